"""The detokenizer's Rust path (tokenizers' DecodeStream) against its Python path: the same text,
token by token, for random ids with special tokens among them, with and without skipping them,
and the Python path taking over where the stream refuses an id."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pagedserve.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.frontend.hub import default_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


def _python_path(tokenizer, prompt: list[int], skip: bool) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    detok._stream = None
    return detok


@pytest.mark.parametrize("skip", [True, False])
def test_stream_matches_python_path(tokenizer, skip):
    rng = random.Random(skip)
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(9)]
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(400)] + [0, 1, 5, 1]
    fast = IncrementalDetokenizer(tokenizer, prompt, skip)
    slow = _python_path(tokenizer, prompt, skip)
    assert fast._stream is not None
    for token_id in ids:
        assert fast.add(token_id) == slow.add(token_id)
    assert fast.text == slow.text and len(fast.text) > 400
    assert fast.ids == slow.ids


def test_unknown_id_and_refusal(tokenizer):
    """An id beyond the vocabulary (a padded LM head's) reads as the Python path reads it; where
    the stream raises (some tokenizers' decoders refuse a prefix), the Python path takes over
    with the text so far intact."""
    ids = tokenizer.encode("def f(x):\n    return x + 1\n", add_special_tokens=False)
    ids = [*ids[:4], tokenizer.vocab_size + 1000, *ids[4:]]
    fast, slow = IncrementalDetokenizer(tokenizer, [], True), _python_path(tokenizer, [], True)
    for n, token_id in enumerate(ids):
        if n == 6:
            fast._stream = _Refusing()
        assert fast.add(token_id) == slow.add(token_id)
    assert fast._stream is None and fast.text == slow.text == tokenizer.decode(ids)


class _Refusing:
    def step(self, tokenizer, token_id):
        raise Exception("Invalid prefix encountered")  # what tokenizers raises

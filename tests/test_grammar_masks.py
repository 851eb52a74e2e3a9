"""The per-step grammar masks (worker/grammar_masks.py) on the embedded model's tokenizer: the
batched accept agrees with one token at a time, a refused token leaves only EOS, the LM head's
padding past the tokenizer is masked, unconstrained rows are untouched, and (GPU) the device
path masks exactly as the CPU one."""

from __future__ import annotations

import pytest
import torch

from pagedserve.frontend.hub import default_model_dir
from pagedserve.ipc.messages import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler
from pagedserve.worker.grammar_masks import GrammarMasks, RowMatcher

PADDED = 4096 + 160  # the embedded tokenizer's 4096 ids in a wider LM head
EOS = 1
SPEC = StructuredOutputs(choice=["yes", "no"])


@pytest.fixture(scope="module")
def compiled():
    compiler = GrammarCompiler(default_model_dir(), PADDED)
    yield compiler.hold(SPEC), compiler.mask_vocab_size
    compiler.close()


def tokens_of(text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    return tok.encode(text, add_special_tokens=False)


def masked_rows(compiled, outputs, device="cpu") -> torch.Tensor:
    """Logits of zeros masked for rows 0 and 2 (constrained) after `outputs`; row 1 is free."""
    grammar, vocab = compiled
    matchers = [RowMatcher(grammar, SPEC, [EOS]), None, RowMatcher(grammar, SPEC, [EOS])]
    masks = GrammarMasks(3, vocab, torch.device(device))
    logits = torch.zeros(3, PADDED, device=device)
    masks.apply(logits, matchers, [outputs, [], outputs])
    return logits.cpu()


def allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits_row > float("-inf"))[:, 0].tolist())


def test_masks_follow_the_grammar_and_the_padding(compiled):
    assert compiled[1] == 4096, "the grammars know only the tokenizer's ids"
    yes = tokens_of("yes")
    first = masked_rows(compiled, [])
    assert yes[0] in allowed(first[0]) and allowed(first[0]) == allowed(first[2])
    assert max(allowed(first[0])) < 4096 and EOS not in allowed(first[0])
    assert allowed(first[1]) == set(range(PADDED)), "an unconstrained row is untouched"
    done = masked_rows(compiled, yes)
    assert allowed(done[0]) == {EOS}, "a finished choice can only end"


def test_batched_accept_equals_one_token_at_a_time(compiled):
    grammar, vocab = compiled
    yes = tokens_of("yes")
    batched, single = RowMatcher(grammar, SPEC, [EOS]), RowMatcher(grammar, SPEC, [EOS])
    masks = GrammarMasks(2, vocab, torch.device("cpu"))
    logits = torch.zeros(2, PADDED)
    for n in range(1, len(yes) + 2):
        out = [*yes, EOS][:n]
        masks._advance([batched], [out])  # one new token: the batched path
        single.catch_up(out)
        assert (batched.num_seen, batched.terminated) == (single.num_seen, single.terminated)
    assert batched.terminated and not batched.active
    masks.apply(logits, [batched, None], [[*yes, EOS], []])
    assert allowed(logits[0]) == set(range(PADDED)), "a finished grammar frees its row"


def test_a_refused_token_leaves_only_eos(compiled):
    refused = tokens_of("maybe")[:1]
    logits = masked_rows(compiled, refused)
    assert allowed(logits[0]) == {EOS} and allowed(logits[2]) == {EOS}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_masks_equal_cpu_masks(compiled):
    for outputs in ([], tokens_of("yes")[:1], tokens_of("maybe")[:1]):
        assert torch.equal(masked_rows(compiled, outputs, "cuda"), masked_rows(compiled, outputs))

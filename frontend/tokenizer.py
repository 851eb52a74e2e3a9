"""Loading the tokenizer and rendering chat templates (client side only)."""

from __future__ import annotations

import json
import os
from typing import Any

from pagedserve.frontend.chat_template import model_chat_template

# Tokenizer classes whose behaviour is all in tokenizer.json (transformers adds nothing in Python).
PLAIN_CLASSES = {None, "TokenizersBackend", "PreTrainedTokenizerFast"}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A `FastTokenizer` when the directory's tokenizer is plain tokenizer.json, else
    transformers' AutoTokenizer (which imports torch: seconds of start-up; with
    `trust_remote_code` it may run the checkpoint's own tokenizer code)."""
    try:
        fast = FastTokenizer.load(path)
        if fast is not None:
            return fast
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # transformers raises many kinds; say what failed and where
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


class FastTokenizer:
    """transformers' fast tokenizer, for the API servers, without transformers' model stack.

    `tokenizers` (what transformers' fast tokenizers run on) encodes and decodes; chat templates
    render with transformers' own jinja renderer. Neither imports torch,
    so an API server is up in well under a second instead of the seconds `import torch` takes.
    Used only where transformers would add nothing to tokenizer.json (see `load`); the methods are
    the subset of transformers' tokenizer API that pagedserve and its users call.
    """

    def __init__(self, tokenizer: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self._tk = tokenizer
        self.special_tokens_map = {
            name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name)
        }
        for name in SPECIAL_TOKENS:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else tokenizer.token_to_id(token))
        self.chat_template = chat_template
        if chat_template is not None:  # the renderer's import (~1 s) at start-up, not in a request
            from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.name_or_path = config.get("name_or_path", "")

    @classmethod
    def load(cls, path: str) -> FastTokenizer | None:
        """None where transformers' class adds behaviour of its own (then use transformers)."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            return None
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        if (
            config.get("tokenizer_class") not in PLAIN_CLASSES
            or "add_bos_token" in config  # transformers rewrites the post-processor for these
            or "add_eos_token" in config
            or "auto_map" in config  # custom code
        ):
            return None
        from tokenizers import Tokenizer

        template = model_chat_template(path, config)
        return cls(Tokenizer.from_file(tokenizer_file), config, template)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """A (query, document) pair as one prompt, with the tokenizer's pair template."""
        return self._tk.encode(text, pair, add_special_tokens=True).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`tokenizers` releases the GIL in encode_batch: a long text tokenized on another
        thread leaves the event loop free."""
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tk.id_to_token(i) for i in ids]

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special added tokens (BOS, EOS, chat markers), as transformers names them."""
        decoder = self._tk.get_added_tokens_decoder()
        return sorted(i for i, token in decoder.items() if token.special)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """transformers' `apply_chat_template` for one conversation (same renderer, context)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            documents=documents,
            chat_template=template,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]


def _content(token: Any) -> str:
    """A special token from tokenizer_config.json: a string, or {"content": ...} (older files)."""
    return token["content"] if isinstance(token, dict) else str(token)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text for a conversation, from the tokenizer's chat template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template")
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **template_kwargs,
    )


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt text. Rendered chat templates already hold BOS: pass False."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompts(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """`encode_prompt` for several texts in one call (one that releases the GIL for a
    FastTokenizer, and for transformers' fast tokenizers, which batch through `tokenizers`)."""
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.encode_batch(texts, add_special_tokens)
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [list(ids) for ids in encoded]


# How a prompt's length in characters bounds its length in tokens, read from tokenizer.json.
# Normalizers: the most input characters one output character can stand for (canonical
# composition joins at most 4 code points into one); a normalizer that can delete characters
# (Strip, StripAccents, BertNormalizer's clean-up, SentencePiece's Precompiled) is not listed.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1,
                      "ByteLevel": 1}  # fmt: skip
# Pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop some; Split and Punctuation do with the behavior "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts"}  # fmt: skip


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of prompt text one token can stand for, or None where no safe bound
    follows from tokenizer.json: a prompt of more than `max_model_len` times this many characters
    cannot fit, whatever it holds, so it is refused without tokenizing it.

    A bound holds when no character can be dropped or fused with others into an unknown token:
    byte-level BPE (every character is bytes the vocabulary holds) or byte fallback, normalizers
    that keep characters, no added token that absorbs the spaces beside it. The longest
    vocabulary entry then bounds a token (in bytes for byte-level BPE, more than characters)."""
    if not isinstance(tokenizer, FastTokenizer):
        return None  # transformers may change the text in Python first
    spec = json.loads(tokenizer._tk.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or spec.get("truncation") or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    model = spec.get("model") or {}
    vocab = tokenizer.get_vocab()
    byte_level = _has_byte_level(spec.get("pre_tokenizer")) and all(c in vocab for c in _BYTE_CHARS)
    byte_fallback = model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if model.get("type") not in ("BPE", "Unigram") or not (byte_level or byte_fallback):
        return None
    return shrink * max(len(token) for token in vocab)


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":  # a plain string replaced by a non-empty one
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content")
        if not pattern or not content:
            return None
        return -(-len(pattern) // len(content))
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for part in spec.get("pretokenizers", []) for p in _pre_tokenizers(part)]
    return [spec]


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    return all(
        p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
        for p in _pre_tokenizers(spec)
    )


def _has_byte_level(spec: dict[str, Any] | None) -> bool:
    return any(p.get("type") == "ByteLevel" for p in _pre_tokenizers(spec))


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table: the 256 characters byte-level BPE spells bytes with."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()

"""Loading the tokenizer and rendering chat templates (client side only)."""

from __future__ import annotations

import json
import os
from typing import Any

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

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(Tokenizer.from_file(tokenizer_file), config, template)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

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

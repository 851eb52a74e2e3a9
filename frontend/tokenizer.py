"""Loading the tokenizer and rendering chat templates (client side only)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; say what failed and where
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


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

"""Chat templates from the operator (`--chat-template`, a file or the template itself) and from
requests (`chat_template`), which run only with `--trust-request-chat-template`, as in vLLM.

A template is code: a request's own template could loop for hours on the server's event loop.
Templates render in transformers' sandboxed jinja (no attribute access to Python internals, ranges
capped), and a request's template is also stopped after `REQUEST_TEMPLATE_TIMEOUT_S`: a trace
function on the rendering thread raises once the deadline passes (jinja compiles templates to
Python, so every loop iteration is a traced line). A single long C-level operation inside one
line is not interrupted; that is why request templates stay off by default.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
REQUEST_TEMPLATE_TIMEOUT_S = 1.0
TRUST_FLAG = "--trust-request-chat-template"


def load_chat_template(value: str) -> str:
    """`--chat-template`: a path to a file, or (holding template syntax or a newline) the
    template itself; anything else is a path that does not exist (an error, not a template)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file (and not a template)")


class TemplateTimeout(Exception):
    pass


def run_bounded(fn: Callable[[], T], seconds: float) -> T:
    """`fn()`, raising TemplateTimeout if it is still running after `seconds`."""
    deadline = time.monotonic() + seconds

    def trace(_frame: Any, _event: str, _arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template took over {seconds:g} s to render")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def request_template(req: Any) -> str | None:
    """The template a request brings (`chat_template`, or inside `chat_template_kwargs`)."""
    kwargs = getattr(req, "chat_template_kwargs", None) or {}
    return req.chat_template if req.chat_template is not None else kwargs.get("chat_template")

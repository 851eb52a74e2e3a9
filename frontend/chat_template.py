"""Chat templates from the operator (`--chat-template`, a file or the template itself) and from
requests (`chat_template`), which run only with `--trust-request-chat-template`, as in vLLM.

A template is code: a request's own template could loop for hours on the server's event loop.
Templates render in transformers' sandboxed jinja (no attribute access to Python internals, ranges
capped), and a request's template is also stopped after `REQUEST_TEMPLATE_TIMEOUT_S`: a trace
function on the rendering thread raises once the deadline passes (jinja compiles templates to
Python, so every loop iteration is a traced line). A single long C-level operation inside one
line is not interrupted; that is why request templates stay off by default.

Tools reach a model only through its template: one that never reads `tools` (SmolLM2's ChatML)
makes `--enable-auto-tool-choice` silently useless, so `launch` warns (`tools_unseen_warning`).
`chat_templates/` ships templates for such models (`shipped_template`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
REQUEST_TEMPLATE_TIMEOUT_S = 1.0
TRUST_FLAG = "--trust-request-chat-template"
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "chat_templates")


def shipped_template(name: str) -> str:
    """The path of a template shipped in `chat_templates/` (e.g. "chatml_tools")."""
    return os.path.join(SHIPPED_DIR, f"{name}.jinja")


def model_chat_template(path: str, config: dict[str, Any] | None = None) -> str | None:
    """A model directory's own template: tokenizer_config.json's `chat_template` (the one named
    "default" in a list of named templates), else chat_template.jinja; None if it has none.
    `config`: tokenizer_config.json already read (None: read it here)."""
    if config is None:
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template


def reads_variable(template: str, name: str) -> bool | None:
    """Whether `template` ever reads the variable `name` (from jinja's syntax tree, so text that
    merely mentions it does not count); None when jinja cannot parse it here (a template using
    transformers' own tags)."""
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return name in meta.find_undeclared_variables(env.parse(template))
    except TemplateSyntaxError:
        return None


def tools_unseen_warning(template: str | None) -> str | None:
    """With `--enable-auto-tool-choice`: the warning to print when the chat template never reads
    `tools`, so the model is never shown them and `auto` cannot call; None when it does."""
    if template is None or reads_variable(template, "tools") is not False:
        return None
    return (
        "warning: --enable-auto-tool-choice is set but the chat template never reads `tools`: "
        "the model is not shown them and will not call them. Pass a template that does, e.g. "
        "--chat-template chatml_tools (shipped: ChatML with Hermes-style tool calls, for "
        "SmolLM2 and other ChatML models)"
    )


def load_chat_template(value: str) -> str:
    """`--chat-template`: a path to a file, the name of a shipped template (`chatml_tools`), or
    (holding template syntax or a newline) the template itself; anything else is a path that
    does not exist (an error, not a template)."""
    candidates = [value] if os.sep in value else [value, shipped_template(value)]
    for path in candidates:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    if any(c in value for c in "{}\n"):
        return value
    names = sorted(n.removesuffix(".jinja") for n in os.listdir(SHIPPED_DIR))
    raise ValueError(
        f"--chat-template {value!r}: no such file, not a template, and not one of the shipped "
        f"templates ({', '.join(names)})"
    )


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

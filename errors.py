"""The errors that cross layers: raised by the EngineCore, its process or the engine clients, and
caught by callers above them (the CLI, the HTTP layer, `LLM` users).

A leaf: it imports nothing from pagedserve, so core/, frontend/ and entrypoints/ all raise and
catch the same classes without importing each other. The engine clients raise these, never an
HTTP error; frontend/openai/ maps each to its status and OpenAI error body.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A worker died or reported an error; the engine cannot go on."""


class StepTimeoutError(EngineDeadError):
    """A step got no result within `step_timeout`: a worker hangs (the transport names it)."""


class EngineOverloadedError(RuntimeError):
    """The core refused a request because its waiting queue is full (`max_waiting`): try later."""

    def __init__(self, max_waiting: int | None) -> None:
        super().__init__(f"the engine's waiting queue is full ({max_waiting} requests)")
        self.max_waiting = max_waiting


class RequestRefusedError(ValueError):
    """The core's gate refused a request (the sender's fault); the message is the core's reason."""

"""What the hook reads of one server-side call before and while vLLM runs it (duck-typed over
vLLM's HarmonyContext and MCP session: no vLLM import).

**Complete before decided.** vLLM's loop asks whether to run ``context.messages[-1]`` after every
generation, also one the token limit cut off (its parser then flushes the unfinished call as a
message) or one ended by another stop token than harmony's ``<|call|>`` (``<|return|>`` completes
a message too). Such a call is not one the model made: it is never run and never put before a
person (:func:`incomplete_reason`). The grammar of a server-side turn ends every call with
``<|call|>`` already; this is the check where no grammar applies, or a limit cut it short.

**A failure is the tool's output.** vLLM's ``call_tool`` lets any exception of the MCP session out
of its loop (a 500 "unhandled errors in a TaskGroup" when the tool server went away), and reads a
tool's error reply (``isError``) as a plain output. The hook turns the first into a failed call
whose message the model sees, and notes the second (:func:`watching_errors`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

#: the attribute on vLLM's HarmonyContext holding how the last generation ended
_END = "_vllm_allowed_tools_end"
#: o200k_harmony's stop tokens other than ``<|call|>``: ``<|return|>``, ``<|endoftext|>`` (a
#: server-side turn's generation stops at one of them right after its call's ``<|call|>``)
AFTER_A_CALL = frozenset({200002, 199999})


def call_token() -> int:
    """Harmony's ``<|call|>`` id (the registry's marker tokens)."""
    from ..formats import wire_format
    return int(dict(wire_format("openai").grammar.marker_tokens)["<|call|>"])


def note_end(context: Any, output: Any) -> None:
    """After ``append_output``: the finish reason and the last token that is not a stop token
    (``<|call|>`` when a call ended as harmony ends one) of a finished generation."""
    completions = getattr(output, "outputs", None) or []
    ids = [t for t in (getattr(completions[0], "token_ids", None) or ()) if t not in AFTER_A_CALL] \
        if completions else []
    previous = getattr(context, _END, None) or {}
    last = ids[-1] if ids else (None if previous.get("finished", True) else previous.get("last"))
    if not getattr(output, "finished", False):
        setattr(context, _END, {"last": last, "finished": False})
        return
    completion = completions[0] if completions else None
    setattr(context, _END, {"last": last, "finished": True,
                            "finish_reason": getattr(completion, "finish_reason", None),
                            "stop_reason": getattr(completion, "stop_reason", None),
                            "flushed": bool(getattr(context, "last_append_flush_status", False))})


def incomplete_reason(context: Any, message: Any, arguments: str) -> tuple[str, str] | None:
    """Why the call about to run is not a complete one (metric reason, text), None when it is:
    the generation ended with ``<|call|>`` (not cut off, not flushed unfinished) and its
    arguments are a JSON object (``python``'s are code: any text)."""
    end = getattr(context, _END, None)
    if end is None or not end.get("finished"):
        return "cut_off", "the call did not finish"
    if end.get("flushed") or end.get("last") != call_token():
        if end.get("finish_reason") == "length":
            return "cut_off", "the call was cut off by the token limit (max_output_tokens)"
        return "not_called", "the call did not end with harmony's <|call|>"
    recipient = getattr(message, "recipient", "") or ""
    if recipient.startswith("python"):
        return None
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "not_json", "the call's arguments are not JSON"
    if not isinstance(parsed, dict):
        return "not_json", "the call's arguments are not a JSON object"
    return None


@contextlib.contextmanager
def watching_errors(context: Any, builtin: str) -> Iterator[list[Any]]:
    """While vLLM runs one call: the replies of the built-in's MCP session (:func:`tool_error`
    when the tool answered with an error), collected into the yielded list."""
    replies: list[Any] = []
    session = (getattr(context, "_tool_sessions", None) or {}).get(builtin)
    original = getattr(session, "call_tool", None)
    if session is None or original is None or not hasattr(session, "__dict__"):
        yield replies
        return

    async def call_tool(*args: Any, **kwargs: Any) -> Any:
        reply = await original(*args, **kwargs)
        replies.append(reply)
        return reply

    had_own = "call_tool" in vars(session)
    session.call_tool = call_tool
    try:
        yield replies
    finally:
        if had_own:
            session.call_tool = original
        else:
            del session.call_tool


def tool_error(reply: Any) -> bool:
    """Whether an MCP ``CallToolResult`` is the tool's error (``is_error``; ``isError`` before the
    mcp package's 2.x)."""
    return bool(getattr(reply, "is_error", None) or getattr(reply, "isError", None))


def failure_text(exc: BaseException) -> str:
    """What the model (and the client's item) is told of a call that raised: the innermost cause
    of an exception group (the MCP session's task group wraps the real error)."""
    leaf: BaseException = exc
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
        leaf = leaf.exceptions[0]
    detail = str(leaf).strip() or "no detail"
    return f"This tool call failed: {type(leaf).__name__}: {detail}"[:500]

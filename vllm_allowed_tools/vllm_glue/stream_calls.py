"""Streamed calls under a policy are the unary parse's calls, released as they complete.

vLLM's streaming tool parsers misread outputs their own unary parser reads fine (a multi-token
delta around DeepSeek's markers, Llama's partial-JSON re-serialization, a marker spelled in
ordinary tokens, an engine-based parser handed each delta alone), so a streamed turn could give
other calls than the same turn unary. Under an allowed-tools policy the wrapper therefore keeps
the whole text itself and sends, as tool-call deltas, what the base parser's unary parse of that
text reads: a call once a call end (the format's ``call_ends``) closes it, and at the end of the
stream whatever else the unary parse reads. The base parser's own streaming still runs, for the
text it releases as content and for its state, but its tool-call deltas are dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from os.path import commonprefix
from dataclasses import dataclass, field
from typing import Any

try:  # vLLM 0.32 / 0.33
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
except ImportError:  # pragma: no cover - older layout
    from vllm.entrypoints.openai.engine.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

logger = logging.getLogger(__name__)


def call_start(text: str, triggers: Sequence[str]) -> int | None:
    """Where the first call starts in ``text``: the first trigger, or a trailing piece of one that
    more text could complete (a trigger cut off by the token limit); None when there is none."""
    found = [index for index in (text.find(trigger) for trigger in triggers) if index != -1]
    if found:
        return min(found)
    pieces = [size for trigger in triggers for size in range(min(len(trigger) - 1, len(text)), 0, -1)
              if text.endswith(trigger[:size])]
    return len(text) - max(pieces) if pieces else None


@dataclass
class UnaryStream:
    """One stream's text and the calls already released from its unary parse, by parse index."""
    ends: tuple[str, ...]
    text: str = ""
    #: the end of the longest prefix already read: a call end seen again sends no second read
    read_upto: int = 0
    released: list[tuple[str, str]] = field(default_factory=list)
    #: the next :meth:`new_calls` reads a prefix (from :meth:`feed`), not the whole text
    prefix_read: bool = False

    def feed(self, delta_text: str) -> str | None:
        """Add ``delta_text``; the text up to the last call end when this delta may have
        completed a call (it holds a call end's last character and a new end is there), else
        None. Reading only then keeps the cost at one unary parse per call, not per delta."""
        self.text += delta_text
        if not delta_text or not any(end[-1] in delta_text for end in self.ends):
            return None
        upto = max((self.text.rfind(end) + len(end) for end in self.ends if end in self.text), default=0)
        if upto <= self.read_upto:
            return None
        self.read_upto = upto
        self.prefix_read = True
        return self.text[:upto]

    def new_calls(self, tool_calls: Sequence[Any]) -> list[DeltaToolCall]:
        """Deltas for the calls of a unary parse not released yet, each whole (name, arguments,
        id) at its parse index; an earlier call that now reads differently cannot be taken back
        (a call end inside a value, where the unary parse misreads too): it is logged."""
        deltas, prefix, self.prefix_read = [], self.prefix_read, False
        for index, call in enumerate(tool_calls):
            read = (call.function.name, call.function.arguments)
            if prefix and index >= len(self.released) and not _json_text(read[1]):
                break   # a lenient parser's read of a call cut at a call end inside a string
            if index < len(self.released):
                if read != self.released[index]:
                    logger.warning("vllm-allowed-tools: streamed call %d was released as %r, the "
                                   "whole text reads %r", index, self.released[index], read)
                continue
            self.released.append(read)
            deltas.append(DeltaToolCall(index=index, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=read[0], arguments=read[1])))
        return deltas


def _json_text(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


def with_calls(delta: DeltaMessage | None, calls: list[DeltaToolCall]) -> DeltaMessage | None:
    """``delta`` with its tool calls (the base parser's streamed ones) replaced by ``calls``."""
    if delta is None:
        return DeltaMessage(tool_calls=calls) if calls else None
    if not calls and not delta.tool_calls:
        return delta
    return delta.model_copy(update={"tool_calls": calls})


@dataclass
class ReleasedStream:
    """What one stream has released under a policy: content only while it comes before the first
    call start (a trailing piece of a trigger waits for more text), and each call's verdict, so a
    call outside the allowlist, or a second one when parallel calls are off, never goes out."""
    seen: str = ""
    sent: int = 0
    verdict: dict[int, bool | None] = field(default_factory=dict)
    renumber: dict[int, int] = field(default_factory=dict)

    def text(self, delta: DeltaMessage | None, current_text: str, triggers: Sequence[str],
             all_call: bool) -> DeltaMessage | None:
        """``delta`` with only the content that comes before the first call start of
        ``current_text`` (the whole text so far, which vLLM does not give an engine-based parser:
        the wrapper's own); ``all_call``: the whole output is call (a required JSON array)."""
        if delta is None or not delta.content:
            return delta
        self.seen += delta.content
        if all_call:
            limit = 0
        else:
            start = call_start(current_text, triggers)
            limit = len(self.seen) if start is None else len(commonprefix([self.seen, current_text[:start]]))
        release = self.seen[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        if release == delta.content:
            return delta
        if not release and not delta.tool_calls and not getattr(delta, "reasoning", None):
            return None
        return delta.model_copy(update={"content": release or None})

    def calls(self, delta: DeltaMessage | None, allowlist: Any, *, final: bool) -> DeltaMessage | None:
        """``delta`` with only the allowed calls, renumbered; ``final``: the end of the stream, where
        a name cut off by the token limit (a piece of an allowed name) is dropped uncounted."""
        from ..metrics import record_violation
        if delta is None or not delta.tool_calls:
            return delta
        kept = []
        for tool_delta in delta.tool_calls:
            name = tool_delta.function.name if tool_delta.function is not None else None
            verdict = self.verdict.get(tool_delta.index)
            if verdict is None and name:
                verdict = allowlist.is_allowed(name)
                if verdict and not allowlist.parallel_tool_calls and self.renumber:
                    verdict = False   # a second call when only one is allowed
                self.verdict[tool_delta.index] = verdict
                if verdict:
                    self.renumber[tool_delta.index] = len(self.renumber)
                elif final and any(allowed.startswith(name) for allowed in allowlist.allowed):
                    logger.info("vllm-allowed-tools: dropped a call cut off in its name (%r)", name)
                else:
                    record_violation("parser")
                    logger.warning("vllm-allowed-tools: dropped streamed call %r", name)
            if verdict:   # unknown identity (None) or disallowed (False) never goes out
                kept.append(tool_delta.model_copy(update={"index": self.renumber[tool_delta.index]}))
        if not kept and not delta.content and not getattr(delta, "reasoning", None):
            return None
        return delta.model_copy(update={"tool_calls": kept})

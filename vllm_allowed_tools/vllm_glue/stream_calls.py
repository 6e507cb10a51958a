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

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

try:  # vLLM 0.32 / 0.33
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
except ImportError:  # pragma: no cover - older layout
    from vllm.entrypoints.openai.engine.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

logger = logging.getLogger(__name__)


@dataclass
class UnaryStream:
    """One stream's text and the calls already released from its unary parse, by parse index."""
    ends: tuple[str, ...]
    text: str = ""
    #: the end of the longest prefix already read: a call end seen again sends no second read
    read_upto: int = 0
    released: list[tuple[str, str]] = field(default_factory=list)

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
        return self.text[:upto]

    def new_calls(self, tool_calls: Sequence[Any]) -> list[DeltaToolCall]:
        """Deltas for the calls of a unary parse not released yet, each whole (name, arguments,
        id) at its parse index; an earlier call that now reads differently cannot be taken back
        (a call end inside a value, where the unary parse misreads too): it is logged."""
        deltas = []
        for index, call in enumerate(tool_calls):
            read = (call.function.name, call.function.arguments)
            if index < len(self.released):
                if read != self.released[index]:
                    logger.warning("vllm-allowed-tools: streamed call %d was released as %r, the "
                                   "whole text reads %r", index, self.released[index], read)
                continue
            self.released.append(read)
            deltas.append(DeltaToolCall(index=index, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=read[0], arguments=read[1])))
        return deltas


def with_calls(delta: DeltaMessage | None, calls: list[DeltaToolCall]) -> DeltaMessage | None:
    """``delta`` with its tool calls (the base parser's streamed ones) replaced by ``calls``."""
    if delta is None:
        return DeltaMessage(tool_calls=calls) if calls else None
    if not calls and not delta.tool_calls:
        return delta
    return delta.model_copy(update={"tool_calls": calls})

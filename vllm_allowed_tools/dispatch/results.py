"""What a dispatched call gives back to the agent loop: a result or a typed error, and either one
turned into the message that answers the call in the Responses or the Chat API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from ..request import ToolIdentity


class CallAnswer:
    """Turns an outcome into the item that answers its call; subclasses say what the model reads."""

    call_id: str | None

    def to_tool_output(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def to_responses_item(self) -> dict[str, Any]:
        """The ``function_call_output`` input item that answers the call (Responses API)."""
        if self.call_id is None:
            raise ValueError("this call has no call_id to answer")
        return {"type": "function_call_output", "call_id": self.call_id,
                "output": self.to_tool_output()}

    def to_chat_message(self) -> dict[str, Any]:
        """The ``role: tool`` message that answers the call (Chat Completions)."""
        if self.call_id is None:
            raise ValueError("this call has no call_id to answer")
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.to_tool_output()}


@dataclass(frozen=True)
class DispatchResult(CallAnswer):
    """A call that passed every check and ran (or was replayed from its idempotency key)."""

    ok: ClassVar[bool] = True

    call_id: str | None
    tool: ToolIdentity
    arguments: dict[str, Any]
    output: Any
    idempotency_key: str | None = None
    replayed: bool = False

    @property
    def name(self) -> str:
        """The flat name (what the model called)."""
        return self.tool.flat_name

    def to_tool_output(self) -> str:
        """The tool result for the model: a string output as is, anything else as JSON."""
        if isinstance(self.output, str):
            return self.output
        return json.dumps(self.output, ensure_ascii=False, default=str)

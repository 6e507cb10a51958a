"""The stream guard for Chat Completions chunks: hold a call until its name is complete, judge it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..metrics import record_violation
from .violations import AllowedToolsViolation, CallFilter, is_call_allowed, refusal


class _ChatCall:
    __slots__ = ("decided", "kind", "name")

    def __init__(self) -> None:
        self.name: list[str] = []
        self.kind = "function"
        self.decided = False


class ChatStreamGuard:
    """Guard a Chat Completions chunk stream (``docs/response-path.md``)."""

    def __init__(self, call_filter: CallFilter, *, source: str = "stream_guard") -> None:
        self.call_filter = call_filter
        self.source = source
        self.terminal = False
        self.violation: AllowedToolsViolation | None = None
        self._calls: dict[tuple[Any, Any], _ChatCall] = {}
        self._held: list[dict[str, Any]] = []
        self._finished = False

    @property
    def holding(self) -> bool:
        """True while chunks are withheld until a call's name is complete."""
        return bool(self._held)

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self.terminal or self._finished:
            return []
        if not isinstance(chunk, dict):
            return self._release([chunk]) if not self._held else self._hold(chunk)
        if "error" in chunk and "choices" not in chunk:   # upstream's own error ends the stream
            failure = self._complete(lambda key: True)
            if failure is not None:
                return failure
            return self._release([chunk])
        complete: set[tuple[Any, Any]] = set()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            c_index = choice.get("index", 0)
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, Mapping) else None
            for position, call in enumerate(calls if isinstance(calls, list) else ()):
                if not isinstance(call, Mapping):
                    continue
                key = (c_index, call.get("index", position))
                state = self._calls.get(key)
                if state is None:
                    # another tool index of this choice starts: earlier ones have their full names
                    complete.update(k for k, s in self._calls.items()
                                    if k[0] == c_index and not s.decided)
                    state = self._calls[key] = _ChatCall()
                kind, piece, arguments = self._delta_parts(call)
                if kind == "custom":
                    state.kind = "custom"
                if piece:
                    state.name.append(piece)
                    if state.decided:     # a name growing after it was judged: judge it again
                        state.decided = False
                        complete.add(key)
                if arguments:
                    complete.add(key)
            if choice.get("finish_reason") is not None:
                complete.update(k for k, s in self._calls.items() if k[0] == c_index and not s.decided)
        failure = self._complete(lambda key: key in complete)
        if failure is not None:
            return failure
        if any(not s.decided for s in self._calls.values()):
            return self._hold(chunk)
        return self._release([chunk])

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended: every name is complete; returns the held chunks, or the error chunk."""
        if self.terminal or self._finished:
            return []
        self._finished = True
        failure = self._complete(lambda key: True)
        if failure is not None:
            return failure
        return self._release([])

    # -- internals

    @staticmethod
    def _delta_parts(call: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
        custom = call.get("custom")
        if call.get("type") == "custom" or (isinstance(custom, Mapping) and "function" not in call):
            body = custom if isinstance(custom, Mapping) else {}
            return "custom", body.get("name"), body.get("input")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            return "function", None, None
        name, arguments = fn.get("name"), fn.get("arguments")
        return ("function", name if isinstance(name, str) else None,
                arguments if isinstance(arguments, str) else None)

    def _complete(self, is_complete) -> list[dict[str, Any]] | None:
        """Judge every undecided call whose name is complete; the failure output if one is refused."""
        for key, state in self._calls.items():
            if state.decided or not is_complete(key):
                continue
            name = "".join(state.name) or None
            if not is_call_allowed(self.call_filter, name, state.kind):
                return self._fail(name, state.kind)
            state.decided = True
        return None

    def _hold(self, chunk: Any) -> list[dict[str, Any]]:
        self._held.append(chunk)
        return []

    def _release(self, tail: list[Any]) -> list[Any]:
        if not self._held:
            return tail
        out, self._held = self._held + tail, []
        return out

    def _fail(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        return self.refuse(refusal(self.call_filter, name, kind, self.source, public_name=False))

    def refuse(self, violation: AllowedToolsViolation) -> list[dict[str, Any]]:
        """End the stream now with ``violation`` (counted under its ``source``): the error chunk.
        :class:`GuardedSSE` uses it for an event it cannot read."""
        if self.terminal:
            return []
        self.violation = violation
        self._held = []
        record_violation(violation.source)
        self.terminal = True   # before the terminal chunk leaves this method
        return [violation.to_openai()]



"""The stream guard for Chat Completions chunks: hold a call until its name is complete, judge it;
judge its arguments (a custom call's input) when the call is complete, and a choice without a call
where one is required. A custom tool's calls, which vLLM streams as function deltas, are turned
into the client's custom deltas first (:mod:`.chat_custom`), so the guard judges what goes out."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..metrics import record_violation
from .chat_custom import ChatCustomStream, UnreadableCustomCall
from .contract import NAMES_ONLY, OutputContract
from .violations import (
    ARGUMENTS_NOT_OBJECT,
    CUSTOM_INPUT_INVALID,
    AllowedToolsViolation,
    ArgumentsRefusal,
    CallFilter,
    arguments_violation,
    record_reason,
    refusal,
    required_violation,
)

Key = tuple[Any, Any]   # (choice index, tool index)


class _ChatCall:
    __slots__ = ("arguments", "decided", "judged", "kind", "name")

    def __init__(self) -> None:
        self.name: list[str] = []
        self.arguments: list[str] = []
        self.kind = "function"
        self.decided = False    # its name was judged
        self.judged = False     # its complete arguments were judged


class _ChatChoice:
    __slots__ = ("called", "finish", "last")

    def __init__(self) -> None:
        self.called = False
        self.finish: Any = None       # its finish_reason, once sent
        self.last: Key | None = None  # the tool index started last (the one a token limit cuts)


class ChatStreamGuard:
    """Guard a Chat Completions chunk stream (``docs/response-path.md``); ``contract``: the turn's
    backstops (a call required, arguments checked when each call is complete)."""

    def __init__(self, call_filter: CallFilter, *, source: str = "stream_guard",
                 contract: OutputContract = NAMES_ONLY, custom_names: Collection[str] = ()) -> None:
        self.call_filter = call_filter
        #: the request's custom tools: their function deltas go out as custom deltas
        self._custom = ChatCustomStream(custom_names) if custom_names else None
        self.contract = contract
        self.source = source
        self.terminal = False
        self.violation: AllowedToolsViolation | None = None
        self._calls: dict[Key, _ChatCall] = {}
        self._choices: dict[Any, _ChatChoice] = {}
        self._held: list[dict[str, Any]] = []
        self._finished = False
        self._upstream_error = False

    @property
    def holding(self) -> bool:
        """True while chunks are withheld until a call's name is complete."""
        return bool(self._held)

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self.terminal or self._finished:
            return []
        if self._custom is not None:
            try:
                chunk = self._custom.feed(chunk)
            except UnreadableCustomCall as exc:
                return self._unreadable_custom(exc)
        return self._feed(chunk)

    def _unreadable_custom(self, exc: UnreadableCustomCall) -> list[dict[str, Any]]:
        return self.refuse(arguments_violation(ArgumentsRefusal(CUSTOM_INPUT_INVALID, exc.detail),
                                               exc.name, self.source, public_name=False))

    def _feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if not isinstance(chunk, dict):
            return self._release([chunk]) if not self._held else self._hold(chunk)
        if "error" in chunk and "choices" not in chunk:   # upstream's own error ends the stream
            failure = self._complete(lambda key: True)
            if failure is not None:
                return failure
            self._upstream_error = True
            return self._release([chunk])
        complete: set[Key] = set()   # names complete
        ended: set[Key] = set()      # calls complete (their arguments too)
        finished: list[Any] = []     # choices this chunk finishes
        for choice in chunk.get("choices") or ():
            if isinstance(choice, Mapping):
                self._read_choice(choice, complete, ended, finished)
        failure = self._complete(lambda key: key in complete) or self._judge(ended) \
            or self._required(finished)
        if failure is not None:
            return failure
        if any(not s.decided for s in self._calls.values()):
            return self._hold(chunk)
        return self._release([chunk])

    def _read_choice(self, choice: Mapping[str, Any], complete: set[Key], ended: set[Key],
                     finished: list[Any]) -> None:
        """Take one choice's deltas in: which names and which calls they complete."""
        c_index = choice.get("index", 0)
        info = self._choices.setdefault(c_index, _ChatChoice())
        delta = choice.get("delta")
        calls = delta.get("tool_calls") if isinstance(delta, Mapping) else None
        for position, call in enumerate(calls if isinstance(calls, list) else ()):
            if not isinstance(call, Mapping):
                continue
            key = (c_index, call.get("index", position))
            state = self._calls.get(key)
            if state is None:
                # another tool index of this choice starts: earlier ones are complete
                earlier = [k for k in self._calls if k[0] == c_index]
                complete.update(k for k in earlier if not self._calls[k].decided)
                ended.update(earlier)
                state = self._calls[key] = _ChatCall()
                info.called, info.last = True, key
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
                state.arguments.append(arguments)
                if state.judged:      # arguments growing after they were judged: again
                    state.judged = False
                    ended.add(key)
        if choice.get("finish_reason") is not None:
            mine = [k for k in self._calls if k[0] == c_index]
            complete.update(k for k in mine if not self._calls[k].decided)
            ended.update(mine)
            info.finish = choice.get("finish_reason")
            finished.append(c_index)

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended: every name is complete; returns the held chunks, or the error chunk."""
        if self.terminal or self._finished:
            return []
        out: list[dict[str, Any]] = []
        if self._custom is not None:
            try:
                for chunk in self._custom.finish():
                    out += self._feed(chunk)
            except UnreadableCustomCall as exc:
                return self._unreadable_custom(exc)
            if self.terminal:
                return out
        self._finished = True
        failure = self._complete(lambda key: True)
        if failure is None and not self._upstream_error:
            failure = self._judge(set(self._calls)) or self._required(
                [c for c, info in self._choices.items() if info.finish is None], at_end=True)
        if failure is not None:
            return failure
        return out + self._release([])

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
            if not self.call_filter.allows(state.kind, name):
                return self._fail(name, state.kind)
            state.decided = True
        return None

    def _judge(self, ended: set[Key]) -> list[dict[str, Any]] | None:
        """Judge the arguments (a custom call's input) of every complete call not judged yet; the
        failure output if one is refused. The last call of a choice cut by the token limit
        (``length``) may be unfinished: arguments that are not one JSON object pass there (strict
        ones still fail), and so does a custom input its grammar would not admit yet."""
        for key, state in self._calls.items():
            if key not in ended or state.judged:
                continue
            name = "".join(state.name) or None
            info = self._choices.get(key[0])
            cut = info is not None and info.finish == "length" and info.last == key
            if state.kind == "custom":
                refused = None if cut else self.contract.input_refusal(name, "".join(state.arguments))
            else:
                refused = self.contract.arguments_refusal(name, "".join(state.arguments))
            if refused is not None and not (cut and refused.reason == ARGUMENTS_NOT_OBJECT):
                return self.refuse(arguments_violation(refused, name, self.source,
                                                       public_name=False))
            state.judged = True
        return None

    def _required(self, finished: list[Any], at_end: bool = False) -> list[dict[str, Any]] | None:
        """The failure output if a choice that ended (``finished``; ``at_end``: the stream ended,
        none seen at all counts too) holds no call on a turn that must call; not when the token
        limit cut it (``length``)."""
        if not self.contract.requires_call():
            return None
        ended = [self._choices[c] for c in finished]
        if any(not info.called and info.finish != "length" for info in ended) \
                or (at_end and not self._choices):
            return self.refuse(required_violation(self.contract.requirement or "", self.source))
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
        record_reason(violation)
        self.terminal = True   # before the terminal chunk leaves this method
        return [violation.to_openai()]



"""Chat Completions custom calls in the client's shape: what vLLM answers as a function call of a
custom tool (the one-string-input function the request path served it as,
:func:`..request.custom_tools.read_custom_tools`) goes out as OpenAI's Chat custom call,
``{"id", "type": "custom", "custom": {"name", "input"}}``, unary and streamed.

The input is the ``input`` field of the call's arguments (``{"input": "..."}``), read as vLLM's
Responses path reads a custom call's (``decode_custom_tool_input``: the field when the arguments are
an object holding a string ``input``, else the arguments' text as it is). Streamed, the input is
decoded from the JSON string as its pieces arrive (a piece ending inside an escape waits for the
rest), so the deltas are a prefix of the final input; whatever the decoding could not stream goes
out with the chunk that ends the call. Arguments whose final input does not continue what was
streamed cannot be answered (:class:`UnreadableCustomCall`, refused by the guard). A call cut by the
token limit keeps the input decoded so far. No vLLM imports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["ChatCustomStream", "UnreadableCustomCall", "custom_input", "restore_completion"]

_INPUT_KEY = "input"
_PREFIX = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_PREFIX_TOKENS = '{"input":"'
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

Key = tuple[Any, Any]   # (choice index, tool index)


class UnreadableCustomCall(Exception):
    """A streamed custom call whose final input does not continue the input already streamed."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(detail)
        self.name = name
        self.detail = detail


def custom_input(arguments: Any, *, cut: bool = False) -> str:
    """The input of a custom call whose arguments are ``arguments`` (vLLM's reading: the string
    ``input`` of an arguments object, else the text as it is); ``cut``: the token limit ended the
    call, so arguments that do not parse give the input decoded so far."""
    text = arguments if isinstance(arguments, str) else ""
    try:
        value = json.loads(text)
    except ValueError:
        if cut:
            decoder = InputDecoder()
            return decoder.feed(text)
        return text
    payload = value.get(_INPUT_KEY) if isinstance(value, dict) else None
    return payload if isinstance(payload, str) else text


class InputDecoder:
    """The ``input`` string of ``{"input": "..."}`` decoded as the arguments' text arrives."""

    __slots__ = ("pending", "raw", "state")

    def __init__(self) -> None:
        self.raw = ""           # every piece fed
        self.pending = ""       # fed, not decoded yet
        self.state = "prefix"   # prefix | string | after | hold (not the expected shape: wait)

    def feed(self, text: str) -> str:
        """The input text ``text`` completes (may be empty)."""
        self.raw += text
        if self.state in ("after", "hold"):
            return ""
        self.pending += text
        if self.state == "prefix":
            match = _PREFIX.match(self.pending)
            if match is None:
                if not _PREFIX_TOKENS.startswith(re.sub(r"\s+", "", self.pending)):
                    self.state, self.pending = "hold", ""
                return ""
            self.pending, self.state = self.pending[match.end():], "string"
        out: list[str] = []
        text, i = self.pending, 0
        while i < len(text):
            char = text[i]
            if char == '"':
                self.state, i = "after", len(text)
                break
            if char != "\\":
                out.append(char)
                i += 1
                continue
            if i + 1 >= len(text):
                break   # the escape's next character is still to come
            escape = text[i + 1]
            if escape in _ESCAPES:
                out.append(_ESCAPES[escape])
                i += 2
                continue
            if escape != "u":
                self.state, i = "hold", len(text)   # not JSON: the final reading decides
                break
            decoded, used = _unicode_escape(text, i)
            if used == 0:
                break   # incomplete: wait for the rest
            if used < 0:
                self.state, i = "hold", len(text)
                break
            out.append(decoded)
            i += used
        self.pending = text[i:] if self.state == "string" else ""
        return "".join(out)


def _unicode_escape(text: str, i: int) -> tuple[str, int]:
    """The character of the ``\\uXXXX`` escape at ``i`` (a surrogate pair as one) and the length
    read; 0: incomplete, -1: not an escape JSON allows."""
    if i + 6 > len(text):
        return "", 0
    try:
        code = int(text[i + 2:i + 6], 16)
    except ValueError:
        return "", -1
    if not 0xD800 <= code < 0xDC00:
        return chr(code), 6
    if i + 12 > len(text):
        return "", 0
    if text[i + 6:i + 8] != "\\u":
        return chr(code), 6   # a lone surrogate, as json.loads reads it
    try:
        low = int(text[i + 8:i + 12], 16)
    except ValueError:
        return "", -1
    if not 0xDC00 <= low < 0xE000:
        return chr(code), 6
    return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12


def _function_name(call: Mapping[str, Any]) -> str | None:
    function = call.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


# ------------------------------------------------------------------------------------------ unary

def restore_completion(body: Any, names: Collection[str]) -> None:
    """Each ``choices[].message.tool_calls`` entry that calls one of the custom tools ``names``
    (in place) as the client's Chat custom call; the last call of a choice the token limit cut
    keeps the input decoded so far."""
    choices = body.get("choices") if isinstance(body, dict) and names else None
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            continue
        cut = choice.get("finish_reason") == "length"
        for position, call in enumerate(calls):
            if not isinstance(call, dict) or _function_name(call) not in names:
                continue
            function = call["function"]
            calls[position] = {**{key: value for key, value in call.items()
                                  if key not in ("type", "function")},
                               "type": "custom",
                               "custom": {"name": function["name"],
                                          "input": custom_input(function.get("arguments"),
                                                                cut=cut and position == len(calls) - 1)}}


# ---------------------------------------------------------------------------------------- streamed

class _StreamedCall:
    __slots__ = ("decoder", "name", "sent")

    def __init__(self, name: str) -> None:
        self.name = name
        self.decoder = InputDecoder()
        self.sent: list[str] = []

    def delta(self, call: Mapping[str, Any], first: bool) -> dict[str, Any]:
        """One function delta of this call as a custom delta."""
        out = {key: value for key, value in call.items() if key not in ("type", "function")}
        if first or call.get("type") is not None:
            out["type"] = "custom"
        custom: dict[str, Any] = {}
        if first:
            custom["name"] = self.name
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(arguments, str):
            piece = self.decoder.feed(arguments)
            self.sent.append(piece)
            if piece or first:
                custom["input"] = piece
        elif first:
            custom["input"] = ""
        out["custom"] = custom
        return out

    def rest(self, cut: bool) -> str:
        """What of the final input is still to go out; raises UnreadableCustomCall when the final
        input does not continue what was streamed."""
        final = custom_input(self.decoder.raw, cut=cut)
        sent = "".join(self.sent)
        if not final.startswith(sent):
            raise UnreadableCustomCall(self.name, "the call's arguments are not one JSON object "
                                                  "holding a string `input` (what was streamed of "
                                                  "its input is not the final input's beginning)")
        self.sent.append(final[len(sent):])
        return final[len(sent):]


class ChatCustomStream:
    """Turns a Chat chunk stream's function deltas of the custom tools ``names`` into custom
    deltas (``feed`` each chunk, ``finish`` at the end); chunks that change are new objects."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = frozenset(names)
        self._calls: dict[Key, _StreamedCall | None] = {}   # None: a function call
        self._open: dict[Key, _StreamedCall] = {}           # custom calls not ended yet
        self._last: dict[str, Any] = {}                      # the last chunk's fields but choices
        self._latest: dict[Any, Key] = {}                    # choice index -> its last call started

    def feed(self, chunk: Any) -> Any:
        """The chunk as the client gets it (itself when nothing changed)."""
        if not self.names or not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return chunk
        self._last = {key: value for key, value in chunk.items() if key not in ("choices", "usage")}
        choices, changed = [], False
        for choice in chunk["choices"]:
            new = self._choice(choice) if isinstance(choice, Mapping) else choice
            changed = changed or new is not choice
            choices.append(new)
        return {**chunk, "choices": choices} if changed else chunk

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended: a chunk with what the open custom calls still have to send, if any."""
        ends: dict[Any, list[dict[str, Any]]] = {}
        for key in list(self._open):
            rest = self._open.pop(key).rest(cut=False)
            if rest:
                ends.setdefault(key[0], []).append({"index": key[1], "custom": {"input": rest}})
        return [{**self._last, "choices": [{"index": c, "delta": {"tool_calls": calls},
                                            "finish_reason": None} for c, calls in ends.items()]}] \
            if ends else []

    def _choice(self, choice: Mapping[str, Any]) -> Mapping[str, Any]:
        c_index = choice.get("index", 0)
        delta = choice.get("delta")
        calls = delta.get("tool_calls") if isinstance(delta, Mapping) else None
        out_calls: list[Any] = []
        changed = False
        ending: list[Key] = []
        for position, call in enumerate(calls if isinstance(calls, list) else ()):
            if not isinstance(call, Mapping):
                out_calls.append(call)
                continue
            key = (c_index, call.get("index", position))
            first = key not in self._calls
            if first:   # another call of this choice starts: the earlier ones are complete
                self._latest[c_index] = key
                ending += [k for k in self._open if k[0] == c_index and k not in ending]
                name = _function_name(call)
                self._calls[key] = _StreamedCall(name) if name in self.names else None
                if self._calls[key] is not None:
                    self._open[key] = self._calls[key]   # type: ignore[assignment]
            state = self._calls[key]
            if state is None:
                out_calls.append(call)
                continue
            out_calls.append(state.delta(call, first))
            changed = True
        if choice.get("finish_reason") is not None:
            ending += [k for k in self._open if k[0] == c_index and k not in ending]
        cut = choice.get("finish_reason") == "length"
        for key in ending:
            state = self._open.pop(key)
            rest = state.rest(cut=cut and key == self._latest.get(c_index))
            if not rest:
                continue
            changed = True
            merged = next((item for item in out_calls if isinstance(item, dict)
                           and item.get("index") == key[1] and "custom" in item), None)
            if merged is not None:
                merged["custom"] = {**merged["custom"],
                                    "input": merged["custom"].get("input", "") + rest}
            else:
                out_calls.append({"index": key[1], "custom": {"input": rest}})
        if not changed:
            return choice
        return {**choice, "delta": {**(delta if isinstance(delta, Mapping) else {}),
                                    "tool_calls": out_calls}}

"""A guarded stream over raw SSE bytes: each event is parsed once, judged, and sent on.

Events nobody rewrote keep their exact bytes, so a stream of allowed calls passes byte for byte.
The rules (framing, unreadable events, the trailing partial event) are in ``docs/response-path.md``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .chat_guard import ChatStreamGuard
from .responses_guard import ResponsesStreamGuard
from .responses_stream import Request, ResponsesStream, run_in_threads, run_sync
from .sse import SSEEvent, SSEFramer
from .violations import unreadable_violation

_DONE = b"data: [DONE]\n\n"

Chunk = Generator[Request, Any, bytes]   # a step's requests, then the bytes to send


class GuardedSSE:
    """Run a guard (or a whole :class:`ResponsesStream`) over raw SSE bytes in any chunking.

    ``feed(chunk) -> bytes`` to send now; ``close() -> bytes`` when upstream ended; ``terminal``
    once the stream was ended early (stop reading upstream then and close it). ``feed_async`` /
    ``close_async`` do the same and answer a step's requests (grant-store decisions) in worker
    threads. For a Chat stream a violation sends the error chunk followed by ``data: [DONE]``.
    """

    def __init__(self, guard: ResponsesStreamGuard | ChatStreamGuard | ResponsesStream) -> None:
        self._chat = guard if isinstance(guard, ChatStreamGuard) else None
        self._stream = guard.stream if isinstance(guard, ResponsesStreamGuard) else (
            None if self._chat is not None else guard)
        self.guard = guard
        self._ends: Any = self._chat if self._chat is not None else self._stream   # has `terminal`
        self._framer = SSEFramer()
        self._raw: dict[int, tuple[Any, bytes]] = {}   # id(fed data) -> (data, its bytes), unsent
        self._closed = False

    @property
    def terminal(self) -> bool:
        return self._ends.terminal

    @property
    def violation(self) -> Any:
        """Why the stream ended early (a violation, or the error a step failed on), else None."""
        return self._chat.violation if self._chat is not None else self._stream.error

    def feed(self, chunk: bytes) -> bytes:
        events = self._framed(chunk)
        return run_sync(self._take(events)) if events else b""

    def close(self) -> bytes:
        """Upstream ended: what is still to send (held events, a trailing partial event)."""
        return run_sync(self._close())

    async def feed_async(self, chunk: bytes) -> bytes:
        events = self._framed(chunk)
        return await run_in_threads(self._take(events)) if events else b""

    async def close_async(self) -> bytes:
        return await run_in_threads(self._close())

    def refuse(self, violation: Any) -> bytes:
        """End the stream now with ``violation`` (counted): the closing events, as bytes."""
        out: list[bytes] = []
        if not self._closed:
            self._end(violation, out)
        return b"".join(out)

    # -- internals

    def _framed(self, chunk: bytes) -> list[SSEEvent]:
        if self._ends.terminal or self._closed:
            return []
        return self._framer.feed(chunk)

    def _close(self) -> Chunk:
        if self._closed:
            return b""
        self._closed = True
        if self.terminal:
            return b""
        out = yield from self._take(self._framer.close())    # events only the end completes
        if not self.terminal:
            finished = self._chat.finish() if self._chat is not None else (
                yield from self._stream.finish())
            out += self._bytes(finished)
        self._framer.flush()   # a partial event: never dispatched by a client, never forwarded
        return out

    def _take(self, events: list[SSEEvent]) -> Chunk:
        out: list[bytes] = []
        for event in events:
            if self.terminal:
                break
            if event.data is None:   # comments, keep-alives: a client dispatches nothing
                out.append(event.raw)
                continue
            if event.data == "[DONE]":
                finished = self._chat.finish() if self._chat is not None else (
                    yield from self._stream.finish())
                self._emit(finished, out)
                if not self.terminal:
                    out.append(event.raw)
                continue
            data = event.json()
            if not isinstance(data, dict):
                self._end(unreadable_violation("a stream event whose data is not a JSON object"),
                          out)
                break
            self._raw[id(data)] = (data, event.raw)
            items = self._chat.feed(data) if self._chat is not None else (
                yield from self._stream.process(data))
            self._emit(items, out)
            if not self._holding():
                self._raw.clear()
        return b"".join(out)

    def _bytes(self, items: list[Any]) -> bytes:
        out: list[bytes] = []
        self._emit(items, out)
        return b"".join(out)

    def _end(self, violation: Any, out: list[bytes]) -> None:
        self._emit(self._chat.refuse(violation) if self._chat is not None
                   else self._stream.terminate(violation), out)

    def _holding(self) -> bool:
        return self._chat.holding if self._chat is not None else self._stream.holding

    def _emit(self, items: list[Any], out: list[bytes]) -> None:
        for item in items:
            known = self._raw.pop(id(item), None)
            if known is not None and known[0] is item:
                out.append(known[1])
            else:
                name = item.get("type") if self._chat is None and isinstance(item, dict) else None
                out.append(SSEEvent.encode(item, name))
        if self.terminal:
            self._raw.clear()
            if self._chat is not None:
                out.append(_DONE)

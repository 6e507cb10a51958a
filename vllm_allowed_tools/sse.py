"""Incremental Server-Sent-Events framing: bytes in any chunking -> whole events -> bytes.

Pure and byte-exact: an event that nobody rewrites is re-emitted exactly as it arrived, so a
passthrough over any chunking of a stream reproduces the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class SSEEvent:
    raw: bytes                      # the event as received, including its blank-line terminator
    event: str | None = None        # the `event:` field, if any
    data: str | None = None         # the `data:` field(s), joined with "\n"

    def json(self) -> Any:
        """The data as JSON, or None when it is absent, `[DONE]` or not JSON."""
        if self.data is None or self.data == "[DONE]":
            return None
        try:
            return json.loads(self.data)
        except ValueError:
            return None

    @staticmethod
    def encode(data: Any, event: str | None = None) -> bytes:
        payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        head = f"event: {event}\n" if event else ""
        return f"{head}data: {payload}\n\n".encode()


def _parse(raw: bytes) -> SSEEvent:
    event, data = None, []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return SSEEvent(raw=raw, event=event, data="\n".join(data) if data else None)


class SSEFramer:
    """Feed chunks, get complete events; :meth:`flush` returns a trailing partial event's bytes."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        events = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end == -1:
                return events
            raw, self._buffer = self._buffer[:end + 2], self._buffer[end + 2:]
            events.append(_parse(raw))

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

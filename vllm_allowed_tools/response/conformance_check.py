"""The Open Responses check mode: a running server validates every Responses object and event it
sends, after all its rewriting (the e2e suite turns it on for every server it starts), so a
conformance regression anywhere on the response path fails the suite."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..settings import Settings
from .conformance import TERMINAL_TYPES, check_event, check_response

#: a file path: every outgoing Responses object and event is validated after all rewriting, one
#: JSON line each (``problems`` empty when it conforms) appended to that file
CHECK_LOG_ENV = Settings.variable("conformance_log")


class CheckLog:
    """Appends one JSON line per validated object or event: ``{"kind", "type", "problems",
    "pid"}``. Lines are written with one ``write`` in append mode, so several servers may share a
    file."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_settings(cls, settings: Settings) -> CheckLog | None:
        """The check log the settings name (:data:`CHECK_LOG_ENV`); None: check mode is off."""
        path = settings.conformance_log
        return cls(str(path)) if path is not None else None

    def record(self, kind: str, name: Any, problems: list[str]) -> None:
        line = json.dumps({"kind": kind, "type": name, "problems": problems, "pid": os.getpid()})
        with open(self.path, "a", encoding="utf-8") as log:
            log.write(line + "\n")

    def unary(self, body: bytes) -> None:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, Mapping) and "object" not in data and "token_ids" in data:
            return   # a render endpoint's answer (the prompt's tokens), not a Responses object
        self.record("object", "response", check_response(data))

    def stream(self) -> StreamCheck:
        return StreamCheck(self)


class StreamCheck:
    """The events of one outgoing stream, as a client frames them: each validated, and the
    stream's end checked (exactly one terminal event, last)."""

    def __init__(self, log: CheckLog) -> None:
        from .sse import SSEFramer
        self._log = log
        self._framer = SSEFramer()
        self._last: Any = None
        self._terminals = 0

    def feed(self, chunk: bytes) -> None:
        for frame in self._framer.feed(chunk):
            if frame.data is None or frame.data == "[DONE]":
                continue
            event = frame.json()
            problems = check_event(event)
            name = event.get("type") if isinstance(event, Mapping) else None
            if frame.event not in (None, name):
                problems.append(f"(sse): event name {frame.event!r} differs from type {name!r}")
            if name in TERMINAL_TYPES:
                self._terminals += 1
            self._last = name
            self._log.record("event", name, problems)

    def close(self) -> None:
        """The stream ended as the server meant it (not at a client that left)."""
        self.feed(b"")
        if self._last is not None and (self._last not in TERMINAL_TYPES or self._terminals != 1):
            self._log.record("stream", self._last, [
                f"stream: {self._terminals} terminal events, the last event is {self._last!r} "
                "(expected exactly one terminal event, last)"])


def read_check_log(path: str | Path, *, exclude_pid: int | None = None,
                   exclude_pids: Iterable[int] = ()) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """(how many of each kind were validated, the records with problems) of a check-mode file;
    ``exclude_pid`` / ``exclude_pids``: records these processes wrote are left out (test
    processes' own fakes: the test session and its parallel workers)."""
    excluded = {*exclude_pids, *(() if exclude_pid is None else (exclude_pid,))}
    counts: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    file = Path(path)
    for line in file.read_text(encoding="utf-8").splitlines() if file.exists() else ():
        record = json.loads(line)
        if record.get("pid") in excluded:
            continue
        counts[record["kind"]] = counts.get(record["kind"], 0) + 1
        if record["problems"]:
            failures.append(record)
    return counts, failures

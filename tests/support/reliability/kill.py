"""The server SIGKILLed while approvals are answered, then restarted on the same SQLite store:
every grant the client was told about must be there and usable, and the store intact."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .approval_client import (
    GATED_TOOL,
    accept_input,
    ask,
    ask_until_called,
    elicitation_of,
    gated_body,
    made_no_call,
    post_approval,
)
from .report import Figures
from .wire import REQUEST_TIMEOUT, log


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(child) for task in tasks
                for child in (task / "children").read_text().split()]
    except OSError:
        return []


def kill_server_hard(cli_pid: int) -> None:
    """SIGKILL the server's process group (API server, engine core, workers: all at once), then
    the `serve-tiny` process that started it: no shutdown code runs anywhere."""
    own = os.getpgid(0)
    for child in _children(cli_pid):
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(child)
            if group != own:
                os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(cli_pid, signal.SIGKILL)


def store_check(db: Path) -> tuple[bool, dict[str, str]]:
    """(integrity and foreign keys ok, origin elicitation id -> grant id) of a SQLite store,
    read with a plain sqlite3 connection as any tool would."""
    import sqlite3
    conn = sqlite3.connect(db)
    try:
        ok = conn.execute("PRAGMA integrity_check").fetchone() == ("ok",) and \
            conn.execute("PRAGMA foreign_key_check").fetchall() == []
        grants = dict(conn.execute("SELECT origin_elicitation_id, id FROM grants "
                                   "WHERE revoked_at IS NULL"))
        return ok, grants
    finally:
        conn.close()


@dataclass
class _Traffic:
    """Approval flows shared by the client threads of one kill cycle."""
    base_url: str
    cycle: int
    figures: Figures
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    acknowledged: list[tuple[str, str, str]] = field(default_factory=list)

    def flow(self, worker: int) -> None:
        """ask -> elicitation -> accept `session` -> released call, until stopped or cut."""
        c = self.figures.counts
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                session = f"kill-{self.cycle}-{worker}-{n}-{uuid.uuid4().hex[:6]}"
                asked = ask(client, self.base_url, session)
                with self.lock:
                    c["kill_requests"] += 1
                item = elicitation_of(asked)
                if item is None and made_no_call(asked):
                    with self.lock:
                        c["kill_asks_without_call"] += 1
                    continue
                if item is None:
                    if not self.stop.is_set():
                        self.figures.problems.append(f"kill: ask failed before the kill: "
                                                     f"{asked.status} {asked.error}")
                    return
                if not self._accept(client, session, item):
                    return

    def _accept(self, client: httpx.Client, session: str, item: dict) -> bool:
        """Answer `item` with accept; False when this flow must end."""
        c = self.figures.counts
        with self.lock:
            self.in_flight += 1
        answer = post_approval(client, self.base_url, "responses", gated_body(
            session, *accept_input(item, f"er_{session}")))
        with self.lock:
            self.in_flight -= 1
            c["kill_requests"] += 1
            c["kill_answers_sent"] += 1
        calls = [(i.get("type"), i.get("call_id")) for i in answer.items]
        if answer.status == 200 and calls == [("function_call", item["call_id"])]:
            with self.lock:
                self.acknowledged.append((item["id"], session, item["call_id"]))
            return True
        if answer.status is None:
            with self.lock:
                c["kill_answers_cut"] += 1   # in flight at the kill: the client was not told
            return False
        self.figures.problems.append(f"kill: accept got {answer.status} {answer.error}")
        return False


def _traffic_then_kill(base_url: str, pid: int, cycle: int, kill_after: int, workers: int,
                       figures: Figures) -> list[tuple[str, str, str]]:
    """Approval flows from `workers` threads until `kill_after` grants were acknowledged and an
    answer is in flight, then SIGKILL; returns the acknowledged (elicitation id, session, call id)."""
    traffic = _Traffic(base_url, cycle, figures)
    threads = [threading.Thread(target=traffic.flow, args=(w,), daemon=True)
               for w in range(workers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(traffic.acknowledged) < kill_after \
            and any(t.is_alive() for t in threads):
        time.sleep(0.02)
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        with traffic.lock:
            if traffic.in_flight:   # an answer (a grant write) is in the server right now
                break
        time.sleep(0.001)
    with traffic.lock:
        figures.counts["kill_answers_in_flight_at_kill"] += traffic.in_flight
    kill_server_hard(pid)
    traffic.stop.set()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT)
    with traffic.lock:   # every answer the client received before the kill
        return list(traffic.acknowledged)


def _check_grants(base_url: str, acknowledged: list[tuple[str, str, str]],
                  grants: dict[str, str], figures: Figures) -> None:
    """Every acknowledged grant found in the store and releasing the next call of its session."""
    c = figures.counts
    found = [entry for entry in acknowledged if entry[0] in grants]
    c["grants_acknowledged"] = len(acknowledged)
    c["grants_found_after_restart"] = len(found)
    c["grants_lost"] = len(acknowledged) - len(found)
    c["grants_found_not_acknowledged"] = len(grants) - len(found)
    if c["grants_lost"]:
        figures.problems.append(f"kill: {c['grants_lost']} acknowledged grants lost")
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        for eid, session, _ in acknowledged:
            answer = ask_until_called(client, base_url, session, sent=c)
            kinds = [i.get("type") for i in answer.items]
            usable = answer.status == 200 and kinds == ["function_call"] and \
                answer.items[0].get("name") == GATED_TOOL
            c["grants_usable_after_restart"] += usable
            if not usable:
                figures.problems.append(f"kill: grant of {eid} not usable: {answer.status} "
                                        f"{kinds} {answer.error}")


def run_kill(start: Callable[[], tuple[str, int, Callable[[], None]]], db: Path, *,
             kill_after: int, workers: int = 4, cycles: int = 1,
             figures: Figures | None = None) -> Figures:
    """`cycles` times: approval flows (ask -> elicitation -> accept `session` -> released call)
    from `workers` threads, each in its own session; once `kill_after` grants were acknowledged
    and an answer is in flight, SIGKILL the server; restart it on the same store; check every
    acknowledged grant is there and releases the next call of its session without asking.
    `start()` returns (base_url, serve-tiny pid, cleanup); cleanup must be idempotent."""
    figures = figures or Figures()
    c = figures.counts
    acknowledged: list[tuple[str, str, str]] = []     # (elicitation id, session, call id)
    grants: dict[str, str] = {}
    base_url, pid, cleanup = start()
    started = time.monotonic()
    try:
        for cycle in range(cycles):
            told = _traffic_then_kill(base_url, pid, cycle, kill_after, workers, figures)
            cleanup()
            c["kills"] += 1
            acknowledged += told
            log(f"kill {cycle + 1}: {len(told)} grants acknowledged; restarting on the same store")
            base_url, pid, cleanup = start()
            ok, grants = store_check(db)
            c["store_integrity_failures"] += not ok
            if not ok:
                figures.problems.append("kill: the store failed its integrity/foreign-key check")
        _check_grants(base_url, acknowledged, grants, figures)
    finally:
        cleanup()
    figures.extra["kill_seconds"] = round(time.monotonic() - started, 1)
    return figures

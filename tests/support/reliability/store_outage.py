"""The grant store unavailable while the server runs: gated turns and elicitation answers must be
refused as store-down and never release the gated call, turns without a gated tool keep working,
and the server recovers by itself when the store is back."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .approval_client import (
    Answer,
    accept_input,
    ask,
    ask_until_called,
    elicitation_of,
    free_body,
    gated_body,
    post_approval,
)
from .report import Figures
from .wire import REQUEST_TIMEOUT


@contextlib.contextmanager
def sqlite_folder_gone(db: Path):
    """The store's folder moved away (an unmounted volume), then put back."""
    folder = db.parent
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    try:
        yield
    finally:
        away.rename(folder)


@contextlib.contextmanager
def postgres_stopped(pg: Any):
    """The PostgreSQL server stopped (clients disconnected), then started again."""
    pg.stop()
    try:
        yield
    finally:
        pg.restart()


def is_store_error(error: Any) -> bool:
    """The error the client must get while the store is down: code, and a message that says what
    happened and what to do."""
    return isinstance(error, dict) and error.get("code") == "grant_store_unavailable" \
        and "grant store" in str(error.get("message")) and "Retry" in str(error.get("message"))


def _record(figures: Figures, label: str, kind: str, answer: Answer) -> None:
    """Count one request sent during the outage, and say what was wrong with its answer."""
    c = figures.counts
    c[f"{label}:tried"] += 1
    c["outage_tried"] += 1
    status = answer.status
    bucket = "no_answer" if status is None else f"{status // 100}xx"
    c[f"outage_{bucket}"] += 1
    c["gated_leaked"] += answer.leaked
    store_refusal = (status == 503 and is_store_error(answer.error)) or (
        status == 200 and kind == "gated_stream" and is_store_error(answer.error))
    if store_refusal:
        c["outage_refused_store_down"] += 1
        c[f"{label}:refused"] += 1
    elif status is not None and status >= 500:
        c["outage_5xx_other"] += 1
    if kind.startswith("free"):
        ok = status == 200 and answer.error is None
        c["outage_free_ok"] += ok
        if not ok:
            figures.problems.append(f"{label}: {kind} failed: {status} {answer.error} "
                                    f"{answer.transport_error or ''}")
    elif kind.startswith("gated") and status == 200 and answer.error is None and \
            not answer.leaked and not any(i.get("type") in ("function_call", "elicitation")
                                          for i in answer.items):
        c["outage_gated_without_call"] += 1   # the model made no call: nothing to decide
    elif not store_refusal:
        figures.problems.append(f"{label}: {kind} not refused as store-down: {status} "
                                f"{answer.error} {[i.get('type') for i in answer.items]} "
                                f"{answer.transport_error or ''}")
    if answer.leaked:
        figures.problems.append(f"{label}: {kind} leaked {answer.leaked} gated call(s)")


def _outage_round(client: httpx.Client, base_url: str, tag: str, round_: int, answer_body: dict,
                  record: Callable[[str, Answer], None]) -> None:
    """Six requests: a gated turn unary and streamed, the answer to an elicitation, and three
    turns that cannot call the gated tool."""
    record("gated_unary", ask(client, base_url, f"{tag}-u{round_}"))
    record("gated_stream", post_approval(client, base_url, "responses", gated_body(
        f"{tag}-s{round_}", stream=True)))
    record("answer", post_approval(client, base_url, "responses", answer_body))
    record("free_responses", post_approval(client, base_url, "responses", free_body("responses")))
    record("free_responses_stream", post_approval(
        client, base_url, "responses", free_body("responses", stream=True)))
    record("free_chat", post_approval(client, base_url, "chat", free_body("chat")))


def run_store_outage(base_url: str, fault: Callable[[], Any], label: str, rounds: int,
                     figures: Figures | None = None) -> Figures:
    """One outage (`fault()` is a context manager: the store is down inside it). Each round
    sends, during the outage: a gated turn unary and streamed, the answer (accept) to an
    elicitation asked before the outage, and three turns that cannot call the gated tool (Responses
    unary and streamed, Chat). Then checks recovery."""
    figures = figures or Figures()
    c = figures.counts
    tag = f"{label}-{uuid.uuid4().hex[:8]}"
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        before = elicitation_of(ask_until_called(client, base_url, f"{tag}-pending"))
        if before is None:
            figures.problems.append(f"{label}: the store did not work before the fault")
            return figures
        answer_body = gated_body(f"{tag}-pending", *accept_input(before, f"er_{tag}"))
        with fault():
            for round_ in range(rounds):
                _outage_round(client, base_url, tag, round_, answer_body,
                              lambda kind, answer: _record(figures, label, kind, answer))
            healthy = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30)
            if healthy.status_code != 200:
                figures.problems.append(f"{label}: /health {healthy.status_code} during the outage")
        # recovered: asking works again, and the answer refused during the outage now releases
        # exactly the call asked about before it
        after = elicitation_of(ask_until_called(client, base_url, f"{tag}-after"))
        released = post_approval(client, base_url, "responses", answer_body)
        calls = [(i.get("type"), i.get("call_id")) for i in released.items]
        recovered = after is not None and released.status == 200 and \
            calls == [("function_call", before["call_id"])]
        c["outage_recovered"] += recovered
        c["outages"] += 1
        if not recovered:
            figures.problems.append(f"{label}: no recovery: ask {after is not None}, answer "
                                    f"{released.status} {calls} {released.error}")
    return figures

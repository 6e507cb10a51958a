"""Grant-store faults on the real server, at CI size; the same code as ``benchmarks/reliability.py``
runs (tests/support/reliability/: its store-outage and kill parts), one JSON line
of figures each.

* The store unavailable while the server runs: SQLite (its folder moved away; its write lock held
  by another process past the busy timeout) and PostgreSQL (the server stopped; skipped without
  the server binaries). Gated turns get 503 ``grant_store_unavailable`` (a started stream: one
  ``response.failed`` with that code), never the gated call; turns that cannot call a gated tool keep
  working; the server stays up and recovers when the store is back.
* The API server's process group SIGKILLed while approvals are being answered: every grant the
  client was told about is in the store after a restart on it, and usable; the store is intact.

Sizes: ``VLLM_ALLOWED_TOOLS_OUTAGE_ROUNDS`` (default 2 rounds of 6 requests per fault),
``VLLM_ALLOWED_TOOLS_KILL_AFTER`` (default 8 acknowledged grants before the kill).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


from support import reliability as rel
from support.servers import start_cli_server, stop_cli_server
from support.store_faults import sqlite_locked

pytestmark = pytest.mark.server

ROUNDS = int(os.environ.get("VLLM_ALLOWED_TOOLS_OUTAGE_ROUNDS", "2"))
KILL_AFTER = int(os.environ.get("VLLM_ALLOWED_TOOLS_KILL_AFTER", "8"))


def _print(name: str, figures) -> None:
    print(json.dumps({"reliability": name, **figures.as_dict()}, sort_keys=True, default=str))


def _check_outage(figures, outages: int) -> None:
    c = figures.counts
    assert not figures.problems, figures.problems[:5]
    assert c["gated_leaked"] == 0
    assert c["outage_5xx_other"] == 0 and c["outage_4xx"] == 0 and c["outage_no_answer"] == 0
    # every gated request and answer was refused as store-down (or, for a turn in which the
    # model made no call at all, answered without one), every other one answered 200
    assert c["outage_refused_store_down"] + c["outage_gated_without_call"] == 3 * ROUNDS * outages
    assert c["outage_refused_store_down"] >= 2 * ROUNDS * outages   # the answers, and most turns
    assert c["outage_free_ok"] == 3 * ROUNDS * outages
    assert c["outage_recovered"] == c["outages"] == outages


def test_sqlite_store_unavailable_fails_closed_and_recovers(tmp_path):
    env = rel.approval_env(tmp_path)
    db = Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"])
    server = start_cli_server("random", env=env)
    try:
        figures = rel.run_store_outage(server.base_url, lambda: rel.sqlite_folder_gone(db),
                                       "sqlite_folder_gone", ROUNDS)
        rel.run_store_outage(server.base_url, lambda: sqlite_locked(db), "sqlite_locked",
                             ROUNDS, figures)
        _print("store_outage_sqlite", figures)
        _check_outage(figures, 2)
        assert server.process.poll() is None
        log = server.log_text()
        assert "grant store unavailable" in log and str(db) in log   # the operator sees where
        assert rel.store_check(db)[0]
    finally:
        stop_cli_server(server)


def test_postgres_store_unavailable_fails_closed_and_recovers():
    from support.postgres import PostgresUnavailable, ThrowawayPostgres

    try:
        pg = ThrowawayPostgres.start()
    except PostgresUnavailable as exc:
        pytest.skip(f"PostgreSQL store outage not tested: {exc}")
    try:
        import tempfile
        env = rel.approval_env(Path(tempfile.mkdtemp(prefix="vat-pg-policy-")), store=pg.dsn)
        server = start_cli_server("random", env=env)
        try:
            figures = rel.run_store_outage(server.base_url, lambda: rel.postgres_stopped(pg),
                                           "postgres_stopped", ROUNDS)
            _print("store_outage_postgres", figures)
            _check_outage(figures, 1)
            assert server.process.poll() is None
        finally:
            stop_cli_server(server)
    finally:
        pg.close()


def test_sigkilled_server_loses_no_acknowledged_grant(tmp_path):
    env = rel.approval_env(tmp_path)
    db = Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"])

    def start():
        server = start_cli_server("random", env=env)
        return server.base_url, server.process.pid, lambda: stop_cli_server(server)

    figures = rel.run_kill(start, db, kill_after=KILL_AFTER, workers=4, cycles=1)
    _print("kill", figures)
    c = figures.counts
    assert not figures.problems, figures.problems[:5]
    assert c["kills"] == 1 and c["store_integrity_failures"] == 0
    assert c["grants_acknowledged"] >= KILL_AFTER
    assert c["grants_lost"] == 0
    assert c["grants_found_after_restart"] == c["grants_acknowledged"]
    assert c["grants_usable_after_restart"] == c["grants_acknowledged"]

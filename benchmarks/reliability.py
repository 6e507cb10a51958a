"""Reliability figures: request fuzzing, concurrent load and client faults against a real server.

    python benchmarks/reliability.py [--fuzz-examples 2000] [--load-requests 64] [--load-rounds 10]
                                     [--disconnects 16] [--json OUT]
    python benchmarks/reliability.py --base-url http://127.0.0.1:8000/v1 --server-pid PID ...
    python benchmarks/reliability.py --skip fuzz --skip load --skip faults   # grant-store faults only
    python benchmarks/reliability.py --approvals --skip load --skip faults --skip store --skip kill

Without ``--base-url`` it starts its own server (``vllm-allowed-tools serve-tiny``, random tiny
model, the plugin on) and stops it at the end. ``--server-pid`` (the PID of the ``serve-tiny`` or
``vllm serve`` process) is only needed for the RSS figures of a server it did not start. Progress
goes to stderr; stdout gets a markdown figures table (and ``--json`` the raw figures). Exit 0 when
every figure is clean, 1 when one is not (5xx, a leaked call, a hang, a 4xx without a field, an
unexpected outcome, a stream not aborted), 2 when the run could not happen.

The parts (fuzz, load, faults, store, kill) live in tests/support/reliability/,
the same code the end-to-end tests run at a smaller size; benchmarks/README.md says what each checks.
``--approvals`` serves its own server with an approval policy gating a function and a custom tool
(:data:`FUZZ_GATED`): no call of theirs may come back (the fuzz never answers an approval).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from vllm_allowed_tools.devtools.serve import SEPARATE_WORKER, ServeTinyProcess, start_serve_tiny

# the test-side helpers this script shares with the tests live in tests/support/ (not in the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.reliability import (  # noqa: E402
    Figures,
    approval_env,
    approvals_table,
    log,
    postgres_stopped,
    rss_growth_problems,
    run_disconnects,
    run_fuzz,
    run_kill,
    run_load,
    run_store_outage,
    sqlite_folder_gone,
    table,
)
from support.store_faults import sqlite_locked  # noqa: E402


def _start_server(flavour: str, log_dir: Path, env: dict[str, str] | None = None,
                  tag: str = "") -> ServeTinyProcess:
    log_path = log_dir / f"vllm-reliability-{flavour}{tag}.log"
    log(f"starting serve-tiny ({flavour}); log {log_path}")
    # the model in its own worker process: the load tells the engine core's memory from the KV cache's
    server = start_serve_tiny(flavour, env=env, log_path=log_path, extra_args=SEPARATE_WORKER)
    log(f"server at {server.base_url}")
    return server


def _store_outages(folder: Path, rounds: int, flavour: str) -> Figures:
    """SQLite folder gone and SQLite locked on one server; PostgreSQL stopped on another (when its
    server binaries are on PATH)."""
    env = approval_env(folder / "outage")
    db = Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"])
    server = _start_server(flavour, folder, env, "-outage")
    try:
        log(f"store outage: SQLite folder gone, SQLite locked ({rounds} rounds each) ...")
        outage = run_store_outage(server.base_url, lambda: sqlite_folder_gone(db),
                                  "sqlite_folder_gone", rounds)
        run_store_outage(server.base_url, lambda: sqlite_locked(db), "sqlite_locked", rounds,
                         outage)
    finally:
        server.stop()
    from support.postgres import PostgresUnavailable, ThrowawayPostgres
    try:
        pg = ThrowawayPostgres.start()
    except PostgresUnavailable as exc:
        log(f"store outage: PostgreSQL not measured: {exc}")
        return outage
    try:
        server = _start_server(flavour, folder, approval_env(folder / "pg", store=pg.dsn), "-pg")
        try:
            log(f"store outage: PostgreSQL stopped ({rounds} rounds) ...")
            run_store_outage(server.base_url, lambda: postgres_stopped(pg), "postgres_stopped",
                             rounds, outage)
        finally:
            server.stop()
    finally:
        pg.close()
    return outage


def _kills(folder: Path, kill_after: int, kill_cycles: int, flavour: str) -> Figures:
    env = approval_env(folder / "kill")

    def start() -> tuple[str, int, Callable[[], None]]:
        server = _start_server(flavour, folder, env, "-kill")
        return server.base_url, server.process.pid, server.stop

    log(f"kill: {kill_cycles} x SIGKILL after {kill_after} acknowledged grants ...")
    return run_kill(start, Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"]), kill_after=kill_after,
                    workers=4, cycles=kill_cycles)


def run_approval_faults(parts: list[str], rounds: int, kill_after: int, kill_cycles: int,
                        flavour: str) -> tuple[Figures | None, Figures | None]:
    """The grant-store parts, each on servers of its own (approvals on)."""
    outage = kill = None
    folder = Path(tempfile.mkdtemp(prefix="vat-reliability-approvals-"))
    if "store" in parts:
        outage = _store_outages(folder, rounds, flavour)
        log(json.dumps({"store_outage": outage.as_dict()}))
    if "kill" in parts:
        kill = _kills(folder, kill_after, kill_cycles, flavour)
        log(json.dumps({"kill": kill.as_dict()}))
    return outage, kill


#: what ``--approvals`` gates: a pool function and a custom tool the fuzz's catalogs carry
FUZZ_GATED = frozenset({"send_email", "decide"})


def _fuzz_approval_env(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "store").mkdir(exist_ok=True)
    policy = folder / "fuzz-approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": sorted(FUZZ_GATED), "approval": "required",
                                             "scopes": ["once", "session"]}]}))
    return {"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
            "VLLM_ALLOWED_TOOLS_GRANT_STORE": str(folder / "store" / "grants.db")}


def _server_parts(args: argparse.Namespace, base_url: str,
                  pid: int | None) -> tuple[Figures | None, Figures | None, Figures | None]:
    fuzz = load = faults = None
    if "fuzz" not in args.skip:
        log(f"fuzz: {args.fuzz_examples} examples ...")
        fuzz = run_fuzz(base_url, args.fuzz_examples, strict=False, seed=args.seed,
                        gated=FUZZ_GATED if args.approvals else frozenset())
        log(json.dumps({"fuzz": fuzz.as_dict()}))
    if "load" not in args.skip:
        log(f"load: {args.load_requests} concurrent x {args.load_rounds} rounds ...")
        load = run_load(base_url, args.load_requests, args.load_rounds, pid)
        log(json.dumps({"load": load.as_dict()}))
    if "faults" not in args.skip:
        log(f"faults: {args.disconnects} mid-stream disconnects + unary + half-sent ...")
        faults = run_disconnects(base_url, args.disconnects)
        log(json.dumps({"faults": faults.as_dict()}))
    return fuzz, load, faults


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz-examples", type=int, default=2000)
    parser.add_argument("--load-requests", type=int, default=64)
    parser.add_argument("--load-rounds", type=int, default=10)
    parser.add_argument("--disconnects", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None,
                        help="hypothesis seed (default: derandomized, the same cases every run)")
    parser.add_argument("--base-url", default=None, help="use this server instead of starting one")
    parser.add_argument("--server-pid", type=int, default=None, help="for RSS with --base-url")
    parser.add_argument("--flavour", default="random", choices=["random", "tool-happy"])
    parser.add_argument("--approvals", action="store_true",
                        help="serve with an approval policy gating a function and a custom tool")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    parser.add_argument("--outage-rounds", type=int, default=5,
                        help="rounds of 6 requests during each grant-store outage")
    parser.add_argument("--kill-after", type=int, default=20,
                        help="acknowledged grants before each SIGKILL")
    parser.add_argument("--kill-cycles", type=int, default=2)
    parser.add_argument("--skip", action="append", default=[],
                        choices=["fuzz", "load", "faults", "store", "kill"])
    return parser


def _report(figures: dict[str, Figures | None], json_path: Path | None) -> int:
    """Print the tables and the problems; write the raw figures; the exit status."""
    fuzz, load, faults, outage, kill = figures.values()
    if fuzz or load or faults:
        print(table(fuzz, load, faults))
    if outage or kill:
        print(approvals_table(outage, kill))
    problems = [p for f in figures.values() if f for p in f.problems]
    if load:
        problems += [f"RSS not flat: {why}" for why in rss_growth_problems(load)]
    for problem in problems[:50]:
        print(f"problem: {problem}")
    if json_path:
        json_path.write_text(json.dumps({name: f.as_dict() | {"problem_list": f.problems}
                                         for name, f in figures.items() if f}, indent=2))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    approval_parts = [part for part in ("store", "kill") if part not in args.skip]
    only_approvals = {"fuzz", "load", "faults"} <= set(args.skip)

    server = None
    try:
        if args.base_url or only_approvals:
            base_url, pid = (args.base_url or "").rstrip("/"), args.server_pid
        else:
            folder = Path(tempfile.mkdtemp(prefix="reliability-"))
            server = _start_server(args.flavour, folder,
                                   env=_fuzz_approval_env(folder) if args.approvals else None)
            base_url, pid = server.base_url, server.process.pid
    except (RuntimeError, OSError) as exc:
        log(f"error: {exc}")
        return 2
    try:
        fuzz, load, faults = _server_parts(args, base_url, pid)
    finally:
        if server is not None:
            server.stop()
    outage = kill = None
    if approval_parts and args.base_url:
        log("grant-store faults skipped: they need servers of their own (no --base-url)")
    elif approval_parts:
        try:
            outage, kill = run_approval_faults(approval_parts, args.outage_rounds,
                                               args.kill_after, args.kill_cycles, args.flavour)
        except (RuntimeError, OSError) as exc:
            log(f"error: {exc}")
            return 2
    return _report({"fuzz": fuzz, "load": load, "faults": faults, "store_outage": outage,
                    "kill": kill}, args.json)


if __name__ == "__main__":
    sys.exit(main())

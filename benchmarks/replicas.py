"""Approvals across vLLM replicas: two ``serve-tiny`` replicas on one PostgreSQL grant store behind a
real reverse proxy (HAProxy), and what prompt-cache reuse does across them.

    python benchmarks/replicas.py [--agents 64] [--rounds 10] [--max-tokens 96] [--cache-turns 8]
                                  [--results benchmarks/results/replicas.md] [--json OUT]

It starts a throwaway PostgreSQL (tests/support/postgres.py), two replicas of
``serve-tiny --flavour random`` with the same approval policy (``send_email`` needs approval, scopes
``once`` / ``session``) and that store, and two proxies in front of them
(tests/support/proxy.py): round-robin, and sticky (a hash of ``x-session-id``,
standing for prefix-aware routing). Then:

* **agents**: N concurrent agents through the round-robin proxy, each in its own session
  (``prompt_cache_key``, the same API key for all: only the session tells their grants apart) with
  its own catalog and allowed subset, for R rounds. A turn that asks for ``send_email`` gets an
  elicitation; the agent accepts it (even agents: scope ``session``, odd: ``once``) by sending the
  same answer twice at once (the proxy puts the two on different replicas: a race on one record)
  and both must release exactly the recorded call. Counted: requests, elicitations, releases (by
  answer, by grant, by policy), double releases (an answer that released two different calls, or an
  elicitation with two grants in the store), cross-session releases (a gated call released in a
  session that holds no grant of its own, a grant in a session that never accepted with ``session``,
  or a release of another session's call), p50/p95 latency of turns and of answers;
* **cache**: one multi-turn agent session (Chat Completions, a free tool each turn, the history
  kept) through each proxy: per turn the replica that served it, prompt tokens and
  ``usage.prompt_tokens_details.cached_tokens``.

Progress goes to stderr; the markdown figures to stdout and to ``--results``. Exit 0 when the agents
run is clean (no double or cross-session release, no problem), 1 when not, 2 when it could not run.
``tests/test_replicas_e2e.py`` runs the same code at CI size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME
from vllm_allowed_tools.devtools.serve import ServeError, ServeTinyProcess, start_serve_tiny

# the test-side helpers this script shares with the tests live in tests/support/ (not in the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.calls import chat_selection, responses_selection  # noqa: E402
from support.postgres import PostgresUnavailable, ThrowawayPostgres  # noqa: E402
from support.proxy import (  # noqa: E402
    SERVED_BY_HEADER,
    SESSION_HEADER,
    ProxyUnavailable,
    ThrowawayProxy,
    find_haproxy,
)
from support.reliability import approval_env, log  # noqa: E402
from support.reliability.approval_client import GATED_TOOL  # noqa: E402

API_KEY = "replicas-agents"
BLOCK_SIZE = 32                   # serve-tiny's --block-size: the prefix cache's unit
STORE_TIMEOUT_S = "5"             # the default: 2 replicas x 16 streams on 2 cores is slow
HERE = Path(__file__).resolve().parent


def headers(session: str | None = None) -> dict[str, str]:
    out = {"Authorization": f"Bearer {API_KEY}"}
    if session:
        out[SESSION_HEADER] = session
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ------------------------------------------------------------------------------------ deployment

@dataclass
class Deployment:
    """PostgreSQL, the replicas (A = replicas[0], B = replicas[1]) and the proxies by mode."""
    pg: ThrowawayPostgres
    replicas: list[ServeTinyProcess]
    proxies: dict[str, ThrowawayProxy]
    env: dict[str, str]

    @property
    def dsn(self) -> str:
        return self.pg.dsn

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for replica in self.replicas:
            replica.stop()
        self.pg.close()


def start_deployment(folder: Path, replicas: int = 2, log_dir: Path | None = None) -> Deployment:
    """Everything, or PostgresUnavailable / ProxyUnavailable (checked before any server starts) /
    ServeError; what was started is stopped on failure."""
    find_haproxy()
    pg = ThrowawayPostgres.start()
    env = {**approval_env(folder, store=pg.dsn), "VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT":
           STORE_TIMEOUT_S}
    started: list[ServeTinyProcess] = []
    proxies: dict[str, ThrowawayProxy] = {}
    try:
        for i in range(replicas):
            log_path = (log_dir or folder) / f"vllm-replica-{i}.log"
            log(f"starting replica {i} (serve-tiny random); log {log_path}")
            started.append(start_serve_tiny("random", env=env, log_path=log_path))
        urls = [replica.base_url for replica in started]
        for mode in ("roundrobin", "sticky"):
            proxies[mode] = ThrowawayProxy.start(urls, mode=mode)
        log(f"replicas {urls}; proxies {[p.base_url for p in proxies.values()]}")
    except BaseException:
        Deployment(pg, started, proxies, env).close()
        raise
    return Deployment(pg, started, proxies, env)


# ---------------------------------------------------------------------------------------- agents

@dataclass
class Agent:
    index: int
    session: str
    subset: list[str]
    catalog: list[str]
    scope: str                       # what it answers an elicitation with
    grant_from: str | None = None    # the elicitation whose session grant it holds


def make_agents(count: int, run: str) -> list[Agent]:
    """Each agent its own session, catalog of 7 pool tools with the gated one, and allowed subset:
    only the gated tool, it with one or two free tools, or one free tool (the gated one in the
    catalog but not allowed)."""
    agents = []
    free = [tool.name for tool in POOL if tool.name != GATED_TOOL]
    for i in range(count):
        rng = random.Random(i)
        picked = rng.sample(free, 6)
        subset = {0: [GATED_TOOL], 1: [GATED_TOOL, picked[0]], 2: [GATED_TOOL, *picked[:2]],
                  3: [picked[0]]}[i % 4]
        agents.append(Agent(i, f"{run}-agent-{i}", subset, [GATED_TOOL, *picked],
                            "session" if i % 2 == 0 else "once"))
    return agents


def agent_body(agent: Agent, seed: int, max_tokens: int, history: list[dict] | None = None) -> dict:
    return {"model": "tiny", "input": history or "Send it.",
            "tools": [POOL_BY_NAME[name].responses_tool() for name in agent.catalog],
            "tool_choice": responses_selection("required", agent.subset),
            "parallel_tool_calls": False, "max_output_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "prompt_cache_key": agent.session}


@dataclass
class AgentFigures:
    counts: Counter = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=lambda: {"turn": [], "answer": []})
    served_by: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        c = self.counts
        out = {key: c[key] for key in (
            "requests", "turns", "elicitations", "released_by_answer", "released_by_grant",
            "released_by_policy", "turns_without_call", "double_releases", "cross_session_releases",
            "subset_violations", "grant_not_honoured", "errors", "grants_in_store")}
        for kind, values in self.latency.items():
            out[f"{kind}_p50_ms"] = round(1000 * percentile(values, 0.5))
            out[f"{kind}_p95_ms"] = round(1000 * percentile(values, 0.95))
        out["served_by"] = dict(sorted(self.served_by.items()))
        out["problems"] = len(self.problems)
        return out


async def _post(client: httpx.AsyncClient, url: str, body: dict, session: str, kind: str,
                figures: AgentFigures) -> dict | None:
    """One request; its output items on a 200 (None otherwise, recorded as a problem)."""
    started = time.monotonic()
    try:
        response = await client.post(url + "/responses", json=body, headers=headers(session))
    except httpx.HTTPError as exc:
        figures.counts["errors"] += 1
        figures.problems.append(f"{session} {kind}: {type(exc).__name__}: {exc}")
        return None
    figures.latency[kind].append(time.monotonic() - started)
    figures.counts["requests"] += 1
    figures.served_by[response.headers.get(SERVED_BY_HEADER, "?")] += 1
    if response.status_code != 200:
        figures.counts["errors"] += 1
        figures.problems.append(f"{session} {kind}: {response.status_code} {response.text[:200]}")
        return None
    return list(response.json().get("output") or [])


def _judge_calls(agent: Agent, items: list[dict], figures: AgentFigures) -> None:
    c = figures.counts
    for item in items:
        if item.get("type") != "function_call":
            continue
        if item["name"] not in agent.subset:
            c["subset_violations"] += 1
            figures.problems.append(f"{agent.session}: call {item['name']} outside {agent.subset}")
        elif item["name"] != GATED_TOOL:
            c["released_by_policy"] += 1
        elif agent.grant_from is not None:
            c["released_by_grant"] += 1
        else:   # a gated call without this session's own grant: another session's authority
            c["cross_session_releases"] += 1
            figures.problems.append(f"{agent.session}: {GATED_TOOL} released without a grant")


async def _answer(client: httpx.AsyncClient, url: str, agent: Agent, item: dict, round_: int,
                  max_tokens: int, figures: AgentFigures) -> None:
    """Accept `item` with the agent's scope, the same answer sent twice at once (a race across
    replicas): both must release exactly the recorded call."""
    c = figures.counts
    answer = {"id": f"er-{agent.session}-{round_}", "type": "elicitation_response",
              "elicitation_id": item["id"], "action": "accept", "scope": agent.scope}
    body = agent_body(agent, round_, max_tokens,
                      [{"role": "user", "content": "Send it."}, item, answer])
    outputs = await asyncio.gather(*(_post(client, url, body, agent.session, "answer", figures)
                                     for _ in range(2)))
    released = {(i.get("type"), i.get("name"), i.get("call_id"), i.get("arguments"))
                for output in outputs if output is not None for i in output}
    expected = ("function_call", GATED_TOOL, item["call_id"], item["arguments"])
    if released == {expected}:
        c["released_by_answer"] += 1
        if agent.scope == "session":
            agent.grant_from = item["id"]
        return
    if len([r for r in released if r[0] == "function_call"]) > 1:
        c["double_releases"] += 1
    if any(r[2] != item["call_id"] for r in released if r[0] == "function_call"):
        c["cross_session_releases"] += 1
    figures.problems.append(f"{agent.session}: accept released {sorted(map(str, released))}, "
                            f"expected {expected}")


async def agent_round(client: httpx.AsyncClient, url: str, agent: Agent, round_: int,
                      max_tokens: int, figures: AgentFigures) -> None:
    c = figures.counts
    items = await _post(client, url, agent_body(agent, 1000 * round_ + agent.index, max_tokens),
                        agent.session, "turn", figures)
    c["turns"] += 1
    if items is None:
        return
    _judge_calls(agent, items, figures)
    elicitations = [item for item in items if item.get("type") == "elicitation"]
    if not elicitations and not any(item.get("type") == "function_call" for item in items):
        c["turns_without_call"] += 1   # the random model ran out of tokens before a call
    for item in elicitations:
        c["elicitations"] += 1
        if item.get("name") not in agent.subset:
            c["subset_violations"] += 1
            figures.problems.append(f"{agent.session}: elicitation for {item.get('name')}")
        if agent.grant_from is not None:
            c["grant_not_honoured"] += 1
            figures.problems.append(f"{agent.session}: asked again despite its session grant")
        await _answer(client, url, agent, item, round_, max_tokens, figures)


def check_store(dsn: str, agents: list[Agent], figures: AgentFigures) -> None:
    """The store's side: one grant per accepted elicitation at most, grants only in the sessions
    that accepted with ``session``, exactly the ones the agents were told about."""
    from vllm_allowed_tools.approvals.store import open_store
    store = open_store(dsn)
    try:
        grants = store.list_grants(include_inactive=True, now=time.time())
    finally:
        store.close()
    sessions = {f"cache_key:{agent.session}": agent for agent in agents}
    ours = [grant for grant in grants if grant.session in sessions]
    c = figures.counts
    c["grants_in_store"] = len(ours)
    per_origin = Counter(grant.origin_elicitation_id for grant in ours)
    c["double_releases"] += sum(n - 1 for n in per_origin.values())
    for grant in ours:
        agent = sessions[grant.session]
        if agent.grant_from != grant.origin_elicitation_id:
            c["cross_session_releases"] += 1
            figures.problems.append(f"store: grant {grant.id} in {agent.session} from "
                                    f"{grant.origin_elicitation_id}, agent holds {agent.grant_from}")
    told = sum(agent.grant_from is not None for agent in agents)
    if told != len(ours):
        figures.problems.append(f"store: {len(ours)} grants, agents were told of {told}")


def run_agents(url: str, dsn: str, agents: int, rounds: int, max_tokens: int) -> AgentFigures:
    """`agents` concurrent agents through `url` for `rounds` rounds, then the store checked."""
    figures = AgentFigures()
    crew = make_agents(agents, f"run-{uuid.uuid4().hex[:8]}")

    async def go() -> None:
        limits = httpx.Limits(max_connections=2 * agents + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0),
                                     limits=limits) as client:
            for round_ in range(rounds):
                started = time.monotonic()
                await asyncio.gather(*(agent_round(client, url, agent, round_, max_tokens, figures)
                                       for agent in crew))
                log(f"agents round {round_ + 1}/{rounds}: {time.monotonic() - started:.1f}s, "
                    f"{figures.counts['elicitations']} elicitations so far")

    asyncio.run(go())
    check_store(dsn, crew, figures)
    figures.counts["agents"], figures.counts["rounds"] = agents, rounds
    return figures


# ----------------------------------------------------------------------------------------- cache

def cache_session(url: str, turns: int, max_tokens: int = 40, seed: int = 7) -> list[dict]:
    """One agent session of `turns` Chat turns through `url` (a proxy), the history kept (each
    answer as returned, a result for each call): per turn the replica, prompt and cached tokens.
    The session opens with a system prompt of its own, so nothing it reuses was written by another
    run."""
    from openai import OpenAI
    session = f"cache-{uuid.uuid4().hex[:10]}"
    client = OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=300,
                    default_headers={SESSION_HEADER: session})
    catalog = [tool for tool in POOL if tool.name != GATED_TOOL][:16]
    messages: list[dict] = [{"role": "system", "content": f"Session {session}: you are a careful "
                             "operations agent; use the tools one at a time."}]
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn + 1}: carry on with the task."})
        subset = [tool.name for tool in random.Random(seed + turn).sample(catalog, 2)]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=[tool.chat_tool() for tool in catalog],
            tool_choice=chat_selection("required", subset), parallel_tool_calls=False,
            max_tokens=max_tokens, temperature=1.0, seed=seed + turn,
            extra_body={"prompt_cache_key": session})
        completion = raw.parse()
        details = completion.usage.prompt_tokens_details
        rows.append({"turn": turn, "replica": raw.headers.get(SERVED_BY_HEADER, "?"),
                     "prompt_tokens": completion.usage.prompt_tokens,
                     "cached_tokens": (details.cached_tokens if details else 0) or 0})
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content",
                                                                       "tool_calls"}))
        for call in message.tool_calls or []:   # a tool result of a realistic size (~150 tokens)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"{call.function.name} finished step {turn + 1}. " +
                             " ".join(f"line {i}: status ok, 3 items updated." for i in range(12))})
    return rows


def cache_summary(rows: list[dict]) -> dict[str, Any]:
    later = rows[1:]
    prompt = sum(r["prompt_tokens"] for r in later)
    cached = sum(r["cached_tokens"] for r in later)
    return {"turns": len(rows), "replicas": sorted({r["replica"] for r in rows}),
            "cached_tokens_after_first": cached, "prompt_tokens_after_first": prompt,
            "uncached_tokens_after_first": prompt - cached,
            "cached_fraction_after_first": round(sum(r["cached_tokens"] for r in later)
                                                 / prompt, 3) if prompt else 0.0}


# ------------------------------------------------------------------------------------------ main

AGENTS_HEADER = ("| agents x rounds | requests | elicitations | releases (answer / grant / policy) "
                 "| double releases | cross-session releases | errors | turn p50 / p95 ms "
                 "| answer p50 / p95 ms | requests per replica |")


def agents_table(figures: AgentFigures) -> str:
    s = figures.summary()
    releases = s["released_by_answer"] + s["released_by_grant"] + s["released_by_policy"]
    row = (f"| {figures.counts['agents']} x {figures.counts['rounds']} | {s['requests']} "
           f"| {s['elicitations']} | {releases} ({s['released_by_answer']} / "
           f"{s['released_by_grant']} / {s['released_by_policy']}) | {s['double_releases']} "
           f"| {s['cross_session_releases']} | {s['errors']} | {s['turn_p50_ms']} / "
           f"{s['turn_p95_ms']} | {s['answer_p50_ms']} / {s['answer_p95_ms']} | "
           + ", ".join(f"{k} {v}" for k, v in s["served_by"].items()) + " |")
    return f"{AGENTS_HEADER}\n|---|---:|---:|---|---:|---:|---:|---|---|---|\n{row}"


def cache_table(runs: dict[str, list[dict]]) -> str:
    turns = max(len(rows) for rows in runs.values())
    lines = ["| turn | " + " | ".join(f"{mode}: replica, cached / prompt" for mode in runs) + " |",
             "|---:|" + "---|" * len(runs)]
    for turn in range(turns):
        cells = [f"{rows[turn]['replica']}, {rows[turn]['cached_tokens']} / "
                 f"{rows[turn]['prompt_tokens']}" if turn < len(rows) else "" for rows in runs.values()]
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    totals = [cache_summary(rows) for rows in runs.values()]
    lines.append("| turns 1+ | " + " | ".join(
        f"{t['cached_tokens_after_first']} / {t['prompt_tokens_after_first']} "
        f"({100 * t['cached_fraction_after_first']:.0f}% cached, "
        f"{t['uncached_tokens_after_first']} recomputed)" for t in totals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cache-turns", type=int, default=8)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "replicas.md")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="vat-replicas-"))
    started = time.monotonic()
    try:
        deployment = start_deployment(folder, log_dir=args.log_dir)
    except (PostgresUnavailable, ProxyUnavailable, ServeError) as exc:
        print(f"replicas benchmark could not run: {exc}", file=sys.stderr)
        return 2
    try:
        figures = run_agents(deployment.proxies["roundrobin"].base_url, deployment.dsn,
                             args.agents, args.rounds, args.max_tokens)
        cache = {mode: cache_session(deployment.proxies[mode].base_url, args.cache_turns)
                 for mode in ("roundrobin", "sticky")}
    finally:
        deployment.close()
    command = (f"python benchmarks/replicas.py --agents {args.agents} --rounds {args.rounds} "
               f"--max-tokens {args.max_tokens} --cache-turns {args.cache_turns}")
    report = "\n".join([
        "# Approvals across two vLLM replicas", "", "```bash", command, "```", "",
        (f"{time.strftime('%Y-%m-%d')}, {time.monotonic() - started:.0f} s on a shared 2-core CPU "
         "machine: two `serve-tiny --flavour random` replicas, one PostgreSQL grant store, HAProxy "
         "in front (see the script's docstring for what each figure counts)."), "",
        "## Concurrent agents through the round-robin proxy", "", agents_table(figures), "",
        "## Prompt-cache reuse across replicas: one multi-turn session", "",
        ("Chat Completions, the history kept, a 16-tool catalog; `cached / prompt` is "
         "`usage.prompt_tokens_details.cached_tokens` / `prompt_tokens` of each turn, the replica "
         "the proxy's `x-served-by` header."), "", cache_table(cache), "",
        ("Round-robin alternates the session between the two replicas: each turn lands on the "
         "replica that served the turn before last, so it reuses only that turn's prompt (turn 1 "
         "reuses nothing: that replica never saw the session) and recomputes the last two turns' "
         "additions. Sticky routing (a hash of the session header, what a prefix-aware router does) "
         "keeps the session on one replica, which reuses the whole previous prompt but its last "
         "partial block. The grants do not depend on the routing: the store is shared."), ""])
    print(report)
    if figures.problems:
        print("problems:\n" + "\n".join(figures.problems[:20]), file=sys.stderr)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(report)
    if args.json:
        args.json.write_text(json.dumps({"agents": figures.summary(), "problems": figures.problems,
                                         "cache": cache}, indent=2))
    s = figures.summary()
    return 1 if figures.problems or s["double_releases"] or s["cross_session_releases"] else 0


if __name__ == "__main__":
    sys.exit(main())

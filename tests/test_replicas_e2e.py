"""Approvals across vLLM replicas: two ``serve-tiny --flavour random`` replicas (A, B) with the same
approval policy on one PostgreSQL grant store, behind a real HAProxy (round-robin, and sticky on
``x-session-id``), all started and stopped here (``benchmarks/replicas.py`` starts the same, and
runs the agents at full size).

Where a scenario needs "A, then B" it talks to each replica directly; the load and the failover go
through the proxy. Every request carries the same API key, so only the session (the
``prompt_cache_key``) tells grants apart. Skipped, saying why, only where PostgreSQL or HAProxy
cannot be started (``.ci/run`` installs both from Debian). The SIGKILL test runs last: it leaves B
dead. Sizes: ``VLLM_ALLOWED_TOOLS_REPLICA_AGENTS`` (32), ``..._REPLICA_ROUNDS`` (5).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME

from support.metrics import scrape_metric
from support.postgres import PostgresUnavailable
from support.proxy import SERVED_BY_HEADER, ProxyUnavailable
from support.reliability.kill import kill_server_hard
from support.servers import load_script

pytestmark = pytest.mark.server

AGENTS = int(os.environ.get("VLLM_ALLOWED_TOOLS_REPLICA_AGENTS", "32"))
ROUNDS = int(os.environ.get("VLLM_ALLOWED_TOOLS_REPLICA_ROUNDS", "5"))
AGENT_MAX_TOKENS = 96     # CI size
GATED, FREE = "send_email", "get_weather"
TOOLS = [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]


def _bench():
    return load_script("benchmarks", "replicas")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    try:
        deployed = _bench().start_deployment(tmp_path_factory.mktemp("replicas"))
    except (PostgresUnavailable, ProxyUnavailable) as exc:
        pytest.skip(f"two-replica tests not run: {exc}")
    yield deployed
    deployed.close()


@pytest.fixture(scope="module")
def store(deployment):
    from vllm_allowed_tools.approvals.store import open_store
    opened = open_store(deployment.dsn)
    yield opened
    opened.close()


def _turn(session: str, *history: dict, seed: int = 0) -> dict:
    """A Responses turn whose only allowed tool is the gated one (required: the model calls it)."""
    return {"model": "tiny", "input": list(history) or "Send it.", "tools": TOOLS,
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": GATED}]},
            "parallel_tool_calls": False, "max_output_tokens": 96, "temperature": 1.0,
            "seed": seed, "prompt_cache_key": session}


def _post(url: str, session: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/responses", json=body, headers=_bench().headers(session), timeout=120)


def _post_retrying(url: str, session: str, body: dict) -> httpx.Response:
    """As a client does (the openai SDK retries a 502 by default): until the proxy stops picking a
    dead replica. A replica that is still dying can accept a connection and reset it, which
    HAProxy answers with a 502 (it never resends a request a replica accepted); its health check
    takes the replica out within two seconds."""
    for _ in range(20):
        response = _post(url, session, body)
        if response.status_code != 502:
            return response
        time.sleep(0.5)
    return response


def _output(url: str, session: str, body: dict) -> list[dict]:
    response = _post_retrying(url, session, body)
    assert response.status_code == 200, response.text
    return response.json()["output"]


def _accept(elicitation: dict, response_id: str, scope: str) -> list[dict]:
    return [{"role": "user", "content": "Send it."}, elicitation,
            {"id": response_id, "type": "elicitation_response", "elicitation_id": elicitation["id"],
             "action": "accept", "scope": scope}]


def _calls(output: list[dict]) -> list[tuple[str, str, str]]:
    return [(i["name"], i["call_id"], i["arguments"]) for i in output if i["type"] == "function_call"]


def _gated_turn(url: str, session: str) -> list[dict]:
    """The first turn in `session` in which the model made a call (it may run out of tokens first);
    no earlier attempt may have released the gated call either."""
    for seed in range(5):
        output = _output(url, session, _turn(session, seed=seed))
        if any(i["type"] in ("function_call", "elicitation") for i in output):
            return output
    raise AssertionError(f"no call in 5 turns of {session}")


def _elicitation(url: str, session: str) -> dict:
    output = _gated_turn(url, session)
    assert not _calls(output), f"released without approval: {output}"
    [elicitation] = [i for i in output if i["type"] == "elicitation"]
    assert elicitation["name"] == GATED
    return elicitation


def _released(elicitation: dict) -> list[tuple[str, str, str]]:
    return [(GATED, elicitation["call_id"], elicitation["arguments"])]


def _grants_from(store, elicitation_id: str) -> list:
    return [g for g in store.list_grants(include_inactive=True, now=time.time())
            if g.origin_elicitation_id == elicitation_id]


def test_an_elicitation_issued_by_a_is_answered_through_b(deployment, store):
    a, b = deployment.replicas
    elicitation = _elicitation(a.base_url, "a-to-b")
    # another session on B cannot answer it: it is bound to (principal, session) in the shared store
    other = _post(b.base_url, "a-to-b-other",
                  _turn("a-to-b-other", *_accept(elicitation, "er-other", "once")))
    assert other.status_code == 400 and other.json()["error"]["code"] == "unknown_elicitation"
    before = scrape_metric(b.root_url, "vllm:prompt_tokens_total")
    output = _output(b.base_url, "a-to-b", _turn("a-to-b", *_accept(elicitation, "er-1", "once")))
    assert _calls(output) == _released(elicitation)
    assert scrape_metric(b.root_url, "vllm:prompt_tokens_total") == before, "no model call on B"
    record = store.get_elicitation(elicitation["id"])
    assert (record.status, record.response_id, record.scope) == ("accepted", "er-1", "once")
    # the same answer resent to A: the same call again, nothing consumed twice
    again = _output(a.base_url, "a-to-b", _turn("a-to-b", *_accept(elicitation, "er-1", "once")))
    assert _calls(again) == _released(elicitation)
    assert store.get_elicitation(elicitation["id"]).resolved_at == record.resolved_at
    assert _grants_from(store, elicitation["id"]) == []   # `once` mints no grant


def _grant_on_a(deployment, store, session: str):
    """Ask and accept with scope `session`, both on A; the grant the store then holds."""
    a = deployment.replicas[0]
    elicitation = _elicitation(a.base_url, session)
    output = _output(a.base_url, session, _turn(session, *_accept(elicitation, f"er-{session}",
                                                                   "session")))
    assert _calls(output) == _released(elicitation)
    [grant] = _grants_from(store, elicitation["id"])
    assert grant.session == f"cache_key:{session}" and grant.scope == "session"
    return grant


def test_a_session_grant_minted_on_a_releases_the_next_call_on_b(deployment, store):
    b = deployment.replicas[1]
    _grant_on_a(deployment, store, "grant-a-b")
    output = _gated_turn(b.base_url, "grant-a-b")
    assert [i["type"] for i in output] == ["function_call"] and output[0]["name"] == GATED
    # the same API key in another session is asked: the grant is the session's
    other = _gated_turn(b.base_url, "grant-a-b-other")
    assert not _calls(other) and [i["type"] for i in other] == ["elicitation"]


def test_a_revocation_on_a_is_honoured_by_b_on_the_very_next_request(deployment, store):
    a, b = deployment.replicas
    grant = _grant_on_a(deployment, store, "revoke")
    released = _gated_turn(b.base_url, "revoke")
    assert [i["type"] for i in released] == ["function_call"], "B used the grant before"
    revoked = subprocess.run([sys.executable, "-m", "vllm_allowed_tools.approvals.cli", "--db",
                              deployment.dsn, "revoke", grant.id, "--reason", "replica test"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert revoked.returncode == 0, revoked.stderr
    # B's very next request releases nothing; it (or the first that makes a call) asks again
    first = _output(b.base_url, "revoke", _turn("revoke", seed=10))
    assert not _calls(first), f"a revoked grant released a call on B: {first}"
    output = first if any(i["type"] == "elicitation" for i in first) else \
        _gated_turn(b.base_url, "revoke")
    assert not _calls(output) and [i["type"] for i in output] == ["elicitation"]
    assert [i["type"] for i in _gated_turn(a.base_url, "revoke")] == ["elicitation"]


def test_concurrent_agents_through_round_robin(deployment):
    figures = _bench().run_agents(deployment.proxies["roundrobin"].base_url, deployment.dsn,
                                  AGENTS, ROUNDS, AGENT_MAX_TOKENS)
    summary = figures.summary()
    print(json.dumps({"replicas_agents": summary}, sort_keys=True))
    assert not figures.problems, figures.problems[:10]
    assert summary["double_releases"] == 0 and summary["cross_session_releases"] == 0
    assert summary["subset_violations"] == 0 and summary["errors"] == 0
    assert summary["grant_not_honoured"] == 0
    assert summary["turns"] == AGENTS * ROUNDS
    assert summary["elicitations"] >= AGENTS // 4      # the gated-only agents, in round 1 at least
    assert summary["released_by_answer"] == summary["elicitations"]
    assert summary["released_by_grant"] >= AGENTS // 4     # their session grants, later rounds
    assert summary["grants_in_store"] >= AGENTS // 4
    served = summary["served_by"]
    assert set(served) == {"r0", "r1"} and min(served.values()) >= 0.4 * summary["requests"]


def test_prompt_cache_reuse_sticky_vs_round_robin(deployment):
    bench = _bench()
    sticky = bench.cache_session(deployment.proxies["sticky"].base_url, 4)
    spread = bench.cache_session(deployment.proxies["roundrobin"].base_url, 4)
    print(json.dumps({"replicas_cache": {"sticky": sticky, "roundrobin": spread}}))
    assert len({row["replica"] for row in sticky}) == 1
    assert all(x["replica"] != y["replica"] for x, y in itertools.pairwise(spread))
    for previous, row in itertools.pairwise(sticky):   # the whole previous prompt, but its last block
        assert row["cached_tokens"] >= previous["prompt_tokens"] - 2 * bench.BLOCK_SIZE, sticky
    # round-robin: turn 1 lands on the replica that never saw this session
    assert spread[1]["cached_tokens"] < spread[0]["prompt_tokens"] - 2 * bench.BLOCK_SIZE, spread
    assert bench.cache_summary(spread)["cached_tokens_after_first"] < \
        bench.cache_summary(sticky)["cached_tokens_after_first"]


# ------------------------------------------------------------------- last: it leaves B dead

def test_a_sigkilled_replica_loses_nothing_acknowledged_and_releases_nothing_twice(deployment, store):
    """Two answers acknowledged by B, then two more sent to B at once: B's process group is
    SIGKILLed as soon as the store shows the third committed (its reply may or may not have left),
    the fourth wherever it was. Retries through the proxy (B is dead: A serves them) release each
    recorded call again, identical, and the store never holds a second grant."""
    a, b = deployment.replicas
    proxy = deployment.proxies["roundrobin"].base_url
    sessions = [f"kill-{i}" for i in range(4)]
    asked = [_elicitation(a.base_url, session) for session in sessions]
    for elicitation, session in zip(asked[:2], sessions):   # answered on B, acknowledged
        output = _output(b.base_url, session, _turn(session, *_accept(elicitation, f"er-{session}",
                                                                       "session")))
        assert _calls(output) == _released(elicitation)
    outcome: dict[int, str] = {}

    def answer(i: int) -> None:
        try:
            response = _post(b.base_url, sessions[i], _turn(
                sessions[i], *_accept(asked[i], f"er-{sessions[i]}", "session")))
            outcome[i] = f"acknowledged {response.status_code}"
        except httpx.HTTPError as exc:
            outcome[i] = f"cut ({type(exc).__name__})"

    senders = [threading.Thread(target=answer, args=(i,)) for i in (2, 3)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + 60
    while senders[0].is_alive() and time.monotonic() < deadline and \
            store.get_elicitation(asked[2]["id"]).status == "pending":
        time.sleep(0.001)
    kill_server_hard(b.process.pid)      # B's whole process group: no shutdown code anywhere
    for sender in senders:
        sender.join(130)
    b.process.wait(30)
    after_kill = {i: store.get_elicitation(asked[i]["id"]).status for i in range(4)}
    print(json.dumps({"answers": outcome, "records_after_kill": after_kill}))
    assert after_kill[0] == after_kill[1] == after_kill[2] == "accepted"
    assert after_kill[3] in ("pending", "accepted")
    resolved = {}
    for elicitation in asked[:3]:        # acknowledged or committed: in the store, one grant each
        assert len(_grants_from(store, elicitation["id"])) == 1
        resolved[elicitation["id"]] = store.get_elicitation(elicitation["id"]).resolved_at
    assert len(_grants_from(store, asked[3]["id"])) == (after_kill[3] == "accepted")
    for _ in range(2):   # retries through the proxy reach A: the same call, never a second grant
        for elicitation, session in zip(asked, sessions):
            response = _post_retrying(proxy, session, _turn(
                session, *_accept(elicitation, f"er-{session}", "session")))
            assert response.status_code == 200 and response.headers[SERVED_BY_HEADER] == "r0"
            assert _calls(response.json()["output"]) == _released(elicitation)
            assert len(_grants_from(store, elicitation["id"])) == 1
    for elicitation_id, resolved_at in resolved.items():   # consumed once, before the kill
        assert store.get_elicitation(elicitation_id).resolved_at == resolved_at
    for session in sessions:             # each grant releases the session's next call on A
        output = _gated_turn(proxy, session)
        assert [i["type"] for i in output] == ["function_call"] and output[0]["name"] == GATED

"""`--api-server-count 2`: several API server processes share no per-request state, so every request
is governed by its own policy whichever process serves it.

Which process served a request is read from the server log: with ``--enable-log-requests`` each API
server logs ``(ApiServer_N pid=P) ... Received request <id>`` for the requests that reach vLLM (ours
carry ids we choose or read back). A request the middleware refuses never reaches vLLM, so it is
sent first on a fresh connection and attributed through the allowed requests that follow it on that
same TCP connection (one connection is accepted by exactly one process).
"""

from __future__ import annotations

import re
from collections import defaultdict

import httpx
import openai
import pytest


from support.calls import chat_calls, responses_calls
from support.servers import start_cli_server, stop_cli_server
from support.serving import catalog_and_subset

pytestmark = pytest.mark.server

MIN_ROUNDS, MAX_ROUNDS = 8, 48
CHECKS = {"refused", "chat", "responses"}
RECEIVED = re.compile(r"^\((ApiServer_\d+) pid=\d+\) .*Received request (\S+?): ", re.M)
STAGE_LINE = re.compile(r"^\((ApiServer_\d+) pid=\d+\) .*allowed-tools grammars are applied by", re.M)


@pytest.fixture(scope="module")
def two_api_servers():
    server = start_cli_server("random", extra_args=["--api-server-count", "2", "--enable-log-requests"])
    yield server
    stop_cli_server(server)


def _round_client(server, seed: int, addresses: list):
    """A client on a connection of its own; ``addresses`` gets the local address of the TCP
    connection each response came back on."""
    def record(response: httpx.Response) -> None:
        stream = response.extensions.get("network_stream")
        addresses.append(stream.get_extra_info("client_addr") if stream is not None else None)
    http = httpx.Client(event_hooks={"response": [record]}, timeout=120)
    return http, server.client(http_client=http, default_headers={"X-Request-Id": f"mas-{seed}"})


def test_policies_hold_across_api_server_processes(two_api_servers):
    log = two_api_servers.log_text()
    assert "Started 2 API server processes" in log
    processes = set(STAGE_LINE.findall(log))
    assert len(processes) == 2, f"the middleware was built in {processes}, not in 2 API servers"

    served: dict[str, set[str]] = defaultdict(set)     # process -> checks it was seen passing
    for seed in range(MAX_ROUNDS):
        if seed >= MIN_ROUNDS and all(served[p] >= CHECKS for p in processes):
            break
        addresses: list = []
        http, client = _round_client(two_api_servers, seed, addresses)
        catalog, allowed = catalog_and_subset(seed)
        with http:
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}],
                    tools=[t.chat_tool() for t in catalog],
                    tool_choice={"type": "allowed_tools",
                                 "allowed_tools": {"mode": "auto", "tools": []}})
            r_calls, _, response = responses_calls(client, catalog, "required", allowed, seed)
            assert len(r_calls) == 1 and r_calls[0][0] in allowed, (seed, r_calls, allowed)
            assert response.tool_choice.type == "allowed_tools"
            calls, _, _ = chat_calls(client, catalog, "required", allowed, seed, stream=bool(seed % 2))
            assert len(calls) == 1 and calls[0][0] in allowed, (seed, calls, allowed)
        assert len(addresses) == 3 and None not in addresses, addresses

        by_id = {request_id: process for process, request_id in RECEIVED.findall(two_api_servers.log_text())}
        chat_process = by_id.get(f"chatcmpl-mas-{seed}")
        responses_process = by_id.get(f"{response.id}_0", by_id.get(response.id))
        assert chat_process in processes and responses_process in processes, \
            (seed, chat_process, responses_process, response.id)
        served[chat_process].add("chat")
        served[responses_process].add("responses")
        # the refusal came back on the connection the Responses request then used: same process
        if addresses[0] == addresses[1]:
            served[responses_process].add("refused")
        if addresses[1] == addresses[2]:
            assert chat_process == responses_process, (seed, addresses)   # one connection, one process

    assert all(served[p] >= CHECKS for p in processes), \
        f"after {seed + 1} rounds, checks seen passing per API server process: {dict(served)}"

"""`--api-server-count 2`: several API server processes share no per-request state, so every request
is governed by its own policy whichever process serves it."""

from __future__ import annotations

import openai
import pytest

from conftest import start_cli_server, stop_cli_server
from test_serving_e2e import _catalog_and_subset, chat_calls, responses_calls

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def two_api_servers():
    server = start_cli_server("random", extra_args=["--api-server-count", "2"])
    yield server
    stop_cli_server(server)


def test_policies_hold_across_api_server_processes(two_api_servers):
    log = two_api_servers.log_text()
    assert log.count("Started server process") >= 2 or "api_server_count" in log
    for seed in range(8):   # new connections each time: both processes serve some of them
        client = two_api_servers.client()
        catalog, allowed = _catalog_and_subset(seed)
        calls, _ = chat_calls(client, catalog, "required", allowed, seed, stream=bool(seed % 2))
        assert len(calls) == 1 and calls[0][0] in allowed, (seed, calls, allowed)
        r_calls, _, response = responses_calls(client, catalog, "required", allowed, seed)
        assert len(r_calls) == 1 and r_calls[0][0] in allowed
        assert response.tool_choice.type == "allowed_tools"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}],
                tools=[t.chat_tool() for t in catalog],
                tool_choice={"type": "allowed_tools",
                             "allowed_tools": {"mode": "auto", "tools": []}})

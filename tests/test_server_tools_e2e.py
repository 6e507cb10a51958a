"""Server-side tools end to end: calls vLLM runs itself (gpt-oss's ``container`` behind
``--tool-server``) are decided by the plugin before they run.

Real parts: a local MCP server over SSE named ``container`` (``tests/support/mcp_server.py``: tools
``exec``, ``ls``, ``slow``; every execution appended to a log file before the tool answers), the tiny
gpt-oss, ``vllm-allowed-tools serve-tiny --parser allowed_openai --one-flag -- --tool-server
127.0.0.1:PORT``, the official ``openai`` SDK. Every assertion about what ran is on the MCP server's
own log. The model is held to the call by the plugin's own grammar (``allowed_tools`` naming the
mcp tool), the marker nudges of ``support/gpt_oss.py`` and a ``seed``.

Two more MCP servers, ``python`` and ``browser`` (the tools vLLM's python and browser built-ins
call, logging to the same file), sit behind the same ``--tool-server`` list. The last part sends
what agents send: their own functions next to server-side tools, tools that fail, calls cut short
(vanilla vLLM's refusal of a function next to an ``mcp`` tool is its own function, called in-process). One server configuration for the module. The operator's policy gates ``container__exec`` (an elicitation) and
``container__slow`` (expires in 5 s); ``ls`` has no rule, so only a client's ``require_approval``
pauses it.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from vllm_allowed_tools.devtools.serve import free_port

from support import mcp_server
from support.gpt_oss import nudges
from support.reliability.kill import kill_server_hard
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

USER = {"role": "user", "content": "Run it."}
#: the server's bound on the server-side calls of one response (vLLM's loop has none)
SERVER_CALL_LIMIT = 4


@pytest.fixture(scope="module")
def mcp(tmp_path_factory):
    """The MCP servers ``container``, ``python`` and ``browser``, one execution log:
    (``--tool-server`` list, log, the processes by name, a function that starts the container
    server again on its port after its ``crash`` tool ended it)."""
    folder = tmp_path_factory.mktemp("mcp")
    log = folder / "executions.log"
    log.write_text("")
    names = ("container", "python", "browser")
    ports = {name: free_port() for name in names}

    def start(name: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, mcp_server.__file__,
                                    "--port", str(ports[name]), "--log", str(log), "--name", name],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", ports[name])) == 0:
                    break
            time.sleep(0.2)
        return process

    processes = {name: start(name) for name in names}

    def restart_container() -> None:
        processes["container"].wait(10)
        processes["container"] = start("container")

    yield (",".join(f"127.0.0.1:{ports[n]}" for n in names), log, processes, restart_container)
    for process in processes.values():
        process.terminate()
        process.wait(10)


class Served:
    """The module's server; :meth:`restart` starts it again on the same store (the kill test)."""

    def __init__(self, tool_servers: str, folder) -> None:
        self.store = folder / "grants.db"
        policy = folder / "approvals.json"
        policy.write_text(json.dumps({"rules": [
            {"tools": ["container__exec"], "approval": "required", "scopes": ["once", "session"]},
            {"tools": ["container__slow"], "approval": "required", "expires_in": 5}]}))
        self.args = dict(options=["--parser", "allowed_openai", "--one-flag"],
                         extra_args=["--tool-server", tool_servers],
                         env={"VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS": "container,code_interpreter",
                              "VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
                              "VLLM_ALLOWED_TOOLS_GRANT_STORE": str(self.store),
                              "VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS": str(SERVER_CALL_LIMIT)})
        self.current = start_cli_server("random", **self.args)

    def restart(self) -> None:
        stop_cli_server(self.current)
        self.current = start_cli_server("random", **self.args)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["current"], name)


@pytest.fixture(scope="module")
def server(mcp, tmp_path_factory):
    served = Served(mcp[0], tmp_path_factory.mktemp("server-tools"))
    yield served
    stop_cli_server(served.current)


def executions(mcp) -> list[dict]:
    return [json.loads(line) for line in mcp[1].read_text().splitlines() if line.strip()]


def client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def request(tool_name: str, *, require_approval="always", seed: int = 0, input_=None,
            mode: str = "required", **extra) -> dict:
    body = dict(model="tiny", input=input_ if input_ is not None else [USER],
                tools=[{"type": "mcp", "server_label": "container",
                        "require_approval": require_approval}],
                tool_choice={"type": "allowed_tools", "mode": mode, "tools": [
                    {"type": "mcp", "server_label": "container", "name": tool_name}]},
                parallel_tool_calls=False, temperature=1.0, max_output_tokens=160,
                extra_body={"seed": seed, **nudges()})
    body.update(extra)
    return body


def error_text(item: dict) -> str:
    error = item.get("error") or {}
    return " ".join(part.get("text", "") for part in error.get("content") or [])


def items(response) -> list[dict]:
    return [item.model_dump() if hasattr(item, "model_dump") else dict(item)
            for item in response.output]


def only(kind: str, output: list[dict]) -> dict:
    found = [item for item in output if item["type"] == kind]
    assert len(found) == 1, output
    return found[0]


def streamed(api: openai.OpenAI, body: dict):
    final, events = None, []
    for event in api.responses.create(stream=True, **body):
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None, events
    return final, events


def pause(server, mcp, tool_name="ls", key="key-a", **kw):
    """A first turn that pauses at its gated call: nothing ran."""
    before = len(executions(mcp))
    response = client(server, key).responses.create(**request(tool_name, **kw))
    output = items(response)
    assert len(executions(mcp)) == before, (output, server.log_tail(30))
    return output


def answer_mcp(approval: dict, approve: bool, **extra) -> list[dict]:
    return [USER, approval, {"type": "mcp_approval_response",
                             "approval_request_id": approval["id"], "approve": approve, **extra}]


def test_require_approval_always_pauses_before_the_call_runs_without_an_operator_rule(server, mcp):
    output = pause(server, mcp, "ls")
    approval = only("mcp_approval_request", output)
    assert approval["server_label"] == "container" and approval["name"] == "ls"
    assert json.loads(approval["arguments"])["cmd"] in ("ls", "pwd", "date")
    assert not [item for item in output if item["type"] == "mcp_call"], output


def test_an_accept_runs_the_recorded_call_once_and_generation_continues(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "ls", seed=1))
    before = executions(mcp)
    body = request("ls", seed=1, input_=answer_mcp(approval, True))
    first = items(client(server).responses.create(**body))
    ran = executions(mcp)[len(before):]
    assert ran == [{"tool": "ls", "cmd": json.loads(approval["arguments"])["cmd"],
                    "at": ran[0]["at"]}], ran
    call = first[0]
    assert call["type"] == "mcp_call" and call["approval_request_id"] == approval["id"], first
    assert call["name"] == "ls" and call["arguments"] == approval["arguments"]
    assert call["output"] == f"ls ran {ran[0]['cmd']!r}", call
    # generation went on in the same response, as an auto turn (a required turn is required once):
    # a message, or another call, which pauses again (never the answered request, never run unasked)
    assert len(first) > 1, first
    assert first[-1]["type"] == "message" or (first[-1]["type"] == "mcp_approval_request"
                                              and first[-1]["id"] != approval["id"]), first
    # the same accept again (a lost reply): the same result, never a second execution
    again = items(client(server).responses.create(**body))
    assert len(executions(mcp)) == len(before) + 1
    assert again[0]["output"] == call["output"] and again[0]["approval_request_id"] == approval["id"]


def test_racing_accepts_run_the_call_once(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "ls", seed=2))
    before = len(executions(mcp))
    body = request("ls", seed=2, input_=answer_mcp(approval, True))

    def send(_):
        try:
            return items(client(server).responses.create(**body))
        except openai.APIStatusError as exc:
            return exc.status_code
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(send, range(3)))
    assert len(executions(mcp)) == before + 1, results
    outputs = {r[0].get("output") for r in results if isinstance(r, list)}
    assert len(outputs) <= 2, results   # the run's output, or "outcome unknown" while it ran


def test_a_decline_never_runs_and_reaches_the_model_as_a_refusal(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "ls", seed=3))
    before = len(executions(mcp))
    body = request("ls", seed=3, input_=answer_mcp(approval, False, reason="not now"))
    output = items(client(server).responses.create(**body))
    assert output[0]["type"] == "mcp_call" and output[0]["status"] == "failed", output
    assert "declined" in error_text(output[0]) and "not now" in error_text(output[0])
    # the decline replayed, then an accept of the declined call: nothing runs
    client(server).responses.create(**body)
    with pytest.raises(openai.APIStatusError):
        client(server).responses.create(**request("ls", seed=3, input_=answer_mcp(approval, True)))
    assert len(executions(mcp)) == before


def test_an_answer_from_another_caller_runs_nothing(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "ls", seed=4))
    before = len(executions(mcp))
    with pytest.raises(openai.BadRequestError) as caught:
        client(server, "key-b").responses.create(**request("ls", seed=4,
                                                           input_=answer_mcp(approval, True)))
    assert "approval_request_id" in str(caught.value.body) or "input[2]" in str(caught.value.body)
    assert len(executions(mcp)) == before


def test_the_operators_policy_elicits_on_the_openresponses_wire(server, mcp):
    output = pause(server, mcp, "exec", require_approval="never", seed=5)
    elicitation = only("elicitation", output)
    assert elicitation["elicitation_type"] == "tool_call_approval"
    assert (elicitation["namespace"], elicitation["name"]) == ("container", "exec")
    before = len(executions(mcp))
    answer = [USER, elicitation, {"type": "elicitation_response", "id": "resp_accept_5",
                                  "elicitation_id": elicitation["id"], "action": "accept",
                                  "scope": "once"}]
    body = request("exec", require_approval="never", seed=5, input_=answer)
    ran = items(client(server).responses.create(**body))
    assert [e["tool"] for e in executions(mcp)[before:]] == ["exec"], ran
    assert ran[0]["approval_request_id"] == elicitation["id"] and ran[0]["output"]
    client(server).responses.create(**body)   # replayed: nothing new runs
    assert len(executions(mcp)) == before + 1


def test_a_cancelled_elicitation_never_runs(server, mcp):
    elicitation = only("elicitation", pause(server, mcp, "exec", require_approval="never", seed=9))
    before = len(executions(mcp))
    answer = [USER, elicitation, {"type": "elicitation_response", "id": "resp_cancel_9",
                                  "elicitation_id": elicitation["id"], "action": "cancel"}]
    client(server).responses.create(**request("exec", require_approval="never", seed=9,
                                              input_=answer))
    assert len(executions(mcp)) == before, server.log_tail(30)


def test_an_expired_approval_never_runs(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "slow", seed=6))
    before = len(executions(mcp))
    time.sleep(6)
    output = items(client(server).responses.create(
        **request("slow", seed=6, input_=answer_mcp(approval, True))))
    assert output[0]["status"] == "failed" and "expired" in error_text(output[0]), output
    assert len(executions(mcp)) == before


def test_an_ungated_call_runs_once_and_max_tool_calls_stops_the_loop(server, mcp):
    before = len(executions(mcp))
    output = items(client(server).responses.create(
        **request("ls", require_approval="never", seed=7, max_tool_calls=1)))
    ran = executions(mcp)[before:]
    assert [e["tool"] for e in ran] == ["ls"], (output, server.log_tail(30))
    calls = [item for item in output if item["type"] == "mcp_call"]
    assert calls[0]["output"] == f"ls ran {ran[0]['cmd']!r}" and calls[0]["status"] == "completed"
    assert all(c["status"] == "incomplete" and "max_tool_calls" in error_text(c)
               for c in calls[1:]), output
    before = len(executions(mcp))
    output = items(client(server).responses.create(
        **request("ls", require_approval="never", seed=7, max_tool_calls=0)))
    assert executions(mcp)[before:] == [], output
    call = only("mcp_call", output)
    assert call["status"] == "incomplete" and "max_tool_calls" in error_text(call), output


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_server_side_tool_outside_allowed_tools_never_runs(server, mcp, stream):
    """Both tool servers offered, none gated by the client, no max_tool_calls: a required turn
    over ``container.ls`` runs ``ls`` (the requirement) and nothing else, and ends: the loop's
    later generations are ``auto`` (a call is no longer forced once one ran), and the server's
    bound stops a model that keeps calling."""
    tools = [{"type": "mcp", "server_label": "container", "require_approval": "never"},
             {"type": "mcp", "server_label": "code_interpreter", "require_approval": "never"}]
    api = openai.OpenAI(base_url=server.base_url, api_key="key-a", max_retries=0, timeout=300)
    ended_before_the_bound = 0
    for seed in (21, 22, 23):
        before = len(executions(mcp))
        body = request("ls", require_approval="never", seed=seed, tools=tools,
                       max_output_tokens=64)
        response = streamed(api, body)[0] if stream else api.responses.create(**body)
        ran = executions(mcp)[before:]
        output = items(response)
        assert ran and {e["tool"] for e in ran} == {"ls"}, (seed, ran, output, server.log_tail(30))
        assert len(ran) <= SERVER_CALL_LIMIT, (seed, ran)
        calls = [item for item in output if item["type"] == "mcp_call"]
        assert calls and all(c["name"] == "ls" and c["server_label"] == "container" for c in calls)
        assert [c["status"] for c in calls[:len(ran)]] == ["completed"] * len(ran), output
        assert all(c["status"] == "incomplete" for c in calls[len(ran):]), output
        ended_before_the_bound += len(ran) < SERVER_CALL_LIMIT and output[-1]["type"] == "message"
    # a call forced on every generation could only end at the bound
    assert ended_before_the_bound, "no required turn ended on its own after its call ran"


def test_streamed_pause_and_accept(server, mcp):
    api = client(server)
    before = len(executions(mcp))
    final, events = streamed(api, request("ls", seed=8))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added][-1] == "mcp_approval_request", added
    assert all(i.type != "mcp_call" for i in added), added   # the call never showed as made
    approval = only("mcp_approval_request", items(final))
    assert len(executions(mcp)) == before
    final, events = streamed(api, request("ls", seed=8, input_=answer_mcp(approval.copy(), True)))
    assert len(executions(mcp)) == before + 1
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].type == "mcp_call" and done[0].approval_request_id == approval["id"], done
    assert done[0].output and items(final)[0]["output"] == done[0].output
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    indexes = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert indexes == list(range(len(indexes))), indexes


def test_a_client_gone_while_the_call_runs_ends_with_one_execution(server, mcp):
    approval = only("mcp_approval_request", pause(server, mcp, "slow", seed=9))
    before = len(executions(mcp))
    payload = request("slow", seed=9, input_=answer_mcp(approval, True), stream=True)
    payload.update(payload.pop("extra_body"))
    with httpx.stream("POST", f"{server.base_url}/responses", json=payload, timeout=60,
                      headers={"Authorization": "Bearer key-a"}) as reply:
        assert reply.status_code == 200
        deadline = time.monotonic() + 30
        while len(executions(mcp)) == before and time.monotonic() < deadline:
            time.sleep(0.1)
    # the client left while `slow` ran; the accept sent again runs nothing new
    time.sleep(4)
    output = items(client(server).responses.create(**request("slow", seed=9,
                                                             input_=answer_mcp(approval, True))))
    assert [e["tool"] for e in executions(mcp)[before:]] == ["slow"], output
    assert output[0]["approval_request_id"] == approval["id"]


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "mcp", "server_label": "container", "require_approval": 3}], None,
     "tools[0].require_approval"),
    ([{"type": "mcp", "require_approval": "never"}], None, "tools[0].server_label"),
    ([{"type": "mcp", "server_label": "container", "require_approval": {"always": {"tool_names": "ls"}}}],
     None, "tools[0].require_approval.always.tool_names"),
    ([{"type": "mcp", "server_label": "container"}],
     {"type": "allowed_tools", "mode": "required", "tools": [{"type": "mcp"}]},
     "tool_choice.tools[0].server_label"),
    ([{"type": "mcp", "server_label": "container"}],
     {"type": "allowed_tools", "mode": "required", "tools": [{"type": "mcp", "server_label": "container", "name": 7}]},
     "tool_choice.tools[0].name"),
    ([{"type": "code_interpreter", "container": {"type": "auto"}, "require_approval": "always"}], None,
     "tools[0].require_approval"),
])
def test_malformed_server_tools_are_a_400_naming_the_field(server, tools, choice, param):
    body = {"model": "tiny", "input": "hi", "tools": tools, "max_output_tokens": 8}
    if choice is not None:
        body["tool_choice"] = choice
    reply = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("answer, param", [
    ({"type": "mcp_approval_response", "approval_request_id": 5, "approve": True},
     "input[1].approval_request_id"),
    ({"type": "mcp_approval_response", "approval_request_id": "elicit_x", "approve": "yes"},
     "input[1].approve"),
    ({"type": "mcp_approval_response", "approval_request_id": "elicit_nope", "approve": True},
     "input[1].approval_request_id"),
])
def test_malformed_answers_are_a_4xx_and_run_nothing(server, mcp, answer, param):
    before = len(executions(mcp))
    body = request("ls", input_=[USER, answer])
    body.update(body.pop("extra_body"))
    reply = httpx.post(f"{server.base_url}/responses", json=body, timeout=60,
                       headers={"Authorization": "Bearer key-a"})
    assert 400 <= reply.status_code < 500 and reply.json()["error"]["param"] == param, reply.text
    assert len(executions(mcp)) == before


def test_a_streamed_ungated_call_shows_its_output_after_it_ran(server, mcp):
    before = len(executions(mcp))
    final, events = streamed(client(server), request("ls", require_approval="never", seed=10,
                                                     max_tool_calls=1))
    ran = executions(mcp)[before:]
    assert [e["tool"] for e in ran] == ["ls"], events
    done = [e.item for e in events if e.type == "response.output_item.done"
            and e.item.type == "mcp_call"]
    assert done[0].output == f"ls ran {ran[0]['cmd']!r}" and done[0].status == "completed"
    assert done[-1].status == "incomplete"   # the call after max_tool_calls, not run
    assert next(i["output"] for i in items(final) if i["type"] == "mcp_call") == done[0].output


def test_a_client_gone_while_a_call_waits_for_approval_runs_nothing(server, mcp):
    before = len(executions(mcp))
    payload = request("ls", seed=12, stream=True)
    payload.update(payload.pop("extra_body"))
    with httpx.stream("POST", f"{server.base_url}/responses", json=payload, timeout=60,
                      headers={"Authorization": "Bearer key-a"}) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())   # the stream started; the client leaves
    time.sleep(3)
    assert len(executions(mcp)) == before
    # the next turn of the same client is served as usual: its call pauses again
    assert only("mcp_approval_request", pause(server, mcp, "ls", seed=12))


def test_a_streamed_elicitation_is_answered_and_runs_once(server, mcp):
    api = client(server)
    before = len(executions(mcp))
    final, events = streamed(api, request("exec", require_approval="never", seed=13))
    elicitation = only("elicitation", items(final))
    assert [e.item.type for e in events if e.type == "response.output_item.added"][-1] == "elicitation"
    answer = [USER, elicitation, {"type": "elicitation_response", "id": "resp_accept_13",
                                  "elicitation_id": elicitation["id"], "action": "accept",
                                  "scope": "once"}]
    final, events = streamed(api, request("exec", require_approval="never", seed=13, input_=answer))
    assert [e["tool"] for e in executions(mcp)[before:]] == ["exec"], events
    assert items(final)[0]["approval_request_id"] == elicitation["id"]


def test_the_python_built_in_pauses_and_runs_once_after_an_accept(server, mcp):
    tools = [{"type": "mcp", "server_label": "code_interpreter", "require_approval": "always"}]
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "mcp", "server_label": "code_interpreter"}]}
    before = len(executions(mcp))
    first = items(client(server).responses.create(**request("python", seed=14, tools=tools,
                                                            tool_choice=choice)))
    approval = only("mcp_approval_request", first)
    assert (approval["server_label"], approval["name"]) == ("code_interpreter", "python")
    assert len(executions(mcp)) == before
    body = request("python", seed=14, tools=tools, tool_choice=choice,
                   input_=answer_mcp(approval, True))
    output = items(client(server).responses.create(**body))
    assert [e["tool"] for e in executions(mcp)[before:]] == ["python"], output
    assert output[0]["type"] == "mcp_call" and output[0]["approval_request_id"] == approval["id"]
    assert output[0]["output"] == f"python ran {approval['arguments']!r}"


# -- agents' requests: client functions next to server-side tools; tools that fail; broken calls

FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                           "required": ["city"], "additionalProperties": False}}
CONTAINER = {"type": "mcp", "server_label": "container", "require_approval": "never"}
CODE = {"type": "code_interpreter", "container": {"type": "auto"}}
SELECTIONS = {
    "function": [{"type": "function", "name": "get_weather"}],
    "mcp": [{"type": "mcp", "server_label": "container", "name": "ls"}],
    "code_interpreter": [{"type": "code_interpreter"}],
    "all": [{"type": "function", "name": "get_weather"},
            {"type": "mcp", "server_label": "container", "name": "ls"}, {"type": "code_interpreter"}],
}
#: harmony's <|call|> and <|return|>
CALL, RETURN = "200012", "200002"


def biased(**bias: float) -> dict:
    """The marker nudges with some token biases changed (token id -> bias; None drops it)."""
    logit_bias = dict(nudges()["logit_bias"])
    for token, value in bias.items():
        logit_bias.pop(token.lstrip("_"), None)
        if value is not None:
            logit_bias[token.lstrip("_")] = value
    return {"logit_bias": logit_bias}


def failures(server, reason: str) -> float:
    """``vllm_allowed_tools:server_tool_failures_total{reason}`` on the server's /metrics."""
    text = httpx.get(f"{server.root_url}/metrics", timeout=30).text
    prefix = f'vllm_allowed_tools:server_tool_failures_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def answer(api: openai.OpenAI, body: dict, stream: bool) -> tuple[list[dict], list]:
    if stream:
        final, events = streamed(api, body)
        return items(final), events
    return items(api.responses.create(**body)), []


def test_a_function_next_to_server_side_tools_is_refused_by_vanilla_vllm_and_served_here(
        server, mcp):
    """vLLM renders every tool of a request that has a function into harmony's developer message
    and refuses an ``mcp`` tool there (its own function, unwrapped, on the request as vLLM reads
    it: the 400 vanilla answers); with the plugin the function is rendered as a function and the
    ``mcp`` built-in as a built-in."""
    from vllm.entrypoints.openai.parser import harmony_utils
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    body = {"model": "tiny", "input": "Run it.", "tools": [FUNCTION, CONTAINER, CODE],
            "max_output_tokens": 8}
    vanilla = inspect.unwrap(harmony_utils.get_developer_message)
    with pytest.raises(Exception, match="tool type 'mcp' is not supported") as refused:
        vanilla(tools=ResponsesRequest.model_validate(body).tools)
    # a VLLMValidationError: vLLM's serving answers it as a 400 naming the parameter
    assert type(refused.value).__name__ == "VLLMValidationError" and refused.value.parameter == "tools"
    served = httpx.post(f"{server.base_url}/responses", json=body, timeout=120,
                        headers={"Authorization": "Bearer key-a"})
    assert served.status_code == 200, served.text
    assert any(item["type"] in ("mcp_call", "function_call", "message", "reasoning")
               for item in served.json()["output"]), served.text


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_allowed_tools_over_a_function_an_mcp_tool_and_code_interpreter(server, mcp, selection,
                                                                        stream):
    """One request offers a client function, the ``container`` mcp tool and code_interpreter; a
    required selection of any of them (or all) gets a call of a selected one, and the MCP servers'
    log shows that only a selected server-side tool ran."""
    api = openai.OpenAI(base_url=server.base_url, api_key="key-a", max_retries=0, timeout=300)
    before = len(executions(mcp))
    body = request("ls", require_approval="never", seed=31, tools=[FUNCTION, CONTAINER, CODE],
                   tool_choice={"type": "allowed_tools", "mode": "required",
                                "tools": SELECTIONS[selection]},
                   max_tool_calls=1, max_output_tokens=96)
    output, _ = answer(api, body, stream)
    ran = [e["tool"] for e in executions(mcp)[before:]]
    functions = [item for item in output if item["type"] == "function_call"]
    assert all(f["name"] == "get_weather" and json.loads(f["arguments"])["city"] in ("Paris", "Rome")
               for f in functions), output
    expected = {"function": set(), "mcp": {"ls"}, "code_interpreter": {"python"},
                "all": {"ls", "python"}}[selection]
    assert set(ran) <= expected and len(ran) <= 1, (ran, output)
    if selection == "function":
        assert functions and not ran, output
    elif selection == "all":
        assert bool(functions) != bool(ran), (ran, output)   # one call: the required one
    else:
        assert ran and not functions, (ran, output, server.log_tail(30))
    if "ls" in ran:
        call = next(item for item in output if item["type"] == "mcp_call")
        assert call["status"] == "completed" and call["output"].startswith("ls ran"), output


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_tool_that_fails_is_a_failed_call_the_model_sees(server, mcp, stream):
    api = client(server)
    before, counted = len(executions(mcp)), failures(server, "tool_error")
    output, events = answer(api, request("fail", require_approval="never", seed=32,
                                         max_tool_calls=1), stream)
    assert [e["tool"] for e in executions(mcp)[before:]] == ["fail"], output
    call = next(item for item in output if item["type"] == "mcp_call")
    assert call["status"] == "failed" and "fail" in error_text(call) and not call["output"], call
    assert output[-1] is not call, output   # the loop went on: the model answered after it
    assert failures(server, "tool_error") == counted + 1
    if stream:
        kinds = [e.type for e in events]
        assert "response.mcp_call.failed" in kinds and "response.mcp_call.completed" not in kinds


def test_a_tool_server_gone_while_its_call_runs_is_a_failed_call(server, mcp):
    before, counted = len(executions(mcp)), failures(server, "raised")
    try:
        output = items(client(server).responses.create(
            **request("crash", require_approval="never", seed=33, max_tool_calls=1)))
    finally:
        mcp[3]()   # the container server again, for the tests after this one
    assert [e["tool"] for e in executions(mcp)[before:]] == ["crash"], output
    call = next(item for item in output if item["type"] == "mcp_call")
    assert call["status"] == "failed" and "This tool call failed" in error_text(call), call
    assert output[-1] is not call and failures(server, "raised") == counted + 1, output


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_call_cut_off_by_the_token_limit_is_never_run_nor_asked(server, mcp, stream):
    """``note`` takes a free string, which the random model does not close (``<|call|>`` pushed
    down so that it never ends the string early): the call is cut off by max_output_tokens."""
    before, counted = len(executions(mcp)), failures(server, "cut_off")
    body = request("note", seed=34, max_output_tokens=40,
                   extra_body={"seed": 34, **biased(**{f"_{CALL}": -100.0})})
    output, events = answer(client(server), body, stream)
    assert executions(mcp)[before:] == [], output
    assert not [item for item in output if item["type"] in ("mcp_approval_request", "elicitation")]
    call = only("mcp_call", output)
    assert call["status"] == "incomplete" and "cut off" in error_text(call), call
    assert failures(server, "cut_off") == counted + 1
    if stream:
        assert events[-1].type == "response.incomplete", events[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_call_whose_arguments_do_not_parse_is_never_run_nor_asked(server, mcp, stream):
    """With ``<|call|>`` nudged up, the random model writes it inside ``note``'s string (a JSON
    string may hold a special token): harmony's parser ends the call there, its arguments cut."""
    before, counted = len(executions(mcp)), failures(server, "not_json")
    output, _ = answer(client(server), request("note", seed=35, max_output_tokens=40), stream)
    assert executions(mcp)[before:] == [], output
    assert not [item for item in output if item["type"] in ("mcp_approval_request", "elicitation")]
    call = only("mcp_call", output)
    assert call["status"] == "incomplete" and "not JSON" in error_text(call), call
    assert failures(server, "not_json") == counted + 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_call_ends_with_call_where_another_stop_token_is_likelier(server, mcp, stream):
    """``<|return|>`` pushed up, ``<|call|>`` left alone: vLLM's tag would let the model end the
    call with ``<|return|>`` (and vLLM's loop run it); the grammar admits only ``<|call|>``."""
    before = len(executions(mcp))
    body = request("ls", require_approval="never", seed=36, max_tool_calls=1,
                   extra_body={"seed": 36, **biased(**{f"_{CALL}": None, f"_{RETURN}": 40.0})})
    output, _ = answer(client(server), body, stream)
    ran = executions(mcp)[before:]
    assert [e["tool"] for e in ran] == ["ls"], (output, server.log_tail(30))
    call = next(item for item in output if item["type"] == "mcp_call")
    assert call["status"] == "completed" and json.loads(call["arguments"]) == {"cmd": ran[0]["cmd"]}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_web_search_runs_against_a_local_browser_server(server, mcp, stream):
    """``web_search_preview`` runs vLLM's ``browser`` on the MCP server named so; streamed, its
    ``web_search_call`` events pass the server's own conformance check (its check log)."""
    from vllm_allowed_tools.response.conformance_check import CHECK_LOG_ENV
    check_log = Path(os.environ[CHECK_LOG_ENV])
    checked_before = check_log.stat().st_size
    tools = [{"type": "web_search_preview"}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search_preview"}]}
    before = len(executions(mcp))
    output, events = answer(client(server), request("search", seed=37, tools=tools, tool_choice=choice,
                                                    max_tool_calls=1), stream)
    ran = executions(mcp)[before:]
    assert [e["tool"] for e in ran] in (["search"], ["open"], ["find"]), (output, server.log_tail(30))
    calls = [item for item in output if item["type"] == "web_search_call"]
    assert calls and calls[0]["status"] == "completed", output
    assert not [item for item in output if item["type"] == "mcp_call"], output
    with check_log.open(encoding="utf-8") as handle:
        handle.seek(checked_before)
        records = [json.loads(line) for line in handle if line.strip()]
    assert records and not [r for r in records if r["problems"]], records
    if stream:
        kinds = [e.type for e in events]
        for kind in ("in_progress", "searching", "completed"):
            assert f"response.web_search_call.{kind}" in kinds, kinds
        assert not [k for k in kinds if k.startswith("response.mcp_call")], kinds
        assert {f"response.web_search_call.{k}" for k in ("in_progress", "searching", "completed")} \
            <= {r["type"] for r in records}, records


def _store_rows(path, elicitation_id: str) -> tuple[str | None, tuple | None]:
    conn = sqlite3.connect(path)
    try:
        status = conn.execute("SELECT status FROM elicitations WHERE id = ?",
                              (elicitation_id,)).fetchone()
        run = conn.execute("SELECT recipient, output FROM server_executions WHERE "
                           "elicitation_id = ?", (elicitation_id,)).fetchone()
        return (status[0] if status else None), run
    finally:
        conn.close()


def test_zz_the_api_server_killed_between_an_accept_and_the_run(server, mcp):
    """Last in the module: it kills the server and starts it again on the same grant store."""
    approval = only("mcp_approval_request", pause(server, mcp, "ls", seed=11))
    before = len(executions(mcp))
    body = request("ls", seed=11, input_=answer_mcp(approval, True))
    tool_server = mcp[2]["container"]
    os.kill(tool_server.pid, signal.SIGSTOP)   # vLLM now waits to open the tool session
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pending = pool.submit(lambda: client(server).with_options(timeout=120).responses.create(**body))
        deadline = time.monotonic() + 60
        while _store_rows(server.store, approval["id"])[0] != "accepted":
            assert time.monotonic() < deadline, "the accept was never consumed"
            time.sleep(0.1)
        time.sleep(1.0)
        kill_server_hard(server.current.process.pid)   # accepted, not yet run
    finally:
        os.kill(tool_server.pid, signal.SIGCONT)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        pending.result(timeout=60)
    pool.shutdown()
    assert len(executions(mcp)) == before
    assert _store_rows(server.store, approval["id"]) == ("accepted", None)   # the approval kept
    server.restart()
    output = items(client(server).responses.create(**body))
    assert [e["tool"] for e in executions(mcp)[before:]] == ["ls"], output
    assert output[0]["approval_request_id"] == approval["id"] and output[0]["output"]
    client(server).responses.create(**body)
    assert len(executions(mcp)) == before + 1
    status, run = _store_rows(server.store, approval["id"])
    assert status == "accepted" and run == ("container.ls", output[0]["output"])

"""A reasoning model under allowed_tools, served for real on both constraint stages and endpoints.

The tiny ``thinking`` model writes ``<think>\\n<a few words>\\n</think>\\n\\n`` and then calls a tool
of the prompt's catalog (mostly one a 2-of-8 allowlist does not allow). Served with
``--reasoning-parser qwen3``, the allowed-subset grammar applies only after reasoning ends, on
either stage: reasoning comes back (Chat ``reasoning``, a Responses ``reasoning`` item before the
calls, its deltas before the calls' events when streamed), and the calls are only allowed ones.
The logits-processor server runs the ``guidance`` backend, which cannot compile structural tags,
so every constrained answer it gives was constrained by our logits processor. Both servers carry an
approval policy gating one tool, which the other tests leave out of their catalogs.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME

from support.calls import chat_calls, chat_selection, responses_calls, responses_selection
from support.metrics import scrape_metric
from support.servers import load_script, start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

GATED = "send_email"
STAGES = {
    "logits-processor": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor"},
                         ["--structured-outputs-config.backend", "guidance"]),
    "native": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}, []),
}
REASONING = ["--reasoning-parser", "qwen3"]
UNGATED = [tool for tool in POOL if tool.name != GATED]
SEEDS = range(4)


@pytest.fixture(scope="module", params=sorted(STAGES))
def thinking_server(request, tmp_path_factory):
    policy = tmp_path_factory.mktemp("reasoning-approvals") / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": [GATED], "approval": "required",
                                             "scopes": ["once", "session"]}]}))
    ensure_model("thinking", log=lambda *_: None)   # built before the server's start-up deadline
    env, args = STAGES[request.param]
    server = start_cli_server("thinking", env={**env, "VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)},
                              extra_args=[*args, *REASONING])
    yield server
    stop_cli_server(server)


def _catalog_and_subset(seed: int) -> tuple[list, list[str]]:
    rng = random.Random(seed)
    catalog = rng.sample(UNGATED, 8)
    return catalog, [tool.name for tool in rng.sample(catalog, 2)]


def _parser_drops(server) -> float:
    return scrape_metric(server.root_url, "vllm_allowed_tools:violations_total", source="parser")


def _chat(client, catalog, mode, allowed, seed, *, stream=False, history=(), max_tokens=120):
    """(reasoning, calls, text) of one Chat answer; a stream is also checked to send every
    reasoning delta before the first call delta."""
    request = dict(model="tiny", tools=[tool.chat_tool() for tool in catalog],
                   messages=[{"role": "user", "content": "Go ahead."}, *history],
                   tool_choice=chat_selection(mode, allowed), parallel_tool_calls=False,
                   max_tokens=max_tokens, temperature=1.0, seed=seed)
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        reasoning = getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)
        return reasoning or "", [(c.function.name, c.function.arguments)
                                 for c in message.tool_calls or []], message.content or ""
    reasoning, text, calls, order = [], [], {}, []
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning", None) or getattr(delta, "reasoning_content", None)
        if piece:
            reasoning.append(piece)
            order.append("reasoning")
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            order.append("call")
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += (call.function.name or "") if call.function else ""
            entry[1] += (call.function.arguments or "") if call.function else ""
    if "call" in order:   # no reasoning after the first call delta
        assert "reasoning" not in order[order.index("call"):], order
    return "".join(reasoning), [tuple(calls[i]) for i in sorted(calls)], "".join(text)


def _responses(client, catalog, mode, allowed, seed, *, stream=False, history=None, max_tokens=120):
    """(output items as dicts, stream event types or None) of one Responses answer."""
    request = dict(model="tiny", tools=[tool.responses_tool() for tool in catalog],
                   input=history or "Go ahead.", tool_choice=responses_selection(mode, allowed),
                   parallel_tool_calls=False, max_output_tokens=max_tokens, temperature=1.0,
                   extra_body={"seed": seed})
    if not stream:
        return client.responses.with_raw_response.create(**request).http_response.json()["output"], None
    with client.responses.with_streaming_response.create(stream=True, **request) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", events[-1]
    return events[-1]["response"]["output"], events


def _check_responses_output(output, allowed, events=None):
    """A reasoning item with text, before every call; calls only allowed and valid."""
    types = [item["type"] for item in output]
    assert types and types[0] == "reasoning", types
    reasoning = "".join(part.get("text", "") for part in output[0].get("content") or ())
    assert reasoning.strip(), output[0]
    calls = [item for item in output if item["type"] == "function_call"]
    assert calls and all(c["name"] in allowed and POOL_BY_NAME[c["name"]].arguments_valid(c["arguments"])
                         for c in calls), calls
    if events is not None:
        kinds = [event["type"] for event in events]
        first_call = min(i for i, e in enumerate(events) if e["type"] == "response.output_item.added"
                         and e["item"]["type"] == "function_call")
        assert "response.reasoning_text.delta" in kinds[:first_call]
        assert "response.reasoning_text.delta" not in kinds[first_call:]
    return calls


# ------------------------------------------------------------------- required: reasoning, then calls

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_required_keeps_reasoning_and_gives_only_allowed_calls_on_chat(thinking_server, stream):
    client, before = thinking_server.client(), _parser_drops(thinking_server)
    for seed in SEEDS:
        catalog, allowed = _catalog_and_subset(seed)
        reasoning, calls, text = _chat(client, catalog, "required", allowed, seed, stream=stream)
        assert reasoning.strip(), (seed, reasoning, calls, text)
        assert "<tool_call>" not in reasoning and "<think>" not in text, (reasoning, text)
        assert len(calls) == 1 and calls[0][0] in allowed, (seed, calls, text)
        assert POOL_BY_NAME[calls[0][0]].arguments_valid(calls[0][1]), calls
    assert _parser_drops(thinking_server) == before, "the grammar did not constrain the calls"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_required_keeps_reasoning_and_gives_only_allowed_calls_on_responses(thinking_server, stream):
    client, before = thinking_server.client(), _parser_drops(thinking_server)
    for seed in SEEDS:
        catalog, allowed = _catalog_and_subset(seed)
        output, events = _responses(client, catalog, "required", allowed, seed, stream=stream)
        assert len(_check_responses_output(output, allowed, events)) == 1
    assert _parser_drops(thinking_server) == before, "the grammar did not constrain the calls"


# ------------------------------------------------------------------- auto against the adversary

def test_auto_never_calls_outside_the_allowlist_after_reasoning(thinking_server):
    """Without a policy the thinking model calls outside a 2-of-8 allowlist most of the time; with
    one in auto mode, never, and the parser never had to drop a call (the grammar did it)."""
    client, trials = thinking_server.client(), 12
    before = _parser_drops(thinking_server)
    outside_without = reasoned = called = 0
    for seed in range(trials):
        catalog, allowed = _catalog_and_subset(100 + seed)
        plain = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go ahead."}], max_tokens=80,
            tools=[tool.chat_tool() for tool in catalog], temperature=1.0, seed=seed).choices[0].message
        outside_without += any(c.function.name not in allowed for c in plain.tool_calls or [])
        reasoning, calls, _ = _chat(client, catalog, "auto", allowed, seed, stream=seed % 2 == 1,
                                    max_tokens=80)
        assert all(name in allowed for name, _ in calls), (seed, calls)
        reasoned += bool(reasoning.strip())
        called += bool(calls)
        output, _ = _responses(client, catalog, "auto", allowed, seed, max_tokens=80)
        assert all(i["name"] in allowed for i in output if i["type"] == "function_call"), output
    assert outside_without >= trials // 2, "the adversary got weak: the test would be hollow"
    assert reasoned >= trials - 1 and called > 0, (reasoned, called)
    assert _parser_drops(thinking_server) == before, "the grammar did not constrain the calls"


# ------------------------------------------------------------------- reasoning in the history

def test_a_second_chat_turn_with_reasoning_in_the_history_still_enforces(thinking_server):
    client = thinking_server.client()
    for seed in SEEDS:
        catalog, allowed = _catalog_and_subset(seed)
        reasoning, calls, _ = _chat(client, catalog, "required", allowed, seed)
        history = [{"role": "assistant", "content": None, "reasoning": reasoning, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": calls[0][0], "arguments": calls[0][1]}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"ok": True})}]
        second = sorted({t.name for t in catalog} - set(allowed))[:2]
        for stream in (False, True):
            again, calls2, text = _chat(client, catalog, "required", second, seed + 10,
                                        history=history, stream=stream)
            assert again.strip() and len(calls2) == 1 and calls2[0][0] in second, (again, calls2, text)


def test_a_second_responses_turn_with_the_reasoning_item_passed_back_still_enforces(thinking_server):
    client = thinking_server.client()
    for seed in SEEDS:
        catalog, allowed = _catalog_and_subset(seed)
        output, _ = _responses(client, catalog, "required", allowed, seed)
        call = _check_responses_output(output, allowed)[0]
        history = [{"role": "user", "content": "Go ahead."}, *output,
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
        second = sorted({t.name for t in catalog} - set(allowed))[:2]
        for stream in (False, True):
            output2, events = _responses(client, catalog, "required", second, seed + 10,
                                         history=history, stream=stream)
            _check_responses_output(output2, second, events)


# ------------------------------------------------------------------- approvals

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_gated_call_after_reasoning_is_an_elicitation(thinking_server, stream):
    """Only the gated tool is allowed: the model reasons, its call comes back as an elicitation
    after the reasoning item, and accepting it (reasoning passed back too) releases that call
    without a model call."""
    client = thinking_server.client()
    tools = [POOL_BY_NAME[GATED], POOL_BY_NAME["get_weather"]]
    key = f"reasoning-{stream}"
    request = dict(model="tiny", tools=[tool.responses_tool() for tool in tools],
                   tool_choice=responses_selection("required", [GATED]), parallel_tool_calls=False,
                   max_output_tokens=120, temperature=1.0,
                   extra_body={"seed": 5, "prompt_cache_key": key})
    if stream:
        with client.responses.with_streaming_response.create(stream=True, input="Send it.",
                                                             **request) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        output = events[-1]["response"]["output"]
        assert not any(e["type"].startswith("response.function_call_arguments") for e in events)
        kinds = [e["type"] for e in events]
        assert "response.reasoning_text.delta" in kinds
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == \
            ["reasoning", "elicitation"]
    else:
        output = client.responses.with_raw_response.create(input="Send it.", **request) \
            .http_response.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "elicitation"], output
    elicitation = output[1]
    assert elicitation["name"] == GATED and POOL_BY_NAME[GATED].arguments_valid(elicitation["arguments"])
    answer = {"id": f"er_{key}", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "accept", "scope": "once"}
    before = scrape_metric(thinking_server.root_url, "vllm:prompt_tokens_total")
    released = client.responses.with_raw_response.create(
        input=[{"role": "user", "content": "Send it."}, *output, answer], **request).http_response.json()
    assert [(i["type"], i["call_id"]) for i in released["output"]] == \
        [("function_call", elicitation["call_id"])], released["output"]
    assert scrape_metric(thinking_server.root_url, "vllm:prompt_tokens_total") == before


def test_chat_gated_tool_leaves_the_allowlist_and_reasoning_stays(thinking_server):
    """Chat cannot ask: the gated tool leaves an auto turn's allowlist; the turn still reasons."""
    client = thinking_server.client()
    tools = [POOL_BY_NAME[GATED], POOL_BY_NAME["get_weather"]]
    for seed in SEEDS:
        reasoning, calls, _ = _chat(client, tools, "auto", [GATED, "get_weather"], seed)
        assert reasoning.strip() and all(name == "get_weather" for name, _ in calls), calls
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Send it."}],
            "tools": [tool.chat_tool() for tool in tools], "max_tokens": 60,
            "tool_choice": chat_selection("required", [GATED])}
    refused = httpx.post(thinking_server.base_url + "/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "tool_needs_approval"


# ------------------------------------------------------------------- the guard after reasoning

FAULTY_PLUGIN = __import__("pathlib").Path(__file__).parent / "plugins" / "faulty_parser.py"


@pytest.fixture(scope="module")
def faulty_thinking_server():
    """tests/plugins/faulty_parser.py renames every parsed call to a disallowed tool, after our
    wrapper's filtering: only the output guard stands between it and the client."""
    server = start_cli_server("thinking", options=["--parser", "allowed_faulty"],
                              extra_args=["--tool-parser-plugin", str(FAULTY_PLUGIN), *REASONING],
                              env={"VLLM_ALLOWED_TOOLS_EXTRA_PARSERS": "allowed_faulty"})
    yield server
    stop_cli_server(server)


def test_a_violation_after_reasoning_ends_the_responses_stream_with_the_reasoning_kept(
        faulty_thinking_server):
    catalog, allowed = _catalog_and_subset(3)
    forbidden = min({tool.name for tool in catalog} - set(allowed))
    body = {"model": "tiny", "input": "Go ahead.", "tools": [t.responses_tool() for t in catalog],
            "tool_choice": responses_selection("required", allowed), "stream": True,
            "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 1.0, "seed": 1}
    with httpx.stream("POST", faulty_thinking_server.base_url + "/responses", json=body,
                      timeout=120) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds.count("response.failed") == 1 and kinds[-1] == "response.failed", kinds
    assert "response.reasoning_text.delta" in kinds, kinds
    failed = events[-1]["response"]
    assert failed["error"]["code"] == "allowed_tools_violation"
    assert [item["type"] for item in failed["output"]] == ["reasoning"], failed["output"]
    assert failed["output"][0]["status"] == "completed"
    for event in events:   # no byte of the refused call: no item, delta or done names it
        assert (event.get("item") or {}).get("name") != forbidden and event.get("name") != forbidden
        assert "function_call" not in event["type"], event
    numbers = [event["sequence_number"] for event in events]
    assert numbers == sorted(set(numbers))


def test_a_violation_after_reasoning_ends_the_chat_stream_after_its_reasoning(faulty_thinking_server):
    catalog, allowed = _catalog_and_subset(3)
    forbidden = min({tool.name for tool in catalog} - set(allowed))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}],
            "tools": [t.chat_tool() for t in catalog], "tool_choice": chat_selection("required", allowed),
            "stream": True, "parallel_tool_calls": False, "max_tokens": 120, "temperature": 1.0,
            "seed": 1}
    with httpx.stream("POST", faulty_thinking_server.base_url + "/chat/completions", json=body,
                      timeout=120) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines[-2].startswith('data: {"error"'), lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["code"] == "allowed_tools_violation"
    chunks = [json.loads(line[6:]) for line in lines[:-2]]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks if c.get("choices"))
    assert reasoning.strip(), chunks
    assert forbidden not in "".join(lines[:-2])   # before the error chunk


# ------------------------------------------------------------------- required never ends in reasoning

#: conversations (benchmarks/reasoning_required.py: two required turns each) whose turns ended inside
#: their reasoning on both stages before rows that must call were held (seed 4's second turn on Chat
#: unary, 15's second on Responses streamed, 23's first on Responses streamed), and three more
REPRODUCING = (4, 15, 23)


def test_a_required_turn_never_ends_inside_its_reasoning(thinking_server):
    bench = load_script("benchmarks", "reasoning_required")
    outcomes = [(label, bench.outcome(turn, allowed))
                for seed in (*REPRODUCING, 40, 41, 42)
                for label, turn, allowed in bench.play(thinking_server.base_url, seed, 120)]
    assert len(outcomes) >= 10 and all(kind == "call" for _, kind in outcomes), outcomes


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_reasoning_is_cut_so_the_call_fits_a_small_budget(thinking_server, api):
    """``</think>`` pushed out of reach (logit_bias -100): the model would reason to the token limit
    and end without a call; the row is made to end its reasoning while the budget holds the call."""
    client, end = thinking_server.client(), "655"   # the thinking tokenizer's </think>
    catalog, allowed = _catalog_and_subset(7)
    fetch = chat_calls if api == "chat" else responses_calls
    for stream in (False, True):
        reply = fetch(client, catalog, "required", allowed, 7, stream=stream, max_tokens=70,
                      extra_body={"logit_bias": {end: -100}})
        assert len(reply.calls) == 1 and reply.calls[0][0] in allowed, (stream, reply)

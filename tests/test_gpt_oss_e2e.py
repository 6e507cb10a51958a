"""gpt-oss end to end: vLLM's harmony path (no chat template; openai_harmony renders, vLLM's
HarmonyParser reads the calls) under ``--tool-call-parser allowed_openai`` alone (the one-flag
launch), on a tiny gpt-oss model built offline (devtools/models/gpt_oss_model.py: the real
architecture, attention sinks and MoE included, random weights; vLLM's CPU build serves it).

The contract suite of the hermes path, on both endpoints: ``required`` gives only allowed calls (one
with ``parallel_tool_calls: false``), unary and streamed; ``auto`` never a disallowed call (and some
calls: a floor); Responses namespaces; invalid selections are a 400 naming the field; the per-turn
policy is a trailing developer message after the whole history, so the history is a shared token
prefix across subsets and turns; a gated tool elicits an approval instead of a call, and an accept
releases it.
"""

from __future__ import annotations

import json
import os
import random

import httpx
import openai
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME

from support.calls import (
    USER_TURN,
    chat_calls,
    chat_selection,
    responses_calls,
    responses_selection,
)
from support.gpt_oss import nudges
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

GATED = "send_email"


POLICY_BLOCK = "<|start|>developer<|message|># Instructions\n\nAllowed tools this turn ("


#: ``VLLM_ALLOWED_TOOLS_FAMILY_STAGES=all`` (the full matrix, as tests/test_families_e2e.py) also
#: serves the native stage on vLLM's guidance backend (the tags' Lark translation:
#: vllm_glue/guidance_tags.py); CI runs that backend on hermes (tests/test_constraint_e2e.py)
FULL_MATRIX = os.environ.get("VLLM_ALLOWED_TOOLS_FAMILY_STAGES", "").strip().lower() == "all"


@pytest.fixture(scope="module", params=["default", "native", *(["native-guidance"] if FULL_MATRIX else [])])
def server(request, tmp_path_factory):
    """One server per constraint stage: the CPU default (our logits processor) and vLLM's native
    structured outputs (on xgrammar; in the full matrix on guidance too)."""
    policy = tmp_path_factory.mktemp("gpt-oss") / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": [GATED], "approval": "required",
                                             "scopes": ["once"]}]}))
    env = {"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)}
    if request.param.startswith("native"):
        env["VLLM_ALLOWED_TOOLS_CONSTRAINT"] = "native"
    backend = ["--structured-outputs-config.backend", "guidance"] if request.param == "native-guidance" else []
    started = start_cli_server("random", options=["--parser", "allowed_openai", "--one-flag"],
                               extra_args=["--enable-scale-out", *backend], env=env)
    yield started
    stop_cli_server(started)


def catalog_and_subset(seed: int, size: int = 2):
    rng = random.Random(3000 + seed)
    catalog = rng.sample([tool for tool in POOL if tool.name != GATED], 8)
    return catalog, sorted(tool.name for tool in rng.sample(catalog, size))


def prompt_text(server, body: dict, endpoint: str = "chat/completions") -> tuple[list[int], str]:
    """The prompt vLLM would run for ``body`` (the render endpoint, through our middleware)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    reply = httpx.post(f"{server.base_url}/{endpoint}/render", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    ids = reply.json()["token_ids"]
    return ids, load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).decode(ids)


def test_the_launch_is_one_flag_and_the_policy_is_a_trailing_developer_message(server):
    log = server.log_text()
    assert "--middleware" not in log.split("vllm serve", 1)[-1].split("\n", 1)[0]
    assert "per-turn policy goes in by system-message" in log and "harmony" in log
    catalog, subset = catalog_and_subset(0)
    history = [{"role": "system", "content": "You are an agent."},
               {"role": "user", "content": "Do it."},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": catalog[0].name, "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"},
               {"role": "user", "content": "Next."}]
    tools = [tool.chat_tool() for tool in catalog]

    def render(names, messages=history, tool_list=tools):
        return prompt_text(server, {"model": "tiny", "messages": messages, "tools": tool_list,
                                    "tool_choice": chat_selection("required", names)})
    ids_a, text_a = render(subset)
    ids_b, _ = render([tool.name for tool in catalog[2:5]])
    ids_next, _ = render(subset, history + [{"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": "Again."}])
    ids_reordered, _ = render(subset, tool_list=tools[::-1])
    block = text_a.rindex(POLICY_BLOCK)
    assert text_a[block:].startswith(POLICY_BLOCK + "required): " + ", ".join(subset))
    assert text_a.index("Next.") < block   # after the whole history
    # the policy block is the only difference: every token before it is shared
    history_tokens = len(server_tokens(text_a[:block]))
    for other in (ids_b, ids_next):
        shared = next((i for i, (x, y) in enumerate(zip(ids_a, other)) if x != y), len(ids_a))
        assert shared >= history_tokens - 1, (shared, history_tokens)
    assert ids_reordered == ids_a   # the catalog is rendered in canonical order


def server_tokens(text: str) -> list[int]:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).encode(text, allowed_special="all")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_one_allowed_schema_valid_call(request, server, api, stream, seed):
    """Exactly one allowed call whose arguments the tool's schema accepts, on both APIs, unary and
    streamed (three seeds on the default stage, one on the native stage: the grammar is the same
    tag, and CI's time is bounded)."""
    if seed and "native" in request.node.callspec.id:
        pytest.skip("the native stage runs seed 0 (the default stage runs all three)")
    catalog, subset = catalog_and_subset(seed)
    fetch = chat_calls if api == "chat" else responses_calls
    reply = fetch(server.client(), catalog, "required", subset, seed, stream=stream, max_tokens=200,
                  extra_body=nudges())
    assert len(reply.calls) == 1 and reply.calls[0][0] in subset, (reply, server.log_tail(20))
    assert POOL_BY_NAME[reply.calls[0][0]].arguments_valid(reply.calls[0][1]), reply.calls


def test_without_the_nudges_a_call_ends_on_a_stop_token_the_parser_reads(request, server):
    """No ``logit_bias``: the random model ends a call with whichever stop token the grammar admits
    after its arguments. gpt-oss's generation config stops on ``<|endoftext|>`` too, which vLLM's
    HarmonyParser reads as argument text (``{...}<|endoftext|>``): on these seeds every endpoint,
    unary and streamed, on both stages, ended in a 500 ``arguments_not_object``. The token is
    refused (tests/test_harmony_stop_tokens.py), so each turn calls with JSON arguments."""
    cases = [("chat", False, 0), ("responses", True, 11), ("chat", True, 3), ("responses", False, 4)]
    for api, stream, seed in cases[:2] if "native" in request.node.callspec.id else cases:
        catalog, subset = catalog_and_subset(seed)
        fetch = chat_calls if api == "chat" else responses_calls
        reply = fetch(server.client(), catalog, "required", subset, seed, stream=stream, max_tokens=200)
        assert len(reply.calls) == 1 and reply.calls[0][0] in subset, (api, stream, seed, reply)
        assert POOL_BY_NAME[reply.calls[0][0]].arguments_valid(reply.calls[0][1]), (seed, reply.calls)


#: a free ``city`` string: without the nudges the random model's string runs on to the token limit
WEATHER_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]


def test_a_call_the_token_limit_cuts_goes_out_as_length_not_a_500(request, server):
    """No ``logit_bias``, unary Chat, ``auto`` (plain and as an ``allowed_tools`` selection): the
    model opens a call and its free ``city`` string runs to ``max_tokens``. vLLM's unary Chat
    reports such a turn as ``tool_calls``, which the guard read as a refused call (a 500
    ``arguments_not_object``); the choice now goes out as ``length`` with the cut call
    (response/unary.py, ``mark_cut_choice``). Measured on the default stage: seeds 1-4 and 6-11 of
    0-11 cut a call this way (0 and 5 run to the limit in text), on both choices; the guard is the
    same on both stages, so the default stage runs it."""
    if "native" in request.node.callspec.id:
        pytest.skip("the guard does not depend on the stage: the default stage runs it")
    names = {"get_weather", "get_time"}
    cut = 0
    for choice, seed in (("auto", 1), ("auto", 2), (chat_selection("auto", sorted(names)), 3)):
        body = {"model": "tiny", "messages": [{"role": "user", "content": USER_TURN}],
                "tools": WEATHER_TOOLS, "tool_choice": choice, "max_tokens": 200, "temperature": 1.0,
                "seed": seed}
        reply = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, (seed, reply.status_code, reply.text[:400])
        [answer] = reply.json()["choices"]
        finish, calls = answer["finish_reason"], answer["message"].get("tool_calls") or []
        arguments = [call["function"]["arguments"] for call in calls]
        assert finish in ("tool_calls", "stop", "length"), (seed, answer)
        assert all(call["function"]["name"] in names for call in calls), (seed, answer)
        if finish == "tool_calls":   # complete calls: JSON objects with the string the schema asks
            assert calls and all(isinstance((json_object(text) or {}).get("city"), str)
                                 for text in arguments), (seed, answer)
        elif finish == "stop":
            assert not calls, (seed, answer)
        elif calls and json_object(arguments[-1]) is None:
            cut += 1
    assert cut >= 1, (cut, server.log_tail(20))   # the case was exercised


def json_object(text: str) -> dict | None:
    """``text`` read as one JSON object, None when it is not one (e.g. cut)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_auto_never_calls_outside_the_subset(server, api):
    """Left alone (harmony's markers written as one token, nothing pushed), auto calls only allowed
    tools, and the model does call: a floor (measured: seeds 1 and 2 call, on both stages and both
    APIs; 3 of seeds 0-7), so the test cannot pass on answers without a call."""
    fetch = chat_calls if api == "chat" else responses_calls
    called = 0
    for seed in range(3):
        catalog, subset = catalog_and_subset(seed)
        reply = fetch(server.client(), catalog, "auto", subset, seed, max_tokens=120,
                      extra_body=nudges())
        assert all(call[0] in subset for call in reply.calls), (seed, reply.calls, subset)
        called += len(reply.calls)
    assert called >= 1, (api, called, server.log_tail(30))


def test_namespaced_responses_tools_are_refused_by_the_harmony_path_naming_tools(server):
    """vLLM's harmony path takes no ``namespace`` tools: a clean 400 naming ``tools`` (our selection
    resolved them; nothing is widened or half-served)."""
    catalog, _ = catalog_and_subset(4)
    tools = [{"type": "namespace", "name": "crm", "description": "CRM tools",
              "tools": [tool.responses_tool() for tool in catalog[:3]]},
             *[tool.responses_tool() for tool in catalog[3:]]]
    with pytest.raises(openai.BadRequestError, match="namespace") as refused:
        responses_calls(server.client(), None, "required", [catalog[1].name], 4, tools=tools)
    assert refused.value.body.get("param") == "tools", refused.value.body


def test_an_invalid_selection_is_a_400_naming_the_field(server):
    catalog, _ = catalog_and_subset(0)
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[tool.chat_tool() for tool in catalog],
                                       tool_choice=chat_selection("required", ["nope"]))
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.responses.create(model="tiny", input="x", tools=[tool.responses_tool() for tool in catalog],
                                tool_choice=responses_selection("required", ["nope"]))


def test_a_gated_tool_elicits_and_an_accept_releases_the_call(server):
    client = server.client()
    tools = [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME["get_weather"].responses_tool()]
    kwargs = dict(model="tiny", tools=tools, parallel_tool_calls=False, max_output_tokens=200,
                  temperature=1.0, tool_choice=responses_selection("required", [GATED]),
                  extra_body={"seed": 5, "prompt_cache_key": "oss-1", **nudges()})
    output = client.responses.with_raw_response.create(input="Send it.", **kwargs).http_response.json()["output"]
    [elicitation] = [item for item in output if item["type"] == "elicitation"]
    assert not [item for item in output if item["type"] == "function_call"]
    assert elicitation["name"] == GATED and POOL_BY_NAME[GATED].arguments_valid(elicitation["arguments"])
    answer = {"id": "er_1", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "accept", "scope": "once"}
    released = client.responses.with_raw_response.create(
        input=[{"role": "user", "content": "Send it."}, elicitation, answer], **kwargs).http_response.json()
    assert [(item["type"], item["call_id"]) for item in released["output"]] == \
        [("function_call", elicitation["call_id"])]


def test_built_in_tools_in_the_request_do_not_open_the_grammar(server):
    """vLLM's own harmony tag degrades to free text after ``to=`` when the request has built-in
    tools; ours is built from the allowed functions only, so the recipient stays constrained."""
    catalog, subset = catalog_and_subset(5)
    tools = [tool.responses_tool() for tool in catalog] + [{"type": "web_search_preview"},
                                                            {"type": "code_interpreter",
                                                             "container": {"type": "auto"}}]
    for seed in (5, 6):
        reply = responses_calls(server.client(), None, "required", subset, seed, tools=tools,
                                max_tokens=200, extra_body=nudges())
        assert len(reply.calls) == 1 and reply.calls[0][0] in subset, (seed, reply.raw)
        assert [item.type for item in reply.raw.output if item.type.endswith("_call")] == ["function_call"]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_preamble_that_would_not_end_leaves_room_for_the_call(server, api):
    """``<|end|>`` pushed out of reach (logit_bias -100): the analysis message would run to the
    token limit and the turn end without a call; each preamble message is bounded by what
    ``max_tokens`` leaves after the shortest allowed call, so the call comes."""
    fetch = chat_calls if api == "chat" else responses_calls
    bias = {**nudges()["logit_bias"], "200007": -100.0}   # o200k_harmony's <|end|>
    for seed in (0, 3):
        catalog, subset = catalog_and_subset(seed)
        reply = fetch(server.client(), catalog, "required", subset, seed, max_tokens=200,
                      extra_body={"logit_bias": bias})
        assert len(reply.calls) == 1 and reply.calls[0][0] in subset, (seed, reply)

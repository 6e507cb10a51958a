"""Both constraint stages, each forced on, served for real: the serving guarantees hold on either.

``auto`` picks the logits-processor stage on CPU, so most of the suite runs on it; this module
also pins each stage explicitly. Both random-model servers run the ``guidance`` structured-output
backend: on the logits-processor stage no structural tag reaches it (every constrained answer was
constrained by our logits processor); on the native stage it compiles each tag through its Lark
translation (vllm_glue/guidance_tags.py: no compile on the request's path). The tool-happy servers
run the native stage on xgrammar, and check auto mode against a model that violates the allowlist
on its own most of the time, and that the parser's defense-in-depth filter never had to drop
anything (the grammar did the work).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME, sample_catalog

from support.calls import chat_calls, chat_selection, responses_calls
from support.metrics import scrape_metric
from support.servers import start_cli_server, stop_cli_server
from support.serving import catalog_and_subset, happy_model_violation_figures

pytestmark = pytest.mark.server

SEEDS = range(6)
STAGES = {
    "logits-processor": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor"},
                         ["--structured-outputs-config.backend", "guidance"]),
    "native": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"},
               ["--structured-outputs-config.backend", "guidance"]),
}


@pytest.fixture(scope="module", params=sorted(STAGES))
def stage_random_server(request):
    env, args = STAGES[request.param]
    server = start_cli_server("random", env=env, extra_args=args)
    yield server
    stop_cli_server(server)


def test_new_subsets_of_a_known_catalog_are_served_without_a_compile_first(stage_random_server, request):
    """Logits-processor stage: a first-seen grammar's rows start on llguidance while xgrammar
    compiles it in the background, then move onto it (logged); every new subset after that starts
    the same way and still gets only allowed, valid calls. The native stage's rows never do: vLLM's
    guidance backend makes each request's matcher from the tag's translation (nothing compiled
    ahead), with the same guarantee. (The split path, a known
    catalog's grammar and a subset's envelope, serves with
    ``VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS=xgrammar``: tests/test_subset_masks.py.)"""
    import time
    lazy = request.node.callspec.params["stage_random_server"] == "logits-processor"
    client = stage_random_server.client()
    catalog = sample_catalog(random.Random(21), 8)
    chat_calls(client, catalog, "required", [catalog[0].name], 0, max_tokens=80)
    deadline = time.monotonic() + 60
    while lazy and "started on llguidance" not in stage_random_server.log_text():
        assert time.monotonic() < deadline, stage_random_server.log_tail()
        time.sleep(0.5)
    rng = random.Random(5)
    grammars = {("required", frozenset([catalog[0].name]))}   # each distinct grammar served
    for seed in range(6):
        allowed = [tool.name for tool in rng.sample(catalog, 1 + seed % 3)]
        calls, text, _ = chat_calls(client, catalog, "required", allowed, seed, stream=seed % 2 == 1)
        assert len(calls) == 1, (seed, calls, text)
        assert calls[0][0] in allowed and POOL_BY_NAME[calls[0][0]].arguments_valid(calls[0][1])
        calls, _, _ = chat_calls(client, catalog, "auto", allowed, seed, parallel=True, max_tokens=60)
        assert all(name in allowed for name, _ in calls), (seed, calls)
        grammars |= {("required", frozenset(allowed)), ("auto", frozenset(allowed))}
    # every one of them started on llguidance, the policy auto turns too (their free text may be
    # held to valid UTF-8): one line each once its background compile lands
    deadline = time.monotonic() + 120
    while lazy and stage_random_server.log_text().count("started on llguidance") < len(grammars):
        assert time.monotonic() < deadline, stage_random_server.log_tail()
        time.sleep(0.5)
    assert stage_random_server.log_text().count("started on llguidance") == (len(grammars) if lazy else 0)


@pytest.fixture(scope="module", params=sorted(STAGES))
def stage_happy_server(request):
    env, _ = STAGES[request.param]
    server = start_cli_server("tool-happy", env=env)
    yield server
    stop_cli_server(server)


def _parser_violations(server) -> float:
    return scrape_metric(server.root_url, "vllm_allowed_tools:violations_total", source="parser")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_required_mode_only_allowed_calls(stage_random_server, stream):
    client = stage_random_server.client()
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, text, _ = chat_calls(client, catalog, "required", allowed, seed, stream=stream)
        assert len(calls) == 1, (seed, calls, text)
        assert calls[0][0] in allowed and POOL_BY_NAME[calls[0][0]].arguments_valid(calls[0][1])
        r_calls, r_text, _ = responses_calls(client, catalog, "required", allowed, seed, stream=stream)
        assert len(r_calls) == 1, (seed, r_calls, r_text)
        assert r_calls[0][0] in allowed and POOL_BY_NAME[r_calls[0][0]].arguments_valid(r_calls[0][1])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_parallel_false_and_auto_mode(stage_random_server, stream):
    client = stage_random_server.client()
    text_only = 0
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, _, _ = responses_calls(client, catalog, "required", allowed, seed, stream=stream,
                                      parallel=False, max_tokens=200)
        assert len(calls) == 1, calls
        calls, text, _ = chat_calls(client, catalog, "auto", allowed, seed, stream=stream, max_tokens=60)
        assert all(name in allowed for name, _ in calls), (seed, calls)
        text_only += not calls and bool(text)
    assert text_only > 0, "auto mode must still allow a text-only answer"


def test_plain_requests_are_not_constrained(stage_random_server):
    """No policy, no grammar: a request without tools is free text."""
    client = stage_random_server.client()
    text = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, seed=1,
        temperature=1.0).choices[0].message.content
    assert text and "<tool_call>" not in text


def test_mixed_batch_each_request_gets_its_own_grammar(stage_random_server):
    """Concurrent requests share the engine's batch: with and without a policy (a plain
    ``required`` turn: vLLM's own tag, its arguments JSON schemas), different subsets, both modes.
    Each obeys its own allowlist, and required ones always call."""
    client = stage_random_server.client()
    rng = random.Random(7)
    jobs = []
    for index in range(24):
        catalog = sample_catalog(rng, 8)
        allowed = [tool.name for tool in rng.sample(catalog, 1 + index % 3)]
        jobs.append((index, catalog, allowed, ("required", "auto", None)[index % 3]))

    def run(job):
        index, catalog, allowed, mode = job
        if mode is None:   # no policy: the whole catalog, vLLM's own required grammar
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Go ahead."}], max_tokens=150,
                tools=[tool.chat_tool() for tool in catalog], tool_choice="required",
                temperature=1.0, seed=index)
            choice = reply.choices[0]   # vLLM's grammar does not bound whitespace: may run out
            return job, [(call.function.name, json.loads(call.function.arguments))
                         for call in choice.message.tool_calls or []] or choice.finish_reason
        calls, _, _ = chat_calls(client, catalog, mode, allowed, index, stream=index % 2 == 0,
                              parallel=mode == "auto", max_tokens=150)
        return job, calls

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(run, jobs))
    plain_calls = [calls for (_, _, _, mode), calls in results if mode is None and calls != "length"]
    assert len(plain_calls) >= 4, results   # a floor: most plain turns end their call
    for (index, catalog, allowed, mode), calls in results:
        if mode is None and calls == "length":
            continue
        permitted = allowed if mode is not None else [tool.name for tool in catalog]
        assert all(name in permitted for name, _ in calls), (index, mode, allowed, calls)
        if mode != "auto":
            assert calls and all(POOL_BY_NAME[n].arguments_valid(a) for n, a in calls), (index, calls)


def test_auto_mode_holds_against_the_tool_happy_model(stage_happy_server):
    before = _parser_violations(stage_happy_server)
    figures = happy_model_violation_figures(stage_happy_server.client(), trials=16)
    assert figures["violation_rate_with_policy"] == 0 and figures["responses_with_allowed_calls"] > 0
    assert _parser_violations(stage_happy_server) == before, \
        "the parser had to drop disallowed calls: the grammar did not constrain decoding"


def test_client_cannot_plant_a_grammar(stage_happy_server):
    """Our vllm_xargs keys are stripped from client requests: a client's own 'grammar' (here one
    that would force a call to a tool outside its allowlist) never reaches the engine."""
    from vllm_allowed_tools.decode.split import constraint_extra_args
    from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
    catalog, allowed = catalog_and_subset(3)
    outsider = next(tool for tool in catalog if tool.name not in allowed)
    planted = built(build_structural_tag("hermes", [AllowedFunction(outsider.name, {"type": "object"})],
                                         "required"))
    reply = stage_happy_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go ahead."}],
        tools=[tool.chat_tool() for tool in catalog], tool_choice=chat_selection("required", allowed),
        max_tokens=80, temperature=1.0, seed=3, extra_body={"vllm_xargs": constraint_extra_args(planted)})
    names = [c.function.name for c in reply.choices[0].message.tool_calls or []]
    assert names and all(name in allowed for name in names), names


def test_offline_llm_is_constrained_through_extra_args():
    """vLLM's offline ``LLM`` has no tool_choice handling of its own: the same grammar reaches our
    logits processor (loaded from the entry point) through ``SamplingParams.extra_args``."""
    import os

    from vllm_allowed_tools.decode.split import constraint_extra_args
    from vllm_allowed_tools.decode.grammar import allowed_tools_grammar
    from vllm_allowed_tools.devtools.serve import server_environment
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    os.environ.update(server_environment())
    from vllm import LLM, SamplingParams
    catalog, allowed = catalog_and_subset(11)
    body = {"tools": [tool.chat_tool() for tool in catalog],
            "tool_choice": chat_selection("required", allowed), "parallel_tool_calls": False}
    tag = allowed_tools_grammar(body, "hermes", max_whitespace=1)
    llm = LLM(model=str(ensure_model("random")), dtype="float32", max_model_len=4096,
              enforce_eager=True, block_size=32, max_num_seqs=8, enable_chunked_prefill=False,
              max_num_batched_tokens=4096)
    try:
        prompts = [f"Request {seed}:" for seed in range(6)]
        constrained = llm.generate(prompts, [SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                            extra_args=constraint_extra_args(tag))
                                             for seed in range(6)], use_tqdm=False)
        plain = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=1.0, seed=seed)
                                       for seed in range(6)], use_tqdm=False)
    finally:
        del llm
    for output in constrained:
        text = output.outputs[0].text
        call = json.loads(text.split("<tool_call>", 1)[1].rsplit("</tool_call>", 1)[0])
        assert text.lstrip().startswith("<tool_call>") and call["name"] in allowed, text
        assert POOL_BY_NAME[call["name"]].arguments_valid(call["arguments"]), text
        assert output.outputs[0].finish_reason == "stop", text
    assert not any(out.outputs[0].text.lstrip().startswith("<tool_call>") for out in plain)


#: strict MCP-shaped tools with string lengths: Slack's 40,000-character message (a channel
#: pattern beside it), and a code of 12-16 characters, longer than what the tool-happy model writes
_SLACK = {"type": "function", "function": {"name": "post_message", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["channel_id", "text"],
    "properties": {"channel_id": {"type": "string", "pattern": "^C[0-9]{2}$"},
                   "text": {"type": "string", "maxLength": 40000}}}}}
_CODE = {"type": "function", "function": {"name": "set_code", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["code"],
    "properties": {"code": {"type": "string", "minLength": 12, "maxLength": 16}}}}}


def test_strict_string_lengths_are_served_and_held(stage_happy_server):
    """A strict tool holding ``maxLength`` 40,000 is served at once and its calls match the full
    schema; a strict call outside its bounds never leaves the server: each answer is a valid call or
    the guard's ``strict_arguments_invalid`` refusal (tests/test_string_lengths.py: the grammar
    leaves lengths to the guard while xgrammar compiles them slowly)."""
    import time

    import jsonschema
    import openai
    client = stage_happy_server.client()
    outcomes = {"call": 0, "refused": 0}
    for seed in range(3):
        for tool in (_SLACK, _CODE):
            name = tool["function"]["name"]
            started = time.monotonic()
            try:
                message = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Go ahead."}],
                    tools=[_SLACK, _CODE], tool_choice=chat_selection("required", [name]),
                    max_tokens=120, temperature=1.0, seed=seed).choices[0].message
            except openai.APIStatusError as error:
                assert "strict_arguments_invalid" in str(error.body), error.body
                assert name == "set_code", (seed, error.body)   # the Slack schema's bounds are loose
                outcomes["refused"] += 1
                continue
            assert time.monotonic() - started < 60
            assert [call.function.name for call in message.tool_calls or []] == [name], message
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments),
                                tool["function"]["parameters"])
            outcomes["call"] += 1
    # every answer seen, Slack's calls served, and the code's short strings refused by the guard
    assert sum(outcomes.values()) == 6 and outcomes["call"] >= 3 and outcomes["refused"] >= 1, outcomes


def test_the_guidance_native_stage_holds_strict_lengths_in_the_grammar(stage_random_server, request):
    """On vLLM's guidance backend nothing compiles ahead, so a strict tool's string lengths stay in
    its grammar (decode/argument_schemas.py): every answer is a call within its bounds, none the
    guard's ``strict_arguments_invalid`` refusal that the other stages may give (the random model
    writes strings of any length on its own)."""
    import jsonschema
    if request.node.callspec.params["stage_random_server"] != "native":
        pytest.skip("the logits-processor stage leaves lengths to the guard (0.2.8): "
                    "test_strict_string_lengths_are_served_and_held")
    short_text = json.loads(json.dumps(_SLACK))
    short_text["function"]["parameters"]["properties"]["text"]["maxLength"] = 24
    client = stage_random_server.client()
    for seed in range(3):
        for tool in (short_text, _CODE):
            name = tool["function"]["name"]
            message = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Go ahead."}],
                tools=[short_text, _CODE], tool_choice=chat_selection("required", [name]),
                max_tokens=150, temperature=1.0, seed=seed).choices[0].message
            calls = message.tool_calls or []
            assert calls and {call.function.name for call in calls} == {name}, (seed, message)
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

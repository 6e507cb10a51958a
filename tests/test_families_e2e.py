"""The model families' wrappers end to end: one real `vllm serve` per format, its bundled template,
the tiny random model with the format's markers as single tokens (``serve-tiny --parser`` builds
that copy from the registry's ``special_tokens``).

Per format, with the official ``openai`` SDK, for an 8-tool catalog and a 2-tool subset:

* ``required`` with ``parallel_tool_calls: false``: exactly one call, allowed, arguments an object of
  the tool's schema, on Chat Completions and Responses, over two seeds;
* the same request streamed gives the same calls as unary (the random model's names take several
  tokens, so each name reaches the parser split across chunks);
* ``auto`` with the sampler pushed onto the format's call opening (``logit_bias``: the trigger
  token, or where calls open the message, ``[``), on both APIs, unary and streamed: the model does
  start calls, and every one is allowed; without the push, on Responses: never a disallowed call,
  and calls where the model opens them on its own (tests/support/families.py, ``CALLS_UNPUSHED``);
* an invalid selection is a 400 naming the field, on both endpoints.

Servers run on the stage this machine picks (on CPU: our logits-processor stage).
``VLLM_ALLOWED_TOOLS_FAMILY_STAGES=all`` also runs every format on vLLM's native stage, on its
xgrammar backend and on its guidance backend (``guidance``: the tags' Lark translation,
vllm_glue/guidance_tags.py), and the aliases (the full matrix); by default the native stage runs
on xgrammar for the formats in NATIVE_SAMPLE, one per kind of grammar, so CI stays within its time.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME

from support.calls import responses_calls, responses_selection
from support.families import (
    MAX_TOKENS,
    assert_auto_pushed_calls_only_allowed,
    catalog_and_subset,
    chat_answer,
    chat_request,
    nudges,
    unpushed_floor,
)
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

FAMILIES = ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm47", "minimax_m2", "llama4_pythonic", "granite4",
            "granite", "seed_oss", "phi4_mini_json", "xlam", "longcat"]
#: formats that are another format under a second vLLM name (same parser class, grammar and
#: template: tests/test_families.py): served in the full matrix only
ALIASES = {"glm45": "glm47", "llama4_json": "llama3_json", "qwen3_xml": "qwen3_coder"}
#: the native stage for one format per kind of grammar (xgrammar's, vLLM's, ours renamed)
NATIVE_SAMPLE = ["kimi_k2", "minimax_m2", "seed_oss"]
STAGES = {"default": {}, "native": {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"},
          "guidance": {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}}
#: the vLLM flags of a stage (the native stage on the guidance backend)
STAGE_FLAGS = {"guidance": ["--structured-outputs-config.backend", "guidance"]}
SEEDS = (0, 1)


def _cases() -> list:
    everything = os.environ.get("VLLM_ALLOWED_TOOLS_FAMILY_STAGES", "").strip().lower() == "all"
    families = FAMILIES + sorted(ALIASES) if everything else FAMILIES
    return [pytest.param((family, stage), id=f"{family}-{stage}") for stage in STAGES
            for family in families
            if stage == "default" or everything or (stage == "native" and family in NATIVE_SAMPLE)]


@pytest.fixture(scope="module", params=_cases())
def served(request):
    family, stage = request.param
    server = start_cli_server("random", env=STAGES[stage], options=["--parser", f"allowed_{family}"],
                              extra_args=STAGE_FLAGS.get(stage, []))
    yield family, server
    stop_cli_server(server)


def responses_answer(family: str, server, catalog, mode: str, subset, seed: int, **options):
    return responses_calls(server.client(), catalog, mode, subset, seed, max_tokens=MAX_TOKENS,
                           extra_body={"logit_bias": nudges(family)}, **options)


def arguments_fit(name: str, arguments: str) -> bool:
    """The arguments are an object the tool's schema accepts, exactly as the parser read them (an
    XML format's grammar writes each value as its parser reads it: no framing whitespace)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return False
    return isinstance(parsed, dict) and POOL_BY_NAME[name].arguments_valid(parsed)


def one_allowed_call(calls, subset, context) -> None:
    assert len(calls) == 1, context
    name, arguments = calls[0][:2]
    assert name in subset, context
    assert arguments_fit(name, arguments), context


# ------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("seed", SEEDS)
def test_required_gives_one_allowed_call_on_chat(served, seed):
    family, server = served
    catalog, subset = catalog_and_subset(seed)
    calls = chat_answer(server.client(), chat_request(family, catalog, "required", subset, seed), stream=False)
    one_allowed_call(calls, subset, (family, seed, calls, server.log_tail(20)))


@pytest.mark.parametrize("seed", SEEDS)
def test_required_gives_one_allowed_call_on_responses(served, seed):
    family, server = served
    catalog, subset = catalog_and_subset(seed)
    reply = responses_answer(family, server, catalog, "required", subset, seed)
    one_allowed_call(reply.calls, subset, (family, seed, reply.calls, server.log_tail(20)))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_streamed_required_answer_is_the_unary_one(served, seed):
    """Streamed, on both APIs, every seed: the calls unary gives (one allowed call, its arguments
    an object of the tool's schema); the wrapper releases streamed calls from the same read."""
    family, server = served
    catalog, subset = catalog_and_subset(seed)
    request = chat_request(family, catalog, "required", subset, seed)
    unary = chat_answer(server.client(), request, stream=False)
    streamed = chat_answer(server.client(), request, stream=True)
    # the same calls; JSON-array formats stream the arguments as written, unary re-serialized
    same = [(name, json.loads(arguments)) for name, arguments in streamed] == \
        [(name, json.loads(arguments)) for name, arguments in unary]
    assert same, (family, seed, streamed, unary)
    one_allowed_call(streamed, subset, (family, seed, streamed))
    reply = responses_answer(family, server, catalog, "required", subset, seed, stream=True)
    one_allowed_call(reply.calls, subset, (family, seed, reply.calls))


def test_auto_pushed_onto_the_opening_calls_only_allowed_tools(served):
    """The grammar lets auto mode call only the subset: with the call opening favoured (a trigger
    token, or a dispatch's ``[``), the random model opens calls, and each call it finishes is to an
    allowed tool, on both APIs, unary and streamed (a floor on the calls seen)."""
    family, server = served
    assert_auto_pushed_calls_only_allowed(family, server)


def test_auto_never_calls_outside_the_subset_on_responses(served):
    """Left alone (the markers written as one token, nothing pushed), auto calls only allowed tools;
    where the model calls on its own (``CALLS_UNPUSHED``: two calls on these two seeds), it did
    call: a floor, so the test cannot pass on answers without a call."""
    family, server = served
    called = 0
    for seed in SEEDS:
        catalog, subset = catalog_and_subset(seed)
        reply = responses_answer(family, server, catalog, "auto", subset, seed)
        assert all(call[0] in subset for call in reply.calls), (family, seed, reply.calls)
        called += len(reply.calls)
    assert called >= unpushed_floor(ALIASES.get(family, family)), (family, called, server.log_tail(30))


def test_an_invalid_selection_is_a_400_naming_the_field(served):
    family, server = served
    catalog, _ = catalog_and_subset(0)
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(**chat_request(family, catalog, "required", ["not_in_the_catalog"], 0))
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.responses.create(model="tiny", input="Go ahead.",
                                tools=[tool.responses_tool() for tool in catalog],
                                tool_choice=responses_selection("required", ["not_in_the_catalog"]))

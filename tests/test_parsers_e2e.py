"""Every wrapped parser end to end: a real `vllm serve` per parser, its own template, both modes.

One server at a time (a module-scoped fixture parametrized by parser; pytest finishes every test of
one parser, and stops its server, before starting the next). Each server is
`vllm-allowed-tools serve-tiny --flavour random --parser allowed_X`, which serves the parser's own
bundled template. Two of vLLM's parsers refuse a tokenizer that lacks their marker token, which the
tiny model's tokenizer does not have, so serve-tiny serves them a copy of the tiny model with the
registry's ``special_tokens`` of the format added (devtools/models/format_model.py; the weights are
untouched, the model's vocabulary has room):

* ``allowed_llama3_json``: ``Llama3JsonToolParser`` needs ``<|python_tag|>``;
* ``allowed_mistral``: ``MistralToolParser`` needs ``[TOOL_CALLS]`` (with a Hugging Face tokenizer
  and no ``[ARGS]`` token it runs its "pre-v11" path).

Per parser, on Chat Completions and Responses with the official `openai` SDK, for an 8-tool catalog of
the tool pool (strict, enum-only arguments) and a 2-tool subset:

* required mode with ``parallel_tool_calls=False``: exactly one call, in the subset, schema-valid
  arguments, over several seeds at temperature 1.0;
* auto mode, the format's markers written as one token and nothing pushed: never a call outside
  the subset, and calls where the model opens them on its own (mistral's ``[TOOL_CALLS]``);
* a plain ``required`` (no ``allowed_tools``) on the pythonic format: written in its call list
  (``[name(...)]``, the returned tokens show it), not vLLM's JSON array;
* the server renders the prompt exactly as :mod:`vllm_allowed_tools.templates.render` does, policy
  block included.

The random model rarely emits EOS, so nothing here asks for parallel calls in required mode (that
would run to max_tokens).

The last section checks the wrappers without a server (deterministic inputs): what sampling shows
only sometimes, such as an XML value framed by whitespace the parser keeps, is pinned there.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME, sample_catalog
from vllm_allowed_tools.devtools.prefix import policy_block_offset, render_with_policy
from vllm_allowed_tools.devtools.serve import TEMPLATE_FOR_PARSER, ServeTinyProcess
from vllm_allowed_tools.templates.render import render_chat

from support import custom_tools
from support.calls import USER_TURN, chat_calls, chat_selection, responses_calls
from support.families import assert_auto_pushed_calls_only_allowed, nudges, unpushed_floor
from support.parsers import TWO_TOOLS, format_model, glue, policy_request
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

SEEDS = (0, 1, 2)
REQUIRED_MAX_TOKENS = 200
AUTO_MAX_TOKENS = 60   # room for a whole mistral call (its arguments cut at 40 on most seeds)

PARSERS = ["allowed_hermes", "allowed_qwen3_coder", "allowed_llama3_json", "allowed_mistral",
           "allowed_pythonic"]


# ----------------------------------------------------------------------------------------- servers

def start_parser_server(parser: str, model_dir: Path | None = None,
                        timeout: float = 600.0) -> ServeTinyProcess:
    """`vllm-allowed-tools serve-tiny --parser PARSER` (support/servers.py's starter, plus a parser); the
    scale-out endpoints serve /v1/chat/completions/render."""
    options = ["--parser", parser] + (["--model-dir", str(model_dir)] if model_dir else [])
    return start_cli_server("random", extra_args=["--enable-scale-out"], timeout=timeout,
                            options=options)


@pytest.fixture(scope="module", params=PARSERS)
def served(request, tmp_path_factory):
    """(parser, server, model folder) for one parser; the previous parser's server is stopped first."""
    parser = request.param
    server = start_parser_server(parser)   # serve-tiny adds the format's tokens to a copy
    yield parser, server, format_model(parser)
    stop_cli_server(server)


# ----------------------------------------------------------------------------------------- requests

def catalog_and_subset(seed: int) -> tuple[list, list[str]]:
    rng = random.Random(1000 + seed)
    catalog = sample_catalog(rng, 8)
    subset = sorted(tool.name for tool in rng.sample(catalog, 2))
    return catalog, subset


SYSTEM = "You are a helpful agent."


def calls_for(api: str, server: ServeTinyProcess, mode: str, seed: int, max_tokens: int,
              stream: bool = False, extra_body: dict | None = None):
    """[(name, arguments)], the subset, and the Chat message or the Responses output."""
    catalog, subset = catalog_and_subset(seed)
    fetch = chat_calls if api == "chat" else responses_calls
    reply = fetch(server.client(), catalog, mode, subset, seed, max_tokens=max_tokens, system=SYSTEM,
                  stream=stream, extra_body=extra_body)
    return [call[:2] for call in reply.calls], subset, reply.raw if api == "chat" else reply.raw.output


# ----------------------------------------------------------------------------------------- tests

def test_parser_is_served_with_its_own_template(served):
    parser, server, _ = served
    log = server.log_text()
    assert f"'tool_call_parser': '{parser}'" in log
    assert f"{TEMPLATE_FOR_PARSER[parser]}.jinja" in log


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_required_mode_gives_one_allowed_schema_valid_call(served, api, stream):
    _, server, _ = served
    failures = []
    for seed in SEEDS:
        calls, subset, raw = calls_for(api, server, "required", seed, REQUIRED_MAX_TOKENS, stream)
        if len(calls) != 1:
            failures.append((seed, "calls", calls, str(raw)[:400]))
            continue
        name, arguments = calls[0]
        if name not in subset:
            failures.append((seed, "name", name, subset))
        elif not POOL_BY_NAME[name].arguments_valid(arguments):   # no tolerance for framing
            failures.append((seed, "arguments", name, arguments))
    assert not failures, (failures, server.log_tail(30))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_auto_mode_never_calls_outside_the_subset(served, api):
    """Left alone (the format's markers written as one token, as test_families_e2e.py writes them;
    nothing pushed), auto never calls outside the subset; where the model calls on its own
    (mistral, ``CALLS_UNPUSHED``: two calls on these two seeds), it did call: a floor."""
    parser, server, _ = served
    family = parser.removeprefix("allowed_")
    called = 0
    for seed in SEEDS[:2]:
        calls, subset, _ = calls_for(api, server, "auto", seed, AUTO_MAX_TOKENS,
                                     extra_body={"logit_bias": nudges(family)})
        assert all(name in subset for name, _ in calls), (seed, calls, subset, server.log_tail(30))
        called += len(calls)
    assert called >= unpushed_floor(family), (parser, api, called, server.log_tail(30))


@pytest.mark.parametrize("served", ["allowed_mistral", "allowed_pythonic"], indirect=True)
def test_auto_pushed_onto_the_opening_calls_only_allowed_tools(served):
    """Mistral's ``[TOOL_CALLS]`` and the pythonic list's ``[`` hold auto by grammar: pushed onto
    the opening, the model calls, only allowed tools (test_families_e2e's test, on these servers)."""
    parser, server, _ = served
    assert_auto_pushed_calls_only_allowed(parser.removeprefix("allowed_"), server)


#: a Python call opening the list: ``[get_weather(`` (vLLM's JSON array opens ``[{`` or ``[ {``)
PYTHON_CALL_OPENING = re.compile(r"\[[A-Za-z_][A-Za-z0-9_]*\(")


def plain_required_chat(server: ServeTinyProcess, catalog: list, seed: int,
                        stream: bool) -> tuple[list[tuple[str, str]], str | None, str]:
    """A plain ``tool_choice: "required"`` Chat request (no ``allowed_tools``; the request
    support/calls.py's ``chat_calls`` sends, with ``logprobs``): ([(name, arguments)], the finish
    reason, the generated text joined from the returned tokens, i.e. what the model wrote)."""
    request = dict(model="tiny", messages=[{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": USER_TURN}],
                   tools=[tool.chat_tool() for tool in catalog], tool_choice="required",
                   max_tokens=REQUIRED_MAX_TOKENS, temperature=1.0, seed=seed, logprobs=True)
    client = server.client()
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason, "".join(t.token for t in choice.logprobs.content)
    collected: dict[int, list[str]] = {}
    finish, tokens = None, []
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else None) or ()]
            for call in choice.delta.tool_calls or []:
                entry = collected.setdefault(call.index, ["", ""])
                entry[0] += call.function and call.function.name or ""
                entry[1] += call.function and call.function.arguments or ""
    return [tuple(collected[i]) for i in sorted(collected)], finish, "".join(tokens)


@pytest.mark.parametrize("served", ["allowed_pythonic"], indirect=True)   # that server, once
@pytest.mark.parametrize("endpoint", ["chat-unary", "chat-streamed", "responses"])
def test_plain_required_on_a_pythonic_format_is_written_in_its_call_syntax(served, endpoint):
    """A plain ``tool_choice: "required"`` (no ``allowed_tools``, the client's default
    ``parallel_tool_calls``) is decoded in the format's own call list, ``[get_weather(city=...)]``,
    which vLLM's pythonic parser reads, not as vLLM's JSON array (asgi/turn_plan.py: the whole
    catalog as a required wire allowlist). The calls come back as tool calls, from the catalog,
    schema-valid; Chat finishes ``tool_calls`` and the tokens it returns (``logprobs``) show the
    model wrote a Python call list; the Responses object echoes the client's ``required`` (vLLM
    itself saw another choice). Before, the same requests decoded ``[{"name": ..., "parameters":
    ...}]`` (vLLM's required path), so the output check fails there."""
    _, server, _ = served
    failures = []
    for seed in SEEDS:
        catalog, _ = catalog_and_subset(seed)
        names = {tool.name for tool in catalog}
        if endpoint == "responses":
            reply = responses_calls(server.client(), catalog, "required", None, seed, parallel=True,
                                    max_tokens=REQUIRED_MAX_TOKENS, system=SYSTEM)
            calls, finish, written = [call[:2] for call in reply.calls], reply.raw.status, None
            if reply.raw.tool_choice != "required":
                failures.append((seed, "echoed tool_choice", reply.raw.tool_choice))
        else:
            calls, finish, written = plain_required_chat(server, catalog, seed,
                                                         stream=endpoint == "chat-streamed")
            if not PYTHON_CALL_OPENING.match(written):
                failures.append((seed, "written", written[:300]))
        if finish != ("completed" if endpoint == "responses" else "tool_calls"):
            failures.append((seed, "finish", finish, calls))
        if not calls:
            failures.append((seed, "no call", written))
        for name, arguments in calls:
            if name not in names or not POOL_BY_NAME[name].arguments_valid(arguments):
                failures.append((seed, "call", name, arguments))
    assert not failures, (endpoint, failures, server.log_tail(30))


def test_server_renders_the_template_like_render_py(served):
    """/v1/chat/completions/render goes through our middleware: the prompt vLLM would run, policy
    block included, is token for token what render.py renders (for a multi-turn agent transcript)."""
    import httpx
    from tokenizers import Tokenizer

    parser, server, model_dir = served
    catalog, subset = catalog_and_subset(0)
    tools = [tool.chat_tool() for tool in catalog]
    rng = random.Random(4)
    first, second = POOL_BY_NAME[catalog[0].name], POOL_BY_NAME[catalog[1].name]
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Do two things."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": first.name, "arguments": json.dumps(first.random_arguments(rng))}},
            {"id": "call_2", "type": "function", "function": {
                "name": second.name, "arguments": json.dumps(second.random_arguments(rng))}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        {"role": "assistant", "content": "Both done."},
        {"role": "user", "content": "Next."},
    ]
    body = {"model": "tiny", "messages": messages, "tools": tools,
            "tool_choice": chat_selection("required", subset)}
    reply = httpx.post(server.base_url + "/chat/completions/render", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    token_ids = reply.json()["token_ids"]
    served_text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(
        token_ids, skip_special_tokens=False)
    template = TEMPLATE_FOR_PARSER[parser]
    expected = render_with_policy(messages, tools, template, {"mode": "required", "names": subset})
    block = policy_block_offset(served_text, template)
    assert block is not None, served_text[-400:]
    assert "Allowed tools this turn (required): " + ", ".join(subset) in served_text[block:]
    assert served_text == expected


def test_base_parsers_refuse_a_tokenizer_without_their_marker_token():
    """Why llama3_json and mistral are served a tiny model with one token added: vLLM's parsers raise
    at construction (i.e. on every tool request) when the marker token is missing."""
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("random", 0, log=lambda *_: None)))
    with pytest.raises(RuntimeError, match=r"<\|python_tag\|>"):
        ToolParserManager.get_tool_parser("allowed_llama3_json")(tokenizer)
    with pytest.raises(RuntimeError, match="tool call token"):
        ToolParserManager.get_tool_parser("allowed_mistral")(tokenizer)
    for name in ("allowed_hermes", "allowed_qwen3_coder", "allowed_pythonic"):
        ToolParserManager.get_tool_parser(name)(tokenizer)   # these construct fine


# ----------------------------------------------------------------------------------------- wrappers
# The parser wrappers on their own (vLLM imported, no server): deterministic checks of what the
# sampled end-to-end runs above can only show by chance.

def parser_pair(glue, parser: str):
    from vllm.tool_parsers import ToolParserManager
    tokenizer = glue(parser)
    return (ToolParserManager.get_tool_parser(parser)(tokenizer),
            ToolParserManager.get_tool_parser(parser.removeprefix("allowed_"))(tokenizer))


@pytest.mark.parametrize("parser,model,template", [
    ("allowed_llama3_json", "llama", "llama3_json"), ("allowed_qwen3_coder", "qwen_3_coder", "qwen3_coder"),
    ("allowed_hermes", "hermes", "hermes")])
def test_wrapper_grammar_accepts_the_templates_call_format_for_allowed_tools_only(glue, parser, model,
                                                                                 template):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    wrapper, _ = parser_pair(glue, parser)
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    assert wrapper.structural_tag_model == model
    grammar = xgrammar.Grammar.from_structural_tag(wrapper.get_structural_tag(request).model_dump_json())

    def reply(name: str) -> str:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": name, "arguments": {"priority": "high"}}}]}
        text = render_chat([{"role": "user", "content": "x"}, message], None, template=template,
                           add_generation_prompt=False)
        head, end = ("<|im_start|>assistant\n", "<|im_end|>") if "<|im_start|>" in text else \
            ("<|end_header_id|>\n\n", "<|eot_id|>")
        start = text.rindex(head) + len(head)
        return text[start:text.index(end, start)]

    assert _is_grammar_accept_string(grammar, reply("get_ticket")), reply("get_ticket")
    assert not _is_grammar_accept_string(grammar, reply("delete_note"))   # in the catalog, not allowed


def test_qwen_xml_values_admit_only_the_framing_the_parser_strips(glue):
    """xgrammar's qwen_xml style frames an enum value with free whitespace, which vLLM's qwen3 parser
    keeps (it strips one line break each side): ``\\nhigh\\t`` would read back as ``"high\\t"``,
    outside the enum. The wrapper's grammar admits the value only as the parser reads it
    (decode/argument_slots.py), and what it admits parses schema-valid."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    wrapper, _ = parser_pair(glue, "allowed_qwen3_coder")
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    grammar = xgrammar.Grammar.from_structural_tag(wrapper.get_structural_tag(request).model_dump_json())

    def call(value: str) -> str:
        return (f"<tool_call>\n<function=get_ticket>\n<parameter=priority>{value}</parameter>\n"
                "</function>\n</tool_call>")

    for framed in ("\nhigh\t", "\thigh\n", "\n high\n", "\nhigh \n"):
        assert not _is_grammar_accept_string(grammar, call(framed)), framed
    admitted = call("\nhigh\n")
    assert _is_grammar_accept_string(grammar, admitted)
    info = wrapper.extract_tool_calls(admitted, request)
    assert [call.function.name for call in info.tool_calls] == ["get_ticket"]
    assert POOL_BY_NAME["get_ticket"].arguments_valid(info.tool_calls[0].function.arguments), \
        info.tool_calls[0].function.arguments


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_mistral_required_schema_matches_the_parsers_call_format(glue, api):
    """The required-mode schema is the format's array ({"name", "arguments"} items for mistral, the
    key its parser reads), built from the allowed tools only, on both APIs (vLLM's Mistral parser
    sets one on Chat only: on Responses the turn was unconstrained and ended with no call)."""
    import jsonschema

    wrapper, _ = parser_pair(glue, "allowed_mistral")
    request, _ = policy_request("required", ["get_ticket"], TWO_TOOLS)
    if api == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        tools = [{"type": "function", "name": tool.function.name, "parameters": tool.function.parameters}
                 for tool in request.tools]
        request = ResponsesRequest(model="tiny", input="x", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, **request.model_extra)
    request = wrapper.adjust_request(request)
    assert request.extract_structured_outputs() is request.structured_outputs
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from vllm_allowed_tools.decode.grammar import AllowedFunction, call_array_schema
    from vllm_allowed_tools.formats import wire_format
    # the array as a grammar (decode/safe_json.py's strings) of the format's schema
    grammar = xgrammar.Grammar.from_structural_tag(request.structured_outputs.structural_tag)
    ticket = next(function for function in (getattr(tool, "function", None) or tool for tool in request.tools)
                  if function.name == "get_ticket")
    schema = call_array_schema("mistral", [AllowedFunction("get_ticket", ticket.parameters, ticket.strict)],
                               parallel_tool_calls=False)
    # the one output the schema admits for get_ticket(priority=high)
    key = wire_format("mistral").grammar.arguments_key
    assert key == next(k for k in schema["items"]["anyOf"][0]["properties"] if k != "name")
    output = json.dumps([{"name": "get_ticket", key: {"priority": "high"}}])
    jsonschema.validate(json.loads(output), schema)
    assert _is_grammar_accept_string(grammar, output)
    info = wrapper.extract_tool_calls(output, request)
    assert [call.function.name for call in info.tool_calls] == ["get_ticket"]
    assert json.loads(info.tool_calls[0].function.arguments) == {"priority": "high"}


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_policy_keeps_the_base_parsers_detokenizer_settings(glue, parser, mode):
    """The policy path replaces the base parser's grammar, not its other side effects: where the base
    parser keeps special tokens in the output (hermes, qwen3_coder, mistral set
    `skip_special_tokens=False`, so a call marker that is a special token reaches the parser), the
    wrapper does too."""
    wrapper, base = parser_pair(glue, parser)
    request, plain = policy_request(mode, ["get_ticket"], TWO_TOOLS)
    assert wrapper.adjust_request(request).skip_special_tokens == \
        base.adjust_request(plain).skip_special_tokens


# ------------------------------------------------------ a custom grammar tool on an XML format

@pytest.mark.parametrize("served", ["allowed_qwen3_coder"], indirect=True)   # that server, once
@pytest.mark.parametrize("seed", custom_tools.SEEDS)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_selected_custom_tool_is_called_with_an_input_its_grammar_admits(served, seed, stream):
    """tests/test_custom_tools_e2e.py's required custom-tool turn on qwen3_coder, where the input is
    the raw parameter value."""
    _, server, _ = served
    if not stream:
        response = custom_tools.unary(server, custom_tools.request_body(seed, False))
        custom_tools.the_one_custom_call(response)
        return
    events = custom_tools.streamed(server, custom_tools.request_body(seed, True))
    assert events[-1]["type"] == "response.completed", events[-1]
    call = custom_tools.the_one_custom_call(events[-1]["response"])
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert deltas == call["input"], events

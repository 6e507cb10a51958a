"""A custom grammar tool's calls constrained while decoding: the turn's structural tag admits a call
whose input the tool's grammar admits and no other (JSON-argument formats carry the input as a JSON
string, XML formats raw), the format's parser reads that input back exactly, and a format whose
grammar cannot carry the tool's grammar is a 400 naming the format and the tool before generation.
"""

from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from vllm_allowed_tools.decode.custom_capability import refuse_uncarried_custom_tools
from vllm_allowed_tools.decode.custom_inputs import MARKER_PREFIX
from vllm_allowed_tools.decode.grammar import AllowedFunction, allowed_tools_grammar, build_structural_tag
from vllm_allowed_tools.decode.split import split_tags
from vllm_allowed_tools.errors import AllowedToolsError, CapabilityError
from vllm_allowed_tools.formats import wire_format, wire_formats
from vllm_allowed_tools.request.custom_tools import compile_custom_grammar
from vllm_allowed_tools.request.rewrite import rewrite_request

from support.custom_tools import CODEX_APPLY_PATCH

PATCH_GRAMMAR = '''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Add File: " filename LF add_line+
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
%import common.LF
'''
#: quotes, a backslash, a tab and line breaks: what JSON writes escaped
PATCH = '*** Begin Patch\n*** Add File: a "b".txt\n+hi \\ \t"there"\n*** End Patch\n'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
SHORT = {"type": "custom", "name": "short", "format": {"type": "grammar", "syntax": "lark",
                                                        "definition": 'start: "a" | "b" "c"~1..3'}}
NOTE = {"type": "custom", "name": "note", "description": "Free text."}
EXEC = {"type": "function", "name": "exec_command", "strict": True,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                       "additionalProperties": False}}

#: one call of ``name`` with ``input``, as each format's model writes it
CALLS = {
    "hermes": lambda name, text: f'<tool_call>\n{{"name": "{name}", "arguments": '
                                 f'{json.dumps({"input": text})}}}\n</tool_call>',
    "qwen3_coder": lambda name, text: f"<tool_call>\n<function={name}>\n<parameter=input>\n{text}\n"
                                      "</parameter>\n</function>\n</tool_call>",
    "seed_oss": lambda name, text: f"<seed:tool_call>\n<function={name}>\n<parameter=input>\n{text}\n"
                                   "</parameter>\n</function>\n</seed:tool_call>",
    "minimax_m2": lambda name, text: f'\n<minimax:tool_call>\n<invoke name="{name}">\n<parameter name="input">'
                                     f"{text}</parameter>\n</invoke>\n</minimax:tool_call>",
    "glm47": lambda name, text: f"<tool_call>{name}<arg_key>input</arg_key><arg_value>{text}</arg_value>"
                                "</tool_call>",
}


def body(*tools, choice=None, **extra):
    request = {"model": "m", "input": "hi", "tools": list(tools), **extra}
    if choice is not None:
        request["tool_choice"] = choice
    return request


def selection(mode, *names):
    return {"type": "allowed_tools", "mode": mode,
            "tools": [{"type": "custom" if name != "exec_command" else "function", "name": name}
                      for name in names]}


def accepts(tag, text: str) -> bool:
    return bool(_is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag.json), text))


def turn(fmt: str, mode: str, *names, tools=(EXEC, APPLY_PATCH, SHORT, NOTE)):
    return allowed_tools_grammar(body(*tools, choice=selection(mode, *names)), fmt, "responses")


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_the_turn_admits_a_call_whose_input_the_grammar_admits_and_no_other(fmt, mode):
    tag = turn(fmt, mode, "apply_patch", "exec_command")
    call = CALLS[fmt]
    lead = "Let me edit. " if mode == "auto" else ""
    assert accepts(tag, lead + call("apply_patch", PATCH))
    assert not accepts(tag, lead + call("apply_patch", PATCH.replace("*** End Patch\n", "")))
    assert not accepts(tag, lead + call("apply_patch", PATCH.replace("+hi", "hi")))
    assert not accepts(tag, lead + call("short", "a"))   # a custom tool outside the selection


def test_a_json_string_input_is_admitted_in_its_escaped_spellings_only():
    tag = turn("hermes", "required", "apply_patch")

    def call(arguments: str) -> str:
        return '<tool_call>\n{"name": "apply_patch", "arguments": ' + arguments + "}\n</tool_call>"
    escaped = json.dumps({"input": PATCH})
    assert accepts(tag, call(escaped))
    assert accepts(tag, call(escaped.replace("\\n", "\\u000A")))   # another spelling of one input
    assert not accepts(tag, call(escaped.replace("\\n", "\n")))   # a raw line break: not JSON
    assert not accepts(tag, call(json.dumps({"input": PATCH + "x"})))


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_a_bounded_grammar_ends_the_input_where_the_grammar_ends(fmt):
    tag = turn(fmt, "required", "short")
    for text, admitted in [("a", True), ("bc", True), ("bccc", True), ("bcccc", False), ("b", False),
                           ("ab", False), ("", False)]:
        assert accepts(tag, CALLS[fmt]("short", text)) is admitted, text


def test_a_free_form_custom_tool_takes_any_string_as_its_input():
    tag = turn("hermes", "required", "note")
    assert accepts(tag, CALLS["hermes"]("note", 'anything "at" all\n'))


def test_the_split_catalog_grammar_pins_the_input_and_the_envelope_leaves_it_to_it():
    grammar = compile_custom_grammar("short", "lark", 'start: "a" | "b" "c"~1..3').ebnf
    catalog = [AllowedFunction("exec_command", EXEC["parameters"], True),
               AllowedFunction("short", None, None, input_grammar=grammar)]
    split = split_tags("hermes", catalog, catalog[1:], catalog_digest="c", allowlist_digest="a",
                       mode="required", parallel_tool_calls=False)
    assert accepts(split.catalog, CALLS["hermes"]("short", "bc"))
    assert not accepts(split.catalog, CALLS["hermes"]("short", "x"))
    assert accepts(split.envelope, CALLS["hermes"]("short", "x"))   # names only: the catalog pins


def _vllm_builders():
    from vllm.tool_parsers import ToolParserManager
    for entry in wire_formats():
        if entry.grammar.kind == "vllm":
            ToolParserManager.get_tool_parser(entry.name)   # registers the builder vLLM keeps there


@pytest.mark.parametrize("fmt", [entry.name for entry in wire_formats()])
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_every_format_carries_the_grammar_or_refuses_the_tool(fmt, mode):
    """Never an unconstrained call: a format either constrains the input with the grammar (the tag
    holds it, no marked schema is left) or has no grammar in that mode, or refuses the tool."""
    _vllm_builders()
    grammar = compile_custom_grammar("short", "lark", 'start: "a" | "b" "c"~1..3').ebnf
    function = AllowedFunction("short", None, None, input_grammar=grammar)
    kind = wire_format(fmt).grammar.kind
    if kind == "json_array" and mode == "required":
        with pytest.raises(CapabilityError) as caught:
            build_structural_tag(fmt, [function], mode, parallel_tool_calls=False)
        assert fmt in caught.value.message and "'short'" in caught.value.message
        assert caught.value.status == 400
        return
    tag = build_structural_tag(fmt, [function], mode, parallel_tool_calls=False)
    if kind == "json_array":   # auto: the input is free (the output guard parses it)
        dumped = json.dumps(tag.model_dump()) if tag is not None else ""
        assert MARKER_PREFIX not in dumped and "start_repeat" not in dumped
        return
    dumped = json.dumps(tag.model_dump())
    assert MARKER_PREFIX not in dumped and 'start_repeat{1, 3}' in dumped


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_the_format_writes_the_input_as_its_parser_reads_it(glue, fmt):
    """The call the grammar admits is the call vLLM's parser reads back as ``{"input": <text>}``,
    for an input that starts and ends with a line break and holds quotes."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.tool_parsers import ToolParserManager
    text = '\n+x "y"\n'
    free = {"type": "custom", "name": "edit", "format": {"type": "grammar", "syntax": "regex",
                                                          "definition": '\\n\\+x "y"\\n'}}
    rewritten = rewrite_request(body(EXEC, free, choice=selection("required", "edit")), "responses")
    request = ResponsesRequest(**rewritten.body)
    parser = ToolParserManager.get_tool_parser(f"allowed_{fmt}")(glue(f"allowed_{fmt}"))
    request = parser.adjust_request(request)
    call = CALLS[fmt]("edit", text)
    tag = build_structural_tag(fmt, [AllowedFunction("edit", None, None, input_grammar=compile_custom_grammar(
        "edit", "regex", free["format"]["definition"]).ebnf)], "required", parallel_tool_calls=False)
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag.model_dump_json()), call)
    calls = parser.extract_tool_calls(call, request).tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("edit", {"input": text})]


@pytest.fixture(scope="module")
def glue():
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.format_model import model_for_parser
    from vllm_allowed_tools.vllm_glue.plugin import register
    register()
    cache: dict = {}

    def tokenizer_for(parser: str):
        if parser not in cache:
            cache[parser] = AutoTokenizer.from_pretrained(str(model_for_parser("random", 0, parser,
                                                                               log=lambda *_: None)))
        return cache[parser]
    return tokenizer_for


# ------------------------------------------------------------------------- refused before decoding

def _for(parser: str):
    """What the middleware lends rewrite_request for a server on ``parser``."""
    return lambda turn: refuse_uncarried_custom_tools(turn, parser)


@pytest.mark.parametrize("parser", ["allowed_mistral", "allowed_pythonic", "allowed_xlam"])
def test_a_format_that_cannot_carry_the_grammar_is_a_400_naming_it_and_the_tool(parser):
    request = body(EXEC, APPLY_PATCH, choice=selection("required", "apply_patch", "exec_command"))
    with pytest.raises(CapabilityError) as caught:
        rewrite_request(request, "responses", check_turn=_for(parser))
    error = caught.value
    assert error.status == 400 and error.param == "tool_choice"
    assert wire_format(parser).name in error.message and "'apply_patch'" in error.message
    # auto mode has no grammar on these formats at all; a free-form custom tool has none to carry;
    # a format that carries it is served
    rewrite_request(body(EXEC, APPLY_PATCH, choice=selection("auto", "apply_patch")), "responses", check_turn=_for(parser))
    rewrite_request(body(EXEC, NOTE, choice=selection("required", "note")), "responses", check_turn=_for(parser))
    rewrite_request(request, "responses", check_turn=_for("allowed_hermes"))


def test_a_grammar_that_does_not_compile_is_refused_as_such_first():
    bad = {**APPLY_PATCH, "format": {**APPLY_PATCH["format"], "definition": "start: ("}}
    with pytest.raises(AllowedToolsError) as caught:
        rewrite_request(body(EXEC, bad, choice=selection("required", "apply_patch")), "responses",
                        check_turn=_for("allowed_mistral"))
    assert caught.value.param == "tools[1].format.definition"


def test_a_plain_auto_turn_decodes_custom_calls_held_to_their_grammar():
    """Codex's turns: plain ``auto`` with its custom ``apply_patch``. The catalog-wide grammar every
    plain ``auto`` turn gets (docs/decode-path.md) takes custom tools in too, each held to its
    grammar, so a model can call them at all, and only with an input the grammar admits."""
    from vllm_allowed_tools.decode.grammar import turn_tag
    from vllm_allowed_tools.request.custom_tools import input_grammar
    from vllm_allowed_tools.request.rewrite import constrain_to_catalog
    from vllm_allowed_tools.wire import WireAllowlist
    rewritten = constrain_to_catalog(rewrite_request(body(EXEC, APPLY_PATCH, NOTE), "responses"), "responses")
    wire = WireAllowlist.from_wire(rewritten.body["vllm_allowed_tools"])
    assert wire.allowed == {"exec_command", "apply_patch", "note"} and wire.mode == "auto"
    functions = [AllowedFunction(spec.flat_name, spec.parameters, spec.strict,
                                 input_grammar(wire.custom.get(spec.flat_name)))
                 for spec in rewritten.allowlist.catalog]
    tag = turn_tag("hermes", functions, catalog_digest=wire.catalog_digest,
                   allowlist_digest=wire.allowlist_digest, mode="auto", parallel_tool_calls=True)
    assert accepts(tag, "Patching. " + CALLS["hermes"]("apply_patch", PATCH))
    assert not accepts(tag, "Patching. " + CALLS["hermes"]("apply_patch", "rm -rf /"))
    assert accepts(tag, "Noting. " + CALLS["hermes"]("note", "anything"))


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_codexs_apply_patch_is_held_to_its_grammar(fmt):
    tool = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": CODEX_APPLY_PATCH}}
    tag = allowed_tools_grammar(body(EXEC, tool, choice=selection("auto", "apply_patch", "exec_command")),
                                fmt, "responses")
    patch = '*** Begin Patch\n*** Update File: src/a.py\n@@ def f():\n-    return "x"\n+    return "y\\t"\n*** End Patch\n'
    assert accepts(tag, "On it. " + CALLS[fmt]("apply_patch", patch))
    assert not accepts(tag, "On it. " + CALLS[fmt]("apply_patch", patch.replace("@@", "@")))

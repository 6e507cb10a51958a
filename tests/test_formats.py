"""The wire-format registry: every entry is complete, and every data file's grammar is exactly the one
vLLM (or xgrammar) builds for the same allowed subset, so a vLLM upgrade cannot drift silently."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import textwrap

import pytest

from vllm_allowed_tools.decode.argument_slots import format_markers, with_object_arguments
from vllm_allowed_tools.decode.free_text import with_unmarked_free_text
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, call_array_schema
from vllm_allowed_tools.decode.marker_tokens import with_marker_tokens
from vllm_allowed_tools.formats import (
    GrammarSpec,
    WireFormat,
    format_from_data,
    register_wire_format,
    registry,
    wire_format,
    wire_formats,
)
from vllm_allowed_tools.grammars import GRAMMAR_DIR
from vllm_allowed_tools.templates import TEMPLATE_DIR

from support.grammar_read import grammar_style, tag_nodes

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
ALLOWED = ["t1", "t3", "t4"]
FORMATS = [entry.name for entry in wire_formats()]
#: formats whose base parser has no structural tag of its own, and the vLLM tag their calls follow
REFERENCE_MODEL = {"granite4": "hermes"}
#: formats whose grammar is another's with renamed markup: no vLLM tag to compare (see below)
RENAMED = [entry.name for entry in wire_formats() if entry.grammar.rename]
STRUCTURAL = [entry.name for entry in wire_formats()
              if entry.grammar.kind in ("tags", "xgrammar", "vllm") and entry.name not in RENAMED]


def allowed_functions() -> list[AllowedFunction]:
    return [AllowedFunction(f"t{i}", SCHEMA, strict=(i % 2 == 0)) for i in range(5)
            if f"t{i}" in ALLOWED]


def dumped(tag) -> str:
    return json.dumps(tag.model_dump(), sort_keys=True)


# ---------------------------------------------------------------------------- the registry
def test_every_data_file_is_a_registered_format():
    files = sorted(path.stem for path in GRAMMAR_DIR.glob("*.json"))
    assert files == sorted(FORMATS)
    assert {"hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "longcat"} <= set(FORMATS)


def test_parser_names_and_classes_are_the_ones_vllm_is_told_about():
    names = {entry.parser_name: entry.parser_class_name for entry in wire_formats()}
    assert {name: names[name] for name in ("allowed_hermes", "allowed_llama3_json", "allowed_deepseek_v31",
                                           "allowed_kimi_k2", "allowed_phi4_mini_json")} == {
        "allowed_hermes": "AllowedHermesToolParser",
        "allowed_llama3_json": "AllowedLlama3JsonToolParser",
        "allowed_deepseek_v31": "AllowedDeepseekV31ToolParser",
        "allowed_kimi_k2": "AllowedKimiK2ToolParser",
        "allowed_phi4_mini_json": "AllowedPhi4MiniJsonToolParser",
    }
    assert len(set(names.values())) == len(names)   # one class per parser
    from vllm_allowed_tools.vllm_glue.plugin import PARSER_CLASSES
    assert PARSER_CLASSES == names   # the classes listed where grep finds them
    assert wire_format("allowed_hermes") is wire_format("hermes")


def test_unknown_format_says_what_exists():
    with pytest.raises(ValueError, match="unknown wire format 'harmony'; expected one of .*hermes"):
        wire_format("harmony")


@pytest.mark.parametrize("name", [name for name in FORMATS if wire_format(name).template is not None])
def test_every_format_has_a_bundled_template_and_consistent_marker(name):
    entry = wire_format(name)
    assert (TEMPLATE_DIR / f"{entry.template}.jinja").is_file()
    assert entry.policy_block_marker.endswith("Allowed tools this turn (")
    sharing = {other.policy_block_marker for other in wire_formats() if other.template == entry.template}
    assert sharing == {entry.policy_block_marker}   # one template, one marker


def test_derived_tables_read_the_registry():
    from vllm_allowed_tools.devtools.prefix import POLICY_BLOCK_MARKERS
    from vllm_allowed_tools.devtools.serve import TEMPLATE_FOR_PARSER, template_for_parser
    assert TEMPLATE_FOR_PARSER["allowed_longcat"] == "hermes"
    assert template_for_parser("longcat").stem == "hermes"
    assert template_for_parser("allowed_nonesuch").stem == "hermes"
    assert set(POLICY_BLOCK_MARKERS) == {entry.template for entry in wire_formats() if entry.template}
    assert wire_format("openai").template is None   # harmony: vLLM renders no chat template


def test_bad_entries_are_refused_with_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs a trigger and calls whose begin holds \{name\}"):
        register_wire_format(WireFormat("broken", "X", "hermes", "m", (), GrammarSpec(kind="tags")))
    with pytest.raises(ValueError, match="needs xgrammar_model"):
        register_wire_format(WireFormat("broken", "X", "hermes", "m", (), GrammarSpec(kind="xgrammar")))
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_wire_format(WireFormat("hermes", "X", "hermes", "m", (), GrammarSpec(kind="json_array")))
    with pytest.raises(ValueError, match="broken.json: not a wire-format file"):
        format_from_data({"name": "broken"}, source="broken.json")
    assert "broken" not in FORMATS


def test_a_code_format_builds_its_grammar_with_its_own_builder(monkeypatch):
    seen = []

    def builder(functions, mode, parallel, strict_level, max_whitespace):
        seen.append(([f.name for f in functions], mode, parallel, strict_level, max_whitespace))
        return build_structural_tag("hermes", functions, mode, parallel_tool_calls=parallel)

    entry = WireFormat("custom", "Hermes2ProToolParser", "hermes", wire_format("hermes").policy_block_marker,
                       ("<tool_call>",), GrammarSpec(kind="code", builder=builder))
    monkeypatch.setitem(registry._FORMATS, "custom", entry)
    tag = build_structural_tag("custom", allowed_functions(), "required", parallel_tool_calls=False,
                               max_whitespace=0)
    assert dumped(tag) == dumped(build_structural_tag("hermes", allowed_functions(), "required",
                                                      parallel_tool_calls=False))
    assert seen == [(ALLOWED, "required", False, 1, 1)]


# ---------------------------------------------------------------------------- parity with vLLM
@pytest.mark.parametrize("name", FORMATS)
def test_base_parser_is_the_class_vllm_registers(name):
    from vllm.tool_parsers import ToolParserManager
    assert ToolParserManager.lazy_parsers[name][1] == wire_format(name).base_parser_class


def _vllm_tag(name: str, mode: str, parallel: bool, every_tool: bool = False):
    from openai.types.responses import FunctionTool, ToolChoiceAllowed
    from vllm.tool_parsers import ToolParserManager
    from vllm.tool_parsers.structural_tag_registry import (
        get_model_structural_tag,
        limit_to_single_tool_call,
    )
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    tools = [FunctionTool(type="function", name=f"t{i}", parameters=SCHEMA, strict=(i % 2 == 0))
             for i in range(5)]
    model = ToolParserManager.get_tool_parser(name).structural_tag_model or REFERENCE_MODEL[name]
    tag = get_model_structural_tag(
        model=model, tools=tools, reasoning=False,
        strict_level=ToolStrictLevel.PARAMETER if every_tool else ToolStrictLevel.FUNCTION,
        tool_choice=ToolChoiceAllowed(type="allowed_tools", mode=mode,
                                      tools=[{"type": "function", "name": n} for n in ALLOWED]))
    return limit_to_single_tool_call(tag) if not parallel else tag


@pytest.mark.parametrize("name", STRUCTURAL)
@pytest.mark.parametrize("mode", ["auto", "required"])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("every_tool", [False, True], ids=["strict-only", "every-tool"])
def test_grammar_is_the_one_vllms_parser_builds(name, mode, parallel, every_tool):
    """Ours is vLLM's own tag for the subset: with only strict tools held to their schema, as
    vLLM's ``--tool-strict-level function``; with every tool held (our default), as ``parameter``."""
    ours = build_structural_tag(name, allowed_functions(), mode, parallel_tool_calls=parallel,
                                every_tool=every_tool)
    assert dumped(ours) == dumped(as_objects(name, _vllm_tag(name, mode, parallel, every_tool), mode))


def as_objects(name: str, tag, mode: str):
    """vLLM's tag with its free text and argument slots as ours are (an auto turn's text holds no
    marker of the format but as a call's opening: decode/free_text.py; arguments objects only, on
    one line where the format's parser reads no line break, strings kept from the format's
    markers): the two transforms our builder applies to every format; and for harmony, calls
    ending at the call token, a required turn's preamble bounded, markers as tokens."""
    spec = wire_format(name).grammar
    if spec.kind == "vllm":
        from vllm_allowed_tools.decode.server_recipients import bound_preambles, preamble_bound
        from vllm_allowed_tools.vllm_glue.vllm_tags import as_served
        tag = as_served(spec.vllm_model, tag)
        if spec.vllm_model == "harmony":
            bound_preambles(tag.format, preamble_bound(mode))
    tag = with_unmarked_free_text(tag, name)
    tag = with_object_arguments(tag, one_line=spec.arguments_on_one_line, markers=format_markers(name))
    return with_marker_tokens(tag, dict(spec.marker_tokens))


def harmony_accepts(tag, text: str, *, pieces: bool = False) -> bool:
    """``tag`` admits ``text`` written with harmony's markers as their tokens (``pieces``: each
    marker spelled in one-character tokens instead), over a walk vocabulary, each token in the
    matcher's mask (as a model decodes)."""
    from support.grammar_walk import GrammarWalker, marker_texts
    texts = marker_texts("openai")
    walker = GrammarWalker(tag, list(texts.values()), token_texts=texts)
    tokens = [piece for part in re.split("(<\\|[a-z]+\\|>)", text) if part
              for piece in ([part] if part in texts.values() and not pieces else list(part))]
    return walker.accepts(tokens, masked=True)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_harmony_call_ends_at_the_call_token_only(mode):
    """vLLM's harmony tag lets a call end with ``<|end|>``; spelled in text pieces it passes the
    grammar and the harmony parser (token ids) reads it as part of the arguments. Ours ends a
    call where ``<|call|>`` (a stop token) must follow."""
    tag = build_structural_tag("openai", allowed_functions(), mode, parallel_tool_calls=False)
    call = '<|channel|>commentary to=functions.t1 <|constrain|>json<|message|>{"city": "Oslo"}'
    assert harmony_accepts(tag, call)
    assert not harmony_accepts(tag, call + "<|end|>")
    assert harmony_accepts(_vllm_tag("openai", mode, False), call + "<|end|>")   # what this closes


def test_a_required_harmony_turn_reaches_its_call_within_the_preamble_bound(monkeypatch):
    """A required gpt-oss turn may write an analysis and a commentary message before its call;
    each holds at most VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS tokens, so the call comes within
    the turn's token budget (vLLM's tag leaves both unbounded). Auto turns, which may answer
    instead, keep theirs unbounded."""
    from vllm_allowed_tools.decode.grammar import clear_tag_cache
    from vllm_allowed_tools.settings import reset_for_tests
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS", "5")
    reset_for_tests()
    clear_tag_cache()
    try:
        call = '<|channel|>commentary to=functions.t1 <|constrain|>json<|message|>{"city": "Oslo"}'

        def turn(analysis: str, commentary: str) -> str:
            return (f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant"
                    f"<|channel|>commentary<|message|>{commentary}<|end|><|start|>assistant{call}")
        required = build_structural_tag("openai", allowed_functions(), "required", parallel_tool_calls=False)
        auto = build_structural_tag("openai", allowed_functions(), "auto", parallel_tool_calls=False)
        assert harmony_accepts(required, turn("abcde", "vwxyz"))
        assert not harmony_accepts(required, turn("abcdef", "z"))
        assert not harmony_accepts(required, turn("a", "uvwxyz"))
        assert harmony_accepts(auto, turn("abcdef" * 20, "uvwxyz" * 20))
        assert harmony_accepts(_vllm_tag("openai", "required", False), turn("abcdef" * 20, "z"))   # closed
        monkeypatch.setenv("VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS", "0")   # no bound
        reset_for_tests()
        clear_tag_cache()
        unbounded = build_structural_tag("openai", allowed_functions(), "required", parallel_tool_calls=False)
        assert harmony_accepts(unbounded, turn("abcdef" * 20, "z"))
    finally:
        monkeypatch.undo()
        reset_for_tests()
        clear_tag_cache()


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_harmony_markers_are_admitted_only_as_their_tokens(mode):
    """HarmonyParser reads markers by token id: spelled in ordinary tokens, ``<|start|>`` starts no
    message. vLLM's tag matches markers as text; ours admits each only as its one token, and no
    marker inside a message's free text."""
    tag = build_structural_tag("openai", allowed_functions(), mode, parallel_tool_calls=False)
    call = ('<|channel|>analysis<|message|>think<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.t1 <|constrain|>json<|message|>{"city": "Oslo"}')
    assert harmony_accepts(tag, call)
    assert not harmony_accepts(tag, call, pieces=True)
    assert harmony_accepts(_vllm_tag("openai", mode, False), call, pieces=True)   # what this closes
    inner = call.replace("think", "a <|start|> b")
    assert not harmony_accepts(tag, inner) and not harmony_accepts(tag, inner.replace("<|start|>", "<|call|>"))


#: one parameter, as each XML argument style writes it
XML_PARAMETER = {"qwen_xml": "<parameter=a>\n1\n</parameter>", "minimax_xml": '<parameter name="a">1</parameter>',
                 "glm_xml": "<arg_key>a</arg_key><arg_value>1</arg_value>"}


@pytest.mark.parametrize("name", FORMATS)
def test_every_argument_slot_admits_only_an_object(name):
    """A non-strict tool's arguments are an object with any keys, never another JSON value (an
    agent client cannot run a call whose arguments are a string); on one-line formats also
    never a line break."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string
    if wire_format(name).grammar.kind == "vllm":
        from vllm.tool_parsers import ToolParserManager
        ToolParserManager.get_tool_parser(name)   # registers the builder vLLM keeps with its parser
    loose = [AllowedFunction("t1", None, strict=None), AllowedFunction("t2", {}, strict=True)]
    tag = build_structural_tag(name, loose, "required", parallel_tool_calls=False)
    if wire_format(name).grammar.call_syntax == "pythonic":   # Python calls, keyword arguments
        grammar = xgrammar.Grammar.from_structural_tag(tag)
        assert _is_grammar_accept_string(grammar, "[t1()]")
        for other in ('[t1("unit{")]', "[t2([1])]", '[{"name": "t1"}]'):
            assert not _is_grammar_accept_string(grammar, other), other
        return
    if wire_format(name).grammar.kind == "json_array":   # one grammar: the array of calls
        grammar = xgrammar.Grammar.from_structural_tag(tag)
        key = wire_format(name).grammar.arguments_key
        assert _is_grammar_accept_string(grammar, '[{"name": "t1", "%s": {"a": 1}}]' % key)
        assert not _is_grammar_accept_string(grammar, '[{"name": "t1", "%s": "unit{"}]' % key)
        assert not _is_grammar_accept_string(grammar, '[{"name": "t2", "%s": [1]}]' % key)
        return
    slots = [node["json_schema"] if node["type"] == "json_schema" else node["grammar"]
             for node in tag_nodes(tag)
             if node.get("type") == "grammar" or (node.get("type") == "json_schema"
                                                   and node.get("style") == "json")]
    assert slots, name
    for slot in slots:
        if isinstance(slot, str) and grammar_style(slot) != "json":   # XML parameters
            grammar = xgrammar.Grammar.from_ebnf(slot)
            assert _is_grammar_accept_string(grammar, XML_PARAMETER[grammar_style(slot)])
            for other in ('"unit{"', "[1]", "3", '{"a": 1}'):
                assert not _is_grammar_accept_string(grammar, other), (name, other)
            continue
        if isinstance(slot, str):   # JSON EBNF (decode/safe_json.py), on one line where the format says
            grammar = xgrammar.Grammar.from_ebnf(slot)
            if wire_format(name).grammar.arguments_on_one_line:
                assert not _is_grammar_accept_string(grammar, '{"a":\n1}')
                assert not _is_grammar_accept_string(grammar, '{\n"a": 1}')
        else:
            grammar = xgrammar.Grammar.from_json_schema(json.dumps(slot))
        assert _is_grammar_accept_string(grammar, '{"a": 1}')
        for other in ('"unit{"', "[1]", "3", "null", "true"):
            assert not _is_grammar_accept_string(grammar, other), (name, other)


@pytest.mark.parametrize("name", STRUCTURAL)
def test_whitespace_cap_is_xgrammars_option_on_every_argument_grammar(name):
    from xgrammar.structural_tag import JSONSchemaFormat
    theirs = _vllm_tag(name, "required", True)

    def cap(node):
        if isinstance(node, JSONSchemaFormat):
            node.max_whitespace_cnt = 2
        for child in (getattr(node, field) for field in getattr(type(node), "model_fields", ())):
            for item in child if isinstance(child, list) else [child]:
                cap(item)
    cap(theirs.format)
    ours = build_structural_tag(name, allowed_functions(), "required", max_whitespace=2, every_tool=False)
    assert dumped(ours) == dumped(as_objects(name, theirs, "required"))


@pytest.mark.parametrize("name", RENAMED)
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_renamed_grammar_is_its_source_with_only_the_markup_renamed(name, mode):
    """Seed-OSS writes Qwen3-Coder's XML calls with other wrapper tokens (what vLLM's seed_oss
    parser reads): its tag is xgrammar's qwen_3_coder tag for the same subset, every markup string
    renamed, schemas untouched (and its free text as every format's: decode/free_text.py)."""
    import xgrammar
    from xgrammar import StructuralTag
    spec = wire_format(name).grammar
    renamed = dict(spec.rename)

    def markup(text: str) -> str:
        return re.sub("|".join(re.escape(old) for old in sorted(renamed, key=len, reverse=True)),
                      lambda match: renamed[match.group(0)], text)

    def renamed_markup(node, key=None):
        if isinstance(node, dict):
            return {k: renamed_markup(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [renamed_markup(item, key) for item in node]
        return markup(node) if isinstance(node, str) and key in ("begin", "end", "triggers", "excludes") else node

    ours = json.loads(dumped(build_structural_tag(name, allowed_functions(), mode)))
    theirs = json.loads(dumped(with_unmarked_free_text(StructuralTag.model_validate(renamed_markup(
        xgrammar.get_model_structural_tag(
            spec.xgrammar_model, tools=[{"type": "function", "function": {
                "name": f.name, "parameters": f.parameters, "strict": bool(f.strict)}}
                for f in allowed_functions()],
            tool_choice=mode, reasoning=False).model_dump())), name)))

    def walk(a, b, key=None):
        if isinstance(a, dict) and a.get("type") == "grammar" and b.get("type") == "json_schema":
            # the XML arguments, rewritten from xgrammar's (values unframed): the same parameters
            assert grammar_style(a["grammar"]) == b["style"]
            schema = b["json_schema"] if isinstance(b["json_schema"], dict) else {}
            for parameter in schema.get("properties", {}):
                assert f'"<parameter={parameter}"' in a["grammar"]
            return
        if isinstance(a, dict):
            assert set(a) == set(b)
            for k in a:
                walk(a[k], b[k], k)
        elif isinstance(a, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                walk(x, y, key)
        else:
            assert a == b, (key, a, b)
    walk(ours, theirs)
    assert "<tool_call>" not in json.dumps(ours) and "<seed:tool_call>" in json.dumps(ours)


JSON_ARRAY_FORMATS = [n for n in FORMATS if wire_format(n).grammar.kind == "json_array"
                      and wire_format(n).grammar.call_syntax == "json"]


@pytest.mark.parametrize("name", JSON_ARRAY_FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_json_array_formats_have_no_structural_tag_and_vllms_array_envelope(name, parallel):
    """vLLM has no structural tag for these parsers; required mode is its JSON array of calls."""
    from openai.types.responses import FunctionTool
    from vllm.tool_parsers import ToolParserManager
    from vllm.tool_parsers.utils import get_json_schema_from_tools
    assert ToolParserManager.get_tool_parser(name).structural_tag_model is None
    tag = build_structural_tag(name, allowed_functions(), "required", parallel_tool_calls=parallel)
    assert tag.format.type == "grammar"   # the array's safe_json grammar (test below), of this schema:
    ours = call_array_schema(name, allowed_functions(), parallel_tool_calls=parallel)
    theirs = get_json_schema_from_tools("required", [FunctionTool(type="function", name=n, parameters=SCHEMA)
                                                     for n in ALLOWED], parallel_tool_calls=parallel)
    envelope = ("type", "minItems", "maxItems")
    assert {k: ours.get(k) for k in envelope} == {k: theirs.get(k) for k in envelope}
    assert [item["properties"]["name"]["enum"] for item in ours["items"]["anyOf"]] == \
        [item["properties"]["name"]["enum"] for item in theirs["items"]["anyOf"]]
    # the arguments' key is the one that reads the array: vLLM's serving layer (its own schema's
    # key) where the parser leaves required to it, else the parser (Mistral's reads `arguments`)
    key = wire_format(name).grammar.arguments_key
    assert all(item["required"] == ["name", key] for item in ours["items"]["anyOf"])
    if ToolParserManager.get_tool_parser(name).supports_required_and_named:
        assert all(key in item["properties"] for item in theirs["items"]["anyOf"])
    else:
        assert key == "arguments" and name == "mistral"   # _pre_v11_function_calls reads it


@pytest.mark.parametrize("name", JSON_ARRAY_FORMATS)
def test_json_array_strings_spell_no_marker_and_no_lone_surrogate(name):
    """The required array is xgrammar's JSON grammar of the schema through decode/safe_json.py, as
    every tag's JSON slots: a string cannot spell the format's markers (its parser takes one for
    the marker) nor a lone surrogate escape (vLLM's pydantic read of the array refuses it)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string
    tag = build_structural_tag(name, [AllowedFunction("t1", None, strict=None)], "required",
                               parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag)
    key = wire_format(name).grammar.arguments_key

    def call(value: str) -> str:
        return '[{"name": "t1", "%s": {"a": %s}}]' % (key, value)
    assert _is_grammar_accept_string(grammar, call('"x \\ud83d\\ude00 y"'))
    assert not _is_grammar_accept_string(grammar, call('"\\udaaa"'))
    assert not _is_grammar_accept_string(grammar, call("1e999"))
    from vllm_allowed_tools.decode.safe_json import MARKUP_STARTS
    for marker in format_markers(name):
        spelled = _is_grammar_accept_string(grammar, call(json.dumps(f"a {marker} b")))
        assert spelled == (marker[0] not in MARKUP_STARTS), marker   # markup never, words yes
        # the marker's value still has a spelling: its first character escaped
        escaped = json.dumps(f"a {marker} b").replace(marker[0], "\\u%04x" % ord(marker[0]), 1)
        assert _is_grammar_accept_string(grammar, call(escaped)), escaped


# ---------------------------------------------------------------------------- the parser classes
def test_parser_classes_are_built_on_first_use():
    code = textwrap.dedent("""
        import sys
        from vllm_allowed_tools.vllm_glue import parsers
        assert "vllm.tool_parsers.llama_tool_parser" not in sys.modules
        assert "AllowedHermesToolParser" not in vars(parsers)
        cls = parsers.AllowedHermesToolParser
        assert cls is parsers.AllowedHermesToolParser and cls.allowed_tools_base_parser == "hermes"
        assert "vllm.tool_parsers.llama_tool_parser" not in sys.modules
        assert parsers.CALL_TRIGGERS["longcat"] == ("<longcat_tool_call>",)
        try:
            parsers.AllowedNoSuchToolParser
        except AttributeError:
            pass
        else:
            raise SystemExit("no AttributeError")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_longcat_registers_and_its_grammar_admits_only_allowed_longcat_calls():
    import xgrammar
    from vllm.tool_parsers import ToolParserManager
    from xgrammar.testing import _is_grammar_accept_string

    from vllm_allowed_tools.vllm_glue.plugin import register
    register()
    cls = ToolParserManager.get_tool_parser("allowed_longcat")
    assert cls.__name__ == "AllowedLongcatToolParser" and cls.structural_tag_model == "longcat"
    grammar = xgrammar.Grammar.from_structural_tag(
        build_structural_tag("longcat", allowed_functions(), "required").model_dump_json())
    call = '<longcat_tool_call>\n{"name": "%s", "arguments": {"city": "Oslo"}}\n</longcat_tool_call>'
    assert _is_grammar_accept_string(grammar, call % "t1")
    assert not _is_grammar_accept_string(grammar, call % "t0")                       # not allowed
    assert not _is_grammar_accept_string(grammar, (call % "t1").replace("longcat_", ""))   # hermes markup


#: (format, an enum value written as its parser reads it, the same value framed by whitespace the
#: parser keeps, a string value, one holding markup the parser takes for markup)
XML_VALUES = [
    ("qwen3_coder", "<parameter=unit>\nc\n</parameter>", "<parameter=unit>\tc </parameter>",
     "<parameter=city>a/function b</parameter>", "<parameter=city>a</function>b</parameter>"),
    ("seed_oss", "<parameter=unit>c</parameter>", "<parameter=unit>\n\nc</parameter>",
     "<parameter=city>a seed:tool_call</parameter>", "<parameter=city>a</seed:tool_call></parameter>"),
    ("minimax_m2", '<parameter name="unit">c</parameter>', '<parameter name="unit">\nc</parameter>',
     '<parameter name="city">a parameter name=</parameter>', '<parameter name="city">a<parameter name="x</parameter>'),
    ("glm47", "<arg_key>unit</arg_key><arg_value>c</arg_value>", "<arg_key>unit</arg_key><arg_value>c\n</arg_value>",
     "<arg_key>city</arg_key><arg_value>a arg_key</arg_value>", "<arg_key>city</arg_key><arg_value>a<arg_key>b</arg_value>"),
]


@pytest.mark.parametrize("name,read,framed,plain,markup", XML_VALUES, ids=[case[0] for case in XML_VALUES])
def test_an_xml_value_is_written_as_its_parser_reads_it(name, read, framed, plain, markup):
    """xgrammar frames a non-string XML value with free whitespace and lets a string hold any
    markup but its closing tag; the parsers keep the value verbatim (qwen3/seed strip one line break
    each side) and read markup as markup. The strict tool's grammar admits neither."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string
    if wire_format(name).grammar.kind == "vllm":
        from vllm.tool_parsers import ToolParserManager
        ToolParserManager.get_tool_parser(name)
    schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
              "required": ["unit"], "additionalProperties": False}
    strings = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    for (parameters, good, bad), bound in itertools.product(((schema, read, framed), (strings, plain, markup)),
                                                            (None, 1, 4)):   # the servers run with 1
        tag = build_structural_tag(name, [AllowedFunction("t", parameters, strict=True)], "required",
                                   parallel_tool_calls=False, max_whitespace=bound)
        slots = [node["grammar"] for node in tag_nodes(tag) if node.get("type") == "grammar"]
        assert len(slots) == 1, name
        grammar = xgrammar.Grammar.from_ebnf(slots[0])
        assert _is_grammar_accept_string(grammar, good), (name, good)
        assert not _is_grammar_accept_string(grammar, bad), (name, bad)

"""vLLM's guidance backend with our hook (vllm_glue/guidance_tags.py): a structural tag validates in
the API server as its Lark translation, and the engine's matcher for it admits the allowed calls,
markers included, and nothing else. The backend is vLLM's own class, on the tiny model's tokenizer
(whose ``<tool_call>`` is an added token: vLLM's own llguidance tokenizer would force that token
and then refuse it)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.vllm_glue import guidance_tags

NAMES = sorted(POOL_BY_NAME)[:3]


@pytest.fixture(scope="module")
def guidance():
    """vLLM's guidance backend module, hooked."""
    from vllm.v1.structured_output import backend_guidance
    assert guidance_tags.install() and guidance_tags.install()   # idempotent
    return backend_guidance


@pytest.fixture(scope="module")
def backend(guidance):
    """vLLM's GuidanceBackend for the random tiny model's tokenizer (built without a whole vLLM
    config: compile_grammar reads only the tokenizer and the vocabulary size)."""
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("random", 0, log=lambda *_: None)))
    instance = object.__new__(guidance.GuidanceBackend)
    instance.tokenizer, instance.vocab_size = tokenizer, len(tokenizer)
    instance.ll_tokenizer = guidance.GuidanceBackend._build_ll_tokenizer(tokenizer, len(tokenizer))
    return instance


def _tag(mode: str, names=NAMES[:2]) -> str:
    functions = [AllowedFunction(name, POOL_BY_NAME[name].chat_tool()["function"]["parameters"])
                 for name in names]
    return built(build_structural_tag("hermes", functions, mode, parallel_tool_calls=False)).json


def _options():
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    return StructuredOutputOptions


def _feed(grammar, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(grammar.accept_tokens("r", [token]) for token in ids)


def _allowed(grammar, backend) -> set[int]:
    mask = backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(mask, 0)
    words = mask[0].tolist()
    return {i for i in range(backend.vocab_size) if (words[i // 32] >> (i % 32)) & 1}


def test_a_tag_validates_as_its_translation_and_legacy_tags_stay_vllms(guidance):
    options = _options()
    lark = guidance.serialize_guidance_grammar(options.STRUCTURAL_TAG, _tag("required"))
    assert lark.startswith("%llguidance") and NAMES[0] in lark and NAMES[2] not in lark
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    guidance.validate_guidance_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(
        structural_tag=_tag("auto"))))
    legacy = {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}
    assert "lark_grammar" in guidance.serialize_guidance_grammar(options.STRUCTURAL_TAG, json.dumps(legacy))
    assert "json_schema" in guidance.serialize_guidance_grammar(options.JSON, '{"type": "object"}')


@pytest.mark.parametrize("spec", [
    '{"type": "structural_tag", "format": {"type": "qwen_xml_parameter"}}',   # outside the translation
    '{"type": "structural_tag", "format": [1, 2]}',                           # type-confused
    '{"type": "structural_tag", "format": {"type": "const_string"}}',         # a field missing
    '{"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= ("}}',   # bad EBNF
    '{"type": "structural_tag", "format": {"type": "regex", "pattern": 5}}',
    '{"type": "structural_tag", "format": {"type": "sequence", "elements": "ab"}}',
    "not json", "[]", "7"])
def test_a_tag_outside_the_translation_is_a_400_naming_the_field(guidance, spec):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    with pytest.raises(VLLMValidationError, match="structured_outputs.structural_tag"):
        guidance.serialize_guidance_grammar(_options().STRUCTURAL_TAG, spec)
    with pytest.raises(VLLMValidationError, match="structural_tag"):
        guidance.validate_guidance_grammar(SamplingParams(
            structured_outputs=StructuredOutputsParams(structural_tag=spec)))


def test_the_engine_matcher_admits_an_allowed_call_and_ends_on_eos(backend):
    tokenizer = backend.tokenizer
    grammar = backend.compile_grammar(_options().STRUCTURAL_TAG, _tag("required"))
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert marker in _allowed(grammar, backend) and tokenizer.eos_token_id not in _allowed(grammar, backend)
    call = f'<tool_call>\n{{"name": "{NAMES[0]}", "arguments": {{"day": "friday"}}}}\n</tool_call>'
    assert _feed(grammar, tokenizer, call) and not grammar.ll_matcher.is_error()
    assert _allowed(grammar, backend) == {tokenizer.eos_token_id}   # one call (no parallel calls)
    assert grammar.accept_tokens("r", [tokenizer.eos_token_id]) and grammar.is_terminated()
    grammar.reset()
    assert _feed(grammar, tokenizer, "<tool_call>\n")
    refused = tokenizer.encode(f'{{"name": "{NAMES[2]}"', add_special_tokens=False)
    assert not all(grammar.accept_tokens("r", [token]) for token in refused)


def test_an_auto_tag_admits_text_and_only_allowed_calls(backend):
    tokenizer = backend.tokenizer
    grammar = backend.compile_grammar(_options().STRUCTURAL_TAG, _tag("auto"))
    assert _feed(grammar, tokenizer, "Sure, let me see. ")
    eos = tokenizer.eos_token_id
    assert eos in _allowed(grammar, backend)   # a text-only answer may end here
    assert _feed(grammar, tokenizer, f'<tool_call>\n{{"name": "{NAMES[1]}", "arguments": ')
    grammar.reset()
    assert _feed(grammar, tokenizer, "Ok <tool_call>\n")
    refused = tokenizer.encode(f'{{"name": "{NAMES[2]}"', add_special_tokens=False)
    assert not all(grammar.accept_tokens("r", [token]) for token in refused)


def test_vllms_own_plain_tag_with_json_schemas_is_served(backend):
    """A plain ``required`` turn's tag is vLLM's (json_schema nodes): llguidance's JSON-schema
    grammar serves it there; the logits-processor stage's translation still refuses those nodes
    (its rows move onto xgrammar's matcher, whose JSON must be the same language)."""
    from vllm_allowed_tools.decode.lark_tags import UntranslatableTag, lark_grammar
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{NAMES[0]}", "arguments": ',
                  "content": {"type": "json_schema", "json_schema": {
                      "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                      "additionalProperties": False}},
                  "end": "}\n</tool_call>"}]}}
    grammar = backend.compile_grammar(_options().STRUCTURAL_TAG, json.dumps(tag))
    assert _feed(grammar, backend.tokenizer,
                 f'<tool_call>\n{{"name": "{NAMES[0]}", "arguments": {{"n": 3}}}}\n</tool_call>')
    grammar.reset()
    assert not _feed(grammar, backend.tokenizer, f'<tool_call>\n{{"name": "{NAMES[0]}", "arguments": {{"n": "x"')
    with pytest.raises(UntranslatableTag, match="json_schema"):
        lark_grammar(json.dumps(tag))


def test_without_the_hook_the_backend_refuses_our_tags():
    """The reason for the hook: vLLM's guidance backend reads only the legacy tag form."""
    import importlib

    from vllm.v1.structured_output import backend_guidance
    hooked = backend_guidance.serialize_guidance_grammar
    assert getattr(hooked, "__wrapped_by_allowed_tools__", False) or guidance_tags.install()
    original = backend_guidance.serialize_guidance_grammar.__wrapped__
    with pytest.raises(KeyError):
        original(_options().STRUCTURAL_TAG, _tag("required"))
    assert importlib.import_module("vllm_allowed_tools.vllm_glue.guidance_tags").unsupported_reason() is None


@pytest.mark.parametrize("model", ["hermes", "llama", "kimi", "deepseek_v3_1", "glm_4_7", "minimax", "qwen_3_coder"])
def test_vllms_own_plain_required_tags(guidance, model):
    """A plain ``required`` turn's tag is vLLM's own: every one translates (``star``, JSON
    schemas) but the XML argument styles (GLM-4.7's, MiniMax's, Qwen3-Coder's): a 400 naming the field
    (vLLM's guidance backend refuses all of them)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    tools=[POOL_BY_NAME[name].chat_tool() for name in NAMES],
                                    tool_choice="required")
    tag = json.dumps(get_model_structural_tag(model=model, tools=request.tools, tool_choice="required",
                                              reasoning=False).model_dump())
    serialize = guidance.serialize_guidance_grammar
    if model in ("glm_4_7", "minimax", "qwen_3_coder"):
        with pytest.raises(VLLMValidationError, match="structured_outputs.structural_tag.*json_schema"):
            serialize(_options().STRUCTURAL_TAG, tag)
        return
    lark = serialize(_options().STRUCTURAL_TAG, tag)
    assert all(name in lark for name in NAMES) and not guidance.llguidance.LLMatcher.validate_grammar(lark, None)


_LEAVES = st.sampled_from([None, True, 0, -1, 2.5, "", "a", "<tool_call>", 'root ::= "x"', "[a-z]+",
                           "type", "const_string", "tag", "sequence", "or", "grammar", "regex",
                           "any_text", "triggered_tags", "tags_with_separator", "json_schema", "star",
                           "plus", "token"])
_KEYS = st.sampled_from(["type", "value", "elements", "content", "begin", "end", "pattern", "grammar",
                         "triggers", "tags", "json_schema", "token", "separator", "excludes"])
_NODES = st.recursive(_LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(_KEYS, children, max_size=5)), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_NODES)
def test_any_tag_a_client_sends_is_served_or_a_400(guidance, node):
    """Whatever a client's structural tag holds, the hook answers with a grammar llguidance
    validates or vLLM's validation error (a 400), never another exception (a 500)."""
    from vllm.exceptions import VLLMValidationError
    spec = json.dumps({"type": "structural_tag", "format": node})
    try:
        lark = guidance.serialize_guidance_grammar(_options().STRUCTURAL_TAG, spec)
    except VLLMValidationError:
        return
    guidance.llguidance.LLMatcher.validate_grammar(lark, None)   # returns its error, never raises

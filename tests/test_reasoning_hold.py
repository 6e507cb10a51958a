"""A turn that must call while it reasons: no stop token, reasoning cut in time for the call (no server).

The pure rules (:mod:`vllm_allowed_tools.decode.reasoning_hold`: which tokens a row may write in
which state, the budget arithmetic), the shortest call a grammar admits
(:mod:`vllm_allowed_tools.decode.call_budget`: checked against the compiled grammar itself), and
the rows of the logits processor's batch under vLLM's real ``qwen3`` and ``deepseek_r1`` reasoning
parsers on the tiny model's tokenizer, with a grammar (the logits-processor stage) and without one
(vLLM's native stage, where this processor only holds the reasoning). A call written inside the
reasoning is read by neither vLLM's parsers nor ours.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")

from vllm_allowed_tools.decode.call_budget import minimal_json, reserve_tokens, shortest_call_text
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
from vllm_allowed_tools.decode.masks import MaskedBatch
from vllm_allowed_tools.decode.reasoning_hold import (
    BAN_STOPS,
    END_REASONING,
    must_end_reasoning,
    next_step,
    read_must_call,
    refused_tokens,
)
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import ConstraintArgsError, read_extra_args
from vllm_allowed_tools.wire import XARGS_MUST_CALL

from support.reasoning import compiled_grammars, reasoning_gate, tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
FUNCTIONS = [AllowedFunction(f"tool_{i}", SCHEMA, strict=True) for i in range(4)]
PROMPT = "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------ the pure rules

@given(generated=st.integers(0, 500), max_tokens=st.integers(1, 500), reserve=st.integers(0, 100),
       end=st.one_of(st.none(), st.integers(0, 1000)))
def test_reasoning_ends_exactly_when_the_budget_left_is_the_calls(generated, max_tokens, reserve, end):
    step = next_step(generated, max_tokens, reserve, end)
    left = max_tokens - generated
    if end is not None and left <= reserve + 1:
        assert step == END_REASONING and must_end_reasoning(generated, max_tokens, reserve)
    else:
        assert step == BAN_STOPS
    assert next_step(generated, None, reserve, end) == BAN_STOPS   # no budget: never cut


@given(stops=st.sets(st.integers(-5, 200)), end=st.one_of(st.none(), st.integers(0, 150)))
def test_the_refused_tokens_are_the_stops_in_the_vocabulary_never_the_end_marker(stops, end):
    refused = refused_tokens(stops, 150, end)
    assert refused == {t for t in stops if 0 <= t < 150} - {end}


@pytest.mark.parametrize("value", [-1, "3", 2.5, True, None])
def test_a_malformed_reserve_is_refused_naming_the_key(value):
    with pytest.raises(ConstraintArgsError, match=XARGS_MUST_CALL):
        read_must_call({XARGS_MUST_CALL: value})
    assert read_must_call({XARGS_MUST_CALL: 7}) == 7 and read_must_call({}) is None


# ------------------------------------------------------------------ the shortest call

_LEAF = st.one_of(
    st.just({"type": "string"}), st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(0, 5)),
    st.just({"type": "integer"}), st.builds(lambda m: {"type": "number", "minimum": m}, st.integers(-3, 9)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda values: {"enum": values}, st.lists(st.text(max_size=4), min_size=1, max_size=3)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer"}, "minItems": n}, st.integers(0, 3)))
_SCHEMA = st.recursive(_LEAF, lambda inner: st.builds(
    lambda props, required: {"type": "object", "properties": props,
                             "required": sorted(k for k in props if k in required)},
    st.dictionaries(st.sampled_from("abcdef"), inner, max_size=4), st.sets(st.sampled_from("abcdef"))),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(schema=_SCHEMA)
def test_the_smallest_arguments_satisfy_their_schema(schema):
    import jsonschema
    arguments = minimal_json(schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [error.message for error in validator.iter_errors(arguments)]
    assert not errors, (schema, arguments, errors)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "llama3_json", "kimi_k2", "longcat"])
def test_the_shortest_call_is_one_the_grammar_admits_and_completes(fmt):
    """The text sized for the call is a whole call of the turn's ``required`` grammar."""
    functions = [AllowedFunction("get_weather", {"type": "object", "properties": {
                     "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                     "required": ["city", "days"]}, strict=True),
                 AllowedFunction("lookup_order", {"type": "object", "properties": {
                     "order_id": {"type": "string", "minLength": 3}}, "required": ["order_id"]}, strict=True)]
    tag = built(build_structural_tag(fmt, functions, "required", parallel_tool_calls=False, max_whitespace=1))
    pieces = shortest_call_text(tag.json, {f.name: f.parameters for f in functions})
    assert all(isinstance(piece, str) for piece in pieces)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_structural_tag(tag.json)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    call = "".join(pieces)
    if fmt == "qwen3_coder":   # XML arguments are sized, not spelled: never shorter than the real one
        real = "<tool_call>\n<function=lookup_order>\n<parameter=order_id>\naaa\n</parameter>\n</function>\n</tool_call>"
        assert len(call) >= len(real)
        call = real
    assert matcher.accept_string(call) and matcher.is_terminated(), (fmt, pieces)
    assert reserve_tokens(pieces, len) == len("".join(pieces)) * 5 // 4 + 2


# ------------------------------------------------------------------ the batch's rows

@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return compiled_grammars(tokenizer)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def gate(request, tokenizer):
    return reasoning_gate(tokenizer, request.param)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(batch: MaskedBatch, row: int, vocab: int) -> list[int] | None:
    batch.sync()
    logits = torch.zeros(row + 1, vocab)
    batch.apply(logits)
    if torch.isfinite(logits[row]).all():
        return None
    return torch.isfinite(logits[row]).nonzero().flatten().tolist()


def _grammar():
    tag = built(build_structural_tag("hermes", FUNCTIONS[1:2], "required", max_whitespace=1))
    return read_extra_args(constraint_extra_args(tag))


@pytest.mark.parametrize("with_grammar", [True, False], ids=["logits-processor", "native"])
def test_a_row_that_must_call_cannot_stop_while_it_reasons(tokenizer, grammars, gate, with_grammar):
    vocab = len(tokenizer)
    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"), 7})
    end = tokenizer.convert_tokens_to_ids("</think>")
    assert gate.end_token_id == end
    batch = MaskedBatch(grammars, vocab, max_rows=2, reasoning=gate)
    output: list[int] = []
    batch.add(1, _grammar() if with_grammar else None, output, stops, _ids(tokenizer, PROMPT),
              must_call=10, max_tokens=200)
    for token in [None, *_ids(tokenizer, "<think>\nI could call tool_3.\n")]:
        if token is not None:
            output.append(token)
        allowed = _allowed(batch, 1, vocab)
        assert allowed is not None and set(range(vocab)) - set(allowed) == set(stops), token
    output.append(end)
    allowed = _allowed(batch, 1, vocab)
    if with_grammar:   # the grammar's turn: a call start only
        assert allowed and all("<tool_call>".startswith(tokenizer.decode([t])) for t in allowed)
    else:              # the native stage's grammar takes over; this processor lets the row go
        assert allowed is None and 1 not in batch.rows


@pytest.mark.parametrize("with_grammar", [True, False], ids=["logits-processor", "native"])
def test_reasoning_ends_while_the_budget_still_holds_the_call(tokenizer, grammars, gate, with_grammar):
    vocab, eos, end = len(tokenizer), tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</think>")
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=gate)
    output: list[int] = []
    batch.add(0, _grammar() if with_grammar else None, output, [eos], _ids(tokenizer, PROMPT),
              must_call=20, max_tokens=30)
    steps = []
    for token in _ids(tokenizer, "<think>\nhello there, a long thought goes on and on and on"):
        allowed = _allowed(batch, 0, vocab)
        steps.append(allowed == [end])
        if allowed == [end]:
            break
        output.append(token)
    assert steps[-1] and steps.count(True) == 1
    assert len(output) == 30 - 20 - 1   # the end marker and 20 tokens for the call are left


def test_a_row_free_to_answer_or_without_a_reasoning_parser_is_not_held(tokenizer, grammars, gate):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=2, reasoning=gate)
    batch.add(0, None, [], [eos], _ids(tokenizer, PROMPT))                       # not a must-call row
    batch.add(1, None, [], [eos], _ids(tokenizer, PROMPT + "<think>\n\n</think>\n\n"), must_call=5)
    assert batch.rows == {}                  # the second one's prompt already ended reasoning
    plain = MaskedBatch(grammars, vocab, max_rows=1, reasoning=None)
    plain.add(0, None, [], [eos], _ids(tokenizer, PROMPT), must_call=5)
    assert plain.rows == {}


def test_the_wrapper_marks_turns_that_must_call_and_a_client_cannot():
    """``required`` selections, plain ``required`` and named choices carry the reserve of their
    shortest call; ``auto`` does not; a client's own key is stripped."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.request.rewrite import rewrite_request
    from support.calls import chat_selection
    from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    wrapper = ToolParserManager.get_tool_parser("allowed_hermes")(tiny_tokenizer())
    names = sorted(POOL_BY_NAME)[:4]
    reserves = {}
    for label, choice in [("required", chat_selection("required", names[:2])),
                          ("auto", chat_selection("auto", names[:2])), ("plain", "required"),
                          ("named", {"type": "function", "function": {"name": names[0]}}),
                          ("plain auto", "auto"), ("no reasoning", chat_selection("required", names[:2]))]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
                "tools": [POOL_BY_NAME[name].chat_tool() for name in names],
                "vllm_xargs": {XARGS_MUST_CALL: 0}, "include_reasoning": label != "no reasoning"}
        request = ChatCompletionRequest(**rewrite_request(body, "chat").body)
        assert XARGS_MUST_CALL not in (request.vllm_xargs or {}), label
        if label.startswith(("plain", "named")):   # vLLM's parser sets its tag before the wrapper runs
            tag = wrapper.get_structural_tag(request)
            request.structured_outputs = tag and StructuredOutputsParams(structural_tag=json.dumps(tag.model_dump()))
        reserves[label] = (wrapper.adjust_request(request).vllm_xargs or {}).get(XARGS_MUST_CALL)
    # include_reasoning: false: the native stage constrains from the first token, nothing to hold
    assert reserves["auto"] is None and reserves["plain auto"] is None and reserves["no reasoning"] is None
    assert all(isinstance(reserves[k], int) and reserves[k] >= 8 for k in ("required", "plain", "named")), reserves


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_call_written_inside_the_reasoning_is_never_a_call(tokenizer, parser):
    """vLLM hands the tool parser only the content after the reasoning: a call inside it stays
    reasoning text, never parsed (deepseek_r1). qwen3 reads a ``<tool_call>`` inside ``<think>`` as
    the end of reasoning: that call is after the reasoning, where the grammar (and here the
    wrapper, for a name outside the allowlist) applies."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.request.rewrite import rewrite_request
    from support.calls import chat_selection
    from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    names = sorted(POOL_BY_NAME)[:3]
    inside = f'<tool_call>\n{{"name": "{names[2]}", "arguments": {{}}}}\n</tool_call>'
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "tools": [POOL_BY_NAME[name].chat_tool() for name in names],
            "tool_choice": chat_selection("auto", names[:2])}
    request = ChatCompletionRequest(**rewrite_request(body, "chat").body)
    reasoner = ReasoningParserManager.get_reasoning_parser(parser)(tokenizer=tokenizer)
    wrapper = ToolParserManager.get_tool_parser("allowed_hermes")(tokenizer)
    text = f"<think>\nMaybe {inside} first.\n</think>\n\nHello."
    reasoning, content = reasoner.extract_reasoning(text, request)
    if parser == "qwen3":   # the call ended the reasoning: content, where the allowlist applies
        assert inside not in (reasoning or "") and inside in (content or "")
    else:
        assert inside in (reasoning or "") and "tool_call" not in (content or "")
    extracted = wrapper.extract_tool_calls(content or "", request)
    assert extracted.tool_calls == [] and json.dumps(names[2]) not in (extracted.content or "")


# ------------------------------------------------------------------- gpt-oss: the preamble's budget

def test_a_harmony_required_turns_preamble_leaves_its_budget_room_for_the_call():
    """Each preamble message (analysis, commentary) holds at most half of what the budget has
    left after the shortest call and the messages' markup; a large budget keeps the configured
    bound; the call's own grammar is untouched."""
    import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony tag builder)

    from vllm_allowed_tools.decode.call_budget import shortest_call_text
    from vllm_allowed_tools.decode.turn_grammar import (
        HARMONY_PREAMBLE_MARKUP,
        TurnRead,
        Wrapper,
        preambles_within_budget,
    )
    from vllm_allowed_tools.vllm_glue.plugin import register
    from vllm_allowed_tools.wire import WireAllowlist

    register()
    schema = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
    tag = built(build_structural_tag("openai", [AllowedFunction("lookup_order", schema, strict=True)],
                                     "required", parallel_tool_calls=False, max_whitespace=1)).tag
    pieces = shortest_call_text(tag.model_dump(), {"lookup_order": schema})
    assert '{"order_id":""}' in pieces and 200008 in pieces       # the arguments and the markers sized

    def bounds(max_tokens, mode="required"):
        allowlist = WireAllowlist(mode=mode, allowed=frozenset({"lookup_order"}),
                                  catalog=frozenset({"lookup_order"}), parallel_tool_calls=False,
                                  catalog_digest="c", allowlist_digest="a")
        turn = TurnRead(Wrapper("openai", "harmony"), allowlist,
                        catalog=(AllowedFunction("lookup_order", schema),), max_tokens=max_tokens)
        out = json.dumps(preambles_within_budget(turn, tag).model_dump())
        return sorted(int(v) for v in __import__("re").findall(r'"max_tokens": (\d+)', out))

    assert bounds(None) == bounds(100_000) == [2048, 2048]
    small = bounds(200)
    assert len(small) == 2 and small[0] == small[1] < 100
    reserve = 200 - HARMONY_PREAMBLE_MARKUP - 2 * small[0]
    assert 8 <= reserve <= 60                                     # the shortest call, with its margin
    assert bounds(10) == [0, 0] and bounds(200, mode="auto") == [2048, 2048]

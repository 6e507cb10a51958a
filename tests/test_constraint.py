"""The grammar builder, its caches and the logits-processor stage's batch masking (no server).

The masking tests decode with random logits through :class:`MaskedBatch` on the tiny model's real
tokenizer: whatever the logits say, a constrained row can only spell a call its own grammar admits,
and an unconstrained row is left untouched.
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

from vllm_allowed_tools.decode import cpu_mask
from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch
from vllm_allowed_tools.decode.stage import ConstraintArgsError, choose_stage, read_extra_args
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.decode.grammar import (
    AllowedFunction,
    GrammarKey,
    cached_subset_tag,
    build_structural_tag,
    built,
    call_array_schema,
    clear_tag_cache,
    tag_cache_stats,
)
from vllm_allowed_tools.wire import XARGS_DIGEST, XARGS_TAG, XARGS_TEXT_UTF8

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
FUNCTIONS = [AllowedFunction(f"tool_{i}", SCHEMA, strict=True) for i in range(6)]


# ---------------------------------------------------------------------------- grammar builder
@pytest.mark.parametrize("kwargs,message", [
    ({"wire_format": "harmony"}, "unknown wire format"),
    ({"mode": "none"}, "mode must be"),
    ({"functions": []}, "never empty"),
])
def test_builder_refuses_bad_input(kwargs, message):
    args = {"wire_format": "hermes", "functions": FUNCTIONS[:1], "mode": "auto", **kwargs}
    with pytest.raises(ValueError, match=message):
        build_structural_tag(args["wire_format"], args["functions"], args["mode"])


def test_json_array_formats_have_an_auto_grammar_and_a_required_array():
    assert build_structural_tag("mistral", FUNCTIONS[:2], "auto").format.type == "triggered_tags"
    assert build_structural_tag("pythonic", FUNCTIONS[:2], "auto").format.type == "or"   # a dispatch
    tag = build_structural_tag("xlam", FUNCTIONS[:2], "required", parallel_tool_calls=False)
    assert tag.format.type == "grammar"   # the schema's JSON through decode/safe_json.py
    schema = call_array_schema("xlam", FUNCTIONS[:2], parallel_tool_calls=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == \
        [["tool_0"], ["tool_1"]]


def test_tag_cache_builds_once_per_turn_and_keys_on_the_subset():
    clear_tag_cache()
    calls = []

    def functions(subset):
        def make():
            calls.append(subset)
            return [f for f in FUNCTIONS if f.name in subset]
        return make

    key = GrammarKey("hermes", "catalog", "allow-a", "auto", True)
    first = cached_subset_tag(key, functions(("tool_0",)))
    again = cached_subset_tag(key, functions(("tool_0",)))
    other = cached_subset_tag(GrammarKey("hermes", "catalog", "allow-b", "auto", True),
                               functions(("tool_1",)))
    assert first is again and first.digest != other.digest
    assert calls == [("tool_0",), ("tool_1",)]
    assert tag_cache_stats()[:2] == (1, 2)
    assert cached_subset_tag(GrammarKey("mistral", "c", "a", "auto", True), functions(("tool_0",))) \
        is not None   # after [TOOL_CALLS]


# ---------------------------------------------------------------------------- request arguments
def test_extra_args_round_trip_and_refusals():
    tag = built(build_structural_tag("hermes", FUNCTIONS[:1], "required"))
    args = constraint_extra_args(tag)
    assert read_extra_args(args).digest == tag.digest
    assert read_extra_args(None) is None and read_extra_args({"other": 1}) is None
    with pytest.raises(ConstraintArgsError, match=XARGS_DIGEST):
        read_extra_args({**args, XARGS_DIGEST: "0" * 64})
    with pytest.raises(ConstraintArgsError, match=XARGS_TAG):
        read_extra_args({XARGS_DIGEST: tag.digest})
    assert not read_extra_args(args).utf8_text and read_extra_args({**args, XARGS_TEXT_UTF8: 1}).utf8_text
    for wrong in ("1", 2, 1.0, None, [1]):
        with pytest.raises(ConstraintArgsError, match=XARGS_TEXT_UTF8):
            read_extra_args({**args, XARGS_TEXT_UTF8: wrong})


@pytest.mark.parametrize("requested,compiles,on_cpu,blocked,expected", [
    ("auto", True, True, None, "logits-processor"),       # measured faster on CPU
    ("auto", True, False, None, "native"),                # accelerators: not measured, native
    ("auto", True, True, "spec decoding", "native"),      # the processor would not run
    ("auto", False, False, None, "logits-processor"),     # the backend cannot compile tags
    ("auto", False, True, "spec decoding", "refused"),    # neither can serve
    ("native", True, True, None, "native"),
    ("native", False, True, None, "refused"),
    ("logits-processor", True, False, None, "logits-processor"),
    ("logits-processor", True, False, "V2 runner", "refused"),
])
def test_stage_choice(requested, compiles, on_cpu, blocked, expected):
    kwargs = dict(backend="guidance" if not compiles else "xgrammar", backend_compiles_tags=compiles,
                  on_cpu=on_cpu, logits_processor_blocked=blocked)
    if expected == "refused":
        with pytest.raises(CapabilityError) as error:
            choose_stage(requested, **kwargs)
        assert (blocked or "guidance") in str(error.value)
    else:
        assert choose_stage(requested, **kwargs) == expected


# ---------------------------------------------------------------------------- masking
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return AutoTokenizer.from_pretrained(str(ensure_model("random")))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return CompiledGrammars(info, hf_tokenizer=tokenizer)


def _grammar(names, mode="required", parallel=True):
    tag = built(build_structural_tag("hermes", [f for f in FUNCTIONS if f.name in names], mode,
                                     parallel_tool_calls=parallel, max_whitespace=1))
    return read_extra_args(constraint_extra_args(tag))


def _decode(batch: MaskedBatch, outputs: dict[int, list[int]], vocab: int, steps: int, seed: int,
            eos: int) -> dict[int, torch.Tensor]:
    """Sample from random logits through the batch's masks; returns the last step's logits."""
    rng = torch.Generator().manual_seed(seed)
    rows = max(outputs) + 1
    last = {}
    for _ in range(steps):
        batch.sync()
        logits = torch.randn(rows, vocab, generator=rng)
        raw = logits.clone()
        batch.apply(logits)
        for row, output in outputs.items():
            if output and output[-1] == eos:
                continue
            output.append(int(torch.argmax(logits[row])))
        last = {"raw": raw, "masked": logits}
    return last


def _calls(text: str) -> list[dict]:
    found = []
    for chunk in text.split("<tool_call>")[1:]:
        if "</tool_call>" in chunk:            # the last call may still be under way
            found.append(json.loads(chunk.split("</tool_call>")[0]))
    return found


def test_each_row_follows_its_own_grammar_and_plain_rows_are_untouched(tokenizer, grammars):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=4)
    outputs = {0: [], 1: [], 2: []}
    batch.add(0, _grammar({"tool_1"}), outputs[0], [eos])
    batch.add(1, None, outputs[1], [eos])
    batch.add(2, _grammar({"tool_3", "tool_4"}, parallel=False), outputs[2], [eos])
    last = _decode(batch, outputs, vocab, steps=60, seed=1, eos=eos)
    assert torch.equal(last["raw"][1], last["masked"][1])      # row 1 never masked
    assert outputs[2][-1] == eos                # one call, then only the stop token
    for row, allowed in ((0, {"tool_1"}), (2, {"tool_3", "tool_4"})):
        calls = _calls(tokenizer.decode(outputs[row]))
        assert calls and {call["name"] for call in calls} <= allowed
        assert all(call["arguments"]["city"] in ("Paris", "Oslo") for call in calls)
    assert len(_calls(tokenizer.decode(outputs[2]))) == 1   # parallel_tool_calls: false


def test_moves_swaps_and_removals_carry_the_matchers(tokenizer, grammars):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=4)
    a, b = [], []
    batch.add(0, _grammar({"tool_0"}), a, [eos])
    batch.add(1, _grammar({"tool_5"}), b, [eos])
    _decode(batch, {0: a, 1: b}, vocab, steps=5, seed=2, eos=eos)
    batch.move(0, 1, swap=True)                  # a now lives in row 1, b in row 0
    _decode(batch, {1: a, 0: b}, vocab, steps=5, seed=3, eos=eos)
    batch.move(1, 3, swap=False)                 # a moves to row 3; row 1 is empty
    assert set(batch.rows) == {0, 3}
    _decode(batch, {3: a, 0: b}, vocab, steps=60, seed=4, eos=eos)
    assert {c["name"] for c in _calls(tokenizer.decode(a))} == {"tool_0"}
    assert {c["name"] for c in _calls(tokenizer.decode(b))} == {"tool_5"}
    batch.remove(3)
    assert set(batch.rows) == {0}


def test_a_refused_token_leaves_only_stop_tokens(tokenizer, grammars):
    """A token the grammar cannot accept (e.g. forced by another stage) fails closed."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=2)
    output = tokenizer.encode("hello", add_special_tokens=False)   # required mode admits no text
    batch.add(0, _grammar({"tool_0"}), output, [eos])
    batch.sync()
    logits = torch.zeros(1, vocab)
    batch.apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]


def test_resumed_request_replays_its_tokens(tokenizer, grammars):
    """A preempted request comes back with the tokens it already made; the new matcher replays
    them, so the rest of the call is still constrained."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    prefix = tokenizer.encode('<tool_call>{"name": "tool_2", "arguments": {"city": "',
                              add_special_tokens=False)
    batch = MaskedBatch(grammars, vocab, max_rows=2)
    output = list(prefix)
    batch.add(0, _grammar({"tool_2"}), output, [eos])
    _decode(batch, {0: output}, vocab, steps=40, seed=5, eos=eos)
    assert _calls(tokenizer.decode(output))[0]["arguments"]["city"] in ("Paris", "Oslo")


def test_compiled_grammar_cache(tokenizer, grammars):
    grammar = _grammar({"tool_0", "tool_1"}, mode="auto")
    first = grammars.get(grammar)
    hits = grammars.stats[0]
    assert grammars.get(grammar) is first and grammars.stats[0] == hits + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add-plain", "remove", "move", "swap"]),
                          st.integers(0, 5), st.integers(0, 5)), max_size=40))
def test_batch_bookkeeping_matches_a_reference(grammars, operations):
    """Any sequence of batch updates leaves every row with the grammar of the request that vLLM's
    batch says is there (the same bookkeeping run on a plain dict)."""
    batch = MaskedBatch(grammars, 64, max_rows=6)
    reference: dict[int, str] = {}
    grammar = _grammar({"tool_0"})
    for op, i, j in operations:
        if op == "add":
            token_list: list[int] = []
            batch.add(i, grammar, token_list, [0])
            reference[i] = id(token_list)
        elif op == "add-plain":
            batch.add(i, None, [], [0])
            reference.pop(i, None)
        elif op == "remove":
            batch.remove(i)
            reference.pop(i, None)
        else:
            moving, displaced = reference.pop(i, None), reference.pop(j, None)
            if moving is not None:
                reference[j] = moving
            if op == "swap" and displaced is not None:
                reference[i] = displaced
            batch.move(i, j, swap=op == "swap")
    assert {row: id(state.output_ids) for row, state in batch.rows.items()} == reference


@settings(max_examples=120, deadline=None)
@given(vocab=st.integers(1, 300), rows=st.integers(1, 4), data=st.data(),
       share=st.sampled_from([0.0, MaskedBatch.SPARSE_WORDS_SHARE, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       small=st.sampled_from([0, cpu_mask.SMALL_MASK_ENTRIES]))
def test_cpu_mask_matches_the_bitmask_semantics(grammars, vocab, rows, data, share, dtype, small):
    """Our CPU bitmask application (numpy, all-allowed rows skipped) masks exactly the tokens whose
    bit is 0, in the listed rows, below ``vocab``: partial last words, all-ones rows, padded logits,
    rows not next to each other, small masks (torch) and large ones (numpy), both ways of masking a row (keeping its few allowed tokens:
    ``share`` 1.0; unpacking its refused bits: 0.0) and logits numpy cannot view (bfloat16)
    included. (xgrammar 0.2.8's own CPU kernel writes past a row's end when the row is narrower
    than its last bitmask word, so the reference is the documented rule itself.)"""
    batch = MaskedBatch(grammars, vocab, max_rows=rows)
    batch.SPARSE_WORDS_SHARE = share
    words = batch._bitmask.shape[1]
    for row in range(rows):
        values = data.draw(st.lists(st.sampled_from([-1, 0, 1, -2 ** 31, 2 ** 31 - 1, 12345, -7]),
                                    min_size=words, max_size=words))
        batch._bitmask[row] = torch.tensor(values, dtype=torch.int32)
    indices = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    logits = torch.randn(rows, vocab + data.draw(st.integers(0, 40))).to(dtype)   # padded vocabulary
    expected = logits.clone()
    for row in indices:
        for token in range(vocab):
            if not (int(batch._bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    masked = [row for row in indices
              if any(not (int(batch._bitmask[row, token // 32]) >> (token % 32)) & 1
                     for token in range(vocab))]
    assert batch._not_open(list(indices)) == masked
    if masked:
        saved, cpu_mask.SMALL_MASK_ENTRIES = cpu_mask.SMALL_MASK_ENTRIES, small   # 0: numpy always
        try:
            batch._apply_on_cpu(logits, masked, vocab)
        finally:
            cpu_mask.SMALL_MASK_ENTRIES = saved
    assert torch.equal(logits, expected)

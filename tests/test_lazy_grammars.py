"""A row whose grammar xgrammar has not compiled starts on llguidance (decode/lazy_grammars.py) and
moves onto xgrammar's matcher once the background compile is done, the tokens so far replayed: no
compile on the request's path, the same language from the first token to the last.

On the tiny random model's tokenizer, through the logits-processor stage's batch
(:class:`MaskedBatch`), sampling from random logits: the call written is always an allowed one."""

from __future__ import annotations

import codecs
import json
import time

import pytest
import torch
import xgrammar as xgr

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
from vllm_allowed_tools.decode.lark_tags import lark_grammar
from vllm_allowed_tools.decode.lazy_grammars import LazyMatcher
from vllm_allowed_tools.decode.masks import CompiledGrammars, MaskedBatch
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import read_extra_args

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
FUNCTIONS = [AllowedFunction(f"tool_{i}", SCHEMA, strict=True) for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return AutoTokenizer.from_pretrained(str(ensure_model("random")))


def _grammars(tokenizer, **options) -> CompiledGrammars:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return CompiledGrammars(info, hf_tokenizer=tokenizer, **options)


def _grammar(names, salt: str, mode: str = "required", *, policy: bool = False):
    """A grammar no cache has seen (``salt`` goes into a description-free schema title);
    ``policy``: an allowlist's turn, whose free text may be held to valid UTF-8."""
    schema = {**SCHEMA, "title": salt}
    functions = [AllowedFunction(f.name, schema, strict=True) for f in FUNCTIONS if f.name in names]
    tag = built(build_structural_tag("hermes", functions, mode, parallel_tool_calls=False))
    return read_extra_args(constraint_extra_args(tag, utf8_text=policy))


def _step(batch: MaskedBatch, output: list[int], vocab: int, rng: torch.Generator,
          boost: int | None = None) -> int:
    batch.sync()
    logits = torch.randn(1, vocab, generator=rng)
    if boost is not None:
        logits[0, boost] += 100.0
    batch.apply(logits)
    token = int(torch.argmax(logits[0]))
    output.append(token)
    return token


def _calls(text: str) -> list[str]:
    return [json.loads(chunk.split("</tool_call>")[0])["name"]
            for chunk in text.split("<tool_call>")[1:] if "</tool_call>" in chunk]


@pytest.mark.parametrize("seed", range(4))
def test_a_first_seen_row_starts_on_llguidance_and_moves_onto_xgrammar(tokenizer, seed):
    grammars = _grammars(tokenizer)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    grammar = _grammar({"tool_1", "tool_3"}, f"moves-{seed}")
    assert grammars.ready(grammar) is None
    batch = MaskedBatch(grammars, vocab, max_rows=1)
    output: list[int] = []
    batch.add(0, grammar, output, [eos])
    assert isinstance(batch.rows[0].matcher, LazyMatcher)       # nothing compiled on the path
    rng = torch.Generator().manual_seed(seed)
    for _ in range(3):
        _step(batch, output, vocab, rng)
    deadline = time.monotonic() + 60                            # the background compile
    while grammars.ready(grammar) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert grammars.ready(grammar) is not None
    moved = False
    for _ in range(80):
        if _step(batch, output, vocab, rng) == eos:
            break
        moved = moved or not isinstance(batch.rows[0].matcher, LazyMatcher)
    assert moved and not batch.rows[0].failed
    assert output[-1] == eos
    assert set(_calls(tokenizer.decode(output))) <= {"tool_1", "tool_3"}
    assert _calls(tokenizer.decode(output))


@pytest.mark.parametrize("seed", range(4))
def test_a_row_on_llguidance_alone_writes_an_allowed_call_and_ends_on_its_stop(tokenizer, seed):
    """The compile never lands (no background worker runs it): llguidance masks the whole turn."""
    grammars = _grammars(tokenizer)
    grammars._in_background = lambda grammar, compile_it: None   # noqa: E731 (the compile never runs)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1)
    output: list[int] = []
    batch.add(0, _grammar({"tool_2"}, f"alone-{seed}"), output, [eos])
    rng = torch.Generator().manual_seed(100 + seed)
    for _ in range(80):
        if _step(batch, output, vocab, rng) == eos:
            break
        assert isinstance(batch.rows[0].matcher, LazyMatcher)
    assert output[-1] == eos and not batch.rows[0].failed
    assert _calls(tokenizer.decode(output)) == ["tool_2"]


def test_the_row_ends_only_on_its_own_stop_tokens(tokenizer):
    """xgrammar's ``override_stop_tokens``: once the call is done, the request's stop tokens and
    no other stop token of the tokenizer (here its end of sequence)."""
    grammars = _grammars(tokenizer)
    other = tokenizer.convert_tokens_to_ids("</tools>")       # the request's own stop token
    eos = tokenizer.eos_token_id
    assert other != eos
    matcher = grammars.lazy.matcher(_grammar({"tool_0"}, "stops"), [other])
    text = '<tool_call>\n{"name": "tool_0", "arguments": {"city": "Paris"}}\n</tool_call>'
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token)
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    allowed = {i for i in range(len(tokenizer)) if (words[i >> 5] >> (i & 31)) & 1}
    assert other in allowed and eos not in allowed
    assert not matcher.accept_token(eos) and not matcher.is_terminated()
    assert matcher.accept_token(other) and matcher.is_terminated()


def test_without_llguidance_the_row_waits_for_xgrammar(tokenizer, monkeypatch):
    """``VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS=xgrammar``, or a grammar the translation does not
    cover: the row's matcher is xgrammar's, compiled on the request's path as before."""
    from vllm_allowed_tools.decode import lazy_grammars
    from vllm_allowed_tools.settings import reset_for_tests
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS", "xgrammar")
    reset_for_tests()
    try:
        assert _grammars(tokenizer).lazy is None
    finally:
        monkeypatch.delenv("VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS")
        reset_for_tests()
    grammars = _grammars(tokenizer)

    def untranslatable(tag_json, **options):
        raise lazy_grammars.UntranslatableTag("not covered")
    monkeypatch.setattr(lazy_grammars, "lark_grammar", untranslatable)
    row = grammars.matchers(_grammar({"tool_0"}, "untranslatable"))
    assert isinstance(row.matcher, xgr.GrammarMatcher) and not row.provisional


def test_a_row_llguidance_gives_up_on_may_only_stop(tokenizer):
    """Where llguidance stops a row (one of its limits), the row's mask holds its stop tokens only,
    never nothing at all (a row with no token allowed would sample from -inf logits)."""
    grammars = _grammars(tokenizer)
    eos = tokenizer.eos_token_id
    matcher = grammars.lazy.matcher(_grammar({"tool_0"}, "gives-up"), [eos])
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("{"))   # refused: an error
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    allowed = [i for i in range(len(tokenizer)) if (words[i >> 5] >> (i & 31)) & 1]
    assert allowed == [eos]
    assert matcher.accept_token(eos) and matcher.is_terminated()


def test_a_plain_auto_turn_waits_for_xgrammar_and_a_policy_one_does_not(tokenizer, monkeypatch):
    """Free text between calls: llguidance admits only valid UTF-8 token by token, so a turn
    without an allowlist waits for xgrammar (its text must be what vanilla vLLM samples:
    tests/test_serving_e2e.py); a policy turn (``utf8_text``: ``XARGS_TEXT_UTF8``) starts on llguidance. The
    refusal is kept, so the grammar is translated once, not once a row."""
    from vllm_allowed_tools.decode import lazy_grammars
    translated = []
    monkeypatch.setattr(lazy_grammars, "lark_grammar",
                        lambda *args, **options: translated.append(1) or lark_grammar(*args, **options))
    grammars = _grammars(tokenizer, max_threads=1)
    grammars._in_background = lambda grammar, compile_it: None   # noqa: E731
    grammars.get = lambda grammar: grammars._compile(grammar)    # noqa: E731 (never cached: asked again)
    auto = _grammar({"tool_0"}, "auto-turn", mode="auto")
    for _ in range(2):
        row = grammars.matchers(auto)
        assert isinstance(row.matcher, xgr.GrammarMatcher)
    assert len(translated) == 1
    row = grammars.matchers(_grammar({"tool_0"}, "required-turn"))
    assert isinstance(row.matcher, LazyMatcher)
    policy = _grammar({"tool_0"}, "auto-turn", mode="auto", policy=True)
    assert policy.digest == auto.digest          # the same grammar: the refusal is not reused
    assert isinstance(grammars.matchers(policy).matcher, LazyMatcher)


@pytest.mark.parametrize("seed", range(3))
def test_a_policy_auto_row_on_llguidance_writes_text_and_only_allowed_calls(tokenizer, seed):
    """A policy ``auto`` turn's row, masked by llguidance alone from random logits: free text,
    calls to allowed tools only, valid UTF-8 text throughout, and its end."""
    grammars = _grammars(tokenizer)
    grammars._in_background = lambda grammar, compile_it: None   # noqa: E731 (the compile never runs)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1)
    output: list[int] = []
    batch.add(0, _grammar({"tool_1"}, f"policy-auto-{seed}", mode="auto", policy=True), output, [eos])
    assert isinstance(batch.rows[0].matcher, LazyMatcher)
    rng = torch.Generator().manual_seed(200 + seed)
    opening = tokenizer.convert_tokens_to_ids("<tool_call>")
    for step in range(120):   # the call opens at step 8 (a boost the mask may still refuse)
        if _step(batch, output, vocab, rng, boost=opening if step == 8 else None) == eos:
            break
    assert not batch.rows[0].failed
    written = [token for token in output if token != eos]
    text = tokenizer.decode(written)
    vocab_bytes = grammars.tokenizer_info.decoded_vocab
    # valid UTF-8 throughout (a character may still be open where the steps ran out)
    codecs.getincrementaldecoder("utf-8")().decode(b"".join(bytes(vocab_bytes[t]) for t in written))
    assert _calls(text) == ["tool_1"]
    matcher = xgr.GrammarMatcher(grammars._compile(_grammar({"tool_1"}, f"policy-auto-{seed}", mode="auto")))
    assert all(matcher.accept_token(token) for token in written)   # xgrammar admits it too

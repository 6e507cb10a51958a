"""The logits-processor stage under a reasoning parser: each row's state machine (no server).

A row whose prompt leaves reasoning open is not masked until its output ends reasoning; its
matcher then starts at the token vLLM's structured-output manager starts the native stage's
grammar at: after an explicit ``</think>``, at an implicit end (qwen3's ``<tool_call>``). The gate
is the real one (``vllm_glue.logits_processor``) over vLLM's own parsers for the reasoning models
agents use (``qwen3``, ``glm45``, ``kimi_k2``, ``minimax_m2``: engine-based; ``deepseek_r1``: a token
scan), on the tiny model's tokenizer, which has ``<think>``, ``</think>`` and ``<tool_call>`` as
single tokens.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, built
from vllm_allowed_tools.decode.masks import MaskedBatch
from vllm_allowed_tools.decode.split import constraint_extra_args
from vllm_allowed_tools.decode.stage import read_extra_args

from support.reasoning import compiled_grammars, reasoning_gate, tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
FUNCTIONS = [AllowedFunction(f"tool_{i}", SCHEMA, strict=True) for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return compiled_grammars(tokenizer, lazy=False)   # exact masks, xgrammar's (llguidance's admit
    # no lone UTF-8 continuation byte in free text)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1", "glm45", "kimi_k2", "minimax_m2"])
def gate(request, tokenizer):
    return reasoning_gate(tokenizer, request.param)


def _grammar(names=("tool_1",), mode="required"):
    tag = built(build_structural_tag("hermes", [f for f in FUNCTIONS if f.name in names], mode,
                                     max_whitespace=1))
    return read_extra_args(constraint_extra_args(tag))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(batch: MaskedBatch, row: int, vocab: int) -> list[int] | None:
    """The tokens the row may take next; None when its logits are left alone."""
    batch.sync()
    logits = torch.zeros(row + 1, vocab)
    batch.apply(logits)
    if torch.isfinite(logits[row]).all():
        return None
    return torch.isfinite(logits[row]).nonzero().flatten().tolist()


PROMPT = "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"


def test_reasoning_is_unconstrained_then_the_grammar_starts_after_the_end(tokenizer, grammars, gate):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=2, reasoning=gate)
    output: list[int] = []
    batch.add(0, _grammar(), output, [eos], _ids(tokenizer, PROMPT))
    assert _allowed(batch, 0, vocab) is None                     # before the first token
    for token in _ids(tokenizer, "<think>\nI could call tool_3 or say hello.\n"):
        output.append(token)
        assert _allowed(batch, 0, vocab) is None                 # reasoning: never masked
    output.append(tokenizer.convert_tokens_to_ids("</think>"))
    allowed = _allowed(batch, 0, vocab)                           # required: a call, nothing else
    assert allowed is not None and eos not in allowed
    assert all(tokenizer.decode([t]) and "<tool_call>".startswith(tokenizer.decode([t]))
               for t in allowed)
    output += _ids(tokenizer, '<tool_call>\n{"name": "tool_')
    allowed = _allowed(batch, 0, vocab)
    assert {tokenizer.decode([t]) for t in allowed} <= {"1", "1\""}   # only the allowed name


def test_an_implicit_end_is_the_grammars_first_token(tokenizer, grammars):
    """qwen3 ends reasoning at a ``<tool_call>`` written inside it: the matcher takes that token
    (vLLM's ``ReasoningEnd.implicit``), so the call after it is constrained."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=reasoning_gate(tokenizer, "qwen3"))
    output = _ids(tokenizer, "<think>\nhmm")
    batch.add(0, _grammar(), output, [eos], _ids(tokenizer, PROMPT))
    assert _allowed(batch, 0, vocab) is None
    output += _ids(tokenizer, '<tool_call>\n{"name": "tool_')
    assert {tokenizer.decode([t]) for t in _allowed(batch, 0, vocab)} <= {"1", "1\""}
    assert not batch.rows[0].failed


def test_a_prompt_that_closed_reasoning_is_constrained_from_the_first_token(tokenizer, grammars, gate):
    """Qwen3's template with thinking off ends the prompt with an empty reasoning block."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=gate)
    batch.add(0, _grammar(), [], [eos], _ids(tokenizer, PROMPT + "<think>\n\n</think>\n\n"))
    assert batch.rows[0].reasoning is False
    assert _allowed(batch, 0, vocab) is not None


def test_tokens_arriving_together_are_split_at_the_end(tokenizer, grammars, gate):
    """A resumed (preempted) request comes back with reasoning and part of its call at once."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=gate)
    output = _ids(tokenizer, '<think>\nok\n</think><tool_call>\n{"name": "tool_')
    batch.add(0, _grammar(), output, [eos], _ids(tokenizer, PROMPT))
    assert {tokenizer.decode([t]) for t in _allowed(batch, 0, vocab)} <= {"1", "1\""}
    assert not batch.rows[0].failed


def test_placeholders_wait_and_text_after_the_end_is_refused_in_required_mode(tokenizer, grammars, gate):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=gate)
    output = _ids(tokenizer, "<think>\nok") + [-1]               # async scheduling's placeholder
    batch.add(0, _grammar(), output, [eos], _ids(tokenizer, PROMPT))
    assert _allowed(batch, 0, vocab) is None and batch.rows[0].consumed == len(output) - 1
    output[-1] = tokenizer.convert_tokens_to_ids("</think>")
    output += _ids(tokenizer, "hello")                           # required: no text after reasoning
    assert _allowed(batch, 0, vocab) == [eos] and batch.rows[0].failed


def test_without_a_gate_thinking_is_constrained_like_any_text(tokenizer, grammars):
    """No reasoning parser: the grammar applies from the first token (required refuses ``<think>``)."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1)
    batch.add(0, _grammar(), [], [eos], _ids(tokenizer, PROMPT))
    allowed = _allowed(batch, 0, vocab)
    assert allowed is not None and tokenizer.convert_tokens_to_ids("<think>") not in allowed


def test_a_reasoning_row_is_left_alone_beside_masked_rows_and_moves_with_its_state(tokenizer, grammars, gate):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=3, reasoning=gate)
    thinking, calling = _ids(tokenizer, "<think>\nhm"), []
    batch.add(0, _grammar(), thinking, [eos], _ids(tokenizer, PROMPT))
    batch.add(1, _grammar(), calling, [eos], _ids(tokenizer, PROMPT + "<think>\n\n</think>\n\n"))
    batch.sync()
    logits = torch.zeros(2, vocab)
    batch.apply(logits)
    assert torch.isfinite(logits[0]).all() and not torch.isfinite(logits[1]).all()
    batch.move(0, 2, swap=False)
    thinking.append(tokenizer.convert_tokens_to_ids("</think>"))
    assert _allowed(batch, 2, vocab) is not None and not batch.rows[2].reasoning


def test_a_reasoning_row_of_an_auto_turn_keeps_free_text_after_the_end(tokenizer, grammars, gate):
    """After the reasoning, an auto turn's free text: every token but the format's markers
    (hermes: ``</tool_call>``, which its parser would read; decode/free_text.py)."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    batch = MaskedBatch(grammars, vocab, max_rows=1, reasoning=gate)
    output = _ids(tokenizer, "<think>\nok\n</think>\n\nSure, ")
    batch.add(0, _grammar(mode="auto"), output, [eos], _ids(tokenizer, PROMPT))
    allowed = _allowed(batch, 0, vocab)
    refused = {tokenizer.decode([t]) for t in set(range(vocab)) - set(allowed or ())}
    assert allowed is not None and refused == {"</tool_call>"} and not batch.rows[0].failed, refused
    output += _ids(tokenizer, '<tool_call>\n{"name": "tool_')
    assert {tokenizer.decode([t]) for t in _allowed(batch, 0, vocab)} <= {"1", "1\""}


@pytest.mark.parametrize("parser,in_reasoning,expected", [
    ("", False, None), ("qwen3", True, None), ("qwen3", False, "gate")])
def test_the_gate_follows_the_servers_configuration(tokenizer, parser, in_reasoning, expected, monkeypatch):
    """No reasoning parser, or ``enable_in_reasoning``: no gate (constrained from the start)."""
    from vllm_allowed_tools.vllm_glue import logits_processor

    monkeypatch.setattr("vllm.tokenizers.cached_tokenizer_from_config", lambda _config: tokenizer)
    config = SimpleNamespace(model_config=None, structured_outputs_config=SimpleNamespace(
        reasoning_parser=parser, reasoning_parser_plugin="", enable_in_reasoning=in_reasoning))
    gate = logits_processor.reasoning_gate_for(config)
    assert (gate is None) == (expected is None)


def test_earlier_turns_reasoning_in_the_prompt(tokenizer, grammars):
    """A template that keeps an earlier turn's reasoning leaves a ``</think>`` in the prompt. vLLM's
    qwen3 parser stops at the turn boundary (this turn's reasoning is still open); deepseek_r1 scans
    past it and calls reasoning ended, so both stages constrain that turn from its first token, as
    vLLM's structured-output manager does (the gate decides what vLLM decides)."""
    prompt = _ids(tokenizer, "<|im_start|>assistant\n<think>\nold\n</think>\n\n<tool_call>\n{}\n"
                             "</tool_call><|im_end|>\n" + PROMPT)
    assert not reasoning_gate(tokenizer, "qwen3").ended_in_prompt(prompt)
    assert reasoning_gate(tokenizer, "deepseek_r1").ended_in_prompt(prompt)

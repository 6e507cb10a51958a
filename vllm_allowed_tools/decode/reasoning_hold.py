"""A row that must call while it still reasons: what it may write next.

A ``required`` turn (an ``allowed_tools`` selection in ``required`` mode, plain ``required``, a named
tool) of a reasoning model is unconstrained while it reasons: the grammar starts where reasoning
ends. Left alone, the model may end the turn inside its reasoning (a stop token before ``</think>``),
so the call never starts, or reason until ``max_tokens`` leaves no room for the call. While such a
row reasons, on either constraint stage, the logits processor therefore

* refuses every stop token (the tokenizer's end of sequence, the generation config's, the request's
  ``stop_token_ids``: vLLM's ``all_stop_token_ids``), so the turn cannot end before the call;
* once the budget left is down to the shortest call the grammar admits (:mod:`.call_budget`) plus
  the end marker, admits only the reasoning parser's end token (``</think>``), so the call starts
  while it still fits. A budget that cannot hold even that ends the turn ``length`` as before.

Pure logic (no vLLM, no xgrammar): :mod:`.masks` applies it to the rows' bitmasks. The request
carries the reserve in ``extra_args`` (:data:`..wire.XARGS_MUST_CALL`), set by the parser wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..wire import XARGS_MUST_CALL
from .stage import ConstraintArgsError

#: what a reasoning row that must call may write: anything but a stop token, or only the end marker
BAN_STOPS = "ban_stops"
END_REASONING = "end_reasoning"


def read_must_call(extra_args: Mapping[str, Any] | None) -> int | None:
    """The reserve a request carries (None: it need not call); ConstraintArgsError names the key
    when the value is not a whole number."""
    if not extra_args or XARGS_MUST_CALL not in extra_args:
        return None
    value = extra_args[XARGS_MUST_CALL]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConstraintArgsError(f"extra_args.{XARGS_MUST_CALL} must be a whole number of tokens "
                                  f"(the shortest call's), not {value!r}")
    return value


def must_end_reasoning(generated: int, max_tokens: int | None, reserve: int) -> bool:
    """Whether the next token must end reasoning: the budget left (``max_tokens`` less the tokens
    ``generated``) holds only the end marker and the ``reserve`` for the call."""
    return max_tokens is not None and max_tokens - generated <= reserve + 1


def next_step(generated: int, max_tokens: int | None, reserve: int, end_token: int | None) -> str:
    """What a reasoning row that must call may write next: :data:`END_REASONING` (only
    ``end_token``) when the budget says so and the parser has an end token, else
    :data:`BAN_STOPS`."""
    if end_token is not None and must_end_reasoning(generated, max_tokens, reserve):
        return END_REASONING
    return BAN_STOPS


def allowed_tokens(step: str, vocab_size: int, stops: Iterable[int], end_token: int | None) -> set[int] | None:
    """The tokens a step admits, as a set for :data:`END_REASONING`; for :data:`BAN_STOPS`, None
    (every token but ``stops``: :func:`refused_tokens`)."""
    if step == END_REASONING and end_token is not None and 0 <= end_token < vocab_size:
        return {end_token}
    return None


def refused_tokens(stops: Iterable[int], vocab_size: int, end_token: int | None) -> set[int]:
    """The stop tokens a reasoning row that must call may not write (never its end marker)."""
    return {token for token in stops if 0 <= token < vocab_size and token != end_token}

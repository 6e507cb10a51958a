"""Stop tokens a turn's parser reads as text: the model may never write them.

vLLM ends a request on every stop token it knows (``SamplingParams.all_stop_token_ids``: the
tokenizer's end of sequence, the generation config's, the request's ``stop_token_ids``), and a
grammar whose call ends where "a stop token follows" (vLLM's harmony tag ends a call with ``""``)
admits each of them there. Not every one of them is an end to the format's parser: gpt-oss's
generation config stops on ``<|endoftext|>`` too, and the harmony parser (token ids, not text) reads
that token as message text, so a call the grammar admitted, ``{"city": "Paris"}`` then
``<|endoftext|>``, reaches the client with the arguments ``{"city": "Paris"}<|endoftext|>``: not
JSON, refused by the output guard (a 500). The grammar cannot tell one stop token from another
(xgrammar admits the matcher's stop tokens together, and on the native stage vLLM gives the matcher
all of them), so the format names these tokens (``grammars/<format>.json``,
``grammar.text_stop_tokens``), the parser wrapper puts their ids on the request
(:data:`..wire.XARGS_REFUSED_TOKENS`) and our logits processor refuses them at every step, on both
constraint stages: the call ends on a stop token the parser reads as its end (``<|call|>``,
``<|return|>``).

Pure logic (no vLLM, no torch): :mod:`.masks` applies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..wire import XARGS_REFUSED_TOKENS
from .stage import ConstraintArgsError

#: the most ids a request may carry under :data:`..wire.XARGS_REFUSED_TOKENS`
MAX_REFUSED_TOKENS = 64


def read_refused_tokens(extra_args: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The token ids a request may never write (empty: none); ConstraintArgsError names the key
    when the value is not a short list of token ids."""
    if not extra_args or XARGS_REFUSED_TOKENS not in extra_args:
        return ()
    value = extra_args[XARGS_REFUSED_TOKENS]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REFUSED_TOKENS or any(
            isinstance(token, bool) or not isinstance(token, int) or token < 0 for token in value):
        raise ConstraintArgsError(f"extra_args.{XARGS_REFUSED_TOKENS} must be a list of at most "
                                  f"{MAX_REFUSED_TOKENS} token ids, not {value!r}")
    return tuple(sorted(set(value)))


def refusable(refused: Iterable[int], stops: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """The ids of ``refused`` a row refuses: those inside the vocabulary, and none at all when
    they are every stop token the row has (it could then never end but by the token limit, and a
    grammar that admits only stop tokens would leave it nothing to write)."""
    ids = tuple(sorted({token for token in refused if 0 <= token < vocab_size}))
    stops = set(stops)
    if stops and stops <= set(ids):
        return ()
    return ids

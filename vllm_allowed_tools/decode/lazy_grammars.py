"""llguidance matchers for the grammars xgrammar has not compiled yet (the first request of a
catalog or subset): :mod:`.lark_tags` translates the structural tag, llguidance computes each
mask when asked, so the row starts within milliseconds instead of waiting 0.1-2.5 s for xgrammar's
compile at a 150K vocabulary (docs/benchmarks.md). :class:`.masks.MaskedBatch` moves the row onto
xgrammar's matcher once the background compile is done. No vLLM imports."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from .lark_tags import UntranslatableTag, lark_grammar
from .lru import LRU
from .stage import ConstraintArgsError, GrammarText, tag_digest

__all__ = ["LazyGrammars", "LazyMatcher", "UntranslatableTag"]

logger = logging.getLogger(__name__)

#: llguidance marks a special token by this first byte (its text is then never free text)
_SPECIAL = b"\xff"


class LazyMatcher:
    """An llguidance matcher behind the part of xgrammar's ``GrammarMatcher`` the batch uses, with
    the request's own stop tokens (xgrammar's ``override_stop_tokens``): the grammar may end on
    one of them, and on no other stop token of the tokenizer."""

    def __init__(self, matcher: Any, stops: Sequence[int], tokenizer_stops: Sequence[int]) -> None:
        self._matcher = matcher
        self._stops = frozenset(stops)
        self._all_stops = tuple(sorted(set(tokenizer_stops) | self._stops))
        self._terminated = False
        self._reported = False

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._all_stops:
            if token in self._stops and (self._matcher.is_accepting() or self._matcher.is_error()):
                self._terminated = True
                return True
            return False
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    def is_terminated(self) -> bool:
        return self._terminated

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        """Write the row's mask (``bitmask``: xgrammar's int32 torch bitmask); True: it refuses
        something (always, for this matcher)."""
        import numpy as np
        from llguidance.torch import fill_next_token_bitmask
        fill_next_token_bitmask(self._matcher, bitmask, index)
        words = bitmask[index].numpy()
        accepting = self._matcher.is_accepting()
        if self._matcher.is_error():   # llguidance gave up (a limit): the row may only stop now
            if not self._reported:
                self._reported = True
                logger.error("vllm-allowed-tools: llguidance stopped a row (%s); it may only stop "
                             "now", self._matcher.get_error()[:200])
            words[:] = 0
            accepting = True
        for token in self._all_stops:
            word, bit = divmod(token, 32)
            if word >= len(words):
                continue
            value = np.uint32(words[word].view(np.uint32))
            value = value | np.uint32(1 << bit) if accepting and token in self._stops \
                else value & ~np.uint32(1 << bit)
            words[word] = np.uint32(value).view(np.int32)
        return True


class LazyGrammars:
    """llguidance's tokenizer for one xgrammar tokenizer (built in a background thread from the
    start, so no request waits for it; the vocabulary and special tokens xgrammar's, the text a
    grammar forces tokenized by the model's tokenizer where one is given) and the translations of
    the grammars seen, by digest."""

    def __init__(self, tokenizer_info: Any, hf_tokenizer: Any = None, capacity: int = 256) -> None:
        self._info = tokenizer_info
        self._hf_tokenizer = hf_tokenizer
        self._translations = LRU(capacity, 64 << 20)
        self._tokenizer: Any = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        threading.Thread(target=self._build_tokenizer, name="allowed-tools-llguidance",
                         daemon=True).start()

    def _build_tokenizer(self) -> None:
        try:
            import llguidance
            info = self._info
            stops = list(info.stop_token_ids)
            special = set(info.special_token_ids)
            vocab = [bytes(token) for token in info.decoded_vocab]
            vocab += [b""] * (info.vocab_size - len(vocab))

            by_bytes: dict[bytes, int] = {}
            for index, token in enumerate(vocab):
                if token and index not in special:
                    by_bytes.setdefault(token, index)
            longest = max(map(len, by_bytes), default=1)
            hf_tokenizer = self._hf_tokenizer

            class _Vocabulary:
                tokens = [_SPECIAL + token if index in special else token
                          for index, token in enumerate(vocab)]
                eos_token_id = stops[0] if stops else len(vocab) - 1
                bos_token_id = None
                special_token_ids = sorted(special)

                def __call__(self, text: Any) -> list[int]:
                    """How the model writes the text a grammar forces: its own tokenizer where one
                    is given (as vLLM's guidance backend), else longest match first."""
                    if hf_tokenizer is not None:
                        if isinstance(text, bytes):
                            raise TypeError("text, not bytes")   # llguidance then passes text
                        return list(hf_tokenizer.encode(text, add_special_tokens=False))
                    data = text if isinstance(text, bytes) else str(text).encode()
                    ids: list[int] = []
                    position = 0
                    while position < len(data):
                        for size in range(min(longest, len(data) - position), 0, -1):
                            token = by_bytes.get(data[position:position + size])
                            if token is not None:
                                ids.append(token)
                                position += size
                                break
                        else:
                            position += 1    # a byte no token spells: left out
                    return ids
            self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()),
                                                     n_vocab=info.vocab_size, eos_token=stops or None)
        except BaseException as exc:   # noqa: BLE001 (reported on every use instead)
            self._failure = exc
        finally:
            self._ready.set()

    def matcher(self, grammar: GrammarText, stop_token_ids: Sequence[int] = (), *,
                free_text: bool = False) -> LazyMatcher:
        """A matcher for ``grammar``; raises :class:`UntranslatableTag` where the translation does
        not cover it, or where llguidance cannot build it. ``free_text``: the turn's free text may
        be held to valid UTF-8 (a policy turn's: :data:`..wire.XARGS_TEXT_UTF8`); without it a
        grammar with free text outside its calls is refused (:func:`.lark_tags.lark_grammar`)."""
        matcher = self.llguidance_matcher(grammar, free_text=free_text)
        stops = list(stop_token_ids) or list(self._info.stop_token_ids)
        return LazyMatcher(matcher, stops, self._info.stop_token_ids)

    def llguidance_matcher(self, grammar: GrammarText, *, free_text: bool = False) -> Any:
        """llguidance's own matcher for ``grammar`` (what :meth:`matcher` wraps), ending on this
        tokenizer's stop tokens. Raises as :meth:`matcher` does."""
        import llguidance
        tokenizer = self.tokenizer()
        key = (grammar.digest, free_text)
        lark = self._translations.get(key)
        if lark is None:
            if tag_digest(grammar.tag_json) != grammar.digest:
                raise ConstraintArgsError("structural tag digest mismatch")
            try:
                lark = lark_grammar(grammar.tag_json, free_text=free_text)
            except UntranslatableTag as refused:   # kept too: an auto turn's rows ask again
                lark = refused
            self._translations.put(key, lark, len(str(lark)))
        if isinstance(lark, UntranslatableTag):
            raise lark
        matcher = llguidance.LLMatcher(tokenizer, lark, log_level=0)
        if matcher.is_error():
            raise UntranslatableTag(f"llguidance refused the translation: {matcher.get_error()[:200]}")
        return matcher

    def tokenizer(self) -> Any:
        """llguidance's tokenizer, once built (waits for the background build): the vocabulary as
        xgrammar reads it (vLLM's guidance backend makes its matchers over it too:
        ``vllm_glue/guidance_tags.py``); raises :class:`UntranslatableTag` where it could not be
        built."""
        self._ready.wait()
        if self._tokenizer is None:
            raise UntranslatableTag(f"llguidance's tokenizer could not be built: {self._failure!r}")
        return self._tokenizer

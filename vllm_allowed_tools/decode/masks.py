"""The logits-processor stage's core, without vLLM: one xgrammar matcher per constrained batch row
masking that row's logits (two for a split grammar, the catalog's and the envelope's, their masks
ANDed: :mod:`.split`), every step's work batched over the rows; the compiled grammars are
:mod:`.compiled`'s (re-exported here), the CPU masking :mod:`.cpu_mask`'s.

The vLLM adapter (``vllm_glue/logits_processor.py``) only translates vLLM's batch updates into
:meth:`MaskedBatch.add`, :meth:`~MaskedBatch.remove` and :meth:`~MaskedBatch.move`, and, when the
server runs a reasoning parser, hands over a :class:`ReasoningGate` built from it: a row whose prompt
has not ended reasoning is left unconstrained until its output ends it, as vLLM's structured-output
manager does for the native stage, and its matcher starts from the token the gate names.

A row that must call (:mod:`.reasoning_hold`) may not stop while it reasons, and ends its reasoning
while the budget still holds its call: on this stage with its grammar, on vLLM's native stage as a
row without one (the native stage owns the grammar; this processor only holds the reasoning). A
row's refused tokens (:mod:`.refused_tokens`: stop tokens its parser reads as text) are refused at
every step, on both stages, with or without a grammar here."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .compiled import CompiledGrammars
from .lazy_grammars import LazyMatcher
from .cpu_mask import apply_on_cpu
from .reasoning_hold import END_REASONING, next_step, refused_tokens
from .refused_tokens import refusable
from .stage import RequestGrammar

logger = logging.getLogger(__name__)

__all__ = ["CompiledGrammars", "MaskedBatch", "ReasoningGate"]


class ReasoningGate(Protocol):
    """Where a row's grammar starts, from the server's reasoning parser (the glue adapts vLLM's)."""

    def ended_in_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt already ended reasoning (the template closed it, or reasoning is off)."""

    def grammar_start(self, prompt_ids: Sequence[int], output_ids: Sequence[int], start: int,
                      stop: int) -> int | None:
        """The index in ``output_ids`` the grammar starts at, when ``output_ids[start:stop]`` (new
        tokens, reasoning until then) ends reasoning; None while reasoning goes on. An explicit end
        (``</think>``) starts the grammar after it; an implicit one (a call start) at it."""

    #: the token that ends reasoning explicitly (``</think>``), None when the parser has none; a
    #: row that must call is made to write it while its budget still holds the call
    end_token_id: int | None


@dataclass
class _Row:
    matcher: Any
    output_ids: Sequence[int]          # vLLM's live list of the request's output tokens
    consumed: int = 0
    failed: bool = False               # a token the grammar refused: only stop tokens from now on
    stop_token_ids: tuple[int, ...] = field(default=())
    envelope: Any = None               # the subset's envelope, when ``matcher`` is the catalog's
    reasoning: bool = False            # unconstrained until the gate sees reasoning end
    prompt_ids: Sequence[int] = ()     # for the gate, while reasoning
    grammar: RequestGrammar | None = None   # a split row's: its own grammar replaces the two
    start: int = 0                     # where in ``output_ids`` the grammar started
    must_call: int | None = None       # a turn that must call: tokens kept for its shortest call
    max_tokens: int | None = None      # the request's budget (``SamplingParams.max_tokens``)
    refused: tuple[int, ...] = ()      # never written, at any step (:mod:`.refused_tokens`)


class MaskedBatch:
    """One matcher per constrained row of a persistent batch; unconstrained rows cost nothing.

    A step's grammar work is done for all rows at once, not row by row, because a busy server
    decodes 64-256 constrained rows a step (``benchmarks/scale_rows.py`` measured the per-row loop
    growing linearly): every row's new token is accepted in one xgrammar call, every mask (the
    catalogs' and the envelopes' together) is filled in one threaded call, the envelopes are ANDed
    in one numpy operation, and on CPU the masks are applied together, a row that allows only a few
    tokens by keeping those few rather than unpacking its whole bitmask."""

    #: a row whose bitmask has at most this share of non-zero words (it allows a few tokens: a
    #: call's markup, a name, a key, an enum) is masked by keeping those tokens; others unpack
    SPARSE_WORDS_SHARE = 1 / 8

    def __init__(self, grammars: CompiledGrammars, vocab_size: int, max_rows: int,
                 reasoning: ReasoningGate | None = None) -> None:
        import xgrammar as xgr
        self.grammars = grammars
        self.reasoning = reasoning
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        # rows [0, max_rows) hold each row's mask, rows [max_rows, 2 max_rows) its envelope's, so
        # one batched fill writes both
        self._masks = xgr.allocate_token_bitmask(2 * max_rows, vocab_size)
        self._bitmask = self._masks[:max_rows]
        self._all_words = self._masks.numpy()    # the same memory, for numpy
        self._words = self._all_words[:max_rows]
        self._batch_filler: Any = None
        self._stop_rows: dict[tuple[int, ...], Any] = {}
        self.rows: dict[int, _Row] = {}

    # ------------------------------------------------------------------ batch changes
    def add(self, row: int, grammar: RequestGrammar | None, output_ids: Sequence[int],
            stop_token_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None,
            must_call: int | None = None, max_tokens: int | None = None,
            refused: Sequence[int] = ()) -> None:
        """A request enters ``row`` (replacing whatever was there); tokens it already produced
        (a resumed request) are replayed into the new matcher on the next :meth:`sync`, through
        the reasoning gate first when the prompt left reasoning open. ``must_call``: the row
        must call (the tokens its shortest call needs), held while it reasons, with or without a
        grammar here (:mod:`.reasoning_hold`). ``refused``: tokens the row never writes (with or
        without a grammar here)."""
        self.rows.pop(row, None)
        refused = refusable(refused, stop_token_ids, self.vocab_size)
        if grammar is None:
            held = must_call is not None and self.reasoning is not None \
                and not self.reasoning.ended_in_prompt(prompt_ids or ())
            if held or refused:
                self.rows[row] = _Row(matcher=None, output_ids=output_ids, reasoning=held,
                                      stop_token_ids=tuple(stop_token_ids),
                                      prompt_ids=(prompt_ids or ()) if held else (),
                                      must_call=must_call if held else None, max_tokens=max_tokens,
                                      refused=refused)
            return
        try:
            matcher, envelope, provisional = self.grammars.matchers(grammar, stop_token_ids)
        except Exception:   # admission validated it; if it still cannot compile, fail closed
            logger.exception("vllm-allowed-tools: could not compile the request's grammar; the "
                             "request may only stop")
            self.rows[row] = _Row(matcher=None, output_ids=output_ids, failed=True,
                                  stop_token_ids=tuple(stop_token_ids), refused=refused)
            return
        reasoning = self.reasoning is not None and not self.reasoning.ended_in_prompt(prompt_ids or ())
        self.rows[row] = _Row(matcher=matcher, output_ids=output_ids,
                              stop_token_ids=tuple(stop_token_ids), envelope=envelope,
                              reasoning=reasoning, prompt_ids=(prompt_ids or ()) if reasoning else (),
                              grammar=grammar if provisional else None,
                              must_call=must_call, max_tokens=max_tokens, refused=refused)

    def remove(self, row: int) -> None:
        self.rows.pop(row, None)

    def move(self, source: int, target: int, swap: bool) -> None:
        moving = self.rows.pop(source, None)
        displaced = self.rows.pop(target, None)
        if moving is not None:
            self.rows[target] = moving
        if swap and displaced is not None:
            self.rows[source] = displaced

    # ------------------------------------------------------------------ per step
    def sync(self) -> None:
        """Advance every matcher over the output tokens produced since the last step: the usual
        step (one new token a row) in one batched accept for all rows, a row with several new
        tokens (a resumed request, a row whose reasoning just ended) on its own."""
        matchers: list[Any] = []
        tokens: list[int] = []
        owners: list[_Row] = []
        for row, state in list(self.rows.items()):
            output = state.output_ids
            if state.reasoning and not self._end_reasoning(state):
                continue
            if state.matcher is None and not state.failed:   # no grammar here: held while it
                if not state.refused:                         # reasoned, or refusing tokens
                    del self.rows[row]
                continue
            new = len(output) - state.consumed
            if new <= 0:
                continue
            if state.grammar is not None and not state.failed:
                self._upgrade(state)
            if new == 1 and not state.failed:
                token = output[state.consumed]
                if token < 0:          # a placeholder not yet filled in (async scheduling)
                    continue
                state.consumed += 1
                if state.matcher.is_terminated():
                    continue
                if isinstance(state.matcher, LazyMatcher):   # not xgrammar's: on its own
                    if not state.matcher.accept_token(int(token)):
                        self._refused(state, int(token))
                    continue
                matchers.append(state.matcher)
                tokens.append(int(token))
                owners.append(state)
                if state.envelope is not None:
                    matchers.append(state.envelope)
                    tokens.append(int(token))
                    owners.append(state)
                continue
            self._replay(state)
        if not matchers:
            return
        if len(owners) <= 2 and owners[0] is owners[-1]:   # one row: the batch call costs more
            accepted = [matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]
        else:
            import xgrammar as xgr
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        for state, token, ok in zip(owners, tokens, accepted):
            if not ok:
                self._refused(state, token)

    @staticmethod
    def _refused(state: _Row, token: int) -> None:
        if not state.failed:
            state.failed = True
            logger.error("vllm-allowed-tools: the grammar refused token %d; the request may only "
                         "stop now", token)

    def _upgrade(self, state: _Row) -> None:
        """A split row (or one llguidance started) continues on its subset's own grammar once
        xgrammar has compiled it: a new matcher replays the row's tokens so far, then replaces
        the catalog's and the envelope's (the same language: :mod:`.split`), so later steps fill
        one mask, not two (or llguidance's, the same language: :mod:`.lark_tags`)."""
        compiled = self.grammars.ready(state.grammar)
        if compiled is None:
            return
        import xgrammar as xgr
        state.grammar = None
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(state.stop_token_ids) or None)
        for token in state.output_ids[state.start:state.consumed]:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                logger.warning("vllm-allowed-tools: a subset's own grammar refused a token its "
                               "split admitted; the row keeps the split")
                return
        state.matcher, state.envelope = matcher, None

    def _replay(self, state: _Row) -> None:
        """Several new tokens of one row, one at a time."""
        output = state.output_ids
        while state.consumed < len(output):
            token = output[state.consumed]
            if token < 0:          # a placeholder not yet filled in (async scheduling)
                break
            state.consumed += 1
            if state.failed or state.matcher.is_terminated():
                continue
            if not state.matcher.accept_token(int(token)) or \
                    (state.envelope is not None and not state.envelope.accept_token(int(token))):
                state.failed = True
                logger.error("vllm-allowed-tools: the grammar refused token %d; the request "
                             "may only stop now", token)

    def _end_reasoning(self, state: _Row) -> bool:
        """Pass a reasoning row's new tokens by, up to where the gate says its grammar starts;
        True when it does (the matcher then takes the rest)."""
        output = state.output_ids
        stop = state.consumed
        while stop < len(output) and output[stop] >= 0:   # placeholders (async scheduling) wait
            stop += 1
        if stop == state.consumed:
            return False
        start = self.reasoning.grammar_start(state.prompt_ids, output, state.consumed, stop)
        if start is None:
            state.consumed = stop
            return False
        state.consumed, state.reasoning, state.prompt_ids, state.start = start, False, (), start
        return True

    def apply(self, logits: Any) -> Any:
        """Mask each constrained row of ``logits`` ([rows, vocab]) in place, then refuse each row's
        refused tokens."""
        if not self.rows:
            return logits
        batch = logits.shape[0]
        masked = self.prepare(batch)
        if masked:
            vocab = min(self.vocab_size, logits.shape[-1])
            if logits.device.type == "cpu":
                self._apply_on_cpu(logits, masked, vocab)
            else:
                import xgrammar as xgr
                bitmask = self._bitmask[:batch].to(logits.device, non_blocking=True)
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=masked)
        for row, state in self.rows.items():
            if state.refused and row < batch:
                logits[row, list(state.refused)] = float("-inf")
        return logits

    def prepare(self, batch: int) -> list[int]:
        """Fill the bitmask of every constrained row below ``batch``; the rows (sorted) whose
        logits must be masked. The grammar's share of a step, what stays on the CPU when the
        logits are on a GPU (``benchmarks/scale_rows.py`` times it on its own)."""
        bitmask = self._bitmask
        masked, live_rows, live_matchers, envelope_rows, envelopes = [], [], [], [], []
        for row, state in self.rows.items():
            if row >= batch or state.reasoning:
                if row < batch and state.must_call is not None:
                    self._hold(row, state)
                    masked.append(row)
                continue
            if state.matcher is None and not state.failed:   # refusing tokens only (apply)
                continue
            if state.failed or state.matcher.is_terminated():
                self._stop_only(row, state)
                masked.append(row)
            else:
                live_rows.append(row)
                live_matchers.append(state.matcher)
                if state.envelope is not None:
                    envelope_rows.append(row)
                    envelopes.append(state.envelope)
        if len(live_rows) == 1 and not envelopes:   # xgrammar says whether the mask allows everything
            if live_matchers[0].fill_next_token_bitmask(bitmask, live_rows[0]):
                masked.append(live_rows[0])
        elif live_rows:
            self._fill(live_matchers + envelopes,
                       live_rows + [self.max_rows + row for row in envelope_rows])
            if envelopes:   # names from the subset, arguments from the tool's schema (:mod:`.split`)
                self._words[envelope_rows] &= self._all_words[[self.max_rows + row for row in envelope_rows]]
            masked += self._not_open(live_rows)
        masked.sort()
        return masked

    def _fill(self, matchers: list[Any], rows: list[int]) -> None:
        """Fill the rows' masks: one call for several rows, filled in parallel by xgrammar
        (llguidance's matchers, a first-seen grammar's, one by one)."""
        if any(isinstance(matcher, LazyMatcher) for matcher in matchers):
            for matcher, row in zip(matchers, rows):
                if isinstance(matcher, LazyMatcher):
                    matcher.fill_next_token_bitmask(self._masks, row)
            pairs = [(m, r) for m, r in zip(matchers, rows) if not isinstance(m, LazyMatcher)]
            matchers, rows = [m for m, _ in pairs], [r for _, r in pairs]
            if not rows:
                return
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(self._masks, rows[0])
            return
        if self._batch_filler is None:
            import xgrammar as xgr
            self._batch_filler = xgr.BatchGrammarMatcher()
        self._batch_filler.batch_fill_next_token_bitmask(matchers, self._masks, rows)

    def _not_open(self, rows: list[int]) -> list[int]:
        """The rows whose mask refuses something: a row with every bit set (free text in auto
        mode) needs no masking."""
        import numpy as np
        words = self._words[rows]
        full, tail = divmod(self.vocab_size, 32)
        open_rows = (words[:, :full] == -1).all(axis=1)
        if tail:
            open_rows &= (words[:, full].astype(np.int64) & ((1 << tail) - 1)) == (1 << tail) - 1
        return [row for row, is_open in zip(rows, open_rows.tolist()) if not is_open]

    def _apply_on_cpu(self, logits: Any, rows: Sequence[int], vocab: int) -> None:
        """Mask ``rows`` (sorted) of CPU logits below ``vocab`` (:func:`.cpu_mask.apply_on_cpu`)."""
        apply_on_cpu(logits, self._words, rows, vocab, self.SPARSE_WORDS_SHARE)

    def _hold(self, row: int, state: _Row) -> None:
        """A reasoning row that must call: no stop token, or only the end of reasoning once the
        budget left is the call's (:func:`.reasoning_hold.next_step`)."""
        import numpy as np
        end = getattr(self.reasoning, "end_token_id", None)
        step = next_step(len(state.output_ids), state.max_tokens, state.must_call or 0, end)
        if step == END_REASONING and 0 <= end < self.vocab_size:
            self._words[row] = 0
            self._words[row, end // 32] = np.int32(np.uint32(1 << (end % 32)).view(np.int32))
            return
        stops = tuple(sorted({*state.stop_token_ids, *self.grammars.tokenizer_info.stop_token_ids}))
        key = ("ban", stops, end)
        words = self._stop_rows.get(key)
        if words is None:
            bits = np.ones(self._words.shape[1] * 32, dtype=np.uint8)
            bits[sorted(refused_tokens(stops, self.vocab_size, end))] = 0
            words = self._stop_rows[key] = np.packbits(bits, bitorder="little").view(np.int32)
        self._words[row] = words

    def _stop_only(self, row: int, state: _Row) -> None:
        """Only the request's stop tokens (a finished grammar, or one that refused a token); the
        row is built once per set of stop tokens and copied in."""
        import numpy as np
        stops = state.stop_token_ids or tuple(self.grammars.tokenizer_info.stop_token_ids)
        words = self._stop_rows.get(stops)
        if words is None:
            bits = np.zeros(self._words.shape[1] * 32, dtype=np.uint8)
            bits[[token for token in stops if 0 <= token < self.vocab_size]] = 1
            words = self._stop_rows[stops] = np.packbits(bits, bitorder="little").view(np.int32)
        self._words[row] = words


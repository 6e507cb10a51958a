"""The logits-processor stage's core, without vLLM: compiled structural tags cached per tokenizer,
and one xgrammar matcher per constrained batch row masking that row's logits (two for a split
grammar, the catalog's and the envelope's, their masks ANDed: :mod:`.split`).

The vLLM adapter (``vllm_glue/logits_processor.py``) only translates vLLM's batch updates into
:meth:`MaskedBatch.add`, :meth:`~MaskedBatch.remove` and :meth:`~MaskedBatch.move`, and, when the
server runs a reasoning parser, hands over a :class:`ReasoningGate` built from it: a row whose prompt
has not ended reasoning is left unconstrained until its output ends it, as vLLM's structured-output
manager does for the native stage, and its matcher starts from the token the gate names."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..settings import current
from .grammar import _LRU, tag_digest
from .stage import ConstraintArgsError, GrammarText, RequestGrammar

logger = logging.getLogger(__name__)


class CompiledGrammars:
    """Compiled structural tags for one tokenizer, by tag digest (LRU).

    Keyed by digest, not by the client-visible allowlist, so no request can plant a grammar under
    another turn's key: the digest is checked against the text on every compile. A catalog's
    grammar (:mod:`.split`) is compiled in a background thread the first time a request names it;
    until it is ready, requests are constrained by their own whole grammar."""

    def __init__(self, tokenizer_info: Any, capacity: int = 256, max_threads: int = 8,
                 catalog_capacity: int = 16) -> None:
        import xgrammar as xgr
        self.tokenizer_info = tokenizer_info
        # xgrammar's own cache keeps the pieces it compiled (each tool's argument schema, the
        # envelopes' arguments), so later grammars of the same tools compile far faster; it takes
        # the budget vLLM's xgrammar backend takes
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max_threads, cache_enabled=True,
            cache_limit_bytes=current().xgrammar_cache_mb << 20)
        self._cache = _LRU(capacity)
        self._catalogs = _LRU(catalog_capacity)
        self._catalog_jobs: dict[str, Future] = {}
        self._catalog_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def get(self, grammar: GrammarText) -> Any:
        compiled = self._cache.get(grammar.digest)
        if compiled is None:
            compiled = self._compile(grammar)
            self._cache.put(grammar.digest, compiled)
        return compiled

    def _compile(self, grammar: GrammarText) -> Any:
        if tag_digest(grammar.tag_json) != grammar.digest:
            raise ConstraintArgsError("structural tag digest mismatch")
        return self._compiler.compile_structural_tag(grammar.tag_json)

    def matchers(self, grammar: RequestGrammar, stop_token_ids: Sequence[int] = ()) -> tuple[Any, Any]:
        """(matcher, envelope matcher or None) for a request: the catalog's matcher and the
        subset's envelope when the catalog is compiled, else the request's whole grammar (and the
        catalog is compiled in the background for the next request)."""
        import xgrammar as xgr
        stops = list(stop_token_ids) or None
        if grammar.catalog is not None and grammar.envelope is not None:
            catalog = self.catalog(grammar.catalog, wait=False)
            if catalog is not None:
                try:
                    envelope = self.get(grammar.envelope)
                except Exception:   # the whole grammar below still enforces the subset
                    logger.exception("vllm-allowed-tools: could not compile an envelope grammar")
                else:
                    return (xgr.GrammarMatcher(catalog, override_stop_tokens=stops),
                            xgr.GrammarMatcher(envelope, override_stop_tokens=stops))
        return xgr.GrammarMatcher(self.get(grammar), override_stop_tokens=stops), None

    def catalog(self, grammar: GrammarText, wait: bool = True) -> Any:
        """The compiled catalog grammar; ``wait=False`` returns None while it is being compiled in
        the background (starting that on first sight)."""
        compiled = self._catalogs.get(grammar.digest)
        if compiled is not None:
            return compiled
        with self._catalog_lock:
            job = self._catalog_jobs.get(grammar.digest)
            if job is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="allowed-tools-catalog")
                job = self._catalog_jobs[grammar.digest] = self._worker.submit(self._compile_catalog, grammar)
        if not wait and not job.done():
            return None
        try:
            return job.result()
        except Exception:   # logged by the worker; such a catalog is never used
            return None

    def _compile_catalog(self, grammar: GrammarText) -> Any:
        started = time.perf_counter()
        try:
            compiled = self._compile(grammar)
        except Exception:
            logger.exception("vllm-allowed-tools: could not compile a catalog grammar; its requests "
                             "keep their own grammars")
            raise
        self._catalogs.put(grammar.digest, compiled)
        with self._catalog_lock:
            self._catalog_jobs.pop(grammar.digest, None)
        # under vLLM's own logger, so the line shows in the engine's log
        logging.getLogger("vllm.allowed_tools").info(
            "vllm-allowed-tools: compiled a catalog grammar (%d KB) in %.2f s; new allowed subsets "
            "of it compile only their envelope", len(grammar.tag_json) // 1024,
            time.perf_counter() - started)
        return compiled

    @property
    def stats(self) -> tuple[int, int, int]:
        """(hits, misses, entries)."""
        return self._cache.hits, self._cache.misses, len(self._cache)


class ReasoningGate(Protocol):
    """Where a row's grammar starts, from the server's reasoning parser (the glue adapts vLLM's)."""

    def ended_in_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt already ended reasoning (the template closed it, or reasoning is off)."""

    def grammar_start(self, prompt_ids: Sequence[int], output_ids: Sequence[int], start: int,
                      stop: int) -> int | None:
        """The index in ``output_ids`` the grammar starts at, when ``output_ids[start:stop]`` (new
        tokens, reasoning until then) ends reasoning; None while reasoning goes on. An explicit end
        (``</think>``) starts the grammar after it; an implicit one (a call start) at it."""


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


class MaskedBatch:
    """One matcher per constrained row of a persistent batch; unconstrained rows cost nothing."""

    def __init__(self, grammars: CompiledGrammars, vocab_size: int, max_rows: int,
                 reasoning: ReasoningGate | None = None) -> None:
        import xgrammar as xgr
        self.grammars = grammars
        self.reasoning = reasoning
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._words = self._bitmask.numpy()      # the same memory, for numpy
        self._batch_filler: Any = None
        self._envelope_bitmask: Any = None       # the envelopes' masks, before intersecting
        self._stop_rows: dict[tuple[int, ...], Any] = {}
        self.rows: dict[int, _Row] = {}

    # ------------------------------------------------------------------ batch changes
    def add(self, row: int, grammar: RequestGrammar | None, output_ids: Sequence[int],
            stop_token_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None) -> None:
        """A request enters ``row`` (replacing whatever was there); tokens it already produced
        (a resumed request) are replayed into the new matcher on the next :meth:`sync`, through
        the reasoning gate first when the prompt left reasoning open."""
        self.rows.pop(row, None)
        if grammar is None:
            return
        try:
            matcher, envelope = self.grammars.matchers(grammar, stop_token_ids)
        except Exception:   # admission validated it; if it still cannot compile, fail closed
            logger.exception("vllm-allowed-tools: could not compile the request's grammar; the "
                             "request may only stop")
            self.rows[row] = _Row(matcher=None, output_ids=output_ids, failed=True,
                                  stop_token_ids=tuple(stop_token_ids))
            return
        reasoning = self.reasoning is not None and not self.reasoning.ended_in_prompt(prompt_ids or ())
        self.rows[row] = _Row(matcher=matcher, output_ids=output_ids,
                              stop_token_ids=tuple(stop_token_ids), envelope=envelope,
                              reasoning=reasoning, prompt_ids=(prompt_ids or ()) if reasoning else ())

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
        """Advance every matcher over the output tokens produced since the last step."""
        for state in self.rows.values():
            output = state.output_ids
            if state.reasoning and not self._end_reasoning(state):
                continue
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
        state.consumed, state.reasoning, state.prompt_ids = start, False, ()
        return True

    def apply(self, logits: Any) -> Any:
        """Mask each constrained row of ``logits`` ([rows, vocab]) in place."""
        if not self.rows:
            return logits
        batch = logits.shape[0]
        indices = [row for row, state in self.rows.items() if row < batch and not state.reasoning]
        if not indices:
            return logits
        bitmask = self._bitmask
        masked, live_rows, live_matchers, envelopes = [], [], [], []
        for row in indices:
            state = self.rows[row]
            if state.failed or state.matcher.is_terminated():
                self._stop_only(row, state)
                masked.append(row)
            else:
                live_rows.append(row)
                live_matchers.append(state.matcher)
                if state.envelope is not None:
                    envelopes.append((row, state.envelope))
        if len(live_rows) == 1 and not envelopes:   # xgrammar says whether the mask allows everything
            if live_matchers[0].fill_next_token_bitmask(bitmask, live_rows[0]):
                masked.append(live_rows[0])
        elif live_rows:
            self._fill(live_matchers, bitmask, live_rows)
            if envelopes:
                self._intersect_envelopes(envelopes)
            masked += self._not_open(live_rows)
        if not masked:
            return logits
        vocab = min(self.vocab_size, logits.shape[-1])
        if logits.device.type == "cpu":
            self._apply_on_cpu(logits, masked, vocab)
        else:
            import xgrammar as xgr
            xgr.apply_token_bitmask_inplace(logits, bitmask[:batch].to(logits.device, non_blocking=True),
                                            vocab_size=vocab, indices=masked)
        return logits

    def _fill(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        """Fill the rows' masks: one call for several rows, filled in parallel by xgrammar."""
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
            return
        if self._batch_filler is None:
            import xgrammar as xgr
            self._batch_filler = xgr.BatchGrammarMatcher()
        self._batch_filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def _intersect_envelopes(self, envelopes: list[tuple[int, Any]]) -> None:
        """Each row's catalog mask AND its envelope's: names from the subset, arguments from the
        tool's schema (:mod:`.split`)."""
        if self._envelope_bitmask is None:
            import xgrammar as xgr
            self._envelope_bitmask = xgr.allocate_token_bitmask(self._words.shape[0], self.vocab_size)
        rows = [row for row, _ in envelopes]
        self._fill([matcher for _, matcher in envelopes], self._envelope_bitmask, rows)
        self._words[rows] &= self._envelope_bitmask.numpy()[rows]

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
        """xgrammar's CPU kernel takes about 0.5 ms a row at a 150K vocabulary; unpacking the bits
        with numpy and one masked fill takes about 0.1 ms (measured in benchmarks/). Several rows
        are unpacked and masked in one go (one slice when they are contiguous)."""
        import numpy as np
        import torch
        if len(rows) == 1:
            allowed = np.unpackbits(self._words[rows[0]].view(np.uint8), bitorder="little", count=vocab)
            logits[rows[0], :vocab].masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))
            return
        allowed = np.unpackbits(self._words[list(rows)].view(np.uint8), axis=-1, bitorder="little",
                                count=vocab)
        refused = torch.from_numpy(allowed) == 0
        first = rows[0]
        if list(rows) == list(range(first, first + len(rows))):
            logits[first:first + len(rows), :vocab].masked_fill_(refused, float("-inf"))
        else:
            index = torch.tensor(list(rows))
            logits[index, :vocab] = logits[index, :vocab].masked_fill(refused, float("-inf"))

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

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
        """Advance every matcher over the output tokens produced since the last step: the usual
        step (one new token a row) in one batched accept for all rows, a row with several new
        tokens (a resumed request, a row whose reasoning just ended) on its own."""
        matchers: list[Any] = []
        tokens: list[int] = []
        owners: list[_Row] = []
        for state in self.rows.values():
            output = state.output_ids
            if state.reasoning and not self._end_reasoning(state):
                continue
            new = len(output) - state.consumed
            if new <= 0:
                continue
            if new == 1 and not state.failed:
                token = output[state.consumed]
                if token < 0:          # a placeholder not yet filled in (async scheduling)
                    continue
                state.consumed += 1
                if state.matcher.is_terminated():
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
        import xgrammar as xgr
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        for state, token, ok in zip(owners, tokens, accepted):
            if not ok and not state.failed:
                state.failed = True
                logger.error("vllm-allowed-tools: the grammar refused token %d; the request may "
                             "only stop now", token)

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
        state.consumed, state.reasoning, state.prompt_ids = start, False, ()
        return True

    def apply(self, logits: Any) -> Any:
        """Mask each constrained row of ``logits`` ([rows, vocab]) in place."""
        if not self.rows:
            return logits
        batch = logits.shape[0]
        bitmask = self._bitmask
        masked, live_rows, live_matchers, envelope_rows, envelopes = [], [], [], [], []
        for row, state in self.rows.items():
            if row >= batch or state.reasoning:
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
        if not masked:
            return logits
        masked.sort()
        vocab = min(self.vocab_size, logits.shape[-1])
        if logits.device.type == "cpu":
            self._apply_on_cpu(logits, masked, vocab)
        else:
            import xgrammar as xgr
            xgr.apply_token_bitmask_inplace(logits, bitmask[:batch].to(logits.device, non_blocking=True),
                                            vocab_size=vocab, indices=masked)
        return logits

    def _fill(self, matchers: list[Any], rows: list[int]) -> None:
        """Fill the rows' masks: one call for several rows, filled in parallel by xgrammar."""
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
        """Mask ``rows`` (sorted) of CPU logits below ``vocab``, all rows in a few numpy operations.

        xgrammar 0.2.8's CPU kernel takes about 0.5 ms a row at a 150K vocabulary, and torch's
        element-wise ops on a busy 2-core machine stall on their thread pool, so the masks are
        applied through a numpy view of the logits: a row that allows a few tokens (most steps of
        a call) keeps them and is filled with -inf (a memset); the others unpack their refused bits
        and set those. Logits numpy cannot view (bfloat16) go through torch."""
        import numpy as np
        try:
            target = logits.detach().numpy()
        except (TypeError, RuntimeError):
            self._apply_with_torch(logits, rows, vocab)
            return
        rows_array = np.asarray(rows, dtype=np.int64)
        words = self._words[rows_array]
        sparse = np.count_nonzero(words, axis=1) <= words.shape[1] * self.SPARSE_WORDS_SHARE
        if sparse.any():
            _keep_only(target, rows_array[sparse], words[sparse], vocab)
        if not sparse.all():
            dense = rows_array[~sparse]
            refused = np.unpackbits((~words[~sparse]).view(np.uint8), axis=-1, bitorder="little",
                                    count=vocab)
            which, tokens = np.nonzero(refused)
            target[dense[which], tokens] = -np.inf

    def _apply_with_torch(self, logits: Any, rows: Sequence[int], vocab: int) -> None:
        """The bits unpacked with numpy, one masked fill in torch (dtypes numpy has no view of)."""
        import numpy as np
        import torch
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


def _keep_only(target: Any, rows: Any, words: Any, vocab: int) -> None:
    """Set ``target[row, :vocab]`` to -inf but for the tokens each row's bitmask ``words`` allows:
    the allowed tokens are read from the non-zero words only, kept, the rows filled, put back."""
    import numpy as np
    which, columns = np.nonzero(words)
    bits = np.unpackbits(np.ascontiguousarray(words[which, columns]).view(np.uint8).reshape(-1, 4),
                         axis=1, bitorder="little")
    word, bit = np.nonzero(bits)
    tokens = columns[word] * 32 + bit
    owners = rows[which[word]]
    inside = tokens < vocab
    tokens, owners = tokens[inside], owners[inside]
    kept = target[owners, tokens]
    if rows[-1] - rows[0] + 1 == len(rows):   # contiguous: one slice
        target[rows[0]:rows[-1] + 1, :vocab] = -np.inf
    else:
        target[rows, :vocab] = -np.inf
    target[owners, tokens] = kept

"""Compiled structural tags for one tokenizer, cached by digest and bounded by entries and bytes;
the catalogs of split grammars (:mod:`.split`) and split subsets' own grammars compiled in a
background thread. Used by :class:`.masks.MaskedBatch`; no vLLM imports."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from ..settings import FIRST_SEEN_LLGUIDANCE, current
from .lazy_grammars import LazyGrammars, UntranslatableTag
from .lru import LRU as _LRU
from .stage import tag_digest
from .stage import ConstraintArgsError, GrammarText, RequestGrammar

logger = logging.getLogger(__name__)


class RowMatchers(NamedTuple):
    """What masks one row: a matcher, the subset's envelope where ``matcher`` is a catalog's (their
    masks ANDed: :mod:`.split`), and whether the row moves onto its own compiled grammar once that
    is ready (``provisional``: a split's two, or llguidance's matcher)."""
    matcher: Any
    envelope: Any
    provisional: bool = False


class CompiledGrammars:
    """Compiled structural tags for one tokenizer, by tag digest, in one LRU bounded by entries and
    by bytes (``VLLM_ALLOWED_TOOLS_GRAMMAR_CACHE_ENTRIES`` / ``_MB``): a compiled grammar at a
    150K vocabulary takes 2-15 MB (its token-mask cache), so a count alone lets a server with many
    distinct subsets grow by gigabytes (``benchmarks/scale_memory.py``).

    Keyed by digest, not by the client-visible allowlist, so no request can plant a grammar under
    another turn's key: the digest is checked against the text on every compile. A catalog's
    grammar (:mod:`.split`) is compiled in a background thread the first time a request names it;
    until it is ready, requests are constrained by their own whole grammar. A split row's own
    grammar is compiled in that thread too (``upgrade``): its envelope's mask, where the arguments
    are any JSON, is the costly part of a step at large vocabularies, so once the subset's grammar
    is ready the row continues on it alone (:meth:`MaskedBatch.sync`), which admits the same."""

    #: at most this many compiles wait for the background thread: past it, new subsets' rows stay
    #: on their split (a burst of first-seen subsets must not queue compiles without end)
    PENDING_LIMIT = 64

    def __init__(self, tokenizer_info: Any, capacity: int | None = None, max_threads: int = 8,
                 catalog_capacity: int | None = None, max_bytes: int | None = None,
                 upgrade: bool = True, lazy: bool | None = None, hf_tokenizer: Any = None) -> None:
        import xgrammar as xgr
        settings = current()
        self.tokenizer_info = tokenizer_info
        self.upgrade = upgrade
        # a row whose grammar is not compiled yet starts on llguidance (:mod:`.lazy_grammars`)
        if upgrade and (lazy if lazy is not None else settings.first_seen_grammars == FIRST_SEEN_LLGUIDANCE):
            self.lazy: LazyGrammars | None = LazyGrammars(tokenizer_info, hf_tokenizer)
        else:
            self.lazy = None
        # xgrammar's own cache keeps the pieces it compiled (each tool's argument schema, the
        # envelopes' arguments), so later grammars of the same tools compile far faster; it takes
        # the budget vLLM's xgrammar backend takes
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max_threads, cache_enabled=True,
            cache_limit_bytes=settings.xgrammar_cache_mb << 20)
        entries = capacity if capacity is not None else settings.grammar_cache_entries
        self._cache = _LRU(entries + (catalog_capacity or 0),
                           max_bytes if max_bytes is not None else settings.grammar_cache_mb << 20)
        self._jobs: dict[str, Future] = {}
        self._jobs_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def get(self, grammar: GrammarText) -> Any:
        compiled = self._cache.get(grammar.digest)
        if compiled is None:
            compiled = self._compile(grammar)
            self._cache.put(grammar.digest, compiled, compiled.memory_size_bytes)
        return compiled

    def ready(self, grammar: GrammarText) -> Any:
        """The compiled grammar when it is in the cache, else None (never compiles)."""
        return self._cache.peek(grammar.digest)

    def _compile(self, grammar: GrammarText) -> Any:
        if tag_digest(grammar.tag_json) != grammar.digest:
            raise ConstraintArgsError("structural tag digest mismatch")
        return self._compiler.compile_structural_tag(grammar.tag_json)

    def matchers(self, grammar: RequestGrammar, stop_token_ids: Sequence[int] = ()) -> RowMatchers:
        """The matchers for a request: its own grammar when it is compiled; else llguidance's
        matcher for the same grammar while xgrammar compiles it in the background (``lazy``);
        else the catalog's matcher and the subset's envelope when the catalog is compiled (and
        the subset's own grammar is compiled in the background for its later steps); else the
        request's whole grammar (and the catalog is compiled in the background for the next
        request)."""
        import xgrammar as xgr
        stops = list(stop_token_ids) or None
        if self.lazy is not None and self.ready(grammar) is None:
            try:
                lazy = self.lazy.matcher(grammar, stop_token_ids, free_text=grammar.utf8_text)
            except UntranslatableTag as exc:
                logger.info("vllm-allowed-tools: %s; the row waits for xgrammar's compile", exc)
            else:   # past PENDING_LIMIT queued compiles the row stays on llguidance
                if len(self._jobs) < self.PENDING_LIMIT:
                    self._in_background(grammar, self._compile_after_llguidance)
                return RowMatchers(lazy, None, provisional=True)
        if grammar.catalog is not None and grammar.envelope is not None:
            own = self.ready(grammar) if self.upgrade else None
            if own is not None:
                return RowMatchers(xgr.GrammarMatcher(own, override_stop_tokens=stops), None)
            catalog = self.catalog(grammar.catalog, wait=False)
            if catalog is not None:
                try:
                    envelope = self.get(grammar.envelope)
                except Exception:   # the whole grammar below still enforces the subset
                    logger.exception("vllm-allowed-tools: could not compile an envelope grammar")
                else:
                    if self.upgrade and len(self._jobs) < self.PENDING_LIMIT:
                        self._in_background(grammar, self._compile_own)
                    return RowMatchers(xgr.GrammarMatcher(catalog, override_stop_tokens=stops),
                                       xgr.GrammarMatcher(envelope, override_stop_tokens=stops),
                                       provisional=self.upgrade)
        return RowMatchers(xgr.GrammarMatcher(self.get(grammar), override_stop_tokens=stops), None)

    def catalog(self, grammar: GrammarText, wait: bool = True) -> Any:
        """The compiled catalog grammar; ``wait=False`` returns None while it is being compiled in
        the background (starting that on first sight)."""
        compiled = self._cache.get(grammar.digest)
        if compiled is not None:
            return compiled
        job = self._in_background(grammar, self._compile_catalog)
        if not wait and not job.done():
            return None
        try:
            return job.result()
        except Exception:   # logged by the worker; such a catalog is never used
            return None

    def _in_background(self, grammar: GrammarText, compile_it: Any) -> Future:
        """The one background compile of ``grammar`` (started on first call)."""
        with self._jobs_lock:
            job = self._jobs.get(grammar.digest)
            if job is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="allowed-tools-catalog")
                job = self._jobs[grammar.digest] = self._worker.submit(compile_it, grammar)
        return job

    def _compile_own(self, grammar: GrammarText) -> Any:
        try:
            if self._cache.peek(grammar.digest) is None:
                compiled = self._compile(grammar)
                self._cache.put(grammar.digest, compiled, compiled.memory_size_bytes)
        except Exception:   # the row keeps its catalog and envelope, which enforce the same
            logger.exception("vllm-allowed-tools: could not compile a subset's grammar")
        finally:
            with self._jobs_lock:
                self._jobs.pop(grammar.digest, None)

    def _compile_after_llguidance(self, grammar: GrammarText) -> None:
        started = time.perf_counter()
        self._compile_own(grammar)
        if self._cache.peek(grammar.digest) is not None:
            logging.getLogger("vllm.allowed_tools").info(
                "vllm-allowed-tools: a first-seen grammar (%d KB) started on llguidance; xgrammar "
                "compiled it in the background in %.2f s and its rows moved onto it",
                len(grammar.tag_json) // 1024, time.perf_counter() - started)

    def _compile_catalog(self, grammar: GrammarText) -> Any:
        started = time.perf_counter()
        try:
            compiled = self._compile(grammar)
        except Exception:
            logger.exception("vllm-allowed-tools: could not compile a catalog grammar; its requests "
                             "keep their own grammars")
            raise
        self._cache.put(grammar.digest, compiled, compiled.memory_size_bytes)
        with self._jobs_lock:
            self._jobs.pop(grammar.digest, None)
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

    @property
    def memory_bytes(self) -> int:
        """What the compiled grammars in the cache take (xgrammar's own count)."""
        return self._cache.bytes

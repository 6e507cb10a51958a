"""The logits-processor constraint stage, as vLLM's ``vllm.logits_processors`` entry point.

vLLM loads every installed entry point of that group into every server, so this class must cost
nothing to servers that never use it: construction is cheap, the tokenizer and the grammar compiler
are only built when the first constrained request arrives, and ``apply`` returns at once while no
row of the batch is constrained.

It implements the V1 model runner's interface. Model Runner V2 loads entry points of the same
group but refuses V1-interface classes, which would stop every V2 server that merely has this
package installed, so the class also declares the V2 interface: under V2 it constrains nothing and
raises, naming the fix, for any request that asks it to (only offline callers can: the server's
start-up check never picks this stage where Model Runner V2 may run). vLLM itself drops entry-point
processors under speculative decoding; the start-up check does not pick the stage there either.

With a reasoning parser (``--reasoning-parser``), a row's grammar waits for the end of reasoning,
decided by that parser exactly as vLLM's structured-output manager decides it for the native stage
(``_VllmReasoningGate``); ``--structured-outputs-config.enable_in_reasoning`` constrains from the
first token instead, as there.

A turn that must call (``extra_args`` carries :data:`..wire.XARGS_MUST_CALL`, set by
the parser wrapper on either stage) is held while it reasons: no stop token, and reasoning ends while
the budget holds the call. On the native stage such a row has no grammar here; this processor only
holds its reasoning, and leaves the row once the reasoning ends.

A turn whose parser reads some stop tokens as text (``extra_args`` carries
:data:`..wire.XARGS_REFUSED_TOKENS`: gpt-oss's ``<|endoftext|>``) never writes them, on either stage
(``decode/refused_tokens.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ..decode.masks import CompiledGrammars, MaskedBatch, ReasoningGate
from ..decode.reasoning_hold import read_must_call
from ..decode.refused_tokens import read_refused_tokens
from ..decode.stage import ConstraintArgsError, read_extra_args

try:  # vLLM 0.32: engine-based reasoning parsers (qwen3, ...) say which end token is content
    from vllm.parser.engine.adapters import ParserEngineReasoningAdapter
except ImportError:  # pragma: no cover - a vLLM without parser engines
    ParserEngineReasoningAdapter = None  # type: ignore[assignment,misc]

try:  # Model Runner V2 (vLLM 0.32+): see the module docstring
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # pragma: no cover - a vLLM without Model Runner V2
    class V2LogitsProcessor:  # type: ignore[no-redef]
        pass

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

V2_REFUSAL = ("the allowed-tools logits-processor stage runs on vLLM's V1 model runner only; set "
              "VLLM_USE_V2_MODEL_RUNNER=0 or VLLM_ALLOWED_TOOLS_CONSTRAINT=native")

_TOKENIZER_GRAMMARS: dict[Any, CompiledGrammars] = {}


def compiled_grammars_for(vllm_config: VllmConfig) -> CompiledGrammars:
    """One compiled-grammar cache per tokenizer (model, revision, mode, vocabulary size), shared by
    every processor instance of this process."""
    model_config = vllm_config.model_config
    key = (model_config.tokenizer, getattr(model_config, "tokenizer_revision", None),
           getattr(model_config, "tokenizer_mode", None), model_config.get_vocab_size())
    grammars = _TOKENIZER_GRAMMARS.get(key)
    if grammars is None:
        import xgrammar as xgr
        from vllm.tokenizers import cached_tokenizer_from_config
        tokenizer = cached_tokenizer_from_config(model_config)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.get_vocab_size())
        grammars = _TOKENIZER_GRAMMARS[key] = CompiledGrammars(info, hf_tokenizer=tokenizer)
    return grammars


class _VllmReasoningGate:
    """vLLM's reasoning parser as a :class:`ReasoningGate`, deciding where the grammar starts as
    ``StructuredOutputManager._get_constraint_bounds`` does (vLLM 0.32): engine-based parsers by
    their end tokens (an implicit end, such as qwen3's ``<tool_call>``, is the grammar's first token),
    the others by ``is_reasoning_end_streaming`` over the tokens so far, one token back at a time.
    One parser serves every row: these methods read the parser's configuration, not its state."""

    def __init__(self, reasoner: Any) -> None:
        self._reasoner = reasoner
        self._by_end_token = (ParserEngineReasoningAdapter is not None
                              and isinstance(reasoner, ParserEngineReasoningAdapter)
                              and bool(reasoner.reasoning_end_token_ids))
        self.end_token_id = self._explicit_end(reasoner)

    def _explicit_end(self, reasoner: Any) -> int | None:
        """The token that ends reasoning explicitly: an engine parser's end token that is not an
        implicit end (qwen3's ``</think>``, not its ``<tool_call>``), a ``<think>`` scanner's
        ``end_token_id``; None when the parser names none."""
        if self._by_end_token:
            for token in sorted(reasoner.reasoning_end_token_ids):
                end = reasoner.find_reasoning_end([token])
                if end is not None and not end.implicit:
                    return int(token)
            return None
        token = getattr(reasoner, "end_token_id", None)
        return token if isinstance(token, int) and not isinstance(token, bool) else None

    def ended_in_prompt(self, prompt_ids) -> bool:
        return bool(self._reasoner.is_reasoning_end(list(prompt_ids)))

    def grammar_start(self, prompt_ids, output_ids, start: int, stop: int) -> int | None:
        new = list(output_ids[start:stop])
        if self._by_end_token:
            end = self._reasoner.find_reasoning_end(new)
            if end is not None:
                if end.offset >= len(new):
                    return None
                return start + end.offset + (0 if end.implicit else 1)
        ids = [*prompt_ids, *output_ids[:stop]]
        if not self._reasoner.is_reasoning_end_streaming(ids, new):
            return None
        for index in range(len(new) - 1, 0, -1):
            ids.pop()
            new.pop()
            if not self._reasoner.is_reasoning_end_streaming(ids, new):
                return start + index + 1
        return start + 1


def reasoning_gate_for(vllm_config: VllmConfig) -> ReasoningGate | None:
    """The server's reasoning parser as a gate; None without one, or when the operator constrains
    reasoning too (``enable_in_reasoning``)."""
    config = vllm_config.structured_outputs_config
    if not config.reasoning_parser or config.enable_in_reasoning:
        return None
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import cached_tokenizer_from_config
    if config.reasoning_parser_plugin and len(config.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(config.reasoning_parser_plugin)
    reasoner_cls = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
    return _VllmReasoningGate(reasoner_cls(tokenizer=cached_tokenizer_from_config(vllm_config.model_config)))


class AllowedToolsLogitsProcessor(LogitsProcessor, V2LogitsProcessor):
    """Masks the logits of requests that carry an allowed-tools structural tag in ``extra_args``."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            read_extra_args(sampling_params.extra_args)
            read_must_call(sampling_params.extra_args)
            read_refused_tokens(sampling_params.extra_args)
        except ConstraintArgsError as error:
            raise ValueError(str(error)) from None

    def __init__(self, vllm_config: VllmConfig, *args: Any) -> None:
        self._vllm_config = vllm_config
        self._v2 = len(args) == 1          # V2: (vllm_config, req_states); V1: (config, device, pin)
        self._batch: MaskedBatch | None = None
        self._max_rows = vllm_config.scheduler_config.max_num_seqs

    def _masked_batch(self) -> MaskedBatch:
        if self._batch is None:
            grammars = compiled_grammars_for(self._vllm_config)
            self._batch = MaskedBatch(grammars, self._vllm_config.model_config.get_vocab_size(),
                                      self._max_rows, reasoning=reasoning_gate_for(self._vllm_config))
        return self._batch

    def _holds_reasoning(self) -> bool:
        """Whether rows that must call are held while they reason: the server runs a reasoning
        parser whose reasoning is left unconstrained (no parser: the grammar applies from the first
        token, nothing to hold)."""
        config = self._vllm_config.structured_outputs_config
        return bool(config.reasoning_parser) and not config.enable_in_reasoning

    def is_argmax_invariant(self) -> bool:
        return False

    # ------------------------------------------------------------------ V1 interface
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for row in batch_update.removed:
                if self._batch is not None:
                    self._batch.remove(row)
            for row, params, prompt_ids, output_ids in batch_update.added:
                grammar = (read_extra_args(params.extra_args, verify=False)   # checked at admission
                           if params is not None else None)
                must_call = read_must_call(params.extra_args) if params is not None else None
                refused = read_refused_tokens(params.extra_args) if params is not None else ()
                if grammar is None and self._batch is None and not refused and \
                        (must_call is None or not self._holds_reasoning()):
                    continue
                stops = sorted(getattr(params, "all_stop_token_ids", None) or ())
                self._masked_batch().add(row, grammar, output_ids, stops, prompt_ids, must_call=must_call,
                                         max_tokens=getattr(params, "max_tokens", None), refused=refused)
            for source, target, direction in batch_update.moved:
                if self._batch is not None:
                    self._batch.move(source, target, direction == MoveDirectionality.SWAP)
        if self._batch is not None:
            self._batch.sync()

    def apply(self, logits, ctx: Any = None):
        if self._batch is None or self._v2:
            return logits
        return self._batch.apply(logits)

    # ------------------------------------------------------------------ V2 interface
    def add_request(self, req_idx: int, sampling_params) -> bool:
        if read_extra_args(sampling_params.extra_args, verify=False) is not None:
            raise ValueError(V2_REFUSAL)
        return False


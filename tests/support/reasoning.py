"""The engine-side pieces the reasoning tests drive without a server: a tiny model's tokenizer, the
grammars compiled for it, and vLLM's reasoning parser behind the logits processor's gate."""

from __future__ import annotations

from typing import Any


def tiny_tokenizer() -> Any:
    """The tiny models' tokenizer (every flavour has the same one, ``<think>`` and ``</think>``
    included): the random model's, built in seconds, where the trained flavours' builds take
    minutes on a fresh machine."""
    from transformers import AutoTokenizer

    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return AutoTokenizer.from_pretrained(str(ensure_model("random", log=lambda *_: None)))


def compiled_grammars(tokenizer: Any, lazy: bool | None = None) -> Any:
    """The logits-processor stage's grammars for ``tokenizer`` (``lazy=False``: xgrammar's masks
    from a row's first token, not llguidance's while xgrammar compiles)."""
    import xgrammar as xgr

    from vllm_allowed_tools.decode.masks import CompiledGrammars
    return CompiledGrammars(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)),
                            lazy=lazy, hf_tokenizer=tokenizer)


def reasoning_gate(tokenizer: Any, parser: str) -> Any:
    """The logits processor's gate over vLLM's reasoning parser ``parser``."""
    from vllm.reasoning import ReasoningParserManager

    from vllm_allowed_tools.vllm_glue.logits_processor import _VllmReasoningGate
    return _VllmReasoningGate(ReasoningParserManager.get_reasoning_parser(parser)(tokenizer=tokenizer))

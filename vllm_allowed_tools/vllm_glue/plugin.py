"""vLLM general-plugin entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
several times per process, so it must be idempotent and cheap: it only records lazy parser
registrations; nothing heavy is imported until a server actually selects one of our parsers.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: our parser name -> class name in :mod:`vllm_allowed_tools.vllm_glue.parsers`
PARSERS: dict[str, str] = {
    "allowed_hermes": "AllowedHermesToolParser",
    "allowed_llama3_json": "AllowedLlama3JsonToolParser",
    "allowed_qwen3_coder": "AllowedQwen3CoderToolParser",
    "allowed_mistral": "AllowedMistralToolParser",
    "allowed_pythonic": "AllowedPythonicToolParser",
}
PARSERS_MODULE = "vllm_allowed_tools.vllm_glue.parsers"

_registered = False


def register() -> None:
    """Register the ``allowed_<base>`` tool parsers with vLLM (lazily, once per process)."""
    global _registered
    if _registered:
        return
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # pragma: no cover - vLLM too old or absent
        logger.warning("vllm-allowed-tools: vllm.tool_parsers not importable; parsers not registered")
        return
    for name, class_name in PARSERS.items():
        if name not in ToolParserManager.lazy_parsers and name not in ToolParserManager.tool_parsers:
            ToolParserManager.register_lazy_module(name, PARSERS_MODULE, class_name)
    _registered = True
    logger.debug("vllm-allowed-tools: registered parsers %s", ", ".join(PARSERS))

"""vLLM general-plugin entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
several times per process, so it must be idempotent and cheap: it only records lazy parser
registrations; nothing heavy is imported until a server actually selects one of our parsers.
"""

from __future__ import annotations

import logging

from ..formats import wire_formats

logger = logging.getLogger(__name__)

PARSERS_MODULE = "vllm_allowed_tools.vllm_glue.parsers"


def parser_names() -> list[str]:
    """Our parser names (``allowed_<base>``), one per registered wire format."""
    return [entry.parser_name for entry in wire_formats()]


def register() -> None:
    """Register an ``allowed_<base>`` tool parser per wire format with vLLM, lazily (the class is
    built when vLLM first asks for it). Formats registered since the last call are added."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # pragma: no cover - vLLM too old or absent
        logger.warning("vllm-allowed-tools: vllm.tool_parsers not importable; parsers not registered")
        return
    added = []
    for entry in wire_formats():
        name = entry.parser_name
        if name not in ToolParserManager.lazy_parsers and name not in ToolParserManager.tool_parsers:
            ToolParserManager.register_lazy_module(name, PARSERS_MODULE, entry.parser_class_name)
            added.append(name)
    if added:
        logger.debug("vllm-allowed-tools: registered parsers %s", ", ".join(added))

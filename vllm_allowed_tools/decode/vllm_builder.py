"""The hook through which the vLLM glue lends :mod:`.grammar` vLLM's own structural-tag builders.

Formats of grammar kind ``vllm`` (GLM's XML arguments, MiniMax's ``<invoke>`` calls, harmony) take
the tag vLLM's parser would build for the allowed subset. ``decode`` imports no vLLM, so the builder
is handed in once per process by the plugin (:func:`vllm_allowed_tools.vllm_glue.plugin.register`,
which vLLM runs in every process it starts, offline ``LLM`` included). Light: no xgrammar import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``builder(vllm_model, functions, mode, parallel, strict_level, max_whitespace)`` -> StructuralTag | None
VllmTagBuilder = Callable[..., Any]

_REGISTERED: dict[str, VllmTagBuilder] = {}


def register_vllm_tag_builder(builder: VllmTagBuilder) -> None:
    """Set the process's builder for ``vllm`` grammars (idempotent: the last one wins)."""
    _REGISTERED["vllm"] = builder


def vllm_tag_builder() -> VllmTagBuilder:
    """The registered builder; ValueError saying how to register one where none is."""
    builder = _REGISTERED.get("vllm")
    if builder is None:
        raise ValueError("this format's grammar is built by vLLM's own structural-tag builder, which "
                         "the plugin registers when vLLM loads it; in a process where vLLM has not "
                         "loaded its plugins, call "
                         "vllm_allowed_tools.vllm_glue.plugin.register_tag_builder() first")
    return builder

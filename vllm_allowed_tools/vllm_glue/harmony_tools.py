"""Two narrow wraps on vLLM's harmony path for requests with server-side tools.

**Functions next to built-ins.** vLLM 0.32/0.33 hands every tool of a request that has a function to
``get_developer_message`` (``entrypoints/openai/parser/harmony_utils.py``), which raises on any type
other than a function or a built-in's own type: a request carrying a client ``function`` and an
``mcp`` tool whose ``server_label`` names a built-in (``container``, ``code_interpreter``,
``web_search_preview``) is a 400 "tool type 'mcp' is not supported", although vLLM renders that
built-in itself (its description goes into the system message, from the tool server's listing). The
wrap leaves those ``mcp`` tools out of the developer message, as the built-in types are; the
functions are rendered as functions. An ``mcp`` tool with any other label is passed on (vLLM runs
no such tool, and says so).

**A call ends with ``<|call|>``.** A server-side turn's grammar names ``<|call|>`` as the token that
ends each call (:mod:`..decode.server_tools`). xgrammar admits a stop token only where the grammar
has ended, so a grammar that must write one cannot have it among its stop tokens; vLLM compiles the
grammar with ``SamplingParams.all_stop_token_ids``, which the engine rebuilds from
``stop_token_ids`` when it receives the parameters. So the wrap takes the grammar's own tokens out
of both (after ``update_from_generation_config`` merged the model's end tokens in, on the copy of
the parameters each generation makes): such a generation writes ``<|call|>`` as the call's last
token and stops at the stop token the grammar admits after it (``<|return|>``), which vLLM's
harmony parser passes over. The hook then reads the call as complete by its last token that is not
a stop token (:mod:`..server_tools.runs`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from ..wire import XARGS_TAG

_INSTALLED: list[str] = []


def missing() -> list[str]:
    """What this vLLM lacks of what the wraps wrap (empty: both can be installed)."""
    try:
        from vllm.entrypoints.openai.parser import harmony_utils
        from vllm.sampling_params import SamplingParams
    except ImportError as exc:
        return [f"vLLM's harmony_utils / SamplingParams ({exc})"]
    out = []
    if not callable(getattr(harmony_utils, "get_developer_message", None)):
        out.append("harmony_utils.get_developer_message")
    if not callable(getattr(SamplingParams, "update_from_generation_config", None)) \
            or "_all_stop_token_ids" not in getattr(SamplingParams, "__struct_fields__", ()):
        out.append("SamplingParams.update_from_generation_config / _all_stop_token_ids")
    return out


def install() -> None:
    """Wrap both once per process (the caller checked :func:`missing`)."""
    if _INSTALLED:
        return
    from vllm.entrypoints.openai.parser import harmony_utils
    from vllm.sampling_params import SamplingParams
    harmony_utils.get_developer_message = _without_builtin_mcp(harmony_utils.get_developer_message)
    SamplingParams.update_from_generation_config = _grammar_stop_tokens(
        SamplingParams.update_from_generation_config)
    _INSTALLED.append("installed")


def builtin_labels() -> frozenset[str]:
    """The ``server_label`` values vLLM runs as built-ins (``VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS``)."""
    from vllm import envs
    return frozenset(envs.VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS or ())


def _without_builtin_mcp(get_developer_message: Any) -> Any:
    @functools.wraps(get_developer_message)
    def wrapped(instructions: Any = None, tools: Any = None) -> Any:
        if tools:
            labels = builtin_labels()
            tools = [tool for tool in tools if not (getattr(tool, "type", None) == "mcp"
                                                    and getattr(tool, "server_label", None) in labels)]
        return get_developer_message(instructions=instructions, tools=tools)
    return wrapped


def _grammar_json(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None)
    if isinstance(extra, dict) and isinstance(extra.get(XARGS_TAG), str):
        return extra[XARGS_TAG]
    outputs = getattr(params, "structured_outputs", None)
    tag = getattr(outputs, "structural_tag", None)
    return tag if isinstance(tag, str) else None


def _grammar_stop_tokens(update: Any) -> Any:
    @functools.wraps(update)
    def update_from_generation_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = update(self, *args, **kwargs)
        grammar = _grammar_json(self)
        if grammar is not None:
            kept = stop_tokens_for_grammar(self._all_stop_token_ids, grammar)
            if kept != self._all_stop_token_ids:
                self._all_stop_token_ids = kept
                self.stop_token_ids = [t for t in self.stop_token_ids or () if t in kept]
        return result
    return update_from_generation_config


_TOKEN_ID = re.compile(r'"token"\s*:\s*(\d+)')   # a ``token`` format's id (JSON text)


def stop_tokens_for_grammar(stop_token_ids: Iterable[int], grammar_json: str | None) -> set[int]:
    """The stop tokens a grammar's matcher may take (``stop_token_ids`` without those the grammar
    names as its own tokens, such as a call's ``<|call|>``): xgrammar admits a stop token only where
    the grammar has ended, so one the grammar must write would never be admitted."""
    stops = set(stop_token_ids)
    if not grammar_json or '"token"' not in grammar_json:
        return stops
    named = {int(m) for m in _TOKEN_ID.findall(grammar_json)}
    return stops - named

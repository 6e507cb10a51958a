"""Counters that tell invalid client selections apart from backend/parser violations.

The counters live on prometheus_client's default ``REGISTRY`` because that is what vLLM's own
``/metrics`` endpoint serves (including its multiprocess mode), so no extra endpoint is needed:

* ``vllm_allowed_tools:invalid_selections_total{reason}``: the client sent a selection we rejected
  with a 400 (its fault; see ``errors.SELECTION_REASONS``).
* ``vllm_allowed_tools:violations_total{source}``: the model/parser produced a call outside the
  allowlist and we stopped it (``parser``, ``unary_guard``, ``stream_guard``): our stack's fault, or
  the model's; ``unreadable``: a response the guard could not read while a policy applied was
  refused in its place.
* ``vllm_allowed_tools:backstops_total{reason}``: an answer the output guard refused for what a call
  (or its absence) was, not for its name: ``required_without_call`` (a turn that must call answered
  without a call), ``arguments_not_object`` (a call whose arguments are not one JSON object),
  ``strict_arguments_invalid`` (a ``strict`` tool's arguments do not validate against its schema),
  ``custom_input_invalid`` (a custom tool's input its ``format`` grammar does not admit).
  Each is also counted once in ``violations_total`` under the source that stopped it.
* ``vllm_allowed_tools:server_tool_failures_total{reason}``: a server-side call (one vLLM runs
  itself) that did not give an output: ``raised`` (running it raised: the tool server gone, a reply
  vLLM cannot read), ``tool_error`` (the tool answered with an error), ``cut_off`` (the call was
  cut off by the token limit, never run), ``not_called`` (ended by another stop token than
  harmony's call end, never run), ``not_json`` (arguments that do not parse, never run).
* ``vllm_allowed_tools:fallbacks_total{kind}``: an explicitly enabled compatibility fallback (such
  as catalog filtering) was used; such requests do not have the full cache-friendly contract.

Collectors are created lazily and idempotently: importing this module twice (or reloading it, as
some test runners do) must not raise prometheus_client's "Duplicated timeseries" error. Whatever
prometheus_client does, plain in-process counts are kept too, for :func:`snapshot` in tests and for
deployments without prometheus_client.
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from typing import Any

__all__ = [
    "METRIC_NAMES",
    "BACKSTOP_REASONS",
    "VIOLATION_SOURCES",
    "record_backstop",
    "record_fallback",
    "record_server_tool_failure",
    "record_invalid_selection",
    "record_violation",
    "snapshot",
]

# unreadable: a response the guard could not read while a policy applied (unknown content type, a
# body or stream event that is not JSON) was refused, since it may have held a call
VIOLATION_SOURCES = frozenset({"parser", "unary_guard", "stream_guard", "unreadable"})

#: why the output guard's backstops refused an answer (``AllowedToolsViolation.reason``)
BACKSTOP_REASONS = frozenset({"required_without_call", "arguments_not_object",
                              "strict_arguments_invalid", "custom_input_invalid"})

#: why a server-side call gave no output (``record_server_tool_failure``)
SERVER_TOOL_FAILURES = frozenset({"raised", "tool_error", "cut_off", "not_called", "not_json"})

# family -> (prometheus name, label name, help)
METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "invalid_selections": (
        "vllm_allowed_tools:invalid_selections", "reason",
        "Requests rejected because tools/tool_choice (allowed_tools) could not be resolved."),
    "violations": (
        "vllm_allowed_tools:violations", "source",
        "Tool calls outside the allowlist produced by the model/parser and stopped by the plugin."),
    "backstops": (
        "vllm_allowed_tools:backstops", "reason",
        "Answers refused by an output-guard backstop: a required call missing, arguments that are "
        "not a JSON object, strict arguments that do not validate."),
    "server_tool_failures": (
        "vllm_allowed_tools:server_tool_failures", "reason",
        "Server-side tool calls that failed when run, or were not complete and never ran."),
    "fallbacks": (
        "vllm_allowed_tools:fallbacks", "kind",
        "Requests served through an explicitly enabled compatibility fallback."),
}

_lock = threading.Lock()
_local: dict[str, _Tally[str]] = {family: _Tally() for family in METRIC_NAMES}
_collectors: dict[str, Any] = {}
_prometheus_missing = False


def _collector(family: str) -> Any | None:
    """The prometheus Counter of a family, creating or adopting it on first use; None without
    prometheus_client."""
    global _prometheus_missing
    existing = _collectors.get(family)
    if existing is not None or _prometheus_missing:
        return existing
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError:  # pragma: no cover - prometheus_client ships with vLLM
        _prometheus_missing = True
        return None
    name, label, help_text = METRIC_NAMES[family]
    with _lock:
        existing = _collectors.get(family)
        if existing is not None:
            return existing
        # Adopt a collector registered earlier (module reload, a second copy of the package).
        registered = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
        if registered is None:
            try:
                registered = Counter(name, help_text, [label])
            except ValueError:  # lost a race with another registrant: adopt theirs
                registered = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
                if registered is None:
                    raise
        _collectors[family] = registered
        return registered


def _record(family: str, label_value: str) -> None:
    with _lock:
        _local[family][label_value] += 1
    collector = _collector(family)
    if collector is not None:
        collector.labels(label_value).inc()


def record_invalid_selection(reason: str) -> None:
    """Count one request rejected for an invalid selection (``InvalidSelectionError.reason``)."""
    _record("invalid_selections", str(reason))


def record_violation(source: str) -> None:
    """Count one disallowed call stopped by ``source`` (parser, unary_guard or stream_guard).

    An unexpected source is counted as ``other`` rather than raising: this runs on failure paths
    that must not fail themselves, and label cardinality must stay bounded.
    """
    _record("violations", source if source in VIOLATION_SOURCES else "other")


def record_backstop(reason: str) -> None:
    """Count one answer refused by an output-guard backstop (one of :data:`BACKSTOP_REASONS`;
    anything else is counted as ``other``, like :func:`record_violation`)."""
    _record("backstops", reason if reason in BACKSTOP_REASONS else "other")


def record_server_tool_failure(reason: str) -> None:
    """Count one server-side call that gave no output (one of :data:`SERVER_TOOL_FAILURES`;
    anything else is counted as ``other``)."""
    _record("server_tool_failures", reason if reason in SERVER_TOOL_FAILURES else "other")


def record_fallback(kind: str) -> None:
    """Count one request served through an explicitly enabled fallback (e.g. ``catalog_filter``)."""
    _record("fallbacks", str(kind))


def snapshot() -> dict[str, dict[str, int]]:
    """In-process counts since import, ``{family: {label_value: count}}``; tests compare deltas."""
    with _lock:
        return {family: dict(tally) for family, tally in _local.items()}

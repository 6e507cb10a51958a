"""Tool-call approvals: OpenResponses-style ``elicitation`` items with scoped, bound, revocable grants.

The pure core (no vLLM import). The entry point is :func:`open_engine`::

    from vllm_allowed_tools.approvals import ProposedCall, open_engine, approval_hint

    engine = open_engine(policy="/etc/vllm/approvals.toml", store="/var/lib/vllm/grants.db")

    # a model turn produced calls (spec: the catalog's FunctionSpec of each called tool)
    results = engine.propose_all(
        [ProposedCall.from_spec(spec, call_id=call_id, arguments=arguments_json,
                                hint=approval_hint(tool_definition))],
        principal=authenticated_user, session=conversation_id)
    # each result: Release (send / execute the call), ToolCallApproval (send item.to_json() instead
    # of the call), or Decline (the model sees decline.tool_output)

    # a follow-up request: its `input` carries elicitation_response items
    outcomes = engine.resolve_all(body["input"], principal=authenticated_user,
                                  session=conversation_id, catalog=tool_policy)
    # Release: exactly the recorded call; Decline: a function_call_output for the model;
    # Replayed / Rejected: nothing happens. ApprovalInputError: answer with exc.to_openai(), exc.status

Modules: :mod:`.policy` (the operator's policy file and the tool definition's ``approval`` hint),
:mod:`.items` (wire items, their JSON schemas, the ``elicitation_type`` registry), :mod:`.digests`,
:mod:`.store` (:class:`GrantStore`: SQLite WAL, PostgreSQL), :mod:`.engine` (the decisions),
:mod:`.cli` (``python -m vllm_allowed_tools.approvals.cli --db PATH list|revoke GRANT_ID``).

Configuration by environment (for the server glue, :func:`engine_from_env`):
``VLLM_ALLOWED_TOOLS_APPROVAL_POLICY`` (the policy file; unset: approvals off) and
``VLLM_ALLOWED_TOOLS_GRANT_STORE`` (a SQLite path or ``postgresql://`` DSN; default
``grants.db`` next to the policy file); ``VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT`` (seconds a store
operation may wait before the store counts as unavailable, default 5).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .digests import arguments_digest, definition_digest
from .engine import ApprovalEngine, Decline, Outcome, ProposedCall, Rejected, Release, Replayed
from .errors import ApprovalInputError, GrantStoreUnavailable, PolicyFileError
from .elicitation_types import (
    ElicitationType,
    elicitation_response_schema,
    elicitation_schema,
    register_elicitation_type,
)
from .items import (
    TOOL_CALL_APPROVAL_RESPONSE_SCHEMA,
    TOOL_CALL_APPROVAL_SCHEMA,
    ApprovalItems,
    Elicitation,
    ElicitationResponse,
    ToolCallApproval,
    parse_elicitation,
    parse_elicitation_response,
    parse_input_items,
)
from .hints import approval_hint
from .policy import ApprovalPolicy, EffectiveApproval, load_policy
from .scopes import SCOPES
from .store import (
    ElicitationRecord,
    Grant,
    GrantStore,
    PostgresGrantStore,
    SQLiteGrantStore,
    open_store,
)

__all__ = [
    "ENV_GRANT_STORE",
    "ENV_POLICY",
    "SCOPES",
    "TOOL_CALL_APPROVAL_RESPONSE_SCHEMA",
    "TOOL_CALL_APPROVAL_SCHEMA",
    "ApprovalEngine",
    "ApprovalInputError",
    "ApprovalItems",
    "ApprovalPolicy",
    "Decline",
    "EffectiveApproval",
    "Elicitation",
    "ElicitationRecord",
    "ElicitationResponse",
    "ElicitationType",
    "Grant",
    "GrantStore",
    "GrantStoreUnavailable",
    "Outcome",
    "PolicyFileError",
    "PostgresGrantStore",
    "ProposedCall",
    "Rejected",
    "Release",
    "Replayed",
    "SQLiteGrantStore",
    "ToolCallApproval",
    "approval_hint",
    "arguments_digest",
    "definition_digest",
    "elicitation_response_schema",
    "elicitation_schema",
    "engine_from_env",
    "load_policy",
    "open_engine",
    "open_store",
    "parse_elicitation",
    "parse_elicitation_response",
    "parse_input_items",
    "register_elicitation_type",
]

ENV_POLICY = "VLLM_ALLOWED_TOOLS_APPROVAL_POLICY"
ENV_GRANT_STORE = "VLLM_ALLOWED_TOOLS_GRANT_STORE"


def open_engine(policy: str | os.PathLike[str] | ApprovalPolicy,
                store: str | os.PathLike[str] | GrantStore) -> ApprovalEngine:
    """The approval engine for a policy (a file path or an :class:`ApprovalPolicy`) and a store
    (a SQLite path, ``sqlite:PATH``, a ``postgresql://`` DSN, or a :class:`GrantStore`).

    Raises :class:`PolicyFileError` for a bad policy file: call it at start-up so a broken
    security policy stops the server instead of being ignored.
    """
    if not isinstance(policy, ApprovalPolicy):
        policy = load_policy(policy)
    return ApprovalEngine(policy, open_store(store))


def engine_from_env(environ: Mapping[str, str] | None = None) -> ApprovalEngine | None:
    """:func:`open_engine` from ``VLLM_ALLOWED_TOOLS_APPROVAL_POLICY`` and
    ``VLLM_ALLOWED_TOOLS_GRANT_STORE``; None when no policy is configured (approvals off)."""
    env = os.environ if environ is None else environ
    policy_path = env.get(ENV_POLICY)
    if not policy_path:
        return None
    store = env.get(ENV_GRANT_STORE) or str(Path(policy_path).resolve().parent / "grants.db")
    return open_engine(policy_path, store)

"""Tool-call approvals: OpenResponses-style ``elicitation`` items with scoped, bound, revocable grants.

The vLLM-free core; the server glue builds it with :func:`engine_from_settings`, a library with
:func:`open_engine`. Usage, the policy file, the wire items, the decisions and the store's contract
are in ``docs/approvals.md``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..settings import Settings

from .digests import arguments_digest, definition_digest
from .elicitation_types import (
    ElicitationType,
    elicitation_response_schema,
    elicitation_schema,
    register_elicitation_type,
)
from .engine import ApprovalEngine
from .approval_errors import ApprovalInputError, GrantStoreUnavailable, PolicyFileError
from .hints import approval_hint
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
from .outcomes import Decline, Outcome, ProposedCall, Rejected, Release, Replayed
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
    "engine_from_settings",
    "load_policy",
    "open_engine",
    "open_store",
    "parse_elicitation",
    "parse_elicitation_response",
    "parse_input_items",
    "register_elicitation_type",
]

ENV_POLICY = Settings.variable("approval_policy")
ENV_GRANT_STORE = Settings.variable("grant_store")


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


def engine_from_settings(settings: Settings) -> ApprovalEngine | None:
    """:func:`open_engine` from ``VLLM_ALLOWED_TOOLS_APPROVAL_POLICY`` and
    ``VLLM_ALLOWED_TOOLS_GRANT_STORE`` (``grants.db`` next to the policy file when unset), with
    the store timeout the settings give; None when no policy is configured (approvals off)."""
    policy_path = settings.approval_policy
    if policy_path is None:
        return None
    store = settings.grant_store or str(Path(policy_path).resolve().parent / "grants.db")
    return ApprovalEngine(load_policy(policy_path),
                          open_store(store, timeout_s=settings.grant_store_timeout_s))

"""Hardening of the approvals subsystem: each test here failed before its fix.

* hints: a malformed or contradictory tool-definition ``approval`` object is a 400 before generation;
* the grant store's files are private and principals are keyed with a per-store secret;
* ``purge --older-than-days`` refuses negative ages;
* rules that require approval match a tool's bare name inside any namespace.
"""

from __future__ import annotations

import pytest

from vllm_allowed_tools.approvals import ApprovalPolicy, ProposedCall, ToolCallApproval, open_engine
from vllm_allowed_tools.approvals import cli as approvals_cli
from vllm_allowed_tools.approvals import open_store
from vllm_allowed_tools.approvals.wire import ResponseApprovals
from vllm_allowed_tools.policy import ToolIdentity, resolve_policy

_SEND = {"type": "function", "name": "send_email", "description": "Send an email.",
         "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}

# ------------------------------------------------------------------------- cli: purge ages


@pytest.mark.parametrize("days", ["-1", "-0.5", "nan", "inf", "soon"])
def test_purge_refuses_negative_or_non_finite_ages(tmp_path, capsys, days):
    db = tmp_path / "grants.db"
    open_store(db).close()
    with pytest.raises(SystemExit) as info:
        approvals_cli.main(["--db", str(db), "purge", "--older-than-days", days])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--older-than-days" in err and "number of days >= 0" in err and repr(days) in err


def test_purge_accepts_zero_days(tmp_path, capsys):
    db = tmp_path / "grants.db"
    open_store(db).close()
    assert approvals_cli.main(["--db", str(db), "purge", "--older-than-days", "0"]) == 0
    assert "removed 0 rows" in capsys.readouterr().out


# ------------------------------------------------------------------- rules and namespaces

RULES = ApprovalPolicy.from_mapping({"default_approval": "none", "rules": [
    {"tools": ["get_*"], "approval": "none"},
    {"tools": ["send_email"], "approval": "required", "scopes": ["once"]},
    {"tools": ["crm__*"], "approval": "required", "scopes": ["once", "session"]},
    {"tools": ["mcp__computer_use"], "approval": "required"},
    {"tools": ["*__purge_*"], "approval": "required"},
    {"tools": ["*"], "approval": "none"},
]})


@pytest.mark.parametrize("identity, source", [
    (ToolIdentity(None, "send_email"), "rules[1]"),
    (ToolIdentity("mail", "send_email"), "rules[1]"),     # bare name: no dodging via a namespace
    (ToolIdentity("crm", "update_contact"), "rules[2]"),  # a pattern naming a namespace
    (ToolIdentity("crm", "get_contact"), "rules[2]"),     # `get_*` frees only top-level getters
    (ToolIdentity(None, "mcp__computer_use"), "rules[3]"),  # top-level names may contain __
    (ToolIdentity("db", "purge_all"), "rules[4]"),
])
def test_required_rules_match_bare_names_in_any_namespace(identity, source):
    effective = RULES.effective(identity)
    assert effective.required and effective.source == source


@pytest.mark.parametrize("identity, source", [
    (ToolIdentity(None, "get_weather"), "rules[0]"),
    (ToolIdentity("crm_old", "update_contact"), "rules[5]"),  # `crm__*` names namespace crm only
    (ToolIdentity("x", "computer_use"), "rules[5]"),          # names are never split on __
    (ToolIdentity("tools", "mcp__computer_use"), "rules[5]"),  # a pattern with __ matches only there
    (ToolIdentity(None, "purge_all"), "rules[5]"),
])
def test_rules_naming_a_namespace_match_only_there(identity, source):
    effective = RULES.effective(identity)
    assert not effective.required and effective.source == source


def test_a_rule_without_approval_never_frees_a_namespaced_tool_it_does_not_name():
    policy = ApprovalPolicy.from_mapping({"default_approval": "required",
                                          "rules": [{"tools": ["get_*"], "approval": "none"}]})
    assert not policy.effective(ToolIdentity(None, "get_secret")).required
    assert policy.effective(ToolIdentity("vault", "get_secret")).required


def test_engine_gates_a_namespaced_tool_by_its_bare_name(tmp_path):
    engine = open_engine(ApprovalPolicy.from_mapping(
        {"rules": [{"tools": ["send_email"], "approval": "required"}]}), tmp_path / "grants.db")
    namespaced = ProposedCall(call_id="c1", identity=ToolIdentity("mail", "send_email"),
                              arguments="{}", definition_digest="sha256:" + "0" * 64)
    assert engine.needs_approval(namespaced)
    result = engine.propose(namespaced, principal="alice", session="s1")
    assert isinstance(result, ToolCallApproval) and result.namespace == "mail"


def test_a_namespaced_call_on_the_wire_is_elicited_by_a_bare_name_rule(tmp_path):
    engine = open_engine(ApprovalPolicy.from_mapping(
        {"rules": [{"tools": ["send_email"], "approval": "required"}]}), tmp_path / "grants.db")
    body = {"model": "m", "input": "hi", "tools": [{"type": "namespace", "name": "mail",
                                                    "description": "mail", "tools": [_SEND]}]}
    approvals = ResponseApprovals(engine, body, resolve_policy(body, "responses"),
                                  principal="alice", session="s1")
    assert approvals.may_call_gated()
    response = {"output": [{"type": "function_call", "call_id": "c1", "namespace": "mail",
                            "name": "send_email", "arguments": "{}", "status": "completed"}]}
    approvals.apply_to_response(response)
    assert [item["type"] for item in response["output"]] == ["elicitation"]

"""Hardening of the approvals subsystem: for each item, tests that failed before its fix, next to
controls that pin what must keep working.

* hints: a malformed or contradictory tool-definition ``approval`` object is a 400 before generation;
* the grant store's files are private and principals are keyed with a per-store secret;
* ``purge --older-than-days`` refuses negative ages;
* rules that require approval match a tool's bare name inside any namespace.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import sqlite3
import stat

import pytest

from vllm_allowed_tools.approvals import (
    ApprovalInputError,
    ApprovalPolicy,
    PostgresGrantStore,
    ProposedCall,
    SQLiteGrantStore,
    ToolCallApproval,
    open_engine,
    open_store,
)
from vllm_allowed_tools.approvals import cli as approvals_cli
from vllm_allowed_tools.approvals.hints import check_hints
from vllm_allowed_tools.approvals.store.sql import SCHEMA_VERSION
from vllm_allowed_tools.approvals.response_bodies import ResponseApprovals, principal_from_headers
from vllm_allowed_tools.request import ToolIdentity, resolve_allowlist

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
    approvals = ResponseApprovals(engine, body, resolve_allowlist(body, "responses"),
                                  principal="alice", session="s1")
    assert approvals.may_call_gated()
    response = {"output": [{"type": "function_call", "call_id": "c1", "namespace": "mail",
                            "name": "send_email", "arguments": "{}", "status": "completed"}]}
    approvals.apply_to_response(response)
    assert [item["type"] for item in response["output"]] == ["elicitation"]


# ------------------------------------------------------------ hints: a 400 before generation

HINT_POLICY_DOC = {"rules": [{"tools": ["send_email"], "approval": "required", "scopes": ["once"]}]}
HINT_POLICY = ApprovalPolicy.from_mapping(HINT_POLICY_DOC)
_WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _chat_tool(name, **function):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"},
                                             **function}}


@pytest.mark.parametrize("tools, param", [
    # contradictory: shares no scope with the operator's rule for send_email
    ([_WEATHER, {**_SEND, "approval": {"scopes": ["always"]}}], "tools[1].approval.scopes"),
    ([{"type": "namespace", "name": "mail", "description": "d",
       "tools": [_WEATHER, {**_SEND, "approval": {"required": "yes"}}]}],
     "tools[0].tools[1].approval.required"),
    ([_chat_tool("send_email", approval={"expires_in": -5})], "tools[0].function.approval.expires_in"),
    ([_chat_tool("f", approval={"expires_in": 0})], "tools[0].function.approval.expires_in"),
    ([{**_WEATHER, "approval": {"approve": True}}], "tools[0].approval.approve"),
    ([{**_WEATHER, "approval": "required"}], "tools[0].approval"),
    ([{**_WEATHER, "approval": {"scopes": []}}], "tools[0].approval.scopes"),
    ([{**_chat_tool("f", approval={"required": True}), "approval": {"required": True}}],
     "tools[0].approval"),                                  # given twice
    ([{"type": "namespace", "name": "mail", "description": "d", "tools": [_SEND],
       "approval": {"required": True}}], "tools[0].approval"),   # nothing reads it there
    ([{"type": "web_search", "approval": {"required": True}}], "tools[0].approval"),
])
def test_check_hints_names_the_bad_field(tools, param):
    with pytest.raises(ApprovalInputError) as info:
        check_hints({"model": "m", "tools": tools}, HINT_POLICY)
    assert info.value.status == 400 and info.value.param == param
    assert param in str(info.value)


def test_check_hints_accepts_valid_and_absent_hints():
    class Recording:
        """The operator's policy, recording which hints it was asked to combine."""
        def __init__(self):
            self.asked = []

        def effective(self, identity, hint, *, hint_param):
            self.asked.append((identity.name, hint_param))
            return HINT_POLICY.effective(identity, hint, hint_param=hint_param)

    judge = Recording()
    check_hints({"model": "m"}, judge)
    assert judge.asked == []
    check_hints({"model": "m", "tools": [
        {**_SEND, "approval": {"scopes": ["once"], "expires_in": 30, "bind_arguments": True}},
        {**_WEATHER, "approval": None},
        {"type": "namespace", "name": "crm", "description": "d",
         "tools": [{**_WEATHER, "approval": {"required": True}}]},
        _chat_tool("lookup", approval={"required": False}),
        {"type": "web_search"},
    ]}, judge)
    # every hint given is combined with the operator's rule, where it sits; a null hint is none
    assert judge.asked == [("send_email", "tools[0].approval"), ("get_weather", "tools[2].tools[0].approval"),
                           ("lookup", "tools[3].function.approval")]


def _app(reached):
    """A stand-in for vLLM's app (a Starlette router with its two tool routes): a request that
    reaches it is recorded in ``reached``."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def endpoint(request):
        reached.append(request.url.path)
        return JSONResponse({})

    return Starlette(routes=[Route(path, endpoint, methods=["POST"])
                             for path in ("/v1/chat/completions", "/v1/responses")])


def _through_middleware(tmp_path, monkeypatch, path, body):
    """Send one POST through AllowedToolsMiddleware, approvals on with HINT_POLICY (no vLLM: the
    app is a stand-in). Returns (status, JSON payload, whether the request reached the app)."""
    from vllm_allowed_tools.vllm_glue.middleware import AllowedToolsMiddleware

    policy_file = tmp_path / "approvals.json"
    policy_file.write_text(json.dumps(HINT_POLICY_DOC))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY", str(policy_file))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_GRANT_STORE", str(tmp_path / "grants.db"))
    reached = []
    middleware = AllowedToolsMiddleware(_app(reached))
    sent = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "asgi": {"spec_version": "2.3"}}
    asyncio.run(middleware(scope, receive, send))
    status = sent[0]["status"]
    payload = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return status, payload, bool(reached)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"model": "m", "input": "hi", "tools": [
        _WEATHER, {**_SEND, "approval": {"scopes": ["session"]}}]}, "tools[1].approval.scopes"),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True, "tools": [
        {"type": "namespace", "name": "mail", "description": "d",
         "tools": [{**_SEND, "approval": {"required": 1}}]}]},
     "tools[0].tools[0].approval.required"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [_chat_tool("send_email", approval={"bind": True})]},
     "tools[0].function.approval.bind"),
])
def test_a_bad_hint_is_a_400_before_the_request_reaches_vllm(tmp_path, monkeypatch, path, body,
                                                             param):
    status, payload, reached_vllm = _through_middleware(tmp_path, monkeypatch, path, body)
    assert status == 400 and not reached_vllm
    assert payload["error"]["param"] == param and payload["error"]["code"] == "invalid_approval_hint"


def test_a_valid_hint_reaches_vllm(tmp_path, monkeypatch):
    body = {"model": "m", "input": "hi", "tools": [{**_SEND, "approval": {"scopes": ["once"]}}]}
    _, _, reached_vllm = _through_middleware(tmp_path, monkeypatch, "/v1/responses", body)
    assert reached_vllm


# ------------------------------------------------- grant store: private files, keyed principals


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_sqlite_store_files_are_created_owner_only(tmp_path):
    db = tmp_path / "grants.db"
    old = os.umask(0o022)   # the usual umask: files would come out 0644
    try:
        store = SQLiteGrantStore(db)
        engine = open_engine(HINT_POLICY, store)
        engine.propose(ProposedCall(call_id="c1", identity=ToolIdentity(None, "send_email"),
                                    arguments="{}", definition_digest="sha256:" + "0" * 64),
                       principal="alice", session="s1")   # a write: -wal and -shm exist now
        for path in (db, f"{db}-wal", f"{db}-shm"):
            assert _mode(path) == 0o600, path
        store.close()
    finally:
        os.umask(old)


def test_an_existing_store_keeps_its_mode_and_a_readable_one_is_reported(tmp_path, caplog):
    db = tmp_path / "grants.db"
    SQLiteGrantStore(db).close()
    os.chmod(db, 0o640)
    with caplog.at_level("WARNING", logger="vllm_allowed_tools.approvals.store"):
        SQLiteGrantStore(db).close()
    assert _mode(db) == 0o640
    assert "chmod 600" in caplog.text and str(db) in caplog.text


def _bearer(token):
    return [(b"authorization", b"Bearer " + token.encode())]


def test_principal_is_an_hmac_under_the_store_secret(tmp_path):
    one, same = SQLiteGrantStore(tmp_path / "a.db"), SQLiteGrantStore(tmp_path / "a.db")
    other = SQLiteGrantStore(tmp_path / "b.db")
    secret = one.principal_secret
    assert isinstance(secret, bytes) and len(secret) == 32
    assert same.principal_secret == secret != other.principal_secret   # per store, shared by all
    principal = principal_from_headers(_bearer("sk-1234"), secret)
    expected = hmac.new(secret, b"sk-1234", hashlib.sha256).hexdigest()[:32]
    assert principal == "key:" + expected
    assert principal != "key:" + hashlib.sha256(b"sk-1234").hexdigest()[:24]   # the old format
    assert principal == principal_from_headers(_bearer("sk-1234"), same.principal_secret)
    assert principal != principal_from_headers(_bearer("sk-1234"), other.principal_secret)
    assert principal_from_headers([], secret) == "anonymous"
    with pytest.raises(ValueError, match="principal_secret"):
        principal_from_headers(_bearer("sk-1234"), b"")
    for store in (one, same, other):
        store.close()


def test_a_schema_1_store_gains_a_secret_when_opened(tmp_path):
    db = tmp_path / "grants.db"
    SQLiteGrantStore(db).close()
    with sqlite3.connect(db) as conn:   # as a version-1 store left it
        conn.execute("DROP TABLE store_secrets")
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    store = SQLiteGrantStore(db)
    assert len(store.principal_secret) == 32
    assert SQLiteGrantStore(db).principal_secret == store.principal_secret
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()
    store.close()


def test_postgres_store_shares_one_principal_secret():
    from support.postgres import PostgresUnavailable, ThrowawayPostgres

    dsn = os.environ.get("VLLM_ALLOWED_TOOLS_TEST_POSTGRES")
    pg = None
    if not dsn:
        try:
            pg = ThrowawayPostgres.start()
        except PostgresUnavailable as exc:
            pytest.skip(f"PostgreSQL principal secret not tested: {exc}")
        dsn = pg.dsn
    try:
        first, second = PostgresGrantStore(dsn), PostgresGrantStore(dsn)   # two API servers
        assert len(first.principal_secret) == 32
        assert first.principal_secret == second.principal_secret
        assert principal_from_headers(_bearer("k"), first.principal_secret) == \
            principal_from_headers(_bearer("k"), second.principal_secret)
        first.close()
        second.close()
    finally:
        if pg is not None:
            pg.close()

"""Unit tests of the application-side dispatch guard (vllm_allowed_tools.dispatch).

Every refusal path (malformed call, unknown or disallowed name, no handler, bad JSON, schema
violation, authorization denied, missing grant, idempotency conflict / in progress), the success
path in both APIs' shapes, idempotent replays, and a property test: arbitrary argument strings give
a result or a typed error, never anything else.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.dispatch import (
    AuthorizationDeniedError,
    CallInProgressError,
    CallRefusedError,
    Dispatcher,
    DispatchError,
    DispatchResult,
    GrantChecker,
    GrantRequiredError,
    IdempotencyConflictError,
    InMemoryGrantChecker,
    InMemoryIdempotencyStore,
    InvalidArgumentsError,
    MalformedCallError,
    SchemaViolationError,
    StoredOutcome,
    ToolCall,
    ToolFailedError,
    ToolFailure,
    ToolNotAllowedError,
    ToolUnavailableError,
    TurnContext,
    UnknownToolError,
    allow_all,
    deny,
)
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import ToolIdentity

CATALOG = ["get_weather", "read_file", "send_email", "list_user", "delete_photo"]


def responses_body(allowed, mode="auto", catalog=CATALOG, extra_tools=()):
    return {"model": "tiny", "input": "hi",
            "tools": [POOL_BY_NAME[n].responses_tool() for n in catalog] + list(extra_tools),
            "tool_choice": {"type": "allowed_tools", "mode": mode,
                            "tools": [{"type": "function", "name": n} for n in allowed]}}


def chat_body(allowed, mode="auto", catalog=CATALOG):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "tools": [POOL_BY_NAME[n].chat_tool() for n in catalog],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in allowed]}}}


def turn(body=None, api="responses", tenant="acme", session="s1", subject="alice"):
    body = responses_body(["get_weather", "read_file", "send_email"]) if body is None else body
    return TurnContext.from_request(body, api, tenant=tenant, session=session, subject=subject)


def rcall(name="read_file", arguments='{"path": "readme"}', call_id="call_1", namespace=None):
    item = {"type": "function_call", "name": name, "arguments": arguments, "call_id": call_id}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def ccall(name="read_file", arguments='{"path": "readme"}', call_id="chatcmpl-tool-1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class Recorder:
    """Handlers that record every run."""

    def __init__(self):
        self.runs = []
        self.lock = threading.Lock()

    def handler(self, name):
        def run(arguments, invocation):
            with self.lock:
                self.runs.append((name, arguments, invocation.subject, invocation.session))
            return {"tool": name, "echo": arguments}
        return run

    def all(self, names=CATALOG):
        return {name: self.handler(name) for name in names}


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def dispatcher(rec):
    return Dispatcher(rec.all(), authorize=allow_all)


# ------------------------------------------------------------------------------------ success


def test_success_responses_item(dispatcher, rec):
    result = dispatcher.dispatch(rcall(), turn())
    assert isinstance(result, DispatchResult) and result.ok
    assert result.name == "read_file" and result.tool == ToolIdentity(None, "read_file")
    assert result.arguments == {"path": "readme"} and result.call_id == "call_1"
    assert result.output == {"tool": "read_file", "echo": {"path": "readme"}}
    assert not result.replayed and result.idempotency_key == "call_1"
    assert rec.runs == [("read_file", {"path": "readme"}, "alice", "s1")]
    assert result.to_responses_item() == {"type": "function_call_output", "call_id": "call_1",
                                          "output": json.dumps(result.output)}


def test_success_chat_entry(dispatcher, rec):
    t = turn(chat_body(["read_file"]), api="chat")
    result = dispatcher.dispatch(ccall(), t)
    assert result.ok and result.call_id == "chatcmpl-tool-1"
    assert result.to_chat_message() == {"role": "tool", "tool_call_id": "chatcmpl-tool-1",
                                        "content": result.to_tool_output()}
    assert len(rec.runs) == 1


def test_success_with_openai_sdk_objects(dispatcher):
    from openai.types.chat import ChatCompletionMessageToolCall
    from openai.types.responses import ResponseFunctionToolCall

    item = ResponseFunctionToolCall(type="function_call", name="read_file", call_id="call_sdk",
                                    arguments='{"path": "notes"}')
    assert dispatcher.dispatch(item, turn()).arguments == {"path": "notes"}
    entry = ChatCompletionMessageToolCall(id="tc_sdk", type="function",
                                          function={"name": "read_file", "arguments": '{"path": "main"}'})
    result = dispatcher.dispatch(entry, turn(chat_body(["read_file"]), api="chat"))
    assert result.call_id == "tc_sdk" and result.arguments == {"path": "main"}


def test_string_output_is_sent_as_is():
    d = Dispatcher({"read_file": lambda args, inv: "file contents"}, authorize=allow_all)
    assert d.dispatch(rcall(), turn()).to_tool_output() == "file contents"


def test_namespaced_call_uses_exact_identity(rec):
    crm = {"type": "namespace", "name": "crm", "description": "CRM.",
           "tools": [POOL_BY_NAME["list_user"].responses_tool()]}
    body = responses_body(["read_file", "crm__list_user"], catalog=["read_file"], extra_tools=[crm])
    handlers = {ToolIdentity("crm", "list_user"): rec.handler("crm.list_user"),
                "read_file": rec.handler("read_file")}
    d = Dispatcher(handlers, authorize=allow_all)
    t = turn(body)
    result = d.dispatch(rcall("list_user", '{"user": "bob"}', namespace="crm"), t)
    assert result.tool == ToolIdentity("crm", "list_user") and result.name == "crm__list_user"
    # the flat name the model emits resolves to the same identity
    assert d.dispatch(rcall("crm__list_user", '{"user": "bob"}', call_id="c2"), t).tool == \
        ToolIdentity("crm", "list_user")
    # a bare name without its namespace is not that tool, and a wrong namespace is unknown
    with pytest.raises(UnknownToolError):
        d.dispatch(rcall("list_user", '{"user": "bob"}', call_id="c3"), t)
    with pytest.raises(UnknownToolError):
        d.dispatch(rcall("read_file", '{"path": "readme"}', call_id="c4", namespace="crm"), t)


def test_plain_auto_allows_the_catalog_and_named_allows_one(dispatcher):
    body = {"tools": [POOL_BY_NAME[n].responses_tool() for n in CATALOG]}
    assert dispatcher.dispatch(rcall("list_user", '{"user": "bob"}'), turn(body)).ok
    named = {**body, "tool_choice": {"type": "function", "name": "read_file"}}
    assert dispatcher.dispatch(rcall(call_id="n1"), turn(named)).ok
    with pytest.raises(ToolNotAllowedError):
        dispatcher.dispatch(rcall("list_user", '{"user": "bob"}', call_id="n2"), turn(named))


# ------------------------------------------------------------------------------- name refusals


def test_unknown_name_is_refused(dispatcher, rec):
    error = dispatcher.try_dispatch(rcall("drop_database", "{}"), turn())
    assert isinstance(error, UnknownToolError) and isinstance(error, CallRefusedError)
    assert error.code == "unknown_tool" and not error.ok and not error.executed
    assert "get_weather" in error.message and "Nothing was run" in error.message
    body = json.loads(error.to_tool_output())
    assert body["error"]["code"] == "unknown_tool" and body["error"]["tool"] == "drop_database"
    assert error.to_responses_item()["call_id"] == "call_1"
    assert rec.runs == []


def test_disallowed_name_is_refused(dispatcher, rec):
    t = turn(responses_body(["get_weather"]))
    with pytest.raises(ToolNotAllowedError) as info:
        dispatcher.dispatch(rcall("list_user", '{"user": "bob"}'), t)
    assert info.value.code == "tool_not_allowed"
    assert info.value.details["allowed"] == ["get_weather"]
    assert "not allowed in this turn" in info.value.message
    assert rec.runs == []


def test_same_call_allowed_in_one_turn_refused_in_the_next(dispatcher):
    call = rcall("send_email", '{"path": "notes", "unit": "c"}', call_id="e1")
    with pytest.raises(ToolNotAllowedError):
        dispatcher.dispatch(call, turn(responses_body(["read_file"])))
    assert dispatcher.dispatch(call, turn(responses_body(["send_email"]))).ok


@pytest.mark.parametrize("body", [{"tool_choice": "none",
                                   "tools": [POOL_BY_NAME["read_file"].responses_tool()]},
                                  {"input": "no tools at all"}], ids=["choice-none", "no-tools"])
def test_nothing_allowed(dispatcher, body):
    error = dispatcher.try_dispatch(rcall(), turn(body))
    assert isinstance(error, (ToolNotAllowedError, UnknownToolError))
    assert "No tool may be called this turn" in error.message


def test_no_handler_is_refused(rec):
    d = Dispatcher({"read_file": rec.handler("read_file")}, authorize=allow_all)
    error = d.try_dispatch(rcall("get_weather", '{"day": "monday", "path": "main"}'), turn())
    assert isinstance(error, ToolUnavailableError) and error.code == "tool_unavailable"


@pytest.mark.parametrize("call", [
    "not a call", 42, None,
    {"type": "function_call", "arguments": "{}", "call_id": "c"},
    {"type": "function_call", "name": "", "arguments": "{}", "call_id": "c"},
    {"type": "function_call", "name": "read_file", "namespace": 3, "arguments": "{}"},
    {"type": "custom_tool_call", "name": "read_file", "input": "x", "call_id": "c"},
    {"id": "c", "type": "function", "function": "read_file"},
    {"id": "c", "type": "function", "function": {"arguments": "{}"}},
], ids=["str", "int", "none", "no-name", "empty-name", "bad-namespace", "custom", "chat-fn-str",
        "chat-no-name"])
def test_malformed_calls_are_refused(dispatcher, call, rec):
    error = dispatcher.try_dispatch(call, turn())
    assert isinstance(error, MalformedCallError) and error.code == "malformed_call"
    json.loads(error.to_tool_output())
    assert rec.runs == []


# -------------------------------------------------------------------------- argument refusals


@pytest.mark.parametrize("arguments, fragment", [
    ('{"path": "readme"', "not valid JSON"),
    ("", "not valid JSON"),
    ("readme", "not valid JSON"),
    ('["readme"]', "must be a JSON object, got an array"),
    ('"readme"', "must be a JSON object, got a string"),
    ("null", "must be a JSON object, got null"),
    ("3", "must be a JSON object, got a number"),
    ('{"path": "readme", "path": "notes"}', "duplicate key 'path'"),
    ('{"path": NaN}', "NaN is not valid JSON"),
    ('{"path": Infinity}', "Infinity is not valid JSON"),
    ('{"path": "\\ud800"}', "unpaired surrogate"),
    (None, "arguments are missing"),
    (17, "must be a JSON string"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
], ids=["truncated", "empty", "bare-word", "array", "string", "null", "number", "duplicate-key",
        "nan", "infinity", "surrogate", "missing", "not-a-string", "deep"])
def test_bad_json_is_refused(dispatcher, rec, arguments, fragment):
    error = dispatcher.try_dispatch(rcall(arguments=arguments), turn())
    assert isinstance(error, InvalidArgumentsError), error
    assert error.code == "invalid_arguments" and error.retryable
    assert fragment in error.message
    assert rec.runs == []


def test_oversized_arguments_are_refused_unparsed(rec):
    d = Dispatcher(rec.all(), authorize=allow_all, max_argument_chars=50)
    error = d.try_dispatch(rcall(arguments=json.dumps({"path": "x" * 100})), turn())
    assert isinstance(error, InvalidArgumentsError) and "over the limit of 50" in error.message


def test_already_decoded_arguments_are_accepted(dispatcher):
    assert dispatcher.dispatch(rcall(arguments={"path": "todo"}), turn()).arguments == {"path": "todo"}


@pytest.mark.parametrize("arguments, path, fragment", [
    ('{"path": "etc_passwd"}', "$.path", "is not one of"),
    ("{}", "$", "'path' is a required property"),
    ('{"path": "readme", "mode": "w"}', "$", "Additional properties are not allowed"),
    ('{"path": 7}', "$.path", "is not of type 'string'"),
], ids=["enum", "required", "additional", "type"])
def test_schema_violation_is_refused(dispatcher, rec, arguments, path, fragment):
    error = dispatcher.try_dispatch(rcall(arguments=arguments), turn())
    assert isinstance(error, SchemaViolationError) and error.code == "schema_violation"
    assert error.retryable
    assert any(e["path"] == path and fragment in e["message"] for e in error.details["errors"]), \
        error.details
    assert fragment in error.message and "Fix them" in error.message
    assert json.loads(error.to_tool_output())["error"]["errors"] == error.details["errors"]
    assert rec.runs == []


def test_invalid_tool_schema_fails_closed(rec):
    broken = {"type": "function", "name": "read_file", "description": "Read.",
              "parameters": {"type": "object", "properties": {"path": {"type": 5}}}}
    body = {"tools": [broken], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                               "tools": [{"type": "function", "name": "read_file"}]}}
    d = Dispatcher(rec.all(), authorize=allow_all)
    error = d.try_dispatch(rcall(), turn(body))
    assert isinstance(error, ToolUnavailableError) and "schema is invalid" in error.message
    assert rec.runs == []


# ------------------------------------------------------------------------------ authorization


def test_authorization_hook_sees_caller_and_arguments(rec):
    seen = []

    def authorize(invocation):
        seen.append((invocation.tenant, invocation.session, invocation.subject, invocation.name,
                     invocation.arguments))
        # alice may read any file except "notes"
        return invocation.subject == "alice" and invocation.arguments.get("path") != "notes"

    d = Dispatcher(rec.all(), authorize=authorize)
    assert d.dispatch(rcall(), turn()).ok
    assert seen == [("acme", "s1", "alice", "read_file", {"path": "readme"})]
    with pytest.raises(AuthorizationDeniedError) as info:
        d.dispatch(rcall(call_id="c2"), turn(subject="mallory"))
    assert info.value.code == "authorization_denied" and not info.value.retryable
    with pytest.raises(AuthorizationDeniedError):
        d.dispatch(rcall(arguments='{"path": "notes"}', call_id="c3"), turn())
    assert len(rec.runs) == 1


def test_authorization_denial_reason_reaches_the_model(rec):
    d = Dispatcher(rec.all(), authorize=lambda inv: deny("read_file is read-only for guests"))
    error = d.try_dispatch(rcall(), turn())
    assert isinstance(error, AuthorizationDeniedError)
    assert json.loads(error.to_tool_output())["error"]["reason"] == "read_file is read-only for guests"


@pytest.mark.parametrize("hook", [lambda inv: None, lambda inv: 1, lambda inv: "yes",
                                  lambda inv: 1 / 0], ids=["none", "truthy-int", "truthy-str", "raises"])
def test_authorization_fails_closed(rec, hook):
    d = Dispatcher(rec.all(), authorize=hook)
    assert isinstance(d.try_dispatch(rcall(), turn()), AuthorizationDeniedError)
    assert rec.runs == []


def test_authorizer_is_required(rec):
    with pytest.raises(TypeError):
        Dispatcher(rec.all())  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Dispatcher(rec.all(), authorize=None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- grants


EMAIL = rcall("send_email", '{"path": "notes", "unit": "c"}', call_id="mail_1")


def test_gated_tool_without_grant_checker_is_refused(rec):
    d = Dispatcher(rec.all(), authorize=allow_all, gated=["send_email"])
    error = d.try_dispatch(EMAIL, turn())
    assert isinstance(error, GrantRequiredError) and error.code == "grant_required"
    assert "approval" in error.message
    assert d.dispatch(rcall(), turn()).ok  # ungated tools are unaffected
    assert [r[0] for r in rec.runs] == ["read_file"]


def test_gated_tool_needs_a_live_bound_grant(rec):
    now = [1000.0]
    grants = InMemoryGrantChecker(clock=lambda: now[0])
    assert isinstance(grants, GrantChecker)
    d = Dispatcher(rec.all(), authorize=allow_all, gated=[ToolIdentity(None, "send_email")],
                   grants=grants)
    t = turn()
    assert isinstance(d.try_dispatch(EMAIL, t), GrantRequiredError)
    # grants for another subject, session, tool or arguments do not count
    grants.grant("bob", "s1", "send_email")
    grants.grant("alice", "s2", "send_email")
    grants.grant("alice", "s1", "read_file")
    grants.grant("alice", "s1", "send_email", arguments={"path": "todo", "unit": "c"})
    assert isinstance(d.try_dispatch(EMAIL, t), GrantRequiredError)
    # an expired grant does not count
    grants.grant("alice", "s1", "send_email", arguments={"path": "notes", "unit": "c"}, ttl_s=10)
    now[0] += 11
    assert isinstance(d.try_dispatch(EMAIL, t), GrantRequiredError)
    # a live grant for exactly these arguments does, until it is revoked
    grant_id = grants.grant("alice", "s1", "send_email", arguments={"unit": "c", "path": "notes"})
    assert d.dispatch(EMAIL, t).ok
    assert grants.revoke(grant_id) and not grants.revoke(grant_id)
    assert isinstance(d.try_dispatch(rcall("send_email", '{"path": "notes", "unit": "c"}',
                                           call_id="mail_2"), t), GrantRequiredError)
    assert [r[0] for r in rec.runs] == ["send_email"]


def test_broken_grant_checker_fails_closed(rec):
    class Broken:
        def has_live_grant(self, subject, session, tool_identity, arguments):
            raise RuntimeError("db down")

    d = Dispatcher(rec.all(), authorize=allow_all, gated=["send_email"], grants=Broken())
    assert isinstance(d.try_dispatch(EMAIL, turn()), GrantRequiredError)
    assert rec.runs == []


# ---------------------------------------------------------------------------------- idempotency


def test_replayed_key_returns_stored_result_without_running_again(dispatcher, rec):
    t = turn()
    first = dispatcher.dispatch(rcall(), t)
    again = dispatcher.dispatch(rcall(), t)
    assert again.replayed and not first.replayed
    assert again.output == first.output and again.to_tool_output() == first.to_tool_output()
    assert len(rec.runs) == 1
    # JSON key order and whitespace do not make a different call
    assert dispatcher.dispatch(rcall(arguments='{ "path":"readme" }'), t).replayed
    assert len(rec.runs) == 1


def test_replayed_key_with_different_arguments_is_a_conflict(dispatcher, rec):
    t = turn()
    dispatcher.dispatch(rcall(), t)
    error = dispatcher.try_dispatch(rcall(arguments='{"path": "notes"}'), t)
    assert isinstance(error, IdempotencyConflictError) and error.code == "idempotency_conflict"
    assert error.details["idempotency_key"] == "call_1"
    error = dispatcher.try_dispatch(rcall("get_weather", '{"day": "monday", "path": "main"}'), t)
    assert isinstance(error, IdempotencyConflictError)
    assert len(rec.runs) == 1


def test_keys_are_scoped_by_tenant_and_session(dispatcher, rec):
    dispatcher.dispatch(rcall(), turn())
    assert not dispatcher.dispatch(rcall(), turn(session="s2")).replayed
    assert not dispatcher.dispatch(rcall(), turn(tenant="globex")).replayed
    assert dispatcher.dispatch(rcall(), turn(subject="bob")).replayed  # same tenant and session
    assert len(rec.runs) == 3


def test_explicit_idempotency_key_overrides_call_id(dispatcher, rec):
    t = turn()
    dispatcher.dispatch(rcall(call_id="a"), t, idempotency_key="order-42")
    replay = dispatcher.dispatch(rcall(call_id="b"), t, idempotency_key="order-42")
    assert replay.replayed and replay.call_id == "b"  # answers the call that was made
    assert len(rec.runs) == 1


def test_calls_without_any_key_are_not_deduplicated(dispatcher, rec):
    t = turn()
    dispatcher.dispatch(rcall(call_id=None), t)
    dispatcher.dispatch(rcall(call_id=None), t)
    assert len(rec.runs) == 2


def test_refusals_do_not_consume_the_key(dispatcher, rec):
    t = turn()
    assert isinstance(dispatcher.try_dispatch(rcall(arguments='{"path": 1}'), t), SchemaViolationError)
    assert not dispatcher.dispatch(rcall(), t).replayed
    assert len(rec.runs) == 1


def test_replay_still_checks_the_policy(dispatcher):
    dispatcher.dispatch(rcall(), turn())
    with pytest.raises(ToolNotAllowedError):
        dispatcher.dispatch(rcall(), turn(responses_body(["get_weather"])))


def test_failed_handler_outcome_is_stored(rec):
    runs = []

    def flaky(arguments, invocation):
        runs.append(1)
        raise ToolFailure("the disk is full", details={"retry_after_s": 30})

    d = Dispatcher({"read_file": flaky}, authorize=allow_all)
    t = turn()
    error = d.try_dispatch(rcall(), t)
    assert isinstance(error, ToolFailedError) and error.executed and error.code == "tool_failed"
    assert "the disk is full" in error.message and error.details == {"retry_after_s": 30}
    again = d.try_dispatch(rcall(), t)
    assert isinstance(again, ToolFailedError) and again.replayed and again.details["replayed"]
    assert runs == [1]


def test_unexpected_handler_exception_is_not_leaked(rec):
    def broken(arguments, invocation):
        raise KeyError("SECRET-connection-string")

    d = Dispatcher({"read_file": broken}, authorize=allow_all)
    error = d.try_dispatch(rcall(), turn())
    assert isinstance(error, ToolFailedError) and "internal error" in error.message
    assert "SECRET" not in error.to_tool_output()
    assert isinstance(error.__cause__, KeyError)


def test_base_exception_releases_the_key():
    calls = []

    def interrupted(arguments, invocation):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return "ok"

    d = Dispatcher({"read_file": interrupted}, authorize=allow_all)
    t = turn()
    with pytest.raises(KeyboardInterrupt):
        d.dispatch(rcall(), t)
    assert d.dispatch(rcall(), t).output == "ok" and len(calls) == 2


def test_concurrent_duplicates_run_the_handler_once():
    started, release = threading.Event(), threading.Event()
    runs = []

    def slow(arguments, invocation):
        runs.append(1)
        started.set()
        release.wait(5)
        return "done"

    d = Dispatcher({"read_file": slow}, authorize=allow_all)
    t = turn()
    outcomes = []
    first = threading.Thread(target=lambda: outcomes.append(d.try_dispatch(rcall(), t)))
    first.start()
    assert started.wait(5)
    in_flight = d.try_dispatch(rcall(), t)
    assert isinstance(in_flight, CallInProgressError) and in_flight.code == "call_in_progress"
    release.set()
    first.join(5)
    threads = [threading.Thread(target=lambda: outcomes.append(d.try_dispatch(rcall(), t)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert runs == [1]
    assert all(isinstance(o, DispatchResult) and o.output == "done" for o in outcomes)
    assert sum(not o.replayed for o in outcomes) == 1


def test_in_memory_store_ttl_and_bound():
    now = [0.0]
    store = InMemoryIdempotencyStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    scope = ("t", "s")
    for key in ("a", "b", "c"):
        assert store.reserve(scope, key, "fp").state == "new"
        store.complete(scope, key, StoredOutcome("fp", error=ToolFailedError("x")))
    assert len(store) == 2 and store.reserve(scope, "a", "fp").state == "new"  # "a" was evicted
    assert store.reserve(scope, "a", "fp").state == "running"
    assert store.reserve(scope, "a", "other").state == "conflict"
    store.release(scope, "a")
    assert store.reserve(scope, "c", "fp").state == "done"
    now[0] = 11
    assert store.reserve(scope, "c", "fp").state == "new"  # expired


def test_pluggable_store_is_used(rec):
    class Spy(InMemoryIdempotencyStore):
        def __init__(self):
            super().__init__()
            self.reserved = []

        def reserve(self, scope, key, fingerprint):
            self.reserved.append((scope, key))
            return super().reserve(scope, key, fingerprint)

    spy = Spy()
    d = Dispatcher(rec.all(), authorize=allow_all, idempotency_store=spy)
    d.dispatch(rcall(), turn())
    assert spy.reserved == [(("acme", "s1"), "call_1")]


# ------------------------------------------------------------------------------------ context


@pytest.mark.parametrize("field", ["tenant", "session", "subject"])
def test_turn_context_must_be_bound(field):
    kwargs = {"tenant": "acme", "session": "s1", "subject": "alice", field: ""}
    with pytest.raises(ValueError, match=field):
        TurnContext.from_request(responses_body(["read_file"]), "responses", **kwargs)


def test_turn_context_reports_allowed_names():
    t = turn(responses_body(["send_email", "get_weather"]))
    assert t.allowed_names() == ["get_weather", "send_email"]
    assert t.scope == ("acme", "s1")


def test_tool_call_normalizes_both_shapes():
    r = ToolCall.from_any(rcall("list_user", "{}", "c1", namespace="crm"))
    assert (r.name, r.namespace, r.flat_name, r.call_id, r.source) == \
        ("list_user", "crm", "crm__list_user", "c1", "responses")
    c = ToolCall.from_any(ccall("crm__list_user", "{}", "c2"))
    assert (c.name, c.namespace, c.flat_name, c.call_id, c.source) == \
        ("crm__list_user", None, "crm__list_user", "c2", "chat")


def test_every_error_renders_for_the_model():
    for cls in (UnknownToolError, ToolNotAllowedError, ToolUnavailableError, InvalidArgumentsError,
                SchemaViolationError, AuthorizationDeniedError, GrantRequiredError,
                IdempotencyConflictError, CallInProgressError, ToolFailedError):
        error = cls("message", call_id="c", tool="t")
        body = json.loads(error.to_tool_output())["error"]
        assert body["code"] == cls.code and body["message"] == "message" and body["tool"] == "t"
        assert error.to_chat_message()["tool_call_id"] == "c"
        assert isinstance(error, DispatchError)
    codes = [cls.code for cls in (UnknownToolError, ToolNotAllowedError, ToolUnavailableError,
                                  InvalidArgumentsError, SchemaViolationError,
                                  AuthorizationDeniedError, GrantRequiredError,
                                  IdempotencyConflictError, CallInProgressError, ToolFailedError,
                                  MalformedCallError)]
    assert len(set(codes)) == len(codes)


def test_dispatch_is_cheap():
    d = Dispatcher({"read_file": lambda a, i: "ok"}, authorize=allow_all)
    t = turn()
    start = time.perf_counter()
    for i in range(200):
        d.dispatch(rcall(call_id=f"c{i}"), t)
    assert (time.perf_counter() - start) / 200 < 0.01


# ----------------------------------------------------------------------------------- property


json_leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
             | st.text(max_size=8))
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
argument_strings = (
    st.text(max_size=200)
    | json_values.map(json.dumps)
    | st.fixed_dictionaries({}, optional={"path": json_values | st.sampled_from(["readme", "todo"]),
                                          "extra": json_values}).map(json.dumps)
    | st.builds(lambda s, cut: s[:cut], json_values.map(json.dumps), st.integers(0, 50))
    | st.sampled_from(['{"path": "readme"}', '{"path": "\\udfff"}', '{"a":1,"a":2}', "-Infinity",
                       "1" * 5000, "{" * 3000, '{"path": "readme"} trailing'])
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=argument_strings, name=st.sampled_from(CATALOG + ["nope", "crm__x"]),
       call_id=st.none() | st.sampled_from(["k1", "k2"]), chat=st.booleans())
def test_arbitrary_arguments_never_crash_the_dispatcher(arguments, name, call_id, chat):
    d = _PROPERTY_DISPATCHER
    call = ccall(name, arguments, call_id) if chat else rcall(name, arguments, call_id)
    outcome = d.try_dispatch(call, _PROPERTY_TURN)
    assert isinstance(outcome, (DispatchResult, DispatchError))
    text = outcome.to_tool_output()
    assert isinstance(text, str)
    if outcome.ok:  # only schema-valid arguments of an allowed tool ever reach a handler
        assert name in ("read_file", "get_weather")
        assert POOL_BY_NAME[name].arguments_valid(outcome.arguments)
    else:
        assert json.loads(text)["error"]["code"] == outcome.code


_PROPERTY_DISPATCHER = Dispatcher({n: (lambda a, i: {"ok": True}) for n in CATALOG},
                                  authorize=allow_all)
_PROPERTY_TURN = TurnContext.from_request(responses_body(["read_file", "get_weather"]), "responses",
                                          tenant="t", session="s", subject="u")

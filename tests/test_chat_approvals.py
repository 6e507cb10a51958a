"""Approvals on Chat Completions, decided before generation (no vLLM): a turn that can only call
gated tools without a grant is a 400 naming the field and the tool; in other turns those tools
leave the grammar's allowlist while the prompt stays the same; a live grant not bound to arguments
releases them; errors after generation never ask for a retry that cannot succeed."""

from __future__ import annotations

import json
import random

import pytest

from vllm_allowed_tools.approvals import ApprovalInputError, ApprovalPolicy, ToolCallApproval, \
    open_engine
from vllm_allowed_tools.approvals.chat import CODE_TOOL_NEEDS_APPROVAL, ChatApprovals, \
    decide_chat_turn
from vllm_allowed_tools.approvals.engine import ProposedCall
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import resolve_allowlist
from vllm_allowed_tools.request.rewrite import TEMPLATE_KWARG, narrow_allowlist, rewrite_request
from vllm_allowed_tools.response import AllowedNames, ChatStreamGuard, check_chat_completion
from vllm_allowed_tools.response.violations import AllowedToolsViolation
from vllm_allowed_tools.wire import ALLOWLIST_KEY

GATED, FREE, BOUND = "send_email", "get_weather", "delete_file"
POLICY = {"rules": [
    {"tools": [GATED], "approval": "required", "scopes": ["once", "session", "always"]},
    {"tools": [BOUND], "approval": "required", "scopes": ["once", "session"],
     "bind_arguments": True},
]}
TOOLS = [POOL_BY_NAME[GATED].chat_tool(), POOL_BY_NAME[FREE].chat_tool()]


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(POLICY), tmp_path / "grants.db")


def _body(tool_choice=None, tools=TOOLS, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Send it."}],
            "tools": tools, **fields}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return body


def _allowed_tools(mode, *names):
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def _decide(engine, body, principal="alice", session="s1"):
    return decide_chat_turn(engine, body, resolve_allowlist(body, "chat"), principal=principal,
                            session=session)


def _grant(engine, name, scope, principal="alice", session="s1"):
    """Mint a grant the way a client does on /v1/responses: elicitation, then an accept."""
    spec = resolve_allowlist(_body(tools=[POOL_BY_NAME[name].chat_tool()]), "chat").lookup(name)
    arguments = json.dumps(POOL_BY_NAME[name].random_arguments(random.Random(1)))
    [item] = engine.propose_all([ProposedCall.from_spec(spec, call_id="c1", arguments=arguments)],
                                principal=principal, session=session)
    assert isinstance(item, ToolCallApproval)
    engine.resolve_all([{"id": "er_1", "type": "elicitation_response", "elicitation_id": item.id,
                         "action": "accept", "scope": scope}], principal=principal, session=session, turn=False)


# ------------------------------------------------------------------- 400 before generation


@pytest.mark.parametrize(("tool_choice", "tools", "param"), [
    ({"type": "function", "function": {"name": GATED}}, TOOLS, "tool_choice.function.name"),
    ("required", [POOL_BY_NAME[GATED].chat_tool()], "tool_choice"),
    (_allowed_tools("required", GATED), TOOLS, "tool_choice.allowed_tools.tools"),
], ids=["named", "required", "allowed-tools-required"])
def test_a_turn_that_can_only_call_gated_tools_is_a_400_naming_the_field_and_tool(
        engine, tool_choice, tools, param):
    with pytest.raises(ApprovalInputError) as refused:
        _decide(engine, _body(tool_choice, tools))
    error = refused.value.to_openai()["error"]
    assert refused.value.status == 400 and error["code"] == CODE_TOOL_NEEDS_APPROVAL
    assert error["param"] == param
    assert GATED in error["message"] and "/v1/responses" in error["message"]
    assert "needs approval" in error["message"] and "retry" not in error["message"].lower()


def test_no_session_no_grant_and_another_callers_grant_do_not_count(engine):
    _grant(engine, GATED, "session", principal="bob", session="s1")
    _grant(engine, GATED, "session", principal="alice", session="other")
    named = _body({"type": "function", "function": {"name": GATED}})
    for session in ("s1", None):
        with pytest.raises(ApprovalInputError):
            _decide(engine, named, session=session)


# ------------------------------------------------------------------- auto: narrowed grammar


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", _allowed_tools("auto", GATED, FREE),
                                         _allowed_tools("required", GATED, FREE)])
def test_gated_tools_leave_the_grammar_and_the_prompt_stays_the_same(engine, tool_choice):
    body = _body(tool_choice)
    decision = _decide(engine, body)
    assert decision.blocked == {GATED}
    rewritten = rewrite_request(body, "chat")
    narrowed = narrow_allowlist(rewritten, decision.blocked)
    wire = narrowed.body[ALLOWLIST_KEY]
    assert wire["allowed"] == [FREE] and wire["catalog"] == sorted([GATED, FREE])
    assert wire["mode"] == (tool_choice if isinstance(tool_choice, str) else
                            tool_choice["allowed_tools"]["mode"] if tool_choice else "auto")
    # only the wire allowlist differs: tools, tool_choice and the template's policy block (what
    # the prompt is rendered from) are the client's
    before = {k: v for k, v in rewritten.body.items() if k != ALLOWLIST_KEY}
    after = {k: v for k, v in narrowed.body.items() if k != ALLOWLIST_KEY}
    assert after == before
    kwargs = narrowed.body.get("chat_template_kwargs", {}).get(TEMPLATE_KWARG)
    assert kwargs is None or kwargs["names"] == sorted([GATED, FREE])
    # the grammar's cache key follows the narrowed set
    if ALLOWLIST_KEY in rewritten.body:
        assert wire["allowlist_digest"] != rewritten.body[ALLOWLIST_KEY]["allowlist_digest"]


def test_an_auto_turn_with_only_gated_tools_admits_no_call(engine):
    body = _body(_allowed_tools("auto", GATED))
    decision = _decide(engine, body)
    wire = narrow_allowlist(rewrite_request(body, "chat"), decision.blocked).body[ALLOWLIST_KEY]
    assert wire["mode"] == "auto" and wire["allowed"] == []


def test_nothing_changes_without_a_gated_tool_or_for_tool_choice_none(engine):
    for body in (_body(tools=[POOL_BY_NAME[FREE].chat_tool()]), _body("none")):
        decision = _decide(engine, body)
        assert decision == ChatApprovals()
        rewritten = rewrite_request(body, "chat")
        assert narrow_allowlist(rewritten, decision.blocked) is rewritten


def test_a_tool_definitions_hint_gates_it_on_chat_too(engine):
    hinted = {**POOL_BY_NAME[FREE].chat_tool()}
    hinted["function"] = {**hinted["function"], "approval": {"required": True}}
    body = _body("auto", tools=[POOL_BY_NAME[GATED].chat_tool(), hinted])
    assert _decide(engine, body).blocked == {GATED, FREE}


# ------------------------------------------------------------------- grants


@pytest.mark.parametrize("scope", ["session", "always"])
def test_a_live_grant_releases_the_tool_on_chat(engine, scope):
    _grant(engine, GATED, scope)
    body = _body({"type": "function", "function": {"name": GATED}})
    decision = _decide(engine, body)
    assert decision.blocked == frozenset() and set(decision.granted) == {GATED}
    assert decision.call_filter(AllowedNames.from_request(body, "chat")).allows("function", GATED)
    if scope == "session":   # a session grant covers its own session only
        with pytest.raises(ApprovalInputError):
            _decide(engine, body, session="s2")


def test_a_revoked_grant_releases_nothing(engine):
    _grant(engine, GATED, "always")
    [grant] = engine.store.list_grants(subject="alice", now=engine.clock())
    engine.revoke(grant.id)
    assert _decide(engine, _body("auto")).blocked == {GATED}


def test_a_grant_bound_to_arguments_does_not_release_on_chat(engine):
    _grant(engine, BOUND, "session")
    body = _body("auto", tools=[*TOOLS, POOL_BY_NAME[BOUND].chat_tool()])
    assert _decide(engine, body).blocked == {GATED, BOUND}


# ------------------------------------------------------------------- after generation


def _completion(name):
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                             "function": {"name": name, "arguments": "{}"}}]}}]}


def test_the_guard_refuses_a_blocked_call_and_says_a_retry_cannot_release_it(engine):
    body = _body("auto")
    call_filter = _decide(engine, body).call_filter(AllowedNames.from_request(body, "chat"))
    check_chat_completion(_completion(FREE), call_filter)
    with pytest.raises(AllowedToolsViolation) as refused:
        check_chat_completion(_completion(GATED), call_filter)
    message = refused.value.to_openai()["error"]["message"]
    assert GATED in message and "needs approval" in message and "cannot release" in message
    assert "/v1/responses" in message
    guard = ChatStreamGuard(call_filter)
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": GATED, "arguments": "{"}}]}}]}
    [error] = guard.feed(chunk)
    assert guard.terminal and GATED not in error["error"]["message"]   # a stream never names it
    assert "needs approval" in error["error"]["message"]


def test_no_error_after_generation_tells_the_client_to_retry():
    from vllm_allowed_tools.response import violations
    from vllm_allowed_tools.response.violations import refusal, unreadable_violation
    texts = [violations.STREAM_MESSAGE, unreadable_violation("x").message,
             refusal(AllowedNames([FREE]), GATED, "function", "unary_guard",
                     public_name=True).message]
    for text in texts:
        assert "retry the request" not in text.lower()
        assert "again" in text   # each says what sending it again does


# ------------------------------------------------------------------- through the middleware


def _through_middleware(tmp_path, monkeypatch, body):
    """One POST /v1/chat/completions through the middleware with approvals on, the app a stand-in
    that records the body it was given. Returns (status, payload, the forwarded body or None)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from vllm_allowed_tools.vllm_glue.middleware import AllowedToolsMiddleware

    forwarded = []

    async def endpoint(request):
        forwarded.append(await request.json())
        return JSONResponse({"object": "chat.completion", "choices": []})

    policy_file = tmp_path / "approvals.json"
    policy_file.write_text(json.dumps(POLICY))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY", str(policy_file))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_GRANT_STORE", str(tmp_path / "grants.db"))
    middleware = AllowedToolsMiddleware(Starlette(routes=[
        Route("/v1/chat/completions", endpoint, methods=["POST"])]))
    from support.asgi import post_json
    status, payload = post_json(middleware, "/v1/chat/completions", body)
    return status, payload, (forwarded[0] if forwarded else None)


def test_the_middleware_refuses_a_forced_gated_call_before_the_engine(tmp_path, monkeypatch):
    status, payload, forwarded = _through_middleware(
        tmp_path, monkeypatch, _body({"type": "function", "function": {"name": GATED}}))
    assert status == 400 and forwarded is None
    assert payload["error"]["code"] == CODE_TOOL_NEEDS_APPROVAL


def test_the_middleware_hands_vllm_the_narrowed_allowlist(tmp_path, monkeypatch):
    status, _, forwarded = _through_middleware(tmp_path, monkeypatch, _body("auto"))
    assert status == 200
    from vllm_allowed_tools.request.placement import canonical_tools
    assert forwarded["tools"] == canonical_tools(TOOLS, "chat") and forwarded["tool_choice"] == "auto"
    assert forwarded[ALLOWLIST_KEY]["allowed"] == [FREE]
    assert TEMPLATE_KWARG not in (forwarded.get("chat_template_kwargs") or {})


def test_the_turn_the_approvals_prepare_names_its_parts(engine):
    """prepare_turn, which the middleware runs off the loop: a Chat turn is decided (its gated
    tools out of the wire allowlist, the decision kept for the guard); a render request reaches
    no store and only loses its approval hints."""
    from vllm_allowed_tools.approvals.approval_turn import prepare_turn
    hinted = [{**TOOLS[0], "approval": {"required": True}}, TOOLS[1]]
    body = _body("auto", tools=hinted)
    rewritten = rewrite_request(body, "chat")
    turn = prepare_turn(engine, rewritten.request, rewritten, "chat", headers=[], render=False)
    assert turn.chat is not None and GATED in turn.chat.blocked
    assert turn.responses is None and turn.direct_output is None and turn.commit is None
    assert turn.rewritten.body[ALLOWLIST_KEY]["allowed"] == [FREE]
    assert all("approval" not in tool for tool in turn.rewritten.body["tools"])
    engine.store.find_grants = None   # a render never reads the store
    rendered = prepare_turn(engine, rewritten.request, rewritten, "chat", headers=[], render=True)
    assert (rendered.chat, rendered.responses, rendered.commit) == (None, None, None)
    assert rendered.rewritten.changed
    assert all("approval" not in tool for tool in rendered.rewritten.body["tools"])


def test_the_store_is_read_only_for_gated_tools_and_fails_closed(engine, monkeypatch):
    from vllm_allowed_tools.approvals import GrantStoreUnavailable

    def down(**_):
        raise GrantStoreUnavailable("unreachable", store="test")

    monkeypatch.setattr(engine.store, "find_grants", down)
    assert _decide(engine, _body("auto", tools=[POOL_BY_NAME[FREE].chat_tool()])) == ChatApprovals()
    with pytest.raises(GrantStoreUnavailable):
        _decide(engine, _body("auto"))

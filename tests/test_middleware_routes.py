"""The middleware on vLLM's real app (``build_app``: every route and middleware vLLM mounts, no
engine): each route has a decision, tool-bearing requests are refused off the guarded routes,
vLLM's 401 comes before any grant-store access, render endpoints never answer elicitations, stored
responses are not served, and loosely typed fields are read as vLLM reads them or refused."""

from __future__ import annotations

import json
import sys

import pytest
from starlette.testclient import TestClient

pytest.importorskip("vllm")

from vllm_allowed_tools.asgi.routes import decide  # noqa: E402
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME  # noqa: E402

MIDDLEWARE = "vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware"
KEY = "key-one"
GATED = "send_email"
TOOLS = [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME["get_weather"].responses_tool()]
CHAT_TOOLS = [POOL_BY_NAME[GATED].chat_tool(), POOL_BY_NAME["get_weather"].chat_tool()]


def _build(monkeypatch, tmp_path, *cli: str):
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    policy = tmp_path / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": [GATED], "approval": "required"}]}))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY", str(policy))
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_GRANT_STORE", str(tmp_path / "grants.db"))
    argv = [*cli, "--middleware", MIDDLEWARE]
    monkeypatch.setattr(sys, "argv", ["pytest", *argv])   # not a `serve` line: no capability probe
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = build_app(args, ("generate",))
    stack = app.build_middleware_stack()
    node = stack
    while type(node).__name__ != "AllowedToolsMiddleware":
        node = node.app
    return app, node


@pytest.fixture()
def served(monkeypatch, tmp_path):
    app, middleware = _build(monkeypatch, tmp_path, "--api-key", KEY)
    client = TestClient(app, raise_server_exceptions=False,
                        headers={"Authorization": f"Bearer {KEY}"})
    yield client, middleware


def test_every_mounted_route_has_a_decision_and_tool_routes_are_covered(served):
    from vllm_allowed_tools.asgi.routes import route_table
    _, middleware = served
    table = {(method, template): decision.decision
             for method, template, decision in route_table(middleware._router)}
    assert table[("POST", "/v1/chat/completions")] == "guarded"
    assert table[("POST", "/v1/responses")] == "guarded"
    assert table[("POST", "/v1/responses/render")] == "render"
    assert table[("GET", "/v1/responses/{response_id}")] == "stored"
    # every tool-producing route vLLM 0.32 mounts besides the two guarded ones refuses tools
    for path in ("/v1/messages", "/v1/messages/render", "/invocations",
                 "/v1/chat/completions/batch", "/inference/v1/generate"):
        assert table[("POST", path)] == "no_tools", path


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": GATED, "input_schema": {"type": "object"}}]}),
    ("/v1/messages/render", {"model": "m", "max_tokens": 5,
                             "messages": [{"role": "user", "content": "hi"}],
                             "tool_choice": {"type": "any"}}),
    ("/invocations", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "tools": CHAT_TOOLS}),
    ("/v1/chat/completions/batch", {"model": "m", "messages": [[{"role": "user", "content": "x"}]],
                                    "tools": CHAT_TOOLS}),
    ("/cohere/v2/chat", {"model": "m", "messages": [], "tools": CHAT_TOOLS}),
    ("/some/plugin/route", {"tools": CHAT_TOOLS}),
])
def test_tools_are_refused_on_unguarded_endpoints(served, path, body):
    client, _ = served
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unguarded_endpoint" and path in error["message"]


def test_unguarded_endpoints_without_tools_still_reach_vllm(served):
    client, _ = served
    # vLLM's own answer (no engine in this app: not our 400)
    answer = client.post("/v1/messages/count_tokens",
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "tools": [{"name": GATED, "input_schema": {"type": "object"}}]})
    assert "unguarded_endpoint" not in answer.text
    answer = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert "unguarded_endpoint" not in answer.text


@pytest.mark.parametrize("path", ["/v1/responses/resp_123", "/v1/responses/resp_123/cancel"])
def test_stored_responses_are_not_served(served, path):
    client, _ = served
    answer = client.request("POST" if path.endswith("cancel") else "GET", path)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "unguarded_endpoint"


def test_root_path_cannot_route_around_the_decisions(monkeypatch, tmp_path):
    app, _ = _build(monkeypatch, tmp_path, "--root-path", "/api")
    client = TestClient(app, raise_server_exceptions=False, root_path="/api")
    answer = client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [],
                                               "tools": [{"name": "x"}]})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "unguarded_endpoint"


def _store_calls(middleware, monkeypatch) -> list[str]:
    calls: list[str] = []
    store = middleware.approvals.store
    for name in ("get_elicitation", "consume", "add_elicitations", "find_grants", "ping",
                 "pending_in_batches"):
        original = getattr(store, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(store, name, spy)
    return calls


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic key-one"}])
def test_unauthenticated_answers_get_vllms_401_before_the_grant_store(served, monkeypatch,
                                                                      headers):
    client, middleware = served
    calls = _store_calls(middleware, monkeypatch)
    body = {"model": "m", "tools": TOOLS, "input": [
        {"type": "elicitation", "id": "elic_x", "elicitation_type": "tool_call_approval"},
        {"type": "elicitation_response", "id": "er_1", "elicitation_id": "elic_x",
         "action": "accept", "scope": "once"}]}
    answer = client.post("/v1/responses", json=body, headers={"Authorization": ""} | headers)
    assert answer.status_code == 401
    assert calls == [], "the grant store was read before authentication"


def test_render_endpoints_never_answer_elicitations(served, monkeypatch):
    client, middleware = served
    calls = _store_calls(middleware, monkeypatch)
    body = {"model": "m", "tools": TOOLS, "input": [
        {"type": "elicitation_response", "id": "er_1", "elicitation_id": "elic_x",
         "action": "accept", "scope": "once"}]}
    answer = client.post("/v1/responses/render", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input[0]"
    assert not {"consume", "add_elicitations"} & set(calls)


@pytest.mark.parametrize(("field", "value"), [
    ("parallel_tool_calls", [True]), ("parallel_tool_calls", "maybe"), ("stream", {"a": 1}),
    ("tools", {"a": 1}), ("tool_choice", 3), ("input", 5), ("prompt_cache_key", 7),
    ("conversation", {"id": 3}), ("background", "nope"),
])
def test_fields_the_plugin_cannot_read_are_a_400_naming_them(served, field, value):
    client, _ = served
    body = {"model": "m", "input": "hi", "tools": TOOLS, field: value}
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field or \
        answer.json()["error"]["param"].startswith(field)


def test_background_and_stored_history_are_refused_with_tools(served):
    client, _ = served
    for field, value in (("background", True), ("background", "true"),
                         ("previous_response_id", "resp_1")):
        answer = client.post("/v1/responses", json={"model": "m", "input": "hi", "tools": TOOLS,
                                                    field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field


def test_decisions_are_by_template_and_method():
    assert decide("/v1/chat/completions", "POST").decision == "guarded"
    assert decide("/v1/chat/completions", "GET").decision == "passthrough"
    assert decide(None, "POST").decision == "no_tools"
    assert decide("/v1/responses/{response_id}", "GET").decision == "stored"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", {"input": "hi", "tools": [{"type": "custom", "name": GATED,
                                                 "description": "free-form"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "custom", "custom": {"name": GATED}}]}),
])
def test_a_gated_top_level_custom_tool_is_served_for_approval(served, path, body):
    """Its calls are elicited like a function's on Responses, decided before generation like a
    function's on Chat: no 400 (this app has no engine, so what answers is vLLM's, never the
    approvals' refusal)."""
    client, _ = served
    answer = client.post(path, json={"model": "m", **body})
    assert "custom_tool_needs_approval" not in answer.text, answer.text


@pytest.mark.parametrize(("path", "tool", "param"), [
    ("/v1/responses", {"type": "namespace", "name": "mail", "description": "Mail.", "tools": [
        {"type": "custom", "name": GATED}]}, "tools[0].tools[0]"),
])
def test_a_gated_custom_tool_the_catalog_does_not_model_is_refused(served, path, tool, param):
    """A namespaced custom member (vLLM renders none): no call of its could be asked about, so it
    is refused before generation."""
    client, _ = served
    body = {"model": "m", "tools": [tool],
            **({"input": "hi"} if path == "/v1/responses" else
               {"messages": [{"role": "user", "content": "hi"}]})}
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "custom_tool_needs_approval"
    assert answer.json()["error"]["param"] == param

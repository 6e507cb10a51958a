"""Property: for every field the policy or the approvals read, a type-confused value either gets a
4xx from the plugin, is refused by vLLM itself, or leads to exactly the decision the well-typed
value (what vLLM's own pydantic models make of it) leads to. Checked against vLLM's request
models, so the plugin and vLLM can never disagree about a request that is served."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME  # noqa: E402
from vllm_allowed_tools.errors import AllowedToolsError  # noqa: E402
from vllm_allowed_tools.request.rewrite import rewrite_request  # noqa: E402
from vllm_allowed_tools.wire import ALLOWLIST_KEY  # noqa: E402

NAMES = ("send_email", "get_weather")
R_TOOLS = [POOL_BY_NAME[name].responses_tool() for name in NAMES]
C_TOOLS = [POOL_BY_NAME[name].chat_tool() for name in NAMES]

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.floats(allow_nan=False),
                     st.sampled_from(["true", "false", "yes", "no", "on", "off", "1", "0", "t",
                                      "f", "y", "n", "TRUE", "True", "", "auto", "none",
                                      "required", "maybe"]),
                     st.text(max_size=5))
confused = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["id", "type", "name", "a"]),
                                                  inner, max_size=3)), max_leaves=6)

CHOICES = {
    "responses": ["auto", "required", "none",
                  {"type": "function", "name": "send_email"},
                  {"type": "allowed_tools", "mode": "auto",
                   "tools": [{"type": "function", "name": "send_email"}]}],
    "chat": ["auto", "required", "none",
             {"type": "function", "function": {"name": "send_email"}},
             {"type": "allowed_tools", "allowed_tools": {
                 "mode": "required", "tools": [{"type": "function",
                                                "function": {"name": "get_weather"}}]}}],
}
FIELDS = {
    "responses": ["parallel_tool_calls", "stream", "background", "store", "tool_choice", "tools",
                  "input", "prompt_cache_key", "conversation", "previous_response_id"],
    "chat": ["parallel_tool_calls", "stream", "tool_choice", "tools", "messages"],
}


def _base(api: str, choice: Any) -> dict[str, Any]:
    if api == "responses":
        return {"model": "m", "input": "hi", "tools": R_TOOLS, "tool_choice": choice}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": C_TOOLS,
            "tool_choice": choice}


def _vllm_reads(api: str, body: dict[str, Any]) -> Any:
    """vLLM's validated request, or None when vLLM refuses it."""
    if api == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as Model
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    try:
        return Model.model_validate(body)
    except Exception:   # pydantic's, vLLM's own validation errors, or a crash: nothing is served
        return None


def _decision(rewritten) -> tuple:
    policy = rewritten.allowlist
    if policy is None:
        return (None,)
    return (policy.choice, policy.mode, policy.allowed, policy.parallel_tool_calls,
            policy.catalog_digest, rewritten.body.get(ALLOWLIST_KEY) is not None)


@settings(max_examples=300, deadline=None)
@given(api=st.sampled_from(["responses", "chat"]), data=st.data())
def test_type_confused_fields_are_refused_or_decided_as_vllm_reads_them(api, data):
    choice = data.draw(st.sampled_from(CHOICES[api]), label="choice")
    field = data.draw(st.sampled_from(FIELDS[api]), label="field")
    value = data.draw(confused, label="value")
    body = {**_base(api, choice), field: value}
    try:
        ours = rewrite_request(body, api)
    except AllowedToolsError as exc:
        assert 400 <= exc.status < 500
        return
    theirs = _vllm_reads(api, body)
    if theirs is None:
        return   # vLLM refuses it itself: nothing is served
    attribute = getattr(theirs, field, None) if field in type(theirs).model_fields else value
    if field in ("parallel_tool_calls", "stream", "background", "store"):
        # the value vLLM serves is the value vLLM receives from us, and the one we decided on
        assert ours.body.get(field) == attribute or (attribute is None and value is None) or \
            (field not in ours.body and value is None)
        well_typed = {**_base(api, choice), field: attribute}
        assert _decision(rewrite_request(well_typed, api)) == _decision(ours)
    if ours.allowlist is None:
        # never "not understood, so no policy" while the request carries tools vLLM will serve
        assert not (theirs.tools or [])

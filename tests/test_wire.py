"""The request→vLLM contract (vllm_allowed_tools/wire/): the one reading of ``tool_choice`` for both
APIs, the allowlist's wire shape and its version. The 400s' texts are pinned where the request path
raises them (tests/test_policy.py, tests/test_chat_custom_tools.py, tests/test_server_tools.py)."""
from __future__ import annotations

import pytest

from vllm_allowed_tools.errors import AllowedToolsError, InvalidSelectionError
from vllm_allowed_tools.wire import (
    ALLOWLIST_KEY,
    WIRE_VERSION,
    XARGS_GRAMMAR_KEYS,
    XARGS_KEYS,
    XARGS_MUST_CALL,
    XARGS_REFUSED_TOKENS,
    XARGS_TEXT_UTF8,
    WireAllowlist,
    no_function_wire,
    read_tool_choice,
    tool_choice_of,
    with_server_recipients,
)


@pytest.mark.parametrize("api, choice, name, param", [
    ("chat", {"type": "function", "function": {"name": "f"}}, "f", "tool_choice.function.name"),
    ("chat", {"type": "custom", "custom": {"name": "c"}}, "c", "tool_choice.custom.name"),
    ("chat", {"type": "custom", "name": "c"}, "c", "tool_choice.name"),
    ("responses", {"type": "function", "name": "f"}, "f", "tool_choice.name"),
    ("responses", {"type": "custom", "name": "c"}, "c", "tool_choice.name"),
    ("responses", {"type": "mcp", "server_label": "s", "name": "ls"}, "ls", "tool_choice.name"),
    ("responses", {"type": "function", "function": {"name": "f"}}, None, "tool_choice.name"),
    ("chat", {"type": "function", "name": "f"}, None, "tool_choice.function.name"),
])
def test_a_named_choice_is_read_where_each_api_puts_the_name(api, choice, name, param):
    read = read_tool_choice(choice, api)
    assert read.named is not None and read.string is None and read.allowed is None
    assert (read.named.type, read.named.tool_name, read.named.name_param) == (choice["type"], name, param)


@pytest.mark.parametrize("api, choice, mode, entries, prefix", [
    ("responses", {"type": "allowed_tools", "mode": "auto", "tools": [1]}, "auto", [1], "tool_choice"),
    ("chat", {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [1]}},
     "required", [1], "tool_choice.allowed_tools"),
])
def test_a_selection_is_read_flat_or_nested(api, choice, mode, entries, prefix):
    read = read_tool_choice(choice, api)
    assert read.allowed is not None and read.allowed.prefix == prefix
    assert read.allowed.checked() == (mode, entries)


@pytest.mark.parametrize("api, choice, param", [
    ("responses", {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}, "tool_choice.allowed_tools"),
    ("chat", {"type": "allowed_tools", "mode": "auto", "tools": [1]}, "tool_choice.allowed_tools"),
    ("chat", {"type": "allowed_tools", "allowed_tools": {"tools": [1]}}, "tool_choice.allowed_tools.mode"),
    ("responses", {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.tools"),
])
def test_reading_never_raises_the_checked_value_does(api, choice, param):
    read = read_tool_choice(choice, api)   # a caller decides when the fault counts
    with pytest.raises(InvalidSelectionError) as caught:
        read.allowed.checked()
    assert caught.value.param == param


def test_a_chat_custom_choice_without_a_name_is_a_400_when_its_name_is_asked_for():
    read = read_tool_choice({"type": "custom", "custom": "c"}, "chat")
    with pytest.raises(InvalidSelectionError) as caught:
        read.named.custom_name()
    assert caught.value.param == "tool_choice.custom"


def test_strings_absent_and_other_shapes():
    assert read_tool_choice("required", "chat").string == "required"
    assert read_tool_choice(None, "chat").absent
    other = read_tool_choice([1], "responses")
    assert not other.absent and (other.string, other.named, other.allowed) == (None, None, None)


def test_a_server_only_selection_keeps_its_own_wording():
    read = read_tool_choice({"type": "allowed_tools", "mode": 3, "tools": []}, "responses")
    with pytest.raises(AllowedToolsError) as caught:
        read.allowed.server_only_mode()
    assert caught.value.param == "tool_choice.mode" and "got a number" in caught.value.message


class _Model:
    """A choice as vLLM parses it: a pydantic model, read as the JSON it dumps."""

    def __init__(self, data):
        self.data = data

    def model_dump(self):
        return self.data


class _Request:
    def __init__(self, choice):
        self.tool_choice = choice


def test_a_parsed_request_is_read_as_its_json():
    read = tool_choice_of(_Request(_Model({"type": "function", "function": {"name": "f"}})), "chat")
    assert read.named.tool_name == "f"
    assert tool_choice_of(_Request("auto"), "responses").string == "auto"
    body = {"tool_choice": {"type": "function", "name": "f"}}
    assert tool_choice_of(body, "responses").named.tool_name == "f"


def test_the_wire_allowlist_carries_its_version_and_server_recipients():
    wire = with_server_recipients(no_function_wire("required", ["b", "a"], True), [("browser", None)])
    read = WireAllowlist.from_wire(wire)
    assert read is not None and read.catalog == {"a", "b"} and not read.allowed
    assert read.server == (("browser", None),) and read.mode == "required"
    assert WireAllowlist.from_wire({**wire, "v": WIRE_VERSION + 1}) is None
    assert ALLOWLIST_KEY == "vllm_allowed_tools"


def test_every_extra_args_key_is_ours_to_strip():
    assert set(XARGS_KEYS) == {*XARGS_GRAMMAR_KEYS, XARGS_MUST_CALL, XARGS_REFUSED_TOKENS, XARGS_TEXT_UTF8}
    assert all(key.startswith("vllm_allowed_tools_") for key in XARGS_KEYS)

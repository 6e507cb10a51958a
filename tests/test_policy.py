"""Table-driven tests of the tool policy resolver (no vLLM; milliseconds)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest

from vllm_allowed_tools import metrics
from vllm_allowed_tools.errors import (
    AllowedToolsError,
    CapabilityError,
    InvalidSelectionError,
)
from vllm_allowed_tools.request import (
    FunctionSpec,
    ToolIdentity,
    TurnAllowlist,
    catalog_digest,
    resolve_allowlist,
)

# --------------------------------------------------------------------------------------------------
# builders


def r_fn(name: str, description: str | None = None, **extra: Any) -> dict[str, Any]:
    tool: dict[str, Any] = {"type": "function", "name": name,
                            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
    if description is not None:
        tool["description"] = description
    tool.update(extra)
    return tool


def r_ns(name: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "namespace", "name": name, "description": f"{name} tools", "tools": members}


def c_fn(name: str, description: str | None = None, **extra: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name,
                                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
    if description is not None:
        function["description"] = description
    function.update(extra)
    return {"type": "function", "function": function}


def r_sel(*names: str | dict[str, Any]) -> list[Any]:
    return [n if isinstance(n, dict) else {"type": "function", "name": n} for n in names]


def c_sel(*names: str | dict[str, Any]) -> list[Any]:
    return [n if isinstance(n, dict) else {"type": "function", "function": {"name": n}} for n in names]


def r_allowed(tools: list[Any] | None, mode: Any = "auto", selection: Any = None, **body: Any) -> dict:
    choice: dict[str, Any] = {"type": "allowed_tools"}
    if mode is not _MISSING:
        choice["mode"] = mode
    if selection is not _MISSING:
        choice["tools"] = selection
    out: dict[str, Any] = {"tool_choice": choice, **body}
    if tools is not None:
        out["tools"] = tools
    return out


def c_allowed(tools: list[Any] | None, mode: Any = "auto", selection: Any = None, **body: Any) -> dict:
    inner: dict[str, Any] = {}
    if mode is not _MISSING:
        inner["mode"] = mode
    if selection is not _MISSING:
        inner["tools"] = selection
    out: dict[str, Any] = {"tool_choice": {"type": "allowed_tools", "allowed_tools": inner}, **body}
    if tools is not None:
        out["tools"] = tools
    return out


_MISSING = object()

# A Codex-like Responses catalog: top-level functions (one with "__" in its real name), hosted and
# custom tools, and two namespaces sharing a member name.
R_TOOLS: list[dict[str, Any]] = [
    r_fn("get_weather", "Weather for a city"),
    r_fn("read_file", "Read a file"),
    r_fn("mcp__computer_use", "Drive the computer"),
    {"type": "web_search"},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch"},
    r_ns("github", [r_fn("create_issue"), r_fn("lookup"), {"type": "custom", "name": "raw"}]),
    r_ns("crm", [r_fn("lookup"), r_fn("read_file")]),
]
C_TOOLS: list[dict[str, Any]] = [
    c_fn("get_weather", "Weather for a city"),
    c_fn("read_file", "Read a file"),
    c_fn("mcp__computer_use", "Drive the computer"),
    {"type": "custom", "custom": {"name": "apply_patch"}},
    c_fn("github__create_issue"),
]

I = ToolIdentity  # short alias for the tables


# --------------------------------------------------------------------------------------------------
# accepted allowed_tools selections


ACCEPT: list[tuple[str, str, dict[str, Any], set[ToolIdentity]]] = [
    ("r-top-level", "responses", r_allowed(R_TOOLS, "auto", r_sel("get_weather")),
     {I(None, "get_weather")}),
    ("r-bare-unique-member", "responses", r_allowed(R_TOOLS, "required", r_sel("create_issue")),
     {I("github", "create_issue")}),
    ("r-flat-member", "responses", r_allowed(R_TOOLS, "auto", r_sel("github__create_issue")),
     {I("github", "create_issue")}),
    ("r-flat-disambiguates", "responses", r_allowed(R_TOOLS, "auto", r_sel("crm__lookup")),
     {I("crm", "lookup")}),
    ("r-top-level-preferred", "responses", r_allowed(R_TOOLS, "auto", r_sel("read_file")),
     {I(None, "read_file")}),
    ("r-flat-member-shadowed-bare", "responses", r_allowed(R_TOOLS, "auto", r_sel("crm__read_file")),
     {I("crm", "read_file")}),
    ("r-namespace-key", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "function", "name": "lookup", "namespace": "crm"})),
     {I("crm", "lookup")}),
    ("r-namespace-null-is-absent", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "function", "name": "get_weather", "namespace": None})),
     {I(None, "get_weather")}),
    ("r-double-underscore-top-level-never-split", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("mcp__computer_use")), {I(None, "mcp__computer_use")}),
    ("r-duplicates-count-once", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("get_weather", "get_weather", "create_issue",
                                      "github__create_issue")),
     {I(None, "get_weather"), I("github", "create_issue")}),
    ("r-extra-keys-tolerated", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": "function", "name": "read_file", "description": "x",
                                  "parameters": {}}]),
     {I(None, "read_file")}),
    ("r-namespace-only-catalog", "responses",
     r_allowed([r_ns("mcp", [r_fn("computer_use")])], "auto", r_sel("mcp__computer_use")),
     {I("mcp", "computer_use")}),
    ("r-member-name-with-double-underscore", "responses",
     r_allowed([r_ns("mcp__open_websearch", [r_fn("search__web")])], "required",
               r_sel("mcp__open_websearch__search__web")),
     {I("mcp__open_websearch", "search__web")}),
    ("r-parallel-false", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("get_weather"), parallel_tool_calls=False),
     {I(None, "get_weather")}),
    ("r-parallel-null", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("get_weather"), parallel_tool_calls=None),
     {I(None, "get_weather")}),
    ("r-function-without-parameters", "responses",
     r_allowed([{"type": "function", "name": "ping"}], "required", r_sel("ping")), {I(None, "ping")}),
    ("c-basic", "chat", c_allowed(C_TOOLS, "auto", c_sel("get_weather", "read_file")),
     {I(None, "get_weather"), I(None, "read_file")}),
    ("c-double-underscore-exact", "chat", c_allowed(C_TOOLS, "required", c_sel("mcp__computer_use")),
     {I(None, "mcp__computer_use")}),
    ("c-double-underscore-name-is-top-level", "chat",
     c_allowed(C_TOOLS, "required", c_sel("github__create_issue")), {I(None, "github__create_issue")}),
    ("c-duplicates-count-once", "chat", c_allowed(C_TOOLS, "auto", c_sel("read_file", "read_file")),
     {I(None, "read_file")}),
    ("c-tool-type-defaults-to-function", "chat",
     c_allowed([{"function": {"name": "ping"}}], "auto", c_sel("ping")), {I(None, "ping")}),
    ("c-parallel-false", "chat",
     c_allowed(C_TOOLS, "auto", c_sel("read_file"), parallel_tool_calls=False), {I(None, "read_file")}),
    ("c-custom-tool", "chat",
     c_allowed(C_TOOLS, "required", c_sel("read_file", {"type": "custom", "custom": {"name": "apply_patch"}})),
     {I(None, "read_file"), I(None, "apply_patch")}),
    ("c-custom-tool-flat-name", "chat",
     c_allowed(C_TOOLS, "auto", c_sel({"type": "custom", "name": "apply_patch"})), {I(None, "apply_patch")}),
]


@pytest.mark.parametrize(("case", "api", "body", "expected"), ACCEPT, ids=[row[0] for row in ACCEPT])
def test_allowed_tools_accepts(case: str, api: str, body: dict[str, Any],
                               expected: set[ToolIdentity]) -> None:
    original = copy.deepcopy(body)
    policy = resolve_allowlist(body, api)  # type: ignore[arg-type]
    assert policy is not None
    assert body == original, "resolution must not mutate the request"
    assert policy.api == api
    assert policy.choice == "allowed" and policy.has_allowlist
    assert policy.allowed == frozenset(expected)
    assert policy.mode == body["tool_choice"].get("mode",
                                                  body["tool_choice"].get("allowed_tools", {}).get("mode"))
    assert policy.internal_tool_choice() == policy.mode
    assert policy.original_tool_choice == body["tool_choice"]
    assert policy.original_tool_choice is not body["tool_choice"]
    assert policy.parallel_tool_calls is (body.get("parallel_tool_calls") is not False)
    catalog_ids = {spec.identity for spec in policy.catalog}
    assert policy.allowed <= catalog_ids
    for spec in policy.catalog:
        assert policy.lookup(spec.flat_name) is spec or policy.lookup(spec.flat_name).identity == spec.identity
        assert policy.is_allowed(spec.flat_name) is (spec.identity in expected)
    assert [s.identity for s in policy.allowed_specs] == sorted(expected)
    assert policy.allowed_flat_names == tuple(i.flat_name for i in sorted(expected))
    assert list(policy.catalog) == sorted(policy.catalog, key=lambda s: s.identity.sort_key())


def test_responses_catalog_flattens_namespaces_and_skips_hosted_tools() -> None:
    policy = resolve_allowlist(r_allowed(R_TOOLS, "auto", r_sel("get_weather")), "responses")
    assert policy is not None
    assert [s.flat_name for s in policy.catalog] == [
        "apply_patch", "crm__lookup", "crm__read_file", "get_weather", "github__create_issue",
        "github__lookup", "mcp__computer_use", "read_file"]
    custom = policy.lookup("apply_patch")   # a top-level custom tool: a spec of its own kind
    assert custom.kind == "custom" and custom.grammar is None and custom.parameters["required"] == ["input"]
    assert policy.lookup("web_search") is None
    assert policy.lookup("github__raw") is None  # custom namespace member (vLLM serves none)
    # the model emits flat names; a bare member name is not a flat name
    assert policy.lookup("create_issue") is None
    assert policy.lookup("github__create_issue").identity == I("github", "create_issue")
    # never split: "mcp__computer_use" is the top-level function, there is no namespace "mcp"
    assert policy.lookup("mcp__computer_use").identity == I(None, "mcp__computer_use")
    spec = policy.lookup("crm__lookup")
    assert spec.parameters == {"type": "object", "properties": {"x": {"type": "string"}}}
    ping = resolve_allowlist(r_allowed([{"type": "function", "name": "ping"}], "auto", r_sel("ping")),
                          "responses")
    assert ping.catalog[0].parameters == {"type": "object", "properties": {}}
    assert ping.catalog[0].description is None


# --------------------------------------------------------------------------------------------------
# rejected allowed_tools selections

RejectRow = tuple[str, str, dict[str, Any], str, str, str, str]
# (id, api, body, reason, param, code, substring of the message)

REJECT: list[RejectRow] = [
    # --- empty subset
    ("r-empty", "responses", r_allowed(R_TOOLS, "auto", []), "empty_subset", "tool_choice.tools",
     "invalid_allowed_tools", "at least one function"),
    ("r-missing-tools", "responses", r_allowed(R_TOOLS, "auto", _MISSING), "empty_subset",
     "tool_choice.tools", "invalid_allowed_tools", "never widened"),
    ("r-null-tools", "responses", r_allowed(R_TOOLS, "auto", None), "empty_subset",
     "tool_choice.tools", "invalid_allowed_tools", "at least one"),
    ("c-empty", "chat", c_allowed(C_TOOLS, "required", []), "empty_subset",
     "tool_choice.allowed_tools.tools", "invalid_allowed_tools", "at least one"),
    ("c-missing-tools", "chat", c_allowed(C_TOOLS, "required", _MISSING), "empty_subset",
     "tool_choice.allowed_tools.tools", "invalid_allowed_tools", "at least one"),
    # --- unknown function
    ("r-unknown", "responses", r_allowed(R_TOOLS, "auto", r_sel("get_weather", "read_file", "foo")),
     "unknown_function", "tool_choice.tools[2].name", "invalid_allowed_tools",
     ("'foo' is not a function in `tools`; the function tools are: crm__lookup, crm__read_file, "
      "get_weather, github__create_issue, github__lookup, mcp__computer_use, read_file. Add it to "
      "`tools` or remove it from the selection.")),
    ("r-unknown-close-match", "responses", r_allowed(R_TOOLS, "auto", r_sel("get_wether")),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools",
     "Did you mean 'get_weather'?"),
    ("r-custom-tool-selected-as-function", "responses", r_allowed(R_TOOLS, "auto", r_sel("apply_patch")),
     "tool_type_mismatch", "tool_choice.tools[0].name", "invalid_allowed_tools",
     "'apply_patch' is a custom tool, not a function: select it as {\"type\": \"custom\", "
     "\"name\": \"apply_patch\"}"),
    ("r-function-selected-as-custom", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("read_file", {"type": "custom", "name": "get_weather"})),
     "tool_type_mismatch", "tool_choice.tools[1].name", "invalid_allowed_tools",
     "'get_weather' is a function tool, not a custom tool"),
    ("r-unknown-custom", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "custom", "name": "apply_ptch"})),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools",
     "'apply_ptch' is not a custom tool in `tools`; the custom tools are: apply_patch. Did you mean "
     "'apply_patch'?"),
    ("r-custom-namespace-member", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "custom", "name": "github__raw"})),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools",
     "'github__raw' is a custom tool inside a namespace, which vLLM does not serve"),
    ("r-custom-with-namespace", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "custom", "name": "apply_patch", "namespace": "x"})),
     "malformed", "tool_choice.tools[0].namespace", "invalid_allowed_tools", "custom tools have no namespace"),
    ("r-custom-without-name", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "custom", "custom": {"name": "apply_patch"}})),
     "malformed", "tool_choice.tools[0].name", "invalid_allowed_tools", "Chat Completions shape"),
    ("r-unknown-namespace", "responses",
     r_allowed(R_TOOLS, "auto", r_sel({"type": "function", "name": "lookup", "namespace": "jira"})),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools",
     "'lookup' in namespace 'jira' is not a function"),
    ("r-namespace-with-flat-name", "responses",
     r_allowed(R_TOOLS, "auto",
               r_sel({"type": "function", "name": "crm__lookup", "namespace": "crm"})),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools", "not a function"),
    ("r-bare-name-of-shadowed-member-is-not-split", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("computer_use")), "unknown_function",
     "tool_choice.tools[0].name", "invalid_allowed_tools", "'computer_use' is not a function"),
    ("r-namespace-name-is-not-a-function", "responses", r_allowed(R_TOOLS, "auto", r_sel("github")),
     "unknown_function", "tool_choice.tools[0].name", "invalid_allowed_tools", "not a function"),
    ("c-unknown", "chat", c_allowed(C_TOOLS, "auto", c_sel("read_file", "nope")), "unknown_function",
     "tool_choice.allowed_tools.tools[1].function.name", "invalid_allowed_tools",
     "'nope' is not a function in `tools`"),
    ("c-no-namespace-resolution", "chat", c_allowed(C_TOOLS, "auto", c_sel("create_issue")),
     "unknown_function", "tool_choice.allowed_tools.tools[0].function.name", "invalid_allowed_tools",
     "Add it to `tools`"),
    ("c-custom-tool-name", "chat", c_allowed(C_TOOLS, "auto", c_sel("apply_patch")),
     "tool_type_mismatch", "tool_choice.allowed_tools.tools[0].function.name", "invalid_allowed_tools",
     "'apply_patch' is a custom tool, not a function: select it as {\"type\": \"custom\", "
     "\"custom\": {\"name\": \"apply_patch\"}}"),
    ("c-function-selected-as-custom", "chat",
     c_allowed(C_TOOLS, "auto", c_sel({"type": "custom", "custom": {"name": "read_file"}})),
     "tool_type_mismatch", "tool_choice.allowed_tools.tools[0].custom.name", "invalid_allowed_tools",
     "'read_file' is a function tool, not a custom tool"),
    ("c-unknown-custom", "chat",
     c_allowed(C_TOOLS, "auto", c_sel({"type": "custom", "custom": {"name": "apply_ptch"}})),
     "unknown_function", "tool_choice.allowed_tools.tools[0].custom.name", "invalid_allowed_tools",
     "'apply_ptch' is not a custom tool in `tools`; the custom tools are: apply_patch."),
    # --- ambiguous
    ("r-ambiguous-bare", "responses", r_allowed(R_TOOLS, "auto", r_sel("get_weather", "lookup")),
     "ambiguous_name", "tool_choice.tools[1].name", "invalid_allowed_tools",
     ("'lookup' is ambiguous: it names a function in several namespaces (crm__lookup, "
      "github__lookup). Select one by its flat name `<namespace>__<name>`")),
    # --- non-function selectors
    *[(f"r-non-function-{t}", "responses",
       r_allowed(R_TOOLS, "auto", r_sel("get_weather", {"type": t, "name": "x", "server_label": "s"})),
       "non_function_selector", "tool_choice.tools[1].type", "invalid_allowed_tools",
       "only function tools and custom tools can be selected in allowed_tools")
      for t in ("mcp", "web_search", "file_search", "image_generation", "namespace",
                "tool_search", "computer_use_preview", "frobnicate")],
    *[(f"c-non-function-{t}", "chat",
       c_allowed(C_TOOLS, "auto", c_sel({"type": t, t: {"name": "apply_patch"}})),
       "non_function_selector", "tool_choice.allowed_tools.tools[0].type", "invalid_allowed_tools",
       "only function tools and custom tools can be selected") for t in ("mcp", "web_search")],
    ("c-custom-selector-not-object", "chat", c_allowed(C_TOOLS, "auto", c_sel({"type": "custom", "custom": "apply_patch"})),
     "malformed", "tool_choice.allowed_tools.tools[0].custom", "invalid_allowed_tools",
     'Chat Completions selects custom tools as {"type": "custom", "custom": {"name": "<custom tool name>"}}'),
    ("r-namespace-selector-hint", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": "namespace", "name": "github"}]), "non_function_selector",
     "tool_choice.tools[0].type", "invalid_allowed_tools", "flat name `<namespace>__<name>`"),
    # --- malformed selection
    ("r-tools-not-list", "responses", r_allowed(R_TOOLS, "auto", {"type": "function"}), "malformed",
     "tool_choice.tools", "invalid_allowed_tools", "must be an array"),
    ("r-entry-string", "responses", r_allowed(R_TOOLS, "auto", ["get_weather"]), "malformed",
     "tool_choice.tools[0]", "invalid_allowed_tools", '{"type": "function", "name": "<function name>"}'),
    ("r-entry-missing-type", "responses", r_allowed(R_TOOLS, "auto", [{"name": "get_weather"}]),
     "malformed", "tool_choice.tools[0].type", "invalid_allowed_tools", "type is missing"),
    ("r-entry-type-not-string", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": 1, "name": "get_weather"}]), "malformed",
     "tool_choice.tools[0].type", "invalid_allowed_tools", "must be the string"),
    ("r-entry-missing-name", "responses", r_allowed(R_TOOLS, "auto", r_sel("read_file", {"type": "function"})),
     "malformed", "tool_choice.tools[1].name", "invalid_allowed_tools", "non-empty string"),
    ("r-entry-empty-name", "responses", r_allowed(R_TOOLS, "auto", r_sel("")), "malformed",
     "tool_choice.tools[0].name", "invalid_allowed_tools", "non-empty string"),
    ("r-entry-name-not-string", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": "function", "name": 7}]), "malformed",
     "tool_choice.tools[0].name", "invalid_allowed_tools", "got a number"),
    ("r-entry-chat-shape", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": "function", "function": {"name": "get_weather"}}]),
     "malformed", "tool_choice.tools[0].name", "invalid_allowed_tools", "Chat Completions shape"),
    ("r-entry-bad-namespace", "responses",
     r_allowed(R_TOOLS, "auto", [{"type": "function", "name": "lookup", "namespace": ""}]),
     "malformed", "tool_choice.tools[0].namespace", "invalid_allowed_tools", "non-empty string"),
    ("r-choice-chat-shape", "responses",
     {"tools": R_TOOLS, "tool_choice": {"type": "allowed_tools",
                                        "allowed_tools": {"mode": "auto", "tools": c_sel("read_file")}}},
     "malformed", "tool_choice.allowed_tools", "invalid_allowed_tools", "Chat Completions shape"),
    ("c-missing-allowed-tools", "chat", {"tools": C_TOOLS, "tool_choice": {"type": "allowed_tools"}},
     "malformed", "tool_choice.allowed_tools", "invalid_allowed_tools", "must be an object"),
    ("c-choice-responses-shape", "chat",
     {"tools": C_TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                        "tools": r_sel("read_file")}},
     "malformed", "tool_choice.allowed_tools", "invalid_allowed_tools", "Responses API's shape"),
    ("c-allowed-tools-not-object", "chat",
     {"tools": C_TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": ["read_file"]}},
     "malformed", "tool_choice.allowed_tools", "invalid_allowed_tools", "got an array"),
    ("c-tools-not-list", "chat", c_allowed(C_TOOLS, "auto", "read_file"), "malformed",
     "tool_choice.allowed_tools.tools", "invalid_allowed_tools", "must be an array"),
    ("c-entry-not-object", "chat", c_allowed(C_TOOLS, "auto", [None]), "malformed",
     "tool_choice.allowed_tools.tools[0]", "invalid_allowed_tools", "must be an object"),
    ("c-entry-missing-function", "chat", c_allowed(C_TOOLS, "auto", [{"type": "function"}]),
     "malformed", "tool_choice.allowed_tools.tools[0].function", "invalid_allowed_tools",
     '{"type": "function", "function": {"name": "<function name>"}}'),
    ("c-entry-responses-shape", "chat",
     c_allowed(C_TOOLS, "auto", r_sel("read_file")), "malformed",
     "tool_choice.allowed_tools.tools[0].function", "invalid_allowed_tools", "Responses API shape"),
    ("c-entry-missing-name", "chat",
     c_allowed(C_TOOLS, "auto", c_sel("read_file", "get_weather", {"type": "function", "function": {}})),
     "malformed", "tool_choice.allowed_tools.tools[2].function.name", "invalid_allowed_tools",
     "non-empty string"),
    # --- invalid mode
    ("r-mode-missing", "responses", r_allowed(R_TOOLS, _MISSING, r_sel("read_file")), "invalid_mode",
     "tool_choice.mode", "invalid_allowed_tools", "is required"),
    ("r-mode-null", "responses", r_allowed(R_TOOLS, None, r_sel("read_file")), "invalid_mode",
     "tool_choice.mode", "invalid_allowed_tools", "is required"),
    ("r-mode-none", "responses", r_allowed(R_TOOLS, "none", r_sel("read_file")), "invalid_mode",
     "tool_choice.mode", "invalid_allowed_tools", 'tool_choice "none"'),
    ("r-mode-bogus", "responses", r_allowed(R_TOOLS, "sometimes", r_sel("read_file")), "invalid_mode",
     "tool_choice.mode", "invalid_allowed_tools", "got 'sometimes'"),
    ("r-mode-not-string", "responses", r_allowed(R_TOOLS, ["auto"], r_sel("read_file")),
     "invalid_mode", "tool_choice.mode", "invalid_allowed_tools", "must be"),
    ("c-mode-missing", "chat", c_allowed(C_TOOLS, _MISSING, c_sel("read_file")), "invalid_mode",
     "tool_choice.allowed_tools.mode", "invalid_allowed_tools", "is required"),
    ("c-mode-bogus", "chat", c_allowed(C_TOOLS, "AUTO", c_sel("read_file")), "invalid_mode",
     "tool_choice.allowed_tools.mode", "invalid_allowed_tools", "must be \"auto\" or \"required\""),
    # --- no function tools
    ("r-no-tools", "responses", r_allowed(None, "auto", r_sel("read_file")), "no_function_tools",
     "tools", "invalid_tools", "contains no function tool"),
    ("r-empty-tools", "responses", r_allowed([], "auto", r_sel("read_file")), "no_function_tools",
     "tools", "invalid_tools", "contains no function tool"),
    ("r-only-hosted", "responses",
     r_allowed([{"type": "web_search"}, r_ns("github", [{"type": "custom", "name": "raw"}])], "auto",
               r_sel("apply_patch")),
     "no_function_tools", "tools", "invalid_tools", "contains no function tool"),
    ("c-only-custom", "chat", c_allowed([{"type": "custom", "custom": {"name": "apply_patch"}}], "auto",
                                        c_sel("apply_patch")),
     "tool_type_mismatch", "tool_choice.allowed_tools.tools[0].function.name", "invalid_allowed_tools",
     "is a custom tool, not a function"),
    ("c-only-hosted", "chat", c_allowed([{"type": "web_search", "web_search": {"name": "w"}}], "auto",
                                        c_sel("w")),
     "no_function_tools", "tools", "invalid_tools", "contains no function tool"),
    # --- malformed catalog (only checked for allowed_tools)
    ("r-tools-field-not-list", "responses", r_allowed({"type": "function"}, "auto", r_sel("x")),  # type: ignore[arg-type]
     "malformed", "tools", "invalid_tools", "must be an array"),
    ("r-catalog-entry-not-object", "responses", r_allowed([r_fn("a"), "b"], "auto", r_sel("a")),
     "malformed", "tools[1]", "invalid_tools", "must be an object"),
    ("r-catalog-type-missing", "responses", r_allowed([{"name": "a"}], "auto", r_sel("a")),
     "malformed", "tools[0].type", "invalid_tools", "must be a string"),
    ("r-catalog-name-missing", "responses",
     r_allowed([r_fn("a"), {"type": "function", "parameters": {}}], "auto", r_sel("a")),
     "malformed", "tools[1].name", "invalid_tools", "non-empty string"),
    ("r-catalog-parameters-not-object", "responses",
     r_allowed([r_fn("a", parameters=["x"])], "auto", r_sel("a")), "malformed",
     "tools[0].parameters", "invalid_tools", "JSON schema object"),
    ("r-catalog-description-not-string", "responses",
     r_allowed([r_fn("a", description=3)], "auto", r_sel("a")), "malformed",  # type: ignore[arg-type]
     "tools[0].description", "invalid_tools", "must be a string"),
    ("r-catalog-strict-not-bool", "responses",
     r_allowed([r_fn("a", strict="yes")], "auto", r_sel("a")), "malformed", "tools[0].strict",
     "invalid_tools", "boolean"),
    ("r-namespace-name-missing", "responses",
     r_allowed([r_fn("a"), {"type": "namespace", "tools": [r_fn("b")]}], "auto", r_sel("a")),
     "malformed", "tools[1].name", "invalid_tools", "namespace name"),
    ("r-namespace-tools-not-list", "responses",
     r_allowed([r_fn("a"), {"type": "namespace", "name": "ns", "tools": {}}], "auto", r_sel("a")),
     "malformed", "tools[1].tools", "invalid_tools", "must be an array"),
    ("r-namespace-member-name-missing", "responses",
     r_allowed([r_ns("ns", [r_fn("b"), {"type": "function"}])], "auto", r_sel("b")),
     "malformed", "tools[0].tools[1].name", "invalid_tools", "non-empty string"),
    ("r-namespace-member-not-object", "responses",
     r_allowed([r_ns("ns", [r_fn("b"), 5])], "auto", r_sel("b")),
     "malformed", "tools[0].tools[1]", "invalid_tools", "must be an object"),
    ("c-catalog-function-missing", "chat", c_allowed([c_fn("a"), {"type": "function"}], "auto", c_sel("a")),
     "malformed", "tools[1].function", "invalid_tools", "must be an object"),
    ("c-catalog-responses-shape", "chat", c_allowed([c_fn("a"), r_fn("b")], "auto", c_sel("a")),
     "malformed", "tools[1].function", "invalid_tools", "Responses API's"),
    ("c-catalog-name-missing", "chat",
     c_allowed([c_fn("a"), {"type": "function", "function": {"description": "x"}}], "auto", c_sel("a")),
     "malformed", "tools[1].function.name", "invalid_tools", "non-empty string"),
    ("c-catalog-parameters-not-object", "chat",
     c_allowed([c_fn("a", parameters="{}")], "auto", c_sel("a")), "malformed",
     "tools[0].function.parameters", "invalid_tools", "JSON schema object"),
    # --- duplicates and collisions in the catalog
    ("r-duplicate-top-level", "responses",
     r_allowed([r_fn("a"), r_fn("b"), r_fn("a", "other")], "auto", r_sel("b")), "duplicate_tool",
     "tools[2].name", "invalid_tools", "duplicates the function defined at tools[0]"),
    ("r-duplicate-member", "responses",
     r_allowed([r_ns("ns", [r_fn("a")]), r_ns("ns", [r_fn("a")])], "auto", r_sel("ns__a")),
     "duplicate_tool", "tools[1].tools[0].name", "invalid_tools", "tools[0].tools[0]"),
    ("r-collision-top-level-vs-member", "responses",
     r_allowed([r_fn("mcp__computer_use"), r_ns("mcp", [r_fn("computer_use")])], "auto",
               r_sel("mcp__computer_use")),
     "ambiguous_name", "tools[1].tools[0].name", "invalid_tools",
     "both reach the model as 'mcp__computer_use'"),
    ("r-collision-between-namespaces", "responses",
     r_allowed([r_ns("a", [r_fn("b__c")]), r_ns("a__b", [r_fn("c")])], "auto", r_sel("a__b__c")),
     "ambiguous_name", "tools[1].tools[0].name", "invalid_tools", "Rename one of them"),
    ("r-collision-even-when-not-selected", "responses",
     r_allowed([r_fn("x"), r_fn("a__b"), r_ns("a", [r_fn("b")])], "auto", r_sel("x")),
     "ambiguous_name", "tools[2].tools[0].name", "invalid_tools", "'a__b'"),
    ("c-duplicate", "chat", c_allowed([c_fn("a"), c_fn("a")], "auto", c_sel("a")), "duplicate_tool",
     "tools[1].function.name", "invalid_tools", "duplicates the function defined at tools[0].function"),
    # --- parallel_tool_calls
    ("r-parallel-string", "responses",
     r_allowed(R_TOOLS, "auto", r_sel("read_file"), parallel_tool_calls="false"), "malformed",
     "parallel_tool_calls", "invalid_parallel_tool_calls", "must be true or false"),
    ("c-parallel-int", "chat",
     c_allowed(C_TOOLS, "auto", c_sel("read_file"), parallel_tool_calls=0), "malformed",
     "parallel_tool_calls", "invalid_parallel_tool_calls", "must be true or false"),
]


@pytest.mark.parametrize(("case", "api", "body", "reason", "param", "code", "text"), REJECT,
                         ids=[row[0] for row in REJECT])
def test_allowed_tools_rejects(case: str, api: str, body: dict[str, Any], reason: str, param: str,
                               code: str, text: str) -> None:
    before = metrics.snapshot()["invalid_selections"].get(reason, 0)
    with pytest.raises(InvalidSelectionError) as info:
        resolve_allowlist(body, api)  # type: ignore[arg-type]
    err = info.value
    assert (err.status, err.type, err.reason, err.param, err.code) == (
        400, "invalid_request_error", reason, param, code), err.message
    assert text in err.message
    assert err.to_openai() == {"error": {"message": err.message, "type": "invalid_request_error",
                                         "param": param, "code": code}}
    # counted exactly once per rejected request
    assert metrics.snapshot()["invalid_selections"].get(reason, 0) == before + 1


def test_long_catalog_listing_is_truncated() -> None:
    tools = [r_fn(f"tool_{i:03d}") for i in range(60)]
    with pytest.raises(InvalidSelectionError) as info:
        resolve_allowlist(r_allowed(tools, "auto", r_sel("zzz")), "responses")
    assert "... (40 more)" in info.value.message
    assert len(info.value.message) < 1000


def test_huge_client_name_is_truncated_in_message() -> None:
    with pytest.raises(InvalidSelectionError) as info:
        resolve_allowlist(r_allowed(R_TOOLS, "auto", r_sel("x" * 10_000)), "responses")
    assert len(info.value.message) < 1000


def test_first_problem_wins_in_request_order() -> None:
    body = r_allowed([r_fn("a")], "auto", r_sel("nope", {"type": "mcp"}))
    with pytest.raises(InvalidSelectionError) as info:
        resolve_allowlist(body, "responses")
    assert info.value.param == "tool_choice.tools[0].name"


# --------------------------------------------------------------------------------------------------
# plain choices: described, never rejected (vanilla vLLM validates them)


def test_no_tools_no_choice_is_nothing_to_do() -> None:
    assert resolve_allowlist({"input": "hi"}, "responses") is None
    assert resolve_allowlist({"messages": [], "tools": []}, "chat") is None
    assert resolve_allowlist({"tools": None, "tool_choice": None}, "chat") is None


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_plain_auto_default(api: str) -> None:
    tools = R_TOOLS if api == "responses" else C_TOOLS
    policy = resolve_allowlist({"tools": tools}, api)  # type: ignore[arg-type]
    assert policy is not None
    assert (policy.choice, policy.mode, policy.allowed, policy.has_allowlist) == ("auto", "auto", None, False)
    assert policy.original_tool_choice is None
    assert policy.internal_tool_choice() == "auto"
    assert policy.allowed_specs == policy.catalog
    assert all(policy.is_allowed(s.flat_name) for s in policy.catalog)
    assert not policy.is_allowed("not_a_tool")


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_plain_string_choices(api: str, choice: str) -> None:
    tools = R_TOOLS if api == "responses" else C_TOOLS
    policy = resolve_allowlist({"tools": tools, "tool_choice": choice, "parallel_tool_calls": False},
                            api)  # type: ignore[arg-type]
    assert policy is not None
    assert policy.choice == choice
    assert policy.mode == (None if choice == "none" else choice)
    assert policy.allowed is None
    assert policy.parallel_tool_calls is False
    assert policy.internal_tool_choice() == choice
    if choice == "none":
        assert policy.allowed_specs == ()
        assert not any(policy.is_allowed(s.flat_name) for s in policy.catalog)
    else:
        assert policy.allowed_specs == policy.catalog


def test_plain_choice_without_tools_is_described() -> None:
    policy = resolve_allowlist({"tool_choice": "none"}, "chat")
    assert policy is not None and policy.catalog == () and policy.choice == "none"


def test_auto_default_with_only_hosted_tools() -> None:
    policy = resolve_allowlist({"tools": [{"type": "web_search"}]}, "responses")
    assert policy is not None and policy.choice == "auto" and policy.catalog == ()


@pytest.mark.parametrize(("api", "body", "expected"), [
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
     I(None, "get_weather")),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "create_issue"}},
     I("github", "create_issue")),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "crm__lookup"}},
     I("crm", "lookup")),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "read_file"}},
     I(None, "read_file")),
    ("responses", {"tools": R_TOOLS,
                   "tool_choice": {"type": "function", "name": "read_file", "namespace": "crm"}},
     I("crm", "read_file")),
    ("chat", {"tools": C_TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}}},
     I(None, "read_file")),
    ("chat", {"tools": C_TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "mcp__computer_use"}}},
     I(None, "mcp__computer_use")),
    ("chat", {"tools": C_TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "apply_patch"}}},
     I(None, "apply_patch")),
])
def test_named_choice(api: str, body: dict[str, Any], expected: ToolIdentity) -> None:
    policy = resolve_allowlist(body, api)  # type: ignore[arg-type]
    assert policy is not None
    assert policy.choice == "named" and policy.mode is None
    assert policy.allowed == frozenset({expected})
    assert policy.internal_tool_choice() == body["tool_choice"]
    assert policy.is_allowed(expected.flat_name)
    assert [s.identity for s in policy.allowed_specs] == [expected]
    assert sum(policy.is_allowed(s.flat_name) for s in policy.catalog) == 1


@pytest.mark.parametrize(("api", "body"), [
    # unknown / ambiguous / malformed named choices: vanilla vLLM answers with its own 400
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "lookup"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "lookup",
                                                     "namespace": 3}}),
    ("chat", {"tools": C_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("chat", {"tools": C_TOOLS, "tool_choice": {"type": "function", "name": "read_file"}}),
    # hosted / custom / MCP / unknown choices are not ours to model
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "web_search_preview"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "mcp", "server_label": "deepwiki"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "custom", "name": "get_weather"}}),
    ("responses", {"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "apply_patch"}}),
    ("chat", {"tools": C_TOOLS, "tool_choice": "sometimes"}),
    ("chat", {"tools": C_TOOLS, "tool_choice": 3}),
])
def test_plain_requests_we_do_not_model_return_none(api: str, body: dict[str, Any]) -> None:
    before = metrics.snapshot()["invalid_selections"]
    assert resolve_allowlist(body, api) is None  # type: ignore[arg-type]
    assert metrics.snapshot()["invalid_selections"] == before


@pytest.mark.parametrize(("body", "param"), [
    # a shape the policy cannot read is a 400, never "no policy" (vLLM might coerce it and serve)
    ({"tools": {"a": 1}, "tool_choice": "auto"}, "tools"),
    ({"tools": C_TOOLS, "tool_choice": "auto", "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
])
def test_plain_requests_the_policy_cannot_read_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSelectionError) as caught:
        resolve_allowlist(body, "chat")
    assert caught.value.param == param and caught.value.status == 400


def test_plain_choices_tolerate_malformed_entries() -> None:
    tools = [r_fn("ok"), {"type": "function"}, "junk", r_fn("a__b"),
             {"type": "namespace", "name": "bad", "tools": 3}]
    policy = resolve_allowlist({"tools": tools, "tool_choice": "required"}, "responses")
    assert policy is not None
    assert [s.flat_name for s in policy.catalog] == ["a__b", "ok"]
    assert policy.is_allowed("a__b") and policy.is_allowed("ok")


@pytest.mark.parametrize("choice", ["auto", "required", "none", None])
@pytest.mark.parametrize(("tools", "reason"), [
    ([r_fn("ok"), r_fn("ok", "dup")], "duplicate_tool"),
    ([r_fn("a__b"), r_ns("a", [r_fn("b")])], "ambiguous_name"),
])
def test_two_definitions_of_one_name_are_refused_under_every_choice(choice, tools, reason) -> None:
    # never "the first by digest order": that would let a grant for one definition release the other
    with pytest.raises(InvalidSelectionError) as caught:
        resolve_allowlist({"tools": tools, "tool_choice": choice}, "responses")
    assert caught.value.reason == reason and caught.value.param.startswith("tools[")


# --------------------------------------------------------------------------------------------------
# digests


def _digest_of(api: str, tools: list[Any], selection: list[str], **body: Any) -> TurnAllowlist:
    if api == "responses":
        policy = resolve_allowlist(r_allowed(tools, "auto", r_sel(*selection), **body), "responses")
    else:
        policy = resolve_allowlist(c_allowed(tools, "auto", c_sel(*selection), **body), "chat")
    assert policy is not None
    return policy


def test_catalog_digest_ignores_order_keys_and_strict_and_selection() -> None:
    tools = [r_fn("a", "A", strict=True), r_ns("ns", [r_fn("b", "B"), r_fn("c")]), r_fn("d")]
    reordered = [
        {"strict": False, "parameters": {"properties": {"x": {"type": "string"}}, "type": "object"},
         "name": "d", "type": "function"},
        r_ns("ns", [r_fn("c", strict=False), r_fn("b", "B")]),
        {"description": "A", "name": "a", "type": "function",
         "parameters": {"properties": {"x": {"type": "string"}}, "type": "object"}},
    ]
    p1 = _digest_of("responses", tools, ["a"])
    p2 = _digest_of("responses", reordered, ["ns__b", "d"])
    assert p1.catalog_digest == p2.catalog_digest
    assert [s.digest for s in p1.catalog] == [s.digest for s in p2.catalog]
    assert p1.catalog_digest == catalog_digest(tools, "responses") == catalog_digest(reordered, "responses")
    assert p1.allowlist_digest != p2.allowlist_digest


@pytest.mark.parametrize("mutate", [
    lambda t: t[0].__setitem__("description", "changed"),
    lambda t: t[0].__setitem__("name", "a2"),
    lambda t: t[0]["parameters"]["properties"].__setitem__("y", {"type": "integer"}),
    lambda t: t[0]["parameters"]["properties"]["x"].__setitem__("type", "number"),
    lambda t: t[1].__setitem__("name", "ns2"),
    lambda t: t[1]["tools"][0].__setitem__("description", "new"),
    lambda t: t.append(r_fn("e")),
    lambda t: t.pop(),
])
def test_catalog_digest_changes_with_any_definition(mutate: Any) -> None:
    tools = [r_fn("a", "A"), r_ns("ns", [r_fn("b", "B")]), r_fn("d")]
    before = catalog_digest(tools, "responses")
    changed = copy.deepcopy(tools)
    mutate(changed)
    assert catalog_digest(changed, "responses") != before


def test_same_functions_same_digest_across_apis() -> None:
    r = catalog_digest([r_fn("a", "A"), r_fn("b")], "responses")
    c = catalog_digest([c_fn("b"), c_fn("a", "A", strict=True)], "chat")
    assert r == c


def test_allowlist_digest_is_stable_and_sensitive() -> None:
    tools = [r_fn("a"), r_fn("b"), r_fn("c")]
    base = _digest_of("responses", tools, ["a", "b"]).allowlist_digest
    assert _digest_of("responses", tools, ["b", "a", "b"]).allowlist_digest == base
    assert _digest_of("responses", list(reversed(tools)), ["b", "a"]).allowlist_digest == base
    assert _digest_of("responses", tools, ["a"]).allowlist_digest != base
    assert _digest_of("responses", tools, ["a", "b"], parallel_tool_calls=False).allowlist_digest != base
    required = resolve_allowlist(r_allowed(tools, "required", r_sel("a", "b")), "responses")
    assert required.allowlist_digest != base


def test_function_digest_excludes_strict_includes_namespace() -> None:
    plain = FunctionSpec.build(I(None, "a__b"), None, {"type": "object"}, strict=True)
    member = FunctionSpec.build(I("a", "b"), None, {"type": "object"}, strict=None)
    assert plain.flat_name == member.flat_name == "a__b"
    assert plain.digest != member.digest
    assert FunctionSpec.build(I(None, "a__b"), None, {"type": "object"}).digest == plain.digest
    assert member.chat_tool() == {"type": "function",
                                  "function": {"name": "a__b", "parameters": {"type": "object"}}}


def test_cached_catalog_is_isolated_from_request_mutation() -> None:
    tools = [r_fn("a", "A")]
    policy = _digest_of("responses", tools, ["a"])
    tools[0]["parameters"]["properties"]["x"]["type"] = "integer"
    assert policy.catalog[0].parameters["properties"]["x"]["type"] == "string"
    again = _digest_of("responses", tools, ["a"])
    assert again.catalog[0].parameters["properties"]["x"]["type"] == "integer"
    assert again.catalog_digest != policy.catalog_digest


def test_non_json_tools_are_still_parsed() -> None:
    class Weird(dict):  # a Mapping that json can still serialize is fine; make one it cannot
        pass

    tools = [Weird(type="function", name="a", parameters={"default": {1, 2}})]
    policy = resolve_allowlist({"tools": tools, "tool_choice": "auto"}, "responses")
    assert policy is not None and [s.flat_name for s in policy.catalog] == ["a"]


# --------------------------------------------------------------------------------------------------
# identities, policy invariants, errors, metrics


def test_identity_order_mixes_top_level_and_namespaces() -> None:
    ids = [I("ns", "a"), I(None, "ns__a"), I(None, "b"), I("a", "b__c"), I("a__b", "c")]
    assert [i.flat_name for i in sorted(ids)] == ["a__b__c", "a__b__c", "b", "ns__a", "ns__a"]
    assert sorted(ids)[3] == I(None, "ns__a")  # top level before namespaced on equal flat names
    assert I(None, "x") < I("x", "y")
    assert len({I(None, "a"), I(None, "a"), I("n", "a")}) == 2


def test_policy_never_widens() -> None:
    spec = FunctionSpec.build(I(None, "a"), None, None)
    with pytest.raises(ValueError, match="not in the catalog"):
        TurnAllowlist.build(api="chat", catalog=[spec], choice="allowed", mode="auto",
                         allowed=frozenset({I(None, "b")}))
    policy = TurnAllowlist.build(api="chat", catalog=[spec], choice="allowed", mode="required",
                              allowed=frozenset({I(None, "a")}), parallel_tool_calls=False)
    assert policy.is_allowed("a") and policy.internal_tool_choice() == "required"
    assert hash(policy) == hash(TurnAllowlist.build(api="chat", catalog=[spec], choice="allowed",
                                                 mode="required", allowed=frozenset({I(None, "a")}),
                                                 parallel_tool_calls=False))


def test_error_shapes() -> None:
    err = InvalidSelectionError("bad", reason="empty_subset", param="tool_choice.tools")
    assert isinstance(err, AllowedToolsError)
    assert (err.status, err.code) == (400, "invalid_allowed_tools")
    with pytest.raises(ValueError):
        InvalidSelectionError("bad", reason="not-a-reason")
    cap = CapabilityError("parser 'hermes' cannot enforce allowed_tools", capability="parser",
                          status=500)
    assert cap.to_openai() == {"error": {"message": "parser 'hermes' cannot enforce allowed_tools",
                                         "type": "server_error", "param": "tool_choice",
                                         "code": "allowed_tools_unsupported"}}
    assert cap.capability == "parser"
    assert CapabilityError("x", capability="template").to_openai()["error"]["type"] == \
        "invalid_request_error"


def test_metrics_are_idempotent_and_exposed() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    reloaded = importlib.reload(metrics)  # a second registration must adopt, not raise
    reloaded.record_invalid_selection("unknown_function")
    reloaded.record_violation("stream_guard")
    reloaded.record_violation("bogus")
    reloaded.record_fallback("catalog_filter")
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("vllm_allowed_tools:invalid_selections_total",
                                     {"reason": "unknown_function"}) >= 1
    assert registry.get_sample_value("vllm_allowed_tools:violations_total",
                                     {"source": "stream_guard"}) >= 1
    assert registry.get_sample_value("vllm_allowed_tools:violations_total", {"source": "other"}) >= 1
    assert registry.get_sample_value("vllm_allowed_tools:fallbacks_total",
                                     {"kind": "catalog_filter"}) >= 1
    snap = reloaded.snapshot()
    assert snap["violations"]["stream_guard"] == 1 and snap["violations"]["other"] == 1
    assert snap["fallbacks"] == {"catalog_filter": 1}

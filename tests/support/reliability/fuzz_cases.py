"""The fuzz generator: hypothesis draws request bodies for both endpoints, valid and broken on
purpose (catalogs, ``tool_choice`` selections, ``parallel_tool_calls``, inputs, raw bodies), each a
:class:`Case` that says what was broken."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.request.rewrite import TEMPLATE_KWARG
from vllm_allowed_tools.wire import ALLOWLIST_KEY

from ..calls import chat_selection, responses_selection
from .fuzz_custom import CUSTOM_FAULTS, CUSTOM_FORMATS, CUSTOM_TOOL_APIS, CustomName, custom_selector, custom_tool
from .wire import MISSING, base_body

FUZZ_MAX_TOKENS = 96             # enough for the random model to finish a required call


@dataclass
class Case:
    """One generated request and what the generator knows about it."""
    api: str
    stream: bool
    body: Any                       # dict, or raw bytes
    kind: str                       # "allowed", "plain", "raw"
    faults: tuple[str, ...] = ()    # what was broken on purpose
    input_fault: str | None = None  # the top-level field broken on purpose (vLLM must reject it)
    intended: frozenset[str] | None = None   # the subset a near-miss choice meant to select

    def has_custom_tools(self) -> bool:
        tools = self.body.get("tools") if isinstance(self.body, dict) else None
        return isinstance(tools, list) and any(isinstance(tool, dict) and tool.get("type") == "custom"
                                               for tool in tools)

    def describe(self) -> str:
        body = self.body.decode(errors="replace") if isinstance(self.body, bytes) else self.body
        return json.dumps({"api": self.api, "stream": self.stream, "faults": self.faults,
                           "body": body}, default=repr)[:4000]


CATALOG_FAULTS_COMMON = ["duplicate", "non_object", "missing_name", "empty_name", "name_not_string",
                         "bad_type", "bad_parameters", "bad_strict", "bad_description",
                         "other_api_shape", "tools_not_list", "no_tools", "empty_tools",
                         "non_function_tool"]
CATALOG_FAULTS = {"chat": CATALOG_FAULTS_COMMON + ["missing_function"],
                  "responses": CATALOG_FAULTS_COMMON + ["namespace_bad_name",
                                                        "namespace_members_not_list",
                                                        "namespace_collision", "custom_tool"]}
SELECTION_FAULTS = ["tools_missing", "tools_null", "tools_empty", "tools_not_list", "other_shape",
                    "container_not_object", "entry_not_object", "entry_type_missing",
                    "entry_type_not_string", "entry_non_function", "entry_namespace_type",
                    "entry_name_missing", "entry_name_empty", "entry_name_not_string",
                    "entry_unknown", "entry_near_miss", "entry_other_api_shape", "entry_extra_keys",
                    "entry_bad_namespace", "entry_unknown_namespace", "entry_custom_kind_swapped"]
MODES = ["none", "bogus", MISSING, None, 1, "AUTO"]
PLAIN_CHOICES = [MISSING, "none", "auto", "required", "bogus", "named", "named_unknown",
                 "named_malformed", "weird_object", 7, "near_miss_type", "no_type"]
BROKEN_PLAIN_CHOICES = ("bogus", "named_unknown", "named_malformed", "weird_object", 7,
                        "near_miss_type", "no_type")
PARALLEL = [True, None, MISSING, "yes", 0, 1]
INPUT_FAULTS = {"chat": ["messages_not_list", "messages_empty", "messages_missing",
                         "max_tokens_negative", "max_tokens_string", "temperature_string",
                         "stream_not_bool", "model_unknown"],
                "responses": ["input_not_text", "input_empty", "input_missing",
                              "max_tokens_negative", "max_tokens_string", "temperature_string",
                              "stream_not_bool", "model_unknown"]}
RAW_BODIES = [b"{not json", b"[1, 2]", b'"x"', b"", b'{"model": "tiny", "messages": [',
              b"null", b"\xff\xfe"]


def _weighted(st, common: Any, rare: list[Any], common_weight: int) -> Any:
    return st.sampled_from([common] * common_weight + rare)


def _tool(api: str, tool) -> dict[str, Any]:
    return tool.chat_tool() if api == "chat" else tool.responses_tool()


# ------------------------------------------------------------------------------- catalogs

def _spare_function() -> dict[str, Any]:
    spare = POOL[-1]
    return {"name": spare.name, "description": spare.description, "parameters": spare.parameters}


def _broken_entry(api: str, fault: str, draw, st) -> Any:
    """One catalog entry broken the way `fault` says (before it is wrapped for `api`)."""
    spare, fn = POOL[-1], _spare_function()
    if fault == "non_object":
        return draw(st.sampled_from([5, "get_weather", None, [], True]))
    if fault == "missing_function":
        return {"type": "function", "name": spare.name}
    if fault == "missing_name":
        return {k: v for k, v in fn.items() if k != "name"}
    if fault == "empty_name":
        return {**fn, "name": ""}
    if fault == "name_not_string":
        return {**fn, "name": draw(st.sampled_from([3, None, ["x"], {"a": 1}]))}
    if fault == "bad_type":
        return {"type": draw(st.sampled_from([7, None, ["function"]])), **fn}
    if fault == "bad_parameters":
        return {**fn, "parameters": draw(st.sampled_from(["schema", 3, ["x"]]))}
    if fault == "bad_strict":
        return {**fn, "strict": draw(st.sampled_from(["yes", 1, {}]))}
    if fault == "bad_description":
        return {**fn, "description": draw(st.sampled_from([5, ["x"], {}]))}
    if fault == "other_api_shape":
        return spare.responses_tool() if api == "chat" else spare.chat_tool()
    if fault == "non_function_tool":
        return draw(st.sampled_from([{"type": "web_search"}, {"type": "file_search",
                                                              "vector_store_ids": ["vs"]},
                                     {"type": "mcp", "server_label": "x"}]))
    if fault == "custom_tool":
        return {"type": "custom", "name": "free_text", "description": "Free text."}
    if fault == "namespace_bad_name":
        return {"type": "namespace", "name": draw(st.sampled_from(["", 5, None])),
                "tools": [spare.responses_tool()]}
    if fault == "namespace_members_not_list":
        return {"type": "namespace", "name": "crm", "tools": draw(st.sampled_from(["x", {}, 3]))}
    raise AssertionError(fault)


def _wrapped(api: str, fault: str, broken: Any) -> Any:
    """A broken entry in the shape of `api`'s tools (unless the fault is the shape itself)."""
    if api == "chat" and isinstance(broken, dict) and fault not in (
            "other_api_shape", "non_function_tool", "missing_function", "bad_type"):
        return {"type": "function", "function": broken}
    if api == "chat" and fault == "bad_type":
        return {"type": broken["type"], "function": _spare_function()}
    if api == "responses" and isinstance(broken, dict) and "type" not in broken:
        return {"type": "function", **broken}
    return broken


def _apply_catalog_fault(api: str, tools: list, fault: str, draw, st) -> Any:
    """`tools` broken the way `fault` says (MISSING: no `tools` at all)."""
    spare = POOL[-1]
    position = draw(st.integers(0, len(tools)))
    if fault == "duplicate":
        if not tools:
            return [_tool(api, spare), _tool(api, spare)]
        return tools + [dict(tools[draw(st.integers(0, len(tools) - 1))])]
    if fault == "tools_not_list":
        return draw(st.sampled_from(["x", {}, 3, {"type": "function"}]))
    if fault == "no_tools":
        return MISSING
    if fault == "empty_tools":
        return []
    if fault == "namespace_collision":
        # a top-level crm__<name> next to namespace crm's <name>: one flat name, two identities
        broken: Any = {"type": "namespace", "name": "crm", "tools": [spare.responses_tool()]}
        tools = tools + [{**spare.responses_tool(), "name": f"crm__{spare.name}"}]
    else:
        broken = _wrapped(api, fault, _broken_entry(api, fault, draw, st))
    return tools[:position] + [broken] + tools[position:]


def _draw_catalog(draw, st, api: str, faults: list[str]) -> tuple[Any, list[str]]:
    """(tools, the names a selection may use: flat or bare) of a catalog from the pool."""
    chosen = draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=6,
                           unique_by=lambda tool: tool.name))
    tools: Any = [_tool(api, tool) for tool in chosen]
    names = [tool.name for tool in chosen]
    if api == "responses" and draw(st.integers(0, 5)) == 0 and len(chosen) > 1:
        # move some tools into a namespace; select them by bare or flat name
        split = draw(st.integers(1, len(chosen) - 1))
        tools = tools[:split] + [{"type": "namespace", "name": "crm", "description": "CRM.",
                                  "tools": tools[split:]}]
        names = names[:split] + [draw(st.sampled_from([n, f"crm__{n}"])) for n in names[split:]]
    customs: list[str] = []
    if api in CUSTOM_TOOL_APIS and draw(st.integers(0, 2)) == 0:
        # custom tools next to the functions, one broken now and then
        customs = draw(st.lists(st.sampled_from(sorted(CUSTOM_FORMATS)), min_size=1, max_size=3,
                                unique=True))
        tools = tools + [custom_tool(api, name, CUSTOM_FORMATS[name]) for name in customs]
        broken = draw(_weighted(st, None, sorted(CUSTOM_FAULTS), 2 * len(CUSTOM_FAULTS)))
        if broken is not None:
            tools.insert(draw(st.integers(0, len(tools))),
                         custom_tool(api, "broken_" + broken, CUSTOM_FAULTS[broken]))
            faults.append(f"custom:{broken}")
    catalog_fault = draw(_weighted(st, None, CATALOG_FAULTS[api], 3 * len(CATALOG_FAULTS[api])))
    if catalog_fault is not None:
        tools = _apply_catalog_fault(api, list(tools), catalog_fault, draw, st)
        faults.append(f"catalog:{catalog_fault}")
    return tools, names + [CustomName(name) for name in customs]


# ----------------------------------------------------------------------------- selections

def _selector(api: str, name: Any, **extra: Any) -> dict[str, Any]:
    if isinstance(name, CustomName):
        return {**custom_selector(api, str(name)), **extra}
    if api == "chat":
        return {"type": "function", "function": {"name": name}, **extra}
    return {"type": "function", "name": name, **extra}


def _broken_selector(api: str, fault: str, names: list[str], draw, st) -> Any:
    some = draw(st.sampled_from(names)) if names else POOL[0].name
    if fault == "entry_not_object":
        return draw(st.sampled_from([some, 3, None, [some]]))
    if fault == "entry_type_missing":
        return {k: v for k, v in _selector(api, some).items() if k != "type"}
    if fault == "entry_type_not_string":
        return {**_selector(api, some), "type": draw(st.sampled_from([1, None, ["function"]]))}
    if fault == "entry_non_function":
        return draw(st.sampled_from([{"type": "mcp", "server_label": "x"}, {"type": "web_search"},
                                     custom_selector(api, str(some)), {"type": "file_search"}]))
    if fault == "entry_custom_kind_swapped":   # a custom entry for a function, or the reverse
        return {**_selector(api, str(some))} if isinstance(some, CustomName) else \
            custom_selector(api, some)
    if fault == "entry_namespace_type":
        return {"type": "namespace", "name": "crm"}
    if fault == "entry_name_missing":
        return {"type": "function", "function": {}} if api == "chat" else {"type": "function"}
    if fault == "entry_name_empty":
        return _selector(api, "")
    if fault == "entry_name_not_string":
        return _selector(api, draw(st.sampled_from([3, None, [some], {"name": some}])))
    if fault == "entry_unknown":
        return _selector(api, draw(st.sampled_from(["no_such_tool", "Get_Weather", " ", "x" * 300,
                                                    "crm__", "__", "\u00e9t\u00e9"])))
    if fault == "entry_near_miss":
        return _selector(api, draw(st.sampled_from([some + "s", some.upper(), some[:-1], " " + some])))
    if fault == "entry_other_api_shape":
        return _selector("responses" if api == "chat" else "chat", some)
    if fault == "entry_extra_keys":   # valid: extra keys are ignored
        return _selector(api, some, description="x", parameters={"type": "object"}, strict=True)
    if fault == "entry_bad_namespace":
        return _selector(api, some, namespace=draw(st.sampled_from(["", 5, ["crm"]])))
    if fault == "entry_unknown_namespace":
        return _selector(api, some, namespace="nowhere")
    raise AssertionError(fault)


def _break_entries(draw, st, api: str, names: list[str], entries: list, fault: str | None) -> Any:
    """The `tools` list of an allowed_tools choice, broken the way `fault` says."""
    if fault == "tools_missing":
        return MISSING
    if fault == "tools_null":
        return None
    if fault == "tools_empty":
        return []
    if fault == "tools_not_list":
        return draw(st.sampled_from(["x", {"type": "function"}, 3]))
    if fault is not None and fault.startswith("entry_"):
        entry = _broken_selector(api, fault, names, draw, st)
        entries.insert(draw(st.integers(0, len(entries))), entry)
    return entries


def _draw_allowed_choice(draw, st, api: str, names: list[str], faults: list[str]) -> Any:
    """An ``allowed_tools`` tool_choice: valid, or broken in its mode, list, entries or shape."""
    mode = draw(_weighted(st, draw(st.sampled_from(["required", "auto"])), MODES, 6))
    subset = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
    fault = draw(_weighted(st, None, SELECTION_FAULTS, len(SELECTION_FAULTS)))
    if fault is not None:
        faults.append(f"selection:{fault}")
    entries = _break_entries(draw, st, api, names, [_selector(api, n) for n in subset], fault)
    if mode not in ("auto", "required"):
        faults.append(f"mode:{mode if mode is not MISSING else 'missing'}")
    shape = "chat" if api == "chat" else "responses"
    if fault == "other_shape":
        shape = "responses" if api == "chat" else "chat"
    inner = {"mode": mode, "tools": entries}
    inner = {k: v for k, v in inner.items() if v is not MISSING}
    if shape == "chat":
        choice: Any = {"type": "allowed_tools", "allowed_tools": inner}
        if fault == "container_not_object":
            choice["allowed_tools"] = draw(st.sampled_from(["x", [inner], None]))
        return choice
    if fault == "container_not_object":
        return {"type": "allowed_tools", "allowed_tools": inner}
    return {"type": "allowed_tools", **inner}


def _draw_plain_choice(draw, st, api: str, names: list[str], body: dict,
                       faults: list[str]) -> frozenset[str] | None:
    """A plain tool_choice (or a near miss of allowed_tools) set on `body`; returns the subset a
    near miss meant to select."""
    plain = draw(st.sampled_from(PLAIN_CHOICES))
    if plain in BROKEN_PLAIN_CHOICES:
        faults.append(f"plain:{plain}")
    some = draw(st.sampled_from(names))
    if plain == "named":
        body["tool_choice"] = custom_selector(api, str(some)) if isinstance(some, CustomName) \
            else _named(api, some)
    elif plain == "named_unknown":
        body["tool_choice"] = _named(api, "no_such_tool")
    elif plain == "named_malformed":
        body["tool_choice"] = {"type": "function"}
    elif plain == "weird_object":
        body["tool_choice"] = {"type": "weird"}
    elif plain in ("near_miss_type", "no_type"):
        subset = [some]
        choice = (chat_selection("auto", subset) if api == "chat"
                  else responses_selection("auto", subset))
        if plain == "no_type":
            del choice["type"]
        else:
            choice["type"] = draw(st.sampled_from(["Allowed_Tools", "allowed_tool",
                                                   "allowed-tools", "allowed_tools "]))
        body["tool_choice"] = choice
        return frozenset(subset)
    elif plain is not MISSING:
        body["tool_choice"] = plain
    return None


def _named(api: str, name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}} if api == "chat" else \
        {"type": "function", "name": name}


# ---------------------------------------------------------------------------- the rest

def _forged_allowlist(api: str) -> dict[str, Any]:
    """A policy and template block smuggled in the body: the middleware must strip them."""
    def names() -> list[str]:
        return sorted(t.name for t in POOL)
    return {ALLOWLIST_KEY: {"v": 1, "api": api, "choice": "allowed", "mode": "auto",
                            "allowed": names(), "catalog": names(), "parallel_tool_calls": True,
                            "catalog_digest": "x", "allowlist_digest": "x"},
            "chat_template_kwargs": {TEMPLATE_KWARG: {"mode": "auto", "names": names()}}}


def _apply_input_fault(api: str, body: dict, fault: str) -> None:
    tokens = "max_tokens" if api == "chat" else "max_output_tokens"
    if fault in ("messages_missing", "input_missing"):
        del body[fault.split("_")[0]]
        return
    broken = {"messages_not_list": ("messages", "Go ahead."), "messages_empty": ("messages", []),
              "input_not_text": ("input", 5), "input_empty": ("input", []),
              "max_tokens_negative": (tokens, -1), "max_tokens_string": (tokens, "many"),
              "temperature_string": ("temperature", "hot"), "stream_not_bool": ("stream", "maybe"),
              "model_unknown": ("model", "no-such-model")}
    if fault not in broken:
        raise AssertionError(fault)
    key, value = broken[fault]
    body[key] = value


def _draw_tail(draw, st, api: str, body: dict, faults: list[str]) -> str | None:
    """parallel_tool_calls, a forged allowlist now and then, and a broken input field; returns
    the input field broken on purpose."""
    parallel = draw(_weighted(st, False, PARALLEL, 8))
    if parallel is not MISSING:
        body["parallel_tool_calls"] = parallel
    if parallel not in (False, True, None, MISSING):
        faults.append(f"parallel:{parallel!r}")
    if draw(st.integers(0, 9)) == 0:
        body.update(_forged_allowlist(api))
    input_fault = draw(_weighted(st, None, INPUT_FAULTS[api], 3 * len(INPUT_FAULTS[api])))
    if input_fault is not None:
        _apply_input_fault(api, body, input_fault)
        faults.append(f"input:{input_fault}")
    return input_fault


def fuzz_cases():
    """The hypothesis strategy of fuzz :class:`Case` s."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw) -> Case:
        api = draw(st.sampled_from(["chat", "responses"]))
        stream = draw(st.booleans())
        if draw(st.integers(0, 39)) == 0:
            return Case(api, stream, draw(st.sampled_from(RAW_BODIES)), "raw", ("raw_body",))
        faults: list[str] = []
        tools, names = _draw_catalog(draw, st, api, faults)
        content = draw(st.sampled_from(["Go ahead.", "hi", "\u00e9\u00e8 " * 40]))
        body = base_body(api, FUZZ_MAX_TOKENS, content)
        if tools is not MISSING:
            body["tools"] = tools
        kind = draw(st.sampled_from(["allowed", "allowed", "plain"]))
        intended = None
        if kind == "allowed":
            body["tool_choice"] = _draw_allowed_choice(draw, st, api, names, faults)
        else:
            intended = _draw_plain_choice(draw, st, api, names, body, faults)
        input_fault = _draw_tail(draw, st, api, body, faults)
        if stream and input_fault != "stream_not_bool":
            body["stream"] = True
        return Case(api, stream, body, kind, tuple(f for f in faults if f), input_fault, intended)

    return strategy()

"""Property tests of the tool policy: never widen, exact resolution, order-free digests."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.errors import InvalidSelectionError
from vllm_allowed_tools.request import ToolIdentity, catalog_digest, resolve_allowlist

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Small alphabets so that "__", shared bare names and flat-name coincidences actually happen.
names = st.text(alphabet="ab_", min_size=1, max_size=5)
json_leaf = st.none() | st.booleans() | st.integers(-3, 3) | st.text(alphabet="xyz", max_size=3)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(alphabet="pqr", max_size=3), inner, max_size=3),
                          max_leaves=6)
schemas = st.none() | st.dictionaries(st.text(alphabet="pqrs", max_size=4), json_value, max_size=4)
descriptions = st.none() | st.text(max_size=6)
stricts = st.none() | st.booleans()


@dataclass
class Fn:
    namespace: str | None
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None

    @property
    def identity(self) -> ToolIdentity:
        return ToolIdentity(self.namespace, self.name)

    def responses(self) -> dict[str, Any]:
        tool: dict[str, Any] = {"type": "function", "name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                tool[key] = copy.deepcopy(getattr(self, key))
        return tool

    def chat(self) -> dict[str, Any]:
        tool = self.responses()
        del tool["type"]
        return {"type": "function", "function": tool}


fns = st.builds(Fn, st.none(), names, descriptions, schemas, stricts)


@st.composite
def catalogs(draw: st.DrawFn, *, unique: bool = True) -> tuple[list[dict[str, Any]], list[Fn]]:
    """A Responses `tools` array (functions, namespaces, hosted tools, custom namespace members)
    and its functions.

    With ``unique`` every flat name occurs once (what allowed_tools accepts)."""
    groups: list[tuple[str | None, list[Fn]]] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            groups.append((None, [draw(fns)]))
        else:
            namespace = draw(names)
            members = draw(st.lists(fns, min_size=0, max_size=3))
            for member in members:
                member.namespace = namespace
            groups.append((namespace, members))
    seen: set[str] = set()
    tools: list[dict[str, Any]] = []
    functions: list[Fn] = []
    for namespace, members in groups:
        kept = []
        for fn in members:
            if unique and fn.identity.flat_name in seen:
                continue
            seen.add(fn.identity.flat_name)
            kept.append(fn)
        functions.extend(kept)
        if namespace is None:
            tools.extend(fn.responses() for fn in kept)
        else:
            member_tools = [fn.responses() for fn in kept]
            if draw(st.booleans()):
                member_tools.append({"type": "custom", "name": draw(names)})
            tools.append({"type": "namespace", "name": namespace, "description": "d",
                          "tools": member_tools})
        if draw(st.booleans()):   # (a top-level custom tool is a catalog entry: test_custom_tools)
            tools.append(draw(st.sampled_from([{"type": "web_search"}, {"type": "file_search"},
                                               {"type": "image_generation"}])))
    return tools, functions


def responses_body(tools: list[Any], selectors: list[Any], mode: str = "auto",
                   **extra: Any) -> dict[str, Any]:
    return {"tools": tools, "tool_choice": {"type": "allowed_tools", "mode": mode, "tools": selectors},
            **extra}


def chat_body(tools: list[Any], names_: list[str], mode: str = "auto") -> dict[str, Any]:
    return {"tools": tools, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names_]}}}


def reorder_keys(obj: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys in another order (lists keep their order)."""
    if isinstance(obj, dict):
        keys = list(obj)
        rnd.shuffle(keys)
        return {key: reorder_keys(obj[key], rnd) for key in keys}
    if isinstance(obj, list):
        return [reorder_keys(item, rnd) for item in obj]
    return obj


def flip_strict(obj: Any, rnd: random.Random) -> Any:
    if isinstance(obj, dict):
        out = {key: flip_strict(value, rnd) for key, value in obj.items()}
        if out.get("type") == "function" and "name" in out:
            choice = rnd.choice([None, True, False])
            out.pop("strict", None)
            if choice is not None:
                out["strict"] = choice
        return out
    if isinstance(obj, list):
        return [flip_strict(item, rnd) for item in obj]
    return obj


def shuffle_tools(tools: list[Any], rnd: random.Random) -> list[Any]:
    out = copy.deepcopy(tools)
    rnd.shuffle(out)
    for tool in out:
        if tool.get("type") == "namespace":
            rnd.shuffle(tool["tools"])
    return out


# --------------------------------------------------------------------------------------------------
# resolution


@SETTINGS
@given(catalogs(), st.data())
def test_allowlist_is_exactly_the_selection(catalog: tuple[list[Any], list[Fn]], data: st.DataObject) -> None:
    tools, functions = catalog
    if not functions:
        with pytest.raises(InvalidSelectionError) as info:
            resolve_allowlist(responses_body(tools, [{"type": "function", "name": "a"}]), "responses")
        assert info.value.reason == "no_function_tools"
        return
    chosen = data.draw(st.lists(st.sampled_from(functions), min_size=1, max_size=6))
    selectors = []
    for fn in chosen:  # flat names and explicit namespaces both address exactly one identity
        if fn.namespace is not None and data.draw(st.booleans()):
            selectors.append({"type": "function", "name": fn.name, "namespace": fn.namespace})
        else:
            selectors.append({"type": "function", "name": fn.identity.flat_name})
    mode = data.draw(st.sampled_from(["auto", "required"]))
    parallel = data.draw(st.sampled_from([True, False, None]))
    policy = resolve_allowlist(responses_body(tools, selectors, mode, parallel_tool_calls=parallel),
                            "responses")
    assert policy is not None
    expected = {fn.identity for fn in chosen}
    assert policy.allowed == expected
    assert policy.allowed <= {spec.identity for spec in policy.catalog}
    assert {spec.identity for spec in policy.catalog} == {fn.identity for fn in functions}
    assert policy.mode == mode and policy.internal_tool_choice() == mode
    assert policy.parallel_tool_calls is (parallel is not False)
    for fn in functions:
        assert policy.is_allowed(fn.identity.flat_name) is (fn.identity in expected)
    assert {s.identity for s in policy.allowed_specs} == expected


@SETTINGS
@given(catalogs(), st.data())
def test_bare_names_follow_the_documented_order(catalog: tuple[list[Any], list[Fn]],
                                                data: st.DataObject) -> None:
    tools, functions = catalog
    members = [fn for fn in functions if fn.namespace is not None]
    assume(members)
    bare = data.draw(st.sampled_from(members)).name
    top_level = {fn.name: fn.identity for fn in functions if fn.namespace is None}
    flat = {fn.identity.flat_name: fn.identity for fn in members}
    same_bare = sorted(fn.identity.flat_name for fn in members if fn.name == bare)
    body = responses_body(tools, [{"type": "function", "name": bare}])
    if bare in top_level or bare in flat or len(same_bare) == 1:
        expected = top_level.get(bare) or flat.get(bare) or next(
            fn.identity for fn in members if fn.name == bare)
        policy = resolve_allowlist(body, "responses")
        assert policy is not None and policy.allowed == {expected}
    else:
        with pytest.raises(InvalidSelectionError) as info:
            resolve_allowlist(body, "responses")
        assert info.value.reason == "ambiguous_name"
        assert all(name in info.value.message for name in same_bare)


@SETTINGS
@given(st.lists(fns, min_size=1, max_size=6, unique_by=lambda fn: fn.name), st.data())
def test_chat_allowlist_is_exactly_the_selection(functions: list[Fn], data: st.DataObject) -> None:
    chosen = data.draw(st.lists(st.sampled_from(functions), min_size=1, max_size=6))
    policy = resolve_allowlist(chat_body([fn.chat() for fn in functions], [fn.name for fn in chosen]),
                            "chat")
    assert policy is not None
    assert policy.allowed == {ToolIdentity(None, fn.name) for fn in chosen}
    for fn in functions:  # names containing "__" are plain names in Chat: never split
        assert policy.lookup(fn.name).identity == ToolIdentity(None, fn.name)


@SETTINGS
@given(catalogs(), st.data())
def test_non_function_and_unknown_selectors_are_rejected(catalog: tuple[list[Any], list[Fn]],
                                                         data: st.DataObject) -> None:
    tools, functions = catalog
    assume(functions)
    good = [{"type": "function", "name": fn.identity.flat_name} for fn in functions]
    resolvable = ({fn.identity.flat_name for fn in functions}
                  | {fn.name for fn in functions if fn.namespace is not None})
    kind = data.draw(st.sampled_from(["non_function", "unknown"]))
    if kind == "non_function":
        bad_type = data.draw(st.sampled_from(["mcp", "web_search", "file_search",
                                              "namespace", "image_generation"])
                             | st.text(max_size=8).filter(lambda t: t not in ("function", "custom")))
        bad = {"type": bad_type, "name": data.draw(st.sampled_from(functions)).identity.flat_name,
               "server_label": "x"}
    else:
        bad = {"type": "function",
               "name": data.draw(st.text(alphabet="ab_cz", min_size=1, max_size=7)
                                 .filter(lambda n: n not in resolvable))}
    selectors = data.draw(st.permutations([*good[: data.draw(st.integers(0, len(good)))], bad]))
    with pytest.raises(InvalidSelectionError) as info:
        resolve_allowlist(responses_body(tools, selectors), "responses")
    err = info.value
    assert err.status == 400
    assert err.reason == ("non_function_selector" if kind == "non_function" else "unknown_function")
    index = selectors.index(bad)
    assert err.param == f"tool_choice.tools[{index}]." + ("type" if kind == "non_function" else "name")


# --------------------------------------------------------------------------------------------------
# digests


@SETTINGS
@given(catalogs(unique=False), st.randoms(use_true_random=False))
def test_catalog_digest_ignores_order_keys_and_strict(catalog: tuple[list[Any], list[Fn]],
                                                      rnd: random.Random) -> None:
    tools, functions = catalog
    variant = flip_strict(reorder_keys(shuffle_tools(tools, rnd), rnd), rnd)
    assert catalog_digest(variant, "responses") == catalog_digest(tools, "responses")
    flat_names = [fn.identity.flat_name for fn in functions]
    if len(set(flat_names)) < len(flat_names):
        # two definitions of one flat name: refused under every choice, in any order
        for body_tools in (tools, variant):
            with pytest.raises(InvalidSelectionError) as info:
                resolve_allowlist({"tools": body_tools, "tool_choice": "auto"}, "responses")
            assert info.value.reason in ("duplicate_tool", "ambiguous_name")
    else:
        p1 = resolve_allowlist({"tools": tools, "tool_choice": "auto"}, "responses")
        p2 = resolve_allowlist({"tools": variant, "tool_choice": "auto"}, "responses")
        assert p1 is not None and p2 is not None
        assert [s.digest for s in p1.catalog] == [s.digest for s in p2.catalog]
        assert [s.identity for s in p1.catalog] == [s.identity for s in p2.catalog]


@SETTINGS
@given(catalogs(unique=False), st.data())
def test_catalog_digest_changes_with_any_definition(catalog: tuple[list[Any], list[Fn]],
                                                    data: st.DataObject) -> None:
    tools, functions = catalog
    assume(functions)
    changed = copy.deepcopy(tools)
    definitions = [tool for tool in changed if tool.get("type") == "function"] + [
        member for tool in changed if tool.get("type") == "namespace"
        for member in tool["tools"] if member.get("type") == "function"]
    target = data.draw(st.sampled_from(definitions))
    field = data.draw(st.sampled_from(["name", "description", "parameters"]))
    if field == "name":
        target["name"] = target["name"] + "x"
    elif field == "description":
        target["description"] = (target.get("description") or "") + "!"
    else:
        target["parameters"] = {"wrapped": target.get("parameters")}
    assert catalog_digest(changed, "responses") != catalog_digest(tools, "responses")


@SETTINGS
@given(catalogs(), st.data())
def test_selection_never_touches_the_catalog(catalog: tuple[list[Any], list[Fn]],
                                             data: st.DataObject) -> None:
    tools, functions = catalog
    assume(functions)
    picks = [data.draw(st.lists(st.sampled_from(functions), min_size=1, max_size=4)) for _ in range(2)]
    policies = [resolve_allowlist(responses_body(tools, [{"type": "function", "name": fn.identity.flat_name}
                                                      for fn in pick]), "responses")
                for pick in picks]
    assert policies[0].catalog == policies[1].catalog
    assert policies[0].catalog_digest == policies[1].catalog_digest == catalog_digest(tools, "responses")
    same = {fn.identity for fn in picks[0]} == {fn.identity for fn in picks[1]}
    assert (policies[0].allowlist_digest == policies[1].allowlist_digest) is same


@SETTINGS
@given(catalogs(), st.data(), st.randoms(use_true_random=False))
def test_allowlist_digest_ignores_selector_order_and_duplicates(
        catalog: tuple[list[Any], list[Fn]], data: st.DataObject, rnd: random.Random) -> None:
    tools, functions = catalog
    assume(functions)
    pick = data.draw(st.lists(st.sampled_from(functions), min_size=1, max_size=4))
    selectors = [{"type": "function", "name": fn.identity.flat_name} for fn in pick]
    noisy = selectors + [copy.deepcopy(rnd.choice(selectors))]
    rnd.shuffle(noisy)
    a = resolve_allowlist(responses_body(tools, selectors), "responses")
    b = resolve_allowlist(responses_body(shuffle_tools(tools, rnd), noisy), "responses")
    assert a.allowlist_digest == b.allowlist_digest
    assert a.catalog_digest == b.catalog_digest


@SETTINGS
@given(st.lists(fns, min_size=1, max_size=6, unique_by=lambda fn: fn.name), st.randoms(use_true_random=False))
def test_chat_and_responses_digests_agree(functions: list[Fn], rnd: random.Random) -> None:
    chat_tools = [fn.chat() for fn in functions]
    rnd.shuffle(chat_tools)
    assert catalog_digest(chat_tools, "chat") == catalog_digest([fn.responses() for fn in functions],
                                                                "responses")


# --------------------------------------------------------------------------------------------------
# robustness: any JSON body either resolves or fails with an InvalidSelectionError


def _shapes(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["type", "name", "function", "tools", "mode", "allowed_tools", "namespace",
                            "parameters", "description", "strict"])
    return st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4)


request_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2)
    | st.sampled_from(["", "a", "a__b", "function", "namespace", "allowed_tools", "auto", "required",
                       "none", "custom", "mcp"]),
    _shapes, max_leaves=12)


@SETTINGS
@given(st.sampled_from(["responses", "chat"]), request_json, request_json, request_json)
def test_arbitrary_bodies_resolve_or_fail_cleanly(api: str, tools: Any, tool_choice: Any,
                                                  parallel: Any) -> None:
    for choice in (tool_choice, {"type": "allowed_tools", "mode": "auto", "tools": tool_choice},
                   {"type": "allowed_tools", "allowed_tools": tool_choice}):
        body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
        try:
            policy = resolve_allowlist(body, api)  # type: ignore[arg-type]
        except InvalidSelectionError as err:
            assert err.status == 400 and err.reason and err.param
            continue
        if policy is not None:
            catalog_ids = {spec.identity for spec in policy.catalog}
            assert policy.allowed is None or policy.allowed <= catalog_ids
            if policy.choice == "allowed":
                assert policy.allowed

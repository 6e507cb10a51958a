"""Rewrite a client request for vanilla vLLM, and carry the turn's allowlist along with it.

Pure functions over JSON bodies (no vLLM): the ASGI middleware calls :func:`rewrite_request` on the
way in and :func:`restore_echo` on the way out. What the rewrite changes, and why a client can never
smuggle in an allowlist or a grammar, is in ``docs/request-path.md``."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..wire import ALLOWLIST_KEY, XARGS_KEYS, allowlist_to_wire
from .turn_allowlist import TurnAllowlist, allowlist_digest, resolve_allowlist
from .catalog import Api
from .custom_tools import is_grammar_tool, read_custom_tools, served_messages
from .placement import TEMPLATE_KWARG, TEMPLATE_VARIABLE, canonical_tools
from .typed_fields import normalise_fields


@dataclass(frozen=True)
class Rewritten:
    body: dict[str, Any]
    allowlist: TurnAllowlist | None
    original_tool_choice: Any
    changed: bool
    request: dict[str, Any]   # the client's body with its typed fields read as vLLM reads them
    original_tools: Any = None   # the client's ``tools`` where they were put in canonical form


def rewrite_request(body: Mapping[str, Any], api: Api, placement: str = TEMPLATE_VARIABLE,
                    check_turn: Callable[[TurnAllowlist | None], None] | None = None) -> Rewritten:
    """Resolve the allowlist and rewrite the body; raises InvalidSelectionError (a 400) on bad input.

    ``tools`` go out in canonical form (the stable prompt prefix, whatever order the client sends
    them in); the policy travels in ``chat_template_kwargs`` where the template reads it
    (``placement``), otherwise the caller places it last (:func:`.placement.place_policy`).
    ``check_turn``: what the decode side must refuse of the resolved turn before generation, once
    the tools are read (the server's format cannot hold a selected custom grammar tool to its
    grammar: a CapabilityError, 400); the caller lends it, so the request path imports no decoding."""
    request = normalise_fields(body, api)
    new = dict(request)
    changed = any(new.get(key) is not body.get(key) for key in new)
    if ALLOWLIST_KEY in new:
        del new[ALLOWLIST_KEY]
        changed = True
    kwargs = new.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping) and TEMPLATE_KWARG in kwargs:
        new["chat_template_kwargs"] = {k: v for k, v in kwargs.items() if k != TEMPLATE_KWARG}
        changed = True
    xargs = new.get("vllm_xargs")
    if isinstance(xargs, Mapping) and any(key in xargs for key in XARGS_KEYS):   # the wrapper's only
        new["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in XARGS_KEYS}
        changed = True
    allowlist = resolve_allowlist(new, api)
    original = body.get("tool_choice")
    original_tools = None
    custom = read_custom_tools(new.get("tools"), api)
    if check_turn is not None:
        check_turn(allowlist)
    if isinstance(new.get("tools"), list):
        tools = canonical_tools(custom.served_tools or new["tools"], api)
        if json.dumps(tools) != json.dumps(new["tools"]):   # order matters here, keys included
            original_tools, new["tools"], changed = body.get("tools"), tools, True
    if api == "chat":
        messages = served_messages(new.get("messages"))
        if messages is not None:
            new["messages"], changed = messages, True
        if allowlist is not None and allowlist.choice == "named" and allowlist.allowed_specs \
                and allowlist.allowed_specs[0].kind == "custom":
            # vLLM's Chat validation takes named functions only: the custom tool's function
            new["tool_choice"] = {"type": "function",
                                  "function": {"name": allowlist.allowed_specs[0].flat_name}}
            changed = True
    if allowlist is None or not allowlist.has_allowlist:
        wire = custom_inputs_allowlist(allowlist)
        if wire is not None:   # the wrapper then builds the grammar, each custom input held to its own
            new[ALLOWLIST_KEY], changed = allowlist_to_wire(wire), True
        return Rewritten(new, allowlist, original, changed, request, original_tools)
    new["tool_choice"] = allowlist.internal_tool_choice()
    new[ALLOWLIST_KEY] = allowlist_to_wire(allowlist)
    if placement != TEMPLATE_VARIABLE:
        return Rewritten(new, allowlist, original, True, request, original_tools)
    template_kwargs = dict(new.get("chat_template_kwargs") or {})
    template_kwargs[TEMPLATE_KWARG] = {"mode": allowlist.mode,
                                       "names": sorted(allowlist.allowed_flat_names)}
    new["chat_template_kwargs"] = template_kwargs
    return Rewritten(new, allowlist, original, True, request, original_tools)


def custom_inputs_allowlist(allowlist: TurnAllowlist | None) -> TurnAllowlist | None:
    """The wire allowlist of a plain ``required`` turn or a named choice that can call a custom
    tool with a grammar (None otherwise): what the turn may call, as an ``allowed`` turn in
    ``required`` mode (a named choice: one call), so the wrapper builds the turn's grammar itself
    and holds each custom input to its grammar, where vLLM's own grammar for these choices leaves
    the ``input`` string free. ``tools``, ``tool_choice`` and the prompt stay the client's."""
    if allowlist is None or allowlist.choice not in ("named", "required") or not any(
            spec.kind == "custom" and spec.grammar is not None for spec in allowlist.allowed_specs):
        return None
    allowed = frozenset(spec.identity for spec in allowlist.allowed_specs)
    parallel = allowlist.parallel_tool_calls and allowlist.choice == "required"
    return replace(allowlist, choice="allowed", mode="required", allowed=allowed,
                   parallel_tool_calls=parallel,
                   allowlist_digest=allowlist_digest("allowed", "required", allowed, parallel))


def narrow_allowlist(rewritten: Rewritten, remove: Collection[str]) -> Rewritten:
    """Take the tools named in ``remove`` (flat names) out of what the grammar and the parser admit
    this turn, and nothing else: only the wire allowlist changes (one is added to a plain ``auto`` /
    ``required`` request), while ``tools``, ``tool_choice`` and the template's policy block keep
    the client's choice, so the rendered prompt is byte for byte the same. A named choice is never
    narrowed (its one tool is either callable or refused before this)."""
    allowlist = rewritten.allowlist
    if allowlist is None or allowlist.choice not in ("auto", "required", "allowed"):
        return rewritten
    callable_ids = frozenset(spec.identity for spec in allowlist.allowed_specs)
    kept = frozenset(spec.identity for spec in allowlist.allowed_specs
                     if spec.flat_name not in remove)
    if kept == callable_ids:
        return rewritten
    mode = allowlist.mode or allowlist.choice
    narrowed = replace(allowlist, choice="allowed", mode=mode, allowed=kept,
                       allowlist_digest=allowlist_digest("allowed", mode, kept,
                                                         allowlist.parallel_tool_calls))
    body = {**rewritten.body, ALLOWLIST_KEY: allowlist_to_wire(narrowed)}
    return replace(rewritten, body=body, changed=True)


#: request fields that ask vLLM for another grammar; a plain request carrying one keeps vLLM's own
_OTHER_GRAMMARS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")


def constrain_to_catalog(rewritten: Rewritten, api: Api, *, required: bool = False) -> Rewritten:
    """A plain ``auto`` request gets the whole catalog as its wire allowlist: decoding then admits
    only names the request offers, in every call (vLLM itself constrains names only for
    ``required``, named choices and ``strict`` tools), while arguments stay as vanilla vLLM leaves
    them (pinned for strict tools only) and the prompt is untouched. ``required``: a plain
    ``required`` request gets one too (in ``required`` mode), so the turn is decoded in the
    format's own call syntax rather than as vLLM's JSON array (formats whose calls are not JSON,
    such as the pythonic ones). Requests that ask for another grammar (a response format) keep
    vLLM's; the output guard stays the backstop for them."""
    allowlist = rewritten.allowlist
    body = rewritten.body
    modes = ("auto", "required") if required else ("auto",)
    if allowlist is None or allowlist.choice not in modes or ALLOWLIST_KEY in body \
            or any(body.get(key) is not None for key in _OTHER_GRAMMARS) or _text_format(body, api):
        return rewritten
    callable_ids = frozenset(spec.identity for spec in allowlist.allowed_specs)
    if not callable_ids:
        return rewritten
    mode = allowlist.choice
    catalog_wide = replace(allowlist, choice="allowed", mode=mode, allowed=callable_ids,
                           allowlist_digest=allowlist_digest("allowed", mode, callable_ids,
                                                             allowlist.parallel_tool_calls))
    return replace(rewritten, body={**body, ALLOWLIST_KEY: allowlist_to_wire(catalog_wide)},
                   changed=True)


def _text_format(body: Mapping[str, Any], api: Api) -> bool:
    text = body.get("text") if api == "responses" else None
    kind = text.get("format", {}).get("type") if isinstance(text, Mapping) \
        and isinstance(text.get("format"), Mapping) else None
    return kind not in (None, "text")


def filter_catalog(body: dict[str, Any], allowlist: TurnAllowlist) -> dict[str, Any]:
    """The compatibility fallback: keep only the allowed function tools (and namespace members) in
    ``tools``; other tool types are left as they are. Opt-in only: it changes the prompt whenever
    the subset changes, which is exactly what the tail policy block exists to avoid."""
    allowed = {(identity.namespace, identity.name) for identity in allowlist.allowed or ()}
    kept: list[Any] = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, Mapping):
            kept.append(tool)
            continue
        kind = tool.get("type")
        if kind == "function":
            name = tool.get("function", {}).get("name") if allowlist.api == "chat" else tool.get("name")
            if (None, name) in allowed:
                kept.append(tool)
        elif kind == "namespace" and allowlist.api == "responses":
            members = [m for m in tool.get("tools") or []
                       if isinstance(m, Mapping) and (tool.get("name"), m.get("name")) in allowed]
            if members:
                kept.append({**tool, "tools": members})
        else:
            kept.append(tool)
    return {**body, "tools": kept}


#: request fields a Responses object echoes that vLLM 0.32 leaves out
_UNECHOED = ("prompt_cache_key", "safety_identifier")


def echo_of(rewritten: Rewritten, api: Api) -> dict[str, Any]:
    """The request fields a Responses object must echo as the client sent them, not as vLLM saw
    them: an allowed-tools ``tool_choice``, ``tools`` put in canonical order, and the request
    fields vLLM 0.32 does not echo at all (``prompt_cache_key``, ``safety_identifier``)."""
    if api != "responses":
        return {}
    echo: dict[str, Any] = {key: rewritten.request[key] for key in _UNECHOED
                            if isinstance(rewritten.request.get(key), str)}
    if rewritten.allowlist is not None and rewritten.allowlist.choice != "none":
        # vLLM echoes the JSON schema it builds for a required turn as the text format
        text = rewritten.request.get("text")
        echo["text"] = text if isinstance(text, Mapping) and text.get("format") \
            else {"format": {"type": "text"}}
    if rewritten.allowlist is not None and (rewritten.allowlist.has_allowlist or (
            ALLOWLIST_KEY in rewritten.body and rewritten.original_tool_choice is not None)):
        # the wire allowlist may make vLLM see another choice (a required turn the format's
        # parser reads is ``auto`` to vLLM): the client's own is echoed
        echo["tool_choice"] = rewritten.original_tool_choice
    if rewritten.original_tools is not None:
        echo["tools"] = rewritten.original_tools
    return echo


def restore_echo(response_object: Any, echo: Mapping[str, Any]) -> Any:
    """Put the client's own fields (:func:`echo_of`) back into a Responses object; ``tools`` as
    the response echoes them (in the shape it gives every tool), in the client's order."""
    if isinstance(response_object, dict) and response_object.get("object") == "response":
        for key, value in echo.items():
            if key == "tools" and isinstance(response_object.get("tools"), list):
                response_object["tools"] = _in_client_order(response_object["tools"], value)
            elif key in response_object:
                response_object[key] = value
    return response_object


def _tool_key(tool: Any) -> Any:
    return json.dumps([tool.get("type"), tool.get("name")]) if isinstance(tool, Mapping) else None


def _in_client_order(echoed: list[Any], client_tools: Any) -> list[Any]:
    """``echoed`` reordered as ``client_tools`` (matched by type and name), a grammar custom tool
    as the client sent it; as it is when the two do not match one to one."""
    by_key = {_tool_key(tool): tool for tool in echoed}
    order = [_tool_key(tool) for tool in client_tools] if isinstance(client_tools, list) else []
    if len(by_key) != len(echoed) or sorted(map(str, order)) != sorted(map(str, by_key)):
        return echoed
    # a grammar custom tool went to vLLM as a text tool: the client's own comes back
    return [tool if is_grammar_tool(tool) else by_key[key] for key, tool in zip(order, client_tools)]

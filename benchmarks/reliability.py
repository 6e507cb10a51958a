"""Reliability figures: request fuzzing, concurrent load and client faults against a real server.

    python benchmarks/reliability.py [--fuzz-examples 2000] [--load-requests 64] [--load-rounds 10]
                                     [--disconnects 16] [--json OUT]
    python benchmarks/reliability.py --base-url http://127.0.0.1:8000/v1 --server-pid PID ...
    python benchmarks/reliability.py --skip fuzz --skip load --skip faults   # grant-store faults only

Without ``--base-url`` it starts its own server (``vllm-allowed-tools serve-tiny``, random tiny
model, the plugin on) and stops it at the end. ``--server-pid`` (the PID of the ``serve-tiny`` or
``vllm serve`` process) is only needed for the RSS figures of a server it did not start. Progress
goes to stderr; stdout gets a markdown figures table (and ``--json`` the raw figures). Exit 0 when
every figure is clean, 1 when one is not (5xx, a leaked call, a hang, a 4xx without a field, an
unexpected outcome, a stream not aborted), 2 when the run could not happen.

Five parts, the same code the CI tests run (``tests/test_reliability_e2e.py``,
``tests/test_grant_store_faults_e2e.py``) at a smaller size:

**Fuzz.** Hypothesis generates request bodies for ``/v1/chat/completions`` and ``/v1/responses``,
unary and streaming: catalogs drawn from the tiny models' tool pool (enum-only, strict), with
malformed entries (non-objects, missing/empty/non-string names, bad parameters/strict/description,
the other API's shape, duplicates, namespaces, non-function tools); ``tool_choice`` as valid and
broken ``allowed_tools`` selections (both shapes, every mode, unknown/ambiguous/non-function/
malformed selectors, empty/missing lists), plain choices, near-miss types; ``parallel_tool_calls``
of every JSON type; malformed inputs (messages, input, max tokens, temperature, stream, model); a
forged policy smuggled in the body; raw non-JSON / non-object bodies. What each request should get
is computed locally with :func:`vllm_allowed_tools.request.rewrite.rewrite_request` (typed fields read
as vLLM reads them, then the policy):

* it raises: a 400 from the plugin with exactly that ``error.param``;
* a malformed input: a 4xx naming the field (``error.param``, or a field name in the message:
  vLLM's own validation errors);
* a valid ``allowed_tools`` selection: 200, and every returned call is in THAT request's resolved
  subset (at most one with ``parallel_tool_calls: false``), and a Responses object echoes the
  client's own ``tool_choice``;
* anything else is vanilla vLLM's to judge: 2xx or a 4xx naming a field, never a 5xx, and calls only
  from the request's catalog.

No request may take longer than the timeout (a hang), and no 200 stream may end without its
terminal event or carry an error event.

**Load.** Rounds of the same many concurrent streaming requests (both endpoints,
``required``/``auto`` alternating, each request with its own catalog and its own 1-3-tool subset,
``parallel_tool_calls: false``, no ``seed``). Every stream must complete; every call must be in its
own request's subset (a call from another request's subset is counted as a cross-request mix-up)
with schema-valid arguments (unless max tokens cut it); every Responses object must echo its own
request's ``tool_choice``. The RSS of the server process tree is taken after each round, by role
(API server: HTTP, middleware, guard, parsers; engine core: scheduler, grammars; worker: model, KV
cache): the API server and engine core must stay flat after the first (warm-up) round (at most
max(32 MiB, 3 %)); the worker may only grow into its 1 GiB KV cache (see
:func:`rss_growth_problems`).

**Faults.** The client closes the connection: mid-stream after a few events (streams with
``ignore_eos`` and a 30000-token budget, both endpoints, with and without a policy), right after
sending a unary request, and in the middle of sending the body. Each engine request must be aborted:
``vllm:request_success_total`` unchanged (a request that is not aborted runs to its budget and
finishes; vLLM 0.32 counts no aborts), ``vllm:num_requests_running`` back to 0, and
``vllm:generation_tokens_total`` short of the budget (the figures give how far). The server must still
answer afterwards.

**Grant store unavailable** (``store``; servers of its own, approvals on): the SQLite store's folder
moved away, its write lock held by another process, and (with PostgreSQL server binaries on PATH)
the PostgreSQL server stopped, each while the server runs. Gated turns and elicitation answers must
get 503 ``grant_store_unavailable`` (a started stream: one ``response.failed`` with that code) and
never the gated call; turns that cannot call a gated tool must keep working; the server recovers
when the store is back. See :func:`run_store_outage`.

**Server SIGKILLed** (``kill``): approval flows from 4 threads; the server's process group is
SIGKILLed while an answer is in flight, and restarted on the same SQLite store: every grant the
client was told about must be there and usable, the store intact. See :func:`run_kill`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from vllm_allowed_tools.errors import AllowedToolsError
from vllm_allowed_tools.request.rewrite import ALLOWLIST_KEY, TEMPLATE_KWARG, rewrite_request
from vllm_allowed_tools.testing.calls import chat_selection, responses_selection
from vllm_allowed_tools.testing.metrics import scrape_metric
from vllm_allowed_tools.testing.server import ServeTinyProcess, start_serve_tiny
from vllm_allowed_tools.testing.store_faults import sqlite_locked
from vllm_allowed_tools.testing.tool_pool import POOL, POOL_BY_NAME

PATHS = {"chat": "/chat/completions", "responses": "/responses"}
MISSING: Any = object()          # a field the request leaves out
REQUEST_TIMEOUT = 60.0           # a request that takes longer is a hang
FUZZ_MAX_TOKENS = 96             # enough for the random model to finish a required call
LOAD_MAX_TOKENS = 96
DISCONNECT_BUDGET = 30000        # tokens a disconnected request would generate if not aborted


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# =========================================================================================== wire

def base_body(api: str, max_tokens: int, content: str = "Go ahead.") -> dict[str, Any]:
    if api == "chat":
        return {"model": "tiny", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 1.0}
    return {"model": "tiny", "input": content, "max_output_tokens": max_tokens, "temperature": 1.0}


@dataclass
class Observed:
    """What came back for one request."""
    status: int | None = None              # None: no answer (timeout / connection error)
    error: dict | None = None              # the JSON error object of a non-2xx answer
    calls: list[tuple[str | None, str]] = field(default_factory=list)   # (flat name, arguments)
    echoes: list[Any] = field(default_factory=list)   # tool_choice of every Responses object seen
    stream_error: Any = None               # an error event inside a 200 stream
    terminal: bool = True                  # a 200 stream ended with its terminal event
    finish: str | None = None              # finish_reason / response status
    elapsed: float = 0.0
    transport_error: str | None = None


def _flat(name: Any, namespace: Any = None) -> str | None:
    if not isinstance(name, str):
        return None
    return f"{namespace}__{name}" if isinstance(namespace, str) and namespace else name


def _responses_output_calls(response: dict) -> list[tuple[str | None, str]]:
    return [(_flat(item.get("name"), item.get("namespace")), item.get("arguments") or "")
            for item in response.get("output") or [] if isinstance(item, dict)
            and item.get("type") in ("function_call", "custom_tool_call")]


def parse_unary(api: str, status: int, payload: Any, observed: Observed) -> None:
    observed.status = status
    if status != 200 or not isinstance(payload, dict):
        observed.error = payload.get("error") if isinstance(payload, dict) else {"raw": payload}
        return
    if api == "chat":
        choice = (payload.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        observed.calls = [(_flat((c.get("function") or {}).get("name")),
                           (c.get("function") or {}).get("arguments") or "")
                          for c in message.get("tool_calls") or []]
        observed.finish = choice.get("finish_reason")
    else:
        observed.calls = _responses_output_calls(payload)
        observed.echoes.append(payload.get("tool_choice"))
        observed.finish = payload.get("status")


def parse_stream(api: str, lines: Iterable[str], observed: Observed) -> None:
    """Fold the ``data:`` lines of a 200 SSE stream into `observed`."""
    observed.terminal = False
    calls: dict[int, list[str]] = {}
    final: dict | None = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            observed.terminal = api == "chat"
            continue
        try:
            event = json.loads(data)
        except ValueError:
            observed.stream_error = {"unparseable": data[:200]}
            continue
        if not isinstance(event, dict):
            continue
        if api == "chat" and ("error" in event or event.get("object") == "error"):
            observed.stream_error = event.get("error") or event
            continue
        if api == "chat":
            for choice in event.get("choices") or []:
                if choice.get("finish_reason"):
                    observed.finish = choice["finish_reason"]
                for call in (choice.get("delta") or {}).get("tool_calls") or []:
                    entry = calls.setdefault(call.get("index", 0), ["", ""])
                    function = call.get("function") or {}
                    entry[0] += function.get("name") or ""
                    entry[1] += function.get("arguments") or ""
            continue
        kind = event.get("type")
        if isinstance(event.get("response"), dict):
            observed.echoes.append(event["response"].get("tool_choice"))
        if kind in ("error", "response.failed"):
            observed.stream_error = event.get("error") or event.get("response", {}).get("error") \
                or event
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            final = event.get("response")
            observed.terminal = kind != "response.failed"
            observed.finish = (final or {}).get("status")
        if kind == "response.output_item.added" and isinstance(event.get("item"), dict):
            item = event["item"]
            if item.get("type") in ("function_call", "custom_tool_call") and item.get("name"):
                # a name at `added` already reached the client, whatever happens later
                calls.setdefault(1000 + int(event.get("output_index", 0)),
                                 [_flat(item.get("name"), item.get("namespace")) or "", ""])
    if api == "chat":
        observed.calls = [(calls[i][0] or None, calls[i][1]) for i in sorted(calls)]
    else:
        named = {name for name, _ in (calls[i] for i in calls)}
        observed.calls = _responses_output_calls(final or {})
        seen = {name for name, _ in observed.calls}
        observed.calls += [(name, "") for name in sorted(named - seen)]


def send_sync(client: httpx.Client, base_url: str, api: str, body: Any, stream: bool) -> Observed:
    observed = Observed()
    start = time.monotonic()
    url = base_url + PATHS[api]
    kwargs: dict[str, Any] = ({"content": body, "headers": {"content-type": "application/json"}}
                              if isinstance(body, bytes) else {"json": body})
    try:
        if not stream:
            response = client.post(url, **kwargs)
            try:
                payload = response.json()
            except ValueError:
                payload = response.text[:500]
            parse_unary(api, response.status_code, payload, observed)
        else:
            with client.stream("POST", url, **kwargs) as response:
                if response.status_code != 200 or \
                        not response.headers.get("content-type", "").startswith("text/event-stream"):
                    parse_unary(api, response.status_code, _payload(response.read()), observed)
                else:
                    observed.status = 200
                    deadline = start + REQUEST_TIMEOUT

                    def lines() -> Iterable[str]:
                        for line in response.iter_lines():
                            if time.monotonic() > deadline:
                                raise httpx.ReadTimeout("stream exceeded the request timeout")
                            yield line
                    parse_stream(api, lines(), observed)
    except httpx.HTTPError as exc:
        observed.status = None
        observed.transport_error = f"{type(exc).__name__}: {exc}"
    observed.elapsed = time.monotonic() - start
    return observed


def _payload(raw: bytes) -> Any:
    """A non-stream answer's body: its JSON, or the start of its text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:500].decode(errors="replace")


async def send_async(client: httpx.AsyncClient, base_url: str, api: str, body: dict) -> Observed:
    """A streaming request, read to its end."""
    observed = Observed()
    start = time.monotonic()
    try:
        async with client.stream("POST", base_url + PATHS[api], json=body) as response:
            if response.status_code != 200:
                parse_unary(api, response.status_code, _payload(await response.aread()), observed)
            else:
                observed.status = 200
                parse_stream(api, [line async for line in response.aiter_lines()], observed)
    except httpx.HTTPError as exc:
        observed.status = None
        observed.transport_error = f"{type(exc).__name__}: {exc}"
    observed.elapsed = time.monotonic() - start
    return observed


# ====================================================================================== metrics

def metric(root_url: str, name: str, **labels: str) -> float:
    return scrape_metric(root_url, name, **labels)


ROLES = ("api_server", "engine_core", "worker", "other")


def process_tree_rss(pid: int | None) -> dict[str, int] | None:
    """RSS in bytes of the server tree rooted at `pid` (the ``serve-tiny`` CLI or ``vllm serve``),
    by role: ``api_server`` (the ``vllm serve`` process: HTTP, our middleware, guard and parsers),
    ``engine_core`` (scheduler, structured-output grammars), ``worker`` (model and KV cache),
    ``other`` (the CLI itself, multiprocessing helpers); plus ``total``."""
    if pid is None:
        return None
    import psutil
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    out = dict.fromkeys(ROLES, 0)
    for process in processes:
        try:
            name, rss = process.name(), process.memory_info().rss
            cmdline = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if "EngineCore" in name:
            role = "engine_core"
        elif "Worker" in name:
            role = "worker"
        elif "vllm.entrypoints.cli.main" in cmdline or " serve " in f" {cmdline} " \
                and "serve-tiny" not in cmdline:
            role = "api_server"
        else:
            role = "other"
        out[role] += rss
    out["total"] = sum(out[role] for role in ROLES)
    return out


def _median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


# ========================================================================================= fuzz

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

    def describe(self) -> str:
        body = self.body.decode(errors="replace") if isinstance(self.body, bytes) else self.body
        return json.dumps({"api": self.api, "stream": self.stream, "faults": self.faults,
                           "body": body}, default=repr)[:4000]


@dataclass
class Expect:
    outcome: str                             # "ours_400", "vllm_4xx", "ok", "any"
    param: str | None = None                 # ours_400: the exact error.param
    allowed: frozenset[str] | None = None    # calls a 200 may carry (flat names)
    parallel: bool = True
    echo: Any = MISSING                      # the tool_choice a Responses object must echo


def expected(case: Case) -> Expect:
    if isinstance(case.body, bytes) or not isinstance(case.body, dict):
        return Expect("vllm_4xx")
    body = {k: v for k, v in case.body.items() if k != ALLOWLIST_KEY}   # the middleware strips it
    try:   # what the middleware does: typed fields read as vLLM reads them, then the policy
        policy = rewrite_request(body, case.api).allowlist
    except AllowedToolsError as exc:
        return Expect("ours_400", param=exc.param)
    if policy is not None and policy.has_allowlist:
        catalog_faulty = any(f.startswith("catalog:") for f in case.faults)
        outcome = "vllm_4xx" if case.input_fault else ("any" if catalog_faulty else "ok")
        return Expect(outcome, allowed=frozenset(policy.allowed_flat_names),
                      parallel=policy.parallel_tool_calls,
                      echo=case.body.get("tool_choice") if case.api == "responses" else MISSING)
    catalog = catalog_names(body, case.api)
    if case.intended is not None:     # a near-miss of allowed_tools must never become "auto"
        catalog = case.intended
    if policy is not None and policy.choice == "named":
        catalog = frozenset(policy.allowed_flat_names)
    return Expect("vllm_4xx" if case.input_fault or case.intended is not None else "any",
                  allowed=catalog)


def catalog_names(body: dict, api: str) -> frozenset[str]:
    """Flat names of every function (and namespace member) a request offers, read permissively."""
    names: set[str] = set()
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        if api == "chat":
            fn = tool.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.add(fn["name"])
        elif tool.get("type") in ("function", "custom") and isinstance(tool.get("name"), str):
            names.add(tool["name"])
        elif tool.get("type") == "namespace" and isinstance(tool.get("name"), str) \
                and isinstance(tool.get("tools"), list):
            names.update(_flat(m.get("name"), tool["name"]) for m in tool["tools"]
                         if isinstance(m, dict) and isinstance(m.get("name"), str))
    return frozenset(names)


_FIELD_HINT = re.compile(r"body\.|parameter=|`\w+`|'loc'")


def names_a_field(error: Any, body: Any) -> bool:
    """An error object that says which field is wrong: ``param``, or a field named in the message."""
    if not isinstance(error, dict):
        return False
    if isinstance(error.get("param"), str) and error["param"]:
        return True
    message = str(error.get("message") or "")
    if _FIELD_HINT.search(message):
        return True
    keys = list(body) if isinstance(body, dict) else []
    if any(key.rstrip("s") in message for key in keys if len(key) > 3):
        return True
    # vLLM's own 400 for an empty Responses `input` ("Cannot apply chat template to an empty
    # conversation. Provide at least one message."): the input is the list of messages
    return "input" in keys and "message" in message


@dataclass
class Figures:
    """Counts of one part of the run; `problems` holds a description of everything that was wrong."""
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**dict(sorted(self.counts.items())), **self.extra,
                "problems": len(self.problems)}


def judge(case: Case, expect: Expect, observed: Observed, figures: Figures) -> list[str]:
    """Record `observed` in `figures`; return what was wrong with it (empty: nothing)."""
    c = figures.counts
    c["requests"] += 1
    c[f"{case.api}_{'stream' if case.stream else 'unary'}"] += 1
    problems: list[str] = []
    status = observed.status
    if status is None:
        c["no_answer"] += 1
        problems.append(f"no answer in {REQUEST_TIMEOUT:.0f}s: {observed.transport_error}")
    elif status >= 500:
        c["5xx"] += 1
        problems.append(f"HTTP {status}: {observed.error}")
    elif 400 <= status < 500:
        c["4xx"] += 1
        if expect.outcome == "ours_400":
            c["4xx_plugin"] += 1
        else:
            c["4xx_vllm"] += 1
        if not names_a_field(observed.error, case.body):
            c["4xx_without_field"] += 1
            problems.append(f"HTTP {status} names no field: {observed.error}")
        if expect.outcome == "ours_400":
            param = (observed.error or {}).get("param")
            if status != 400 or param != expect.param:
                c["unexpected_outcome"] += 1
                problems.append(f"expected the plugin's 400 with param {expect.param!r}, got "
                                f"{status} {observed.error}")
        elif expect.outcome == "ok":
            c["unexpected_outcome"] += 1
            problems.append(f"a valid allowed_tools request got {status}: {observed.error}")
    elif 200 <= status < 300:
        c["2xx"] += 1
        if expect.outcome in ("ours_400", "vllm_4xx"):
            c["unexpected_outcome"] += 1
            problems.append(f"expected a 4xx ({expect.outcome}, param {expect.param!r}), got "
                            f"{status}")
        if case.stream and (observed.stream_error is not None or not observed.terminal):
            c["stream_errors"] += 1
            problems.append(f"200 stream ended with error {observed.stream_error} "
                            f"(terminal={observed.terminal})")
        c["calls_returned"] += len(observed.calls)
        if expect.allowed is not None:
            leaked = [name for name, _ in observed.calls if name not in expect.allowed]
            if leaked:
                c["violations_leaked"] += len(leaked)
                problems.append(f"calls outside the request's subset {sorted(expect.allowed)}: "
                                f"{leaked}")
        if not expect.parallel and len(observed.calls) > 1:
            c["parallel_false_excess"] += 1
            problems.append(f"parallel_tool_calls false but {len(observed.calls)} calls")
        if expect.echo is not MISSING:
            wrong = [echo for echo in observed.echoes if echo != expect.echo]
            if wrong or not observed.echoes:
                c["echo_mismatch"] += 1
                problems.append(f"Responses echoed tool_choice {wrong[:1] or 'nothing'}, "
                                f"not the client's {expect.echo}")
    else:
        c["other_status"] += 1
        problems.append(f"HTTP {status}")
    if observed.elapsed > REQUEST_TIMEOUT:
        c["slow"] += 1
    if problems:
        bug = next((bug for bug in KNOWN_BUGS if bug.matches(case, expect)), None)
        if bug is not None:   # pinned by an xfail(strict) test; counted, not failed on
            c[f"known_bug:{bug.id}"] += 1
            figures.extra.setdefault("known_bugs", {})[bug.id] = bug.where
            return []
        figures.problems.append(f"{case.describe()} -> " + "; ".join(problems))
    return problems


@dataclass(frozen=True)
class KnownBug:
    """An open bug in code this suite does not own: requests it matches are counted apart (figure
    ``known_bug:<id>``) instead of failing the fuzz run. Each one is pinned by an
    ``xfail(strict=True)`` test in tests/test_reliability_e2e.py; when the fix lands that test
    XPASSes (and fails): delete the entry here then."""
    id: str
    where: str
    matches: Callable[[Case, Expect], bool]


def _non_iterable_namespace_members(case: Case, expect: Expect) -> bool:
    tools = case.body.get("tools") if isinstance(case.body, dict) else None
    return case.api == "responses" and expect.outcome != "ours_400" and isinstance(tools, list) \
        and any(isinstance(t, dict) and t.get("type") == "namespace"
                and isinstance(t.get("tools"), (int, float)) and t.get("tools") for t in tools)


def _vllm_named_choice_with_malformed_tools(case: Case, expect: Expect) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    tools, choice = body.get("tools"), body.get("tool_choice")
    well_formed = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    return case.api == "chat" and expect.outcome != "ours_400" and isinstance(choice, dict) \
        and choice.get("type") == "function" and "tools" in body and not well_formed


KNOWN_BUGS: list[KnownBug] = [
    KnownBug("upstream_vllm_named_choice_malformed_tools",
             "vLLM 0.32 itself: ChatCompletionRequest.check_tool_usage indexes tools[i]['function']"
             "['name'] before validating `tools` (a named tool_choice next to a malformed `tools` "
             "is a 400 \"string indices must be integers\" / KeyError with no param); the plugin "
             "passes plain choices through unchanged",
             _vllm_named_choice_with_malformed_tools),
]


# ---------------------------------------------------------------------------------- generation

def _hypothesis():
    from hypothesis import strategies as st
    return st


def _weighted(st, common: Any, rare: list[Any], common_weight: int) -> Any:
    return st.sampled_from([common] * common_weight + rare)


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
                    "entry_bad_namespace", "entry_unknown_namespace"]
MODES = ["none", "bogus", MISSING, None, 1, "AUTO"]
PLAIN_CHOICES = [MISSING, "none", "auto", "required", "bogus", "named", "named_unknown",
                 "named_malformed", "weird_object", 7, "near_miss_type", "no_type"]
PARALLEL = [True, None, MISSING, "yes", 0, 1]
INPUT_FAULTS = {"chat": ["messages_not_list", "messages_empty", "messages_missing",
                         "max_tokens_negative", "max_tokens_string", "temperature_string",
                         "stream_not_bool", "model_unknown"],
                "responses": ["input_not_text", "input_empty", "input_missing",
                              "max_tokens_negative", "max_tokens_string", "temperature_string",
                              "stream_not_bool", "model_unknown"]}
RAW_BODIES = [b"{not json", b"[1, 2]", b'"x"', b"", b'{"model": "tiny", "messages": [',
              b"null", b"\xff\xfe"]


def _tool(api: str, tool) -> dict[str, Any]:
    return tool.chat_tool() if api == "chat" else tool.responses_tool()


def _apply_catalog_fault(api: str, tools: list, fault: str, draw, st) -> tuple[Any, str]:
    """Break `tools` the way `fault` says; returns (tools, where)."""
    spare = POOL[-1]
    position = draw(st.integers(0, len(tools)))
    broken: Any
    if fault == "duplicate":
        if not tools:
            return [_tool(api, spare), _tool(api, spare)], "tools"
        return tools + [dict(tools[draw(st.integers(0, len(tools) - 1))])], "tools"
    if fault == "tools_not_list":
        return draw(st.sampled_from(["x", {}, 3, {"type": "function"}])), "tools"
    if fault == "no_tools":
        return MISSING, "tools"
    if fault == "empty_tools":
        return [], "tools"
    fn = {"name": spare.name, "description": spare.description, "parameters": spare.parameters}
    if fault == "non_object":
        broken = draw(st.sampled_from([5, "get_weather", None, [], True]))
    elif fault == "missing_function":
        broken = {"type": "function", "name": spare.name}
    elif fault == "missing_name":
        broken = {k: v for k, v in fn.items() if k != "name"}
    elif fault == "empty_name":
        broken = {**fn, "name": ""}
    elif fault == "name_not_string":
        broken = {**fn, "name": draw(st.sampled_from([3, None, ["x"], {"a": 1}]))}
    elif fault == "bad_type":
        broken = {"type": draw(st.sampled_from([7, None, ["function"]])), **fn}
    elif fault == "bad_parameters":
        broken = {**fn, "parameters": draw(st.sampled_from(["schema", 3, ["x"]]))}
    elif fault == "bad_strict":
        broken = {**fn, "strict": draw(st.sampled_from(["yes", 1, {}]))}
    elif fault == "bad_description":
        broken = {**fn, "description": draw(st.sampled_from([5, ["x"], {}]))}
    elif fault == "other_api_shape":
        broken = spare.responses_tool() if api == "chat" else spare.chat_tool()
    elif fault == "non_function_tool":
        broken = draw(st.sampled_from([{"type": "web_search"}, {"type": "file_search",
                                                                "vector_store_ids": ["vs"]},
                                       {"type": "mcp", "server_label": "x"}]))
    elif fault == "custom_tool":
        broken = {"type": "custom", "name": "free_text", "description": "Free text."}
    elif fault == "namespace_bad_name":
        broken = {"type": "namespace", "name": draw(st.sampled_from(["", 5, None])),
                  "tools": [spare.responses_tool()]}
    elif fault == "namespace_members_not_list":
        broken = {"type": "namespace", "name": "crm", "tools": draw(st.sampled_from(["x", {}, 3]))}
    elif fault == "namespace_collision":
        # a top-level crm__<name> next to namespace crm's <name>: one flat name, two identities
        broken = {"type": "namespace", "name": "crm", "tools": [spare.responses_tool()]}
        tools = tools + [{**spare.responses_tool(), "name": f"crm__{spare.name}"}]
    else:
        raise AssertionError(fault)
    if api == "chat" and isinstance(broken, dict) and fault not in (
            "other_api_shape", "non_function_tool", "missing_function", "bad_type"):
        broken = {"type": "function", "function": broken}
    elif api == "chat" and fault == "bad_type":
        broken = {"type": broken["type"], "function": fn}
    elif api == "responses" and isinstance(broken, dict) and "type" not in broken:
        broken = {"type": "function", **broken}
    return tools[:position] + [broken] + tools[position:], "tools"


def _selector(api: str, name: Any, **extra: Any) -> dict[str, Any]:
    if api == "chat":
        return {"type": "function", "function": {"name": name}, **extra}
    return {"type": "function", "name": name, **extra}


def _broken_selector(api: str, fault: str, names: list[str], draw, st) -> Any:
    some = names[0] if names else POOL[0].name
    if fault == "entry_not_object":
        return draw(st.sampled_from([some, 3, None, [some]]))
    if fault == "entry_type_missing":
        return {k: v for k, v in _selector(api, some).items() if k != "type"}
    if fault == "entry_type_not_string":
        return {**_selector(api, some), "type": draw(st.sampled_from([1, None, ["function"]]))}
    if fault == "entry_non_function":
        return draw(st.sampled_from([{"type": "mcp", "server_label": "x"}, {"type": "web_search"},
                                     {"type": "custom", "name": some}, {"type": "file_search"}]))
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


def fuzz_cases():
    """The hypothesis strategy of fuzz :class:`Case` s."""
    st = _hypothesis()

    @st.composite
    def strategy(draw) -> Case:
        api = draw(st.sampled_from(["chat", "responses"]))
        stream = draw(st.booleans())
        if draw(st.integers(0, 39)) == 0:
            return Case(api, stream, draw(st.sampled_from(RAW_BODIES)), "raw", ("raw_body",))
        faults: list[str] = []
        chosen = draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=6,
                               unique_by=lambda tool: tool.name))
        tools: Any = [_tool(api, tool) for tool in chosen]
        names = [tool.name for tool in chosen]      # what a selection may name (flat or bare)
        if api == "responses" and draw(st.integers(0, 5)) == 0 and len(chosen) > 1:
            # move some tools into a namespace; select them by bare or flat name
            split = draw(st.integers(1, len(chosen) - 1))
            tools = tools[:split] + [{"type": "namespace", "name": "crm", "description": "CRM.",
                                      "tools": tools[split:]}]
            names = names[:split] + [draw(st.sampled_from([n, f"crm__{n}"])) for n in names[split:]]
        catalog_fault = draw(_weighted(st, None, CATALOG_FAULTS[api], 3 * len(CATALOG_FAULTS[api])))
        if catalog_fault is not None:
            tools, _ = _apply_catalog_fault(api, list(tools), catalog_fault, draw, st)
            faults.append(f"catalog:{catalog_fault}")

        content = draw(st.sampled_from(["Go ahead.", "hi", "\u00e9\u00e8 " * 40]))
        body = base_body(api, FUZZ_MAX_TOKENS, content)
        if tools is not MISSING:
            body["tools"] = tools
        kind = draw(st.sampled_from(["allowed", "allowed", "plain"]))
        intended = None
        if kind == "allowed":
            mode = draw(_weighted(st, draw(st.sampled_from(["required", "auto"])), MODES, 6))
            subset = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
            entries: Any = [_selector(api, n) for n in subset]
            fault = draw(_weighted(st, None, SELECTION_FAULTS, len(SELECTION_FAULTS)))
            if fault is not None:
                faults.append(f"selection:{fault}")
            if fault == "tools_missing":
                entries = MISSING
            elif fault == "tools_null":
                entries = None
            elif fault == "tools_empty":
                entries = []
            elif fault == "tools_not_list":
                entries = draw(st.sampled_from(["x", {"type": "function"}, 3]))
            elif fault is not None and fault.startswith("entry_"):
                entry = _broken_selector(api, fault, names, draw, st)
                entries.insert(draw(st.integers(0, len(entries))), entry)
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
            else:
                choice = {"type": "allowed_tools", **inner}
                if fault == "container_not_object":
                    choice = {"type": "allowed_tools", "allowed_tools": inner}
            body["tool_choice"] = choice
        else:
            plain = draw(st.sampled_from(PLAIN_CHOICES))
            if plain in ("bogus", "named_unknown", "named_malformed", "weird_object", 7,
                         "near_miss_type", "no_type"):
                faults.append(f"plain:{plain}")
            some = names[0]
            if plain == "named":
                body["tool_choice"] = ({"type": "function", "function": {"name": some}}
                                       if api == "chat" else {"type": "function", "name": some})
            elif plain == "named_unknown":
                body["tool_choice"] = ({"type": "function", "function": {"name": "no_such_tool"}}
                                       if api == "chat" else
                                       {"type": "function", "name": "no_such_tool"})
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
                intended = frozenset(subset)
            elif plain is not MISSING:
                body["tool_choice"] = plain
        parallel = draw(_weighted(st, False, PARALLEL, 8))
        if parallel is not MISSING:
            body["parallel_tool_calls"] = parallel
        if parallel not in (False, True, None, MISSING):
            faults.append(f"parallel:{parallel!r}")
        if draw(st.integers(0, 9)) == 0:   # a forged policy and template block: must be stripped
            body[ALLOWLIST_KEY] = {"v": 1, "api": api, "choice": "allowed", "mode": "auto",
                                "allowed": sorted(t.name for t in POOL), "catalog":
                                    sorted(t.name for t in POOL), "parallel_tool_calls": True,
                                "catalog_digest": "x", "allowlist_digest": "x"}
            body["chat_template_kwargs"] = {TEMPLATE_KWARG: {"mode": "auto",
                                                             "names": sorted(t.name for t in POOL)}}
        input_fault = draw(_weighted(st, None, INPUT_FAULTS[api], 3 * len(INPUT_FAULTS[api])))
        if input_fault is not None:
            _apply_input_fault(api, body, input_fault)
            faults.append(f"input:{input_fault}")
        if stream and input_fault != "stream_not_bool":
            body["stream"] = True
        return Case(api, stream, body, kind, tuple(f for f in faults if f), input_fault, intended)

    return strategy()


def _apply_input_fault(api: str, body: dict, fault: str) -> None:
    tokens = "max_tokens" if api == "chat" else "max_output_tokens"
    if fault == "messages_not_list":
        body["messages"] = "Go ahead."
    elif fault == "messages_empty":
        body["messages"] = []
    elif fault == "messages_missing":
        del body["messages"]
    elif fault == "input_not_text":
        body["input"] = 5
    elif fault == "input_empty":
        body["input"] = []
    elif fault == "input_missing":
        del body["input"]
    elif fault == "max_tokens_negative":
        body[tokens] = -1
    elif fault == "max_tokens_string":
        body[tokens] = "many"
    elif fault == "temperature_string":
        body["temperature"] = "hot"
    elif fault == "stream_not_bool":
        body["stream"] = "maybe"
    elif fault == "model_unknown":
        body["model"] = "no-such-model"
    else:
        raise AssertionError(fault)


def run_fuzz(base_url: str, examples: int, *, strict: bool, seed: int | None = None,
             figures: Figures | None = None) -> Figures:
    """Send `examples` generated requests. `strict`: raise on the first problem (hypothesis then
    shrinks it to a minimal failing request); otherwise record it and go on."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    figures = figures or Figures()
    violations_before = metric(base_url.removesuffix("/v1"), "vllm_allowed_tools:violations_total")
    started = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)) as client:

        @settings(max_examples=examples, deadline=None, derandomize=seed is None, database=None,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(fuzz_cases())
        def one(case: Case) -> None:
            figures.counts[f"kind_{case.kind}"] += 1
            figures.counts["with_faults" if case.faults else "without_faults"] += 1
            expect = expected(case)
            figures.counts[f"expect_{expect.outcome}"] += 1
            observed = send_sync(client, base_url, case.api, case.body, case.stream)
            problems = judge(case, expect, observed, figures)
            if strict and problems:
                raise AssertionError(f"{case.describe()}\n-> " + "\n-> ".join(problems))

        test = hypothesis_seed(seed)(one) if seed is not None else one
        test()
    root = base_url.removesuffix("/v1")
    figures.extra["healthy_after"] = httpx.get(root + "/health", timeout=30).status_code == 200
    figures.extra["plugin_stopped_calls"] = metric(root, "vllm_allowed_tools:violations_total") \
        - violations_before
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures


# ========================================================================================= load

def load_request(index: int, round_: int) -> tuple[str, dict, frozenset[str], frozenset[str]]:
    """(api, body, its subset, its catalog) of request `index` (the same in every round): its own
    catalog of 8 pool tools and its own 1-3-tool subset."""
    rng = random.Random(index)   # the same requests every round
    api = "chat" if index % 2 == 0 else "responses"
    mode = "required" if (index // 2) % 2 == 0 else "auto"
    catalog = rng.sample(list(POOL), 8)
    subset = [tool.name for tool in rng.sample(catalog, rng.randint(1, 3))]
    body = base_body(api, LOAD_MAX_TOKENS)
    if api == "chat":
        body.update(tools=[tool.chat_tool() for tool in catalog],
                    tool_choice=chat_selection(mode, subset))
    else:
        body.update(tools=[tool.responses_tool() for tool in catalog],
                    tool_choice=responses_selection(mode, subset))
    # no `seed`: on vLLM 0.32's CPU build a seeded request whose prefill gets chunked kills the
    # engine (see KNOWN_BUGS / test_seeded_chunked_prefill_keeps_the_engine_alive)
    body.update(parallel_tool_calls=False, stream=True)
    return api, body, frozenset(subset), frozenset(tool.name for tool in catalog)


async def _load_round(base_url: str, requests: int, round_: int, figures: Figures) -> None:
    specs = [load_request(i, round_) for i in range(requests)]
    limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=requests + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT * 3, connect=10.0),
                                 limits=limits) as client:
        results = await asyncio.gather(*(send_async(client, base_url, api, body)
                                         for api, body, _, _ in specs))
    others: dict[int, frozenset[str]] = {i: spec[2] for i, spec in enumerate(specs)}
    c = figures.counts
    for i, ((api, body, subset, _catalog), observed) in enumerate(zip(specs, results)):
        c["requests"] += 1
        problems: list[str] = []
        if observed.status != 200:
            c["5xx" if (observed.status or 0) >= 500 else
              "no_answer" if observed.status is None else "4xx"] += 1
            problems.append(f"status {observed.status}: {observed.error or observed.transport_error}")
        else:
            c["2xx"] += 1
            if observed.terminal and observed.stream_error is None:
                c["completed"] += 1
            else:
                c["stream_errors"] += 1
                problems.append(f"stream error {observed.stream_error} terminal={observed.terminal}")
            c["calls_returned"] += len(observed.calls)
            for name, arguments in observed.calls:
                if name not in subset:
                    c["violations_leaked"] += 1
                    foreign = any(name in s for j, s in others.items() if j != i)
                    c["cross_request_mixups"] += foreign
                    problems.append(f"call {name!r} outside its subset {sorted(subset)}"
                                    + (" (in another request's subset)" if foreign else ""))
                elif observed.finish == "length" or observed.finish == "incomplete":
                    c["calls_cut_by_max_tokens"] += 1   # vanilla: the budget ran out mid-call
                elif not POOL_BY_NAME[name].arguments_valid(arguments):
                    c["invalid_arguments"] += 1
                    problems.append(f"call {name!r} with arguments off its schema: {arguments!r}")
            if len(observed.calls) > 1:
                c["parallel_false_excess"] += 1
                problems.append(f"{len(observed.calls)} calls with parallel_tool_calls false")
            mode = (body["tool_choice"].get("allowed_tools") or body["tool_choice"])["mode"]
            if mode == "required" and observed.finish in ("tool_calls", "completed") \
                    and not observed.calls:
                c["required_without_call"] += 1
                problems.append(f"required mode finished ({observed.finish}) without a call")
            if api == "responses":
                wrong = [echo for echo in observed.echoes if echo != body["tool_choice"]]
                if wrong or not observed.echoes:
                    c["echo_mismatch"] += 1
                    problems.append(f"echoed tool_choice {wrong[:1] or 'nothing'}")
        c["max_stream_ms"] = max(c["max_stream_ms"], int(observed.elapsed * 1000))
        if problems:
            figures.problems.append(f"round {round_} request {i} ({api}, subset {sorted(subset)}): "
                                    + "; ".join(problems))


def run_load(base_url: str, requests: int, rounds: int, server_pid: int | None) -> Figures:
    """`rounds` rounds of the same `requests` concurrent streams (each with its own catalog and
    subset; sampling is not seeded, so outputs differ every round); the RSS of the server tree by
    role after each round."""
    figures = Figures()
    root = base_url.removesuffix("/v1")
    violations_before = metric(root, "vllm_allowed_tools:violations_total")
    trees: list[dict[str, int] | None] = []
    started = time.monotonic()
    for round_ in range(rounds):
        round_start = time.monotonic()
        asyncio.run(_load_round(base_url, requests, round_, figures))
        time.sleep(1.0)   # let the engine free what the round held
        trees.append(process_tree_rss(server_pid))
        _log(f"load round {round_ + 1}/{rounds}: {time.monotonic() - round_start:.1f}s, server "
             f"tree RSS MiB " + (", ".join(f"{k} {_mib(v)}" for k, v in trees[-1].items())
                                 if trees[-1] else "-"))
    figures.extra["rounds"] = rounds
    figures.extra["concurrency"] = requests
    if trees and all(trees):
        figures.extra["rss_mib_per_round"] = {
            key: [round(tree[key] / 2**20, 1) for tree in trees] for key in (*ROLES, "total")}
        figures.extra["rss_growth_mib"] = {   # after the first (warm-up) round
            key: round((trees[-1][key] - trees[0][key]) / 2**20, 1) for key in (*ROLES, "total")}
    figures.extra["plugin_stopped_calls"] = metric(root, "vllm_allowed_tools:violations_total") \
        - violations_before
    figures.extra["running_after"] = metric(root, "vllm:num_requests_running")
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures


#: the CPU KV cache the worker first-touches block by block (serve.py: VLLM_CPU_KVCACHE_SPACE=1 GiB)
KV_CACHE_MIB = 1024.0


def rss_growth_problems(figures: Figures, max_growth_mib: float = 32.0,
                        max_ratio: float = 0.03) -> list[str]:
    """Why the memory is not flat ([] when it is), last round against the first (warm-up) one.

    The API server (HTTP, our middleware, guard, parsers) and the engine core (scheduler, compiled
    grammars) may grow by at most max(max_growth_mib, max_ratio of their size). The worker's RSS
    also grows while vLLM hands out KV-cache blocks it never used before (the free list is a queue:
    a block is first written, so first resident, when its turn comes, whatever the prefix cache
    holds), up to the whole KV cache; it is bounded by that, not by the flatness rule."""
    growth = figures.extra.get("rss_growth_mib")
    if growth is None:
        return []
    sizes = {key: values[0] for key, values in figures.extra["rss_mib_per_round"].items()}
    problems = [f"{key} grew {growth[key]} MiB (of {sizes[key]})"
                for key in ("api_server", "engine_core", "other")
                if growth[key] > max(max_growth_mib, max_ratio * sizes[key])]
    if growth["worker"] > KV_CACHE_MIB:
        problems.append(f"worker grew {growth['worker']} MiB, more than the KV cache")
    return problems


# ======================================================================================== faults

def _disconnect_body(api: str, policy: bool, index: int) -> dict:
    rng = random.Random(500 + index)
    body = base_body(api, DISCONNECT_BUDGET)
    if policy:
        catalog = rng.sample(list(POOL), 8)
        subset = [tool.name for tool in rng.sample(catalog, 2)]
        if api == "chat":
            body.update(tools=[t.chat_tool() for t in catalog],
                        tool_choice=chat_selection("auto", subset))
        else:
            body.update(tools=[t.responses_tool() for t in catalog],
                        tool_choice=responses_selection("auto", subset))
        body["parallel_tool_calls"] = True
    body["ignore_eos"] = True
    return body


def _wait_idle(root: str, timeout: float = 30.0) -> float:
    """Seconds until no request is running (or `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if metric(root, "vllm:num_requests_running") == 0 and \
                metric(root, "vllm:num_requests_waiting") == 0:
            return time.monotonic() - start
        time.sleep(0.25)
    return timeout


def _raw_post(base_url: str, api: str, body: dict, fraction: float) -> None:
    """Send the headers and `fraction` of the body of a POST on a raw socket, then close it
    (no timer in between: a starved client cannot turn this into a late close)."""
    url = urlparse(base_url)
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall((f"POST {url.path}{PATHS[api]} HTTP/1.1\r\nHost: {url.hostname}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                      ).encode() + data[: int(len(data) * fraction)])


def run_disconnects(base_url: str, streams: int) -> Figures:
    """Client faults, one at a time: `streams` mid-stream disconnects (both endpoints, with and
    without a policy, after 1-6 events), per endpoint one unary request whose client is gone right
    after sending it and one whose body is cut off half-way. Each must leave no engine request
    behind."""
    figures = Figures()
    c = figures.counts
    root = base_url.removesuffix("/v1")
    started = time.monotonic()
    plan: list[tuple[str, str, bool, int]] = []
    for i in range(streams):
        plan.append(("stream", "chat" if i % 2 == 0 else "responses", (i // 2) % 2 == 0, 1 + i % 6))
    for api in ("chat", "responses"):
        plan.append(("unary", api, True, 0))
        plan.append(("half_body", api, True, 0))
    generated_max = 0.0
    idle_seconds = 0.0
    for index, (how, api, policy, events) in enumerate(plan):
        _wait_idle(root)
        tokens = metric(root, "vllm:generation_tokens_total")
        success = metric(root, "vllm:request_success_total")
        prompts = metric(root, "vllm:prompt_tokens_total")
        body = _disconnect_body(api, policy, index)
        read = 0
        problem = None
        try:
            if how == "stream":
                body["stream"] = True
                with httpx.Client(timeout=REQUEST_TIMEOUT) as client, \
                        client.stream("POST", base_url + PATHS[api], json=body) as response:
                    if response.status_code != 200:
                        problem = f"status {response.status_code}: {response.read()[:300]!r}"
                    else:
                        for line in response.iter_lines():
                            read += line.startswith("data: ")
                            if read >= events:
                                break
                # leaving the block closes the connection half-way through the stream
            elif how == "unary":
                _raw_post(base_url, api, body, 1.0)    # the whole request, then gone
            else:
                _raw_post(base_url, api, body, 0.5)    # half of the body, then gone
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        closed = time.monotonic()
        idle_after = _wait_idle(root)
        idle_seconds = max(idle_seconds, time.monotonic() - closed)
        time.sleep(1.0)   # an engine request not aborted would keep generating meanwhile
        running = metric(root, "vllm:num_requests_running")
        tokens_final = metric(root, "vllm:generation_tokens_total")
        generated = tokens_final - tokens
        finished = metric(root, "vllm:request_success_total") - success
        prompted = metric(root, "vllm:prompt_tokens_total") - prompts
        generated_max = max(generated_max, generated)
        c[f"{how}_tried"] += 1
        # With EOS ignored, a request that is not aborted runs to its budget and finishes (it is
        # counted in request_success_total); an aborted one never finishes: `finished == 0` (and
        # nothing running) is the proof. How many tokens it made before the abort depends on how
        # soon this client got to close the socket and the server to notice: on a busy 2-core
        # machine both can be starved for seconds by the engine's own busy processes, so the
        # count is reported (figure `tokens_generated`), not bounded tighter than the budget.
        aborted = running == 0 and finished == 0 and generated < DISCONNECT_BUDGET
        figures.extra.setdefault("tokens_generated", {}).setdefault(how, []).append(int(generated))
        if how == "half_body":
            aborted = aborted and prompted == 0 and generated == 0
        if problem is None and aborted:
            c[f"{how}_aborted"] += 1
        else:
            c[f"{how}_not_aborted"] += 1
            figures.problems.append(
                f"{how} {api} policy={policy} after {read} events: {problem or 'not aborted'} "
                f"(running {running}, generated {generated:.0f} of {DISCONNECT_BUDGET}, "
                f"finished {finished:.0f}, idle after {idle_after:.1f}s)")
    figures.extra["max_tokens_generated"] = generated_max
    figures.extra["max_seconds_close_to_idle"] = round(idle_seconds, 1)
    figures.extra["budget_tokens"] = DISCONNECT_BUDGET
    figures.extra["healthy_after"] = httpx.get(root + "/health", timeout=30).status_code == 200
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        check = send_sync(client, base_url, "chat", base_body("chat", 8), stream=False)
    figures.extra["answers_after"] = check.status == 200
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures


# ============================================================================ grant-store faults
#
# Approvals on (an operator policy gating GATED_TOOL). Two faults:
#
# * the grant store unavailable while the server runs (SQLite: its folder moved away, as an
#   unmounted volume; its write lock held by another process past the busy timeout; PostgreSQL: the
#   server stopped). Requests that may call the gated tool must be refused with a 503
#   `grant_store_unavailable` (a stream that already started: one `response.failed` with that code),
#   never with the gated call released; requests that cannot call it keep working; an answer to an
#   elicitation sent during the outage is refused and can be sent again afterwards; the server
#   recovers by itself when the store is back.
# * the API server's process group SIGKILLed while approvals are being answered: every grant the
#   client was told about (an `accept` with scope `session` answered 200 with the released call) must
#   be in the store after a restart on the same store, and usable (the next call in that session is
#   released without asking); the store must pass SQLite's integrity and foreign-key checks.

GATED_TOOL, FREE_TOOL = "send_email", "get_weather"
APPROVAL_POLICY = {"rules": [{"tools": [GATED_TOOL], "approval": "required",
                              "scopes": ["once", "session"]}]}
STORE_TIMEOUT_S = 1.0          # the server's grant-store timeout in these runs (busy/lock waits)


def approval_env(folder: Path, store: str | None = None) -> dict[str, str]:
    """The environment of a server with approvals on: policy file in `folder`, the store at
    `store` (default `folder/store/grants.db`)."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = folder / "approvals.json"
    policy.write_text(json.dumps(APPROVAL_POLICY))
    if store is None:
        (folder / "store").mkdir(exist_ok=True)
        store = str(folder / "store" / "grants.db")
    return {"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
            "VLLM_ALLOWED_TOOLS_GRANT_STORE": store,
            "VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT": str(STORE_TIMEOUT_S)}


def _approval_tools(api: str) -> list[dict]:
    pick = "responses_tool" if api == "responses" else "chat_tool"
    return [getattr(POOL_BY_NAME[GATED_TOOL], pick)(), getattr(POOL_BY_NAME[FREE_TOOL], pick)()]


def gated_body(session: str, *history: dict, stream: bool = False) -> dict:
    """A Responses turn whose only allowed tool is the gated one (required: it will call it)."""
    return {"model": "tiny", "input": list(history) or "Send it.", "tools": _approval_tools("responses"),
            "tool_choice": responses_selection("required", [GATED_TOOL]),
            "parallel_tool_calls": False, "max_output_tokens": FUZZ_MAX_TOKENS, "temperature": 1.0,
            "prompt_cache_key": session, "stream": stream}


def free_body(api: str, stream: bool = False) -> dict:
    """A turn with the gated tool in the catalog but only the free one allowed."""
    body = base_body(api, 60)
    body.update(tools=_approval_tools(api), parallel_tool_calls=False, stream=stream,
                tool_choice=(responses_selection if api == "responses" else chat_selection)(
                    "required", [FREE_TOOL]))
    return body


def accept_input(elicitation: dict, response_id: str, scope: str = "session") -> list[dict]:
    return [{"role": "user", "content": "Send it."}, elicitation,
            {"id": response_id, "type": "elicitation_response", "elicitation_id": elicitation["id"],
             "action": "accept", "scope": scope}]


@dataclass
class Answer:
    status: int | None
    items: list[dict] = field(default_factory=list)      # Responses output items (final)
    events: list[dict] = field(default_factory=list)     # stream events
    error: dict | None = None                            # error body, or response.failed's error
    leaked: int = 0                                      # gated calls the client was shown
    transport_error: str | None = None


def post_approval(client: httpx.Client, base_url: str, api: str, body: dict) -> Answer:
    """Send one request; collect items, the error and every gated call shown to the client (an
    output item, a stream's added/done item, or a call in the final object)."""
    url = base_url + PATHS[api]
    try:
        if not body.get("stream"):
            response = client.post(url, json=body)
            payload = _payload(response.content)
            answer = Answer(response.status_code)
            if response.status_code != 200:
                answer.error = payload.get("error") if isinstance(payload, dict) else {"raw": payload}
                return answer
            if api == "chat":
                message = ((payload.get("choices") or [{}])[0].get("message") or {})
                calls = [c.get("function", {}).get("name") for c in message.get("tool_calls") or []]
                answer.leaked = calls.count(GATED_TOOL)
                return answer
            answer.items = list(payload.get("output") or [])
        else:
            with client.stream("POST", url, json=body) as response:
                answer = Answer(response.status_code)
                if response.status_code != 200:
                    payload = _payload(response.read())
                    answer.error = payload.get("error") if isinstance(payload, dict) else \
                        {"raw": payload}
                    return answer
                for line in response.iter_lines():
                    if line.startswith("data: ") and line[6:] != "[DONE]":
                        answer.events.append(json.loads(line[6:]))
            shown = []
            for event in answer.events:
                if api == "chat":
                    for choice in event.get("choices") or []:
                        shown += [(c.get("function") or {}).get("name")
                                  for c in (choice.get("delta") or {}).get("tool_calls") or []]
                    continue
                if isinstance(event.get("item"), dict):
                    shown.append(event["item"])
                if isinstance(event.get("response"), dict):
                    if event["type"] == "response.failed":
                        answer.error = event["response"].get("error")
                    if event["type"] in ("response.completed", "response.incomplete",
                                         "response.failed"):
                        answer.items = list(event["response"].get("output") or [])
            if api == "chat":
                answer.leaked = shown.count(GATED_TOOL)
                return answer
            answer.leaked = sum(1 for item in shown if item.get("type") == "function_call"
                                and item.get("name") == GATED_TOOL)
    except httpx.HTTPError as exc:
        return Answer(None, transport_error=f"{type(exc).__name__}: {exc}")
    answer.leaked += sum(1 for item in answer.items if item.get("type") == "function_call"
                         and item.get("name") == GATED_TOOL)
    return answer


def _store_error(error: Any) -> bool:
    """The error the client must get while the store is down: code, and a message that says what
    happened and what to do."""
    return isinstance(error, dict) and error.get("code") == "grant_store_unavailable" \
        and "grant store" in str(error.get("message")) and "Retry" in str(error.get("message"))


def _ask(client: httpx.Client, base_url: str, session: str) -> Answer:
    return post_approval(client, base_url, "responses", gated_body(session))


def _elicitation(answer: Answer) -> dict | None:
    found = [item for item in answer.items if item.get("type") == "elicitation"]
    return found[0] if answer.status == 200 and len(found) == 1 else None


def _no_call(answer: Answer) -> bool:
    """A 200 turn in which the random model made no call at all (cut off by max tokens: vLLM's
    parser then returns the markup as text)."""
    return answer.status == 200 and not any(
        i.get("type") in ("function_call", "elicitation") for i in answer.items)


def _ask_until_called(client: httpx.Client, base_url: str, session: str, tries: int = 5,
                      sent: Counter | None = None) -> Answer:
    """Ask until the model makes a call (the random model sometimes makes none); each request
    sent is counted in ``sent["kill_requests"]`` when given."""
    for _ in range(tries):
        answer = _ask(client, base_url, session)
        if sent is not None:
            sent["kill_requests"] += 1
        if not _no_call(answer):
            return answer
    return answer


@contextlib.contextmanager
def sqlite_folder_gone(db: Path):
    """The store's folder moved away (an unmounted volume), then put back."""
    folder = db.parent
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    try:
        yield
    finally:
        away.rename(folder)


@contextlib.contextmanager
def postgres_stopped(pg: Any):
    """The PostgreSQL server stopped (clients disconnected), then started again."""
    pg.stop()
    try:
        yield
    finally:
        pg.restart()


def run_store_outage(base_url: str, fault: Callable[[], Any], label: str, rounds: int,
                     figures: Figures | None = None) -> Figures:
    """One outage (`fault()` is a context manager: the store is down inside it). Each round
    sends, during the outage: a gated turn unary and streamed, the answer (accept) to an
    elicitation asked before the outage, and three turns that cannot call the gated tool (Responses
    unary and streamed, Chat). Then checks recovery."""
    figures = figures or Figures()
    c = figures.counts
    tag = f"{label}-{uuid.uuid4().hex[:8]}"
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        before = _elicitation(_ask_until_called(client, base_url, f"{tag}-pending"))
        if before is None:
            figures.problems.append(f"{label}: the store did not work before the fault")
            return figures
        answer_body = gated_body(f"{tag}-pending", *accept_input(before, f"er_{tag}"))

        def record(kind: str, answer: Answer) -> None:
            c[f"{label}:tried"] += 1
            c["outage_tried"] += 1
            status = answer.status
            bucket = "no_answer" if status is None else f"{status // 100}xx"
            c[f"outage_{bucket}"] += 1
            c["gated_leaked"] += answer.leaked
            store_refusal = (status == 503 and _store_error(answer.error)) or (
                status == 200 and kind == "gated_stream" and _store_error(answer.error))
            if store_refusal:
                c["outage_refused_store_down"] += 1
                c[f"{label}:refused"] += 1
            elif status is not None and status >= 500:
                c["outage_5xx_other"] += 1
            if kind.startswith("free"):
                ok = status == 200 and answer.error is None
                c["outage_free_ok"] += ok
                if not ok:
                    figures.problems.append(f"{label}: {kind} failed: {status} {answer.error} "
                                            f"{answer.transport_error or ''}")
            elif kind.startswith("gated") and status == 200 and answer.error is None and \
                    not answer.leaked and not any(i.get("type") in ("function_call", "elicitation")
                                                  for i in answer.items):
                c["outage_gated_without_call"] += 1   # the model made no call: nothing to decide
            elif not store_refusal:
                figures.problems.append(f"{label}: {kind} not refused as store-down: {status} "
                                        f"{answer.error} {[i.get('type') for i in answer.items]} "
                                        f"{answer.transport_error or ''}")
            if answer.leaked:
                figures.problems.append(f"{label}: {kind} leaked {answer.leaked} gated call(s)")

        with fault():
            for round_ in range(rounds):
                record("gated_unary", _ask(client, base_url, f"{tag}-u{round_}"))
                record("gated_stream", post_approval(client, base_url, "responses", gated_body(
                    f"{tag}-s{round_}", stream=True)))
                record("answer", post_approval(client, base_url, "responses", answer_body))
                record("free_responses", post_approval(client, base_url, "responses",
                                                       free_body("responses")))
                record("free_responses_stream", post_approval(
                    client, base_url, "responses", free_body("responses", stream=True)))
                record("free_chat", post_approval(client, base_url, "chat", free_body("chat")))
            healthy = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30)
            if healthy.status_code != 200:
                figures.problems.append(f"{label}: /health {healthy.status_code} during the outage")
        # recovered: asking works again, and the answer refused during the outage now releases
        # exactly the call asked about before it
        after = _elicitation(_ask_until_called(client, base_url, f"{tag}-after"))
        released = post_approval(client, base_url, "responses", answer_body)
        calls = [(i.get("type"), i.get("call_id")) for i in released.items]
        recovered = after is not None and released.status == 200 and \
            calls == [("function_call", before["call_id"])]
        c["outage_recovered"] += recovered
        c["outages"] += 1
        if not recovered:
            figures.problems.append(f"{label}: no recovery: ask {after is not None}, answer "
                                    f"{released.status} {calls} {released.error}")
    return figures


# ------------------------------------------------------------------------------- SIGKILL

def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(child) for task in tasks
                for child in (task / "children").read_text().split()]
    except OSError:
        return []


def kill_server_hard(cli_pid: int) -> None:
    """SIGKILL the server's process group (API server, engine core, workers: all at once), then
    the `serve-tiny` process that started it: no shutdown code runs anywhere."""
    own = os.getpgid(0)
    for child in _children(cli_pid):
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(child)
            if group != own:
                os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(cli_pid, signal.SIGKILL)


def store_check(db: Path) -> tuple[bool, dict[str, str]]:
    """(integrity and foreign keys ok, origin elicitation id -> grant id) of a SQLite store,
    read with a plain sqlite3 connection as any tool would."""
    import sqlite3
    conn = sqlite3.connect(db)
    try:
        ok = conn.execute("PRAGMA integrity_check").fetchone() == ("ok",) and \
            conn.execute("PRAGMA foreign_key_check").fetchall() == []
        grants = dict(conn.execute("SELECT origin_elicitation_id, id FROM grants "
                                   "WHERE revoked_at IS NULL"))
        return ok, grants
    finally:
        conn.close()


def _traffic_then_kill(base_url: str, pid: int, cycle: int, kill_after: int, workers: int,
                       figures: Figures) -> list[tuple[str, str, str]]:
    """Approval flows from `workers` threads until `kill_after` grants were acknowledged and an
    answer is in flight, then SIGKILL; returns the acknowledged (elicitation id, session, call id)."""
    import threading
    c = figures.counts
    stop = threading.Event()
    lock = threading.Lock()
    in_flight = [0]
    acknowledged: list[tuple[str, str, str]] = []

    def flow(worker: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            n = 0
            while not stop.is_set():
                n += 1
                session = f"kill-{cycle}-{worker}-{n}-{uuid.uuid4().hex[:6]}"
                asked = _ask(client, base_url, session)
                with lock:
                    c["kill_requests"] += 1
                item = _elicitation(asked)
                if item is None and _no_call(asked):
                    with lock:
                        c["kill_asks_without_call"] += 1
                    continue
                if item is None:
                    if not stop.is_set():
                        figures.problems.append(f"kill: ask failed before the kill: "
                                                f"{asked.status} {asked.error}")
                    return
                with lock:
                    in_flight[0] += 1
                answer = post_approval(client, base_url, "responses", gated_body(
                    session, *accept_input(item, f"er_{session}")))
                with lock:
                    in_flight[0] -= 1
                    c["kill_requests"] += 1
                    c["kill_answers_sent"] += 1
                calls = [(i.get("type"), i.get("call_id")) for i in answer.items]
                if answer.status == 200 and calls == [("function_call", item["call_id"])]:
                    with lock:
                        acknowledged.append((item["id"], session, item["call_id"]))
                elif answer.status is None:
                    with lock:
                        c["kill_answers_cut"] += 1   # in flight at the kill: the client was not told
                    return
                else:
                    figures.problems.append(f"kill: accept got {answer.status} {answer.error}")
                    return

    threads = [threading.Thread(target=flow, args=(w,), daemon=True) for w in range(workers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(acknowledged) < kill_after \
            and any(t.is_alive() for t in threads):
        time.sleep(0.02)
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        with lock:
            if in_flight[0]:   # an answer (a grant write) is in the server right now
                break
        time.sleep(0.001)
    with lock:
        c["kill_answers_in_flight_at_kill"] += in_flight[0]
    kill_server_hard(pid)
    stop.set()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT)
    with lock:   # every answer the client received before the kill
        return list(acknowledged)


def run_kill(start: Callable[[], tuple[str, int, Callable[[], None]]], db: Path, *,
             kill_after: int, workers: int = 4, cycles: int = 1,
             figures: Figures | None = None) -> Figures:
    """`cycles` times: approval flows (ask -> elicitation -> accept `session` -> released call)
    from `workers` threads, each in its own session; once `kill_after` grants were acknowledged
    and an answer is in flight, SIGKILL the server; restart it on the same store; check every
    acknowledged grant is there and releases the next call of its session without asking.
    `start()` returns (base_url, serve-tiny pid, cleanup); cleanup must be idempotent."""
    figures = figures or Figures()
    c = figures.counts
    acknowledged: list[tuple[str, str, str]] = []     # (elicitation id, session, call id)
    grants: dict[str, str] = {}
    base_url, pid, cleanup = start()
    started = time.monotonic()
    try:
        for cycle in range(cycles):
            told = _traffic_then_kill(base_url, pid, cycle, kill_after, workers, figures)
            cleanup()
            c["kills"] += 1
            acknowledged += told
            _log(f"kill {cycle + 1}: {len(told)} grants acknowledged; restarting on the same store")
            base_url, pid, cleanup = start()
            ok, grants = store_check(db)
            c["store_integrity_failures"] += not ok
            if not ok:
                figures.problems.append("kill: the store failed its integrity/foreign-key check")
        found = [entry for entry in acknowledged if entry[0] in grants]
        c["grants_acknowledged"] = len(acknowledged)
        c["grants_found_after_restart"] = len(found)
        c["grants_lost"] = len(acknowledged) - len(found)
        c["grants_found_not_acknowledged"] = len(grants) - len(found)
        if c["grants_lost"]:
            figures.problems.append(f"kill: {c['grants_lost']} acknowledged grants lost")
        # usable: the next call in each acknowledged session is released by its grant
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            for eid, session, _ in acknowledged:
                answer = _ask_until_called(client, base_url, session, sent=c)
                kinds = [i.get("type") for i in answer.items]
                usable = answer.status == 200 and kinds == ["function_call"] and \
                    answer.items[0].get("name") == GATED_TOOL
                c["grants_usable_after_restart"] += usable
                if not usable:
                    figures.problems.append(f"kill: grant of {eid} not usable: {answer.status} "
                                            f"{kinds} {answer.error}")
    finally:
        cleanup()
    figures.extra["kill_seconds"] = round(time.monotonic() - started, 1)
    return figures


# ========================================================================================== CLI

def _start_server(flavour: str, log_dir: Path, env: dict[str, str] | None = None,
                  tag: str = "") -> ServeTinyProcess:
    log = log_dir / f"vllm-reliability-{flavour}{tag}.log"
    _log(f"starting serve-tiny ({flavour}); log {log}")
    server = start_serve_tiny(flavour, env=env, log_path=log)
    _log(f"server at {server.base_url}")
    return server


def table(fuzz: Figures | None, load: Figures | None, faults: Figures | None) -> str:
    rows = [("| part | requests tried | 2xx | 4xx | 5xx | no answer (hang) | violations leaked | "
             "problems | details |"), "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    if fuzz:
        c = fuzz.counts
        known = sum(v for k, v in c.items() if k.startswith("known_bug:"))
        rows.append(
            f"| fuzz (both endpoints, unary + stream) | {c['requests']} | {c['2xx']} | {c['4xx']} "
            f"| {c['5xx']} | {c['no_answer']} | {c['violations_leaked']} | {len(fuzz.problems)} | "
            f"4xx: {c['4xx_plugin']} from the plugin (exact param), {c['4xx_vllm']} from vLLM, "
            f"{c['4xx_without_field']} without a field ({known} on known bugs, below); "
            f"{c['unexpected_outcome']} unexpected "
            f"status; {c['calls_returned']} calls returned; {c['stream_errors']} stream errors; "
            f"{c['echo_mismatch']} echo mismatches; calls stopped by the plugin "
            f"{fuzz.extra.get('plugin_stopped_calls', 0):.0f}; {fuzz.extra.get('seconds')} s |")
    if load:
        c = load.counts
        rows.append(
            f"| load ({load.extra['concurrency']} concurrent streams x {load.extra['rounds']} "
            f"rounds) | {c['requests']} | {c['2xx']} | {c['4xx']} | {c['5xx']} | "
            f"{c['no_answer']} | {c['violations_leaked']} | {len(load.problems)} | "
            f"{c['completed']} streams completed; {c['calls_returned']} calls; "
            f"{c['cross_request_mixups']} cross-request mix-ups; {c['echo_mismatch']} echo "
            f"mismatches; {c['invalid_arguments']} off-schema arguments; "
            f"{load.extra.get('seconds')} s |")
    if faults:
        c = faults.counts
        all_tokens = [n for values in faults.extra.get("tokens_generated", {}).values()
                      for n in values]
        tried = c["stream_tried"] + c["unary_tried"] + c["half_body_tried"]
        aborted = c["stream_aborted"] + c["unary_aborted"] + c["half_body_aborted"]
        rows.append(
            f"| client disconnects | {tried} | - | - | - | - | - | {len(faults.problems)} | "
            f"aborted correctly: {aborted}/{tried} (mid-stream {c['stream_aborted']}/"
            f"{c['stream_tried']}, unary with the client gone after sending {c['unary_aborted']}/"
            f"{c['unary_tried']}, "
            f"half-sent body {c['half_body_aborted']}/{c['half_body_tried']}); tokens generated "
            f"before the abort, of a {faults.extra['budget_tokens']}-token budget: median "
            f"{_median(all_tokens)}, max {max(all_tokens, default=0)}; server answers afterwards: "
            f"{faults.extra['answers_after']}; {faults.extra.get('seconds')} s |")
    if fuzz and fuzz.extra.get("known_bugs"):
        rows.append("")
        rows += [f"known bug `{bug}` ({fuzz.counts[f'known_bug:{bug}']} requests): {where}"
                 for bug, where in fuzz.extra["known_bugs"].items()]
    if load and load.extra.get("rss_mib_per_round"):
        rows += ["", ("| server process (RSS MiB) | after round 1 (warm-up) | after the last round "
                      "| growth |"), "|---|---:|---:|---:|"]
        for key, values in load.extra["rss_mib_per_round"].items():
            rows.append(f"| {key} | {values[0]} | {values[-1]} | "
                        f"{load.extra['rss_growth_mib'][key]:+} |")
    return "\n".join(rows)


def approvals_table(outage: Figures | None, kill: Figures | None) -> str:
    rows = [("| fault | requests tried | 4xx | 503 `grant_store_unavailable` (the fail-closed "
             "answer) | other 5xx | gated calls leaked while the store was down | "
             "grants acknowledged | grants lost after kill | problems | details |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    if outage:
        c = outage.counts
        kinds = [k.split(":")[0] for k in c if k.endswith(":tried")]
        per = ", ".join(f"{k} {c[k + ':refused']}/{c[k + ':tried']}" for k in kinds)
        rows.append(
            f"| grant store unavailable ({', '.join(kinds)}) | {c['outage_tried']} | "
            f"{c['outage_4xx']} | {c['outage_5xx'] - c['outage_5xx_other']} | "
            f"{c['outage_5xx_other']} | {c['gated_leaked']} | - | - | "
            f"{len(outage.problems)} | refused as store-down (503 `grant_store_unavailable`, or "
            f"`response.failed` with it in a started stream) {c['outage_refused_store_down']} "
            f"({per}); other 5xx {c['outage_5xx_other']}; gated turns without any call "
            f"{c['outage_gated_without_call']}; turns without a gated tool answered 200: "
            f"{c['outage_free_ok']}; recovered after the outage: {c['outage_recovered']}/"
            f"{c['outages']} |")
    if kill:
        c = kill.counts
        rows.append(
            f"| API server process group SIGKILLed x {c['kills']}, restarted on the same SQLite "
            f"store | {c['kill_requests']} | - | - | - | - | {c['grants_acknowledged']} | "
            f"{c['grants_lost']} | {len(kill.problems)} | found after restart "
            f"{c['grants_found_after_restart']}, usable {c['grants_usable_after_restart']}; "
            f"answers in flight at the kill {c['kill_answers_in_flight_at_kill']} (grants stored "
            f"but never acknowledged: {c['grants_found_not_acknowledged']}); integrity/foreign-key "
            f"check failures {c['store_integrity_failures']}; {kill.extra.get('kill_seconds')} s |")
    return "\n".join(rows)


def run_approval_faults(parts: list[str], rounds: int, kill_after: int, kill_cycles: int,
                        flavour: str) -> tuple[Figures | None, Figures | None]:
    """The grant-store parts, each on servers of its own (approvals on)."""
    outage = kill = None
    folder = Path(tempfile.mkdtemp(prefix="vat-reliability-approvals-"))
    if "store" in parts:
        env = approval_env(folder / "outage")
        db = Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"])
        server = _start_server(flavour, folder, env, "-outage")
        try:
            _log(f"store outage: SQLite folder gone, SQLite locked ({rounds} rounds each) ...")
            outage = run_store_outage(server.base_url, lambda: sqlite_folder_gone(db),
                                      "sqlite_folder_gone", rounds)
            run_store_outage(server.base_url, lambda: sqlite_locked(db), "sqlite_locked", rounds,
                             outage)
        finally:
            server.stop()
        from vllm_allowed_tools.testing.postgres import PostgresUnavailable, ThrowawayPostgres
        try:
            pg = ThrowawayPostgres.start()
        except PostgresUnavailable as exc:
            _log(f"store outage: PostgreSQL not measured: {exc}")
        else:
            try:
                env = approval_env(folder / "pg", store=pg.dsn)
                server = _start_server(flavour, folder, env, "-pg")
                try:
                    _log(f"store outage: PostgreSQL stopped ({rounds} rounds) ...")
                    run_store_outage(server.base_url, lambda: postgres_stopped(pg),
                                     "postgres_stopped", rounds, outage)
                finally:
                    server.stop()
            finally:
                pg.close()
        _log(json.dumps({"store_outage": outage.as_dict()}))
    if "kill" in parts:
        env = approval_env(folder / "kill")

        def start() -> tuple[str, int, Callable[[], None]]:
            server = _start_server(flavour, folder, env, "-kill")
            return server.base_url, server.process.pid, server.stop

        _log(f"kill: {kill_cycles} x SIGKILL after {kill_after} acknowledged grants ...")
        kill = run_kill(start, Path(env["VLLM_ALLOWED_TOOLS_GRANT_STORE"]),
                        kill_after=kill_after, workers=4, cycles=kill_cycles)
        _log(json.dumps({"kill": kill.as_dict()}))
    return outage, kill


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz-examples", type=int, default=2000)
    parser.add_argument("--load-requests", type=int, default=64)
    parser.add_argument("--load-rounds", type=int, default=10)
    parser.add_argument("--disconnects", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None,
                        help="hypothesis seed (default: derandomized, the same cases every run)")
    parser.add_argument("--base-url", default=None, help="use this server instead of starting one")
    parser.add_argument("--server-pid", type=int, default=None, help="for RSS with --base-url")
    parser.add_argument("--flavour", default="random", choices=["random", "tool-happy"])
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    parser.add_argument("--outage-rounds", type=int, default=5,
                        help="rounds of 6 requests during each grant-store outage")
    parser.add_argument("--kill-after", type=int, default=20,
                        help="acknowledged grants before each SIGKILL")
    parser.add_argument("--kill-cycles", type=int, default=2)
    parser.add_argument("--skip", action="append", default=[],
                        choices=["fuzz", "load", "faults", "store", "kill"])
    args = parser.parse_args(argv)
    approval_parts = [part for part in ("store", "kill") if part not in args.skip]
    only_approvals = {"fuzz", "load", "faults"} <= set(args.skip)

    server = None
    try:
        if args.base_url or only_approvals:
            base_url, pid = (args.base_url or "").rstrip("/"), args.server_pid
        else:
            server = _start_server(args.flavour, Path(tempfile.gettempdir()))
            base_url, pid = server.base_url, server.process.pid
    except (RuntimeError, OSError) as exc:
        _log(f"error: {exc}")
        return 2
    fuzz = load = faults = None
    try:
        if "fuzz" not in args.skip:
            _log(f"fuzz: {args.fuzz_examples} examples ...")
            fuzz = run_fuzz(base_url, args.fuzz_examples, strict=False, seed=args.seed)
            _log(json.dumps({"fuzz": fuzz.as_dict()}))
        if "load" not in args.skip:
            _log(f"load: {args.load_requests} concurrent x {args.load_rounds} rounds ...")
            load = run_load(base_url, args.load_requests, args.load_rounds, pid)
            _log(json.dumps({"load": load.as_dict()}))
        if "faults" not in args.skip:
            _log(f"faults: {args.disconnects} mid-stream disconnects + unary + half-sent ...")
            faults = run_disconnects(base_url, args.disconnects)
            _log(json.dumps({"faults": faults.as_dict()}))
    finally:
        if server is not None:
            server.stop()
    outage = kill = None
    if approval_parts and args.base_url:
        _log("grant-store faults skipped: they need servers of their own (no --base-url)")
    elif approval_parts:
        try:
            outage, kill = run_approval_faults(approval_parts, args.outage_rounds,
                                               args.kill_after, args.kill_cycles, args.flavour)
        except (RuntimeError, OSError) as exc:
            _log(f"error: {exc}")
            return 2
    if fuzz or load or faults:
        print(table(fuzz, load, faults))
    if outage or kill:
        print(approvals_table(outage, kill))
    problems = [p for f in (fuzz, load, faults, outage, kill) if f for p in f.problems]
    if load:
        problems += [f"RSS not flat: {why}" for why in rss_growth_problems(load)]
    for problem in problems[:50]:
        print(f"problem: {problem}")
    if args.json:
        args.json.write_text(json.dumps({name: f.as_dict() | {"problem_list": f.problems}
                                         for name, f in (("fuzz", fuzz), ("load", load),
                                                         ("faults", faults),
                                                         ("store_outage", outage),
                                                         ("kill", kill)) if f}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The fuzz oracle and run: what each generated request should get (computed locally by the
plugin's own request rewrite), sent to a real server and judged against what came back."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from vllm_allowed_tools.errors import AllowedToolsError
from vllm_allowed_tools.request import flat_name
from vllm_allowed_tools.request.custom_tools import read_custom_tools
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.wire import ALLOWLIST_KEY

from ..metrics import scrape_metric
from .fuzz_cases import Case, fuzz_cases
from .report import Figures
from .wire import MISSING, REQUEST_TIMEOUT, Observed, send_sync

VIOLATIONS = "vllm_allowed_tools:violations_total"


@dataclass
class Expect:
    outcome: str                             # "ours_400", "vllm_4xx", "ok", "any"
    param: str | None = None                 # ours_400: the exact error.param
    allowed: frozenset[str] | None = None    # calls a 200 may carry (flat names)
    parallel: bool = True
    echo: Any = MISSING                      # the tool_choice a Responses object must echo
    #: the request's grammar custom tools: a completed call's input must be admitted by its grammar
    grammars: Mapping[str, Any] = field(default_factory=dict)


def expected(case: Case) -> Expect:
    """What the server must answer `case`, from the middleware's own reading of it."""
    if isinstance(case.body, bytes) or not isinstance(case.body, dict):
        return Expect("vllm_4xx")
    body = {k: v for k, v in case.body.items() if k != ALLOWLIST_KEY}   # the middleware strips it
    try:   # what the middleware does: typed fields read as vLLM reads them, then the policy
        policy = rewrite_request(body, case.api).allowlist
        grammars = read_custom_tools(body.get("tools"), case.api).grammars
    except AllowedToolsError as exc:
        return Expect("ours_400", param=exc.param)
    if policy is not None and policy.has_allowlist:
        catalog_faulty = any(f.startswith("catalog:") for f in case.faults)
        outcome = "vllm_4xx" if case.input_fault else ("any" if catalog_faulty else "ok")
        return Expect(outcome, allowed=frozenset(policy.allowed_flat_names),
                      parallel=policy.parallel_tool_calls, grammars=grammars,
                      echo=case.body.get("tool_choice") if case.api == "responses" else MISSING)
    catalog = catalog_names(body, case.api)
    if case.intended is not None:     # a near-miss of allowed_tools must never become "auto"
        catalog = case.intended
    if policy is not None and policy.choice == "named":
        catalog = frozenset(policy.allowed_flat_names)
    return Expect("vllm_4xx" if case.input_fault or case.intended is not None else "any",
                  allowed=catalog, grammars=grammars)


def catalog_names(body: dict, api: str) -> frozenset[str]:
    """Flat names of every function (and namespace member) a request offers, read permissively."""
    names: set[str | None] = set()
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        if api == "chat":
            fn = tool.get("function") if tool.get("type") != "custom" else tool.get("custom")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.add(fn["name"])
        elif tool.get("type") in ("function", "custom") and isinstance(tool.get("name"), str):
            names.add(tool["name"])
        elif tool.get("type") == "namespace" and isinstance(tool.get("name"), str) \
                and isinstance(tool.get("tools"), list):
            names.update(flat_name(m.get("name"), tool["name"]) for m in tool["tools"]
                         if isinstance(m, dict) and isinstance(m.get("name"), str))
    return frozenset(names - {None})


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


def _judge_4xx(case: Case, expect: Expect, observed: Observed, figures: Figures) -> list[str]:
    c, status, problems = figures.counts, observed.status, []
    c["4xx"] += 1
    c["4xx_plugin" if expect.outcome == "ours_400" else "4xx_vllm"] += 1
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
    return problems


def _judge_2xx(case: Case, expect: Expect, observed: Observed, figures: Figures,
               gated: frozenset[str] = frozenset()) -> list[str]:
    c, problems = figures.counts, []
    c["2xx"] += 1
    if expect.outcome in ("ours_400", "vllm_4xx"):
        c["unexpected_outcome"] += 1
        problems.append(f"expected a 4xx ({expect.outcome}, param {expect.param!r}), got "
                        f"{observed.status}")
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
    unapproved = [name for name, _ in observed.calls if name in gated]
    if unapproved:   # the fuzz never answers an approval: a gated call may only be asked about
        c["gated_calls_leaked"] += len(unapproved)
        c["violations_leaked"] += len(unapproved)
        problems.append(f"gated calls released without an approval: {unapproved}")
    if observed.finish in ("completed", "stop", "tool_calls"):   # a cut-off input may be partial
        refused = [(name, text) for name, text in observed.calls
                   if name in expect.grammars and not expect.grammars[name].admits(text)]
        if refused:
            c["custom_inputs_leaked"] += len(refused)
            c["violations_leaked"] += len(refused)
            problems.append(f"custom tool inputs their grammar refuses: {refused[:3]}")
    if not expect.parallel and len(observed.calls) > 1:
        c["parallel_false_excess"] += 1
        problems.append(f"parallel_tool_calls false but {len(observed.calls)} calls")
    if expect.echo is not MISSING:
        wrong = [echo for echo in observed.echoes if echo != expect.echo]
        if wrong or not observed.echoes:
            c["echo_mismatch"] += 1
            problems.append(f"Responses echoed tool_choice {wrong[:1] or 'nothing'}, "
                            f"not the client's {expect.echo}")
    return problems


def judge(case: Case, expect: Expect, observed: Observed, figures: Figures,
          gated: frozenset[str] = frozenset()) -> list[str]:
    """Record `observed` in `figures`; return what was wrong with it (empty: nothing). ``gated``:
    the tools the server's approval policy gates (their calls must never come back, and a valid
    request may get the approvals' own 400, naming its field, instead of a 200)."""
    if gated and expect.outcome == "ok":
        expect = replace(expect, outcome="any")
    c = figures.counts
    c["requests"] += 1
    c[f"{case.api}_{'stream' if case.stream else 'unary'}"] += 1
    status = observed.status
    if status is None:
        c["no_answer"] += 1
        problems = [f"no answer in {REQUEST_TIMEOUT:.0f}s: {observed.transport_error}"]
    elif status >= 500:
        c["5xx"] += 1
        problems = [f"HTTP {status}: {observed.error}"]
    elif 400 <= status < 500:
        problems = _judge_4xx(case, expect, observed, figures)
    elif 200 <= status < 300:
        problems = _judge_2xx(case, expect, observed, figures, gated)
    else:
        c["other_status"] += 1
        problems = [f"HTTP {status}"]
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


def run_fuzz(base_url: str, examples: int, *, strict: bool, seed: int | None = None,
             figures: Figures | None = None, gated: frozenset[str] = frozenset()) -> Figures:
    """Send `examples` generated requests. `strict`: raise on the first problem (hypothesis then
    shrinks it to a minimal failing request); otherwise record it and go on. ``gated``: the tools
    the server's approval policy gates (see :func:`judge`)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    figures = figures or Figures()
    root = base_url.removesuffix("/v1")
    violations_before = scrape_metric(root, VIOLATIONS)
    started = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)) as client:

        @settings(max_examples=examples, deadline=None, derandomize=seed is None, database=None,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(fuzz_cases())
        def one(case: Case) -> None:
            figures.counts[f"kind_{case.kind}"] += 1
            figures.counts["with_faults" if case.faults else "without_faults"] += 1
            if case.has_custom_tools():
                figures.counts["with_custom_tools"] += 1
            expect = expected(case)
            figures.counts[f"expect_{expect.outcome}"] += 1
            observed = send_sync(client, base_url, case.api, case.body, case.stream)
            problems = judge(case, expect, observed, figures, gated)
            if strict and problems:
                raise AssertionError(f"{case.describe()}\n-> " + "\n-> ".join(problems))

        test = hypothesis_seed(seed)(one) if seed is not None else one
        test()
    figures.extra["healthy_after"] = httpx.get(root + "/health", timeout=30).status_code == 200
    figures.extra["plugin_stopped_calls"] = scrape_metric(root, VIOLATIONS) - violations_before
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures

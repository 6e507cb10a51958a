"""Prompt-cache benchmark: how much of each turn's prompt the real vLLM prefix cache serves.

    python benchmarks/prompt_cache.py [--turns 10] [--json OUT]

Replays a multi-turn agent transcript (a stable 16-tool catalog from the tiny models' pool; every
turn a user message, the assistant's answer exactly as the server returned it, and a tool result for
each call it made) whose allowed subset (2-4 tools) changes every turn, with the mode alternating
required/auto and ``parallel_tool_calls: false``, against a real ``vllm serve`` on the cached random
tiny model (CPU, ``--block-size 32``, prefix caching on, ``--enable-prompt-tokens-details``), on both
``/v1/responses`` and ``/v1/chat/completions``, for three placements of the per-turn policy:

* ``tail``           ours: full catalog + ``tool_choice: allowed_tools``; the policy block is rendered
                     after the last message (bundled ``hermes`` template);
* ``after_catalog``  the same requests, served with ``benchmarks/templates/hermes_policy_after_catalog
                     .jinja``, which renders the policy block right after the catalog in the system turn;
* ``filtering``      what Dynamo/SGLang do: send only the allowed tools with a plain ``tool_choice``
                     ``auto``/``required`` (no policy block; the catalog itself changes every turn).

Isolation: ``tail`` and ``filtering`` share one server, ``after_catalog`` gets a second one (started
after the first is stopped: its template is a server flag). Within a server every (variant, endpoint)
run opens with its own system prompt, whose first tokens differ, so no two runs share even the first
32-token block: nothing a run reuses was written by another run.

What is measured per turn: the prompt tokens and ``cached_tokens`` the server reported
(``usage.input_tokens_details.cached_tokens`` / ``usage.prompt_tokens_details.cached_tokens``), the
deltas of vLLM's ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` on
``/metrics`` across the request, and, from the same prompt rendered locally
(:mod:`vllm_allowed_tools.templates.render`) and tokenized with the model's tokenizer (checked against the
server's ``/tokenize`` and its prompt-token count):

* ``expected``: the tokens before the PREVIOUS turn's policy block. That is everything the previous
  request already sent that this one repeats, i.e. the most any prefix cache can serve: this turn's own
  new messages (the assistant call, the tool result, the user message) sit where the previous prompt
  had its policy block, so they cannot have been cached yet;
* ``before_block``: the tokens before this turn's own policy block (``expected`` plus this turn's new
  messages): what the NEXT turn can reuse;
* ``lcp``: the longest token prefix shared with any earlier prompt of the run, and ``ideal``: the
  cached tokens vLLM should report for it (whole 32-token blocks, at most ``prompt - 1`` tokens, since
  vLLM always recomputes the last prompt token).

Goal (changing only the allowed subset must not cost the prefix cache: a turn reuses everything the
previous request sent): for ``tail``, on every turn after the first and on both endpoints,
``cached >= expected - 32`` (one block). The script says whether it was met and exits 1 when not
(2 when the benchmark could not run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.devtools.prefix import POLICY_BLOCK_MARKERS, load_tokenizer, render_with_policy
from vllm_allowed_tools.devtools.serve import SERVED_MODEL_NAME, ServeError, TinyServer, start_server

HERE = Path(__file__).resolve().parent
AFTER_CATALOG_TEMPLATE = HERE / "templates" / "hermes_policy_after_catalog.jinja"
BLOCK_SIZE = 32          # serve-tiny's --block-size
CATALOG_SIZE = 16
VARIANTS = ("tail", "after_catalog", "filtering")
ENDPOINTS = ("responses", "chat")
TAIL_MARKER = POLICY_BLOCK_MARKERS["hermes"]
AFTER_CATALOG_MARKER = "Allowed tools this turn ("
_ASKS = ["Start with the first step.", "Good, continue.", "Next step, please.", "Keep going.",
         "Now handle the follow-up.", "Take care of the next item.", "Do the next part.",
         "Carry on with the task.", "One more step.", "Wrap up this part."]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the transcript plan

@dataclass(frozen=True)
class TurnPlan:
    ask: str
    mode: str              # "required" | "auto"
    allowed: tuple[str, ...]


def make_plan(turns: int, seed: int) -> tuple[list[Any], list[TurnPlan]]:
    """A stable catalog and, per turn, an ask, a mode and an allowed subset differing from the last."""
    rng = random.Random(seed)
    catalog = rng.sample(list(POOL), CATALOG_SIZE)
    plan: list[TurnPlan] = []
    previous: tuple[str, ...] = ()
    for index in range(turns):
        while True:
            subset = tuple(sorted(tool.name for tool in rng.sample(catalog, rng.randint(2, 4))))
            if subset != previous:
                break
        previous = subset
        mode = "required" if index % 2 == 0 else "auto"
        plan.append(TurnPlan(ask=f"{_ASKS[index % len(_ASKS)]} (step {index + 1})", mode=mode,
                             allowed=subset))
    return catalog, plan


# --------------------------------------------------------------------------- HTTP helpers

def post_json(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST ``body`` as JSON and read the JSON answer; an HTTP error says what the server said."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"POST {url} -> HTTP {error.code}: {detail}") from error


def _metrics(root: str) -> dict[str, float]:
    """Sums of vLLM's prefix-cache counters over all label sets."""
    with urllib.request.urlopen(root + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {"hits": 0.0, "queries": 0.0}
    names = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries"}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            totals[names[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def _metrics_after(root: str, before: dict[str, float], timeout: float = 5.0) -> dict[str, float]:
    """Counters once this request's lookup is recorded (stats reach the API server asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _metrics(root)
        if now["queries"] > before["queries"] or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# --------------------------------------------------------------------------- one run

@dataclass
class TurnResult:
    turn: int
    mode: str
    allowed: list[str]
    called: list[str]               # tool names the server returned (empty: it answered in text)
    finish: str
    prompt_tokens: int              # from usage
    cached_tokens: int              # from usage
    local_prompt_tokens: int        # the locally rendered prompt, tokenized
    tokenize_matches: bool          # server /tokenize of the local text == local token ids
    before_block: int | None        # tokens before this turn's policy block
    expected: int | None            # tokens before the previous turn's policy block
    history_stable: bool | None     # the previous prompt up to its block is a prefix of this one
    lcp: int                        # longest token prefix shared with an earlier prompt of the run
    ideal: int                      # whole blocks of min(lcp, prompt - 1)
    hits_delta: float
    queries_delta: float
    latency_s: float

    @property
    def margin(self) -> int | None:
        return None if self.expected is None else self.cached_tokens - self.expected


@dataclass
class RunResult:
    variant: str
    endpoint: str
    system_prompt: str
    turns: list[TurnResult] = field(default_factory=list)

    def later(self) -> list[TurnResult]:
        return self.turns[1:]

    def summary(self) -> dict[str, Any]:
        later = self.later()
        hits = sum(t.hits_delta for t in later)
        queries = sum(t.queries_delta for t in later)
        margins = [t.margin for t in later if t.margin is not None]
        return {
            "variant": self.variant, "endpoint": self.endpoint, "turns": len(self.turns),
            "mean_prompt_tokens": statistics.fmean(t.prompt_tokens for t in later) if later else 0.0,
            "mean_cached_tokens": statistics.fmean(t.cached_tokens for t in later) if later else 0.0,
            "mean_cached_fraction": statistics.fmean(t.cached_tokens / t.prompt_tokens
                                                     for t in later) if later else 0.0,
            "mean_uncached_tokens": statistics.fmean(t.prompt_tokens - t.cached_tokens
                                                     for t in later) if later else 0.0,
            "last_turn_cached_fraction": (self.turns[-1].cached_tokens / self.turns[-1].prompt_tokens
                                          if self.turns else 0.0),
            "min_cached_minus_expected": min(margins) if margins else None,
            "turns_at_ideal": sum(t.cached_tokens == t.ideal for t in later),
            "counter_hits": hits, "counter_queries": queries,
            "counter_hit_rate": hits / queries if queries else 0.0,
            "prompt_tokens_match_local": all(t.prompt_tokens == t.local_prompt_tokens
                                             for t in self.turns),
            "tokenize_matches": all(t.tokenize_matches for t in self.turns),
            "history_stable": all(t.history_stable is not False for t in self.turns),
        }


def _token_index_at(offsets: list[tuple[int, int]], char: int) -> int:
    """Number of tokens that end at or before `char` (the first one touching it starts the block)."""
    for index, (_, end) in enumerate(offsets):
        if end > char:
            return index
    return len(offsets)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] != b[index]:
            return index
    return n


def _block_char(text: str, variant: str) -> int | None:
    if variant == "tail":
        found = text.rfind(TAIL_MARKER)
    elif variant == "after_catalog":
        found = text.rfind(AFTER_CATALOG_MARKER)
    else:
        return None
    return None if found < 0 else found


class Runner:
    def __init__(self, server: TinyServer, tokenizer: Any, catalog: list[Any], plan: list[TurnPlan],
                 max_tokens: int):
        self.server = server
        self.tokenizer = tokenizer
        self.catalog = catalog
        self.plan = plan
        self.max_tokens = max_tokens

    def _request(self, variant: str, endpoint: str, turn: TurnPlan, messages: list[dict],
                 items: list[dict]) -> dict[str, Any]:
        filtering = variant == "filtering"
        tools = [tool for tool in self.catalog if not filtering or tool.name in turn.allowed]
        if endpoint == "responses":
            body: dict[str, Any] = {
                "model": SERVED_MODEL_NAME, "input": items, "temperature": 0.0,
                "max_output_tokens": self.max_tokens, "parallel_tool_calls": False,
                "tools": [tool.responses_tool() for tool in tools],
                "tool_choice": turn.mode if filtering else {
                    "type": "allowed_tools", "mode": turn.mode,
                    "tools": [{"type": "function", "name": name} for name in turn.allowed]},
            }
            return post_json(self.server.base_url + "/responses", body)
        body = {
            "model": SERVED_MODEL_NAME, "messages": messages, "temperature": 0.0,
            "max_tokens": self.max_tokens, "parallel_tool_calls": False,
            "tools": [tool.chat_tool() for tool in tools],
            "tool_choice": turn.mode if filtering else {
                "type": "allowed_tools", "allowed_tools": {
                    "mode": turn.mode,
                    "tools": [{"type": "function", "function": {"name": name}} for name in turn.allowed]}},
        }
        return post_json(self.server.base_url + "/chat/completions", body)

    def _server_ids(self, text: str) -> list[int]:
        reply = post_json(self.server.root_url + "/tokenize",
                      {"model": SERVED_MODEL_NAME, "prompt": text, "add_special_tokens": False})
        return list(reply.get("tokens") or [])

    def run(self, variant: str, endpoint: str) -> RunResult:
        system = (f"[{variant}/{endpoint} run] You are a helpful agent working through a multi-step "
                  "task with tools.")
        result = RunResult(variant=variant, endpoint=endpoint, system_prompt=system)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]   # Chat shape
        items: list[dict[str, Any]] = [{"role": "system", "content": system}]      # Responses input
        earlier_ids: list[list[int]] = []
        previous_text: str | None = None
        previous_block: int | None = None
        for index, turn in enumerate(self.plan, 1):
            messages.append({"role": "user", "content": turn.ask})
            items.append({"role": "user", "content": turn.ask})
            before = _metrics(self.server.root_url)
            started = time.monotonic()
            reply = self._request(variant, endpoint, turn, messages, items)
            latency = time.monotonic() - started
            after = _metrics_after(self.server.root_url, before)

            # what the server rendered, reproduced locally
            tools_chat = [tool.chat_tool() for tool in self.catalog
                          if variant != "filtering" or tool.name in turn.allowed]
            policy = None if variant == "filtering" else {"mode": turn.mode, "names": list(turn.allowed)}
            template = str(AFTER_CATALOG_TEMPLATE) if variant == "after_catalog" else "hermes"
            text = render_with_policy(messages, tools_chat, template, policy,
                                      **self.tokenizer.template_kwargs)
            ids, offsets = self.tokenizer.encode(text)
            block_char = _block_char(text, variant)
            before_block = None if block_char is None else _token_index_at(offsets, block_char)
            expected = stable = None
            if previous_text is not None and previous_block is not None:
                stable = text.startswith(previous_text[:previous_block])
                expected = _token_index_at(offsets, previous_block)
            lcp = max((_lcp(ids, old) for old in earlier_ids), default=0)

            if endpoint == "responses":
                usage = reply["usage"]
                prompt_tokens = usage["input_tokens"]
                cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
                called, finish = self._absorb_responses(reply, messages, items, index)
            else:
                usage = reply["usage"]
                prompt_tokens = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                called, finish = self._absorb_chat(reply, messages, items, index)

            ideal = (min(lcp, prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
            record = TurnResult(
                turn=index, mode=turn.mode, allowed=list(turn.allowed), called=called, finish=finish,
                prompt_tokens=prompt_tokens, cached_tokens=cached, local_prompt_tokens=len(ids),
                tokenize_matches=self._server_ids(text) == ids, before_block=before_block,
                expected=expected, history_stable=stable, lcp=lcp, ideal=ideal,
                hits_delta=after["hits"] - before["hits"],
                queries_delta=after["queries"] - before["queries"], latency_s=round(latency, 3))
            result.turns.append(record)
            _log(f"  {variant:13s} {endpoint:9s} turn {index:2d}: prompt {prompt_tokens:5d} cached "
                 f"{cached:5d} expected {_fmt(expected):>5s} lcp {lcp:5d} "
                 f"called {','.join(called) or '-'} ({latency:.1f}s)")
            earlier_ids.append(ids)
            previous_text, previous_block = text, block_char
        return result

    # the history a real client sends next: the server's own answer, plus a result per call

    @staticmethod
    def _tool_output(index: int, name: str) -> str:
        return json.dumps({"ok": True, "tool": name, "step": index})

    def _absorb_responses(self, reply: dict, messages: list[dict], items: list[dict],
                          index: int) -> tuple[list[str], str]:
        text_parts: list[str] = []
        calls: list[dict[str, Any]] = []
        for item in reply.get("output") or []:
            if item.get("type") == "message":
                text = "".join(part.get("text") or "" for part in item.get("content") or []
                               if part.get("type") == "output_text")
                text_parts.append(text)
                items.append({"role": "assistant", "content": text})
            elif item.get("type") == "function_call":
                calls.append(item)
                items.append({"type": "function_call", "call_id": item["call_id"],
                              "name": item["name"], "arguments": item["arguments"]})
        assistant: dict[str, Any] = {"role": "assistant", "content": "".join(text_parts) or None}
        if calls:
            assistant["tool_calls"] = [{"id": call["call_id"], "type": "function",
                                        "function": {"name": call["name"],
                                                     "arguments": call["arguments"]}}
                                       for call in calls]
        if text_parts or calls:
            messages.append(assistant)
        for call in calls:
            output = self._tool_output(index, call["name"])
            items.append({"type": "function_call_output", "call_id": call["call_id"], "output": output})
            messages.append({"role": "tool", "tool_call_id": call["call_id"], "content": output})
        finish = (reply.get("incomplete_details") or {}).get("reason") or reply.get("status") or ""
        return [call["name"] for call in calls], finish

    def _absorb_chat(self, reply: dict, messages: list[dict], items: list[dict],
                     index: int) -> tuple[list[str], str]:
        choice = reply["choices"][0]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if calls:
            assistant["tool_calls"] = [{"id": call["id"], "type": "function",
                                        "function": {"name": call["function"]["name"],
                                                     "arguments": call["function"]["arguments"]}}
                                       for call in calls]
        messages.append(assistant)
        for call in calls:
            output = self._tool_output(index, call["function"]["name"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        return [call["function"]["name"] for call in calls], choice.get("finish_reason") or ""


# --------------------------------------------------------------------------- reporting

def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits else f"{value:.0f}"
    return str(value)


def summary_table(runs: list[RunResult]) -> str:
    lines = [("| placement | endpoint | mean prompt tokens | mean cached tokens | mean uncached tokens | "
             "cached / prompt (mean; last turn) | min(cached - expected) | "
             "turns with cached = block-floored LCP | counter hit rate (hits / queries) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s = run.summary()
        lines.append(
            f"| {run.variant} | {run.endpoint} | {s['mean_prompt_tokens']:.0f} | "
            f"{s['mean_cached_tokens']:.0f} | {s['mean_uncached_tokens']:.0f} | "
            f"{s['mean_cached_fraction']:.3f}; {s['last_turn_cached_fraction']:.3f} | "
            f"{_fmt(s['min_cached_minus_expected'])} | {s['turns_at_ideal']}/{len(run.later())} | "
            f"{s['counter_hit_rate']:.3f} ({s['counter_hits']:.0f} / {s['counter_queries']:.0f}) |")
    return "\n".join(lines)


def per_turn_table(runs: list[RunResult]) -> str:
    lines = [("| endpoint | turn | mode | allowed | called | prompt | before block | expected | "
             "cached | cached - expected | hits / queries (counters) |"),
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for t in run.turns:
            lines.append(
                f"| {run.endpoint} | {t.turn} | {t.mode} | {', '.join(t.allowed)} | "
                f"{', '.join(t.called) or '(text)'} | {t.prompt_tokens} | {_fmt(t.before_block)} | "
                f"{_fmt(t.expected)} | {t.cached_tokens} | {_fmt(t.margin)} | "
                f"{t.hits_delta:.0f} / {t.queries_delta:.0f} |")
    return "\n".join(lines)


def check_goal(runs: list[RunResult]) -> tuple[bool, list[str]]:
    failures = []
    for run in runs:
        if run.variant != "tail":
            continue
        for t in run.later():
            if t.expected is None:
                failures.append(f"tail/{run.endpoint} turn {t.turn}: no policy block found")
            elif t.cached_tokens < t.expected - BLOCK_SIZE:
                failures.append(f"tail/{run.endpoint} turn {t.turn}: cached {t.cached_tokens} < "
                                f"expected {t.expected} - {BLOCK_SIZE}")
    return not failures, failures


def sanity_notes(runs: list[RunResult]) -> list[str]:
    notes = []
    for run in runs:
        s = run.summary()
        if not s["prompt_tokens_match_local"]:
            notes.append(f"{run.variant}/{run.endpoint}: the server's prompt-token count differs from "
                         "the local rendering on some turn (expected values may be off)")
        if not s["tokenize_matches"]:
            notes.append(f"{run.variant}/{run.endpoint}: /tokenize differs from the local tokenizer")
        if not s["history_stable"]:
            notes.append(f"{run.variant}/{run.endpoint}: the history before the previous policy block "
                         "was re-rendered differently on some turn")
        odd = [t.turn for t in run.turns if t.cached_tokens % BLOCK_SIZE]
        if odd:
            notes.append(f"{run.variant}/{run.endpoint}: cached tokens not a multiple of "
                         f"{BLOCK_SIZE} on turns {odd}")
        mismatch = [t.turn for t in run.turns if t.hits_delta != t.cached_tokens]
        if mismatch:
            notes.append(f"{run.variant}/{run.endpoint}: counter hits delta != usage cached tokens "
                         f"on turns {mismatch}")
    return notes


# --------------------------------------------------------------------------- main

def _serve(model: Path, extra: list[str], log_dir: Path, name: str, timeout: float) -> TinyServer:
    log_path = log_dir / f"vllm-{name}.log"
    _log(f"starting vllm ({name}) on {model}; log: {log_path}")
    started = time.monotonic()
    server = start_server(model, extra_args=extra, log_path=log_path, timeout=timeout)
    _log(f"healthy after {time.monotonic() - started:.0f}s at {server.base_url}")
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--seed", type=int, default=7, help="transcript seed (catalog and subsets)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--flavour", choices=("random", "tool-happy"), default="random",
                        help="tiny model (default: random weights)")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2")

    started = time.monotonic()
    model = ensure_model(args.flavour, 0, log=_log)
    tokenizer = load_tokenizer(model)
    catalog, plan = make_plan(args.turns, args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="prompt-cache-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    try:
        # server 1: our template; tail and filtering runs (distinct system prompts, no shared blocks)
        with _serve(model, [], log_dir, "tail+filtering", args.timeout) as server:
            runner = Runner(server, tokenizer, catalog, plan, args.max_tokens)
            for variant in ("tail", "filtering"):
                for endpoint in ENDPOINTS:
                    runs.append(runner.run(variant, endpoint))
        # server 2 (after the first stopped): the policy-after-catalog template
        with _serve(model, ["--chat-template", str(AFTER_CATALOG_TEMPLATE)], log_dir,
                    "after_catalog", args.timeout) as server:
            runner = Runner(server, tokenizer, catalog, plan, args.max_tokens)
            for endpoint in ENDPOINTS:
                runs.append(runner.run("after_catalog", endpoint))
    except (ServeError, RuntimeError, OSError, KeyError) as exc:
        _log(f"error: {exc}")
        return 2
    runs.sort(key=lambda run: (VARIANTS.index(run.variant), ENDPOINTS.index(run.endpoint)))
    elapsed = time.monotonic() - started

    met, failures = check_goal(runs)
    notes = sanity_notes(runs)
    print(f"## Prompt-cache benchmark: {args.turns} turns, {CATALOG_SIZE}-tool catalog, block size "
          f"{BLOCK_SIZE}, {args.flavour} tiny model, vLLM CPU ({elapsed:.0f}s)\n")
    print(f"Means over turns 2..{args.turns} (turn 1 is cold in every run). `expected` = tokens before "
          "the previous turn's policy block: for `tail` everything the previous request sent "
          "(system, catalog, whole history); for `after_catalog` only the system text and catalog; "
          "`filtering` has no block. Block-floored LCP = whole 32-token blocks of the longest token "
          "prefix shared with an earlier prompt of the run (at most prompt - 1).\n")
    print(summary_table(runs))
    print("\n### Tail placement, per turn\n")
    print(per_turn_table([run for run in runs if run.variant == "tail"]))
    print()
    for note in notes:
        print(f"note: {note}")
    if met:
        print(f"GOAL MET: for the tail placement every turn after the first had cached tokens within "
              f"one block ({BLOCK_SIZE}) of everything before the previous turn's policy block, on "
              "both endpoints.")
    else:
        print("GOAL NOT MET:")
        for failure in failures:
            print(f"  {failure}")
    if args.json:
        args.json.write_text(json.dumps({
            "config": {"turns": args.turns, "seed": args.seed, "max_tokens": args.max_tokens,
                       "block_size": BLOCK_SIZE, "flavour": args.flavour, "catalog": [tool.name for tool in catalog],
                       "model": str(model), "elapsed_s": round(elapsed, 1),
                       "isolation": "tail+filtering on one server, after_catalog on a second; "
                                    "a distinct system prompt per (variant, endpoint) run"},
            "plan": [asdict(turn) for turn in plan],
            "summary": [run.summary() for run in runs],
            "runs": [{"variant": run.variant, "endpoint": run.endpoint,
                      "system_prompt": run.system_prompt,
                      "turns": [dict(asdict(t), margin=t.margin) for t in run.turns]}
                     for run in runs],
            "goal_met": met, "failures": failures, "notes": notes,
        }, indent=2))
        _log(f"wrote {args.json}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

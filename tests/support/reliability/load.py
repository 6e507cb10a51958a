"""Concurrent load: rounds of the same many streams, each request with its own catalog and subset,
judged call by call, and the server tree's memory by process after each round."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME

from ..calls import chat_selection, responses_selection
from ..metrics import scrape_metric
from .report import Figures, mib
from .wire import REQUEST_TIMEOUT, Observed, base_body, log, send_async

LOAD_MAX_TOKENS = 96
ROLES = ("api_server", "engine_core", "worker", "other")
#: the CPU KV cache the worker first-touches block by block (serve.py: VLLM_CPU_KVCACHE_SPACE=1 GiB)
KV_CACHE_MIB = 1024.0


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
    # engine (see test_seeded_chunked_prefill_keeps_the_engine_alive)
    body.update(parallel_tool_calls=False, stream=True)
    return api, body, frozenset(subset), frozenset(tool.name for tool in catalog)


def _judge_calls(observed: Observed, subset: frozenset[str], others: list[frozenset[str]],
                 figures: Figures) -> list[str]:
    """Every call in its own subset (`others`: the other requests' subsets), with arguments on
    its schema unless max tokens cut it."""
    c, problems = figures.counts, []
    for name, arguments in observed.calls:
        if name not in subset:
            c["violations_leaked"] += 1
            foreign = any(name in s for s in others)
            c["cross_request_mixups"] += foreign
            problems.append(f"call {name!r} outside its subset {sorted(subset)}"
                            + (" (in another request's subset)" if foreign else ""))
        elif observed.finish == "length" or observed.finish == "incomplete":
            c["calls_cut_by_max_tokens"] += 1   # vanilla: the budget ran out mid-call
        elif not POOL_BY_NAME[name].arguments_valid(arguments):
            c["invalid_arguments"] += 1
            problems.append(f"call {name!r} with arguments off its schema: {arguments!r}")
    return problems


def _judge_stream(api: str, body: dict, subset: frozenset[str], others: list[frozenset[str]],
                  observed: Observed, figures: Figures) -> list[str]:
    c = figures.counts
    if observed.status != 200:
        c["5xx" if (observed.status or 0) >= 500 else
          "no_answer" if observed.status is None else "4xx"] += 1
        return [f"status {observed.status}: {observed.error or observed.transport_error}"]
    c["2xx"] += 1
    problems: list[str] = []
    if observed.terminal and observed.stream_error is None:
        c["completed"] += 1
    else:
        c["stream_errors"] += 1
        problems.append(f"stream error {observed.stream_error} terminal={observed.terminal}")
    c["calls_returned"] += len(observed.calls)
    problems += _judge_calls(observed, subset, others, figures)
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
    return problems


async def _load_round(base_url: str, requests: int, round_: int, figures: Figures) -> None:
    specs = [load_request(i, round_) for i in range(requests)]
    limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=requests + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT * 3, connect=10.0),
                                 limits=limits) as client:
        results = await asyncio.gather(*(send_async(client, base_url, api, body)
                                         for api, body, _, _ in specs))
    c = figures.counts
    for i, ((api, body, subset, _catalog), observed) in enumerate(zip(specs, results)):
        c["requests"] += 1
        others = [spec[2] for j, spec in enumerate(specs) if j != i]
        problems = _judge_stream(api, body, subset, others, observed, figures)
        c["max_stream_ms"] = max(c["max_stream_ms"], int(observed.elapsed * 1000))
        if problems:
            figures.problems.append(f"round {round_} request {i} ({api}, subset {sorted(subset)}): "
                                    + "; ".join(problems))


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


def run_load(base_url: str, requests: int, rounds: int, server_pid: int | None) -> Figures:
    """`rounds` rounds of the same `requests` concurrent streams (each with its own catalog and
    subset; sampling is not seeded, so outputs differ every round); the RSS of the server tree by
    role after each round."""
    figures = Figures()
    root = base_url.removesuffix("/v1")
    violations_before = scrape_metric(root, "vllm_allowed_tools:violations_total")
    trees: list[dict[str, int] | None] = []
    started = time.monotonic()
    for round_ in range(rounds):
        round_start = time.monotonic()
        asyncio.run(_load_round(base_url, requests, round_, figures))
        time.sleep(1.0)   # let the engine free what the round held
        trees.append(process_tree_rss(server_pid))
        log(f"load round {round_ + 1}/{rounds}: {time.monotonic() - round_start:.1f}s, server "
            f"tree RSS MiB " + (", ".join(f"{k} {mib(v)}" for k, v in trees[-1].items())
                                if trees[-1] else "-"))
    figures.extra["rounds"] = rounds
    figures.extra["concurrency"] = requests
    if trees and all(trees):
        figures.extra["rss_mib_per_round"] = {
            key: [round(tree[key] / 2**20, 1) for tree in trees] for key in (*ROLES, "total")}
        figures.extra["rss_growth_mib"] = {   # after the first (warm-up) round
            key: round((trees[-1][key] - trees[0][key]) / 2**20, 1) for key in (*ROLES, "total")}
    figures.extra["plugin_stopped_calls"] = \
        scrape_metric(root, "vllm_allowed_tools:violations_total") - violations_before
    figures.extra["running_after"] = scrape_metric(root, "vllm:num_requests_running")
    figures.extra["seconds"] = round(time.monotonic() - started, 1)
    return figures


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
    if not sizes["worker"]:
        return ["no worker process: the model and its KV cache run in the engine core (vLLM's "
                "uni executor), whose growth cannot be told from the KV cache's; serve with "
                "devtools.serve.SEPARATE_WORKER"]
    problems = [f"{key} grew {growth[key]} MiB (of {sizes[key]})"
                for key in ("api_server", "engine_core", "other")
                if growth[key] > max(max_growth_mib, max_ratio * sizes[key])]
    if growth["worker"] > KV_CACHE_MIB:
        problems.append(f"worker grew {growth['worker']} MiB, more than the KV cache")
    return problems

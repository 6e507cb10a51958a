"""Decode throughput on the real model: the plugin's server against vanilla vLLM, same build.

    python benchmarks/real_decode.py [--tokens 128] [--reps 4] [--out FILE.json]
    python benchmarks/real_decode.py --plugin-url URL/v1 --vanilla-url URL/v1   # servers already up

Two servers of SmolLM2-135M-Instruct (``serve-tiny --flavour real``: the plugin, and ``--vanilla
--parser hermes``: plain vLLM on the same template, the same vLLM build and flags), unless their
URLs are given. Requests alternate between the two (plugin, vanilla, vanilla, plugin, ...: an ABBA
order, so a load that drifts during the run hits both alike), one at a time, greedy, each arm's
completions of equal length (``ignore_eos`` with ``min_tokens`` = ``max_tokens``) where the output
is free text. Arms, each the same request to both servers except for the policy:

- ``plain``: no tools (what every request without tools pays: the middleware's passthrough);
- ``auto``: a three-tool catalog; the plugin gets ``allowed_tools`` ``auto`` over two of them,
  vanilla plain ``auto`` (the model answers in prose: its tokens run under the trigger grammar);
- ``required``: the same catalog; the plugin gets ``allowed_tools`` ``required`` over two, vanilla
  plain ``required`` (the call's tokens run under each server's call grammar; lengths are the
  model's, so decode speed is compared per token).

Two speeds per request: the client's (completion tokens over the request's wall time, prefill
included, the same prompt on both) and the engine's (generated tokens over the decode time in
vLLM's own ``/metrics``: first token to last, the grammar's mask included, HTTP and the middleware
excluded). Reported per arm: the median of the plugin/vanilla ratio over paired repetitions, with
its min-max spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# idle OpenMP threads sleep (both servers inherit it): on a shared CPU a spinning thread takes the
# core the other server's decode step needs
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SYSTEM = "You are a helpful assistant."
PROSE = "Write a long, detailed story about a lighthouse keeper and a storm."
CALL = "What is the weather in Paris?"


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


TOOLS = [
    _function("get_weather", "Get the current weather for a city.", {"city": {"type": "string"}}),
    _function("search_web", "Search the web.", {"query": {"type": "string"}}),
    _function("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"},
                                                "body": {"type": "string"}}),
]
ALLOWED = ["get_weather", "search_web"]


def _allowed(mode: str) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in ALLOWED]}}


def bodies(arm: str, tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plugin's request, vanilla's) for one arm."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": CALL if arm == "required" else PROSE}]
    base: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": tokens,
                            "temperature": 0}
    if arm != "required":   # free text: every completion exactly `tokens` long
        base.update(ignore_eos=True, min_tokens=tokens)
    if arm == "plain":
        return base, base
    plugin = dict(base, tools=TOOLS, tool_choice=_allowed(arm))
    vanilla = dict(base, tools=TOOLS, tool_choice=arm)
    return plugin, vanilla


def _engine_counters(root: str) -> tuple[float, float]:
    """(decode seconds, generated tokens) so far, from vLLM's Prometheus text."""
    text = httpx.get(root + "/metrics", timeout=30).text
    values = {"vllm:request_decode_time_seconds_sum": 0.0, "vllm:generation_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:request_decode_time_seconds_sum"], values["vllm:generation_tokens_total"]


def measure(base_url: str, body: dict[str, Any]) -> dict[str, float]:
    """One request: its completion tokens, the client's and the engine's tokens per second."""
    root = base_url.rsplit("/v1", 1)[0]
    decode0, generated0 = _engine_counters(root)
    started = time.perf_counter()
    response = httpx.post(base_url + "/chat/completions", json=body, timeout=1800)
    wall = time.perf_counter() - started
    response.raise_for_status()
    decode1, generated1 = _engine_counters(root)
    tokens = response.json()["usage"]["completion_tokens"]
    decode, generated = decode1 - decode0, generated1 - generated0
    # the engine's decode time spans first token to last: tokens - 1 steps
    return {"tokens": tokens, "client_tps": tokens / wall,
            "engine_tps": (generated - 1) / decode if decode > 0 and generated > 1 else float("nan")}


def run(plugin_url: str, vanilla_url: str, arms: list[str], tokens: int, reps: int,
        log=print) -> dict[str, Any]:
    """Paired, alternating runs of every arm; the per-request figures and each arm's ratios."""
    for url in (plugin_url, vanilla_url):   # a first request warms each server (and its grammars)
        for arm in arms:
            measure(url, dict(bodies(arm, 8)[0 if url == plugin_url else 1], max_tokens=8,
                              min_tokens=0, ignore_eos=False))
    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        for arm in arms:
            plugin_body, vanilla_body = bodies(arm, tokens)
            order = [("plugin", plugin_url, plugin_body), ("vanilla", vanilla_url, vanilla_body)]
            if (rep + arms.index(arm)) % 2:
                order.reverse()
            pair = {}
            for server, url, body in order:
                pair[server] = measure(url, body)
            row = {"rep": rep, "arm": arm, **{f"{server}_{key}": value for server, figures in pair.items()
                                              for key, value in figures.items()}}
            rows.append(row)
            log(json.dumps(row))
    return {"tokens": tokens, "reps": reps, "rows": rows, "summary": summarize(rows, arms)}


def summarize(rows: list[dict[str, Any]], arms: list[str]) -> dict[str, dict[str, float]]:
    """Per arm and speed: the median plugin/vanilla ratio of the paired requests, min and max."""
    summary: dict[str, dict[str, float]] = {}
    for arm in arms:
        mine = [row for row in rows if row["arm"] == arm]
        for speed in ("engine_tps", "client_tps"):
            ratios = [row[f"plugin_{speed}"] / row[f"vanilla_{speed}"] for row in mine
                      if row[f"vanilla_{speed}"] > 0]
            summary[f"{arm}/{speed}"] = {
                "plugin_median": statistics.median(row[f"plugin_{speed}"] for row in mine),
                "vanilla_median": statistics.median(row[f"vanilla_{speed}"] for row in mine),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                "ratio_max": max(ratios)}
    return summary


def table(summary: dict[str, dict[str, float]]) -> str:
    lines = ["| arm | speed | plugin tok/s | vanilla tok/s | ratio (median) | ratio min-max |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for key, figures in summary.items():
        arm, speed = key.split("/")
        lines.append(f"| {arm} | {speed.split('_')[0]} | {figures['plugin_median']:.1f} | "
                     f"{figures['vanilla_median']:.1f} | {figures['ratio_median']:.3f} | "
                     f"{figures['ratio_min']:.3f}-{figures['ratio_max']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="completion length of the free-text arms")
    parser.add_argument("--reps", type=int, default=4, help="paired repetitions of each arm")
    parser.add_argument("--arms", nargs="+", default=["plain", "auto", "required"],
                        choices=["plain", "auto", "required"])
    parser.add_argument("--plugin-url", help="a running plugin server's /v1 URL (else one is started)")
    parser.add_argument("--vanilla-url", help="a running vanilla server's /v1 URL (else one is started)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    started = []
    try:
        from vllm_allowed_tools.devtools.serve import start_serve_tiny
        plugin_url, vanilla_url = args.plugin_url, args.vanilla_url
        if plugin_url is None:
            started.append(start_serve_tiny("real"))
            plugin_url = started[-1].base_url
        if vanilla_url is None:
            started.append(start_serve_tiny("real", options=["--vanilla", "--parser", "hermes"]))
            vanilla_url = started[-1].base_url
        result = run(plugin_url, vanilla_url, args.arms, args.tokens, args.reps,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        for server in started:
            server.stop()
    print(table(result["summary"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

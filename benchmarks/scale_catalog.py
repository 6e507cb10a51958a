"""Request-side and compile cost as the catalog grows: 8 to 512 tools shaped like MCP servers'
(benchmarks/mcp_tools.py: nested objects, enums, arrays of objects, long descriptions).

    python benchmarks/scale_catalog.py [--tools 8,32,128,256,512] [--vocab 2K,150K] [--subsets 5] [--json OUT] [--plot PNG]

For each catalog size, side by side in one run:

* resolve + rewrite: the middleware's policy resolution and request rewrite (Responses body,
  ``allowed_tools`` of 4), a catalog seen for the first time and a repeated one;
* catalog grammar: building the catalog's structural tag (the split's catalog half) and
  compiling it with a fresh compiler at each vocabulary (what the engine does once per catalog, in
  its background thread);
* first-seen subset: 4 allowed tools never seen before, catalog compiled: from the turn's
  functions to the row's matchers with the split (tag build, admission digest, envelope compile),
  and the subset's own grammar compiled with xgrammar's cache warm (what vLLM's native stage
  compiles for it);
* new maxLength subset: 4 tools whose schemas hold string lengths (Slack's 40,000-character text,
  a search query's 400, a ticket summary's 255, an issue title's ``minLength``; the 8-tool catalog
  has only the last) as a first-seen catalog's first request, its own grammar through a fresh
  compiler (nothing compiled before), matcher made: what the native stage, and the
  logits-processor stage before the catalog is ready, compile on the request's path
  (``decode/argument_schemas.py`` leaves the lengths to the guard while xgrammar compiles them
  slowly; ``benchmarks/compile_cliff.py`` sets the options side by side); and the same subset as
  the logits-processor stage ships it (``llguidance first``: the tag built, llguidance's matcher
  for its translation and the first mask, xgrammar's compile left to the background).

The last columns are the slope of a least-squares line through the sizes: the cost of each added
tool. Nothing is asserted: docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_report  # noqa: E402
from grammar_inputs import synthetic_tokenizer_info, tiny_tokenizer_info  # noqa: E402
from mcp_tools import mcp_catalog  # noqa: E402

from vllm_allowed_tools.decode.grammar import AllowedFunction, turn_tag  # noqa: E402
from vllm_allowed_tools.decode.masks import CompiledGrammars  # noqa: E402
from vllm_allowed_tools.decode.split import constraint_extra_args, split_tags  # noqa: E402
from vllm_allowed_tools.decode.stage import read_extra_args  # noqa: E402
from vllm_allowed_tools.request.rewrite import rewrite_request  # noqa: E402

ALLOWED = 4


def _body(tools: list[dict[str, Any]], allowed: list[str], salt: str) -> dict[str, Any]:
    """A Responses body; ``salt`` in one description makes the catalog new (its digest binds it)."""
    flat = [{"type": "function", "name": t["function"]["name"],
             "description": t["function"]["description"] + (f" ({salt})" if i == 0 else ""),
             "parameters": t["function"]["parameters"], "strict": True} for i, t in enumerate(tools)]
    return {"model": "m", "input": "Go ahead.", "tools": flat,
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": name} for name in allowed]}}


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_rewrite(tools: list[dict[str, Any]], repeat: int, rng: random.Random) -> dict[str, float]:
    first, repeated = [], []
    names = [t["function"]["name"] for t in tools]
    for round_ in range(repeat):
        body = _body(tools, rng.sample(names, min(ALLOWED, len(names))), f"salt {round_}")
        start = time.perf_counter()
        rewrite_request(copy.deepcopy(body), "responses")
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        rewrite_request(copy.deepcopy(body), "responses")
        repeated.append(time.perf_counter() - start)
    # deepcopy is outside neither sample's start: subtract its own cost
    copies = []
    for _ in range(repeat):
        start = time.perf_counter()
        copy.deepcopy(body)
        copies.append(time.perf_counter() - start)
    base = statistics.median(copies)
    return {"rewrite first ms": (statistics.median(first) - base) * 1e3,
            "rewrite repeated ms": (statistics.median(repeated) - base) * 1e3}


def bench_grammars(functions: list[AllowedFunction], info: Any, subsets: int, rng: random.Random,
                   tag: str) -> dict[str, float]:
    import xgrammar as xgr
    common = dict(catalog_digest=f"mcp-{len(functions)}-{tag}", mode="auto", parallel_tool_calls=True)
    start = time.perf_counter()
    halves = split_tags("hermes", functions, functions[:1], allowlist_digest="first", **common)
    build_s = time.perf_counter() - start
    grammars = CompiledGrammars(info, upgrade=False)   # a first-seen subset: its own grammar is not ready
    first = read_extra_args(constraint_extra_args(turn_tag("hermes", functions[:1], allowlist_digest="first",
                                                           **common), halves))
    start = time.perf_counter()
    assert grammars.catalog(first.catalog) is not None
    compile_s = time.perf_counter() - start
    native = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)
    split_samples, native_samples = [], []
    for sample in range(subsets + 1):      # the first warms xgrammar's caches and is dropped
        allowed = sorted(rng.sample(functions, ALLOWED), key=functions.index)
        digest = f"subset-{sample}-{rng.random()}"
        start = time.perf_counter()
        whole = turn_tag("hermes", allowed, allowlist_digest=digest, **common)
        grammar = read_extra_args(constraint_extra_args(
            whole, split_tags("hermes", functions, allowed, allowlist_digest=digest, **common)))
        assert grammars.matchers(grammar)[1] is not None
        split_samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        xgr.GrammarMatcher(native.compile_structural_tag(
            turn_tag("hermes", allowed, allowlist_digest=digest + "-native", **common).json))
        native_samples.append(time.perf_counter() - start)
    lengths = _with_lengths(functions)[:ALLOWED]
    start = time.perf_counter()       # a fresh compiler: nothing of these schemas compiled before
    xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True).compile_structural_tag(
        turn_tag("hermes", lengths, allowlist_digest=f"lengths-{rng.random()}", **common).json))
    lengths_s = time.perf_counter() - start
    lazy = CompiledGrammars(info, lazy=True)   # what ships on the logits-processor stage
    lazy.lazy._ready.wait()                    # its tokenizer: built once, at start-up
    lazy._in_background = lambda grammar, compile_it: None   # the background compile, not timed
    start = time.perf_counter()
    lengths_grammar = read_extra_args(constraint_extra_args(
        turn_tag("hermes", lengths, allowlist_digest=f"lazy-{rng.random()}", **common)))
    row = lazy.matchers(lengths_grammar)
    row.matcher.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, info.vocab_size), 0)
    lazy_s = time.perf_counter() - start
    assert row.provisional and row.envelope is None
    return {f"catalog compile {tag} ms": compile_s * 1e3,
            f"new maxLength subset {tag} ms": lengths_s * 1e3,
            f"new maxLength subset, llguidance first {tag} ms": lazy_s * 1e3,
            f"new subset, split {tag} ms": _median_ms(split_samples[1:]),
            f"new subset, own grammar {tag} ms": _median_ms(native_samples[1:]),
            "catalog tag build ms": build_s * 1e3, "catalog tag KB": len(halves.catalog.json) / 1024}


def _with_lengths(functions: list[AllowedFunction]) -> list[AllowedFunction]:
    """The catalog's tools whose schemas hold a string ``maxLength`` / ``minLength`` first."""
    def bounded(function: AllowedFunction) -> bool:
        text = json.dumps(function.parameters)
        return "maxLength" in text or "minLength" in text
    return sorted(functions, key=lambda function: not bounded(function))


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (per tool) of value against tools."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axis = scale_report.figure()
    tools = [row["tools"] for row in rows]
    for column in [c for c in rows[0] if c.endswith(" ms")]:
        axis.plot(tools, [max(row[column], 1e-3) for row in rows], marker="o", label=column[:-3])
    scale_report.log_log(axis, "tools in the catalog", "ms", "cost vs catalog size (MCP-shaped tools)")
    scale_report.save(figure, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default="8,32,128,256,512")
    parser.add_argument("--vocab", default="2K,150K")
    parser.add_argument("--subsets", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20, help="rewrite samples (fewer above 128 tools)")
    scale_report.add_output_arguments(parser)
    args = parser.parse_args()
    infos = {}
    for name in args.vocab.split(","):
        infos[name] = tiny_tokenizer_info()[0] if name == "2K" else synthetic_tokenizer_info()[0]
    rng = random.Random(31)
    rows = []
    for count in [int(n) for n in args.tools.split(",")]:
        tools = mcp_catalog(count)
        functions = [AllowedFunction(t["function"]["name"], t["function"]["parameters"], True) for t in tools]
        row: dict[str, Any] = {"tools": count}
        row.update(bench_rewrite(tools, max(3, args.repeat * 128 // max(count, 128)), rng))
        for name, info in infos.items():
            row.update(bench_grammars(functions, info, args.subsets, rng, name))
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    slopes = {column: _slope([(row["tools"], row[column]) for row in rows]) * 1e3
              for column in rows[0] if column.endswith(" ms")}
    columns = list(rows[0])
    print("\n## cost vs catalog size (MCP-shaped tools, hermes)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---:|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c])
                                for c in columns) + " |")
    print("\nslope, µs per added tool: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in slopes.items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "slopes_us_per_tool": slopes}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

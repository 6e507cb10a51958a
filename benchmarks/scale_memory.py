"""Memory of the built-tag cache (API server) and the compiled-grammar cache (engine) as distinct
catalogs and subsets grow (up to 1,000), with and without the bounds the caches enforce.

    python benchmarks/scale_memory.py [--catalogs 10,100,1000] [--large 10,30,100,250] [--json OUT] [--plot PNG]

* built tags: one 16-tool MCP-shaped catalog (benchmarks/mcp_tools.py, names made distinct per
  catalog) per step, two allowed subsets of 4 each, through ``turn_tag`` as the API server builds
  them; memory is what tracemalloc sees the cache hold, next to the cache's own estimate
  (``TAG_BYTES_PER_JSON_CHAR`` times the JSON), unbounded and with the default bounds
  (``VLLM_ALLOWED_TOOLS_TAG_CACHE_ENTRIES`` / ``_MB``);
* compiled grammars: each catalog's subset grammar compiled by one :class:`CompiledGrammars`
  (the logits-processor stage's cache for one tokenizer) at the 2K vocabulary up to
  ``--catalogs`` and at 150K up to ``--large``: xgrammar's count of the bytes held by the cache
  with the default bounds (``VLLM_ALLOWED_TOOLS_GRAMMAR_CACHE_ENTRIES`` / ``_MB``) against the sum
  over every grammar compiled (what an unbounded cache would hold), and the process's RSS.

Nothing is asserted: docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_report  # noqa: E402
from grammar_inputs import synthetic_tokenizer_info, tiny_tokenizer_info  # noqa: E402
from mcp_tools import mcp_catalog  # noqa: E402

from vllm_allowed_tools import settings  # noqa: E402
from vllm_allowed_tools.decode import grammar  # noqa: E402
from vllm_allowed_tools.decode.grammar import AllowedFunction, turn_tag  # noqa: E402
from vllm_allowed_tools.decode.masks import CompiledGrammars  # noqa: E402
from vllm_allowed_tools.decode.split import constraint_extra_args  # noqa: E402
from vllm_allowed_tools.decode.stage import read_extra_args  # noqa: E402

MB = 1 << 20


def _catalog(index: int) -> list[AllowedFunction]:
    tools = mcp_catalog(16)
    offset = index % len(tools)   # each catalog its own mix of the templates, its own names
    return [AllowedFunction(f"c{index}_{t['function']['name']}", t["function"]["parameters"], True)
            for t in tools[offset:] + tools[:offset]]


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _with_limits(environ: dict[str, str]) -> None:
    for key in ("VLLM_ALLOWED_TOOLS_TAG_CACHE_ENTRIES", "VLLM_ALLOWED_TOOLS_TAG_CACHE_MB"):
        os.environ.pop(key, None)
    os.environ.update(environ)
    settings.reset_for_tests()


def bench_tags(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for bounded in (False, True):
        _with_limits({} if bounded else {"VLLM_ALLOWED_TOOLS_TAG_CACHE_ENTRIES": "1000000000",
                                         "VLLM_ALLOWED_TOOLS_TAG_CACHE_MB": "1000000"})
        grammar.clear_tag_cache()
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        made = 0
        for index in range(max(counts)):
            functions = _catalog(index)
            for subset in range(2):
                turn_tag("hermes", functions[subset * 4:subset * 4 + 4], catalog_digest=f"catalog-{index}",
                         allowlist_digest=f"subset-{subset}", mode="auto", parallel_tool_calls=True)
                made += 1
            if index + 1 in counts:
                gc.collect()
                rows.append({"cache": "built tags", "bounds": "default" if bounded else "none",
                             "catalogs": index + 1, "built": made,
                             "entries kept": grammar.tag_cache_stats()[2],
                             "measured MB": (tracemalloc.get_traced_memory()[0] - base) / MB,
                             "estimate MB": grammar.tag_cache_bytes() / MB})
        tracemalloc.stop()
    _with_limits({})
    grammar.clear_tag_cache()
    return rows


def bench_compiled(vocab: str, info: Any, counts: list[int]) -> list[dict[str, Any]]:
    grammars = CompiledGrammars(info, lazy=False)
    rss = _rss_mb()
    compiled_bytes = 0
    rows = []
    for index in range(max(counts)):
        tag = turn_tag("hermes", _catalog(index)[:4], catalog_digest=f"catalog-{index}",
                       allowlist_digest="subset", mode="auto", parallel_tool_calls=True)
        compiled_bytes += grammars.get(read_extra_args(constraint_extra_args(tag))).memory_size_bytes
        if index + 1 in counts:
            rows.append({"cache": f"compiled grammars, {vocab}", "bounds": "default",
                         "catalogs": index + 1, "built": index + 1, "entries kept": len(grammars._cache),
                         "measured MB": grammars.memory_bytes / MB, "estimate MB": compiled_bytes / MB,
                         "RSS growth MB": _rss_mb() - rss})
    grammar.clear_tag_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| cache | bounds | catalogs | built | entries kept | held, MB | unbounded / estimate, MB | RSS growth, MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rss = row.get("RSS growth MB")
        lines.append(f"| {row['cache']} | {row['bounds']} | {row['catalogs']} | {row['built']} | "
                     f"{row['entries kept']} | {row['measured MB']:.1f} | {row['estimate MB']:.1f} | "
                     f"{'-' if rss is None else f'{rss:.0f}'} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axis = scale_report.figure()
    for cache, bounds in dict.fromkeys((r["cache"], r["bounds"]) for r in rows):
        points = [r for r in rows if (r["cache"], r["bounds"]) == (cache, bounds)]
        label = f"{cache}, bounds {bounds}"
        axis.plot([p["catalogs"] for p in points], [p["measured MB"] for p in points], marker="o", label=label)
        if cache.startswith("compiled"):
            axis.plot([p["catalogs"] for p in points], [p["estimate MB"] for p in points], marker="x",
                      linestyle="--", label=f"{cache}, unbounded (sum compiled)")
    scale_report.log_log(axis, "distinct catalogs", "MB held", "cache memory vs distinct catalogs")
    scale_report.save(figure, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--catalogs", default="10,100,1000")
    parser.add_argument("--large", default="10,30,100,250", help="catalogs compiled at the 150K vocabulary")
    scale_report.add_output_arguments(parser)
    args = parser.parse_args()
    counts = [int(n) for n in args.catalogs.split(",")]
    rows = bench_tags(counts)
    rows += bench_compiled("2K", tiny_tokenizer_info()[0], counts)
    if args.large:
        rows += bench_compiled("150K", synthetic_tokenizer_info()[0], [int(n) for n in args.large.split(",")])
    return scale_report.report("cache memory vs distinct catalogs", rows, table, plot, args)


if __name__ == "__main__":
    raise SystemExit(main())

"""What :mod:`vllm_allowed_tools.decode.safe_json` costs a turn's structural tag: build time, compile
time and the tag's JSON size for an MCP-shaped catalog (benchmarks/mcp_tools.py), required mode.

    python benchmarks/safe_json_cost.py [--formats hermes,kimi_k2,qwen3_coder,deepseek_v3] [--tools 128]
        [--strict true|false] [--repeat 3] [--no-rewrite] [--no-compile]

``build s`` is the first build with the process's caches cold, ``rebuild s`` a build of the same
catalog again (the tag cache bypassed, per-slot caches warm), ``compile s`` compiling the built tag
with a fresh single-threaded compiler over a small vocabulary, in CPU seconds (the best of
``--repeat``: wall time on a shared machine says more about the neighbours). ``--no-rewrite``
bypasses the rewrite (the slots keep xgrammar's own JSON EBNF, as grammar nodes): what the rewrite
itself adds. The figures before
safe_json (``json_schema`` slots) are this script run on a checkout of ``6ee2fee~1``
(docs/benchmarks.md). Prints a Markdown table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mcp_tools import mcp_catalog  # noqa: E402

from vllm_allowed_tools.decode import argument_slots, grammar  # noqa: E402


def _tokenizer_info():
    import xgrammar as xgr
    vocab = [chr(c) for c in range(32, 127)] + ["<tool_call>", "</tool_call>", '{"', '":', "name"]
    return xgr.TokenizerInfo(vocab + ["<eos>"], vocab_size=len(vocab) + 1, stop_token_ids=[len(vocab)])


def _compile_seconds(tag) -> float:
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(_tokenizer_info(), max_threads=1, cache_enabled=False)
    start = time.process_time()
    compiler.compile_structural_tag(tag.model_dump_json())
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="hermes,kimi_k2,qwen3_coder,deepseek_v3")
    parser.add_argument("--tools", default="128")
    parser.add_argument("--strict", choices=("true", "false"), default="true")
    parser.add_argument("--no-rewrite", action="store_true", help="bypass safe_json (the figures before)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="compiles per tag (the best is shown)")
    args = parser.parse_args()
    if args.no_rewrite:
        argument_slots.safe_json_ebnf = grammar.safe_json_ebnf = lambda ebnf, markers: ebnf
    print("| format | tools | strict | rewrite | build s | rebuild s | compile s | tag chars |")
    print("|---|---|---|---|---|---|---|---|")
    for count in (int(n) for n in args.tools.split(",")):
        tools = mcp_catalog(count)
        functions = [grammar.AllowedFunction(t["function"]["name"], t["function"]["parameters"],
                                             args.strict == "true") for t in tools]
        for name in args.formats.split(","):
            start = time.perf_counter()
            tag = grammar.build_structural_tag(name, functions, "required")
            build = time.perf_counter() - start
            start = time.perf_counter()
            grammar.build_structural_tag(name, functions, "required")
            rebuild = time.perf_counter() - start
            chars = len(json.dumps(tag.model_dump(), separators=(",", ":")))
            compile_s = ("-" if args.no_compile
                         else f"{min(_compile_seconds(tag) for _ in range(args.repeat)):.2f}")
            print(f"| {name} | {count} | {args.strict} | {'no' if args.no_rewrite else 'yes'} | {build:.2f} "
                  f"| {rebuild:.2f} | {compile_s} | {chars:,} |", flush=True)


if __name__ == "__main__":
    main()

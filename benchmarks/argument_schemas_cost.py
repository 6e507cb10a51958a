"""What holding non-strict tools to their schema costs xgrammar's compile at a 150K vocabulary.

    python benchmarks/argument_schemas_cost.py [--tools 8 32] [--vocab 150000]

For MCP-shaped catalogs (benchmarks/mcp_tools.py: nested objects, enums, bounded strings), tools
sent without ``strict``: the hermes grammar's compile time (CPU seconds, one thread, cache off) with
their arguments an object only (vLLM's default, ``VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS=strict``), held
to their structure (the plugin's default: ``decode/argument_schemas.py`` leaves out string
lengths), and held to every keyword (as if each were ``strict``, vLLM's ``--tool-strict-level
parameter``). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import xgrammar as xgr
from grammar_inputs import synthetic_tokenizer_info
from mcp_tools import mcp_catalog

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag

ARMS = {
    "object only (strict-only)": lambda f: (f, False),
    "structure (default)": lambda f: (f, True),
    "every keyword (all strict)": lambda f: (AllowedFunction(f.name, f.parameters, True), False),
}


def compile_seconds(info, functions, mode: str, every_tool: bool) -> float:
    tag = build_structural_tag("hermes", functions, mode, every_tool=every_tool)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.process_time()
    compiler.compile_structural_tag(tag.model_dump_json())
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--vocab", type=int, default=150_000)
    args = parser.parse_args()
    info, _ = synthetic_tokenizer_info(args.vocab)
    print(f"| tools | mode | {' | '.join(ARMS)} |")
    print(f"|---|---|{'---|' * len(ARMS)}")
    for count in args.tools:
        functions = [AllowedFunction(t["function"]["name"], t["function"]["parameters"], None)
                     for t in mcp_catalog(count)]
        for mode in ("auto", "required"):
            cells = []
            for arm in ARMS.values():
                arm_functions, every_tool = zip(*(arm(f) for f in functions))
                cells.append(f"{compile_seconds(info, list(arm_functions), mode, every_tool[0]):.2f} s")
            print(f"| {count} | {mode} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()

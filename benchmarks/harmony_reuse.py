"""Prompt-cache reuse on gpt-oss's harmony path (``--tool-call-parser allowed_openai``).

    python benchmarks/harmony_reuse.py [--out benchmarks/results/harmony_reuse.md]

The tiny gpt-oss model (devtools/models/gpt_oss_model.py, on vLLM's CPU build) is served twice,
one server after the other: with the probe's placement (the per-turn policy as a trailing developer
message) and with catalog filtering (``VLLM_ALLOWED_TOOLS_PLACEMENT=filter-catalog``: the model sees
only the allowed tools). On each, the 6-turn agent transcript of ``template_reuse.py`` (8-tool catalog, a
different allowed subset every turn, the history grown by a call and its result per turn) is
replayed over ``/v1/chat/completions``; per turn the table gives ``usage`` cached / prompt tokens,
and ``ideal``: whole 32-token blocks of the longest prefix the prompt shares with an earlier one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from template_reuse import AUTO, FILTER, PLACEMENT_ENV, Run, drive, make_transcript  # noqa: E402

from vllm_allowed_tools.devtools.models.gpt_oss_model import ensure_gpt_oss_model  # noqa: E402
from vllm_allowed_tools.devtools.serve import MODEL_TEMPLATE, start_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "harmony_reuse.md"


def run_one(model_dir: Path, placement: str) -> Run:
    from openai import OpenAI
    run = Run(template="gpt-oss (harmony)", placement=placement)
    server = start_server(model_dir, parser="allowed_openai", chat_template=MODEL_TEMPLATE,
                          env={PLACEMENT_ENV: placement}, timeout=600)
    try:
        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        drive(client, server.root_url, make_transcript(), run, filter_catalog=True)
    finally:
        server.stop()
    return run


def table(runs: list[Run]) -> str:
    rows = ["| placement | cached/prompt (ideal), turns 2-6 | reuse |", "|---|---|---|"]
    for run in runs:
        cells = " ".join(f"{t.cached_tokens}/{t.prompt_tokens} ({t.ideal})" for t in run.later())
        rows.append(f"| {run.placement} | {cells} | {100 * run.reuse():.0f}% |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.monotonic()
    model_dir = ensure_gpt_oss_model(0)
    runs = [run_one(model_dir, placement) for placement in (AUTO, FILTER)]
    text = (f"Command: `python benchmarks/harmony_reuse.py`\n\n"
            f"tiny gpt-oss (random weights) on vLLM CPU, {(time.monotonic() - started) / 60:.1f} min; "
            "6 turns, 8 tools, a different allowed subset each turn (mode auto), max_tokens 1.\n\n"
            + table(runs) + "\n")
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

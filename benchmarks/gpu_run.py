"""The GPU run (benchmarks/gpu.sh): a random-weight Qwen3-8B-shaped model with a 150K-token
tokenizer made offline, served one-flag on each constraint stage, and one Markdown table of
decode throughput (unconstrained / native / logits processor / split) at batch 1, 16 and 64, a
first-seen subset's time to first token and prompt reuse over an agent transcript.

    python benchmarks/gpu_run.py [--dry-run] [--out FILE] [--tokens 128] [--batches 1,16,64]

``--dry-run``: the tiny model of the same architecture on CPU, batches 1 and 4, 8 tokens, one
server (the logits-processor stage; the native column says so): what CI runs so the script cannot
rot (tests/test_gpu_script_e2e.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from mcp_tools import mcp_catalog  # noqa: E402
from random_model import build  # noqa: E402

from vllm_allowed_tools.devtools.serve import (  # noqa: E402
    SERVED_MODEL_NAME,
    TinyServer,
    server_environment,
    start_server,
)

CATALOG = 32
ALLOWED = 4


def serve(model: Path, stage: str, dry_run: bool, log_dir: Path, timeout: float) -> TinyServer:
    """``vllm serve`` one-flag (``--tool-call-parser allowed_hermes`` alone) on ``stage``, random
    weights (``--load-format dummy``); on a GPU in bfloat16 with room for 64 rows."""
    sizes = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
    env = {**server_environment(), "VLLM_ALLOWED_TOOLS_CONSTRAINT": stage,
           "VLLM_ALLOWED_TOOLS_PLAIN_DECODING": "vanilla"}
    if not dry_run:
        sizes += ["--dtype", "bfloat16", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.85"]
        env["VLLM_TARGET_DEVICE"] = "cuda"   # the helpers' default is the CPU build's
        # our logits processor runs on the V1 model runner only; both stages on it, like for like
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return start_server(model, one_flag=True, chat_template=model / "chat_template.jinja",
                        extra_args=["--load-format", "dummy", "--enable-prefix-caching", *sizes],
                        env=env, log_path=log_dir / f"serve-{stage}.log", timeout=timeout,
                        validate=False)


def _tools() -> list[dict[str, Any]]:
    return mcp_catalog(CATALOG)


def _body(messages: list[dict[str, Any]], variant: str, allowed: list[str], tokens: int, seed: int,
          stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_MODEL_NAME, "messages": messages, "tools": _tools(),
                            "max_tokens": tokens, "temperature": 1.0, "seed": seed, "stream": stream}
    if variant == "unconstrained":     # plain auto, decoded as vLLM decodes it (PLAIN_DECODING=vanilla)
        body["tool_choice"] = "auto"
    else:
        body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": n}} for n in allowed]}}
    if tokens > 0:
        body["ignore_eos"] = True          # every variant makes the same number of tokens
    return body


def decode_throughput(url: str, variant: str, batch: int, tokens: int, rng: random.Random) -> float:
    """Generated tokens per second for ``batch`` concurrent requests (prompts cached by a warm-up
    round); ``split``: every request a subset never seen before, so it starts on the split."""
    names = [t["function"]["name"] for t in _tools()]
    fixed = names[:ALLOWED]

    def one(index: int) -> int:
        allowed = rng.sample(names, ALLOWED) if variant == "split" else fixed
        messages = [{"role": "user", "content": f"Task {index}: go ahead."}]
        answer = httpx.post(url, json=_body(messages, variant, allowed, tokens, index), timeout=600).json()
        return answer["usage"]["completion_tokens"]

    with ThreadPoolExecutor(batch) as pool:
        list(pool.map(one, range(batch)))           # warm-up: compiles, prompts into the cache
        start = time.perf_counter()
        made = sum(pool.map(one, range(batch)))
    return made / (time.perf_counter() - start)


def first_seen_ttft(url: str, rng: random.Random, samples: int) -> float:
    """Median ms to the first streamed token of a request whose allowed subset is new."""
    names = [t["function"]["name"] for t in _tools()]
    times = []
    for index in range(samples + 1):
        body = _body([{"role": "user", "content": "Go ahead."}], "required", rng.sample(names, ALLOWED),
                     8, index, stream=True)
        start = time.perf_counter()
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {})
                if delta.get("content") or delta.get("tool_calls"):
                    break
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3      # the first also compiles the catalog


def prompt_reuse(url: str, rng: random.Random, turns: int) -> float:
    """cached / prompt tokens over turns 2..N of an agent transcript: a different allowed subset
    every turn, the history growing by the server's own answer and a tool result."""
    names = [t["function"]["name"] for t in _tools()]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing build."}]
    cached = prompt = 0
    for turn in range(turns):
        body = _body(messages, "required", rng.sample(names, ALLOWED), 64, turn)
        body.pop("ignore_eos", None)
        answer = httpx.post(url, json=body, timeout=600).json()
        usage = answer["usage"]
        if turn:
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt += usage["prompt_tokens"]
        message = answer["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages.append({"role": "assistant", "content": message.get("content") or "",
                         **({"tool_calls": calls} if calls else {})})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok: 3 files"})
        if not calls:
            messages.append({"role": "user", "content": "Go on."})
    return cached / prompt if prompt else float("nan")


def _wait_for_catalog(server: TinyServer, timeout: float) -> None:
    """Until the engine logged the first constrained request's compile: the catalog's (then the
    split's new subsets compile only their envelopes) or, as the logits-processor stage ships
    (``VLLM_ALLOWED_TOOLS_FIRST_SEEN_GRAMMARS=llguidance``), the request's own grammar behind its
    llguidance start (then new subsets start on llguidance too)."""
    deadline = time.monotonic() + timeout
    while not any(line in server.log_path.read_text(errors="replace")
                  for line in ("compiled a catalog grammar", "started on llguidance")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the catalog grammar was not compiled in {timeout:.0f} s:\n"
                               + server.log_tail())
        time.sleep(0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gpu-run-"))
    started = time.perf_counter()
    model = build(work / "model", tiny=args.dry_run)
    from vllm_allowed_tools.templates.render import load_template
    (model / "chat_template.jinja").write_text(load_template("hermes"))
    results: dict[str, Any] = {"build_s": time.perf_counter() - started, "decode": {}, "ttft_ms": {},
                               "reuse": {}}
    stages = ["logits-processor"] if args.dry_run else ["native", "logits-processor"]
    for stage in stages:
        server = serve(model, stage, args.dry_run, work, args.start_timeout)
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        rng = random.Random(7)
        try:
            variants = ["unconstrained", "native"] if stage == "native" else \
                ["logits processor", "split"] + (["unconstrained"] if args.dry_run else [])
            for batch in args.batches:
                for variant in variants:
                    if variant == "split":
                        _wait_for_catalog(server, args.start_timeout)
                    results["decode"][(variant, batch)] = decode_throughput(url, variant, batch, args.tokens, rng)
            name = "native" if stage == "native" else "split"
            results["ttft_ms"][name] = first_seen_ttft(url, rng, args.ttft_samples)
            results["reuse"][name] = prompt_reuse(url, rng, args.turns)
        finally:
            server.stop()
    results["total_s"] = time.perf_counter() - started
    return results


def table(results: dict[str, Any], batches: list[int], device: str) -> str:
    columns = ["unconstrained", "native", "logits processor", "split"]
    lines = [f"Device: {device}; model build {results['build_s']:.0f} s, whole run {results['total_s']:.0f} s.", "",
             "| measure | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for batch in batches:
        base = results["decode"].get(("unconstrained", batch))
        cells = []
        for column in columns:
            value = results["decode"].get((column, batch))
            cells.append("not run" if value is None else f"{value:,.0f} tok/s" +
                         (f" ({value / base:.2f})" if base and column != "unconstrained" else ""))
        lines.append(f"| decode, batch {batch} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("first-seen subset, time to first token", "ttft_ms", "{:.0f} ms"),
                            ("prompt reuse over the agent transcript (cached / prompt)", "reuse", "{:.0%}")):
        cells = []
        for column in columns:
            value = results[key].get(column)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--batches")
    parser.add_argument("--ttft-samples", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.tokens = args.tokens or (8 if args.dry_run else 128)
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.dry_run else "1,16,64")).split(",")]
    args.ttft_samples = args.ttft_samples or (1 if args.dry_run else 8)
    args.turns = args.turns or (2 if args.dry_run else 6)
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu.sh needs a CUDA GPU; use --dry-run on CPU", file=sys.stderr)
        return 2
    text = table(run(args), args.batches, device)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

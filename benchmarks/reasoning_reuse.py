"""Prompt-cache reuse when the history carries reasoning: what dropping it costs, per template.

    python benchmarks/reasoning_reuse.py [--turns 4] [--template PATH ...] [--json OUT]

Serves the tiny ``thinking`` model (``--reasoning-parser qwen3``, prefix caching on, block size 32)
once per chat template: our bundled ``hermes`` template, and every ``--template`` given (by default
also ``tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja``, Qwen3's official template, which renders an
assistant turn's reasoning only after the last user message). Per template it replays transcripts
of ``--turns`` turns, each turn a ``required`` ``allowed_tools`` request (2 of 8 tools, a new subset
every turn, greedy), on ``/v1/chat/completions`` and ``/v1/responses``, in three shapes:

* ``agent``: one user message, then the assistant's turns and tool results (an agent loop);
* ``agent+user``: the same loop, with a new user message before the last turn (the user follows up
  on what the agent did: Qwen3's template then drops every earlier turn's reasoning);
* ``chat``: a new user message before every turn;

each with the reasoning passed back (Chat: the assistant message's ``reasoning``; Responses: the
``reasoning`` item in ``input``) or left out by the client (``-noreason``).

Each run opens with its own system prompt, so no run reuses another's blocks. Reported per turn
(from ``usage``): prompt tokens, cached tokens, and the previous turn's prompt tokens. The mean over
turns after the first of cached / prompt says how much of each turn the cache served.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.devtools.serve import SERVED_MODEL_NAME, ServeError, start_server

ROOT = Path(__file__).resolve().parent.parent
#: Qwen3's official template (hermes-style calls; reasoning rendered only after the last user message)
QWEN3_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
SHAPES = ("agent", "agent-noreason", "agent+user", "agent+user-noreason", "chat", "chat-noreason")
ENDPOINTS = ("chat", "responses")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _turn_request(endpoint: str, history: list[dict], catalog: list, allowed: list[str],
                  max_tokens: int) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": SERVED_MODEL_NAME, "messages": history, "max_tokens": max_tokens,
                "tools": [t.chat_tool() for t in catalog], "temperature": 0.0,
                "parallel_tool_calls": False,
                "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                    {"type": "function", "function": {"name": n}} for n in allowed]}}}
    return {"model": SERVED_MODEL_NAME, "input": history, "max_output_tokens": max_tokens,
            "tools": [t.responses_tool() for t in catalog], "temperature": 0.0,
            "parallel_tool_calls": False,
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": n} for n in allowed]}}


def _absorb(endpoint: str, reply: dict, history: list[dict], keep_reasoning: bool, turn: int) -> int:
    """Append the answer (with or without its reasoning) and each call's result; the reasoning's
    length in characters."""
    if endpoint == "chat":
        message = reply["choices"][0]["message"]
        reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
        calls = message.get("tool_calls") or []
        entry = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
        if keep_reasoning and reasoning:
            entry["reasoning"] = reasoning
        history.append(entry)
        history += [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"turn": turn})}
                    for c in calls]
        return len(reasoning)
    output = reply["output"]
    reasoning = "".join(p.get("text", "") for item in output if item["type"] == "reasoning"
                        for p in item.get("content") or ())
    history += [item for item in output if keep_reasoning or item["type"] != "reasoning"]
    history += [{"type": "function_call_output", "call_id": item["call_id"],
                 "output": json.dumps({"turn": turn})} for item in output if item["type"] == "function_call"]
    return len(reasoning)


def run(base_url: str, endpoint: str, shape: str, turns: int, seed: int, max_tokens: int,
        tag: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    catalog = rng.sample(POOL, 8)
    system = f"You are agent {tag}-{endpoint}-{shape}. Work carefully."   # its own first block
    history: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": "Go ahead."}]
    rows, previous = [], None
    for turn in range(turns):
        if turn and (shape.startswith("chat") or (shape.startswith("agent+user") and turn == turns - 1)):
            history.append({"role": "user", "content": f"Next step {turn}."})
        allowed = [tool.name for tool in rng.sample(catalog, 2)]
        reply = _post(f"{base_url}/{'chat/completions' if endpoint == 'chat' else 'responses'}",
                      _turn_request(endpoint, history, catalog, allowed, max_tokens))
        usage = reply["usage"]
        prompt = usage.get("prompt_tokens") or usage.get("input_tokens")
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        reasoning = _absorb(endpoint, reply, history, not shape.endswith("noreason"), turn)
        rows.append({"turn": turn + 1, "prompt": prompt, "cached": details.get("cached_tokens") or 0,
                     "previous_prompt": previous, "reasoning_chars": reasoning})
        previous = prompt
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = rows[1:]
    return {"mean_cached_fraction": round(statistics.fmean(r["cached"] / r["prompt"] for r in later), 3),
            "mean_uncached": round(statistics.fmean(r["prompt"] - r["cached"] for r in later), 1),
            "reasoned_turns": sum(r["reasoning_chars"] > 0 for r in rows)}


def _templates(extra: list[Path]) -> list[tuple[str, Path | None]]:
    found = [("hermes (bundled)", None)]
    paths = extra or [path for path in [QWEN3_TEMPLATE] if path.is_file()]
    return found + [(path.stem, path) for path in paths]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--template", type=Path, action="append", default=[],
                        help="also serve this chat template (repeatable)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = ensure_model("thinking", 0, log=_log)
    log_dir = Path(tempfile.mkdtemp(prefix="reasoning-reuse-"))
    results: list[dict[str, Any]] = []
    for label, template in _templates(args.template):
        _log(f"serving with {label}")
        started = time.monotonic()
        try:
            with start_server(model, extra_args=["--reasoning-parser", "qwen3"], chat_template=template,
                              log_path=log_dir / f"{Path(label).stem}.log", timeout=600) as server:
                _log(f"healthy after {time.monotonic() - started:.0f}s")
                for endpoint in ENDPOINTS:
                    for shape in SHAPES:
                        rows = run(server.base_url, endpoint, shape, args.turns, args.seed,
                                   args.max_tokens, label.split()[0])
                        results.append({"template": label, "endpoint": endpoint, "shape": shape,
                                        "summary": summarize(rows), "turns": rows})
        except (ServeError, OSError, KeyError) as exc:
            _log(f"error: {exc}")
            return 2
    print("| template | endpoint | history | cached / prompt (turns 2+) | uncached tokens / turn | "
          "per turn: cached / prompt |")
    print("|---|---|---|---|---|---|")
    for result in results:
        s = result["summary"]
        per_turn = ", ".join(f"{r['cached']}/{r['prompt']}" for r in result["turns"])
        print(f"| {result['template']} | {result['endpoint']} | {result['shape']} | "
              f"{s['mean_cached_fraction']:.3f} | {s['mean_uncached']:.0f} | {per_turn} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

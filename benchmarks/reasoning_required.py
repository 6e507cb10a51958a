"""Does every ``required`` turn of a reasoning model end with a call? Many sampled turns, counted.

    python benchmarks/reasoning_required.py [--stage native|logits-processor] [--turns 56]
        [--max-tokens 120] [--seed-base 0] [--url URL] [--json OUT]

Serves the tiny ``thinking`` model (``--reasoning-parser qwen3``; the logits-processor stage runs the
``guidance`` backend, which cannot compile structural tags, so every constrained answer there is our
processor's), unless ``--url`` names a running one. Each of ``--turns`` seeds plays one agent
conversation of two ``required`` ``allowed_tools`` turns (2 of 8 tools; the second turn carries the
first's reasoning and call back, and allows two other tools), sampled at temperature 1.0 with the
seed, alternating Chat / Responses and unary / streamed by seed. Each turn is counted as:

* ``call``: one or more calls, every one allowed;
* ``length``: no call, the token limit cut it (Chat ``finish_reason: "length"``, Responses
  ``status: "incomplete"``): what OpenAI answers when the budget cannot hold the call;
* ``no_call``: anything else without a call (a 500 ``required_without_call``, an empty finish
  reason, a turn that ended inside its reasoning): what must never happen;
* ``outside``: a call outside the allowlist (never).

A second turn is played only after a first turn with a call. Prints one line per turn that did not
call and a summary; ``--json`` writes the counts and those turns.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from vllm_allowed_tools.devtools.models.tool_pool import POOL

# the test-side helpers this script shares with the tests live in tests/support/ (not in the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.calls import chat_selection, responses_selection  # noqa: E402

GATED = "send_email"
UNGATED = [tool for tool in POOL if tool.name != GATED]
STAGES = {
    "logits-processor": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor"},
                         ["--structured-outputs-config.backend", "guidance"]),
    "native": ({"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}, []),
}
REASONING = ["--reasoning-parser", "qwen3"]


def catalog_and_subsets(seed: int) -> tuple[list, list[str], list[str]]:
    """A catalog of 8, the first turn's 2 allowed tools, the second turn's 2 others."""
    rng = random.Random(seed)
    catalog = rng.sample(UNGATED, 8)
    first = [tool.name for tool in rng.sample(catalog, 2)]
    return catalog, first, sorted({tool.name for tool in catalog} - set(first))[:2]


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_turn(base_url: str, catalog, allowed, seed: int, history, *, stream: bool,
              max_tokens: int) -> dict[str, Any]:
    """One Chat turn: its status, finish reason, reasoning and calls (name, arguments)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}, *history],
            "tools": [tool.chat_tool() for tool in catalog], "tool_choice": chat_selection("required", allowed),
            "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream": stream}
    if not stream:
        response = httpx.post(base_url + "/chat/completions", json=body, timeout=600)
        if response.status_code != 200:
            return {"status": response.status_code, "error": response.text[:300], "calls": []}
        choice = response.json()["choices"][0]
        message = choice["message"]
        return {"status": 200, "finish": choice["finish_reason"], "reasoning": message.get("reasoning") or "",
                "text": message.get("content") or "",
                "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]}
    with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=600) as response:
        chunks = _sse(response)
    if any("error" in chunk for chunk in chunks):
        return {"status": 500, "error": json.dumps(chunks[-1])[:300], "calls": []}
    reasoning, text, calls, finish = [], [], {}, None
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning.append(delta.get("reasoning") or "")
            text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += (call.get("function") or {}).get("name") or ""
                entry[1] += (call.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"status": 200, "finish": finish, "reasoning": "".join(reasoning), "text": "".join(text),
            "calls": [tuple(calls[index]) for index in sorted(calls)]}


def responses_turn(base_url: str, catalog, allowed, seed: int, history, *, stream: bool,
                   max_tokens: int) -> dict[str, Any]:
    """One Responses turn: its status, the response's status, reasoning, calls and output."""
    body = {"model": "tiny", "input": history or "Go ahead.", "tools": [t.responses_tool() for t in catalog],
            "tool_choice": responses_selection("required", allowed), "parallel_tool_calls": False,
            "max_output_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": stream}
    if not stream:
        response = httpx.post(base_url + "/responses", json=body, timeout=600)
        if response.status_code != 200:
            return {"status": response.status_code, "error": response.text[:300], "calls": []}
        final = response.json()
    else:
        with httpx.stream("POST", base_url + "/responses", json=body, timeout=600) as response:
            events = _sse(response)
        final = events[-1].get("response") or {}
        if events[-1].get("type") != "response.completed" and final.get("status") != "incomplete":
            return {"status": 500, "error": json.dumps(events[-1])[:300], "calls": []}
    output = final.get("output") or []
    reasoning = "".join(part.get("text", "") for item in output if item["type"] == "reasoning"
                        for part in item.get("content") or ())
    return {"status": 200, "finish": final.get("status"), "reasoning": reasoning, "output": output,
            "calls": [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]}


def outcome(turn: dict[str, Any], allowed) -> str:
    if turn["calls"]:
        return "call" if all(name in allowed for name, _ in turn["calls"]) else "outside"
    if turn["status"] == 200 and turn.get("finish") in ("length", "incomplete"):
        return "length"
    return "no_call"


def play(base_url: str, seed: int, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """One two-turn conversation; (label, turn) per turn played."""
    catalog, first, second = catalog_and_subsets(seed)
    chat, stream = seed % 2 == 0, (seed // 2) % 2 == 1
    played = []
    turn = (chat_turn if chat else responses_turn)(base_url, catalog, first, seed, [], stream=stream,
                                                   max_tokens=max_tokens)
    played.append((f"seed {seed} turn 1 {'chat' if chat else 'responses'} {'stream' if stream else 'unary'}",
                   turn, first))
    if outcome(turn, first) != "call":
        return played
    name, arguments = turn["calls"][0]
    if chat:
        history = [{"role": "assistant", "content": None, "reasoning": turn["reasoning"], "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"ok": True})}]
    else:
        call = next(item for item in turn["output"] if item["type"] == "function_call")
        history = [{"role": "user", "content": "Go ahead."}, *turn["output"],
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    again = (chat_turn if chat else responses_turn)(base_url, catalog, second, seed + 10_000, history,
                                                    stream=stream, max_tokens=max_tokens)
    played.append((played[0][0].replace("turn 1", "turn 2"), again, second))
    return played


def run(base_url: str, turns: int, seed_base: int, max_tokens: int) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    misses = []
    for seed in range(seed_base, seed_base + turns):
        for label, turn, allowed in play(base_url, seed, max_tokens):
            kind = outcome(turn, allowed)
            counts[kind] += 1
            if kind != "call":
                misses.append({"turn": label, "outcome": kind, **{k: v for k, v in turn.items() if k != "output"}})
                print(f"{label}: {kind} {json.dumps(misses[-1])[:400]}", flush=True)
    return {"turns": sum(counts.values()), "counts": dict(counts), "misses": misses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), default="logits-processor")
    parser.add_argument("--turns", type=int, default=56, help="conversations (two turns each)")
    parser.add_argument("--seed-base", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--url", help="a running thinking server's /v1 URL (else one is started)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    server = None
    if args.url is None:
        from vllm_allowed_tools.devtools.serve import start_serve_tiny
        env, extra = STAGES[args.stage]
        server = start_serve_tiny("thinking", env=env, extra_args=[*extra, *REASONING])
    try:
        result = run(args.url or server.base_url, args.turns, args.seed_base, args.max_tokens)
    finally:
        if server is not None:
            server.stop()
    result = {"stage": args.stage if args.url is None else "given", "max_tokens": args.max_tokens, **result}
    print(json.dumps({k: v for k, v in result.items() if k != "misses"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not result["counts"].get("no_call") and not result["counts"].get("outside") else 1


if __name__ == "__main__":
    sys.exit(main())

"""Request-side cost: policy resolution + rewrite (what the middleware does before vLLM sees a
request), for catalogs of 8, 32 and 128 tools, first sight and repeated catalog.

    python benchmarks/frontend_overhead.py [--repeat 200]

The design goal is under 1 ms for a 128-tool catalog.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vllm_allowed_tools.request.rewrite import rewrite_request


def _body(size: int, salt: str) -> dict:
    tools = [{"type": "function", "name": f"tool_{salt}_{i}", "description": f"Tool number {i}.",
              "parameters": {"type": "object", "properties": {
                  "city": {"type": "string", "enum": ["paris", "tokyo", "lima"]},
                  "count": {"type": "integer", "minimum": 0, "maximum": 10}},
                  "required": ["city"], "additionalProperties": False}, "strict": True}
             for i in range(size)]
    return {"model": "m", "input": "hi", "tools": tools,
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": tools[i]["name"]}
                                      for i in range(0, size, max(1, size // 4))]}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print("| tools | first sight (ms) | repeated catalog (ms) | request JSON parse + dump (ms) |")
    print("|---|---|---|---|")
    for size in (8, 32, 128):
        first, repeated, codec = [], [], []
        for round_ in range(args.repeat):
            body = _body(size, str(round_))
            start = time.perf_counter()
            rewrite_request(body, "responses")
            first.append(time.perf_counter() - start)
            start = time.perf_counter()
            rewrite_request(body, "responses")
            repeated.append(time.perf_counter() - start)
            raw = json.dumps(body).encode()
            start = time.perf_counter()
            json.dumps(json.loads(raw)).encode()
            codec.append(time.perf_counter() - start)
        print(f"| {size} | {statistics.median(first) * 1e3:.3f} | "
              f"{statistics.median(repeated) * 1e3:.3f} | {statistics.median(codec) * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

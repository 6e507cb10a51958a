"""A local MCP server over SSE for the server-side tool tests: the tools vLLM's ``container``
built-in calls, every execution appended to a log file (one JSON line, written and synced before
the tool answers), so tests assert on what really ran.

    python -m vllm_allowed_tools.testing.mcp_server --port 8931 --log /tmp/exec.log [--name container]

Named ``python``: one tool ``python`` (``code``), as vLLM's python built-in calls it. Otherwise:
``exec`` and ``ls`` (``cmd``: ``"ls"``, ``"pwd"`` or ``"date"``, so a random model's
arguments are always complete), and ``slow`` (waits ``--slow-seconds`` after logging, for the disconnect tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Literal

#: a command is one of a few words, so a random model's arguments are always complete
Cmd = Literal["ls", "pwd", "date"]


def _logger(path: str):
    def log(tool: str, cmd: str) -> str:
        line = json.dumps({"tool": tool, "cmd": cmd, "at": time.time()})
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return f"{tool} ran {cmd!r}"
    return log


def build(name: str, log_path: str, slow_seconds: float = 3.0):
    from mcp.server.mcpserver import MCPServer
    server = MCPServer(name, instructions=f"A test {name}: every run is logged.")
    log = _logger(log_path)
    if name == "python":   # what vLLM's python built-in calls: the tool "python" with {"code"}
        @server.tool(name="python", description="Run Python code.")
        def python(code: str) -> str:
            return log("python", code)
        return server

    @server.tool(name="exec", description="Run a command.")
    def exec_(cmd: Cmd) -> str:
        return log("exec", cmd)

    @server.tool(name="ls", description="List a folder.")
    def ls(cmd: Cmd) -> str:
        return log("ls", cmd)

    @server.tool(name="slow", description="Run a slow command.")
    async def slow(cmd: Cmd) -> str:
        text = log("slow", cmd)
        await asyncio.sleep(slow_seconds)
        return text

    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--name", default="container")
    parser.add_argument("--slow-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    server = build(args.name, args.log, args.slow_seconds)
    asyncio.run(server.run_sse_async(host="127.0.0.1", port=args.port))


if __name__ == "__main__":
    main()

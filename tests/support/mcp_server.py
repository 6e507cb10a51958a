"""A local MCP server over SSE for the server-side tool tests: the tools vLLM's ``container``
built-in calls, every execution appended to a log file (one JSON line, written and synced before
the tool answers), so tests assert on what really ran.

    python tests/support/mcp_server.py --port 8931 --log /tmp/exec.log [--name container]

Named ``python``: one tool ``python`` (``code``), as vLLM's python built-in calls it. Named
``browser``: ``search``, ``open`` and ``find``, as vLLM's browser built-in calls them (each a choice
of a few words). Otherwise: ``exec`` and ``ls`` (``cmd``: ``"ls"``, ``"pwd"`` or ``"date"``, so a
random model's arguments are always complete), ``slow`` (waits ``--slow-seconds`` after logging,
for the disconnect tests), ``fail`` (logs, then raises: the tool's own error), ``crash`` (logs,
then the server process exits: the server gone while a call runs) and ``note`` (``text``: a free
string, which a random model does not close).
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
Query = Literal["weather", "news", "vllm"]


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
    if name == "browser":   # what vLLM's browser built-in calls: browser.search / open / find
        @server.tool(name="search", description="Search the web.")
        def search(query: Query) -> str:
            return log("search", query)

        @server.tool(name="open", description="Open a search result.")
        def open_(id: Cmd) -> str:   # noqa: A002 - the browser tool's own parameter name
            return log("open", id)

        @server.tool(name="find", description="Find a pattern in the open page.")
        def find(pattern: Cmd) -> str:
            return log("find", pattern)
        return server

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

    @server.tool(name="fail", description="Run a command that fails.")
    def fail(cmd: Cmd) -> str:
        log("fail", cmd)
        raise RuntimeError(f"fail refused to run {cmd!r}")

    @server.tool(name="crash", description="Run a command on a server that goes away.")
    def crash(cmd: Cmd) -> str:
        log("crash", cmd)
        os._exit(3)

    @server.tool(name="note", description="Write a note.")
    def note(text: str) -> str:
        return log("note", text)

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

"""The README as a reader runs it: its fenced blocks, its shell commands (one argv each), and its
two requests sent to a served model as written but for the address and the model's name."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
SHELL = {"bash", "sh", "shell"}
#: where the README's requests go, and the model it serves in its quickstart
README_BASE = "http://localhost:8000"


# ------------------------------------------------------------------------------ reading markdown

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown text: (language, body)."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return _FENCE.sub("", text)


def commands(body: str) -> list[list[str]]:
    """The commands of a shell block, one argv each (env assignments included), comments dropped;
    a quoted argument may span lines, a trailing backslash continues one."""
    result, buffer = [], ""
    for line in body.splitlines():
        buffer += line + "\n"
        if buffer.endswith("\\\n"):
            buffer = buffer[:-2] + " "
            continue
        try:
            argv = shlex.split(buffer, comments=True)
        except ValueError:      # an open quote: the argument goes on
            continue
        if argv:
            result.append(argv)
        buffer = ""
    assert not buffer.strip(), f"unfinished command in a shell block: {buffer!r}"
    return result


def readme_commands() -> list[list[str]]:
    return [argv for lang, body in blocks(README.read_text()) if lang in SHELL
            for argv in commands(body)]


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, value = argv[0].split("=", 1)
        env[name] = value
        argv = argv[1:]
    return env, argv


def requests() -> list[list[str]]:
    return [argv for argv in readme_commands() if argv[0] == "curl"]


def served_model() -> str:
    (serve,) = [argv for argv in readme_commands() if argv[:2] == ["vllm", "serve"]
                and not split_env(argv)[0]]
    return serve[2]


def run(argv: list[str], server) -> tuple[int, dict]:
    model = served_model()
    args = [a.replace(README_BASE, server.root_url).replace(f'"{model}"', '"tiny"') for a in argv]
    assert args != argv
    proc = subprocess.run(args + ["-w", "\n%{http_code}"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    body, _, status = proc.stdout.rpartition("\n")
    return int(status), json.loads(body)

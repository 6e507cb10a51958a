"""The README, checked as a reader uses it: every command it shows names something that exists
(make targets, `vllm-allowed-tools` subcommands and their flags, `python -m` modules, files, pip
extras, vLLM flags, our parsers and settings), its requests run against a real server (the real model answers them as it
says: tests/test_real_model_e2e.py), its Python and TOML blocks run as written, and every relative link in README.md and
docs/*.md resolves to a file and, with `#anchor`, to a heading of it."""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_allowed_tools.formats import wire_format, wire_formats

from support.readme import (README, README_BASE, ROOT, blocks, prose, readme_commands, requests,
                            run, split_env)

DOCS = sorted((ROOT / "docs").glob("*.md"))
#: pages other work adds; a link to one of exactly these may wait for it
PENDING_PAGES = {"docs/settings.md"}
REPO_DIRS = ("vllm_allowed_tools/", "tests/", "docs/", "benchmarks/", "examples/", "templates/",
             "grammars/", "clients/")


def flags(args: list[str]) -> list[str]:
    """`--flag` names among args (`--flag=value` counts as `--flag`), before a bare `--`."""
    out = []
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("--"):
            out.append(arg.split("=", 1)[0])
    return out


# --------------------------------------------------------------------- what names must exist

@functools.cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


@functools.cache
def help_text(*argv: str) -> str:
    proc = subprocess.run(list(argv) + ["--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, f"{argv} --help failed: {proc.stderr[-2000:]}"
    return proc.stdout


_SERVE_HELP = threading.Lock()


def vllm_serve_help() -> str:
    """``vllm serve --help=all`` (once: a second caller waits for the first)."""
    with _SERVE_HELP:
        return _vllm_serve_help()


@functools.cache
def _vllm_serve_help() -> str:
    vllm = Path(sys.executable).with_name("vllm")
    if not vllm.exists():
        vllm = shutil.which("vllm")
    if vllm is None:
        pytest.skip("the `vllm` command is not installed here")
    proc = subprocess.run([str(vllm), "serve", "--help=all"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@functools.cache
def package_source() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "vllm_allowed_tools").rglob("*.py"))


def cli_subcommands() -> set[str]:
    from vllm_allowed_tools.devtools.commands import build_parser
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(sub.choices)


def check_paths(args: list[str], problems: list[str], where: str) -> None:
    """Relative paths among the args (not URLs, options or absolute operator paths) must exist."""
    for arg in args:
        if arg.startswith(("-", "http://", "https://", "/", "$")) or "/" not in arg:
            continue
        if arg.startswith(REPO_DIRS) and not (ROOT / arg).exists():
            problems.append(f"{where}: no such path {arg!r}")


def check_command(argv: list[str]) -> list[str]:
    """What in one README command names something that does not exist."""
    where = shlex.join(argv)[:90]
    env, argv = split_env(argv)
    problems: list[str] = []
    for name in env:
        if name.startswith("VLLM_ALLOWED_TOOLS_") and name not in package_source():
            problems.append(f"{where}: the package reads no {name}")
    program, args = argv[0], argv[1:]
    if program == "make":
        problems += [f"{where}: no make target {t!r}" for t in args if t not in make_targets()]
    elif program == "vllm-allowed-tools":
        if args[0] not in cli_subcommands():
            return problems + [f"{where}: no subcommand {args[0]!r} in devtools/commands.py"]
        text = help_text(sys.executable, "-m", "vllm_allowed_tools.devtools.commands", args[0])
        problems += [f"{where}: `{args[0]}` has no flag {f}" for f in flags(args[1:])
                     if f not in text]
    elif program in ("python", "python3"):
        if args[0] == "-m":
            module = args[1]
            text = help_text(sys.executable, "-m", module)
            problems += [f"{where}: `python -m {module}` has no flag {f}" for f in flags(args[2:])
                         if f not in text]
        elif not (ROOT / args[0]).is_file():
            problems.append(f"{where}: no such script {args[0]!r}")
    elif program == "pip":
        assert args[0] == "install", where
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        for target in (a for a in args[1:] if not a.startswith("-")):
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            if match is None:
                problems.append(f"{where}: installs {target!r}, not this checkout")
                continue
            problems += [f"{where}: pyproject.toml has no extra {e!r}"
                         for e in (match.group(1) or "").split(",") if e and e not in extras]
    elif program == "vllm":
        assert args[0] == "serve", where
        text = vllm_serve_help()
        problems += [f"{where}: vllm serve has no flag {f}" for f in flags(args[2:])
                     if f not in text]
        if "--tool-call-parser" in args:
            parser = args[args.index("--tool-call-parser") + 1]
            try:
                assert wire_format(parser).parser_name == parser
            except (ValueError, AssertionError):
                problems.append(f"{where}: {parser!r} is not one of our parsers")
    elif program == "hf":   # huggingface_hub's CLI, installed with vLLM
        assert args[0] == "download", where
        text = help_text(str(Path(sys.executable).with_name("hf")), "download")
        problems += [f"{where}: `hf download` has no flag {f}" for f in flags(args[1:])
                     if f not in text]
    elif program == "curl":
        urls = [a for a in args if a.startswith("http")]
        if len(urls) != 1 or not urls[0].startswith(README_BASE + "/v1/"):
            problems.append(f"{where}: a request must go to {README_BASE}/v1/...")
        json.loads(args[args.index("-d") + 1])     # the body is JSON as written
    else:
        problems.append(f"{where}: this test does not know the program {program!r}: teach it")
    check_paths(args, problems, where)
    return problems


def test_readme_shows_the_two_commands_first() -> None:
    assert readme_commands()[:2] == [["make", "demo"], ["make", "test"]]


def test_every_readme_command_names_what_exists() -> None:
    with ThreadPoolExecutor(1) as pool:
        pool.submit(vllm_serve_help)   # the slowest help (a vLLM import), alongside the others
        problems = [p for argv in readme_commands() for p in check_command(argv)]
    assert not problems, "\n".join(problems)


def test_readme_prose_names_what_exists() -> None:
    """Backticked repository paths exist, `VLLM_ALLOWED_TOOLS_*` settings are read by the package,
    and every `allowed_*` name is one of our parsers."""
    text = prose(README.read_text())
    problems = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in span.split():
            if token.startswith(REPO_DIRS) and not (ROOT / token.rstrip(".,:;")).exists():
                problems.append(f"no such path {token!r}")
    for name in set(re.findall(r"VLLM_ALLOWED_TOOLS_[A-Z0-9_]*[A-Z0-9]", text)):
        if name not in package_source():
            problems.append(f"the package reads no {name}")
    for name in set(re.findall(r"`(allowed_[a-z0-9_]+)`", text)) - {"allowed_tools"}:   # the field
        try:
            wire_format(name)
        except ValueError:
            problems.append(f"{name} is not one of our parsers")
    assert not problems, "\n".join(problems)


def _parser_table() -> dict[str, tuple[str, str]]:
    """The README's parser table: each parser named in the first column -> the `auto` column and
    the custom tool input column."""
    table = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and "`allowed_" in cells[0]:
            for name in re.findall(r"`(allowed_[a-z0-9_]+)`", cells[0]):
                table[name] = (cells[2], cells[3])
    return table


def _custom_input_carried_as(parser: str) -> str:
    """What the format's required grammar makes of a custom tool's input, as the table says it."""
    import vllm.parser.harmony  # noqa: F401 (registers vLLM's harmony tag builder)

    from vllm_allowed_tools.decode.custom_capability import carries_custom_inputs
    from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
    name = wire_format(parser).name
    if not carries_custom_inputs(name, "required"):
        return "`auto` only (guard)"
    tag = build_structural_tag(name, [AllowedFunction("probe", None, None, input_grammar='root ::= "x"')],
                               "required", parallel_tool_calls=False)
    return "JSON string" if '{\\"input\\": \\"' in json.dumps(tag.model_dump()) else "raw value"


def test_parser_table_lists_every_parser_and_what_auto_gets() -> None:
    """Every registered format's parser has a row, the `auto` column says "guard only" exactly for
    the formats whose auto mode has no grammar (phi4_mini_json), and the custom tool input
    column says how the format's grammar carries a custom tool's input."""
    from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
    table = _parser_table()
    assert set(table) == {f.parser_name for f in wire_formats()}

    def no_auto_grammar(name: str) -> bool:
        return wire_format(name).grammar.kind == "json_array" and build_structural_tag(
            name, [AllowedFunction("t", None)], "auto") is None
    wrong = {name: auto for name, (auto, _) in table.items()
             if auto.startswith("guard only") != no_auto_grammar(name)}
    assert not wrong, wrong
    carried = {name: (custom, _custom_input_carried_as(name)) for name, (_, custom) in table.items()}
    assert all(said == built for said, built in carried.values()), carried


def test_readme_python_blocks_run_as_written(tmp_path) -> None:
    """The dispatch-guard block runs: the allowed call runs its handler, the other is refused."""
    (code,) = [body for lang, body in blocks(README.read_text()) if lang == "python"]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, second = [ast.literal_eval(line) for line in proc.stdout.splitlines()]   # printed dicts
    assert first["type"] == "function_call_output" and first["call_id"] == "c1"
    assert json.loads(first["output"]) == {"city": "Paris", "forecast": "sunny"}
    assert second["call_id"] == "c2"
    assert json.loads(second["output"])["error"]["code"] == "tool_not_allowed"


def test_readme_approval_policy_loads_and_gates_what_it_says(tmp_path) -> None:
    from vllm_allowed_tools.approvals.policy import load_policy
    from vllm_allowed_tools.request.identity import ToolIdentity
    (toml,) = [body for lang, body in blocks(README.read_text()) if lang == "toml"]
    path = tmp_path / "approvals.toml"
    path.write_text(toml)
    policy = load_policy(path)
    assert policy.effective("send_email").required
    assert policy.effective(ToolIdentity("crm", "lookup")).required
    assert policy.effective("send_email").scopes == ("once", "session")
    assert not policy.effective("get_weather").required


# ------------------------------------------------------------------------- links and anchors

def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else None
        if not resolved.exists():
            if relative not in PENDING_PAGES:
                problems.append(f"{target}: no such file")
            continue
        if anchor and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {relative}")
    assert not problems, "\n".join(problems)


def test_readme_links_the_docs_pages() -> None:
    """Every page in docs/ is reachable from the README (so are the pages other work adds)."""
    linked = {t.partition("#")[0] for t in links(README)}
    assert {f"docs/{p.name}" for p in DOCS} <= linked
    assert PENDING_PAGES <= linked


# ----------------------------------------------------------------- the requests, on a server

def test_readme_shows_one_request_per_api() -> None:
    endpoints = sorted(next(a for a in argv if a.startswith("http")).removeprefix(README_BASE)
                       for argv in requests())
    assert endpoints == ["/v1/chat/completions", "/v1/responses"]


@pytest.mark.server
def test_readme_says_an_unknown_name_is_a_400_naming_it(random_server) -> None:
    """The Responses request with its allowed name swapped for one not in `tools`: the 400 the
    README describes, `param` naming the entry."""
    (argv,) = [a for a in requests() if any(x.endswith("/v1/responses") for x in a)]
    body_at = argv.index("-d") + 1
    body = json.loads(argv[body_at])
    body["tool_choice"]["tools"][0]["name"] = "drop_database"
    status, answer = run(argv[:body_at] + [json.dumps(body)] + argv[body_at + 1:], random_server)
    assert status == 400, answer
    assert answer["error"]["param"] == "tool_choice.tools[0].name", answer
    assert "`tool_choice.tools[0].name`" in README.read_text()

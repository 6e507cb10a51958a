"""Prompt-cache reuse with a model's own chat template served unmodified, per real template.

    python benchmarks/template_reuse.py [TEMPLATE ...] [--out benchmarks/results/template_reuse.md]

For each template of the corpus (``tests/data/chat_templates/*.jinja``, or the files / corpus names
given), it serves the random tiny model with that template as ``--chat-template`` twice, one server
after the other:

* ``auto``: ``VLLM_ALLOWED_TOOLS_PLACEMENT=auto``, the start-up probe picks how the per-turn policy
  enters the prompt (the server logs its choice, which the table reports);
* ``filter-catalog``: ``VLLM_ALLOWED_TOOLS_PLACEMENT=filter-catalog``, the model sees only the
  allowed tools (what catalog-filtering servers do).

On each server it replays one 6-turn agent transcript over ``/v1/chat/completions`` with the official
``openai`` SDK: the full 8-tool catalog every turn, ``tool_choice`` ``allowed_tools`` (mode ``auto``)
with a different allowed subset each turn, ``max_tokens=1``, temperature 0, and the history grown
by a fixed assistant tool call and its tool result per turn, as a client replays them. Per turn it
records ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``; from the prompt
token ids the server returns (``return_token_ids``) and the history alone tokenized by the server's
``/tokenize`` (no policy, no request) it also records:

* ``ideal``: the cached tokens vLLM should report: whole 32-token blocks of the longest prefix this
  prompt shares with an earlier one of the run, at most ``prompt - 1`` tokens;
* ``must``: what the start-up probe guarantees the cache can serve, whatever placement it chose:
  the previous turn's history up to the end of its last message's content (rendered by the server
  with ``continue_final_message``), cut to what the template itself keeps from one turn to the next
  (the common prefix of the two plain renderings), less the one token a tokenizer may merge across
  that boundary, in whole blocks. A ``last-message`` placement puts the policy right there, so the
  last message's closing markup is not part of it.

Each server is fresh, so everything a run reads from the cache it wrote itself. A template whose
server does not start (e.g. refused by the probe under ``auto``) is listed with the reason. Progress
goes to stderr; the markdown table goes to stdout and to ``--out``. Exit status: 0 when every
started ``auto`` run met ``must`` on every turn after the first, 1 otherwise, 2 when nothing ran.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.devtools.serve import SERVED_MODEL_NAME, ServeError, start_server
from vllm_allowed_tools.request.placement import canonical_tools
from vllm_allowed_tools.request.template_probe import common_prefix_length

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tests" / "data" / "chat_templates"
RESULTS = HERE / "results" / "template_reuse.md"
BLOCK_SIZE = 32          # start_server's --block-size
TURNS = 6
CATALOG_SIZE = 8
PLACEMENT_ENV = "VLLM_ALLOWED_TOOLS_PLACEMENT"
AUTO, FILTER = "auto", "filter-catalog"
#: the parser every run uses: the prompt does not depend on it, and the tiny tokenizer lacks the
#: special tokens other families' parsers look up at start (Llama's <|python_tag|>, ...)
PARSER = "allowed_hermes"
_CHOSEN = re.compile(r"the per-turn policy goes in by (\S+) \((\w+)\)")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the transcript

@dataclass(frozen=True)
class Step:
    """One agent step the client replays: a call (9-character id) and its result."""
    call_id: str
    name: str
    arguments: dict[str, str]
    result: str


@dataclass(frozen=True)
class Transcript:
    tools: list[dict[str, Any]]           # Chat shape, the client's order
    system: str
    user: str
    steps: list[Step]                      # steps[i] follows turn i + 1
    allowed: list[tuple[str, ...]]         # the allowed subset of each turn

    def messages(self, turn: int, arguments_as_text: bool = True) -> list[dict[str, Any]]:
        """The history request ``turn`` (1-based) sends: system, user, then ``turn - 1`` steps.
        Arguments as JSON text (what a client sends) or as objects (what vLLM hands a template)."""
        history: list[dict[str, Any]] = [{"role": "system", "content": self.system},
                                         {"role": "user", "content": self.user}]
        for step in self.steps[:turn - 1]:
            arguments: Any = json.dumps(step.arguments) if arguments_as_text else dict(step.arguments)
            history.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": step.call_id, "type": "function",
                 "function": {"name": step.name, "arguments": arguments}}]})
            history.append({"role": "tool", "tool_call_id": step.call_id, "name": step.name,
                            "content": step.result})
        return history


def make_transcript(seed: int = 11, turns: int = TURNS) -> Transcript:
    """A stable catalog, a different allowed subset (2-3 tools) every turn, and after each turn a
    call to one of that turn's allowed tools with its result."""
    rng = random.Random(seed)
    catalog = rng.sample(list(POOL), CATALOG_SIZE)
    allowed: list[tuple[str, ...]] = []
    steps: list[Step] = []
    for turn in range(1, turns + 1):
        while True:
            subset = tuple(sorted(tool.name for tool in rng.sample(catalog, rng.randint(2, 3))))
            if not allowed or subset != allowed[-1]:
                break
        allowed.append(subset)
        tool = next(tool for tool in catalog if tool.name == subset[0])
        arguments = tool.random_arguments(rng)
        steps.append(Step(call_id=f"call{turn:05d}", name=tool.name, arguments=arguments,
                          result=f"step {turn} finished: {tool.name} returned ok"))
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                               "parameters": tool.parameters}} for tool in catalog]
    return Transcript(tools=tools,
                      system=f"You are a careful agent (run {seed}); use one tool per step.",
                      user="Please work through my task list for today, step by step.",
                      steps=steps[:turns - 1], allowed=allowed)


def chat_tool_choice(names: Sequence[str], mode: str = "auto") -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


# --------------------------------------------------------------------------- one run

@dataclass
class Turn:
    turn: int
    allowed: list[str]
    prompt_tokens: int
    cached_tokens: int
    ideal: int           # whole blocks of the longest prefix shared with an earlier prompt
    must: int | None     # what the previous turn's history guarantees (None on turn 1)


@dataclass
class Run:
    template: str
    placement: str                  # what was asked: auto or filter-catalog
    chosen: str | None = None       # what the server logged
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None

    def later(self) -> list[Turn]:
        return self.turns[1:]

    def reuse(self) -> float:
        later = self.later()
        prompt = sum(turn.prompt_tokens for turn in later)
        return sum(turn.cached_tokens for turn in later) / prompt if prompt else 0.0

    def meets_must(self) -> bool:
        return all(turn.must is None or turn.cached_tokens >= turn.must for turn in self.turns)


def _blocks(tokens: int) -> int:
    return max(0, tokens) // BLOCK_SIZE * BLOCK_SIZE


def _tokenize_chat(root_url: str, messages: list[dict], tools: list[dict], generation: bool,
                   open_end: bool = False) -> list[int]:
    """The server's own rendering and tokenization of a plain conversation (no policy, no request
    to the engine, so nothing enters the cache); ``open_end`` stops at the last message's content."""
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "tools": tools,
            "add_generation_prompt": generation, "continue_final_message": open_end}
    request = urllib.request.Request(root_url + "/tokenize", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return list(json.loads(response.read())["tokens"])


def must_reuse(root_url: str, transcript: Transcript, turn: int) -> int | None:
    """The ``must`` bound of ``turn`` (see the module docstring); None on the first turn."""
    if turn < 2:
        return None
    tools = canonical_tools(transcript.tools, "chat")   # as the middleware hands them to vLLM
    previous = transcript.messages(turn - 1)
    history = _tokenize_chat(root_url, previous, tools, generation=False, open_end=True)
    kept = common_prefix_length(_tokenize_chat(root_url, previous, tools, generation=True),
                _tokenize_chat(root_url, transcript.messages(turn), tools, generation=True))
    return _blocks(min(len(history), kept) - 1)


def drive(client: Any, root_url: str, transcript: Transcript, run: Run,
          filter_catalog: bool = False) -> Run:
    """Replay the transcript against a started server; fills ``run.turns``."""
    earlier: list[list[int]] = []
    for turn in range(1, len(transcript.allowed) + 1):
        allowed = transcript.allowed[turn - 1]
        reply = client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=transcript.messages(turn), tools=transcript.tools,
            tool_choice=chat_tool_choice(allowed), max_tokens=1, temperature=0.0, seed=0,
            extra_body={"return_token_ids": True})
        ids = list((reply.model_extra or {}).get("prompt_token_ids") or [])
        usage = reply.usage
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens if details else 0) or 0
        shared = max((common_prefix_length(ids, old) for old in earlier), default=0)
        earlier.append(ids)
        run.turns.append(Turn(turn=turn, allowed=list(allowed), prompt_tokens=usage.prompt_tokens,
                              cached_tokens=cached,
                              ideal=_blocks(min(shared, usage.prompt_tokens - 1)),
                              must=None if filter_catalog else must_reuse(root_url, transcript, turn)))
    return run


def chosen_placement(log_text: str) -> str | None:
    found = _CHOSEN.findall(log_text)
    return found[-1][0] if found else None


def _refusal(log_text: str) -> str:
    """The line of a failed start that says why: the probe's refusal, else the last error raised."""
    root = f"{HERE.parent}/"   # the report names corpus files relative to the repository
    lines = [line.strip().replace(root, "") for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "cannot take the per-turn" in line:
            return line[line.find("the chat template"):] if "the chat template" in line else line
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    return errors[-1] if errors else (lines[-1] if lines else "(no log)")


def serve_and_drive(model_dir: Path, template: Path, placement: str, transcript: Transcript,
                    log_dir: Path) -> Run:
    """Start a server for (template, placement), replay the transcript, stop it."""
    from openai import OpenAI

    run = Run(template=template.stem, placement=placement)
    log_path = log_dir / f"{template.stem}.{placement}.log"
    try:
        server = start_server(model_dir, parser=PARSER, chat_template=template,
                              log_path=log_path, env={PLACEMENT_ENV: placement}, timeout=600)
    except ServeError:
        run.error = _refusal(log_path.read_text(errors="replace"))
        return run
    try:
        run.chosen = chosen_placement(log_path.read_text(errors="replace"))
        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        drive(client, server.root_url, transcript, run, filter_catalog=placement == FILTER)
    except Exception as exc:   # noqa: BLE001 - a run that breaks mid-way is reported, the others run
        run.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        server.stop()
    return run


# --------------------------------------------------------------------------- report

def _cells(run: Run) -> tuple[str, str]:
    if run.error:
        return f"not run: {run.error}".replace("|", "\\|"), "–"
    cells = " ".join(f"{turn.cached_tokens}/{turn.prompt_tokens}" for turn in run.later())
    return cells, f"{100 * run.reuse():.0f}%"


def table(results: list[tuple[Run, Run]]) -> str:
    rows = [("| template | placement chosen | cached/prompt, turns 2-6 | reuse | filter-catalog "
             "cached/prompt, turns 2-6 | filter reuse |"), "|---|---|---|---|---|---|"]
    for auto, filtered in results:
        chosen = auto.chosen or ("refused" if auto.error else "?")
        auto_cells, auto_reuse = _cells(auto)
        filter_cells, filter_reuse = _cells(filtered)
        rows.append(f"| `{auto.template}` | {chosen} | {auto_cells} | {auto_reuse} | {filter_cells} "
                    f"| {filter_reuse} |")
    return "\n".join(rows)


def shortfalls(results: list[tuple[Run, Run]]) -> list[str]:
    """Turns where an auto run's cache served less than ``must`` or than ``ideal``."""
    notes = []
    for auto, _ in results:
        for turn in auto.later():
            if turn.must is not None and turn.cached_tokens < turn.must:
                notes.append(f"`{auto.template}` turn {turn.turn}: cached {turn.cached_tokens} < "
                             f"must {turn.must}")
            if turn.cached_tokens != turn.ideal:
                notes.append(f"`{auto.template}` turn {turn.turn}: cached {turn.cached_tokens} != "
                             f"ideal {turn.ideal}")
    return notes


def report(argv: Sequence[str], results: list[tuple[Run, Run]], seconds: float) -> str:
    notes = shortfalls(results)
    lines = [f"Command: `{shlex.join(['python', 'benchmarks/template_reuse.py', *argv])}`", "",
             (f"{len(results)} templates, {seconds / 60:.1f} min; random tiny model on CPU, "
              f"--block-size {BLOCK_SIZE}; {TURNS} turns, {CATALOG_SIZE} tools, a different allowed "
              "subset each turn (mode auto), max_tokens 1."), "", table(results), ""]
    lines += ["Every `auto` turn after the first was served from the cache for at least `must` "
              "tokens (the previous turn's history, up to the end of its last message) and exactly "
              "`ideal` (whole blocks of the longest prefix shared with an earlier prompt)."
              if not notes else "Shortfalls:"]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def resolve(names: Sequence[str]) -> list[Path]:
    if not names:
        return sorted(CORPUS.glob("*.jinja"))
    paths = []
    for name in names:
        path = Path(name)
        if not path.is_file():
            path = CORPUS / (name if name.endswith(".jinja") else f"{name}.jinja")
        if not path.is_file():
            raise SystemExit(f"no template {name!r}: give a file or one of "
                             f"{', '.join(p.stem for p in sorted(CORPUS.glob('*.jinja')))}")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("templates", nargs="*", help="corpus names or template files (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown file to write")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the server logs here")
    parser.add_argument("--json", type=Path, default=None, help="also write every turn's figures here")
    args = parser.parse_args(argv)
    templates = resolve(args.templates)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="template-reuse-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model("random", log=_log)
    transcript = make_transcript()
    started = time.monotonic()
    results = []
    for template in templates:
        pair = []
        for placement in (AUTO, FILTER):
            _log(f"{template.stem} / {placement} ...")
            run = serve_and_drive(model_dir, template, placement, transcript, log_dir)
            _log(f"  chosen {run.chosen}, reuse {run.reuse():.0%}" if not run.error else f"  {run.error}")
            pair.append(run)
        results.append((pair[0], pair[1]))
    text = report(argv, results, time.monotonic() - started)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(run) for pair in results for run in pair], indent=1))
    _log(f"server logs: {log_dir}")
    ran = [auto for auto, _ in results if not auto.error]
    if not ran:
        return 2
    return 0 if all(auto.meets_must() for auto in ran) else 1


if __name__ == "__main__":
    sys.exit(main())

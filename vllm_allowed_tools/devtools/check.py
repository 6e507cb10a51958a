"""``vllm-allowed-tools check``: would this model start with the plugin, and what would hold?

Before deploying, an operator names the model (or tokenizer) folder and the flags they would pass
to ``vllm serve``; the check builds that command line and runs on it what the server decides at
start-up (:mod:`.check_findings`: vLLM's own validators, the middleware's capability checks, the
template probe, the format's limits, and a compile of the format's grammar for a sample catalog
against the tokenizer). No weights are read and no engine starts: it takes seconds.

Exit codes: 0 the server starts (warnings are printed), 1 the server would refuse to start, 2 bad
usage or an unreadable input (the message names the flag). ``--json`` prints the report as JSON.
The environment is read as the server reads it: run the check with the server's environment
(``VLLM_TARGET_DEVICE=cuda`` to decide for a GPU host from a CPU one).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import Settings, SettingsError, process_environment
from .check_findings import GUARANTEES, Finding

EXIT_STARTS, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2


class CheckInputError(Exception):
    """An input the check cannot read or a usage error; ``flag`` names the flag (or ``MODEL``)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class CheckReport:
    """The ``vllm serve`` command line checked and one finding per guarantee."""
    command: tuple[str, ...]
    findings: tuple[Finding, ...]
    seconds: float

    @property
    def exit_code(self) -> int:
        return EXIT_REFUSED if any(f.verdict == "refused" for f in self.findings) else EXIT_STARTS

    def to_json(self) -> dict[str, Any]:
        return {"command": list(self.command), "exit_code": self.exit_code,
                "starts": self.exit_code == EXIT_STARTS, "seconds": round(self.seconds, 2),
                "findings": [finding.to_json() for finding in self.findings]}

    def to_text(self) -> str:
        lines = [f"vllm-allowed-tools check: {shlex.join(self.command)}"]
        width = max(len(title) for title in GUARANTEES.values())
        for finding in self.findings:
            lines.append(f"  {finding.verdict.upper():<8} {GUARANTEES[finding.guarantee]:<{width}}  "
                         f"{finding.reason}")
        refused = sum(f.verdict == "refused" for f in self.findings)
        warned = sum(f.verdict == "warn" for f in self.findings)
        verdict = (f"the server would refuse to start ({refused} refused)" if refused else
                   "the server starts with the plugin" + (f" ({warned} warning{'s' * (warned > 1)})"
                                                          if warned else ""))
        lines.append(f"result: {verdict}; checked in {self.seconds:.1f} s")
        return "\n".join(lines)


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The check's flags: the ``vllm serve`` flags it reads, spelled as vLLM spells them."""
    parser.add_argument("model", metavar="MODEL", type=Path,
                        help="the model folder, or a folder holding its tokenizer (no weights read)")
    parser.add_argument("--tool-call-parser", required=True, help="the parser to serve, e.g. allowed_hermes")
    parser.add_argument("--tokenizer", type=Path, default=None, help="the tokenizer folder, if not MODEL")
    parser.add_argument("--chat-template", default=None,
                        help="the template file to serve (default: the tokenizer's own)")
    parser.add_argument("--reasoning-parser", default=None)
    parser.add_argument("--structured-outputs-config.backend", dest="backend", default=None,
                        help="vLLM's structured-outputs backend (default: auto)")
    parser.add_argument("--tokenizer-mode", default=None, help="vLLM's tokenizer mode (default: auto)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(vllm_args=[])   # more vllm serve flags, after `--`: see take_vllm_args


def take_vllm_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   unknown: Sequence[str]) -> None:
    """The flags left after ``--`` (``parse_known_args``) are more ``vllm serve`` flags for the
    command line checked; anything else left over is a usage error naming it."""
    if not unknown:
        return
    if unknown[0] != "--" or not hasattr(args, "vllm_args"):
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (vllm serve flags go after `--`)")
    args.vllm_args = list(unknown[1:])


def server_command(args: argparse.Namespace, settings: Settings) -> list[str]:
    """The ``vllm serve`` command line the check decides for (tools on, as the plugin needs),
    with our middleware added where the plugin would add it (under ``settings``' vouched
    parsers)."""
    from ..vllm_glue.plugin import with_our_middleware
    flags = [("--tool-call-parser", args.tool_call_parser), ("--tokenizer", args.tokenizer),
             ("--chat-template", args.chat_template), ("--reasoning-parser", args.reasoning_parser),
             ("--structured-outputs-config.backend", args.backend),
             ("--tokenizer-mode", args.tokenizer_mode)]
    extra = list(args.vllm_args)
    argv = ["vllm", "serve", str(args.model), "--enable-auto-tool-choice",
            *[part for flag, value in flags if value is not None for part in (flag, str(value))],
            *(["--trust-remote-code"] if args.trust_remote_code else []), *extra]
    return with_our_middleware(argv, settings)


def check_settings(args: argparse.Namespace, environ: Mapping[str, str]
                   ) -> tuple[Settings, SettingsError | None]:
    """The settings the server would start with: ``environ`` (the check's own, as the server reads
    its environment) and the command line the check decides for. A value the server could not use
    is returned as the refusal (start-up stops there) and left out of the settings, so the other
    guarantees are still checked as the server would decide them once it is fixed."""
    try:
        settings, refusal = Settings.from_environ(environ), None
    except SettingsError as exc:
        usable = {name: value for name, value in environ.items() if name not in exc.variables}
        settings, refusal = Settings.from_environ(usable), exc
    return settings.with_command_line(server_command(args, settings)), refusal


def _refuse_unreadable_inputs(args: argparse.Namespace) -> None:
    """Raise CheckInputError for a folder or template file the check cannot read."""
    for flag, folder in (("MODEL", args.model), ("--tokenizer", args.tokenizer)):
        if folder is not None and not Path(folder).is_dir():
            raise CheckInputError(flag, f"{folder} is not a folder; give the local model folder (or "
                                  "the folder holding its tokenizer): the check downloads nothing")
    if args.vllm_args:
        from ..vllm_glue.vllm_validation import serve_flags_refusal
        refusal = serve_flags_refusal(args.vllm_args)
        if refusal is not None:
            raise CheckInputError(" ".join(args.vllm_args), refusal)
    template = args.chat_template
    if template is None:
        return
    path = Path(template)
    if path.is_file():
        try:
            path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckInputError("--chat-template", f"cannot read {template} ({exc})") from None
        return
    if path.exists():
        raise CheckInputError("--chat-template", f"{template} is not a file")
    from ..vllm_glue.vllm_validation import chat_template_refusal
    refusal = chat_template_refusal(template)
    if refusal is not None:
        raise CheckInputError("--chat-template", refusal)


def _vocab_size(model: Path, tokenizer: Any) -> int:
    """The model's vocabulary as vLLM sizes grammars (its config's ``vocab_size``), or the
    tokenizer's length for a folder without a model config."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return len(tokenizer)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else len(tokenizer)


def run_check(args: argparse.Namespace) -> CheckReport:
    """The report for the command line ``args`` describe; raises CheckInputError for bad input."""
    from ..errors import CapabilityError
    from ..vllm_glue.served_template import load_served_template
    from ..vllm_glue.vllm_validation import load_parser_plugins
    from . import check_findings as findings
    started = time.monotonic()
    _refuse_unreadable_inputs(args)
    settings, refusal = check_settings(args, process_environment())
    launch = settings.launch
    try:
        served = load_served_template(launch)
    except CapabilityError as exc:
        raise CheckInputError("--tokenizer" if args.tokenizer else "MODEL", str(exc)) from None
    load_parser_plugins(launch)
    tokenizer = served.tokenizer
    mode = findings.tokenizer_mode_finding(settings)
    placement = findings.placement_finding(settings, served) if mode.verdict == "ok" else \
        Finding("placement", "skipped", "not probed: see the tokenizer mode")
    report = (findings.tool_parser_finding(settings, tokenizer),
              findings.reasoning_parser_finding(settings, tokenizer), mode,
              findings.constraint_stage_finding(settings), placement,
              findings.format_limits_finding(launch.tool_call_parser),
              findings.grammar_finding(settings, tokenizer, _vocab_size(args.model, tokenizer)),
              findings.configuration_finding(settings, refusal))
    return CheckReport(command=launch.argv, findings=report, seconds=time.monotonic() - started)


def cmd_check(args: argparse.Namespace) -> int:
    """Print the report (text, or JSON with ``--json``); the exit code says whether it starts."""
    try:
        report = run_check(args)
    except CheckInputError as exc:
        if args.json:
            print(json.dumps({"exit_code": EXIT_BAD_INPUT, "error": str(exc), "flag": exc.flag}))
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report.to_json(), indent=2) if args.json else report.to_text(), flush=True)
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-allowed-tools check`` on its own (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(prog="vllm-allowed-tools check", description=__doc__.split("\n\n")[0])
    add_check_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    take_vllm_args(parser, args, unknown)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())

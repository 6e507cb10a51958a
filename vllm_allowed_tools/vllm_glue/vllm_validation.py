"""What vLLM itself refuses before its engine starts, asked of vLLM's own validators.

``vllm serve`` checks its parser names (``validate_api_server_args``), its chat template
(``validate_chat_template``), its structured-outputs backend (``StructuredOutputsConfig``) and its
tokenizer mode (the tokenizer registry) before it loads a weight; the tool and reasoning parsers are
built with the served tokenizer on each request. Each function here runs one of those vLLM steps
and says why it refuses (None: it accepts), so ``vllm-allowed-tools check`` reports what the server
would, without building an engine. Our own start-up checks are in :mod:`.capabilities` and
:mod:`.served_template`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ..launch import LaunchArgs
from .plugin import register_parsers


def load_parser_plugins(launch: LaunchArgs) -> None:
    """Register our parsers and import the operator's parser plugins, as ``vllm serve`` does
    before it validates the parser names (``--tool-parser-plugin``, ``--reasoning-parser-plugin``)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    register_parsers()
    tool_plugin = launch.tool_parser_plugin
    if tool_plugin and len(tool_plugin) > 3:
        ToolParserManager.import_tool_parser(tool_plugin)
    reasoning_plugin = launch.reasoning_parser_plugin
    if reasoning_plugin and len(reasoning_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(reasoning_plugin)


def _api_server_refusal(tool_parser: str | None, reasoning_parser: str | None) -> str | None:
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    args = SimpleNamespace(enable_auto_tool_choice=tool_parser is not None, tool_call_parser=tool_parser,
                           structured_outputs_config=SimpleNamespace(reasoning_parser=reasoning_parser))
    try:
        validate_api_server_args(args)
    except KeyError as exc:
        text = str(exc.args[0]) if exc.args else str(exc)
        return text.split(" (chose from", 1)[0]   # the list of every parser: vllm serve --help has it
    return None


def tool_parser_refusal(parser: str) -> str | None:
    """vLLM's refusal of ``--tool-call-parser parser`` (with ``--enable-auto-tool-choice``)."""
    return _api_server_refusal(parser, None)


def reasoning_parser_refusal(parser: str) -> str | None:
    """vLLM's refusal of ``--reasoning-parser parser``."""
    return _api_server_refusal(None, parser)


def backend_refusal(backend: str) -> str | None:
    """vLLM's refusal of ``--structured-outputs-config.backend backend``."""
    from vllm.config import StructuredOutputsConfig
    try:
        StructuredOutputsConfig(backend=backend)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError (vLLM's config dataclass)
        errors = exc.errors() if callable(getattr(exc, "errors", None)) else []
        why = errors[0].get("msg") if errors else _first_line(exc)
        return f"vLLM refuses --structured-outputs-config.backend {backend}: {why}"
    return None


def tokenizer_mode_refusal(mode: str) -> str | None:
    """vLLM's refusal of ``--tokenizer-mode mode`` (its tokenizer registry; ``auto`` resolves to
    ``hf`` or ``mistral``)."""
    from vllm.tokenizers.registry import TokenizerRegistry
    known = {"auto", *TokenizerRegistry.tokenizers}
    if mode.lower() in known:
        return None
    return (f"vLLM has no tokenizer registered for --tokenizer-mode {mode} (it knows "
            f"{', '.join(sorted(known))})")


def chat_template_refusal(value: str) -> str | None:
    """vLLM's refusal of ``--chat-template value`` (a path-like value that names no file)."""
    from vllm.renderers.chat_utils import validate_chat_template
    try:
        validate_chat_template(value)
    except Exception as exc:  # noqa: BLE001 - vLLM raises ValueError or its own validation error
        return _first_line(exc)
    return None


def serve_flags_refusal(flags: Sequence[str]) -> str | None:
    """Why ``vllm serve``'s own argument parser refuses ``flags`` (an unknown flag, a value of the
    wrong type); None: it parses them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
    try:
        _namespace, unknown = parser.parse_known_args(list(flags))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - argparse's ArgumentError, or its exit
        return f"vllm serve refuses them: {_first_line(exc)}"
    return f"vllm serve does not know {' '.join(unknown)}" if unknown else None


def tool_parser_failure(parser: str, tokenizer: Any) -> str | None:
    """Why vLLM could not build ``parser`` with the served tokenizer (it does, on each request with
    tools: a parser whose markers are not in the vocabulary raises there); None: it builds."""
    from vllm.tool_parsers import ToolParserManager
    try:
        ToolParserManager.get_tool_parser(parser)(tokenizer)
    except Exception as exc:  # noqa: BLE001 - parsers raise what they like on a foreign vocabulary
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


def reasoning_parser_failure(parser: str, tokenizer: Any) -> str | None:
    """Why vLLM could not build the reasoning parser with the served tokenizer (it does, per
    request); None: it builds."""
    from vllm.reasoning import ReasoningParserManager
    try:
        ReasoningParserManager.get_reasoning_parser(parser)(tokenizer=tokenizer)
    except Exception as exc:  # noqa: BLE001 - as above
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The server's command line as the plugin reads it: :class:`LaunchArgs`, one typed value per flag.

vLLM parses the command line again, for itself; the plugin needs a few flags before vLLM's parsed
arguments exist (in its general plugin, while vLLM builds its parser) or where they never reach it
(the middleware is built with the app alone). :func:`..settings.current` reads ``sys.argv`` once;
this module only parses what it is given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LaunchArgs"]


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    """The last value given for ``name`` (``--flag value`` or ``--flag=value``; vLLM's parser
    takes ``_`` for ``-`` in a flag's name, so this does too)."""
    values = _flag_values(argv, name)
    return values[-1] if values else None


def _flag_values(argv: Sequence[str], name: str) -> list[str]:
    """Every value given for a repeatable flag such as ``--middleware``."""
    values = []
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if not flag.startswith("--") or flag.replace("_", "-") != name:
            continue
        if equals:
            values.append(value)
        elif index + 1 < len(argv):
            values.append(argv[index + 1])
    return values


def _given(argv: Sequence[str], name: str) -> bool:
    return any(arg.partition("=")[0].replace("_", "-") == name for arg in argv if arg.startswith("--"))


def _model(argv: Sequence[str]) -> str | None:
    model = _flag_value(argv, "--model")
    if model is None and "serve" in argv:
        index = list(argv).index("serve") + 1
        if index < len(argv) and not argv[index].startswith("-"):
            model = argv[index]
    return model


def _structured_outputs_backend(argv: Sequence[str]) -> str:
    backend = _flag_value(argv, "--structured-outputs-config.backend")
    if backend is None:
        blob = _flag_value(argv, "--structured-outputs-config") or _short_flag(argv, "-sc")
        if blob:
            try:
                backend = json.loads(blob).get("backend")
            except (ValueError, AttributeError):
                backend = None
    return backend or "auto"


def _short_flag(argv: Sequence[str], name: str) -> str | None:
    value = None
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
    return value


def _flag(*flags: str, description: str, default: Any = None) -> Any:
    """A command-line field; ``flags``: the flags it is read from, as the docs list them."""
    return Field(default, description=description, json_schema_extra={"flags": list(flags)})


class LaunchArgs(BaseModel):
    """The server's command line, as far as the plugin reads it (vLLM parses it again, for itself).

    Read from ``sys.argv``, which multiprocessing hands to spawned API servers too, so every
    process of one server sees the same values, before or without vLLM's parsed arguments."""

    model_config = ConfigDict(frozen=True)

    argv: tuple[str, ...] = Field(default=(), description="the whole command line")
    is_server: bool = _flag("serve", default=False, description=(
        "a `vllm serve` (or `api_server`) command: only a server's command line is checked at "
        "start-up and gets the middleware added"))
    model: str | None = _flag("--model", description=(
        "the served model (also the first argument after `serve`): whose tokenizer and chat "
        "template the start-up probe reads, and whether it is served as harmony (gpt-oss)"))
    tool_call_parser: str | None = _flag("--tool-call-parser", description=(
        "one of ours (`allowed_<base>`) or a vouched one adds the middleware; any other parser "
        "with the middleware stops start-up"))
    middleware: tuple[str, ...] = _flag("--middleware", default=(), description=(
        "the middleware already named: ours is added only where it is missing"))
    structured_outputs_backend: str = _flag(
        "--structured-outputs-config.backend", "--structured-outputs-config", default="auto", description=(
            "the structured-output backend (`auto` when unset): one that cannot compile structural "
            "tags gets the logits-processor stage, or stops start-up"))
    speculative_decoding: bool = _flag("--speculative-config", default=False, description=(
        "speculative decoding: vLLM runs no logits processors then, so the native stage serves"))
    tool_strict_level: str | None = _flag("--tool-strict-level", description=(
        "`parameter`: every function tool's arguments are validated as if it were `strict`"))
    trust_request_chat_template: bool = _flag("--trust-request-chat-template", default=False, description=(
        "a request's own `chat_template` is rendered, so the middleware probes it per template"))
    chat_template: str | None = _flag("--chat-template", description=(
        "the served template (a file or a literal) the start-up probe renders"))
    tokenizer: str | None = _flag("--tokenizer", description="the tokenizer the probe loads")
    tokenizer_revision: str | None = _flag("--tokenizer-revision", description="its revision")
    revision: str | None = _flag("--revision", description="the model's revision (its config)")
    tokenizer_mode: str | None = _flag("--tokenizer-mode", description=(
        "`mistral` takes no chat template, so it stops start-up"))
    trust_remote_code: bool = _flag("--trust-remote-code", default=False, description=(
        "passed on when the probe loads the tokenizer and the model's config"))
    api_key_given: bool = _flag("--api-key", default=False, description=(
        "an API key: vLLM's authentication runs before the middleware reads a body"))
    reasoning_parser: str | None = _flag("--reasoning-parser", description=(
        "the reasoning parser, which `vllm-allowed-tools check` asks vLLM to know and to build "
        "with the tokenizer"))
    tool_parser_plugin: str | None = _flag("--tool-parser-plugin", description=(
        "the operator's tool-parser file, which `vllm-allowed-tools check` imports first, as "
        "`vllm serve` does (a vouched parser lives there)"))
    reasoning_parser_plugin: str | None = _flag("--reasoning-parser-plugin", description=(
        "the operator's reasoning-parser file, which `vllm-allowed-tools check` imports first"))

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> LaunchArgs:
        argv = tuple(argv)
        return cls(
            argv=argv, is_server="serve" in argv or any(arg.endswith("api_server") for arg in argv),
            model=_model(argv), tool_call_parser=_flag_value(argv, "--tool-call-parser"),
            middleware=tuple(_flag_values(argv, "--middleware")),
            structured_outputs_backend=_structured_outputs_backend(argv),
            speculative_decoding=_flag_value(argv, "--speculative-config") is not None,
            tool_strict_level=_flag_value(argv, "--tool-strict-level"),
            trust_request_chat_template=_given(argv, "--trust-request-chat-template"),
            chat_template=_flag_value(argv, "--chat-template"), tokenizer=_flag_value(argv, "--tokenizer"),
            tokenizer_revision=_flag_value(argv, "--tokenizer-revision"),
            revision=_flag_value(argv, "--revision"), tokenizer_mode=_flag_value(argv, "--tokenizer-mode"),
            trust_remote_code=_given(argv, "--trust-remote-code"),
            api_key_given=_given(argv, "--api-key"),
            reasoning_parser=_flag_value(argv, "--reasoning-parser"),
            tool_parser_plugin=_flag_value(argv, "--tool-parser-plugin"),
            reasoning_parser_plugin=_flag_value(argv, "--reasoning-parser-plugin"))

    @property
    def strict_level_parameter(self) -> bool:
        """``--tool-strict-level parameter``: every function tool's arguments pinned as if it were
        ``strict: true`` (the output guard then validates them all)."""
        return (self.tool_strict_level or "").strip().lower() == "parameter"

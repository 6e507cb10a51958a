"""Refuse, at start-up, server configurations that could not enforce an allowlist.

The middleware is built when vLLM builds its app, in every API server process, with no arguments;
the server's own command line (``sys.argv``, which multiprocessing hands to spawned API servers too)
is what tells us the parser and the structured-output backend. A configuration that cannot enforce
the subset fails with a :class:`~vllm_allowed_tools.errors.CapabilityError` naming what is missing
and how to fix it, instead of serving requests whose allowlist would be silently ignored.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..decode.stage import STAGE_NATIVE, choose_stage, requested_stage
from ..errors import CapabilityError
from .plugin import parser_names

#: parser names (comma-separated) the operator vouches for: their own subclasses of our
#: ``AllowedToolsMixin`` wrappers, loaded with ``--tool-parser-plugin``
EXTRA_PARSERS_ENV = "VLLM_ALLOWED_TOOLS_EXTRA_PARSERS"

#: opt-in compatibility fallback for templates that cannot render the policy after the stable
#: prefix: ``filter-catalog`` sends the model only the allowed tools (breaks prompt-cache reuse
#: whenever the subset changes; counted in ``vllm_allowed_tools:fallbacks``)
FALLBACK_ENV = "VLLM_ALLOWED_TOOLS_FALLBACK"
FALLBACK_FILTER = "filter-catalog"
TEMPLATE_KWARG = "allowed_tools_policy"


@dataclass(frozen=True)
class ServerCapabilities:
    template: str | None            # what the template was read from (None: not determinable)
    template_renders_policy: bool | None
    filter_catalog: bool            # the explicit fallback is on and needed
    constraint_stage: str           # who applies the grammar: native or logits-processor


#: backends that cannot compile new-format structural tags (vLLM 0.32/0.33)
BACKENDS_WITHOUT_STRUCTURAL_TAGS = frozenset({"guidance", "outlines", "lm-format-enforcer"})


def _flag_value(argv: Sequence[str], *names: str) -> str | None:
    value = None
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name and index + 1 < len(argv):
                value = argv[index + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def structured_output_backend(argv: Sequence[str]) -> str:
    backend = _flag_value(argv, "--structured-outputs-config.backend")
    if backend is None:
        blob = _flag_value(argv, "--structured-outputs-config", "-sc")
        if blob:
            try:
                backend = json.loads(blob).get("backend")
            except (ValueError, AttributeError):
                backend = None
    return backend or "auto"


def _model_arg(argv: Sequence[str]) -> str | None:
    model = _flag_value(argv, "--model")
    if model is None and "serve" in argv:
        index = list(argv).index("serve") + 1
        if index < len(argv) and not argv[index].startswith("-"):
            model = argv[index]
    return model


def chat_template_source(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """(template text, where it came from): ``--chat-template`` (file or literal), else the local
    model folder's own template; (None, None) when it cannot be read here (e.g. a hub id)."""
    template = _flag_value(argv, "--chat-template")
    if template is not None:
        path = Path(template)
        if path.is_file():
            return path.read_text(encoding="utf-8"), str(path)
        return template, "the --chat-template literal"
    model = _model_arg(argv)
    if model is None or not Path(model).is_dir():
        return None, None
    jinja = Path(model) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config = Path(model) / "tokenizer_config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except ValueError:
            return None, None
        if isinstance(value, list):   # named templates: the default one renders chats
            value = next((t.get("template") for t in value if t.get("name") == "default"), None)
        if isinstance(value, str):
            return value, f"{model}'s tokenizer_config.json chat_template"
    return None, None


def _logits_processor_blocked(argv: Sequence[str], environ: dict[str, str], on_cpu: bool) -> str | None:
    """Why vLLM would not run our logits processor here (None: it would): speculative decoding
    (vLLM drops entry-point processors there) and Model Runner V2 (it takes another interface)."""
    if _flag_value(argv, "--speculative-config", "--speculative_config") is not None:
        return "vLLM does not run logits processors with speculative decoding (--speculative-config)"
    if not on_cpu and environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("0", "false"):
        return ("it runs on vLLM's V1 model runner only, and Model Runner V2 may be chosen on this "
                "device (set VLLM_USE_V2_MODEL_RUNNER=0)")
    return None


def _on_cpu(environ: dict[str, str]) -> bool:
    device = environ.get("VLLM_TARGET_DEVICE", "").strip().lower()
    if device:
        return device == "cpu"
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover - platform detection failed: assume an accelerator
        return False


_ACTIVE_STAGE: str | None = None


def activate(capabilities: "ServerCapabilities") -> None:
    """Record the stage this API server process serves with (the middleware does, at start-up);
    the parser wrappers, built by vLLM without arguments, read it back."""
    global _ACTIVE_STAGE
    _ACTIVE_STAGE = capabilities.constraint_stage
    # under vLLM's own logger, so the line shows with vLLM's start-up messages
    logging.getLogger("vllm.allowed_tools").info(
        "vllm-allowed-tools: allowed-tools grammars are applied by the %s stage", _ACTIVE_STAGE)


def active_constraint_stage() -> str:
    """The stage this API server process chose at start-up (resolved from the command line on
    first use where no middleware was built)."""
    global _ACTIVE_STAGE
    if _ACTIVE_STAGE is None:
        _ACTIVE_STAGE = check_server_args(sys.argv).constraint_stage
    return _ACTIVE_STAGE


def check_server_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> ServerCapabilities:
    """Raise CapabilityError when this server could not enforce allowed_tools (or keep its prompt
    prefix stable, unless the explicit fallback is on); otherwise say what it can do."""
    environ = dict(os.environ if environ is None else environ)
    if "serve" not in argv and not any(a.endswith("api_server") for a in argv):
        # not a server command line (e.g. the middleware built inside a test app)
        return ServerCapabilities(template=None, template_renders_policy=None, filter_catalog=False,
                                  constraint_stage=STAGE_NATIVE)
    parser = _flag_value(argv, "--tool-call-parser")
    vouched = {name.strip() for name in environ.get(EXTRA_PARSERS_ENV, "").split(",") if name.strip()}
    ours = parser_names()
    if parser is not None and parser not in ours and parser not in vouched:
        raise CapabilityError(
            f"--tool-call-parser {parser} cannot enforce allowed_tools: use one of our wrappers "
            f"({', '.join(sorted(ours))}), e.g. --tool-call-parser allowed_{parser} if it exists",
            capability="tool_parser", status=500)
    backend = structured_output_backend(argv)
    on_cpu = _on_cpu(environ)
    stage = choose_stage(requested_stage(environ), backend=backend,
                         backend_compiles_tags=backend not in BACKENDS_WITHOUT_STRUCTURAL_TAGS,
                         on_cpu=on_cpu,
                         logits_processor_blocked=_logits_processor_blocked(argv, environ, on_cpu))
    if environ.get("VLLM_ENFORCE_STRICT_TOOL_CALLING", "1").strip().lower() in ("0", "false"):
        raise CapabilityError(
            "VLLM_ENFORCE_STRICT_TOOL_CALLING=0 turns structural tags off, so allowed_tools could "
            "not be enforced; unset it", capability="structural_tag", status=500)
    source, origin = chat_template_source(argv)
    renders_policy = None if source is None else TEMPLATE_KWARG in source
    fallback = environ.get(FALLBACK_ENV, "").strip()
    if fallback and fallback != FALLBACK_FILTER:
        raise CapabilityError(f"{FALLBACK_ENV}={fallback!r} is not a known fallback; the only one is "
                              f"{FALLBACK_FILTER!r}", capability="config", status=500)
    if renders_policy is False and not fallback:
        raise CapabilityError(
            f"the chat template ({origin}) cannot place the per-turn allowed-tools policy after the "
            f"stable prefix: it never reads the `{TEMPLATE_KWARG}` template variable. Use one of "
            "our templates (--chat-template, see vllm_allowed_tools.templates), add a tail block "
            f"that renders `{TEMPLATE_KWARG}` (mode, names) after the last message, or opt in to "
            f"catalog filtering with {FALLBACK_ENV}={FALLBACK_FILTER} (breaks prompt-cache reuse "
            "when the subset changes)", capability="chat_template", status=500)
    return ServerCapabilities(template=origin, template_renders_policy=renders_policy, constraint_stage=stage,
                              filter_catalog=renders_policy is False and fallback == FALLBACK_FILTER)

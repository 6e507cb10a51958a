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

from ..decode.stage import STAGE_NATIVE, choose_stage, requested_stage
from ..errors import CapabilityError
from .argv import flag_value, is_server_command
from .plugin import parser_names, vouched_parsers


@dataclass(frozen=True)
class ServerCapabilities:
    constraint_stage: str           # who applies the grammar: native or logits-processor


#: backends that cannot compile new-format structural tags (vLLM 0.32/0.33)
BACKENDS_WITHOUT_STRUCTURAL_TAGS = frozenset({"guidance", "outlines", "lm-format-enforcer"})


def structured_output_backend(argv: Sequence[str]) -> str:
    backend = flag_value(argv, "--structured-outputs-config.backend")
    if backend is None:
        blob = flag_value(argv, "--structured-outputs-config", "-sc")
        if blob:
            try:
                backend = json.loads(blob).get("backend")
            except (ValueError, AttributeError):
                backend = None
    return backend or "auto"


def _logits_processor_blocked(argv: Sequence[str], environ: dict[str, str], on_cpu: bool) -> str | None:
    """Why vLLM would not run our logits processor here (None: it would): speculative decoding
    (vLLM drops entry-point processors there) and Model Runner V2 (it takes another interface)."""
    if flag_value(argv, "--speculative-config", "--speculative_config") is not None:
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


def activate(capabilities: ServerCapabilities) -> None:
    """Record the stage this API server process serves with (the middleware does, at start-up);
    the parser wrappers, built by vLLM without arguments, read it back."""
    global _ACTIVE_STAGE
    _ACTIVE_STAGE = capabilities.constraint_stage
    # under vLLM's own logger, so the line shows with vLLM's start-up messages
    logging.getLogger("vllm.allowed_tools").info(
        "vllm-allowed-tools: middleware active for --tool-call-parser %s; allowed-tools grammars are "
        "applied by the %s stage", flag_value(sys.argv, "--tool-call-parser"), _ACTIVE_STAGE)


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
    if not is_server_command(argv):
        # not a server command line (e.g. the middleware built inside a test app)
        return ServerCapabilities(constraint_stage=STAGE_NATIVE)
    parser = flag_value(argv, "--tool-call-parser")
    vouched = vouched_parsers(environ)
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
    return ServerCapabilities(constraint_stage=stage)

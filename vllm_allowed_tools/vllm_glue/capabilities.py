"""Refuse, at start-up, server configurations that could not enforce an allowlist.

The middleware is built when vLLM builds its app, in every API server process, with no arguments;
the server's own command line (:class:`~vllm_allowed_tools.launch.LaunchArgs`, read once from
``sys.argv``, which multiprocessing hands to spawned API servers too) is what tells us the parser
and the structured-output backend. A configuration that cannot enforce
the subset fails with a :class:`~vllm_allowed_tools.errors.CapabilityError` naming what is missing
and how to fix it, instead of serving requests whose allowlist would be silently ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..decode.argument_schemas import hold_lengths_in_grammar
from ..decode.stage import choose_stage
from ..errors import CapabilityError
from ..formats import parser_names
from ..settings import STAGE_AUTO, STAGE_LOGITS_PROCESSOR, STAGE_NATIVE, Settings, current


@dataclass(frozen=True)
class ServerCapabilities:
    constraint_stage: str           # who applies the grammar: native or logits-processor
    #: the backend that still compiles plain JSON-schema grammars natively while structural tags
    #: go to our logits processor (the stage was chosen because it cannot compile tags); else None
    json_schema_backend: str | None = None
    #: a ``strict`` tool's string lengths stay in its grammar whatever the installed xgrammar: the
    #: native stage on the guidance backend compiles nothing ahead (decode/argument_schemas.py)
    lengths_in_grammar: bool = False


#: backends that cannot compile new-format structural tags (vLLM 0.32/0.33); ``guidance`` compiles
#: them through our translation (:mod:`.guidance_tags`) where its hook installs
BACKENDS_WITHOUT_STRUCTURAL_TAGS = frozenset({"outlines", "lm-format-enforcer"})


def backend_compiles_tags(backend: str) -> bool:
    """Whether ``backend`` compiles the structural tags the native stage hands vLLM."""
    if backend == "guidance":
        from .guidance_tags import unsupported_reason
        return unsupported_reason() is None
    return backend not in BACKENDS_WITHOUT_STRUCTURAL_TAGS


def _logits_processor_blocked(settings: Settings, on_cpu: bool) -> str | None:
    """Why vLLM would not run our logits processor here (None: it would): speculative decoding
    (vLLM drops entry-point processors there) and Model Runner V2 (it takes another interface)."""
    if settings.launch.speculative_decoding:
        return "vLLM does not run logits processors with speculative decoding (--speculative-config)"
    if not on_cpu and settings.use_v2_model_runner is not False:
        return ("it runs on vLLM's V1 model runner only, and Model Runner V2 may be chosen on this "
                "device (set VLLM_USE_V2_MODEL_RUNNER=0)")
    return None


def _on_cpu(settings: Settings) -> bool:
    if settings.target_device is not None:
        return settings.target_device == "cpu"
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover - platform detection failed: assume an accelerator
        return False


_ACTIVE: ServerCapabilities | None = None


def activate(capabilities: ServerCapabilities) -> None:
    """Record the stage this API server process serves with (the middleware does, at start-up);
    the parser wrappers, built by vLLM without arguments, read it back."""
    global _ACTIVE
    _ACTIVE = capabilities
    hold_lengths_in_grammar(capabilities.lengths_in_grammar)
    # under vLLM's own logger, so the line shows with vLLM's start-up messages
    logging.getLogger("vllm.allowed_tools").info(
        "vllm-allowed-tools: middleware active for --tool-call-parser %s; allowed-tools grammars are "
        "applied by the %s stage%s", current().launch.tool_call_parser, capabilities.constraint_stage,
        f" (JSON-schema grammars: the {capabilities.json_schema_backend} backend)"
        if capabilities.json_schema_backend else "")


def _active() -> ServerCapabilities:
    """What this API server process chose at start-up (resolved from the command line on first use
    where no middleware was built)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = check_server_args(current())
        hold_lengths_in_grammar(_ACTIVE.lengths_in_grammar)
    return _ACTIVE


def active_constraint_stage() -> str:
    return _active().constraint_stage


def json_schema_backend() -> str | None:
    """The native backend that keeps plain JSON-schema grammars (a required turn of a JSON-array
    format) which it compiles exactly while our logits processor serves structural tags: only where
    the processor was chosen because that backend cannot compile tags (None: every grammar moves;
    :func:`..decode.outlines_schemas.backend_compiles_json_schema` says which schemas stay)."""
    return _active().json_schema_backend


def check_server_args(settings: Settings) -> ServerCapabilities:
    """Raise CapabilityError when this server (its command line and environment, ``settings``)
    could not enforce allowed_tools; otherwise say what it can do."""
    if not settings.launch.is_server:
        # not a server command line (e.g. the middleware built inside a test app)
        return ServerCapabilities(constraint_stage=STAGE_NATIVE)
    check_tool_parser(settings.launch.tool_call_parser, settings)
    return serving_capabilities(settings)


def check_tool_parser(parser: str | None, settings: Settings) -> None:
    """Raise CapabilityError unless ``parser`` is one of our wrappers or one the operator vouches
    for (``settings.extra_parsers``, ``VLLM_ALLOWED_TOOLS_EXTRA_PARSERS``); no parser (None) is
    not refused here."""
    ours = parser_names()
    if parser is not None and parser not in ours and parser not in settings.extra_parsers:
        raise CapabilityError(
            f"--tool-call-parser {parser} cannot enforce allowed_tools: use one of our wrappers "
            f"({', '.join(sorted(ours))}), e.g. --tool-call-parser allowed_{parser} if it exists",
            capability="tool_parser", status=500)


def serving_capabilities(settings: Settings) -> ServerCapabilities:
    """The constraint stage this server's command line and environment (``settings``) get
    (backend, device, constraint switch, strict tool calling); raises CapabilityError where none
    could enforce the allowlist."""
    backend = settings.launch.structured_outputs_backend
    on_cpu = _on_cpu(settings)
    requested = settings.constraint
    compiles_tags = backend_compiles_tags(backend)
    stage = choose_stage(requested, backend=backend, backend_compiles_tags=compiles_tags,
                         on_cpu=on_cpu,
                         logits_processor_blocked=_logits_processor_blocked(settings, on_cpu))
    if not settings.enforce_strict_tool_calling:
        raise CapabilityError(
            "VLLM_ENFORCE_STRICT_TOOL_CALLING other than true or 1 turns vLLM's structural tags off, "
            "so allowed_tools could not be enforced; unset it", capability="structural_tag",
            status=500)
    # the operator forcing the processor keeps every grammar there; a backend that only lacks
    # structural tags still compiles JSON schemas it supports
    stands_in = stage == STAGE_LOGITS_PROCESSOR and requested == STAGE_AUTO and not compiles_tags
    return ServerCapabilities(constraint_stage=stage,
                              json_schema_backend=backend if stands_in else None,
                              lengths_in_grammar=stage == STAGE_NATIVE and backend == "guidance")

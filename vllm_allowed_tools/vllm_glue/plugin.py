"""vLLM general-plugin entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
several times per process, so it must be idempotent and cheap: it only records lazy parser
registrations; nothing heavy is imported until a server actually selects one of our parsers.

It also makes ``--tool-call-parser allowed_<base>`` the whole launch: vLLM loads general plugins
while it builds its command-line parser, before it parses ``sys.argv``, so a server command that
selects one of our parsers gets ``--middleware`` for our middleware added there (once; an explicit
``--middleware`` naming it is left alone).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..formats import parser_names, wire_formats
from ..launch import LaunchArgs
from ..settings import Settings, current, replace_server_command

logger = logging.getLogger(__name__)

PARSERS_MODULE = "vllm_allowed_tools.vllm_glue.parsers"
MIDDLEWARE = "vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware"


#: the parser classes ``parsers.py`` makes (``AllowedToolsMixin`` over vLLM's parser of the format),
#: by the parser name vLLM is told: built on first use behind that module's ``__getattr__``, so
#: they are named here, where grep finds them (a test keeps this equal to the format registry)
PARSER_CLASSES = {
    "allowed_deepseek_v3": "AllowedDeepseekV3ToolParser",
    "allowed_deepseek_v31": "AllowedDeepseekV31ToolParser",
    "allowed_glm45": "AllowedGlm45ToolParser",
    "allowed_glm47": "AllowedGlm47ToolParser",
    "allowed_granite": "AllowedGraniteToolParser",
    "allowed_granite4": "AllowedGranite4ToolParser",
    "allowed_hermes": "AllowedHermesToolParser",
    "allowed_kimi_k2": "AllowedKimiK2ToolParser",
    "allowed_llama3_json": "AllowedLlama3JsonToolParser",
    "allowed_llama4_json": "AllowedLlama4JsonToolParser",
    "allowed_llama4_pythonic": "AllowedLlama4PythonicToolParser",
    "allowed_longcat": "AllowedLongcatToolParser",
    "allowed_minimax_m2": "AllowedMinimaxM2ToolParser",
    "allowed_mistral": "AllowedMistralToolParser",
    "allowed_openai": "AllowedOpenaiToolParser",
    "allowed_phi4_mini_json": "AllowedPhi4MiniJsonToolParser",
    "allowed_pythonic": "AllowedPythonicToolParser",
    "allowed_qwen3_coder": "AllowedQwen3CoderToolParser",
    "allowed_qwen3_xml": "AllowedQwen3XmlToolParser",
    "allowed_seed_oss": "AllowedSeedOssToolParser",
    "allowed_xlam": "AllowedXlamToolParser",
}


def with_our_middleware(argv: Sequence[str], settings: Settings) -> list[str]:
    """``argv`` plus ``--middleware`` for ours when it is a server command that selects one of our
    parsers (or one ``settings.extra_parsers`` vouches for) and does not name our middleware."""
    argv = list(argv)
    launch = LaunchArgs.from_argv(argv)
    parser = launch.tool_call_parser
    if not launch.is_server or parser is None or MIDDLEWARE in launch.middleware:
        return argv
    if parser not in parser_names() and parser not in settings.extra_parsers:
        return argv
    return [*argv, "--middleware", MIDDLEWARE]


def register_tag_builder() -> None:
    """Lend :mod:`vllm_allowed_tools.decode` vLLM's own structural-tag builders (the ``vllm``
    grammars), imported on first use so that loading the plugin stays cheap."""
    from ..decode.vllm_builder import register_vllm_tag_builder
    register_vllm_tag_builder(_vllm_structural_tag)


def _vllm_structural_tag(*args: Any) -> Any:
    from .vllm_tags import vllm_structural_tag
    return vllm_structural_tag(*args)


def register_parsers() -> list[str]:
    """Register an ``allowed_<base>`` tool parser per wire format with vLLM, lazily (the class is
    built when vLLM first asks for it), and vLLM's tag builders with ours; returns the parser names
    added (formats registered since the last call). Touches nothing else: ``vllm-allowed-tools
    check`` registers them this way too."""
    register_tag_builder()
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # pragma: no cover - vLLM too old or absent
        logger.warning("vllm-allowed-tools: vllm.tool_parsers not importable; parsers not registered")
        return []
    added = []
    for entry in wire_formats():
        name = entry.parser_name
        if name not in ToolParserManager.lazy_parsers and name not in ToolParserManager.tool_parsers:
            ToolParserManager.register_lazy_module(name, PARSERS_MODULE, PARSER_CLASSES[name])
            added.append(name)
    if added:
        logger.debug("vllm-allowed-tools: registered parsers %s", ", ".join(added))
    return added


def register() -> None:
    """vLLM's plugin hook: parses the settings first (a variable with a value the plugin cannot use
    stops every vLLM process here, with the message naming it), then :func:`register_parsers`, then
    our middleware added to a server command line that selects one of our parsers
    (:func:`with_our_middleware`), after the check that stops a server it could not serve
    (:func:`refuse_what_cannot_be_served`); on a server started with the ``guidance``
    structured-output backend, the hook that lets that backend compile structural tags
    (:mod:`.guidance_tags`)."""
    settings = current()
    register_parsers()
    if settings.launch.is_server and settings.launch.structured_outputs_backend == "guidance":
        from .guidance_tags import install
        if not install():   # the capability check says why and refuses the native stage
            logger.warning("vllm-allowed-tools: vLLM's guidance backend was not hooked")
    argv = with_our_middleware(settings.launch.argv, settings)
    if argv != list(settings.launch.argv) or MIDDLEWARE in settings.launch.middleware:
        refuse_what_cannot_be_served(settings)
    if argv != list(settings.launch.argv):
        # read by vLLM's parse_args() after the plugins are loaded (vLLM's logging is not set up
        # yet here: the middleware says it is active when it is built)
        replace_server_command(argv)


def refuse_what_cannot_be_served(settings: Settings) -> None:
    """Stop a server command our middleware would refuse (:func:`.capabilities.check_server_args`)
    before vLLM starts its engine: the same refusal the middleware gives when vLLM builds it, in
    seconds instead of after the model loads."""
    from ..errors import CapabilityError
    from .capabilities import check_server_args
    try:
        check_server_args(settings)
    except CapabilityError as refused:
        raise SystemExit(f"vllm-allowed-tools: the server cannot start: {refused}") from None

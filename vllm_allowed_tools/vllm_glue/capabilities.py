"""Refuse, at start-up, server configurations that could not enforce an allowlist.

The middleware is built when vLLM builds its app, in every API server process, with no arguments;
the server's own command line (``sys.argv``, which multiprocessing hands to spawned API servers too)
is what tells us the parser and the structured-output backend. A configuration that cannot enforce
the subset fails with a :class:`~vllm_allowed_tools.errors.CapabilityError` naming what is missing
and how to fix it, instead of serving requests whose allowlist would be silently ignored.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from ..errors import CapabilityError
from .plugin import PARSERS

#: parser names (comma-separated) the operator vouches for: their own subclasses of our
#: ``AllowedToolsMixin`` wrappers, loaded with ``--tool-parser-plugin``
EXTRA_PARSERS_ENV = "VLLM_ALLOWED_TOOLS_EXTRA_PARSERS"

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


def check_server_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> None:
    """Raise CapabilityError when this server could not enforce allowed_tools."""
    environ = dict(os.environ if environ is None else environ)
    if "serve" not in argv and not any(a.endswith("api_server") for a in argv):
        return   # not a server command line (e.g. the middleware built inside a test app)
    parser = _flag_value(argv, "--tool-call-parser")
    vouched = {name.strip() for name in environ.get(EXTRA_PARSERS_ENV, "").split(",") if name.strip()}
    if parser is not None and parser not in PARSERS and parser not in vouched:
        raise CapabilityError(
            f"--tool-call-parser {parser} cannot enforce allowed_tools: use one of our wrappers "
            f"({', '.join(sorted(PARSERS))}), e.g. --tool-call-parser allowed_{parser} if it exists",
            capability="tool_parser", status=500)
    backend = structured_output_backend(argv)
    if backend in BACKENDS_WITHOUT_STRUCTURAL_TAGS:
        raise CapabilityError(
            f"the {backend!r} structured-output backend cannot compile the structural tags that "
            "constrain decoding to the allowed tools; start vLLM with "
            "--structured-outputs-config.backend xgrammar (or auto)",
            capability="structured_output_backend", status=500)
    if environ.get("VLLM_ENFORCE_STRICT_TOOL_CALLING", "1").strip().lower() in ("0", "false"):
        raise CapabilityError(
            "VLLM_ENFORCE_STRICT_TOOL_CALLING=0 turns structural tags off, so allowed_tools could "
            "not be enforced; unset it", capability="structural_tag", status=500)

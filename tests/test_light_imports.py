"""The request path and the ASGI middleware load without torch or xgrammar: they run in the API
server's front end for every request, and a slow import is a slow server start and a slow test."""

from __future__ import annotations

import subprocess
import sys

LIGHT_MODULES = ("vllm_allowed_tools.request", "vllm_allowed_tools.request.rewrite",
                 "vllm_allowed_tools.response", "vllm_allowed_tools.approvals", "vllm_allowed_tools.settings",
                 "vllm_allowed_tools.asgi.guarding_middleware", "vllm_allowed_tools.vllm_glue.middleware")


def test_request_path_imports_no_torch_or_xgrammar() -> None:
    script = (f"import sys, {', '.join(LIGHT_MODULES)}\n"
              "heavy = sorted(m for m in ('torch', 'xgrammar') if m in sys.modules)\n"
              "assert not heavy, f'imported {heavy}'\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr

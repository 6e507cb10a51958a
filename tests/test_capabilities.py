"""Configurations that could not enforce an allowlist are refused, naming what is missing."""

from __future__ import annotations

import pytest

from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.vllm_glue.capabilities import check_server_args, structured_output_backend

BASE = ["vllm", "serve", "m", "--tool-call-parser", "allowed_hermes"]


def test_good_configuration_passes():
    check_server_args(BASE + ["--structured-outputs-config.backend", "xgrammar"], environ={})
    check_server_args(BASE, environ={})                          # backend auto tries xgrammar first
    check_server_args(["python", "-m", "pytest"], environ={})    # not a server: nothing to check


@pytest.mark.parametrize("backend", ["guidance", "outlines", "lm-format-enforcer"])
def test_backends_without_structural_tags_are_refused(backend):
    for argv in (BASE + ["--structured-outputs-config.backend", backend],
                 BASE + [f"--structured-outputs-config.backend={backend}"],
                 BASE + ["--structured-outputs-config", '{"backend": "%s"}' % backend]):
        assert structured_output_backend(argv) == backend
        with pytest.raises(CapabilityError, match=backend) as error:
            check_server_args(argv, environ={})
        assert "xgrammar" in str(error.value) and error.value.status == 500


def test_last_backend_flag_wins():
    argv = BASE + ["--structured-outputs-config.backend", "xgrammar",
                   "--structured-outputs-config.backend", "guidance"]
    with pytest.raises(CapabilityError):
        check_server_args(argv, environ={})


def test_base_parser_with_the_middleware_is_refused():
    with pytest.raises(CapabilityError, match="allowed_hermes"):
        check_server_args(["vllm", "serve", "m", "--tool-call-parser", "hermes"], environ={})


def test_strict_tool_calling_switched_off_is_refused():
    with pytest.raises(CapabilityError, match="VLLM_ENFORCE_STRICT_TOOL_CALLING"):
        check_server_args(BASE, environ={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"})


@pytest.mark.server
def test_real_server_refuses_to_start_with_guidance(tmp_path):
    from vllm_allowed_tools.serve import ServeError, start_server
    from vllm_allowed_tools.testing.tiny_model import ensure_model
    model = ensure_model("random", 0, log=lambda *_: None)
    with pytest.raises(ServeError) as error:
        start_server(model, extra_args=["--structured-outputs-config.backend", "guidance"],
                     log_path=tmp_path / "server.log", timeout=240)
    assert "structured-output backend cannot compile" in str(error.value)

"""Configurations that could not enforce an allowlist are refused, naming what is missing."""

from __future__ import annotations

import pytest

from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.vllm_glue.capabilities import (ServerCapabilities, check_server_args,
                                                       structured_output_backend)

BASE = ["vllm", "serve", "m", "--tool-call-parser", "allowed_hermes"]
NATIVE = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}


def test_good_configuration_passes():
    """xgrammar, or ``auto`` (which tries xgrammar first), with our parser: accepted, served by the
    stage ``auto`` picks for the device; the template of a hub id is not guessed, nothing is
    filtered. A command line that is not a server's is accepted with nothing checked."""
    assert structured_output_backend(BASE) == "auto"
    for argv in (BASE + ["--structured-outputs-config.backend", "xgrammar"], BASE):
        for environ, stage in (({"VLLM_TARGET_DEVICE": "cpu"}, "logits-processor"),
                               (GPU, "native"), ({**GPU, **NATIVE}, "native")):
            assert check_server_args(argv, environ=environ) == ServerCapabilities(
                template=None, template_renders_policy=None, filter_catalog=False,
                constraint_stage=stage), (argv, environ)
        caps = check_server_args(argv, environ={})   # the device as vLLM detects it here
        assert caps.constraint_stage in ("native", "logits-processor") and not caps.filter_catalog
    not_a_server = ["python", "-m", "pytest", "--tool-call-parser", "hermes"]
    assert check_server_args(not_a_server, environ={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}) \
        == ServerCapabilities(template=None, template_renders_policy=None, filter_catalog=False,
                              constraint_stage="native")


@pytest.mark.parametrize("backend", ["guidance", "outlines", "lm-format-enforcer"])
def test_backends_without_structural_tags_are_refused(backend):
    for argv in (BASE + ["--structured-outputs-config.backend", backend],
                 BASE + [f"--structured-outputs-config.backend={backend}"],
                 BASE + ["--structured-outputs-config", '{"backend": "%s"}' % backend]):
        assert structured_output_backend(argv) == backend
        with pytest.raises(CapabilityError, match=backend) as error:
            check_server_args(argv, environ=NATIVE)
        assert "xgrammar" in str(error.value) and error.value.status == 500


def test_last_backend_flag_wins():
    argv = BASE + ["--structured-outputs-config.backend", "xgrammar",
                   "--structured-outputs-config.backend", "guidance"]
    with pytest.raises(CapabilityError):
        check_server_args(argv, environ=NATIVE)


LP = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor", "VLLM_TARGET_DEVICE": "cpu"}


GPU = {"VLLM_TARGET_DEVICE": "cuda"}   # what the stage choice reads first (no accelerator needed)


def test_logits_processor_stage_serves_other_backends():
    """The logits processor is what makes a non-xgrammar backend usable: the grammar never reaches
    it. ``auto`` (the default) picks it there by itself."""
    guidance = BASE + ["--structured-outputs-config.backend", "guidance"]
    assert check_server_args(guidance, environ=LP).constraint_stage == "logits-processor"
    assert check_server_args(guidance, environ={**GPU, "VLLM_USE_V2_MODEL_RUNNER": "0"}) \
        .constraint_stage == "logits-processor"
    with pytest.raises(CapabilityError, match="guidance.*speculative decoding"):
        check_server_args(guidance + ["--speculative-config", "{}"], environ=GPU)


def test_auto_stage_follows_the_benchmark():
    """``auto``: the logits processor on CPU (measured faster there), vLLM's native path on
    accelerators (not measured) and wherever the processor cannot run."""
    assert check_server_args(BASE, environ={"VLLM_TARGET_DEVICE": "cpu"}).constraint_stage == "logits-processor"
    assert check_server_args(BASE, environ=GPU).constraint_stage == "native"
    assert check_server_args(BASE + ["--speculative-config", "{}"],
                             environ={"VLLM_TARGET_DEVICE": "cpu"}).constraint_stage == "native"
    assert check_server_args(BASE, environ={"VLLM_TARGET_DEVICE": "cpu", **NATIVE}).constraint_stage == "native"


def test_logits_processor_stage_refuses_speculative_decoding():
    argv = BASE + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    check_server_args(argv, environ={})      # the native path supports it
    with pytest.raises(CapabilityError, match="speculative decoding") as error:
        check_server_args(argv, environ=LP)
    assert error.value.capability == "constraint_stage"


def test_logits_processor_stage_needs_the_v1_runner_off_cpu():
    gpu = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor", **GPU}
    with pytest.raises(CapabilityError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_server_args(BASE, environ=gpu)
    check_server_args(BASE, environ={**gpu, "VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_unknown_constraint_stage_is_refused():
    with pytest.raises(CapabilityError, match="VLLM_ALLOWED_TOOLS_CONSTRAINT"):
        check_server_args(BASE, environ={"VLLM_ALLOWED_TOOLS_CONSTRAINT": "both"})


def test_base_parser_with_the_middleware_is_refused():
    with pytest.raises(CapabilityError, match="allowed_hermes"):
        check_server_args(["vllm", "serve", "m", "--tool-call-parser", "hermes"], environ={})


def test_every_registered_wire_format_has_an_accepted_parser():
    from vllm_allowed_tools.formats import wire_formats
    for entry in wire_formats():
        check_server_args(["vllm", "serve", "m", "--tool-call-parser", entry.parser_name], environ={})
    with pytest.raises(CapabilityError, match="allowed_longcat"):
        check_server_args(["vllm", "serve", "m", "--tool-call-parser", "longcat"], environ={})


def test_strict_tool_calling_switched_off_is_refused():
    with pytest.raises(CapabilityError, match="VLLM_ENFORCE_STRICT_TOOL_CALLING"):
        check_server_args(BASE, environ={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"})


@pytest.mark.server
def test_real_server_refuses_to_start_with_guidance(tmp_path):
    from vllm_allowed_tools.testing.server import ServeError, start_server
    from vllm_allowed_tools.testing.tiny_model import ensure_model
    model = ensure_model("random", 0, log=lambda *_: None)
    with pytest.raises(ServeError) as error:
        start_server(model, extra_args=["--structured-outputs-config.backend", "guidance"],
                     log_path=tmp_path / "server.log", timeout=240, env=NATIVE)
    assert "structured-output backend cannot compile" in str(error.value)


# ------------------------------------------------------------------ templates and the fallback

PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_our_templates_render_the_policy(tmp_path):
    from vllm_allowed_tools.templates import template_path
    caps = check_server_args(BASE + ["--chat-template", str(template_path("hermes"))], environ={})
    assert caps.template_renders_policy is True and not caps.filter_catalog


def test_a_template_without_the_policy_block_is_refused_naming_it(tmp_path):
    template = tmp_path / "theirs.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with pytest.raises(CapabilityError, match="theirs.jinja") as error:
        check_server_args(BASE + ["--chat-template", str(template)], environ={})
    assert "allowed_tools_policy" in str(error.value) and "filter-catalog" in str(error.value)


def test_the_model_folders_own_template_is_checked(tmp_path):
    import json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN_TEMPLATE}))
    argv = ["vllm", "serve", str(tmp_path), "--tool-call-parser", "allowed_hermes"]
    with pytest.raises(CapabilityError, match="tokenizer_config.json"):
        check_server_args(argv, environ={})


def test_explicit_fallback_turns_on_catalog_filtering(tmp_path):
    template = tmp_path / "theirs.jinja"
    template.write_text(PLAIN_TEMPLATE)
    argv = BASE + ["--chat-template", str(template)]
    caps = check_server_args(argv, environ={"VLLM_ALLOWED_TOOLS_FALLBACK": "filter-catalog"})
    assert caps.filter_catalog and caps.template_renders_policy is False
    with pytest.raises(CapabilityError, match="not a known fallback"):
        check_server_args(argv, environ={"VLLM_ALLOWED_TOOLS_FALLBACK": "yes"})


def test_unreadable_template_is_not_guessed():
    caps = check_server_args(["vllm", "serve", "org/hub-model", "--tool-call-parser",
                              "allowed_hermes"], environ={})
    assert caps.template_renders_policy is None and not caps.filter_catalog


def test_filter_catalog_keeps_only_the_allowed_functions():
    from vllm_allowed_tools.request import resolve_allowlist
    from vllm_allowed_tools.request.rewrite import filter_catalog
    body = {"tools": [{"type": "function", "name": "a", "parameters": {}},
                      {"type": "function", "name": "b", "parameters": {}},
                      {"type": "web_search"},
                      {"type": "namespace", "name": "crm", "tools": [
                          {"type": "function", "name": "c", "parameters": {}},
                          {"type": "function", "name": "d", "parameters": {}}]}],
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": "b"},
                                      {"type": "function", "name": "crm__d"}]}}
    filtered = filter_catalog(body, resolve_allowlist(body, "responses"))
    assert [t.get("name") for t in filtered["tools"]] == ["b", None, "crm"]
    assert [m["name"] for m in filtered["tools"][2]["tools"]] == ["d"]
    assert len(body["tools"]) == 4   # the request itself is not modified

"""``vllm-allowed-tools check``: its verdicts are the server's start-up decisions.

Each check runs in-process (``check.main``, the console script's own function, with ``--json``) and
is compared with what the start-up functions decide on the very command line the check built
(``check_server_args``, ``choose_placement``) and with the recorded outcomes of the template
corpus. The formats share one tokenizer: the random tiny model holding every registered format's
markers (``devtools/models/format_model.py``), so each format is checked with its bundled template in a
fraction of a second. gpt-oss (harmony, its own 201k-token vocabulary) has a test of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_allowed_tools.devtools import check
from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.formats import wire_formats
from vllm_allowed_tools.settings import Settings, reset_for_tests
from vllm_allowed_tools.templates import template_path
from vllm_allowed_tools.vllm_glue.capabilities import check_server_args
from vllm_allowed_tools.vllm_glue.served_template import choose_placement

from support.template_corpus import CORPUS, PLACEMENT, REFUSED, REFUSED_BECAUSE, TEMPLATES, USER_TURN

#: every plugin switch the check reads from the environment: unset, so each test sets its own
PLUGIN_ENV = ("VLLM_ALLOWED_TOOLS_CONSTRAINT", "VLLM_ALLOWED_TOOLS_PLACEMENT",
              "VLLM_ALLOWED_TOOLS_FALLBACK", "VLLM_ALLOWED_TOOLS_PLAIN_DECODING",
              "VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", "VLLM_ALLOWED_TOOLS_APPROVAL_POLICY",
              "VLLM_ALLOWED_TOOLS_EXTRA_PARSERS", "VLLM_ENFORCE_STRICT_TOOL_CALLING",
              "VLLM_USE_V2_MODEL_RUNNER")
TEMPLATED = [entry for entry in wire_formats() if entry.template is not None]
#: renders user messages only: no placement gets the policy after the history
USERS_ONLY_TEMPLATE = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"


@pytest.fixture(autouse=True)
def server_environment(monkeypatch):
    """The environment of a CPU server with no plugin switch set (the check reads it as is)."""
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="module")
def every_marker_model() -> Path:
    """The random tiny model with every registered format's markers as single tokens."""
    from vllm_allowed_tools.devtools.models.format_model import ensure_format_model
    markers = tuple(dict.fromkeys(token for entry in wire_formats() for token in entry.special_tokens))
    return ensure_format_model("random", 0, markers, log=lambda *_: None)


@pytest.fixture(scope="module")
def random_model() -> Path:
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return ensure_model("random", 0, log=lambda *_: None)


def run(capsys, *argv: str) -> tuple[int, dict]:
    """The check's exit code and its JSON report (or error object)."""
    capsys.readouterr()
    code = check.main(["--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def verdicts(report: dict) -> dict[str, str]:
    return {finding["guarantee"]: finding["verdict"] for finding in report["findings"]}


def finding(report: dict, guarantee: str) -> dict:
    return next(item for item in report["findings"] if item["guarantee"] == guarantee)


def server_settings(command: list[str]) -> Settings:
    """The settings a server started with this command line in this environment parses."""
    return Settings.from_environ(os.environ, command)


def startup_decisions(command: list[str]) -> tuple[str, str | None]:
    """(the constraint stage, the placement or None for a refusal): what the server's start-up
    functions decide on the same command line."""
    stage = check_server_args(server_settings(command)).constraint_stage
    try:
        return stage, choose_placement(server_settings(command)).placement
    except CapabilityError:
        return stage, None


# ------------------------------------------------------------------ bundled templates, per format

@pytest.mark.parametrize("entry", TEMPLATED, ids=[entry.name for entry in TEMPLATED])
def test_every_format_starts_with_its_bundled_template(capsys, every_marker_model, entry) -> None:
    code, report = run(capsys, str(every_marker_model), "--tool-call-parser", entry.parser_name,
                       "--chat-template", str(template_path(entry.template)))
    limits = "ok" if entry.grammar.holds_auto else "warn"
    assert code == 0, report
    assert verdicts(report) == {"tool_parser": "ok", "reasoning_parser": "ok", "tokenizer_mode": "ok",
                                "constraint_stage": "ok", "placement": "ok", "format_limits": limits,
                                "grammar": "ok", "configuration": "ok"}
    stage, placement = startup_decisions(report["command"])
    assert finding(report, "constraint_stage")["details"]["stage"] == stage == "logits-processor"
    assert finding(report, "placement")["details"]["placement"] == placement == "template-variable"
    modes = ["required", "auto"] if entry.grammar.holds_auto else ["required"]
    assert finding(report, "grammar")["details"]["modes"] == modes


def test_gpt_oss_is_checked_on_its_harmony_prompts(capsys) -> None:
    """No chat template: the probe renders harmony, and the grammar compiles for o200k_harmony."""
    from vllm_allowed_tools.devtools.models.gpt_oss_model import VOCAB_SIZE, ensure_gpt_oss_tokenizer
    folder = ensure_gpt_oss_tokenizer(log=lambda *_: None)   # a tokenizer and config.json only
    code, report = run(capsys, str(folder), "--tool-call-parser", "allowed_openai")
    assert code == 0 and set(verdicts(report).values()) == {"ok"}, report
    assert startup_decisions(report["command"])[1] == "system-message"
    assert "harmony" in finding(report, "placement")["details"]["origin"]
    assert finding(report, "grammar")["details"]["vocab_size"] == VOCAB_SIZE


# ------------------------------------------------------------------ the real-template corpus

@pytest.mark.parametrize("name", TEMPLATES)
def test_corpus_templates_get_the_servers_placement_or_its_refusal(capsys, random_model, name) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--chat-template", str(CORPUS / f"{name}.jinja"))
    placement = finding(report, "placement")
    assert startup_decisions(report["command"])[1] == PLACEMENT.get(name)
    if name in PLACEMENT:
        # a template that moves part of the history at a new user turn starts, with a warning
        verdict = "warn" if name in USER_TURN else "ok"
        assert (code, placement["verdict"], placement["details"]["placement"]) == (0, verdict, PLACEMENT[name])
        if name in USER_TURN:
            assert "but not across user turns" in placement["reason"] and USER_TURN[name] in placement["reason"]
    else:
        assert (code, placement["verdict"]) == (1, "refused")
        assert all(f"{where}: " in placement["reason"] and why in placement["reason"]
                   for where, why in REFUSED[name].items()), placement["reason"]
        assert REFUSED_BECAUSE.get(name, "") in placement["reason"]


# ------------------------------------------------------------------ refusals: exit 1 with the reason

def test_a_parser_vllm_does_not_know_is_refused(capsys, random_model) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "no_such_parser")
    assert code == 1 and not report["starts"]
    reason = finding(report, "tool_parser")["reason"]
    assert "invalid tool call parser: no_such_parser" in reason and "allowed_hermes" in reason
    assert verdicts(report)["format_limits"] == verdicts(report)["grammar"] == "skipped"


def test_a_base_parser_is_refused_naming_our_wrapper(capsys, random_model) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "hermes")
    assert code == 1
    assert "--tool-call-parser allowed_hermes" in finding(report, "tool_parser")["reason"]
    with pytest.raises(CapabilityError, match="allowed_hermes"):
        check_server_args(server_settings([*report["command"], "--middleware", "x"]))


@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_a_backend_without_structural_tags_is_refused_on_the_native_stage(capsys, monkeypatch,
                                                                          random_model, backend) -> None:
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_CONSTRAINT", "native")
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--structured-outputs-config.backend", backend)
    assert code == 1
    stage = finding(report, "constraint_stage")
    assert stage["verdict"] == "refused" and f"the {backend!r} structured-output backend" in stage["reason"]
    with pytest.raises(CapabilityError) as error:
        check_server_args(server_settings(report["command"]))
    assert str(error.value) == stage["reason"]


def test_the_stage_follows_the_backend_and_the_device(capsys, monkeypatch, random_model) -> None:
    """Where a backend lacks structural tags the processor stands in; on a GPU host auto is native."""
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--structured-outputs-config.backend", "outlines")
    details = finding(report, "constraint_stage")["details"]
    assert code == 0
    assert (details["stage"], details["json_schema_backend"]) == ("logits-processor", "outlines")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes")
    assert code == 0 and finding(report, "constraint_stage")["details"]["stage"] == \
        check_server_args(server_settings(report["command"])).constraint_stage == "native"
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes", "--",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert code == 0 and "--speculative-config" in report["command"]


def test_a_backend_vllm_does_not_know_is_refused(capsys, random_model) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--structured-outputs-config.backend", "fastest")
    assert code == 1
    reason = finding(report, "constraint_stage")["reason"]
    assert "vLLM refuses --structured-outputs-config.backend fastest" in reason


def test_a_template_the_probe_rejects_is_refused_unless_the_fallback_is_on(capsys, monkeypatch,
                                                                          random_model, tmp_path) -> None:
    template = tmp_path / "users_only.jinja"
    template.write_text(USERS_ONLY_TEMPLATE)
    argv = [str(random_model), "--tool-call-parser", "allowed_hermes", "--chat-template", str(template)]
    code, report = run(capsys, *argv)
    reason = finding(report, "placement")["reason"]
    assert code == 1 and "users_only.jinja" in reason and "filter-catalog" in reason
    assert "(it renders only the user messages)" in reason   # what in the template prevents it
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_FALLBACK", "filter-catalog")
    code, report = run(capsys, *argv)
    placement = finding(report, "placement")
    assert code == 0 and placement["verdict"] == "warn" and "prompt-cache reuse breaks" in placement["reason"]
    assert startup_decisions(report["command"])[1] == "filter-catalog"


def test_mistral_tokenizer_mode_and_an_unknown_reasoning_parser_are_refused(capsys, random_model) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--tokenizer-mode", "mistral", "--reasoning-parser", "no_such_reasoner")
    assert code == 1
    assert "mistral-common" in finding(report, "tokenizer_mode")["reason"]
    assert verdicts(report)["placement"] == "skipped"
    assert "invalid reasoning parser: no_such_reasoner" in finding(report, "reasoning_parser")["reason"]
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--tokenizer-mode", "no_such_mode", "--reasoning-parser", "qwen3")
    assert code == 1 and "no tokenizer registered" in finding(report, "tokenizer_mode")["reason"]
    assert verdicts(report)["reasoning_parser"] == "ok"


def test_plugin_switches_read_at_start_up_are_checked(capsys, monkeypatch, random_model, tmp_path) -> None:
    argv = [str(random_model), "--tool-call-parser", "allowed_hermes"]
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_PLAIN_DECODING", "loose")
    code, report = run(capsys, *argv)
    assert code == 1 and "VLLM_ALLOWED_TOOLS_PLAIN_DECODING" in finding(report, "configuration")["reason"]
    monkeypatch.delenv("VLLM_ALLOWED_TOOLS_PLAIN_DECODING")
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY", str(tmp_path / "missing.toml"))
    code, report = run(capsys, *argv)
    assert code == 1 and "missing.toml" in finding(report, "configuration")["reason"]
    monkeypatch.delenv("VLLM_ALLOWED_TOOLS_APPROVAL_POLICY")
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", "lots")   # parsed at start-up too
    code, report = run(capsys, *argv)
    configuration = finding(report, "configuration")
    assert code == 1 and "VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE='lots'" in configuration["reason"]
    assert configuration["details"]["variables"] == ["VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE"]
    assert verdicts(report)["grammar"] == "ok"   # the rest is checked as without the bad value
    monkeypatch.delenv("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE")
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    code, report = run(capsys, *argv)
    assert code == 1 and "VLLM_ENFORCE_STRICT_TOOL_CALLING" in finding(report, "constraint_stage")["reason"]


def test_the_text_report_says_what_refuses(capsys, random_model) -> None:
    capsys.readouterr()
    code = check.main([str(random_model), "--tool-call-parser", "hermes"])
    out = capsys.readouterr().out
    assert code == 1
    assert "REFUSED  tool parser" in out and "result: the server would refuse to start" in out


#: configurations the middleware decides at start-up: (the check's flags, the environment)
MIDDLEWARE_CASES = {
    "starts": ([], {}),
    "base parser": (["--tool-call-parser", "hermes"], {}),
    "guidance, native stage": (["--structured-outputs-config.backend", "guidance"],
                               {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}),
    "outlines, native stage": (["--structured-outputs-config.backend", "outlines"],
                               {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}),
    "outlines, processor stands in": (["--structured-outputs-config.backend", "outlines"], {}),
    "template the probe rejects": (["--chat-template", "{users_only}"], {}),
    "the same, catalog filtering": (["--chat-template", "{users_only}"],
                                    {"VLLM_ALLOWED_TOOLS_FALLBACK": "filter-catalog"}),
    "mistral tokenizer mode": (["--tokenizer-mode", "mistral"], {}),
    "unknown plain decoding": ([], {"VLLM_ALLOWED_TOOLS_PLAIN_DECODING": "loose"}),
    "bad whitespace cap": ([], {"VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE": "lots"}),
    "missing approval policy": ([], {"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": "{tmp}/missing.toml"}),
    "strict tool calling off": ([], {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}),
}


@pytest.mark.parametrize("case", sorted(MIDDLEWARE_CASES))
def test_the_check_refuses_exactly_what_the_middleware_refuses_at_start_up(capsys, monkeypatch, tmp_path,
                                                                          random_model, case) -> None:
    """The drift guard: the middleware built as vLLM builds it (no arguments, the server's
    ``sys.argv``) on the command line the check decided for fails exactly where the check says
    the server refuses."""
    import importlib

    from vllm_allowed_tools.vllm_glue import capabilities
    from vllm_allowed_tools.vllm_glue.plugin import MIDDLEWARE
    (tmp_path / "users_only.jinja").write_text(USERS_ONLY_TEMPLATE)
    flags, environ = MIDDLEWARE_CASES[case]
    for name, value in environ.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    flags = [flag.format(users_only=tmp_path / "users_only.jinja") for flag in flags]
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes", *flags)
    module, name = MIDDLEWARE.rsplit(".", 1)
    monkeypatch.setattr(sys, "argv", report["command"])
    reset_for_tests()   # the middleware parses this process's settings: the server's command line
    monkeypatch.setattr(capabilities, "_ACTIVE", None)   # what building the middleware records
    try:
        getattr(importlib.import_module(module), name)(lambda *_: None)
        refused = None
    except Exception as exc:  # noqa: BLE001 - CapabilityError, PolicyFileError: what stops a server
        refused = exc
    assert code == (1 if refused else 0), (report, refused)
    if refused is not None:
        reasons = [f["reason"] for f in report["findings"] if f["verdict"] == "refused"]
        assert any(str(refused) in reason for reason in reasons), (reasons, refused)


# ------------------------------------------------------------------ warnings: the server starts

def test_a_tokenizer_without_the_formats_markers_starts_with_a_warning(capsys, random_model) -> None:
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_kimi_k2",
                       "--chat-template", str(template_path("kimi_k2")))
    parser = finding(report, "tool_parser")
    assert code == 0 and parser["verdict"] == "warn"
    assert "<|tool_calls_section_begin|>" in parser["reason"]


# ------------------------------------------------------------------ bad input: exit 2 naming the flag

@pytest.mark.parametrize("argv, flag", [
    (["{tmp}/nowhere", "--tool-call-parser", "allowed_hermes"], "MODEL"),
    (["{model}", "--tool-call-parser", "allowed_hermes", "--tokenizer", "{tmp}/nowhere"], "--tokenizer"),
    (["{model}", "--tool-call-parser", "allowed_hermes", "--chat-template", "{tmp}/none.jinja"],
     "--chat-template"),
    (["{tmp}", "--tool-call-parser", "allowed_hermes"], "MODEL"),   # a folder without a tokenizer
    (["{model}", "--tool-call-parser", "allowed_hermes", "--", "--no-such-flag"], "--no-such-flag"),
])
def test_unreadable_input_exits_2_naming_the_flag(capsys, random_model, tmp_path, argv, flag) -> None:
    code, error = run(capsys, *[arg.format(tmp=tmp_path, model=random_model) for arg in argv])
    assert code == 2 and error["flag"].startswith(flag) and flag in error["error"], error


@pytest.mark.parametrize("argv, named", [
    (["{model}"], "--tool-call-parser"),
    (["{model}", "--tool-call-parser", "allowed_hermes", "--no-such-flag"], "--no-such-flag"),
])
def test_bad_usage_exits_2_naming_the_flag(capsys, random_model, argv, named) -> None:
    from vllm_allowed_tools.devtools.commands import main
    with pytest.raises(SystemExit) as exit_:
        main(["check", *[arg.format(model=random_model) for arg in argv]])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_the_console_script_prints_only_json_and_takes_seconds(random_model) -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "vllm_allowed_tools.devtools.commands", "check",
                             str(random_model), "--tool-call-parser", "allowed_hermes", "--json"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    elapsed = time.monotonic() - started
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["starts"], result.stderr[-2000:]
    assert report["seconds"] <= elapsed < 120, elapsed   # imports (torch, vLLM) dominate


# ------------------------------------------------------------------ against a real server

@pytest.mark.server
def test_the_check_agrees_with_the_server_it_describes(capsys, random_server, random_model) -> None:
    """serve-tiny's server (allowed_hermes, its bundled template, xgrammar, CPU) started; the check
    of the same command line says so, with the stage and placement the server logged."""
    code, report = run(capsys, str(random_model), "--tool-call-parser", "allowed_hermes",
                       "--chat-template", str(template_path("hermes")),
                       "--structured-outputs-config.backend", "xgrammar")
    log = random_server.log_text()
    stage = finding(report, "constraint_stage")["details"]["stage"]
    placement = finding(report, "placement")["details"]["placement"]
    assert code == 0
    assert f"applied by the {stage} stage" in log and f"goes in by {placement}" in log

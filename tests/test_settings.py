"""The settings: every variable and flag the plugin reads is parsed once, in one place; a value it
cannot use stops start-up naming the variable; ``docs/settings.md`` is the model's own table."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from vllm_allowed_tools import settings as settings_module
from vllm_allowed_tools.devtools.models.helper_settings import HelperSettings
from vllm_allowed_tools.launch import LaunchArgs
from vllm_allowed_tools.settings import Settings, SettingsError, markdown_table, variable_rows

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_allowed_tools"
SETTINGS_MODULE = PACKAGE / "settings.py"
GENERATED = re.compile(r"<!-- generated: settings\.markdown_table\(\) -->\n(.*?)<!-- end generated -->",
                       re.DOTALL)


# ------------------------------------------------------------------ one place reads the process

def process_reads(source: str) -> list[str]:
    """Each ``os.environ`` / ``os.getenv`` / ``os.putenv`` / ``sys.argv`` use (read or write) in a
    module's source, and each import of those names, as ``line: what``."""
    found = []
    modules = {"os": "os", "sys": "sys"}   # local name -> module, through `import os as x`
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({alias.asname or alias.name: alias.name for alias in node.names
                            if alias.name in ("os", "sys")})
    watched = {"os": {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"},
               "sys": {"argv", "orig_argv"}}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.attr in watched.get(modules.get(node.value.id, ""), ()):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in watched:
            found += [f"{node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                      if alias.name in watched[node.module] or alias.name == "*"]
    return found


def test_only_the_settings_module_reads_the_environment_or_the_command_line():
    offenders = {str(path.relative_to(ROOT)): reads for path in sorted(PACKAGE.rglob("*.py"))
                 if path != SETTINGS_MODULE and (reads := process_reads(path.read_text()))}
    assert not offenders, ("read them through vllm_allowed_tools.settings (current(), "
                           f"process_environment()): {offenders}")
    assert process_reads(SETTINGS_MODULE.read_text()), "the settings module is where they are read"


def test_the_scan_sees_every_way_in():
    assert process_reads("import os\nx = os.environ.get('A')\n") == ["2: os.environ"]
    assert process_reads("import os as o\no.getenv('A')\n") == ["2: o.getenv"]
    assert process_reads("from os import environ\n") == ["1: from os import environ"]
    assert process_reads("import os\nos.environ['A'] = '1'\n") == ["2: os.environ"]   # writes too
    assert process_reads("import sys\nprint(sys.argv[1:])\n") == ["2: sys.argv"]
    assert process_reads("import os\nos.getpid()\nenviron = {}\nenviron.get('A')\n") == []


# ------------------------------------------------------------------ every field, parsed or refused

#: field -> (variable value -> the parsed value), (values refused -> words of the refusal)
FIELD_CASES = {
    "constraint": ({" Logits-Processor ": "logits-processor", "native": "native"},
                   {"fast": "is not a constraint stage"}),
    "placement": ({"System-Message": "system-message", "auto": "auto"}, {"anywhere": "is not a placement"}),
    "fallback": ({"filter-catalog": "filter-catalog"}, {"yes": "is not a known fallback"}),
    "argument_schemas": ({"ALL": "all", "strict": "strict"},
                         {"parameter": "is not an argument-schema choice"}),
    "plain_decoding": ({"VANILLA": "vanilla", "catalog": "catalog"},
                       {"fast": "is not a plain-request decoding"}),
    "max_json_whitespace": ({"3": 3, " 0 ": 0}, {"abc": "must be a non-negative integer",
                                                 "-1": "must be a non-negative integer",
                                                 "1.5": "must be a non-negative integer"}),
    "extra_parsers": ({"mine, theirs,,": frozenset({"mine", "theirs"})}, {}),
    "approval_policy": ({"/etc/approvals.json": Path("/etc/approvals.json")}, {}),
    "grant_store": ({"postgresql://db/grants": "postgresql://db/grants"}, {}),
    "grant_store_timeout_s": ({"1.5": 1.5}, {bad: "must be a positive number of seconds"
                                             for bad in ("0", "-1", "soon", "nan", "inf")}),
    "conformance_log": ({"/tmp/check.jsonl": Path("/tmp/check.jsonl")}, {}),
    "max_server_tool_calls": ({"3": 3}, {"-1": "must be a non-negative integer"}),
    "harmony_preamble_tokens": ({"512": 512, "0": 0}, {"-1": "must be a non-negative integer"}),
    "xgrammar_cache_mb": ({"64": 64}, {"big": "must be a non-negative integer"}),
    "tag_cache_entries": ({"16": 16}, {"lots": "must be a non-negative integer"}),
    "tag_cache_mb": ({"8": 8}, {"-3": "must be a non-negative integer"}),
    "first_seen_grammars": ({"xgrammar": "xgrammar", " LLGuidance ": "llguidance"},
                            {"outlines": "is not a first-seen grammar choice"}),
    "grammar_cache_entries": ({"32": 32}, {"1e3": "must be a non-negative integer"}),
    "grammar_cache_mb": ({"2048": 2048}, {"big": "must be a non-negative integer"}),
    "api_key_set": ({"sk-secret": True, "   ": False}, {}),
    "target_device": ({"CPU": "cpu", "cuda": "cuda"}, {}),
    "use_v2_model_runner": ({"0": False, "1": True, "false": False, "True": True},
                            {"maybe": "must be 0 or 1"}),
    "enforce_strict_tool_calling": ({"0": False, "True": True, "1": True, "yes": False}, {}),
}


#: the dev tools' own variables (devtools/models/helper_settings.py: never the served plugin's)
HELPER_CASES = {
    "cache": ({"/tmp/vat": Path("/tmp/vat")}, {}),
    "pytest_current_test": ({"tests/test_x.py::t (call)": "tests/test_x.py::t (call)"}, {}),
    "server_ledger": ({"/tmp/starts.jsonl": Path("/tmp/starts.jsonl")}, {}),
    "train_steps": ({"25": 25}, {"many": "must be a non-negative integer"}),
    "xdg_cache_home": ({"/tmp/xdg": Path("/tmp/xdg")}, {}),
}
CASES = [(Settings, field, FIELD_CASES[field]) for field in sorted(FIELD_CASES)] + \
    [(HelperSettings, field, HELPER_CASES[field]) for field in sorted(HELPER_CASES)]


def test_every_variable_has_cases_here():
    assert set(FIELD_CASES) == set(Settings.variables())
    assert set(HELPER_CASES) == set(HelperSettings.variables())
    assert not set(Settings.variables().values()) & set(HelperSettings.variables().values())


@pytest.mark.parametrize(("cls", "field", "cases"), CASES, ids=[f"{c.__name__}.{f}" for c, f, _ in CASES])
def test_each_variable_is_parsed_and_a_bad_value_refused_naming_it(cls, field, cases):
    variable = cls.variable(field)
    good, bad = cases
    for raw, parsed in good.items():
        assert getattr(cls.from_environ({variable: raw}), field) == parsed, raw
    for raw, words in bad.items():
        with pytest.raises(SettingsError) as error:
            cls.from_environ({variable: raw})
        assert f"{variable}={raw!r} {words}" in str(error.value)
        assert error.value.status == 500 and error.value.capability == "config"


@pytest.mark.parametrize(("cls", "field", "cases"), CASES, ids=[f"{c.__name__}.{f}" for c, f, _ in CASES])
def test_unset_and_empty_give_the_default(cls, field, cases):
    default = cls.model_fields[field].default
    assert getattr(cls.from_environ({}), field) == default
    assert getattr(cls.from_environ({cls.variable(field): ""}), field) == default


def test_every_bad_value_is_named_at_once_and_others_are_ignored():
    with pytest.raises(SettingsError) as error:
        Settings.from_environ({"VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE": "abc",
                               "VLLM_ALLOWED_TOOLS_CONSTRAINT": "both", "HOME": "/root",
                               "launch": "not a field's variable"})
    message = str(error.value)
    assert "VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE='abc' must be a non-negative integer" in message
    assert "VLLM_ALLOWED_TOOLS_CONSTRAINT='both' is not a constraint stage" in message


def test_the_settings_are_frozen_and_derived_values_follow():
    settings = Settings.from_environ({"VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE": "0"},
                                     ["vllm", "serve", "m", "--api-key", "k"])
    with pytest.raises(ValueError):
        settings.max_json_whitespace = 3
    assert settings.whitespace_limit == 1   # xgrammar's least
    assert Settings.from_environ({}).whitespace_limit is None
    assert settings.api_key_configured
    assert Settings.from_environ({"VLLM_API_KEY": "k"}).api_key_configured
    assert not Settings.from_environ({}).api_key_configured


# ------------------------------------------------------------------ the command line

SERVE = ["vllm", "serve", "/models/m"]


def test_launch_args_read_each_flag_the_plugin_uses():
    launch = LaunchArgs.from_argv(SERVE + [
        "--tool-call-parser", "allowed_hermes", "--middleware", "a.B", "--middleware=c.D",
        "--structured-outputs-config.backend", "guidance", "--speculative_config", "{}",
        "--tool-strict-level=PARAMETER", "--trust-request-chat-template", "--chat-template", "t.jinja",
        "--tokenizer", "tok", "--tokenizer-revision", "r1", "--revision", "r2",
        "--tokenizer-mode", "mistral", "--trust-remote-code", "--api_key=k"])
    assert launch.is_server and launch.model == "/models/m"
    assert launch.tool_call_parser == "allowed_hermes" and launch.middleware == ("a.B", "c.D")
    assert launch.structured_outputs_backend == "guidance" and launch.speculative_decoding
    assert launch.strict_level_parameter and launch.trust_request_chat_template
    assert (launch.chat_template, launch.tokenizer, launch.tokenizer_revision, launch.revision,
            launch.tokenizer_mode) == ("t.jinja", "tok", "r1", "r2", "mistral")
    assert launch.trust_remote_code and launch.api_key_given


def test_launch_args_defaults_and_other_spellings():
    plain = LaunchArgs.from_argv(["python", "-m", "pytest"])
    assert not plain.is_server and plain.model is None and plain.structured_outputs_backend == "auto"
    assert not (plain.speculative_decoding or plain.strict_level_parameter or plain.api_key_given)
    assert LaunchArgs.from_argv(["python", "-m", "vllm.entrypoints.openai.api_server"]).is_server
    assert LaunchArgs.from_argv(["vllm", "serve", "--model", "m2"]).model == "m2"
    assert LaunchArgs.from_argv(["vllm", "serve", "-sc", '{"backend": "outlines"}']) \
        .structured_outputs_backend == "outlines"
    assert LaunchArgs.from_argv(["vllm", "serve", "--structured-outputs-config={\"backend\": \"x\"}"]) \
        .structured_outputs_backend == "x"
    last = LaunchArgs.from_argv(SERVE + ["--tool-strict-level", "parameter", "--tool-strict-level", "auto"])
    assert not last.strict_level_parameter   # the last flag wins, as in vLLM's parser
    assert Settings.from_environ({}, SERVE).launch == LaunchArgs.from_argv(SERVE)


# ------------------------------------------------------------------ the process's settings

def test_current_is_read_once_until_reset(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS", "11")
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    first = settings_module.current()
    assert first.max_server_tool_calls == 11 and first.launch.model == "m"
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS", "12")
    assert settings_module.current() is first
    settings_module.reset_for_tests()
    assert settings_module.current().max_server_tool_calls == 12


def test_the_servers_command_line_is_changed_in_one_place(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    assert settings_module.current().launch.middleware == ()
    settings_module.replace_server_command(["vllm", "serve", "m", "--middleware", "x.Y"])
    assert sys.argv == ["vllm", "serve", "m", "--middleware", "x.Y"]
    assert settings_module.current().launch.middleware == ("x.Y",)


def test_process_environment_is_a_copy(monkeypatch):
    monkeypatch.setenv("VAT_PROBE", "1")
    copy = settings_module.process_environment()
    copy["VAT_PROBE"] = "2"
    assert copy is not os.environ and os.environ["VAT_PROBE"] == "1"


def test_a_bad_value_stops_the_plugin_and_the_middleware_at_start(monkeypatch):
    """``register()`` runs in every vLLM process before anything else of ours; the middleware is
    built when the server builds its app. Both parse the settings first."""
    from vllm_allowed_tools.vllm_glue.middleware import AllowedToolsMiddleware
    from vllm_allowed_tools.vllm_glue.plugin import register
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE", "abc")
    for start in (register, lambda: AllowedToolsMiddleware(app=None)):
        settings_module.reset_for_tests()
        with pytest.raises(SettingsError, match="VLLM_ALLOWED_TOOLS_MAX_JSON_WHITESPACE='abc' must be"):
            start()


# ------------------------------------------------------------------ the documentation

def test_the_docs_table_is_the_models_own():
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    match = GENERATED.search(doc)
    assert match, "docs/settings.md lost its generated block"
    assert match.group(1) == markdown_table(), (
        "docs/settings.md is out of date: paste vllm_allowed_tools.settings.markdown_table()'s "
        "output between its markers")


def test_the_readme_rows_are_the_models_own():
    """The README's Settings section shows a few variables' rows exactly as the model's table has
    them (default and what it changes), and links the whole table."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 5, "the README's Settings section lost its table"
    known = variable_rows()
    for row in rows:
        variable = row.split("`")[1]
        assert variable in known, f"the README names {variable}, which no settings field reads"
        assert row == known[variable], (
            f"the README's row for {variable} is out of date: paste it from "
            "vllm_allowed_tools.settings.variable_rows()")
    assert "<!-- settings-table -->" not in readme
    assert "(docs/settings.md)" in section and f"All {len(known)} variables" in section


def test_the_table_has_a_row_per_variable_and_per_flag():
    table = markdown_table()
    for variable in Settings.variables().values():
        assert f"| `{variable}` |" in table
    for info in LaunchArgs.model_fields.values():
        for flag in (info.json_schema_extra or {}).get("flags", ()):
            assert f"`{flag}`" in table
    assert all("\n" not in (info.description or "") and "|" not in (info.description or "")
               for info in [*Settings.model_fields.values(), *LaunchArgs.model_fields.values()])

"""Configurations that could not enforce an allowlist are refused, naming what is missing."""

from __future__ import annotations

import json

import pytest

from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.launch import LaunchArgs
from vllm_allowed_tools.settings import Settings
from vllm_allowed_tools.decode.outlines_schemas import backend_compiles_json_schema
from vllm_allowed_tools.vllm_glue.capabilities import ServerCapabilities, check_server_args

BASE = ["vllm", "serve", "m", "--tool-call-parser", "allowed_hermes"]


def _check(argv, environ):
    """The start-up check of a server with this command line and environment."""
    return check_server_args(Settings.from_environ(environ, argv))


def structured_output_backend(argv):
    return LaunchArgs.from_argv(argv).structured_outputs_backend


NATIVE = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "native"}


def test_good_configuration_passes():
    """xgrammar, or ``auto`` (which tries xgrammar first), with our parser: accepted, served by the
    stage ``auto`` picks for the device. A command line that is not a server's is accepted with nothing checked."""
    assert structured_output_backend(BASE) == "auto"
    for argv in (BASE + ["--structured-outputs-config.backend", "xgrammar"], BASE):
        for environ, stage in (({"VLLM_TARGET_DEVICE": "cpu"}, "logits-processor"),
                               (GPU, "native"), ({**GPU, **NATIVE}, "native")):
            assert _check(argv, environ) == ServerCapabilities(
                constraint_stage=stage), (argv, environ)
        caps = _check(argv, {})   # the device as vLLM detects it here
        assert caps.constraint_stage in ("native", "logits-processor")
    not_a_server = ["python", "-m", "pytest", "--tool-call-parser", "hermes"]
    assert _check(not_a_server, {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}) \
        == ServerCapabilities(constraint_stage="native")


@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_backends_without_structural_tags_are_refused(backend):
    for argv in (BASE + ["--structured-outputs-config.backend", backend],
                 BASE + [f"--structured-outputs-config.backend={backend}"],
                 BASE + ["--structured-outputs-config", '{"backend": "%s"}' % backend]):
        assert structured_output_backend(argv) == backend
        with pytest.raises(CapabilityError, match=backend) as error:
            _check(argv, NATIVE)
        assert "xgrammar" in str(error.value) and error.value.status == 500


def test_last_backend_flag_wins():
    argv = BASE + ["--structured-outputs-config.backend", "xgrammar",
                   "--structured-outputs-config.backend", "outlines"]
    with pytest.raises(CapabilityError):
        _check(argv, NATIVE)


LP = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor", "VLLM_TARGET_DEVICE": "cpu"}


GPU = {"VLLM_TARGET_DEVICE": "cuda"}   # what the stage choice reads first (no accelerator needed)


def test_logits_processor_stage_serves_other_backends():
    """The logits processor is what makes a backend without structural tags usable: the grammar
    never reaches it. ``auto`` (the default) picks it there by itself."""
    outlines = BASE + ["--structured-outputs-config.backend", "outlines"]
    assert _check(outlines, LP).constraint_stage == "logits-processor"
    assert _check(outlines, {**GPU, "VLLM_USE_V2_MODEL_RUNNER": "0"}) \
        .constraint_stage == "logits-processor"
    with pytest.raises(CapabilityError, match="outlines.*speculative decoding"):
        _check(outlines + ["--speculative-config", "{}"], GPU)


def test_guidance_serves_the_native_stage_where_the_processor_cannot_run():
    """vLLM's guidance backend compiles our tags through their Lark translation
    (vllm_glue/guidance_tags.py): the native stage is served there, on GPUs by default, and with
    speculative decoding or Model Runner V2, where our processor never runs, a strict tool's string
    lengths held by the grammar there (nothing compiles ahead); on CPU ``auto`` keeps the processor
    (measured faster there)."""
    guidance = BASE + ["--structured-outputs-config.backend", "guidance"]
    native = ServerCapabilities(constraint_stage="native", lengths_in_grammar=True)
    assert _check(guidance, NATIVE) == native and _check(guidance, GPU) == native
    assert _check(guidance + ["--speculative-config", "{}"], GPU).constraint_stage == "native"
    assert _check(guidance, {"VLLM_TARGET_DEVICE": "cpu"}) == ServerCapabilities(
        constraint_stage="logits-processor")


def test_a_guidance_native_server_holds_strict_lengths_in_the_grammar(monkeypatch):
    """The server's capabilities, recorded at start-up, decide whether a strict tool's
    ``maxLength`` stays in its grammar (xgrammar 0.2.8 leaves it to the guard)."""
    from vllm_allowed_tools.decode import argument_schemas
    from vllm_allowed_tools.decode.grammar import AllowedFunction
    from vllm_allowed_tools.vllm_glue import capabilities
    monkeypatch.setattr(capabilities, "_ACTIVE", None)
    bounded = AllowedFunction("post", {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 40}}}, strict=True)
    try:
        capabilities.activate(ServerCapabilities(constraint_stage="native", lengths_in_grammar=True))
        assert argument_schemas.held_to_schema([bounded], every_tool=True) == [bounded]
        capabilities.activate(ServerCapabilities(constraint_stage="logits-processor"))
        held = argument_schemas.held_to_schema([bounded], every_tool=True)[0]
        assert argument_schemas.lengths_compile_fast() is argument_schemas._version_at_least(
            argument_schemas._installed_xgrammar(), (0, 2, 9))
        if not argument_schemas.lengths_compile_fast():
            assert "maxLength" not in json.dumps(held.parameters)
    finally:
        argument_schemas.hold_lengths_in_grammar(False)


def test_auto_stage_follows_the_benchmark():
    """``auto``: the logits processor on CPU (measured faster there), vLLM's native path on
    accelerators (not measured) and wherever the processor cannot run."""
    assert _check(BASE, {"VLLM_TARGET_DEVICE": "cpu"}).constraint_stage == "logits-processor"
    assert _check(BASE, GPU).constraint_stage == "native"
    assert _check(BASE + ["--speculative-config", "{}"],
                  {"VLLM_TARGET_DEVICE": "cpu"}).constraint_stage == "native"
    assert _check(BASE, {"VLLM_TARGET_DEVICE": "cpu", **NATIVE}).constraint_stage == "native"


def test_logits_processor_stage_refuses_speculative_decoding():
    argv = BASE + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    _check(argv, {})      # the native path supports it
    with pytest.raises(CapabilityError, match="speculative decoding") as error:
        _check(argv, LP)
    assert error.value.capability == "constraint_stage"


def test_logits_processor_stage_needs_the_v1_runner_off_cpu():
    gpu = {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "logits-processor", **GPU}
    with pytest.raises(CapabilityError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        _check(BASE, gpu)
    _check(BASE, {**gpu, "VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_unknown_constraint_stage_is_refused():
    with pytest.raises(CapabilityError, match="VLLM_ALLOWED_TOOLS_CONSTRAINT"):
        _check(BASE, {"VLLM_ALLOWED_TOOLS_CONSTRAINT": "both"})


def test_base_parser_with_the_middleware_is_refused():
    with pytest.raises(CapabilityError, match="allowed_hermes"):
        _check(["vllm", "serve", "m", "--tool-call-parser", "hermes"], {})


def test_every_registered_wire_format_has_an_accepted_parser():
    from vllm_allowed_tools.formats import wire_formats
    for entry in wire_formats():
        _check(["vllm", "serve", "m", "--tool-call-parser", entry.parser_name], {})
    with pytest.raises(CapabilityError, match="allowed_longcat"):
        _check(["vllm", "serve", "m", "--tool-call-parser", "longcat"], {})


def test_strict_tool_calling_switched_off_is_refused():
    with pytest.raises(CapabilityError, match="VLLM_ENFORCE_STRICT_TOOL_CALLING"):
        _check(BASE, {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"})


@pytest.mark.server
def test_real_server_refuses_to_start_with_outlines(tmp_path, monkeypatch, capsys):
    """... and `vllm-allowed-tools check` of the same configuration refuses it for the same reason."""
    import json

    from vllm_allowed_tools.devtools.check import main as check
    from vllm_allowed_tools.devtools.serve import ServeError, server_environment, start_server
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    model = ensure_model("random", 0, log=lambda *_: None)
    with pytest.raises(ServeError) as error:
        start_server(model, extra_args=["--structured-outputs-config.backend", "outlines"],
                     log_path=tmp_path / "server.log", timeout=240, env=NATIVE)
    assert "structured-output backend cannot compile" in str(error.value)
    environment = server_environment(NATIVE)
    for name in ("VLLM_TARGET_DEVICE", "VLLM_ALLOWED_TOOLS_CONSTRAINT"):
        monkeypatch.setenv(name, environment[name])
    capsys.readouterr()
    code = check(["--json", str(model), "--tool-call-parser", "allowed_hermes",
                  "--structured-outputs-config.backend", "outlines"])
    report = json.loads(capsys.readouterr().out)
    reason = next(f["reason"] for f in report["findings"] if f["guarantee"] == "constraint_stage")
    assert code == 1 and reason in str(error.value)


# ------------------------------------------------------------------ templates and the fallback

#: renders every message's content in order: a trailing system message lands after the history
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
#: system messages hoisted to the front (as DeepSeek's templates do): the policy goes last instead
HOISTING_TEMPLATE = ("{% for m in messages if m.role == 'system' %}{{ m.content }}\n{% endfor %}"
                     "{% for m in messages if m.role != 'system' %}{{ m.content }}\n{% endfor %}")
#: renders user messages only: no placement gets the policy into the prompt
USERS_ONLY_TEMPLATE = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tiny_model_dir():
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return ensure_model("random", 0, log=lambda *_: None)


def _placement(argv, environ=None):
    from vllm_allowed_tools.vllm_glue.served_template import choose_placement
    return choose_placement(Settings.from_environ(environ or {}, argv))


def _serve(model, template=None):
    argv = ["vllm", "serve", str(model), "--tool-call-parser", "allowed_hermes"]
    return argv + (["--chat-template", str(template)] if template else [])


def test_each_template_gets_the_placement_its_probe_passes(tiny_model_dir, tmp_path):
    """Our templates read the policy variable; a model's own template takes it as a trailing
    system message, or appended to the last message where system messages are hoisted."""
    from vllm_allowed_tools.templates import template_path
    assert _placement(_serve(tiny_model_dir, template_path("hermes"))).placement == "template-variable"
    assert _placement(_serve(tiny_model_dir)).placement == "template-variable"   # the folder's own
    for text, expected in ((PLAIN_TEMPLATE, "system-message"), (HOISTING_TEMPLATE, "last-message")):
        template = tmp_path / "theirs.jinja"
        template.write_text(text)
        choice = _placement(_serve(tiny_model_dir, template))
        assert (choice.placement, choice.origin) == (expected, str(template))


def test_a_template_no_placement_fits_is_refused_naming_it(tiny_model_dir, tmp_path):
    template = tmp_path / "theirs.jinja"
    template.write_text(USERS_ONLY_TEMPLATE)
    with pytest.raises(CapabilityError, match="theirs.jinja") as error:
        _placement(_serve(tiny_model_dir, template))
    message = str(error.value)
    assert "system-message: the allowed names are not rendered after the history" in message
    assert "filter-catalog" in message


def test_the_model_folders_own_template_is_probed(tiny_model_dir, tmp_path):
    import json
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": USERS_ONLY_TEMPLATE}))
    with pytest.raises(CapabilityError, match="own chat template"):
        _placement(_serve(tmp_path))
    config["chat_template"] = HOISTING_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert _placement(_serve(tmp_path)).placement == "last-message"


def test_explicit_fallback_and_forced_placements(tiny_model_dir, tmp_path):
    template = tmp_path / "theirs.jinja"
    template.write_text(USERS_ONLY_TEMPLATE)
    argv = _serve(tiny_model_dir, template)
    assert _placement(argv, {"VLLM_ALLOWED_TOOLS_FALLBACK": "filter-catalog"}).filter_catalog
    assert _placement(argv, {"VLLM_ALLOWED_TOOLS_PLACEMENT": "filter-catalog"}).filter_catalog
    with pytest.raises(CapabilityError, match="not a known fallback"):
        _placement(argv, {"VLLM_ALLOWED_TOOLS_FALLBACK": "yes"})
    with pytest.raises(CapabilityError, match="not a placement"):
        _placement(argv, {"VLLM_ALLOWED_TOOLS_PLACEMENT": "anywhere"})
    template.write_text(HOISTING_TEMPLATE)   # a forced placement is still probed
    with pytest.raises(CapabilityError, match="system-message: two allowed subsets"):
        _placement(argv, {"VLLM_ALLOWED_TOOLS_PLACEMENT": "system-message"})


def test_unreadable_tokenizer_is_refused_naming_the_way_out():
    with pytest.raises(CapabilityError, match="could not load the tokenizer of '/nowhere/model'"):
        _placement(["vllm", "serve", "/nowhere/model", "--tool-call-parser", "allowed_hermes"])
    with pytest.raises(CapabilityError, match="--tokenizer-mode mistral"):
        _placement(["vllm", "serve", "m", "--tokenizer-mode", "mistral"])


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


def test_a_requests_own_template_is_probed_once_and_refused_when_nothing_fits(tiny_model_dir):
    """With --trust-request-chat-template vLLM renders a request's own `chat_template`: the
    middleware probes it like the served one (cached by content), so a template that cannot take
    the policy is refused per request instead of silently losing the policy."""
    from vllm_allowed_tools.templates import template_path
    choice = _placement(_serve(tiny_model_dir, template_path("hermes")))
    assert choice.for_request_template(PLAIN_TEMPLATE).placement == "system-message"
    assert choice.for_request_template(HOISTING_TEMPLATE).placement == "last-message"
    refused = choice.for_request_template(USERS_ONLY_TEMPLATE)
    assert refused.placement is None and "system-message" in refused.explain()
    assert choice.for_request_template(PLAIN_TEMPLATE) is choice.for_request_template(PLAIN_TEMPLATE)


def _post_through_middleware(argv, monkeypatch, body):
    """One POST /v1/chat/completions through the middleware built for ``argv``; the app records
    the body it was given. Returns (status, payload, the forwarded body or None)."""
    import sys

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from vllm_allowed_tools.vllm_glue.middleware import AllowedToolsMiddleware
    forwarded = []

    async def endpoint(request):
        forwarded.append(await request.json())
        return JSONResponse({"object": "chat.completion", "choices": []})

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_CONSTRAINT", "native")
    middleware = AllowedToolsMiddleware(Starlette(routes=[
        Route("/v1/chat/completions", endpoint, methods=["POST"])]))
    from support.asgi import post_json
    status, payload = post_json(middleware, "/v1/chat/completions", body)
    return status, payload, (forwarded[0] if forwarded else None)


def test_the_middleware_places_the_policy_the_probe_chose_and_refuses_unfit_request_templates(
        tiny_model_dir, tmp_path, monkeypatch):
    template = tmp_path / "theirs.jinja"
    template.write_text(PLAIN_TEMPLATE)
    argv = _serve(tiny_model_dir, template) + ["--trust-request-chat-template"]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("b", "a")]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": {"type": "allowed_tools",
                            "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                         "function": {"name": "a"}}]}}}
    status, _, forwarded = _post_through_middleware(argv, monkeypatch, body)
    assert status == 200
    assert forwarded["messages"][-1] == {"role": "system", "content": "Allowed tools this turn (auto): a"}
    assert [t["function"]["name"] for t in forwarded["tools"]] == ["a", "b"]
    assert "allowed_tools_policy" not in (forwarded.get("chat_template_kwargs") or {})
    status, payload, forwarded = _post_through_middleware(
        argv, monkeypatch, {**body, "chat_template": USERS_ONLY_TEMPLATE})
    assert status == 400 and forwarded is None and payload["error"]["param"] == "chat_template"
    status, _, forwarded = _post_through_middleware(
        argv, monkeypatch, {**body, "chat_template": HOISTING_TEMPLATE})
    assert status == 200 and forwarded["messages"][-1]["content"].endswith("Allowed tools this turn (auto): a")


# ------------------------------------------------- JSON schemas a structural-tag-less backend compiles

OUTLINES = BASE + ["--structured-outputs-config.backend", "outlines"]


def test_json_schemas_stay_native_only_where_the_backend_forced_the_processor():
    """outlines cannot compile structural tags, so ``auto`` serves tags with our processor but
    leaves JSON schemas to outlines; the operator forcing the processor, or a backend whose
    schemas are not checked here, keeps every grammar on the processor."""
    for environ in ({"VLLM_TARGET_DEVICE": "cpu"}, {**GPU, "VLLM_USE_V2_MODEL_RUNNER": "0"}):
        assert _check(OUTLINES, environ) == ServerCapabilities(
            constraint_stage="logits-processor", json_schema_backend="outlines")
    assert _check(OUTLINES, LP).json_schema_backend is None
    for backend in ("guidance", "lm-format-enforcer", "xgrammar", "auto"):   # guidance: tags too
        argv = BASE + ["--structured-outputs-config.backend", backend]
        caps = _check(argv, {"VLLM_TARGET_DEVICE": "cpu"})
        assert caps.constraint_stage == "logits-processor"
        assert not backend_compiles_json_schema(caps.json_schema_backend, {"type": "string"})


def _tool_array(*parameters, parallel=True):
    """vLLM's required-mode schema (tool_parsers/utils.py get_json_schema_from_tools)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.utils import get_json_schema_from_tools
    tools = [ChatCompletionToolsParam(type="function", function={"name": f"f{i}", "parameters": p})
             for i, p in enumerate(parameters)]
    return get_json_schema_from_tools("required", tools, parallel_tool_calls=parallel)


#: (schema, compiled exactly by outlines, instances it must accept, instances it must refuse)
ENUM = {"type": "object", "properties": {"u": {"type": "string", "enum": ["c", "f"]}},
        "required": ["u"], "additionalProperties": False}
OUTLINES_CASES = [
    (_tool_array(ENUM, None, parallel=False), True,
     ['[{"name": "f0", "parameters": {"u": "c"}}]', '[{"name": "f1", "parameters": {}}]'],
     ['[]', '[{"name": "f2", "parameters": {}}]', '[{"name": "f0", "parameters": {"u": "x"}}]',
      '[{"name": "f1", "parameters": {}}, {"name": "f1", "parameters": {}}]']),
    (_tool_array(ENUM), True, ['[{"name": "f0", "parameters": {"u": "f"}}, '
                               '{"name": "f0", "parameters": {"u": "c"}}]'], ['[]']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, True,
     ["[1]", "[1, 2]"], ["[]", "[1, 2, 3]"]),
    ({"$defs": {"d": {"const": "x"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/d"}},
      "required": ["a"]}, True, ['{"a": "x"}'], ['{"a": "y"}', "{}"]),
    ({"type": "string", "minLength": 1, "maxLength": 2}, True, ['"ab"'], ['""', '"abc"']),
    ({"type": "string", "pattern": "^a+$"}, True, ['"aa"'], ['"b"']),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, True, ["1", "null"], ['"a"']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, True, ['{"a": 1}'], ['{"a": "b"}']),
    ({"type": "integer", "minimum": 0}, False, [], []),            # dropped: -1 would pass
    ({"type": "string", "pattern": "a", "maxLength": 2}, False, [], []),   # pattern dropped
    ({"anyOf": [{"type": "string"}], "type": "string", "maxLength": 2}, False, [], []),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, False, [], []),
    ({"allOf": [{"type": "string"}, {"type": "string"}]}, False, [], []),  # regexes concatenated
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, False, [], []),
    ({"type": "object", "additionalProperties": False}, False, [], []),  # refused
    ({"type": "string", "format": "hostname"}, False, [], []),  # refused
    ({"not": {"type": "string"}}, False, [], []),  # refused
    ({"type": "array", "items": True}, False, [], []),
]


@pytest.mark.parametrize("schema, exact, accepted, refused", OUTLINES_CASES)
def test_outlines_compiles_exactly_the_schemas_said_to_stay_native(schema, exact, accepted, refused):
    """Checked against outlines_core itself (what vLLM's outlines backend runs): a schema said to
    stay native compiles to a regex that accepts and refuses what the schema does; the others
    would be refused or loosened by outlines, so our processor keeps them."""
    import json
    import re

    from outlines_core.json_schema import build_regex_from_schema
    assert backend_compiles_json_schema("outlines", schema) is exact
    assert backend_compiles_json_schema("outlines", json.dumps(schema)) is exact
    assert backend_compiles_json_schema("guidance", schema) is False
    if exact:
        regex = build_regex_from_schema(json.dumps(schema))
        assert all(re.fullmatch(regex, text) for text in accepted), (regex, accepted)
        assert not any(re.fullmatch(regex, text) for text in refused), (regex, refused)


def test_a_schema_stays_native_only_on_an_outlines_server(monkeypatch):
    from vllm_allowed_tools.vllm_glue import capabilities
    schema = _tool_array(ENUM)
    monkeypatch.setattr(capabilities, "_ACTIVE", ServerCapabilities("logits-processor", "outlines"))
    backend = capabilities.json_schema_backend()
    assert backend_compiles_json_schema(backend, schema)
    assert not backend_compiles_json_schema(backend, {"type": "integer", "maximum": 3})
    monkeypatch.setattr(capabilities, "_ACTIVE", ServerCapabilities("logits-processor"))
    assert not backend_compiles_json_schema(capabilities.json_schema_backend(), schema)


def test_the_turns_grammar_leaves_a_native_json_schema_and_moves_the_rest():
    """The one place that moves grammars to our processor reads the decision above."""
    import dataclasses
    import json

    from vllm_allowed_tools.decode.turn_grammar import Outputs, TurnRead, Wrapper, decide_turn
    from vllm_allowed_tools.wire import XARGS_TAG, XARGS_TEXT_UTF8, WireAllowlist
    schema = _tool_array(ENUM)
    allowlist = WireAllowlist(mode="auto", allowed=frozenset(), catalog=frozenset(),
                              parallel_tool_calls=True, catalog_digest="c", allowlist_digest="a")
    for backend, moved in (("outlines", False), (None, True)):
        wrapper = Wrapper("pythonic", None, stage="logits-processor", json_schema_backend=backend)
        grammar = decide_turn(TurnRead(wrapper, allowlist, outputs=Outputs(json=json.dumps(schema))))
        assert (grammar.rewrites_outputs and grammar.outputs is None) is moved
        assert (XARGS_TAG in grammar.xargs) is moved
        # an allowlist of the whole catalog (a plain turn's) keeps vanilla's free text; one that
        # narrows it may have its text held to valid UTF-8 while its grammar compiles
        assert XARGS_TEXT_UTF8 not in grammar.xargs
        narrowing = dataclasses.replace(allowlist, catalog=frozenset({"other_tool"}))
        grammar = decide_turn(TurnRead(wrapper, narrowing, outputs=Outputs(json=json.dumps(schema))))
        assert grammar.xargs.get(XARGS_TEXT_UTF8) == (1 if moved else None)


def test_the_plugin_hook_stops_a_refused_server_before_its_engine_starts(monkeypatch):
    """vLLM loads general plugins while it parses the server's command line, before the engine
    starts: a configuration the middleware would refuse stops there, naming the reason."""
    from vllm_allowed_tools.settings import reset_for_tests
    from vllm_allowed_tools.vllm_glue.plugin import register
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_CONSTRAINT", "native")
    monkeypatch.setattr("sys.argv", BASE + ["--structured-outputs-config.backend", "outlines"])
    reset_for_tests()
    with pytest.raises(SystemExit, match="the 'outlines' structured-output backend cannot compile"):
        register()
    monkeypatch.setattr("sys.argv", BASE + ["--structured-outputs-config.backend", "guidance"])
    reset_for_tests()
    register()   # served: the native stage on guidance

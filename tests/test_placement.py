"""Where the per-turn policy enters the prompt, the canonical catalog, the template probe, and the
one-flag launch: pure functions, no server."""

from __future__ import annotations

import copy
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.templates.render import _compile
from vllm_allowed_tools.launch import LaunchArgs
from vllm_allowed_tools.request.placement import (
    LAST_MESSAGE,
    SYSTEM_MESSAGE,
    TEMPLATE_VARIABLE,
    canonical_tools,
    place_policy,
    policy_text,
)
from vllm_allowed_tools.request.rewrite import echo_of, restore_echo, rewrite_request
from vllm_allowed_tools.request.template_probe import check_placement, check_user_turn, probe_template
from vllm_allowed_tools.settings import Settings
from vllm_allowed_tools.vllm_glue.plugin import MIDDLEWARE, with_our_middleware
from vllm_allowed_tools.wire import ALLOWLIST_KEY

NO_SETTINGS = Settings.from_environ({})   # an environment with none of our variables

TEXT = policy_text("auto", ["b", "a"])


def test_policy_text_names_the_mode_and_sorted_names():
    assert TEXT == "Allowed tools this turn (auto): a, b"


def test_system_message_goes_after_the_whole_history_on_both_apis():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    placed = place_policy(chat, "chat", SYSTEM_MESSAGE, "auto", ["b", "a"])
    assert placed["messages"] == [{"role": "user", "content": "hi"}, {"role": "system", "content": TEXT}]
    assert chat == {"messages": [{"role": "user", "content": "hi"}]}     # not mutated
    responses = place_policy({"input": "hi"}, "responses", SYSTEM_MESSAGE, "auto", ["a", "b"])
    assert responses["input"] == [{"type": "message", "role": "user", "content": "hi"},
                                  {"type": "message", "role": "system", "content": TEXT}]


def test_last_message_extends_the_last_entry_or_adds_one():
    tool = {"role": "tool", "tool_call_id": "c", "content": "42"}
    assert place_policy({"messages": [tool]}, "chat", LAST_MESSAGE, "auto", ["a", "b"])["messages"] \
        == [{**tool, "content": f"42\n\n{TEXT}"}]
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert place_policy({"messages": [parts]}, "chat", LAST_MESSAGE, "auto", ["a", "b"])["messages"][0] \
        ["content"] == [{"type": "text", "text": "hi"}, {"type": "text", "text": f"\n\n{TEXT}"}]
    image_last = {"role": "user", "content": [{"type": "input_text", "text": "see"},
                                              {"type": "input_image", "image_url": "data:,"}]}
    assert place_policy({"input": [image_last]}, "responses", LAST_MESSAGE, "auto", ["a"])["input"][0] \
        ["content"][-1] == {"type": "input_text", "text": "\n\nAllowed tools this turn (auto): a"}
    for bad in ({"messages": {"role": "user"}}, {"messages": "hi"}, {}):   # vLLM refuses these itself
        assert place_policy(bad, "chat", SYSTEM_MESSAGE, "auto", ["a"]) is bad
    output = {"type": "function_call_output", "call_id": "c", "output": "42"}
    assert place_policy({"input": [output]}, "responses", LAST_MESSAGE, "auto", ["a", "b"])["input"] \
        == [{**output, "output": f"42\n\n{TEXT}"}]
    call_only = {"role": "assistant", "content": None, "tool_calls": []}
    assert place_policy({"messages": [call_only]}, "chat", LAST_MESSAGE, "auto", ["a", "b"])["messages"] \
        == [call_only, {"role": "system", "content": TEXT}]
    assert place_policy({"messages": []}, "chat", TEMPLATE_VARIABLE, "auto", ["a"]) == {"messages": []}


def _tool(name, properties):
    return {"type": "function", "function": {"parameters": {"type": "object", "properties": properties},
                                             "name": name, "description": f"{name} tool"}}


def test_canonical_tools_sort_names_and_keys_but_keep_argument_order():
    tools = [_tool("zeta", {"b": {"type": "string"}, "a": {"type": "integer"}}), _tool("alpha", {})]
    canonical = canonical_tools(tools, "chat")
    assert [t["function"]["name"] for t in canonical] == ["alpha", "zeta"]
    assert list(canonical[1]["function"]) == ["description", "name", "parameters"]
    assert list(canonical[1]["function"]["parameters"]["properties"]) == ["b", "a"]   # as sent
    responses = canonical_tools([{"type": "function", "name": "b"}, {"type": "web_search"},
                                 {"type": "function", "name": "a"}], "responses")
    assert [t.get("name") for t in responses] == [None, "a", "b"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text("abcxyz_", min_size=1, max_size=6), min_size=1, max_size=6, unique=True),
       st.randoms(use_true_random=False))
def test_any_order_of_the_catalog_renders_one_canonical_catalog(names, rng):
    tools = [_tool(name, {"q": {"type": "string", "description": name}, "p": {}}) for name in names]
    shuffled = copy.deepcopy(tools)
    rng.shuffle(shuffled)
    for tool in shuffled:   # and every mapping's keys in another order
        tool["function"] = dict(reversed(list(tool["function"].items())))
    assert json.dumps(canonical_tools(shuffled, "chat")) == json.dumps(canonical_tools(tools, "chat"))


def test_rewrite_canonicalises_tools_and_keeps_the_clients_for_the_echo():
    tools = [{"type": "function", "name": "b", "parameters": {}},
             {"type": "function", "name": "a", "parameters": {}}]
    body = {"input": "hi", "tools": tools,
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "a"}]}}
    rewritten = rewrite_request(body, "responses", placement=SYSTEM_MESSAGE)
    assert [t["name"] for t in rewritten.body["tools"]] == ["a", "b"]
    assert "chat_template_kwargs" not in rewritten.body and ALLOWLIST_KEY in rewritten.body
    echo = echo_of(rewritten, "responses")
    assert echo == {"tool_choice": body["tool_choice"], "tools": tools,
                    "text": {"format": {"type": "text"}}}   # vLLM echoes required's schema there
    response = {"object": "response", "tools": rewritten.body["tools"], "tool_choice": "auto"}
    assert restore_echo(response, echo) == {"object": "response", "tools": tools,
                                            "tool_choice": body["tool_choice"]}   # no text: none set
    variable = rewrite_request(body, "responses")
    assert variable.body["chat_template_kwargs"]["allowed_tools_policy"] == {"mode": "auto", "names": ["a"]}
    canonical = [{"name": "a", "parameters": {}, "type": "function"},
                 {"name": "b", "parameters": {}, "type": "function"}]
    in_order = rewrite_request({**body, "tools": canonical}, "responses")
    assert in_order.original_tools is None   # already canonical: nothing to restore


# ------------------------------------------------------------------ the probe, on small templates

def _renderer(source):
    template = _compile(source)
    return lambda messages, tools, variables: template.render(
        messages=messages, tools=tools, add_generation_prompt=True, **variables)


PLAIN = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
HOISTING = ("{% for m in messages if m.role == 'system' %}{{ m.content }}\n{% endfor %}"
            "{% for m in messages if m.role != 'system' %}{{ m.content }}\n{% endfor %}")
VARIABLE = PLAIN + "{% if allowed_tools_policy %}{{ allowed_tools_policy.names | join(',') }}{% endif %}"
#: the catalog after the history: the policy is after the history, but the history moves
CATALOG_LAST = "{% for m in messages %}{{ m.content }}\n{% endfor %}{{ tools | map(attribute='function.name') | join(',') }}"


@pytest.mark.parametrize("source, expected", [
    (VARIABLE, TEMPLATE_VARIABLE), (PLAIN, SYSTEM_MESSAGE), (HOISTING, LAST_MESSAGE),
    (CATALOG_LAST, SYSTEM_MESSAGE)])
def test_the_probe_picks_the_first_placement_that_keeps_the_prefix(source, expected):
    result = probe_template(_renderer(source))
    assert result.placement == expected, result.reasons


def test_the_probe_says_why_a_placement_fails():
    reasons = probe_template(_renderer(HOISTING)).reasons
    assert "not rendered after the history" in reasons[TEMPLATE_VARIABLE]
    assert "render the history differently" in reasons[SYSTEM_MESSAGE]
    assert "rendering failed: TemplateError: no" in check_placement(
        _renderer("{{ raise_exception('no') }}"), SYSTEM_MESSAGE)
    calls = []
    plain = _renderer(PLAIN)

    def counting(messages, tools, variables):   # e.g. a template that prints the time
        calls.append(1)
        return plain(messages, tools, variables) + str(len(calls))
    assert "nondeterministic" in check_placement(counting, SYSTEM_MESSAGE)


#: the catalog just before the LAST user message (as Mistral's templates put it)
CATALOG_BEFORE_LAST_USER = (
    "{% set last = namespace(i=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if loop.index0 == last.i %}"
    "{{ tools | map(attribute='function.description') | join(',') }}\n{% endif %}{{ m.content }}\n"
    "{% endfor %}")
#: an assistant turn's reasoning only after the last user message (as Qwen3's template does)
REASONING_AFTER_LAST_USER = (
    "{% set last = namespace(i=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.reasoning_content and loop.index0 > last.i %}"
    "{{ m.reasoning_content }}\n{% endif %}{{ m.content }}\n{% endfor %}")
USERS_ONLY = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"


def test_the_probe_says_what_a_new_user_turn_does_to_the_prefix():
    moves = probe_template(_renderer(CATALOG_BEFORE_LAST_USER))
    assert moves.placement == SYSTEM_MESSAGE and moves.user_turn_reasoning is None
    assert "the tool catalog is rendered just before the last user message" in moves.user_turn
    assert moves.reuse_notes()[0].startswith("prompt reuse holds within an agent loop (tool results "
                                             "appended after the last user message) but not across user turns")
    drops = probe_template(_renderer(REASONING_AFTER_LAST_USER))
    assert drops.placement == SYSTEM_MESSAGE and drops.user_turn is None
    assert "reasoning is rendered only after the last user message" in drops.user_turn_reasoning
    assert check_user_turn(_renderer(PLAIN), SYSTEM_MESSAGE) is None
    assert check_user_turn(_renderer(PLAIN), SYSTEM_MESSAGE, reasoning=True) is None
    assert probe_template(_renderer(PLAIN)).reuse_notes() == []


def test_a_refusal_says_first_what_the_template_leaves_out():
    result = probe_template(_renderer(USERS_ONLY))
    assert result.placement is None
    assert result.dropped.startswith("the template leaves the system message, the assistant's tool "
                                     "call, the tool result and a system message after them out of "
                                     "the prompt (it renders only the user messages)")
    assert result.explain().startswith(result.dropped + " (template-variable: ")
    raising = probe_template(_renderer("{{ raise_exception('no') }}"))
    assert raising.dropped is None and raising.explain().startswith("template-variable: rendering failed")


def test_the_probe_compares_tokens_where_a_tokenizer_is_given():
    """A tokenizer that merges across the end of the history (here: the whole prompt is one token
    per 4 characters, shifted by what follows) makes equal texts unequal token prefixes."""
    def tokenize(text):
        return [hash(text[i:]) for i in range(0, len(text), 4)]   # every token depends on the rest
    assert check_placement(_renderer(PLAIN), SYSTEM_MESSAGE) is None
    assert "render the history differently" in check_placement(_renderer(PLAIN), SYSTEM_MESSAGE, tokenize)


# ------------------------------------------------------------------ one flag

SERVE = ["vllm", "serve", "m", "--enable-auto-tool-choice"]


def test_our_parser_installs_the_middleware_once():
    argv = SERVE + ["--tool-call-parser", "allowed_hermes"]
    assert with_our_middleware(argv, NO_SETTINGS) == argv + ["--middleware", MIDDLEWARE]
    assert with_our_middleware(with_our_middleware(argv, NO_SETTINGS), NO_SETTINGS) \
        == argv + ["--middleware", MIDDLEWARE]
    assert with_our_middleware(argv + [f"--middleware={MIDDLEWARE}"], NO_SETTINGS) \
        == argv + [f"--middleware={MIDDLEWARE}"]
    other = argv + ["--middleware", "my.Middleware"]
    assert with_our_middleware(other, NO_SETTINGS) == other + ["--middleware", MIDDLEWARE]
    assert with_our_middleware(SERVE + ["--tool-call-parser=allowed_pythonic"], NO_SETTINGS)[-1] == MIDDLEWARE


def test_other_parsers_and_commands_are_left_alone():
    for argv in (SERVE + ["--tool-call-parser", "hermes"], SERVE, ["python", "-m", "pytest",
                                                                  "--tool-call-parser", "allowed_hermes"]):
        assert with_our_middleware(argv, NO_SETTINGS) == argv
    vouched = SERVE + ["--tool-call-parser", "mine"]
    vouching = Settings.from_environ({"VLLM_ALLOWED_TOOLS_EXTRA_PARSERS": "mine"})
    assert with_our_middleware(vouched, vouching)[-1] == MIDDLEWARE


def test_probe_conversation_is_not_mutated_by_rendering():
    seen = []

    def render(messages, tools, variables):
        seen.append(copy.deepcopy(messages))
        messages.clear()   # a template (or renderer) that consumes its input
        return "x"
    check_placement(render, SYSTEM_MESSAGE)
    assert all(seen) and random.choice(seen)[0]["role"] == "system"


# ---------------------------------------------------------------------------- gpt-oss (harmony)
def test_harmony_prompts_take_the_policy_as_a_trailing_developer_message(tmp_path):
    """vLLM renders gpt-oss with harmony, not a template: the probe renders its conversations with
    vLLM's own harmony functions and finds the system-message placement (a trailing system message
    becomes a developer message after the history); the template variable cannot work there."""
    import json

    from vllm_allowed_tools.request.placement import SYSTEM_MESSAGE
    from vllm_allowed_tools.request.template_probe import PROBE_TOOLS, probe_template
    from vllm_allowed_tools.vllm_glue.harmony_prompt import HarmonyPrompt, serves_harmony
    from vllm_allowed_tools.vllm_glue.served_template import choose_placement

    prompt = HarmonyPrompt()
    result = probe_template(prompt.render, prompt.tokenize)
    assert result.placement == SYSTEM_MESSAGE, result.reasons
    assert "not rendered after the history" in result.reasons["template-variable"]
    text = prompt.render([{"role": "user", "content": "hi"},
                          {"role": "system", "content": "Allowed tools this turn (auto): x"}],
                         PROBE_TOOLS[:1], {})
    assert text.endswith("<|start|>developer<|message|># Instructions\n\nAllowed tools this turn "
                         "(auto): x<|end|><|start|>assistant")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    argv = ["vllm", "serve", str(model), "--tool-call-parser", "allowed_openai"]
    assert serves_harmony(LaunchArgs.from_argv(argv))
    assert not serves_harmony(LaunchArgs.from_argv(["vllm", "serve", str(tmp_path / "none")]))
    choice = choose_placement(Settings.from_environ({}, argv),
                              load=lambda _: (_ for _ in ()).throw(AssertionError("no template read")))
    assert choice.placement == SYSTEM_MESSAGE and "harmony" in choice.origin

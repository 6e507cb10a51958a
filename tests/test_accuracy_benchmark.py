"""The pure parts of benchmarks/accuracy.py: BFCL's tool conversion, the interval math, the hermes
ground truth (no server, no BFCL download)."""

from __future__ import annotations

import json

import pytest

from vllm_allowed_tools.templates.render import render_chat

from support.servers import load_script

accuracy = load_script("benchmarks", "accuracy")   # with its folder importable, as when it runs

#: BFCL-shaped functions (as in BFCL_v4_multiple.json): Gorilla types, dotted names
FUNCTIONS = [
    {"name": "geo.distance", "description": "Distance between two cities.",
     "parameters": {"type": "dict", "properties": {
         "origin": {"type": "string", "description": "From."},
         "speed": {"type": "float", "description": "Speed."},
         "stops": {"type": "tuple", "items": {"type": "string"}, "description": "Stops."},
         "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "float"}},
                    "description": "Rows."},
         "extra": {"type": "any", "description": "Anything."},
         "options": {"type": "dict", "properties": {"fast": {"type": "boolean", "description": "Fast."}},
                     "description": "Options."}},
         "required": ["origin"]}},
    {"name": "weather", "description": "Weather.",
     "parameters": {"type": "dict", "properties": {"city": {"type": "string", "description": "City."}},
                    "required": ["city"]}},
    {"name": "stock.price", "description": "Price.",
     "parameters": {"type": "dict", "properties": {"ticker": {"type": "string", "description": "T."}},
                    "required": ["ticker"]}},
]


def _case(ground_truth, category="multiple"):
    return accuracy.Case("x_0", category, [{"role": "user", "content": "hi"}], FUNCTIONS, ground_truth)


def test_tools_as_bfcls_openai_handler_makes_them():
    tools = accuracy.bfcl_tools(FUNCTIONS)
    function = tools[0]["function"]
    assert tools[0]["type"] == "function"
    assert function["name"] == "geo_distance"
    assert function["description"] == "Distance between two cities." + accuracy.PYTHON_HINT
    params = function["parameters"]
    assert params["type"] == "object" and params["required"] == ["origin"]
    props = params["properties"]
    assert props["speed"] == {"type": "number", "format": "float",
                              "description": "Speed. This is a float type value."}
    assert props["stops"]["type"] == "array" and props["stops"]["items"] == {"type": "string"}
    assert props["matrix"]["items"] == {"type": "array", "items": {"type": "number"}}
    assert props["extra"]["type"] == "string"
    assert props["options"]["type"] == "object"
    assert props["options"]["properties"]["fast"]["type"] == "boolean"
    assert FUNCTIONS[0]["parameters"]["type"] == "dict"   # the input is left alone


def test_ground_truth_in_schema_order_first_accepted_value_optional_left_out():
    case = _case([{"geo.distance": {"speed": [2.5], "origin": ["Paris", "paris"], "stops": ["", ["A"]]}}])
    assert accuracy.ground_truth_calls(case) == [("geo_distance", {"origin": "Paris", "speed": 2.5})]


def test_hermes_ground_truth_is_what_the_template_renders_for_the_call():
    calls = [("geo_distance", {"speed": 2.5, "origin": "Paris"}), ("weather", {"city": "Oslo"})]
    messages = [{"role": "user", "content": "hi"}]
    prompt = render_chat(messages, accuracy.bfcl_tools(FUNCTIONS))
    answer = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}
    full = render_chat([*messages, answer], accuracy.bfcl_tools(FUNCTIONS), add_generation_prompt=False)
    assert full.startswith(prompt)
    # the template sorts argument keys; the benchmark writes them in schema order, as the grammar does
    assert full[len(prompt):] == accuracy.hermes_calls_text(calls, sort_keys=True) + "<|im_end|>\n"
    assert accuracy.hermes_calls_text(calls[:1]) == (
        '<tool_call>\n{"name": "geo_distance", "arguments": {"speed": 2.5, "origin": "Paris"}}\n</tool_call>')


def test_subsets_hold_the_ground_truth_and_nest():
    case = _case([{"weather": {"city": ["Oslo"]}}])
    subsets = accuracy.allowed_subsets(case, [1, 2, 4], seed=0)
    assert list(subsets) == [1, 2]           # a 3-tool catalog has no subset of 4
    assert subsets[1] == ["weather"] and subsets[2][0] == "weather" and len(set(subsets[2])) == 2
    two = _case([{"weather": {"city": ["Oslo"]}}, {"stock.price": {"ticker": ["X"]}}])
    assert accuracy.allowed_subsets(two, [1, 2, 4], seed=0) == {2: ["weather", "stock_price"]}


def test_wilson_interval():
    low, high = accuracy.wilson(3, 10)
    assert (round(low, 4), round(high, 4)) == (0.1078, 0.6032)
    assert accuracy.wilson(0, 20)[0] == 0.0 and 0.15 < accuracy.wilson(0, 20)[1] < 0.17
    assert accuracy.wilson(0, 0) == (0.0, 1.0)


def test_bootstrap_interval_brackets_the_mean_and_is_deterministic():
    values = [0.1, -0.2, 0.3, 0.05, 0.0, 0.2, -0.1, 0.15]
    low, high = accuracy.bootstrap_mean_ci(values, seed=3)
    assert low < sum(values) / len(values) < high
    assert (low, high) == accuracy.bootstrap_mean_ci(values, seed=3)
    assert accuracy.bootstrap_mean_ci([0.5] * 5) == (0.5, 0.5)


def test_request_bodies_per_arm():
    case = _case([{"weather": {"city": ["Oslo"]}}])
    subset = ["weather", "geo_distance"]
    filtered = accuracy.request_body(case, accuracy.Arm("V filter req@2", "vanilla", "required", True, 2),
                                     subset, 160)
    assert [t["function"]["name"] for t in filtered["tools"]] == ["geo_distance", "weather"]
    assert filtered["tool_choice"] == "required" and filtered["temperature"] == 0
    allowed = accuracy.request_body(case, accuracy.Arm("P allowed req@2", "template-variable",
                                                       "allowed-required", size=2), subset, 160)
    assert len(allowed["tools"]) == 3
    assert allowed["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "weather"}},
                                      {"type": "function", "function": {"name": "geo_distance"}}]}}
    json.dumps(allowed)


@pytest.mark.parametrize("placements", [["template-variable", "system-message"], []])
def test_arms(placements):
    arms = accuracy.arms_for([1, 2], placements)
    keys = [arm.key for arm in arms]
    assert keys[:4] == ["V auto", "V filter req@1", "V filter req@2", "V req"]
    assert len(keys) == len(set(keys))
    if placements:
        assert "P[system-message] allowed req@2" in keys and keys[-2:] == ["P auto", "P req"]


def test_system_message_placement_renders_as_the_template_variable_on_hermes():
    """Why the benchmark serves template-variable and last-message by default: on the hermes
    template a trailing system message is the template's own policy block, byte for byte."""
    from vllm_allowed_tools.request.placement import place_policy

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    tools = accuracy.bfcl_tools(FUNCTIONS)
    names = ["weather", "geo_distance"]
    variable = render_chat(messages, tools, allowed_tools_policy={"mode": "required", "names": sorted(names)})
    placed = place_policy({"messages": messages}, "chat", "system-message", "required", names)
    assert render_chat(placed["messages"], tools) == variable
    last = place_policy({"messages": messages}, "chat", "last-message", "required", names)
    assert render_chat(last["messages"], tools) != variable


def test_token_span_covers_the_name():
    tokens = ["<", "tool", "_call", ">", "Ċ", '{"', "name", '":', 'Ġ"', "get", "_stock", '_price"', ","]
    start = len('<tool_call>\n{"name": "')
    assert accuracy.token_span(tokens, start, len("get_stock_price")) == (9, 12)
    assert accuracy.token_span(tokens, 999, 3) is None

"""A model's own chat template, served unmodified, with the one-flag launch.

Two real servers on the tool-happy tiny model: the Qwen3 official template as the tokenizer's own
template (no ``--chat-template``, no ``--middleware``: ``--tool-call-parser allowed_hermes`` alone,
with an approval policy on), where the probe picks a trailing system message; and DeepSeek-V3's
template through ``--chat-template PATH``, which hoists system messages, where the policy is
appended to the last message. Both endpoints, unary and streaming, and the prompt-cache prefix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.devtools.serve import start_server

pytestmark = [pytest.mark.server, pytest.mark.trained_model]

CORPUS = Path(__file__).parent / "data" / "chat_templates"
QWEN3 = CORPUS / "Qwen-Qwen3-0.6B.jinja"
DEEPSEEK = CORPUS / "tool_chat_template_deepseekv3.jinja"
NAMES = ["search_note", "get_weather", "read_file", "send_email", "update_user"]
GATED = "send_email"
CHAT_TOOLS = [POOL_BY_NAME[name].chat_tool() for name in NAMES]            # not in canonical order
RESPONSES_TOOLS = [POOL_BY_NAME[name].responses_tool() for name in NAMES]
SCALE_OUT = ["--enable-scale-out"]   # vLLM's render endpoint, to read the prompt it renders


def _model_with_template(base: Path, template: Path, out: Path) -> Path:
    """The tiny model with ``template`` as its tokenizer's own chat template (weights linked)."""
    out.mkdir()
    for entry in base.iterdir():
        if entry.name == "tokenizer_config.json":
            config = json.loads(entry.read_text())
            config["chat_template"] = template.read_text(encoding="utf-8")
            (out / entry.name).write_text(json.dumps(config))
        elif entry.suffix == ".safetensors":
            (out / entry.name).symlink_to(entry)
        else:
            shutil.copy(entry, out / entry.name)
    return out


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    """The one-flag launch on the tokenizer's own (Qwen3) template, approvals on."""
    folder = tmp_path_factory.mktemp("own-template")
    model = _model_with_template(ensure_model("tool-happy", 0, log=lambda *_: None), QWEN3,
                                 folder / "model")
    policy = folder / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": [GATED], "approval": "required"}]}))
    server = start_server(model, chat_template="model", one_flag=True, timeout=900,
                          extra_args=SCALE_OUT, env={"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deepseek_server():
    server = start_server(ensure_model("tool-happy", 0, log=lambda *_: None), chat_template=DEEPSEEK,
                          one_flag=True, timeout=900, extra_args=SCALE_OUT)
    yield server
    server.stop()


def _client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _allowed(mode, names, api="chat"):
    tools = [{"type": "function", "function": {"name": n}} if api == "chat" else
             {"type": "function", "name": n} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}} if api == "chat" \
        else {"type": "allowed_tools", "mode": mode, "tools": tools}


HISTORY = [{"role": "system", "content": "You are a careful assistant."},
           {"role": "user", "content": "Look up the weather, then tell me."}]


def _step(number, name):
    call_id = f"call{number:05d}"
    return [{"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps({"day": "monday"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": f"result number {number}"}]


def _render(server, messages, names, tools=CHAT_TOOLS):
    """The prompt vLLM renders for this request (its render endpoint, then detokenised)."""
    body = {"model": "tiny", "messages": messages, "tools": tools, "tool_choice": _allowed("auto", names)}
    tokens = httpx.post(f"{server.root_url}/v1/chat/completions/render", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["token_ids"]
    text = httpx.post(f"{server.root_url}/detokenize", json={"model": "tiny", "tokens": ids}, timeout=60)
    return ids, text.json()["prompt"]


def test_the_one_flag_launch_installs_the_middleware_and_probes_the_template(own_server, deepseek_server):
    own_log, deepseek_log = own_server.log_tail(4000), deepseek_server.log_tail(4000)
    assert "--middleware" not in " ".join(own_server.process.args)
    assert "middleware active for --tool-call-parser allowed_hermes" in own_log
    assert "own chat template: the per-turn policy goes in by system-message" in own_log
    assert f"chat template {DEEPSEEK}: the per-turn policy goes in by last-message" in deepseek_log


@pytest.mark.parametrize("server_name, placement_marker", [
    ("own_server", "<|im_start|>system\nAllowed tools this turn (auto): get_weather, read_file"),
    ("deepseek_server", "result number 1\n\nAllowed tools this turn (auto): get_weather, read_file")])
def test_the_policy_follows_the_history_and_the_history_is_a_shared_prefix(
        request, server_name, placement_marker):
    server = request.getfixturevalue(server_name)
    history = HISTORY + _step(1, "get_weather")
    ids_a, text_a = _render(server, history, ["read_file", "get_weather"])
    ids_b, _ = _render(server, history, ["update_user"])
    ids_next, _ = _render(server, history + _step(2, "read_file"), ["search_note"],
                          tools=CHAT_TOOLS[::-1])   # the client reorders its catalog, too
    assert placement_marker in text_a
    assert text_a.index("Allowed tools this turn") > text_a.index("result number 1") \
        > text_a.index("careful assistant")
    history_end = len(httpx.post(f"{server.root_url}/tokenize", json={
        "model": "tiny", "prompt": text_a[:text_a.index("result number 1") + len("result number 1")],
        "add_special_tokens": False}, timeout=60).json()["tokens"])
    for other in (ids_b, ids_next):
        shared = next((i for i, (x, y) in enumerate(zip(ids_a, other)) if x != y), len(ids_a))
        assert shared >= history_end - 1, (shared, history_end)


@pytest.mark.parametrize("server_name", ["own_server", "deepseek_server"])
@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_only_the_allowed_on_both_endpoints(request, server_name, stream):
    client = _client(request.getfixturevalue(server_name))
    allowed = {"read_file", "update_user"}
    chat = client.chat.completions.create(
        model="tiny", messages=HISTORY, tools=CHAT_TOOLS, tool_choice=_allowed("required", allowed),
        max_tokens=120, temperature=0, stream=stream, extra_body={"seed": 3})
    if stream:
        names = [call.function.name for chunk in chat for choice in chunk.choices
                 for call in choice.delta.tool_calls or () if call.function and call.function.name]
    else:
        names = [call.function.name for call in chat.choices[0].message.tool_calls or ()]
    assert names and set(names) <= allowed, names
    kwargs = dict(model="tiny", input=HISTORY[1]["content"], tools=RESPONSES_TOOLS,
                  tool_choice=_allowed("required", allowed, "responses"), max_output_tokens=120,
                  temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert events[-1].type == "response.completed", events[-1]
        output = events[-1].response.output
    else:
        output = client.responses.create(**kwargs).output
    calls = [item.name for item in output if item.type == "function_call"]
    assert calls and set(calls) <= allowed, calls


def test_responses_echo_the_clients_own_tools_and_tool_choice(own_server):
    response = httpx.post(f"{own_server.base_url}/responses", timeout=120, json={
        "model": "tiny", "input": "Look it up.", "tools": RESPONSES_TOOLS, "max_output_tokens": 60,
        "tool_choice": _allowed("required", ["get_weather"], "responses"), "temperature": 0})
    assert response.status_code == 200, response.text
    echoed = response.json()
    # the client's order (the server rendered them sorted), in the shape vLLM echoes every tool
    assert [(i["name"], i["parameters"]) for i in echoed["tools"]] == \
        [(t["name"], t["parameters"]) for t in RESPONSES_TOOLS]
    assert echoed["tool_choice"] == _allowed("required", ["get_weather"], "responses")


def test_a_gated_call_asks_for_approval_under_the_own_template(own_server):
    response = httpx.post(f"{own_server.base_url}/responses", timeout=120, json={
        "model": "tiny", "input": "Send it.", "tools": RESPONSES_TOOLS, "max_output_tokens": 120,
        "tool_choice": _allowed("required", [GATED], "responses"), "temperature": 0,
        "parallel_tool_calls": False})
    assert response.status_code == 200, response.text
    kinds = [(item["type"], item.get("name")) for item in response.json()["output"]]
    assert ("elicitation", GATED) in kinds and ("function_call", GATED) not in kinds


def test_continuing_the_final_message_is_refused_where_the_policy_is_a_message(own_server):
    response = httpx.post(f"{own_server.base_url}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": HISTORY + [{"role": "assistant", "content": "Sure"}],
        "tools": CHAT_TOOLS, "tool_choice": _allowed("auto", ["get_weather"]),
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"

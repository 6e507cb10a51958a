"""gpt-oss prompts as vLLM renders them: harmony, not a chat template.

vLLM serves ``model_type == "gpt_oss"`` on its harmony path: the Jinja template (the tokenizer's or
``--chat-template``) is never used; ``openai_harmony`` renders the conversation, the tools going
into the developer message at its start. So the start-up probe renders its conversations with
vLLM's own harmony functions instead, and the placement it finds is the one the served prompts
really have (a trailing system message becomes a developer message after the history).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..launch import LaunchArgs

#: where the harmony path is chosen in vLLM (``hf_config.model_type``)
HARMONY_MODEL_TYPE = "gpt_oss"


def serves_harmony(launch: LaunchArgs) -> bool:
    """Whether the server's model is one vLLM serves on its harmony path (read from the local
    model folder's config.json; a hub id is resolved by transformers)."""
    source = launch.model
    if source is None:
        return False
    config = Path(source) / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type") == HARMONY_MODEL_TYPE
        except ValueError:
            return False
    try:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(
            source, revision=launch.revision,
            trust_remote_code=launch.trust_remote_code).model_type == HARMONY_MODEL_TYPE
    except Exception:   # unreadable config: vLLM fails on it too; the template probe reports it
        return False


def _with_text_arguments(messages: list) -> list:
    """Call arguments as JSON text, as vLLM hands them to harmony (``maybe_serialize_tool_calls``)."""
    def call(tool_call: dict) -> dict:
        function = dict(tool_call.get("function") or {})
        if not isinstance(function.get("arguments"), str):
            function["arguments"] = json.dumps(function.get("arguments") or {})
        return {**tool_call, "function": function}
    return [{**message, "tool_calls": [call(c) for c in message["tool_calls"]]}
            if message.get("tool_calls") else message for message in messages]


@dataclass(frozen=True)
class HarmonyPrompt:
    """Renders Chat messages the way vLLM's harmony path does (``_make_request_with_harmony``)."""
    origin: str = "gpt-oss's harmony rendering (vLLM's harmony path; no chat template)"
    text: str | None = None

    def render(self, messages: list, tools: list, variables: dict) -> str:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
        from vllm.entrypoints.openai.parser.harmony_utils import (
            build_harmony_preamble,
            extract_instructions_from_messages,
            get_encoding,
            parse_chat_inputs_to_harmony_messages,
            render_for_completion,
        )
        instructions, rest = extract_instructions_from_messages(_with_text_arguments(messages))
        harmony = build_harmony_preamble(
            instructions=instructions, with_custom_tools=bool(tools),
            tools=[ChatCompletionToolsParam.model_validate(tool) for tool in tools] or None)
        harmony.extend(parse_chat_inputs_to_harmony_messages(rest))
        return get_encoding().decode(render_for_completion(harmony))

    def tokenize(self, text: str) -> list[int]:
        from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
        return list(get_encoding().encode(text, allowed_special="all"))

    def with_text(self, text: str, origin: str) -> Any:
        return self   # a request's chat_template is not used on the harmony path either

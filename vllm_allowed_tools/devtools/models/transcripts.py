"""The transcripts the trained tiny models learn from: a catalog, a few user asks, assistant calls to
catalog tools (and, for the thinking flavour, a short reasoning block first), rendered by our own
chat template exactly as the server renders a prompt."""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

from ...templates.render import render_chat
from .tool_pool import PoolTool

USER_ASKS = ["Help me with this.", "Can you take care of it?", "Do the next step.", "Go ahead.",
              "What now?", "Please handle my request.", "I need something done.", "Continue."]
# the thinking flavour's reasoning: a few words before a call or a text (naming no tool: the name is
# chosen in the call, where its first token is weighted, as for tool-happy)
_THOUGHTS_BEFORE_CALL = ["A tool can do this.", "Let me use a tool.", "I need to call a tool.",
                         "The user wants an action.", "I will pick a tool."]
_THOUGHTS_BEFORE_TEXT = ["The tool answered.", "That worked.", "Nothing more to call."]



def _conversation(rng: random.Random, catalog: list[PoolTool]) -> tuple[list[dict], dict | None]:
    """A transcript ending in an assistant call, and an optional (ignored) tail policy block."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
    for round_index in range(rng.choice([1, 1, 2, 3])):
        target = rng.choice(catalog)
        if rng.random() < 0.5:
            messages.append({"role": "user", "content": f"Please use {target.name}."})
        else:
            messages.append({"role": "user", "content": rng.choice(USER_ASKS)})
        call_id = f"call_{round_index}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": target.name, "arguments": target.random_arguments(rng)}}]})
        if round_index >= 0:
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": json.dumps({"ok": True})})
            messages.append({"role": "assistant", "content": "Done."})
    # drop the last "Done." so most transcripts end on a call, and sometimes on text after a result
    if rng.random() < 0.8:
        messages.pop()
        messages.pop()
    policy = None
    if rng.random() < 0.5:
        names = [tool.name for tool in rng.sample(catalog, min(2, len(catalog)))]
        policy = {"mode": rng.choice(["auto", "required"]), "names": names}
    return messages, policy


def _with_reasoning(rng: random.Random, message: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn the thinking flavour writes: a short reasoning block, then the turn."""
    if message.get("tool_calls"):
        # the template puts one newline between content and a call: "</think>\n\n<tool_call>"
        return {**message, "content": f"<think>\n{rng.choice(_THOUGHTS_BEFORE_CALL)}\n</think>\n"}
    return {**message, "content": f"<think>\n{rng.choice(_THOUGHTS_BEFORE_TEXT)}\n</think>\n\n"
                                  f"{message['content']}"}


def render_training_text(rng: random.Random, catalog: list[PoolTool], thinking: bool = False) -> str:
    """One transcript as the template renders it; ``thinking``: its last assistant turn reasons first
    (the template renders the reasoning of earlier turns nowhere, so they have none)."""
    messages, policy = _conversation(rng, catalog)
    if thinking:
        messages[-1] = _with_reasoning(rng, messages[-1])
    tools = [tool.chat_tool() for tool in catalog]
    # The policy block is rendered only at the tail (that is where the server puts it), so render the
    # history with the block and the final assistant turn appended as plain text.
    last = messages[-1]
    prompt = render_chat(messages[:-1], tools, add_generation_prompt=True,
                         allowed_tools_policy=policy)
    tail = render_chat([last], None, add_generation_prompt=False)
    assert tail.startswith("<|im_start|>assistant\n")
    return prompt + tail[len("<|im_start|>assistant\n"):]


def assistant_spans(text: str) -> Iterator[tuple[int, int]]:
    """Character spans the model should learn: every assistant turn's content and its <|im_end|>."""
    marker, end = "<|im_start|>assistant\n", "<|im_end|>"
    start = text.find(marker)
    while start != -1:
        content_start = start + len(marker)
        stop = text.find(end, content_start)
        if stop == -1:
            break
        yield content_start, stop + len(end)
        start = text.find(marker, stop)

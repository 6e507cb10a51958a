"""The corpus of real chat templates (``tests/data/chat_templates``) and what the start-up probe
decides for each: the placement it picks, or why it refuses, and what it says a new user turn does
to the prefix. test_template_corpus.py checks the probe against these, test_check.py that
``vllm-allowed-tools check`` reports the same for every template."""

from __future__ import annotations

from pathlib import Path

from vllm_allowed_tools.request.placement import LAST_MESSAGE, SYSTEM_MESSAGE

CORPUS = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
TEMPLATES = sorted(path.stem for path in CORPUS.glob("*.jinja"))

#: the placement the start-up probe picks for each template it accepts
PLACEMENT = {
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": SYSTEM_MESSAGE,
    "GLM-4.6": SYSTEM_MESSAGE,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": SYSTEM_MESSAGE,
    "Qwen-Qwen2.5-7B-Instruct": SYSTEM_MESSAGE,
    "Qwen-Qwen3-0.6B": SYSTEM_MESSAGE,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": LAST_MESSAGE,
    "meta-llama-Llama-3.2-3B-Instruct": SYSTEM_MESSAGE,
    "meta-llama-Llama-3.3-70B-Instruct": SYSTEM_MESSAGE,
    # a system message anywhere but first raises; the policy goes on the last tool result
    "mistralai-Mistral-Nemo-Instruct-2407": LAST_MESSAGE,
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503": LAST_MESSAGE,   # the same refusal as Nemo
    "moonshotai-Kimi-K2": SYSTEM_MESSAGE,
    "moonshotai-Kimi-K2-Thinking": SYSTEM_MESSAGE,
    "tool_chat_template_deepseekv3": LAST_MESSAGE,
    "tool_chat_template_granite": SYSTEM_MESSAGE,
    "tool_chat_template_llama3.1_json": SYSTEM_MESSAGE,
    "tool_chat_template_llama4_pythonic": SYSTEM_MESSAGE,
    # a system message anywhere but first raises, as in the other Mistral templates
    "tool_chat_template_mistral3": LAST_MESSAGE,
    "tool_chat_template_phi4_mini": LAST_MESSAGE,
    "tool_chat_template_qwen3coder": SYSTEM_MESSAGE,
    "unsloth-MiniMax-M2": LAST_MESSAGE,
}
#: templates the probe refuses (the server then needs VLLM_ALLOWED_TOOLS_PLACEMENT=filter-catalog),
#: with the reason it gives for each placement
REFUSED = {
    # vLLM's object arguments break every rendering of a call (see test_template_corpus.py's
    # RENDER_FAILS)
    "deepseek-ai-DeepSeek-V3.1": {
        "template-variable": "can only concatenate str",
        "system-message": "can only concatenate str",
        "last-message": "can only concatenate str"},
    # renders only the user messages: nothing after the history reaches the prompt
    "tool_chat_template_granite-1659236": {
        "template-variable": "not rendered after the history",
        "system-message": "not rendered after the history",
        "last-message": "not rendered after the history"},
}
#: what the probe says a template itself does that no placement can change, where it says so
#: (a refusal's reason, said first in it, and named in the start-up error)
REFUSED_BECAUSE = {
    "tool_chat_template_granite-1659236": (
        "the template leaves the system message, the assistant's tool call, the tool result and a "
        "system message after them out of the prompt (it renders only the user messages)"),
}
#: accepted templates where a new user turn moves part of the history (the probe's ``user_turn``,
#: a warning at start-up and in ``vllm-allowed-tools check``): Mistral's catalog sits just before
#: the LAST user message
CATALOG_MOVES = "the tool catalog is rendered just before the last user message"
USER_TURN = {name: CATALOG_MOVES for name in (
    "mistralai-Mistral-Nemo-Instruct-2407", "mistralai-Mistral-Small-3.1-24B-Instruct-2503",
    "tool_chat_template_mistral3")}
#: accepted templates that drop the reasoning passed back on earlier turns at a new user turn (the
#: probe's ``user_turn_reasoning``, said at start-up)
REASONING_DROPPED = "reasoning is rendered only after the last user message (or final answer)"
USER_TURN_REASONING = {name: REASONING_DROPPED for name in (
    "GLM-4.6", "Qwen-Qwen3-0.6B", "moonshotai-Kimi-K2-Thinking", "unsloth-MiniMax-M2")}

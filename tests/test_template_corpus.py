"""The corpus of real chat templates (``tests/data/chat_templates``), served unmodified.

Fast (no server, no vLLM import). Each template is rendered the way the server renders it: the
served tokenizer's ``apply_chat_template`` (here the random tiny model's), through
:class:`~vllm_allowed_tools.vllm_glue.served_template.ServedTemplate`, the class the start-up probe
uses; messages as vLLM hands them to a template (tool-call arguments as objects, an assistant call
without text as ``content: ""``); tools in canonical order. The transcript is the one
``benchmarks/template_reuse.py`` replays against real servers (its sixth turn: system, user, five
call/result pairs).

What the tests pin, per template: that it renders the transcript with every message in it (or,
for the few real templates that lose something, exactly what they lose), and the placement the
start-up probe picks for it (or why it refuses), so a change to the probe or to a template shows up.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from conftest import load_script

from vllm_allowed_tools.request.placement import LAST_MESSAGE, SYSTEM_MESSAGE, canonical_tools
from vllm_allowed_tools.request.template_probe import probe_template
from vllm_allowed_tools.vllm_glue.served_template import ServedTemplate

CORPUS = Path(__file__).resolve().parent / "data" / "chat_templates"
TEMPLATES = sorted(path.stem for path in CORPUS.glob("*.jinja"))
REQUIRED = ("Qwen-Qwen3-0.6B", "tool_chat_template_llama3.1_json", "tool_chat_template_deepseekv3",
            "GLM-4.6")

#: templates that cannot render the transcript at all, and what they raise
RENDER_FAILS = {
    # concatenates function.arguments to a string; vLLM hands every template arguments as objects
    "deepseek-ai-DeepSeek-V3.1": (TypeError, "can only concatenate str"),
}
#: templates that render it but leave something out: what they drop (asserted missing)
DROPS = {
    # renders an assistant turn's calls only when its content is None; vLLM passes "" for a call
    # without text, so the calls vanish (their argument values with them)
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {"calls", "catalog"},
    # renders a message's content only: never its tool calls
    "moonshotai-Kimi-K2": {"calls"},
    # shows the system message only inside the LAST user message, when that is the last message
    "mistralai-Mistral-Nemo-Instruct-2407": {"system"},
    # with a client system message the catalog goes in only through ``custom_tools``
    "tool_chat_template_llama4_pythonic": {"catalog"},
}

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
    "tool_chat_template_deepseekv3": LAST_MESSAGE,
    "tool_chat_template_llama3.1_json": SYSTEM_MESSAGE,
    "tool_chat_template_llama4_pythonic": SYSTEM_MESSAGE,
    "tool_chat_template_phi4_mini": LAST_MESSAGE,
    "tool_chat_template_qwen3coder": SYSTEM_MESSAGE,
    "unsloth-MiniMax-M2": LAST_MESSAGE,
}
#: templates the probe refuses (the server then needs VLLM_ALLOWED_TOOLS_PLACEMENT=filter-catalog),
#: with the reason it gives for each placement
REFUSED = {
    # vLLM's object arguments break every rendering of a call (see RENDER_FAILS)
    "deepseek-ai-DeepSeek-V3.1": {
        "template-variable": "can only concatenate str",
        "system-message": "can only concatenate str",
        "last-message": "can only concatenate str"},
}


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks", "template_reuse")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_allowed_tools.testing.tiny_model import ensure_model
    return AutoTokenizer.from_pretrained(str(ensure_model("random", log=lambda *_: None)))


def served(name: str, tokenizer) -> ServedTemplate:
    text = (CORPUS / f"{name}.jinja").read_text(encoding="utf-8")
    return ServedTemplate(origin=name, text=text, tokenizer=tokenizer)


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ----------------------------------------------------------------------------------------- the corpus

def test_corpus_holds_the_required_templates_and_enough_families() -> None:
    assert len(TEMPLATES) >= 14, TEMPLATES
    assert set(REQUIRED) <= set(TEMPLATES)


def test_every_template_is_sourced_with_the_bytes_it_was_fetched_with() -> None:
    """SOURCES.md names each file with its blob hash: the bytes are the published ones (an editor
    that normalises line endings, e.g. Qwen3's and Kimi K2's CRLF, fails this)."""
    rows = {match.group(1): match.group(2) for match in re.finditer(
        r"^\| `([^`]+)\.jinja` \|.*\| `([0-9a-f]{40})` \|$",
        (CORPUS / "SOURCES.md").read_text(encoding="utf-8"), re.MULTILINE)}
    assert sorted(rows) == TEMPLATES
    changed = {name: blob for name, blob in rows.items()
               if git_blob((CORPUS / f"{name}.jinja").read_bytes()) != blob}
    assert not changed, f"templates whose bytes differ from SOURCES.md: {sorted(changed)}"


def test_every_template_has_an_expected_outcome() -> None:
    assert sorted([*PLACEMENT, *REFUSED]) == TEMPLATES
    assert not set(PLACEMENT) & set(REFUSED)


# ----------------------------------------------------------------------------------------- rendering

def _render(bench, tokenizer, name: str) -> tuple[str, list[dict], list[dict]]:
    transcript = bench.make_transcript()
    messages = transcript.messages(bench.TURNS, arguments_as_text=False)
    tools = canonical_tools(transcript.tools, "chat")
    return served(name, tokenizer).render(messages, tools, {}), messages, tools


def _missing(rendered: str, messages: list[dict], tools: list[dict]) -> dict[str, list[str]]:
    """What of the transcript the prompt lacks, by kind. Calls are looked for after the user's
    message (the catalog before it names every tool and argument value too)."""
    user = next(message["content"] for message in messages if message["role"] == "user")
    history = rendered[rendered.find(user):] if user in rendered else ""
    missing: dict[str, list[str]] = {"system": [], "messages": [], "calls": [], "catalog": []}
    for message in messages:
        content = message.get("content")
        if content and content not in rendered:
            missing["system" if message["role"] == "system" else "messages"].append(content)
        for call in message.get("tool_calls") or []:
            function = call["function"]
            for text in (function["name"], *function["arguments"].values()):
                if text not in history:
                    missing["calls"].append(text)
    missing["catalog"] = [tool["function"]["description"] for tool in tools
                          if tool["function"]["description"] not in rendered]
    return {kind: texts for kind, texts in missing.items() if texts}


@pytest.mark.parametrize("name", [name for name in TEMPLATES if name not in RENDER_FAILS])
def test_template_renders_every_message_of_the_agent_transcript(bench, tokenizer, name: str) -> None:
    rendered, messages, tools = _render(bench, tokenizer, name)
    missing = _missing(rendered, messages, tools)
    assert set(missing) == DROPS.get(name, set()), (
        f"{name}: expected to drop {sorted(DROPS.get(name, set()))}, lacks {missing}")


@pytest.mark.parametrize("name", sorted(RENDER_FAILS))
def test_template_that_cannot_render_vllms_messages_still_fails_the_same_way(bench, tokenizer,
                                                                             name: str) -> None:
    error, text = RENDER_FAILS[name]
    with pytest.raises(error, match=text):
        _render(bench, tokenizer, name)


def test_mistral_templates_keep_the_last_nine_characters_of_each_call_id(bench, tokenizer) -> None:
    """The transcript's ids are 9 characters, which the Mistral templates insist on."""
    rendered, messages, _ = _render(bench, tokenizer, "mistralai-Mistral-Small-3.1-24B-Instruct-2503")
    ids = [message["tool_call_id"] for message in messages if message["role"] == "tool"]
    assert all(len(call_id) == 9 for call_id in ids)
    assert all(f'"id": "{call_id}"' in rendered and f'"call_id": "{call_id}"' in rendered
               for call_id in ids)


# ----------------------------------------------------------------------------------------- the probe

@pytest.mark.parametrize("name", sorted(PLACEMENT))
def test_probe_picks_the_recorded_placement(tokenizer, name: str) -> None:
    template = served(name, tokenizer)
    result = probe_template(template.render, template.tokenize)
    assert result.placement == PLACEMENT[name], f"{name}: {result.explain()}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_probe_refuses_the_recorded_templates_for_the_recorded_reasons(tokenizer, name: str) -> None:
    template = served(name, tokenizer)
    result = probe_template(template.render, template.tokenize)
    assert result.placement is None, f"{name} is now accepted ({result.placement}): move it to PLACEMENT"
    assert sorted(result.reasons) == sorted(REFUSED[name])
    for placement, why in REFUSED[name].items():
        assert why in result.reasons[placement], f"{name} / {placement}: {result.reasons[placement]}"


def test_placed_policy_follows_the_whole_history_in_the_transcript(bench, tokenizer) -> None:
    """Beyond the probe's own conversation: on the benchmark's transcript, every accepted
    template's prompt with the policy placed begins with its plain rendering of the history."""
    from vllm_allowed_tools.request.placement import place_policy

    transcript = bench.make_transcript()
    messages = transcript.messages(bench.TURNS, arguments_as_text=False)
    tools = canonical_tools(transcript.tools, "chat")
    broken = []
    for name, placement in PLACEMENT.items():
        template = served(name, tokenizer)
        body = place_policy({"messages": [dict(m) for m in messages]}, "chat", placement, "auto",
                            transcript.allowed[-1])
        placed = template.render(body["messages"], tools, {})
        plain = template.render(messages, tools, {})
        last = messages[-1]["content"]
        history_end = plain.rfind(last) + len(last)
        if placed[:history_end] != plain[:history_end] or transcript.allowed[-1][0] not in placed[history_end:]:
            broken.append(name)
    assert not broken, f"the policy lands inside the history or goes missing: {broken}"

"""The corpus of real chat templates (``tests/data/chat_templates``), served unmodified.

Fast (no server, no vLLM import). Each template is rendered the way the server renders it: the
served tokenizer's ``apply_chat_template`` (here the random tiny model's), through
:class:`~vllm_allowed_tools.vllm_glue.served_template.ServedTemplate`, the class the start-up probe
uses; messages as vLLM hands them to a template (tool-call arguments as objects, an assistant call
without text as ``content: ""``); tools in canonical order. The transcript is the one
``benchmarks/template_reuse.py`` replays against real servers (its sixth turn: system, user, five
call/result pairs).

What the tests pin, per template: that it renders the transcript with every message in it (or,
for the few real templates that lose something, exactly what they lose), the placement the
start-up probe picks for it (or why it refuses), what the probe says a new user turn does to the
prefix, and how much of each previous prompt's history the next prompt begins with, within the
agent loop and across a user turn (with and without reasoning passed back): the figures of the
template table in docs/serving.md, which is checked against them. So a change to the probe or to a
template shows up.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from vllm_allowed_tools.errors import CapabilityError
from vllm_allowed_tools.request.placement import LAST_MESSAGE, SYSTEM_MESSAGE, canonical_tools, place_policy
from vllm_allowed_tools.request.template_probe import check_placement, common_prefix_length, probe_template
from vllm_allowed_tools.settings import Settings
from vllm_allowed_tools.vllm_glue.served_template import ServedTemplate, choose_placement

from support.servers import load_script
from support.template_corpus import (CATALOG_MOVES, CORPUS, PLACEMENT, REASONING_DROPPED, REFUSED,
                                     REFUSED_BECAUSE, TEMPLATES, USER_TURN, USER_TURN_REASONING)

SERVING_DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"

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
    # the first file at vLLM's granite template path (a single-turn draft): user messages only
    "tool_chat_template_granite-1659236": {"system", "messages", "calls"},
}


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks", "template_reuse")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return ensure_model("random", log=lambda *_: None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


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
    assert result.dropped == (REFUSED_BECAUSE[name] + ", so neither a message after the history "
                              "nor the text of its last message reaches the model"
                              if name in REFUSED_BECAUSE else None)
    assert result.explain().startswith(result.dropped or "template-variable: ")


@pytest.mark.parametrize("name", sorted(PLACEMENT))
def test_probe_says_what_a_new_user_turn_does_to_the_prefix(tokenizer, name: str) -> None:
    """After the placement, the probe renders a follow-up user turn: Mistral's templates move the
    catalog to the new last user message; thinking templates drop the reasoning passed back."""
    template = served(name, tokenizer)
    result = probe_template(template.render, template.tokenize)
    for said, expected in ((result.user_turn, USER_TURN.get(name)),
                           (result.user_turn_reasoning, USER_TURN_REASONING.get(name))):
        assert (said is None) == (expected is None), f"{name}: the probe says {said!r}"
        assert expected is None or expected in said, f"{name}: {said}"


def test_start_up_names_what_in_the_template_prevents_the_policy(model_dir) -> None:
    """The server's start-up decision on the command line itself: the refusal says what the
    template leaves out, and what to serve instead."""
    name = "tool_chat_template_granite-1659236"
    argv = ["vllm", "serve", str(model_dir), "--tool-call-parser", "allowed_hermes",
            "--chat-template", str(CORPUS / f"{name}.jinja")]
    with pytest.raises(CapabilityError) as refused:
        choose_placement(Settings.from_environ({}, argv))
    message = str(refused.value)
    assert f"the chat template ({CORPUS / name}.jinja) cannot take" in message
    assert REFUSED_BECAUSE[name] in message
    assert "Serve a template that renders every message of an agent conversation" in message
    assert "VLLM_ALLOWED_TOOLS_FALLBACK=filter-catalog" in message


def test_start_up_warns_where_reuse_holds_within_an_agent_loop_only(model_dir, caplog) -> None:
    argv = ["vllm", "serve", str(model_dir), "--tool-call-parser", "allowed_hermes",
            "--chat-template", str(CORPUS / "tool_chat_template_mistral3.jinja")]
    with caplog.at_level("INFO", logger="vllm.allowed_tools"):
        choice = choose_placement(Settings.from_environ({}, argv))
    assert choice.placement == LAST_MESSAGE
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].endswith(choice.notes[0]), warnings
    assert ("prompt reuse holds within an agent loop (tool results appended after the last user "
            "message) but not across user turns: " + CATALOG_MOVES) in warnings[0]


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


# ----------------------------------------------------------------------------------------- reuse

#: what a user turn appends to the transcript's last history: the agent's answer, then the user
FINAL_ANSWER = {"role": "assistant", "content": "All five steps are done."}
FOLLOW_UP = {"role": "user", "content": "Thanks. Now the second list, please."}
THOUGHT = "Think it through."
#: percent of each previous prompt's history the next prompt begins with (in-process, tiny
#: tokenizer, the benchmark's transcript): within the agent loop (turns 2-6, one call and its
#: result more each), across a user turn (after turn 6, an answer and a user message), and across
#: that user turn with every assistant turn's reasoning passed back. Unlisted: 100, 100, 100.
REUSE = {
    # the system message shows only inside the last user message, while that is the last message
    # (turn 1 only); the catalog sits before the last user message
    "mistralai-Mistral-Nemo-Instruct-2407": (99, 0, 0),
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503": (100, 20, 20),
    "tool_chat_template_mistral3": (100, 20, 20),
    # reasoning rendered only after the last user message (or final answer)
    "GLM-4.6": (100, 100, 70),
    "Qwen-Qwen3-0.6B": (100, 100, 73),
    "moonshotai-Kimi-K2-Thinking": (100, 100, 53),
    "unsloth-MiniMax-M2": (100, 100, 59),
}


def _with_reasoning(messages: list[dict]) -> list[dict]:
    """The history as a thinking model's client replays it: every assistant turn with its
    reasoning (vLLM hands a template both keys)."""
    return [{**message, "reasoning": THOUGHT, "reasoning_content": THOUGHT}
            if message["role"] == "assistant" else message for message in messages]


def _placed(template: ServedTemplate, placement: str, messages: list[dict], allowed, tools) -> str:
    body = place_policy({"messages": [dict(m) for m in messages]}, "chat", placement, "auto", allowed)
    return template.render(body["messages"], tools, {})


def _kept(template: ServedTemplate, placement: str, before: tuple, after: tuple, tools) -> tuple[int, int]:
    """(of the prompt ``before``'s history, up to the end of its last message's text, the tokens
    the prompt ``after`` begins with; that history's tokens). One token of slack, where a tokenizer
    merges the history's last token with what follows it, as the probe allows."""
    first = _placed(template, placement, *before, tools)
    last = before[0][-1]["content"]
    history = len(template.tokenize(first[:first.rfind(last) + len(last)]))
    shared = common_prefix_length(template.tokenize(first),
                                  template.tokenize(_placed(template, placement, *after, tools)))
    return min(shared + 1, history), history


def measure_reuse(bench, template: ServedTemplate, placement: str) -> tuple[int, int, int]:
    """The three figures of :data:`REUSE` for one template under its placement."""
    transcript = bench.make_transcript()
    tools = canonical_tools(transcript.tools, "chat")
    turns = [(transcript.messages(turn, arguments_as_text=False), transcript.allowed[turn - 1])
             for turn in range(1, bench.TURNS + 1)]
    loop = [_kept(template, placement, a, b, tools) for a, b in zip(turns, turns[1:])]
    figures = [sum(kept for kept, _ in loop) / sum(history for _, history in loop)]
    for history in (turns[-1][0], _with_reasoning(turns[-1][0])):
        kept, total = _kept(template, placement, (history, turns[-1][1]),
                            ([*history, FINAL_ANSWER, FOLLOW_UP], transcript.allowed[0]), tools)
        figures.append(kept / total)
    loop_reasoning = [_kept(template, placement, (_with_reasoning(a[0]), a[1]),
                            (_with_reasoning(b[0]), b[1]), tools) for a, b in zip(turns, turns[1:])]
    lost = [history - kept for kept, history in loop]
    assert [history - kept for kept, history in loop_reasoning] == lost   # the loop keeps reasoning
    return tuple(round(100 * figure) for figure in figures)


@pytest.mark.parametrize("name", sorted(PLACEMENT))
def test_reuse_within_the_agent_loop_and_across_a_user_turn(bench, tokenizer, name: str) -> None:
    measured = measure_reuse(bench, served(name, tokenizer), PLACEMENT[name])
    assert measured == REUSE.get(name, (100, 100, 100)), f"{name}: {measured}"


def _doc_rows() -> dict[str, list[str]]:
    """The template table of docs/serving.md: template name -> its other cells."""
    rows = {}
    for line in SERVING_DOC.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if match and match.group(1) in TEMPLATES:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_the_docs_template_table_says_what_the_tests_measure() -> None:
    rows = _doc_rows()
    assert sorted(rows) == TEMPLATES, "docs/serving.md's template table lacks or adds templates"
    for name, cells in rows.items():
        expected = [PLACEMENT[name], *(f"{figure}%" for figure in REUSE.get(name, (100, 100, 100)))] \
            if name in PLACEMENT else ["refused", "–", "–", "–"]
        assert cells[:4] == expected, f"{name}: the docs say {cells[:4]}, the tests {expected}"


def test_kimi_k2_thinking_re_renders_at_a_user_turn_exactly_the_reasoning_it_drops(bench, tokenizer) -> None:
    """Kimi-K2-Thinking renders an assistant turn's reasoning only after its last assistant turn
    without calls (the final answer), each earlier one with an empty ``<think></think>``. So once an
    answer and a user message follow an agent loop whose reasoning was passed back, the next prompt
    leaves the previous one exactly inside the loop's first call, at its reasoning, under every
    placement the probe accepts (no placement can keep it); the answer's own reasoning is never
    rendered back. Without reasoning in the history the whole history is kept."""
    template = served("moonshotai-Kimi-K2-Thinking", tokenizer)
    transcript = bench.make_transcript()
    tools = canonical_tools(transcript.tools, "chat")
    history = _with_reasoning(transcript.messages(bench.TURNS, arguments_as_text=False))
    answer = {**FINAL_ANSWER, "reasoning": "Answer it.", "reasoning_content": "Answer it."}
    for placement in (SYSTEM_MESSAGE, LAST_MESSAGE):
        assert check_placement(template.render, placement, template.tokenize) is None
        before = _placed(template, placement, history, ["read_contact"], tools)
        after = _placed(template, placement, [*history, answer, FOLLOW_UP], ["read_contact"], tools)
        first_call = before.index(f"<think>{THOUGHT}</think><|tool_calls_section_begin|>")
        assert common_prefix_length(before, after) == first_call + len("<think>")
        assert THOUGHT not in after and "Answer it." not in after
        assert after.count("<think></think>") == bench.TURNS   # five calls and the answer


def test_start_up_says_what_a_thinking_template_drops_at_a_user_turn(model_dir, caplog) -> None:
    argv = ["vllm", "serve", str(model_dir), "--tool-call-parser", "allowed_hermes",
            "--chat-template", str(CORPUS / "moonshotai-Kimi-K2-Thinking.jinja")]
    with caplog.at_level("INFO", logger="vllm.allowed_tools"):
        choice = choose_placement(Settings.from_environ({}, argv))
    said = {r.levelname: r.getMessage() for r in caplog.records if "new user turn" in r.getMessage()}
    assert list(said) == ["INFO"] and choice.notes == [choice.probe.reasoning_note]
    assert ("reasoning passed back in the history is reused within an agent loop but prefilled "
            "again at each new user turn: an assistant turn's " + REASONING_DROPPED) in said["INFO"]

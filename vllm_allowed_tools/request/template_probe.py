"""Find, by rendering, where a chat template lets the per-turn policy go without breaking the
prompt-cache prefix.

A template is served unmodified, so which placement works (see :mod:`.placement`) can only be
learned by rendering probe conversations through it: with two different allowed subsets, and with
one more agent step in the history. A placement passes when

(a) everything up to the end of the history renders identically for both subsets, token for token,
    and the next turn's prompt begins with the same history (what vLLM's prefix cache reuses);
(b) the allowed names of each subset appear after the history (the model is told the subset);
(c) reordering ``tools`` changes nothing, once the catalog is put in canonical order.

Those are what an agent loop needs (each step appends a call and its result after the last user
message). A new user turn is probed too, after a placement passes, since some templates move part
of the history when a user message arrives (Mistral's put the catalog before the LAST user message;
several drop the reasoning of earlier turns): the server still starts, and says so. Where no
placement passes, the probe also says what of the conversation the template leaves out (a template
that renders only user messages has nowhere to show the allowed names after the history).

The probe is pure: the caller supplies ``render`` (the served template, rendered as the server
renders it) and optionally ``tokenize`` (the served tokenizer); without one, text is compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .placement import PROBE_ORDER, TEMPLATE_KWARG, TEMPLATE_VARIABLE, canonical_tools, place_policy

#: (messages, tools, extra template variables) -> the prompt text, generation prompt included
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]], str]
Tokenize = Callable[[str], Sequence[int]]

_MARK = "q7zx"   # makes the probe's markers unlikely to occur in any template text
#: two subsets of tools the probe history never calls (a called name shows up in the history)
SUBSET_A = ("auto", ("probe_bravo",))
SUBSET_B = ("required", ("probe_charlie", "probe_delta"))


@dataclass(frozen=True)
class ProbeResult:
    """The placement chosen (None: none passed), why each placement tried before failed, and what
    the template does with the history that no placement can change."""
    placement: str | None
    reasons: dict[str, str] = field(default_factory=dict)
    #: where none passed: what of the conversation the template leaves out of its prompt
    dropped: str | None = None
    #: where one passed: why a new user turn's prompt does not begin with this turn's history
    user_turn: str | None = None
    #: where one passed: what of reasoning passed back in the history a new user turn re-renders
    user_turn_reasoning: str | None = None

    def explain(self) -> str:
        """Why no placement passed (the template's own reason first), for a refusal."""
        reasons = "; ".join(f"{name}: {why}" for name, why in self.reasons.items())
        if self.dropped:
            return f"{self.dropped} ({reasons})" if reasons else self.dropped
        return reasons or "no placement tried"

    @property
    def user_turn_note(self) -> str | None:
        """The history itself moves at a user turn: a warning (the prefix guarantee is partial)."""
        return None if not self.user_turn else (
            "prompt reuse holds within an agent loop (tool results appended after the last user "
            f"message) but not across user turns: {self.user_turn}")

    @property
    def reasoning_note(self) -> str | None:
        """Reasoning passed back is dropped at a user turn: the model's own design, said for
        information (the catalog and the rest of the history stay a prefix)."""
        return None if not self.user_turn_reasoning else (
            "reasoning passed back in the history is reused within an agent loop but prefilled "
            f"again at each new user turn: {self.user_turn_reasoning}")

    def reuse_notes(self) -> list[str]:
        """What the prefix cache cannot reuse although the placement passed, one sentence each."""
        return [note for note in (self.user_turn_note, self.reasoning_note) if note]


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"Probe tool {name} {_MARK}.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


PROBE_TOOLS = [_tool(name) for name in ("probe_alpha", "probe_bravo", "probe_charlie", "probe_delta")]


def _step(number: int, name: str, reasoning: bool = False) -> list[dict[str, Any]]:
    """One agent step as vLLM hands it to a template: a call (arguments as a dict) and its result;
    with ``reasoning``, the call's reasoning passed back (vLLM sets both of these keys)."""
    call_id = f"call{number:05d}"   # 9 characters: Mistral-family templates insist
    call: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": name, "arguments": {"x": f"arg-{number}-{_MARK}"}}}]}
    if reasoning:
        call["reasoning"] = call["reasoning_content"] = f"reasoning-{number}-{_MARK}"
    return [call, {"role": "tool", "tool_call_id": call_id, "name": name,
                   "content": f"result-{number}-{_MARK}"}]


def probe_history(steps: int = 1, reasoning: bool = False) -> list[dict[str, Any]]:
    history = [{"role": "system", "content": f"system-{_MARK}"},
               {"role": "user", "content": f"user-{_MARK}"}]
    for number in range(1, steps + 1):
        history += _step(number, "probe_alpha", reasoning)
    return history


#: what a new user turn adds to the probe history: the agent's final answer, then the user
FOLLOW_UP = [{"role": "assistant", "content": f"answer-{_MARK}"},
             {"role": "user", "content": f"follow-up-{_MARK}"}]


def _markers(history: list[dict[str, Any]]) -> list[str]:
    return [message["content"] for message in history if message.get("content")]


def _prompt(render: Render, history: list[dict[str, Any]], placement: str, subset: tuple,
            tools: list[dict[str, Any]] | None = None) -> str:
    mode, names = subset
    body = place_policy({"messages": copy.deepcopy(history)}, "chat", placement, mode, names)
    variables = {TEMPLATE_KWARG: {"mode": mode, "names": sorted(names)}} \
        if placement == TEMPLATE_VARIABLE else {}
    return render(body["messages"], canonical_tools(tools or PROBE_TOOLS, "chat"), variables)


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (tokens, characters) two sequences share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _shares_history(first: str, second: str, cut: int, tokenize: Tokenize | None) -> bool:
    """Both prompts render the history (``first[:cut]``) identically, token for token (a
    tokenizer may merge the history's last token with what follows it: one token of slack)."""
    if first[:cut] != second[:cut]:
        return False
    if tokenize is None:
        return True
    history_tokens = len(tokenize(first[:cut]))
    return common_prefix_length(tokenize(first), tokenize(second)) >= history_tokens - 1


def _history_end(prompt: str, plain: str, history: list[dict[str, Any]]) -> int | str:
    """Where the history ends in ``prompt``: after the last of its messages the template renders
    at all (some drop a system message, for one); a str says why it cannot be found."""
    position = 0
    for marker in [marker for marker in _markers(history) if marker in plain]:
        found = prompt.find(marker, position)
        if found < 0:
            return f"the history is not rendered in order (missing {marker!r})"
        position = found + len(marker)
    return position


def check_placement(render: Render, placement: str, tokenize: Tokenize | None = None) -> str | None:
    """Why ``placement`` does not keep the history a stable prefix under this template (None: it
    does). Rendering errors are reasons too: a template may refuse a message where we put one."""
    history = probe_history(1)
    try:
        plain = render(copy.deepcopy(history), canonical_tools(PROBE_TOOLS, "chat"), {})
        prompt_a = _prompt(render, history, placement, SUBSET_A)
        prompt_b = _prompt(render, history, placement, SUBSET_B)
        next_turn = _prompt(render, probe_history(2), placement, SUBSET_B)
        reordered = _prompt(render, history, placement, SUBSET_A, tools=PROBE_TOOLS[::-1])
    except Exception as exc:  # noqa: BLE001 - a template raises what it likes (TemplateError, TypeError, ...)
        return f"rendering failed: {type(exc).__name__}: {exc}"
    cut = _history_end(prompt_a, plain, history)
    if isinstance(cut, str):
        return cut
    if not _shares_history(prompt_a, prompt_b, cut, tokenize):
        return "two allowed subsets render the history differently (the policy lands inside it)"
    if not _shares_history(prompt_a, next_turn, cut, tokenize):
        return "the next turn's prompt does not begin with this turn's history"
    for (_mode, names), prompt, other in ((SUBSET_A, prompt_a, prompt_b), (SUBSET_B, prompt_b, prompt_a)):
        # counted against the other subset's prompt: a catalog rendered after the history names
        # every tool in both, the policy names only its own
        missing = [name for name in names if prompt[cut:].count(name) <= other[cut:].count(name)]
        if missing:
            return f"the allowed names are not rendered after the history (missing {missing})"
    if reordered != prompt_a:
        return "reordering tools changes the prompt even in canonical order (a nondeterministic template)"
    return None


def check_user_turn(render: Render, placement: str, tokenize: Tokenize | None = None,
                    reasoning: bool = False) -> str | None:
    """Why the prompt of a new user turn (the agent's final answer and a user message appended)
    does not begin with this turn's history under ``placement`` (None: it does), saying what moves.
    With ``reasoning``, the history's call carries its reasoning, as a thinking model's client
    passes it back. A template that refuses the follow-up is a reason too."""
    history = probe_history(1, reasoning)
    try:
        plain = render(copy.deepcopy(history), canonical_tools(PROBE_TOOLS, "chat"), {})
        prompt = _prompt(render, history, placement, SUBSET_A)
        follow_up = _prompt(render, [*history, *FOLLOW_UP], placement, SUBSET_B)
    except Exception as exc:  # noqa: BLE001 - a template raises what it likes
        return f"rendering a new user turn failed: {type(exc).__name__}: {exc}"
    cut = _history_end(prompt, plain, history)
    if isinstance(cut, str) or _shares_history(prompt, follow_up, cut, tokenize):
        return None   # (a history out of order already failed check_placement)
    diverges = common_prefix_length(prompt, follow_up)
    catalog = PROBE_TOOLS[0]["function"]["description"]
    if diverges <= prompt.find(catalog) < cut and follow_up.find(catalog) > prompt.find(catalog):
        return ("the tool catalog is rendered just before the last user message, so each new "
                "user message moves the catalog, and everything from it on is prefilled again")
    thought = history[2].get("reasoning")   # the call's (the history: system, user, call, result)
    if thought and diverges <= prompt.find(thought) < cut and thought not in follow_up:
        return ("an assistant turn's reasoning is rendered only after the last user message (or "
                "final answer), so the reasoning of the turns before it is dropped and the prompt "
                "is prefilled again from the first of them on")
    return f"a new user turn renders the history differently from {prompt[diverges:diverges + 40]!r} on"


#: what the probe history holds, each found by the marker the template would render
_PARTS = (("the system message", f"system-{_MARK}"), ("the assistant's tool call", f"arg-1-{_MARK}"),
          ("the tool result", f"result-1-{_MARK}"))


def dropped_parts(render: Render) -> str | None:
    """What of an agent conversation (system message, user message, a call, its result, and a
    system message after them) the template leaves out of its prompt, said as why no placement
    can show the allowed names after the history; None where it renders them all (or raises:
    then the placements' reasons say what failed)."""
    history = probe_history(1)
    tools = canonical_tools(PROBE_TOOLS, "chat")
    try:
        plain = render(copy.deepcopy(history), tools, {})
    except Exception:  # noqa: BLE001 - reported by check_placement
        return None
    missing = [part for part, marker in _PARTS if marker not in plain]
    try:
        trailing = render([*copy.deepcopy(history), {"role": "system", "content": f"policy-{_MARK}"}],
                          tools, {})
        if f"policy-{_MARK}" not in trailing:
            missing.append("a system message after them")
    except Exception:  # noqa: BLE001 - a template may refuse a late system message: reported too
        pass
    if not missing or f"user-{_MARK}" not in plain:
        return None
    listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
    only = " (it renders only the user messages)" if len(missing) == len(_PARTS) + 1 else ""
    blind = {"the tool result", "a system message after them"} <= set(missing)
    so = ", so neither a message after the history nor the text of its last message reaches the " \
        "model" if blind else ""
    return f"the template leaves {listed} out of the prompt{only}{so}"


def probe_template(render: Render, tokenize: Tokenize | None = None,
                   order: Sequence[str] = PROBE_ORDER) -> ProbeResult:
    """The first placement in ``order`` that passes :func:`check_placement`, with what a new user
    turn does to the prefix under it; where none passes, what the template leaves out."""
    reasons: dict[str, str] = {}
    for placement in order:
        why = check_placement(render, placement, tokenize)
        if why is None:
            user_turn = check_user_turn(render, placement, tokenize)
            reasoning = None if user_turn else check_user_turn(render, placement, tokenize, True)
            return ProbeResult(placement, reasons, user_turn=user_turn, user_turn_reasoning=reasoning)
        reasons[placement] = why
    return ProbeResult(None, reasons, dropped=dropped_parts(render))

"""Find, by rendering, where a chat template lets the per-turn policy go without breaking the
prompt-cache prefix.

A template is served unmodified, so which placement works (see :mod:`.placement`) can only be
learned by rendering probe conversations through it: with two different allowed subsets, and with
one more agent step in the history. A placement passes when

(a) everything up to the end of the history renders identically for both subsets, token for token,
    and the next turn's prompt begins with the same history (what vLLM's prefix cache reuses);
(b) the allowed names of each subset appear after the history (the model is told the subset);
(c) reordering ``tools`` changes nothing, once the catalog is put in canonical order.

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
    """The placement chosen (None: none passed) and why each placement tried before failed."""
    placement: str | None
    reasons: dict[str, str] = field(default_factory=dict)

    def explain(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons.items()) or "no placement tried"


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"Probe tool {name} {_MARK}.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


PROBE_TOOLS = [_tool(name) for name in ("probe_alpha", "probe_bravo", "probe_charlie", "probe_delta")]


def _step(number: int, name: str) -> list[dict[str, Any]]:
    """One agent step as vLLM hands it to a template: a call (arguments as a dict) and its result."""
    call_id = f"call{number:05d}"   # 9 characters: Mistral-family templates insist
    return [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": {"x": f"arg-{number}-{_MARK}"}}}]},
        {"role": "tool", "tool_call_id": call_id, "name": name,
         "content": f"result-{number}-{_MARK}"},
    ]


def probe_history(steps: int = 1) -> list[dict[str, Any]]:
    history = [{"role": "system", "content": f"system-{_MARK}"},
               {"role": "user", "content": f"user-{_MARK}"}]
    for number in range(1, steps + 1):
        history += _step(number, "probe_alpha")
    return history


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
    # the history is what the template renders of it (some drop a system message, for one)
    position = 0
    for marker in [marker for marker in _markers(history) if marker in plain]:
        found = prompt_a.find(marker, position)
        if found < 0:
            return f"the history is not rendered in order (missing {marker!r})"
        position = found + len(marker)
    cut = position
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


def probe_template(render: Render, tokenize: Tokenize | None = None,
                   order: Sequence[str] = PROBE_ORDER) -> ProbeResult:
    """The first placement in ``order`` that passes :func:`check_placement`."""
    reasons: dict[str, str] = {}
    for placement in order:
        why = check_placement(render, placement, tokenize)
        if why is None:
            return ProbeResult(placement, reasons)
        reasons[placement] = why
    return ProbeResult(None, reasons)

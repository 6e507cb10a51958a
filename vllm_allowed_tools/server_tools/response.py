"""The response side of server-side tools: what the client sees of each call the hook decided.

vLLM writes every server-side call into the response as an item (``mcp_call`` for ``container``,
``web_search_call`` for ``browser``; unary ``python`` calls are reasoning items, streamed ones
``code_interpreter_call``), executed or not. The hook's :class:`~.turn.ServerTurn` says which ran
(their ``mcp_call`` gets its ``output`` and ``approval_request_id``), which paused (the item
becomes the approval item: ``mcp_approval_request`` or an ``elicitation``) and which was refused
(the turn ends as a violation). Pure over JSON; no vLLM.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from ..metrics import record_server_tool_failure
from ..response import NEXT_NUMBER, ResponsesStream
from ..response.violations import AllowedToolsViolation
from .server_turn import ServerDecision, ServerTurn

__all__ = ["ServerToolStream", "apply_to_response", "approval_item", "refusal_violation"]

SERVER_ITEM_TYPES = frozenset({"mcp_call", "web_search_call", "code_interpreter_call"})
_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def approval_item(decision: ServerDecision) -> dict[str, Any]:
    """The item a paused call is sent as."""
    approval = decision.approval
    assert approval is not None and decision.tool is not None
    if decision.wire == "mcp":
        return {"type": "mcp_approval_request", "id": approval.id,
                "server_label": decision.tool.namespace, "name": decision.target.tool_name,
                "arguments": decision.arguments}
    return approval.to_json()


def refusal_violation(decision: ServerDecision, *, source: str) -> AllowedToolsViolation:
    return AllowedToolsViolation(
        f"The model called the server-side tool {decision.target.recipient!r}, which may not run "
        f"this turn ({decision.reason}); it was not run and the response stopped "
        "(allowed_tools_violation).", name=decision.target.recipient, source=source,
        kind="builtin")


def mcp_error(text: str) -> dict[str, Any]:
    """An ``mcp_call``'s ``error`` (OpenAI's ``McpToolExecutionError``)."""
    return {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": text}]}


def _is_server_item(item: Any) -> bool:
    return isinstance(item, Mapping) and item.get("type") in SERVER_ITEM_TYPES


#: why a call item has no decision: vLLM's loop never asked to run it (the generation ended
#: before the call did, so harmony's parser never completed it as a message)
CUT_OFF = "the call was cut off by the token limit (max_output_tokens)"
NOT_FINISHED = "the call did not finish"


def _undecided_item(item: Mapping[str, Any], why: str, *, count: bool = True) -> dict[str, Any]:
    """The item of a call vLLM wrote but never asked to run: never run, so never ``completed``
    (counted as ``cut_off`` once: ``count`` False where the item was counted already)."""
    out = {**item, "status": "incomplete"}
    if out.get("type") == "mcp_call":   # the other items have no error field
        out["error"] = mcp_error(f"{why}; this call was not run")
        out.pop("output", None)
    if count:
        record_server_tool_failure("cut_off")
    return out


def _why_undecided(response: Mapping[str, Any] | None) -> str:
    details = (response or {}).get("incomplete_details")
    return CUT_OFF if isinstance(details, Mapping) and details.get("reason") == "max_output_tokens" \
        else NOT_FINISHED


def _executed_item(turn: ServerTurn, index: int, item: Mapping[str, Any]) -> dict[str, Any]:
    """``item`` (the ``index``-th executed call's) with what the run gave."""
    out = dict(item)
    if index < len(turn.executed) and out.get("type") != "mcp_call":
        if turn.executed[index].error is not None:   # no error field: the status says it
            out["status"] = "failed"
        return out
    if index < len(turn.executed) and out.get("type") == "mcp_call":
        run = turn.executed[index]
        if run.output is not None:
            out["output"] = run.output
        if run.error is not None:
            out["error"] = mcp_error(run.output or run.error)
        if run.elicitation_id is not None:
            out["approval_request_id"] = run.elicitation_id
        out["status"] = "completed" if run.error is None else "failed"
    return out


def _resumed_item(turn: ServerTurn) -> dict[str, Any] | None:
    """The item of the call this request resumed (run, or refused), which vLLM never streams."""
    resume = turn.resume
    if resume is None:
        return None
    tool = turn.tools.for_builtin(resume.target.builtin)
    item: dict[str, Any] = {"id": "mcp_" + secrets.token_hex(12), "type": "mcp_call",
                            "server_label": tool.namespace if tool else resume.target.builtin,
                            "name": resume.target.tool_name, "arguments": resume.arguments,
                            "approval_request_id": resume.elicitation_id}
    if resume.refusal is not None:
        item.update(status="failed", error=mcp_error(resume.refusal))
        return item
    run = turn.executed[0] if turn.executed else None
    item.update(status="completed" if run is not None and run.error is None else "failed")
    if run is not None and run.output is not None:
        item["output"] = run.output
    if run is None or run.error is not None:
        item["error"] = mcp_error(run.error if run is not None and run.error else "not run")
    return item


def _browser_mcp_item(item: Any) -> bool:
    """vLLM's stream shows a ``browser`` call twice at one output index: as an ``mcp_call`` named
    ``browser.<tool>`` while it is written, then as the ``web_search_call`` (its unary answer has
    only the latter)."""
    return isinstance(item, Mapping) and item.get("type") == "mcp_call" \
        and str(item.get("name") or "").startswith("browser.")


def _failed_event(event: dict[str, Any], item: Mapping[str, Any]) -> dict[str, Any]:
    """An ``mcp_call``'s ``completed`` event, ``failed`` when its call did not complete."""
    if item and event.get("type") == "response.mcp_call.completed" \
            and item.get("status") != "completed":
        return {**event, "type": "response.mcp_call.failed"}
    return event


def _reasoning_text(item: Mapping[str, Any]) -> str:
    return "".join(part.get("text", "") for part in item.get("content") or ()
                   if isinstance(part, Mapping))


def _stopped_item(item: Mapping[str, Any], decision: ServerDecision) -> dict[str, Any]:
    """The item of a call the loop ended at, not run: ``status: incomplete`` and why."""
    if decision.verdict == "incomplete":
        why = f"{decision.reason}; this call was not run"
    else:
        why = ("max_tool_calls reached (the request's, or the server's "
               "VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS); this call was not run")
    out = {**item, "status": "incomplete"}
    if out.get("type") == "mcp_call":   # the other items have no error field
        out["error"] = mcp_error(why)
        out.pop("output", None)
    return out


def apply_to_response(turn: ServerTurn, response: dict[str, Any], *,
                      count_undecided: bool = True) -> dict[str, Any]:
    """A unary Responses object (or a stream's terminal snapshot) with the turn's decisions
    applied; raises :class:`AllowedToolsViolation` when a call was refused. A call item past the
    turn's runs was never asked about (the generation ended inside it): ``incomplete``, counted
    once (a stream's snapshot repeats the items its events counted: ``count_undecided`` False)."""
    refused = turn.refused
    if refused is not None:
        raise refusal_violation(refused, source="unary_guard")
    output = response.get("output")
    if not isinstance(output, list):
        return response
    new = list(output)
    server_at = [i for i, item in enumerate(new) if _is_server_item(item)]
    paused = turn.paused
    if paused is not None:
        # the loop stopped at the paused call: vLLM's item of it is the last server-side item (a
        # unary python call is a reasoning item holding the code)
        at = server_at.pop() if server_at else None
        if at is None and paused.target.builtin == "python":
            at = next((i for i in range(len(new) - 1, -1, -1)
                       if isinstance(new[i], Mapping) and new[i].get("type") == "reasoning"), None)
        item = approval_item(paused)
        if at is None:
            new.append(item)
        else:
            new[at] = item
    stopped = turn.stopped
    if stopped is not None and server_at:   # the loop stopped there: the last item, not run
        at = server_at.pop()
        new[at] = _stopped_item(new[at], stopped)
    resume = turn.resume
    runs = 0   # executed[runs] is the next server-side item's run
    for n, i in enumerate(server_at):
        if n == 0 and resume is not None and resume.refusal is not None:
            new[i] = {**new[i], "status": "failed", "error": mcp_error(resume.refusal),
                      "approval_request_id": resume.elicitation_id}
            new[i].pop("output", None)
            continue
        new[i] = _executed_item(turn, runs, new[i]) if runs < len(turn.executed) else \
            _undecided_item(new[i], _why_undecided(response), count=count_undecided)
        runs += 1
    if resume is not None and not server_at:
        if resume.target.builtin == "python":   # vLLM shows a python call as reasoning
            at = next((i for i, it in enumerate(new) if isinstance(it, Mapping)
                       and it.get("type") == "reasoning"
                       and _reasoning_text(it) == resume.arguments), None)
            if at is not None:
                del new[at]
        item = _resumed_item(turn)
        if item is not None:
            new.insert(0, item)
    response["output"] = new
    return response


class ServerToolStream:
    """A step on a Responses stream: each server-side call item is held from its ``added`` until
    the event after its ``done`` (vLLM decides, and runs, the call in between), then passed on with
    its output, sent as the approval item, or the stream ends as a violation. The call this
    request resumed is sent first (vLLM never streams it)."""

    def __init__(self, turn: ServerTurn, stream: ResponsesStream) -> None:
        self.turn = turn
        self.stream = stream
        stream.steps.append(self)
        self._held: list[dict[str, Any]] = []
        self._held_index: Any = None
        self._dropping: Any = None  # the output index of vLLM's mcp_call twin of a browser call
        self._awaiting = False      # the held item is done; the next event settles it
        self._seen = 0              # server-side items settled so far
        self._executed = 0
        self._offset = 0            # items this step added before upstream's
        self._injected = turn.resume is None
        self._resumed_item: dict[str, Any] | None = None

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def drain(self) -> list[dict[str, Any]]:
        return self._settle() if self._held else []

    def process(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        kind = event.get("type", "")
        if not self._injected and (kind.startswith("response.output_item") or kind in _TERMINAL):
            out += self._inject()
        if self._awaiting:
            out += self._settle(event)
            if self.stream.terminal:
                return out
        item = event.get("item")
        if kind == "response.output_item.added" and _browser_mcp_item(item):
            self._dropping = event.get("output_index")   # its web_search_call follows there
            return out
        if self._dropping is not None and event.get("output_index") == self._dropping \
                and (kind.startswith("response.mcp_call") or kind == "response.output_item.done"
                     and _browser_mcp_item(item)):
            if kind == "response.output_item.done":
                self._dropping = None
            return out
        if kind == "response.output_item.added" and _is_server_item(item):
            self._held = [event]
            self._held_index = event.get("output_index")
            return out
        if self._held and event.get("output_index") == self._held_index \
                and kind.startswith("response."):
            self._held.append(event)
            if kind == "response.output_item.done":
                self._awaiting = True
            return out
        if kind in _TERMINAL and isinstance(event.get("response"), dict):
            event = self._terminal(event)
            if self.stream.terminal:
                return out + self.stream._closing()
        return out + [self._shifted(event)]

    def _shifted(self, event: dict[str, Any]) -> dict[str, Any]:
        index = event.get("output_index")
        if self._offset and isinstance(index, int) and not isinstance(index, bool):
            return {**event, "output_index": index + self._offset}
        return event

    def _inject(self) -> list[dict[str, Any]]:
        self._injected = True
        item = _resumed_item(self.turn)
        if item is None:
            return []
        self._resumed_item = item
        self._offset = 1
        return [{"type": kind, "output_index": 0, "item": item, "sequence_number": NEXT_NUMBER}
                for kind in ("response.output_item.added", "response.output_item.done")]

    def _settle(self, after: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """The held call's events, decided: vLLM's n-th server-side call is the turn's n-th
        decision (the loop decides each call once, in order, before the next event)."""
        held, self._held, self._awaiting = self._held, [], False
        skip = 1 if self.turn.resume is not None and self.turn.resume.refusal is None else 0
        decisions = self.turn.decisions[skip:]
        decision = decisions[self._seen] if self._seen < len(decisions) else None
        self._seen += 1
        if decision is None:   # never decided (cut off before it completed): never run
            why = CUT_OFF if after is not None and after.get("type") == "response.incomplete" \
                and _why_undecided(after.get("response")) == CUT_OFF else NOT_FINISHED
            return self._released(held, lambda item: _undecided_item(item, why))
        if decision.verdict == "refuse":
            return self.stream.terminate(refusal_violation(decision, source="stream_guard"))
        index = held[0].get("output_index")
        if decision.verdict in ("stop", "incomplete"):
            return self._released(held, lambda item: _stopped_item(item, decision))
        if decision.verdict == "pause":
            item = approval_item(decision)
            return [self._shifted({"type": kind, "output_index": index, "item": item,
                                   "sequence_number": NEXT_NUMBER})
                    for kind in ("response.output_item.added", "response.output_item.done")]
        n = self._executed + (1 if self.turn.resume is not None
                              and self.turn.resume.refusal is None else 0)
        self._executed += 1
        return self._released(held, lambda item: _executed_item(self.turn, n, item))

    def _released(self, held: list[dict[str, Any]],
                  final: Callable[[Mapping[str, Any]], dict[str, Any]]) -> list[dict[str, Any]]:
        """The held events, the ``done`` one carrying ``final`` of its item (its ``completed``
        event ``failed`` where the final item is not completed)."""
        done = next((final(e["item"]) for e in held if e.get("type") == "response.output_item.done"
                     and isinstance(e.get("item"), Mapping)), {})
        return [self._shifted({**e, "item": done} if e.get("type") == "response.output_item.done"
                              and done else _failed_event(e, done)) for e in held]

    def _terminal(self, event: dict[str, Any]) -> dict[str, Any]:
        event = copy.copy(event)
        response = copy.deepcopy(event["response"])
        try:
            if self._resumed_item is not None:
                # the snapshot is vLLM's; the resumed call is shown as streamed
                output = list(response.get("output") or [])
                first = next((n for n, i in enumerate(output) if _is_server_item(i)), None)
                if first is not None and output[first].get("arguments") == \
                        self._resumed_item["arguments"]:
                    del output[first]   # vLLM's item of the resumed call: shown as streamed
                response["output"] = output
                view = _shifted_turn(self.turn)
                view.resume = None
                apply_to_response(view, response, count_undecided=False)
                response["output"] = [self._resumed_item, *response["output"]]
            else:
                apply_to_response(self.turn, response, count_undecided=False)
        except AllowedToolsViolation as violation:
            self.stream.fail(violation)
            return event
        event["response"] = response
        return event


def _shifted_turn(turn: ServerTurn) -> ServerTurn:
    """``turn`` as seen past its resumed call (its first execution and decision)."""
    view = copy.copy(turn)
    if turn.resume is not None and turn.resume.refusal is None:
        view.executed = turn.executed[1:]
        view.decisions = turn.decisions[1:]
    return view

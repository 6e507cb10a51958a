"""The agent loop over ``/v1/responses`` (streamed), pausing wherever the server asks a person.

A person's message starts a turn: the app sends the history, streams the answer to the page, runs
every call the server released (through :class:`~desk_tools.DeskTools`) and asks again for the
model's answer to the results. A response holding ``elicitation`` items ends the loop: the turn
waits for the person. Their answers go back as ``elicitation_response`` items appended to the
history, together with the elicitations, in one request, and only once every elicitation of the
response is answered or the person submits explicitly (then the server declines the unanswered
ones): the proposal's rule for clients.

Each event the loop yields is one JSON object for the page: ``item`` (a history item's view, see
:class:`conversation.Viewer`), ``text_delta`` (streamed text), ``desk`` (what the tools did),
then ``waiting`` (approvals to answer), ``done`` or, from the web layer, ``error``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from approval_options import ApprovalOptions
from conversation import Conversation, Viewer
from desk_tools import DeskTools, tool_definitions
from my_grants import GrantView, MyGrants
from tool_rule import TEXT_ANSWER, must_call, tools_asked_for
from turn_notes import released_by, turn_note

from vllm_allowed_tools.approvals.approval_errors import GrantStoreUnavailable

#: model requests one action of the person may cause (a call, its result, the answer, one spare)
MAX_STEPS = 4
ACTIONS = ("accept", "decline", "cancel")
#: sent after the calls' results (or declines) when the app asks for the model's answer: without
#: it SmolLM2 echoes the last tool output, markup and all (``<tool_response>...``); it is not kept
#: in the history and not shown
ANSWER_PROMPT = {"role": "user", "content": "Tell me in one short sentence what happened."}


class AgentError(Exception):
    """A request the server refused or a stream that broke; ``message`` is for the person."""


class AnswerError(ValueError):
    """Answers the app cannot send (unknown elicitation, a scope not offered, answers missing)."""


@dataclass
class Person:
    """One signed-in person: their API key (their identity to the server), chat and desk."""

    api_key: str
    tools: DeskTools
    conversation: Conversation = field(default_factory=Conversation)
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class Upstream:
    """Where the model is served: the base URL (``.../v1``) and the served model name."""

    base_url: str
    model: str = "tiny"
    #: a turn that must call: room for a whole call (an email's body is up to 160 characters)
    max_output_tokens: int = 160
    #: a text answer (after the calls, or to a message naming no tool): a sentence or two
    answer_tokens: int = 64


Event = dict[str, Any]


class Agent:
    """The loop for every person: ``say`` and ``answer`` check what they can before anything is
    sent (raising AnswerError) and return the turn's events to stream."""

    def __init__(self, upstream: Upstream, client: httpx.AsyncClient, viewer: Viewer,
                 options: ApprovalOptions, grants: MyGrants | None = None) -> None:
        self._upstream = upstream
        self._client = client
        self._viewer = viewer
        self._options = options
        self._grants = grants
        self._tools = tool_definitions()

    async def _live_grants(self, person: Person) -> list[GrantView]:
        """The person's live grants, for the page's notes only (none when the store is down:
        the server fails closed on its own, the page merely says less)."""
        if self._grants is None:
            return []
        try:
            return await asyncio.to_thread(self._grants.live, person.api_key)
        except GrantStoreUnavailable:
            return []

    def say(self, person: Person, text: str) -> AsyncIterator[Event]:
        """A new message from the person: one turn of the loop (AnswerError, before anything is
        sent, while approvals wait: a new message would decline them without asking)."""
        if person.conversation.pending:
            raise AnswerError("Answer the approval requests first, or submit your answers as "
                              "they are; a new message would decline them without asking you.")
        return self._said(person, text)

    async def _said(self, person: Person, text: str) -> AsyncIterator[Event]:
        chat = person.conversation
        message = {"role": "user", "content": text}
        chat.history.append(message)
        chat.turn_tools = tools_asked_for(text)
        choice = must_call(chat.turn_tools)
        yield {"type": "item", "item": self._viewer.view(chat, message)}
        note = turn_note(chat.turn_tools, "required" if chat.turn_tools else "none", self._options,
                         await self._live_grants(person), chat.session)
        chat.turn_notes[len(chat.history) - 1] = note
        yield {"type": "item", "item": note}
        async for event in self._loop(person, choice):
            yield event

    def answer(self, person: Person, answers: Sequence[Mapping[str, Any]], *,
               submit_now: bool) -> AsyncIterator[Event]:
        """The person's answers to the pending elicitations, sent as one follow-up request
        (AnswerError, before anything is sent, for answers the app cannot send)."""
        responses = self._responses(person.conversation, answers, submit_now=submit_now)
        return self._answered(person, responses)

    async def _answered(self, person: Person,
                        responses: list[dict[str, Any]]) -> AsyncIterator[Event]:
        chat = person.conversation
        pending_before, history_before = list(chat.pending), len(chat.history)
        chat.history.extend(responses)
        chat.pending = []
        for response in responses:
            yield {"type": "item", "item": self._viewer.view(chat, response)}
        accepted = any(r["action"] == "accept" for r in responses)
        choice = must_call(chat.turn_tools) if accepted else TEXT_ANSWER
        try:
            async for event in self._loop(person, choice, first_step_undo=history_before):
                yield event
        except AgentError:
            chat.pending = pending_before   # nothing was applied: the person may answer again
            raise

    # ------------------------------------------------------------------------------ the loop

    async def _loop(self, person: Person, choice: Any, *,
                    first_step_undo: int | None = None) -> AsyncIterator[Event]:
        chat = person.conversation
        for step in range(MAX_STEPS):
            body = self._body(chat, choice)
            undo = first_step_undo if step == 0 and first_step_undo is not None \
                else len(chat.history)
            try:
                items, cut = [], False
                async for event in self._stream(person.api_key, body):
                    if event["type"] == "delta":
                        yield {"type": "text_delta", "delta": event["delta"]}
                    elif event["type"] == "incomplete":
                        cut = True
                    else:
                        items.append(event["item"])
                if cut and not items:   # a call cut off at the limit is dropped, not shown as text
                    raise AgentError("The model reached its token limit before it finished, so "
                                     "nothing ran. Send a shorter request.")
            except AgentError:
                del chat.history[undo:]   # the server changed nothing for a refused request
                raise
            calls = []
            for item in items:
                kept = _history_item(item)
                if kept is None:
                    continue
                chat.history.append(kept)
                if kept.get("type") == "function_call":
                    calls.append(kept)   # shown below, once the app knows what released it
                    continue
                if kept.get("type") == "elicitation":
                    chat.pending.append(kept)
                yield {"type": "item", "item": self._viewer.view(chat, kept)}
            grants = await self._live_grants(person) if calls else []
            for call in calls:
                why = released_by(call, chat.history, self._options, grants, chat.session)
                if why is not None:
                    chat.released[call["call_id"]] = why
                yield {"type": "item", "item": self._viewer.view(chat, call)}
                run = await asyncio.to_thread(person.tools.run, call, body, chat.session)
                output = {"type": "function_call_output", "call_id": run.call_id,
                          "output": run.output}
                chat.history.append(output)
                yield {"type": "item", "item": self._viewer.view(chat, output)}
                yield {"type": "desk", "desk": person.tools.desk.to_json()}
            if chat.pending:
                yield {"type": "waiting", "pending": [item["id"] for item in chat.pending]}
                return
            if not calls:
                yield {"type": "done"}
                return
            choice = TEXT_ANSWER   # the results are in: ask for the model's answer to them
        yield {"type": "done"}

    def _body(self, chat: Conversation, choice: Any) -> dict[str, Any]:
        history = list(chat.history)
        if choice == TEXT_ANSWER and history and history[-1].get("role") != "user":
            history.append(ANSWER_PROMPT)   # the app's own ask, sent with this request only
        return {"model": self._upstream.model, "input": history, "tools": self._tools,
                "tool_choice": choice, "parallel_tool_calls": True, "stream": True,
                "prompt_cache_key": chat.session, "temperature": 0.0,
                "max_output_tokens": self._upstream.answer_tokens if choice == TEXT_ANSWER
                else self._upstream.max_output_tokens}

    async def _stream(self, api_key: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST the body; yield ``{"type": "delta"}`` text pieces and ``{"type": "item"}`` output
        items as the server completes them. A refusal or a failed response is an AgentError."""
        headers = {"Authorization": f"Bearer {api_key}"}
        url = self._upstream.base_url.rstrip("/") + "/responses"
        try:
            async with self._client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    raise AgentError(_error_text(response.status_code, await response.aread()))
                done = False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    kind = event.get("type")
                    if kind == "response.output_text.delta":
                        yield {"type": "delta", "delta": event.get("delta", "")}
                    elif kind == "response.output_item.done":
                        yield {"type": "item", "item": event["item"]}
                    elif kind == "response.completed":
                        done = True
                    elif kind == "response.incomplete":
                        done = True
                        yield {"type": "incomplete"}
                    elif kind in ("response.failed", "error"):
                        raise AgentError(_failure_text(event))
                if not done:
                    raise AgentError("The server's answer ended before it was complete. Send "
                                     "your message again.")
        except httpx.HTTPError as error:
            raise AgentError(f"The model server could not be reached ({error}). Check that it "
                             "runs, then send your message again.") from error

    @staticmethod
    def _responses(chat: Conversation, answers: Sequence[Mapping[str, Any]], *,
                   submit_now: bool) -> list[dict[str, Any]]:
        """The ``elicitation_response`` items for ``answers``, checked against what was asked."""
        by_id = {item["id"]: item for item in chat.pending}
        if not by_id:
            raise AnswerError("Nothing is waiting for an approval in this chat.")
        responses, seen = [], set()
        for answer in answers:
            elicitation = by_id.get(answer.get("elicitation_id"))
            if elicitation is None or elicitation["id"] in seen:
                raise AnswerError(f"{answer.get('elicitation_id')!r} is not an approval waiting "
                                  "for your answer in this chat (or it was answered twice).")
            seen.add(elicitation["id"])
            action, scope = answer.get("action"), answer.get("scope")
            if action not in ACTIONS:
                raise AnswerError(f"action must be one of {list(ACTIONS)}, got {action!r}.")
            if action == "accept" and scope not in elicitation.get("requested_scopes", ()):
                raise AnswerError(f"scope {scope!r} was not offered for {elicitation['name']}; "
                                  f"choose one of {elicitation.get('requested_scopes')}.")
            response = {"id": "er_" + secrets.token_hex(8), "type": "elicitation_response",
                        "elicitation_id": elicitation["id"], "action": action,
                        # the binding fields: the server checks them against its own record
                        "call_id": elicitation["call_id"],
                        "arguments_digest": elicitation["arguments_digest"],
                        "tool_definition_digest": elicitation["tool_definition_digest"]}
            if action == "accept":
                response["scope"] = scope
            reason = answer.get("reason")
            if action == "decline" and isinstance(reason, str) and reason.strip():
                response["reason"] = reason.strip()
            responses.append(response)
        missing = [item["name"] for item in chat.pending if item["id"] not in seen]
        if missing and not submit_now:
            raise AnswerError(f"Still waiting for your answer about {', '.join(missing)}: answer "
                              "it, or submit now (the server then declines what you left "
                              "unanswered).")
        return responses


def _history_item(item: dict[str, Any]) -> dict[str, Any] | None:
    """What of an output item the history keeps (and sends back next time)."""
    kind = item.get("type")
    if kind == "message":
        text = "".join(part.get("text", "") for part in item.get("content") or []
                       if part.get("type") == "output_text")
        return {"type": "message", "role": "assistant", "content": text}
    if kind == "function_call":
        kept = {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item.get("arguments", "")}
        if item.get("namespace"):
            kept["namespace"] = item["namespace"]
        return kept
    if kind == "elicitation":
        return dict(item)   # echoed exactly as the server sent it
    return None


def _error_text(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    message = error.get("message") if isinstance(error, dict) else None
    return f"The server refused the request ({status}): {message or body[:300].decode(errors='replace')}"


def _failure_text(event: Mapping[str, Any]) -> str:
    error = (event.get("response") or {}).get("error") or event.get("error") or event
    message = error.get("message") if isinstance(error, Mapping) else None
    return f"The server's answer failed: {message or json.dumps(error)[:300]}"

"""The web application: three plain pages, their static files and the JSON API they call.

A person signs in with their API key (their identity to the model server, and so to their grants);
the app keeps it server-side and gives the browser only an HttpOnly, SameSite=Strict cookie. Every
``/api`` route but sign-in needs that cookie (401 otherwise) and every POST a JSON body (415
otherwise): a page on another site can neither read nor forge these requests. Pages may load only
this app's own files (``Content-Security-Policy: default-src 'self'``): no CDN, no inline script.

Routes (all JSON unless said):

* ``GET /``, ``GET /approvals``, ``GET /sign-in``: the pages (HTML); the first two send a person
  who is not signed in to ``/sign-in``.
* ``POST /api/sign-in`` ``{"api_key"}``, ``POST /api/sign-out``.
* ``GET /api/chat``: the chat's items, the pending approvals' ids, the desk.
* ``POST /api/chat/messages`` ``{"text"}``, ``POST /api/chat/answers`` ``{"answers": [{"elicitation_id",
  "action", "scope", "reason"}], "submit_now"}``: the agent loop's events, one JSON object a line
  (``application/x-ndjson``), as they happen; ``POST /api/chat/new`` starts a new chat (session).
* ``GET /api/grants``: the signed-in person's live grants; ``POST /api/grants/{id}/revoke``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from approval_options import ApprovalOptions
from agent import Agent, AgentError, AnswerError, Event, Person, Upstream
from conversation import Conversation, Viewer
from desk_tools import DeskTools
from my_grants import MyGrants, NotYourGrant
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, \
    StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_allowed_tools.approvals.approval_errors import GrantStoreUnavailable

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "approval_chat"
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
     b"form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class SignIns:
    """Who is signed in: cookie token -> :class:`Person` (this app's memory; gone on restart)."""

    def __init__(self) -> None:
        self._people: dict[str, Person] = {}

    def add(self, api_key: str, person_label: str) -> str:
        token = secrets.token_urlsafe(32)
        self._people[token] = Person(api_key=api_key, tools=DeskTools(person_label))
        return token

    def find(self, request: Request) -> Person | None:
        token = request.cookies.get(COOKIE)
        return self._people.get(token) if token else None

    def remove(self, request: Request) -> None:
        self._people.pop(request.cookies.get(COOKIE) or "", None)


def _problem(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return _problem(415, "send a JSON body (Content-Type: application/json)")
    try:
        body = json.loads(await request.body())
    except ValueError:
        return _problem(400, "the body is not JSON")
    return body if isinstance(body, dict) else _problem(400, "the body must be a JSON object")


def _ndjson(person: Person, start: Callable[[], AsyncIterator[Event]],
            running: set[asyncio.Task[None]]) -> StreamingResponse:
    """Stream ``start()``'s events, one person's loop at a time (its lock held throughout).

    The loop runs as its own task and the response only reads what it produced: a browser that
    leaves mid-turn does not cut a turn in half (a call released but never run), and the page
    redraws the finished turn from ``GET /api/chat`` when it comes back."""
    events: asyncio.Queue[Event | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            if person.busy.locked():
                await events.put({"type": "error", "message": "The assistant is still working "
                                  "on your last request; wait for it to finish."})
                return
            async with person.busy:
                try:
                    async for event in start():
                        await events.put(event)
                except (AgentError, AnswerError) as error:
                    await events.put({"type": "error", "message": str(error)})
        finally:
            await events.put(None)

    task = asyncio.create_task(pump())
    running.add(task)   # held until done: a task nobody references may be collected mid-turn
    task.add_done_callback(running.discard)

    async def lines() -> AsyncIterator[bytes]:
        while (event := await events.get()) is not None:
            yield _line(event)
    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _line(event: Event) -> bytes:
    return (json.dumps(event) + "\n").encode()


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)
        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


class ChatSite:
    """The routes over one model server and the grant store it uses; ``options`` words each
    approval prompt's choices."""

    def __init__(self, upstream: Upstream, grants: MyGrants, options: ApprovalOptions) -> None:
        self._upstream = upstream
        self._grants = grants
        self._sign_ins = SignIns()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0))
        self._viewer = Viewer(options)
        self._agent = Agent(upstream, self._client, self._viewer, options, grants)
        self._running: set[asyncio.Task[None]] = set()   # agent turns still going

    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self._page("chat.html")),
            Route("/approvals", self._page("approvals.html")),
            Route("/sign-in", self._page("sign-in.html", signed_in_only=False)),
            Route("/favicon.ico", lambda _: Response(status_code=204)),   # no icon, and no 404
            Route("/api/sign-in", self.sign_in, methods=["POST"]),
            Route("/api/sign-out", self.sign_out, methods=["POST"]),
            Route("/api/chat", self.chat),
            Route("/api/chat/new", self.new_chat, methods=["POST"]),
            Route("/api/chat/messages", self.message, methods=["POST"]),
            Route("/api/chat/answers", self.answers, methods=["POST"]),
            Route("/api/grants", self.list_grants),
            Route("/api/grants/{grant_id}/revoke", self.revoke, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC)),
        ]

    async def close(self) -> None:
        for task in list(self._running):   # shutting down: turns still going end here
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self._client.aclose()

    def _page(self, name: str, *, signed_in_only: bool = True) -> Callable[[Request], Any]:
        async def serve(request: Request) -> Response:
            if signed_in_only and self._sign_ins.find(request) is None:
                return RedirectResponse("/sign-in", status_code=303)
            return FileResponse(STATIC / name, media_type="text/html")
        return serve

    def _person(self, request: Request) -> Person | JSONResponse:
        person = self._sign_ins.find(request)
        return person if person is not None else _problem(
            401, "sign in first: open /sign-in and enter your API key")

    # ------------------------------------------------------------------------------ signing in

    async def sign_in(self, request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        api_key = body.get("api_key")
        if not isinstance(api_key, str) or not api_key.strip():
            return _problem(400, "enter your API key")
        api_key = api_key.strip()
        refused = await self._check_key(api_key)
        if refused is not None:
            return refused
        label = await asyncio.to_thread(self._grants.principal_of, api_key)
        token = self._sign_ins.add(api_key, label)
        response = JSONResponse({"signed_in": True})
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
        return response

    async def _check_key(self, api_key: str) -> JSONResponse | None:
        """None when the model server accepts ``api_key`` (``GET /v1/models`` answers 200)."""
        try:
            check = await self._client.get(self._upstream.base_url.rstrip("/") + "/models",
                                           headers={"Authorization": f"Bearer {api_key}"})
        except httpx.HTTPError as error:
            return _problem(502, f"the model server could not be reached ({error})")
        if check.status_code == 401:
            return _problem(401, "the model server does not accept this API key")
        if check.status_code != 200:
            return _problem(502, f"the model server answered {check.status_code}")
        return None

    async def sign_out(self, request: Request) -> Response:
        self._sign_ins.remove(request)
        response = JSONResponse({"signed_in": False})
        response.delete_cookie(COOKIE, path="/")
        return response

    # ---------------------------------------------------------------------------------- the chat

    async def chat(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        return JSONResponse(self._chat_state(person))

    async def new_chat(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        if person.busy.locked():
            return _problem(409, "the assistant is still working; wait for it to finish")
        person.conversation = Conversation()
        return JSONResponse(self._chat_state(person))

    async def message(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            return _problem(400, "type a message first")
        try:
            self._agent.say(person, text.strip())   # checks now, sends nothing
        except AnswerError as error:
            return _problem(409, str(error))
        return _ndjson(person, lambda: self._agent.say(person, text.strip()), self._running)

    async def answers(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        given = body.get("answers")
        if not isinstance(given, list) or not all(isinstance(a, dict) for a in given):
            return _problem(400, "answers must be a list of objects")
        submit_now = body.get("submit_now") is True
        try:
            self._agent.answer(person, given, submit_now=submit_now)   # checks now, sends nothing
        except AnswerError as error:
            return _problem(409, str(error))
        return _ndjson(person, lambda: self._agent.answer(person, given, submit_now=submit_now),
                       self._running)

    def _chat_state(self, person: Person) -> dict[str, Any]:
        chat = person.conversation
        return {"items": self._viewer.views(chat), "pending": [item["id"] for item in chat.pending],
                "desk": person.tools.desk.to_json(), "session": chat.session}

    # ------------------------------------------------------------------------------- the grants

    async def list_grants(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        try:
            views = await asyncio.to_thread(self._grants.live, person.api_key)
        except GrantStoreUnavailable as error:
            return _problem(503, f"the grant store is unavailable ({error}); try again shortly")
        session = person.conversation.session
        return JSONResponse({"grants": [view.to_json(session) for view in views]})

    async def revoke(self, request: Request) -> Response:
        person = self._person(request)
        if isinstance(person, Response):
            return person
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        grant_id = request.path_params["grant_id"]
        try:
            await asyncio.to_thread(self._grants.revoke, person.api_key, grant_id)
        except NotYourGrant as error:
            return _problem(404, str(error))
        except GrantStoreUnavailable as error:
            return _problem(503, f"the grant store is unavailable ({error}); try again shortly")
        return JSONResponse({"revoked": grant_id})


def build_app(upstream: Upstream, grants: MyGrants, options: ApprovalOptions) -> ASGIApp:
    """The ASGI application: :class:`ChatSite`'s routes behind :class:`SecurityHeaders`."""
    site = ChatSite(upstream, grants, options)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await site.close()

    return SecurityHeaders(Starlette(lifespan=lifespan, routes=site.routes()))

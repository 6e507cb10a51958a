"""Drive an ASGI app in-process with one JSON request: the middleware's unit tests send a body
through it to a stand-in app and read what came back, without a server."""

from __future__ import annotations

import asyncio
import json
from typing import Any


def post_json(app: Any, path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` to ``path`` of ``app``; (status, the JSON answer, or None when not JSON)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "asgi": {"spec_version": "2.3"},
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    raw = b"".join(message.get("body", b"") for message in sent[1:])
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    return sent[0]["status"], payload

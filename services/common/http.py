"""What the HTTP services (reward, control) share: JSON that always encodes, a cap on request bodies
enforced before anything reads them, and 422s that say what was wrong without echoing the input.

FastAPI's default validation handler echoes the offending input with `ensure_ascii=False`, so a body
holding a lone surrogate (`"\\ud800"`, valid JSON, not valid Unicode text) made it fail to encode its own
error: a 500. Escaped to ASCII, the same JSON encodes whatever it holds. Echoing the input also turned a
19 MB body into a 106 MB answer, so the 422s here carry each error's location, message and type only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# A check of a request's headers alone, run before its body is read: the refusal to send, or None.
Gate = Callable[[Scope], Response | None]

MAX_ERRORS = 20  # 422 entries answered; a body with thousands of bad keys gets a count of the rest
MAX_TEXT = 400  # characters of a message or location part (a key of the body can be as long as the body)


class AsciiJSON(JSONResponse):
    """JSON escaped to ASCII: lone surrogates come out as `\\ud800`, still valid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class BodyLimit:
    """Answer 413 to a body over `max_bytes` before anything parses it: a declared Content-Length from the
    headers alone, a chunked upload as it arrives (at most `max_bytes` of it is ever held).

    `gate` (optional) checks the headers after the declared length and before the first byte of the body
    is read, so a refused request (no token) costs its headers only. An early answer leaves the rest of the
    body unread; the server discards it and keeps the connection, so the client still reads the answer.
    `setting` names the limit's setting in the 413's message.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, setting: str, gate: Gate | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.setting = setting
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, f"{int(declared)} bytes")
            return
        refusal = self.gate(scope) if self.gate is not None else None
        if refusal is not None:
            await refusal(scope, _no_body, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees an empty body and the disconnect after it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(send, f"over {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send: Send, size: str) -> None:
        limit = f"the limit is {self.max_bytes} bytes ({self.setting})"
        response = AsciiJSON({"detail": f"request body is {size}; {limit}"}, status_code=413)
        await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def _short(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def error_entries(errors: list[Any]) -> list[dict[str, Any]]:
    """pydantic-shaped 422 entries without what would echo the input: `loc`, `msg` and `type` only (the
    `input`, and the `ctx` that can hold it, are left out), long texts cut, at most MAX_ERRORS entries
    and then one that counts the rest."""
    entries = [
        {
            "type": str(error.get("type", "value_error")),
            "loc": [part if isinstance(part, int) else _short(str(part)) for part in error.get("loc", ())],
            "msg": _short(str(error.get("msg", ""))),
        }
        for error in errors[:MAX_ERRORS]
    ]
    if len(errors) > MAX_ERRORS:
        more = f"and {len(errors) - MAX_ERRORS} more errors like these"
        entries.append({"type": "too_many_errors", "loc": ["body"], "msg": more})
    return entries


def install_validation_handler(app: FastAPI) -> None:
    """422 with pydantic's errors (location, message, type; never the input) for every body that fails
    validation."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> AsciiJSON:
        return AsciiJSON({"detail": error_entries(list(exc.errors()))}, status_code=422)

"""What the HTTP services (reward, control) share: JSON that always encodes, and 422s for every bad body.

FastAPI's default validation handler echoes the offending input with `ensure_ascii=False`, so a body
holding a lone surrogate (`"\\ud800"`, valid JSON, not valid Unicode text) made it fail to encode its own
error: a 500. Escaped to ASCII, the same JSON encodes whatever it holds.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class AsciiJSON(JSONResponse):
    """JSON escaped to ASCII: lone surrogates come out as `\\ud800`, still valid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def install_validation_handler(app: FastAPI) -> None:
    """422 with pydantic's errors (location, message, input) for every body that fails validation."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> AsciiJSON:
        return AsciiJSON({"detail": jsonable_encoder(exc.errors())}, status_code=422)

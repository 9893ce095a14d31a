"""Bearer-token auth of the control API: 401 without a token, 403 with a wrong one (constant-time compare).

Two gates, one check: `write_gate` refuses a request that can carry a body (any method but GET, HEAD,
OPTIONS) from its headers, before the body is read, so a client without the token cannot make the service
read or parse anything; `TokenCheck` is also each route's dependency (the OpenAPI document's security, and
the reads' check).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from sparkrl.services.common.http import AsciiJSON, Gate, Scope
from sparkrl.services.common.settings import ControlSettings

bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <control.token>`")


def resolve_token(cfg: ControlSettings) -> str:
    """`control.token`, else the contents of `control.token_file`; raises ValueError naming the fix."""
    if cfg.token is not None and cfg.token.get_secret_value():
        return cfg.token.get_secret_value()
    if cfg.token_file:
        path = Path(cfg.token_file)
        if not path.is_file():
            raise ValueError(f"control.token_file {path} does not exist; write a token into it (mode 0600)")
        token = path.read_text().strip()
        if token:
            return token
        raise ValueError(f"control.token_file {path} is empty; write a token into it")
    raise ValueError(
        "the control service needs a token: set SPARKRL_CONTROL__TOKEN or control.token_file "
        "(`sparkrl up` generates one in RUN_DIR/control-token)"
    )


class TokenCheck:
    """A FastAPI dependency accepting any of `tokens`; `required=False` lets every request through (reads
    without protect_reads or a read token)."""

    def __init__(self, *tokens: str, required: bool = True) -> None:
        self._tokens = [token.encode() for token in tokens]
        self.required = required

    def __call__(self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        refusal = self.refusal(credentials.credentials if credentials is not None else None)
        if refusal is not None:
            raise refusal

    def refusal(self, given: str | None) -> HTTPException | None:
        """Why a request bearing `given` (None: no bearer token) is refused; None when it may pass."""
        if not self.required:
            return None
        if given is None:
            return HTTPException(
                401,
                "missing bearer token: send `Authorization: Bearer <token>`",
                {"WWW-Authenticate": "Bearer"},
            )
        # Every token compared, constant-time: which one matched is not timed out of the service.
        if not any([hmac.compare_digest(given.encode(), token) for token in self._tokens]):
            return HTTPException(403, "wrong token")
        return None


SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}  # what cannot carry a command


def write_gate(check: TokenCheck) -> Gate:
    """`check` on every request that can carry a body, from its `Authorization` header alone (parsed as
    HTTPBearer does: anything but `Bearer <token>` is no token)."""

    def gate(scope: Scope) -> Response | None:
        if scope["method"] in SAFE_METHODS:
            return None
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, given = get_authorization_scheme_param(header)
        refusal = check.refusal(given if scheme.lower() == "bearer" and given else None)
        if refusal is None:
            return None
        return AsciiJSON({"detail": refusal.detail}, status_code=refusal.status_code, headers=refusal.headers)

    return gate

"""Bearer-token auth of the control API: 401 without a token, 403 with a wrong one (constant-time compare)."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

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
        if not self.required:
            return
        if credentials is None:
            raise HTTPException(
                401,
                "missing bearer token: send `Authorization: Bearer <token>`",
                {"WWW-Authenticate": "Bearer"},
            )
        given = credentials.credentials.encode()
        # Every token compared, constant-time: which one matched is not timed out of the service.
        if not any([hmac.compare_digest(given, token) for token in self._tokens]):
            raise HTTPException(403, "wrong token")

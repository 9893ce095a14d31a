"""How the HTTP services (control, reward) are served: uvicorn, with a deadline on each request's head.

uvicorn closes a keep-alive connection that stays idle for `timeout_keep_alive`, but none that has sent
part of a request (any byte cancels that timer) and nothing on a fresh connection: one that connects,
sends half a request line and waits is held for ever, its descriptor with it, and enough of them exhaust
the process's descriptors (issue 45). `config` serves over uvicorn's own HTTP protocol with one timer
more: a connection whose next request's head has not arrived `HEAD_TIMEOUT_S` after it opened, or after
its last answer, is closed. A request being answered (a long command wait, the live page's event stream)
is never cut by it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEAD_TIMEOUT_S = 10.0  # from a connection's start or its last answer, until the next request's head is in


class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol (httptools' or h11's, whichever it picks) with the head deadline above."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # keep-alive: the next request's head gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        answering = self.cycle is not None and not self.cycle.response_complete
        if not answering and not self.transport.is_closing():
            self.transport.close()  # idle or a head still trickling in; an answer re-arms the timer


def config(
    app: Any, host: str, port: int, head_timeout_s: float = HEAD_TIMEOUT_S, **options: Any
) -> uvicorn.Config:
    """uvicorn's config for `app` on host:port, its HTTP connections under the head deadline; `options`
    are uvicorn.Config's others."""
    protocol = type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": head_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, **options)

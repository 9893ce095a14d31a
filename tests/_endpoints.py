"""A chat-completions endpoint on loopback for the judge's tests: real HTTP, answering as an
OpenAI-compatible server does, and failing as one does (status, garbage, delay), call by call."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Endpoint:
    """A chat-completions endpoint on loopback whose next answers the test sets (`plan`: one per call;
    after the plan, `choose(body)` when set, else a reply of `default`), recording every request."""

    def __init__(self) -> None:
        self.plan: list[tuple[int, Any, float]] = []  # (status, body, delay) per call
        self.default = "Grade: 10"
        self.choose: Callable[[dict[str, Any]], tuple[int, Any, float]] | None = None
        self.requests: list[dict[str, Any]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(
                    {"path": self.path, "body": body, "auth": self.headers["Authorization"]}
                )
                if endpoint.plan:
                    status, answer, delay = endpoint.plan.pop(0)
                elif endpoint.choose is not None:
                    status, answer, delay = endpoint.choose(body)
                else:
                    status, answer, delay = 200, endpoint.default, 0.0
                time.sleep(delay)
                payload = answer if isinstance(answer, bytes) else json.dumps(_completion(answer)).encode()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client past its deadline
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                return None  # quiet

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _completion(text: str) -> dict[str, Any]:
    return {
        "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
    }

"""A fake OpenAI-compatible completions server for the gate tests (imported as
`_gate_fakes`): it answers each data-set question with what ``answer`` says."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# What the server answers to a prompt that is not a data-set question (the gate's preflight).
OTHER_ANSWER = " 2"


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients dropping connections when the run aborts are expected


class FakeServer:
    """Serves /v1/completions: ``answer(prompt)`` is the completion of a data-set question, or
    None for any other prompt. After ``fail_after`` answered questions it answers HTTP 500."""

    def __init__(
        self, answer: Callable[[str], str | None], fail_after: int | None = None
    ) -> None:
        self.served = 0
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
                texts = [answer(prompt) for prompt in prompts]
                with lock:
                    if texts[-1] is not None:
                        if fail_after is not None and server.served >= fail_after:
                            self.send_response(500)
                            self.end_headers()
                            self.wfile.write(b"internal error")
                            return
                        server.served += 1
                choices = [
                    {"index": i, "text": OTHER_ANSWER if t is None else t}
                    for i, t in enumerate(texts)
                ]
                data = json.dumps({"choices": choices}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

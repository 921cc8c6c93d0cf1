"""A stand-in for a served model in the CI script tests: an OpenAI-compatible /v1/completions
endpoint on 127.0.0.1 that answers each GSM8K question of a data directory (test.jsonl)
correctly ("#### <gold>"), and anything else with " 2".

    python3 fake_completions_server.py PORT DATA_DIR [--wrong N]   # first N answers wrong

It is what `SERVER_CMD` starts in the nightly tests; it serves until it is terminated.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

QUESTION_RE = re.compile(r"Question: (.*?)\nAnswer:$", re.DOTALL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("data_dir", type=Path)
    p.add_argument("--wrong", type=int, default=0, help="answer the first N test questions wrong")
    args = p.parse_args()
    answers = {}
    for i, line in enumerate((args.data_dir / "test.jsonl").read_text().splitlines()):
        doc = json.loads(line)
        gold = int(doc["answer"].split("#### ")[-1])
        got = gold + 1 if i < args.wrong else gold
        answers[doc["question"]] = f" The answer is {got}.\n#### {got}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            texts = []
            for prompt in prompts:
                m = QUESTION_RE.search(prompt.split("\n\n")[-1])
                texts.append(answers.get(m.group(1), " 2") if m else " 2")
            data = json.dumps({"choices": [{"index": i, "text": t} for i, t in enumerate(texts)]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"fake server on 127.0.0.1:{args.port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

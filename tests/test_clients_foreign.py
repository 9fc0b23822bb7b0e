"""Clients against servers that do not speak the OpenAI API: `serving.bench` and
`gemma_tpu.evaluate --endpoint` say in one line what came back (status, content type, the start of the
body), exit non-zero, and write no results file when every request failed."""

from __future__ import annotations

import http.server
import json

import pytest

from tests.conftest import REPO, assert_one_line_error, run_cli
from tests.test_serving import http_server, sse

CHAT = REPO / "tests" / "data" / "chat_sample.jsonl"
HTML = b"<!DOCTYPE html><html><head><title>Welcome to nginx!</title></head><body>It works</body></html>"


class Foreign(http.server.BaseHTTPRequestHandler):
    """Behaviour by path prefix: /html (a web page for everything), /json (a plain JSON completion where a
    stream was asked for), /cut (an event stream whose JSON event is cut off)."""

    def log_message(self, *args):
        pass

    def _send(self, ctype: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/html"):
            return self._send("text/html", HTML)
        return self._send("application/json", json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/html"):
            return self._send("text/html; charset=utf-8", HTML)
        if self.path.startswith("/json"):
            return self._send("application/json", json.dumps(
                {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                              "finish_reason": "stop"}]}).encode())
        body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        body += b'data: {"choices": [{"index": 0, "delta": {"cont\n\n'
        self._send("text/event-stream", body)


@pytest.mark.parametrize("path, needles", [
    ("/html", ["not an OpenAI event stream", "HTTP 200, Content-Type text/html", "Welcome to nginx"]),
    ("/json", ["not an OpenAI event stream", "Content-Type application/json", '"choices"']),
    ("/cut", ["bad event", "cont"]),
])
def test_bench_against_a_foreign_server(tmp_path, path, needles):
    out = tmp_path / "bench.json"
    with http_server(Foreign) as url:
        proc = run_cli("serving.bench", "--base-url", url + path, "--num-prompts", "3", "--input-len", "4",
                       "--output-len", "2", "--timeout", "10", "--json", str(out), "--disable-tqdm", timeout=120)
    assert_one_line_error(proc, "all 3 requests", "failed", *needles, "nothing written")
    assert "Serving Benchmark Result" not in proc.stdout  # no table of zeros
    assert not out.exists()


def test_evaluate_against_an_html_server(tmp_path):
    out = tmp_path / "r.json"
    with http_server(Foreign) as url:
        proc = run_cli("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url + "/html", "--limit", "2",
                       "--json", str(out), timeout=300)
    assert_one_line_error(proc, "/html/v1/chat/completions", "not JSON", "HTTP 200, Content-Type text/html",
                          "Welcome to nginx", "OpenAI-compatible")
    assert not out.exists()

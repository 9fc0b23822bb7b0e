"""Clients against servers that do not speak the OpenAI API: `serving.bench` and
`gemma_tpu.evaluate --endpoint` say in one line what came back (status, content type, the start of the
body), exit non-zero, and write no results file when every request failed."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest

from gemma_tpu.core.errors import UserError
from tests.conftest import REPO, assert_one_line_error, run_cli
from tests.test_serving import ScriptedModel, http_server, sse

CHAT = REPO / "tests" / "data" / "chat_sample.jsonl"
HTML = b"<!DOCTYPE html><html><head><title>Welcome to nginx!</title></head><body>It works</body></html>"
# a load balancer's error page, as Google's front end sends it: style sheet first, the words after
LB_PAGE = (b"<!DOCTYPE html>\n<html lang=en>\n  <meta charset=utf-8>\n  <title>Error 502 (Server Error)!!1</title>\n"
           b"  <style>\n    *{margin:0;padding:0}html,code{font:15px/22px arial,sans-serif}html{background:#fff;"
           b"color:#222;padding:15px}body{margin:7% auto 0;max-width:390px;min-height:180px;padding:30px 0 15px}"
           b"\n  </style>\n  <p><b>502.</b> <ins>That&#39;s an error.</ins>\n  <p>The server encountered a temporary "
           b"error and could not complete your request.<p>Please try again in 30 seconds.\n")


class Foreign(http.server.BaseHTTPRequestHandler):
    """Behaviour by path prefix: /html (a web page for everything), /json (a plain JSON completion where a
    stream was asked for), /cut (an event stream whose JSON event is cut off), /shape (events whose
    `choices` is not a list of objects), /deep (an event nested past the JSON parser), /empty (a stream of no
    choice at all)."""

    def log_message(self, *args):
        pass

    def _send(self, ctype: str, body: bytes, status: int = 200) -> None:
        self.send_response(status)
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
        if self.path.startswith("/lb"):
            return self._send("text/html; charset=UTF-8", LB_PAGE, 502)
        if self.path.startswith("/html"):
            return self._send("text/html; charset=utf-8", HTML)
        if self.path.startswith("/json"):
            return self._send("application/json", json.dumps(
                {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                              "finish_reason": "stop"}]}).encode())
        if self.path.startswith("/empty"):  # a stream that ends at once: no choice, a usage event, [DONE]
            return self._send("text/event-stream", sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 4}})
                              + sse("[DONE]"))
        body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if self.path.startswith("/reset"):  # the connection reset mid-stream (a proxy's idle cut, a server killed)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST
            self.connection.close()
            self.wfile = io.BytesIO()  # what finish() flushes
            return
        if self.path.startswith("/deep"):  # an event nested past Python's JSON parser (it was a traceback)
            body += b"data: " + b"[" * 100000 + b"]" * 100000 + b"\n\n"
            return self._send("text/event-stream", body)
        if self.path.startswith("/shape"):  # valid JSON events of the wrong shape
            body += sse({"choices": "one two"}) + sse({"choices": [{"index": 0, "delta": "two"}]})
            return self._send("text/event-stream", body)
        body += b'data: {"choices": [{"index": 0, "delta": {"cont\n\n'
        self._send("text/event-stream", body)


@pytest.mark.parametrize("path, needles", [
    ("/html", ["not an OpenAI event stream", "HTTP 200, Content-Type text/html", "Welcome to nginx"]),
    ("/json", ["not an OpenAI event stream", "Content-Type application/json", '"choices"']),
    ("/cut", ["bad event", "cont"]),
    ("/shape", ["bad event", "'choices' is not a list of objects", "one two"]),
    ("/deep", ["bad event", "nested too deeply"]),
    ("/empty", ["the stream held no choice", "[DONE]"]),  # was a completed request of 0 tokens
    ("/reset", ["ReadError: [Errno 104] Connection reset by peer"]),  # was a bare 'ReadError'
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


def test_an_error_page_is_told_by_its_words(tmp_path):
    """A proxy's HTML error page (a 502 from a load balancer) filled the one-line error with its style sheet:
    `HTTP 502 (<!DOCTYPE html> <html lang=en> <meta charset=utf-8> ... *{margin:0;padding:0}...`. Now its title
    and text."""
    with http_server(Foreign) as url:
        proc = run_cli("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url + "/lb", "--served-model", "m",
                       "--limit", "2", "--retries", "0", timeout=300)
        bench = run_cli("serving.bench", "--base-url", url + "/lb", "--model", "m", "--num-prompts", "2",
                        "--input-len", "4", "--output-len", "2", "--timeout", "10", "--disable-tqdm", timeout=120)
    line = assert_one_line_error(proc, "/lb/v1/chat/completions", "HTTP 502",
                                 "web page: Error 502 (Server Error)!!1: 502. That's an error. The server encountered")
    assert "margin" not in line and "<" not in line
    line = assert_one_line_error(bench, "HTTP 502", "web page: Error 502 (Server Error)!!1")
    assert "margin" not in line


# ------------------------------------------------ answers that are not HTTP, or not an OpenAI message

@contextlib.contextmanager
def raw_server(answer: bytes):
    """A loopback TCP server that reads each request (headers and body) and sends `answer` verbatim, HTTP
    or not, then hangs up (at most 20 connections, each read bounded to 1 MB); an answer ending in RESET hangs up
    with a TCP reset (SO_LINGER 0) instead."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(30)

    def serve():
        for _ in range(20):
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                data = b""
                try:
                    while b"\r\n\r\n" not in data and len(data) < 1 << 20:
                        data += conn.recv(65536) or b"\r\n\r\n"
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                    while length and len(body) < int(length.group(1)):
                        body += conn.recv(65536) or b"x" * int(length.group(1))
                    if answer.endswith(RESET):
                        conn.sendall(answer[:-len(RESET)])
                        time.sleep(0.2)  # the answer read before the reset arrives
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        conn.close()
                        continue
                    conn.sendall(answer)
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1)  # until the client hangs up
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


def _in_process(entry: str, *argv: str) -> subprocess.CompletedProcess:
    """`python -m entry argv` as `cli_main` runs it, in this process (the evaluation's imports once)."""
    import importlib

    from gemma_tpu.core.cli import cli_main

    module = importlib.import_module({"gemma_tpu.evaluate": "gemma_tpu.evaluate.run"}.get(entry, entry))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(module.main, list(argv))
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


NOT_HTTP = [
    # an SSH port (or any non-HTTP service) given as the server: http.client's BadStatusLine
    (b"SSH-2.0-OpenSSH_9.6\r\n", ["the answer is not HTTP", "SSH-2.0-OpenSSH_9.6", "OpenAI-compatible"]),
    # a body cut short of its Content-Length: IncompleteRead
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"choices\": [",
     ["the answer was cut off", "13 of 100 bytes"]),
    # an error page cut short: the HTTP status is still reported
    (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 50\r\n\r\nboom", ["HTTP 500"]),
    # a chunked body cut short after a chunk: what arrived is counted (it said 0 bytes, the last read's)
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"d\r\n{\"choices\": [\r\n", ["the answer was cut off (13 bytes of its body arrived)"]),
    # a connection reset after the headers: the server was reached (it said "cannot reach the server")
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"choices\": ["
     + b"RESET", ["the answer was cut off (13 of 100 bytes of its body arrived)"]),
    # JSON nested past Python's parser (a broken or hostile server): it was a RecursionError traceback
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n"
     + b"[" * 100000 + b"]" * 100000, ["the answer is JSON nested too deeply to read", "HTTP 200"]),
    # an integer past Python's 4,300 digits: json.loads' ValueError was a traceback
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5013\r\n\r\n{\"created\": "
     + b"9" * 5000 + b"}", ["the answer is not JSON Python can read", "5000 digits", "HTTP 200"]),
    # a body without end (a wrong URL serving a large file, a broken server): it was read into memory until --timeout
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b" " * (65 << 20),
     ["the answer passed 64 MB and was read no further"]),
]
RESET = b"RESET"


@pytest.mark.parametrize("answer, needles", NOT_HTTP, ids=["not-http", "cut-off", "cut-off-500", "cut-off-chunked",
                                                           "reset-midway", "nested-too-deeply",
                                                           "number-of-5000-digits", "too-large"])
def test_chat_and_evaluate_against_answers_that_are_not_http(tmp_path, answer, needles):
    out = tmp_path / "r.json"
    with raw_server(answer) as url:
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps today?",
                           "--retries", "0")  # a cut-off answer or a 500 is asked again
        assert_one_line_error(proc, "/v1/chat/completions", *needles)
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "1", "--json", str(out), "--retries", "0")  # a cut-off answer is asked again
        assert_one_line_error(proc, "/v1/chat/completions", *needles)
    assert not out.exists()


@pytest.mark.parametrize("message, needles", [
    ({"content": 5}, ["content is not a string", "5"]),
    ({"content": None, "tool_calls": "get_steps"}, ["tool_calls is not a list", '"get_steps"']),
    ({"content": None, "tool_calls": [None]}, ["tool_calls is not a list", "[null]"]),
    ({"content": None, "tool_calls": [{"function": "get_steps"}]}, ["tool_calls is not a list"]),
    ({"content": [{"type": "image_url", "image_url": {"url": "x"}}, 3]}, ["not of text parts"]),
    # a part without text read as "" (an empty answer), as did a refusal part (below)
    ({"content": [{"type": "image_url", "image_url": {"url": "x"}}]}, ["not of text parts", "image_url"]),
    ({"content": None, "refusal": 5}, ["refusal is not a string", "5"]),
])
def test_messages_of_the_wrong_shape_are_one_line_errors(tmp_path, message, needles):
    from tests.test_serving import scripted

    out = tmp_path / "r.json"
    _, server = scripted(message, message)
    with server as url:
        proc = _in_process("serving.chat", "--base-url", url, "--once", "steps today?")
        assert_one_line_error(proc, "/v1/chat/completions", *needles)
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "1",
                           "--json", str(out))
        assert_one_line_error(proc, "/v1/chat/completions", *needles)
    assert not out.exists()


def test_content_parts_models_without_ids_and_nameless_calls():
    """Content as a list of text parts is read as its text; a model list without ids names no model; a call
    whose name is not a string is a format error, not a crash."""
    from gemma_tpu.examples.fitness.providers import SimulatedDevice
    from gemma_tpu.infer.openai_client import reply_from_message, served_model_name
    from serving.chat import RemoteCoach
    from tests.test_serving import scripted

    _, server = scripted({"content": [{"type": "text", "text": "You slept "}, {"type": "text", "text": "well."}]})
    with server as url:
        assert RemoteCoach(url, SimulatedDevice(0), trace=None).ask("how did I sleep?") == "You slept well."
    # a refusal (a part of its own, or the message's `refusal` with content null) is the model's answer in words
    _, server = scripted({"content": [{"type": "refusal", "refusal": "I cannot share that."}]},
                         {"content": None, "refusal": "I cannot share that either."})
    with server as url:
        coach = RemoteCoach(url, SimulatedDevice(0), trace=None)
        assert coach.ask("how did I sleep?") == "I cannot share that."
        assert coach.ask("and today?") == "I cannot share that either."

    class Models(Foreign):
        def do_GET(self):
            return self._send("application/json", json.dumps({"data": {"id": "m"}}).encode())

    with http_server(Models) as url:
        assert served_model_name(url + "/v1") is None
    assert reply_from_message({"tool_calls": [{"function": {"name": 7, "arguments": "{}"}}]}).kind == "format_error"


def test_a_thinking_models_thought_is_traced_apart_by_the_remote_chat():
    """serving.chat shows a thought as the local chat does, `(thought) ...` on its trace: vLLM's reasoning parser
    hands it as `reasoning` (`reasoning_content` before 0.27), a server without the parser in the content's markers;
    the reply is the answer alone. It was not shown at all."""
    import io

    from gemma_tpu.examples.fitness.providers import SimulatedDevice
    from serving.chat import RemoteCoach
    from tests.test_serving import scripted

    _, server = scripted({"content": "You slept well.", "reasoning": "Sleep was 7 hours."},
                         {"content": "Fine.", "reasoning_content": "Steps are fine."},
                         {"content": "<|channel>thought\nQuiet day.<channel|>Rest."},
                         {"content": "No thought.", "reasoning": "  "})
    trace = io.StringIO()
    with server as url:
        coach = RemoteCoach(url, SimulatedDevice(0), trace=trace)
        assert [coach.ask(q) for q in ("a?", "b?", "c?", "d?")] == ["You slept well.", "Fine.", "Rest.", "No thought."]
    assert [line for line in trace.getvalue().splitlines() if line.startswith("(thought)")] == [
        "(thought) Sleep was 7 hours.", "(thought) Steps are fine.", "(thought) Quiet day."]


# ------------------------------------------------------------------ results files published at once

class Streams(Foreign):
    """A well-behaved streaming completion for every request."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunk = lambda **kw: {"id": "x", "choices": [{"index": 0, **kw}]}  # noqa: E731
        self._send("text/event-stream", sse(chunk(delta={"role": "assistant", "content": "one"}))
                   + sse(chunk(delta={"content": " two"}, finish_reason="stop")) + sse("[DONE]"))


def test_a_results_file_that_cannot_be_written_whole_keeps_the_old_one(tmp_path):
    """`--json` used to be rewritten in place: a write that failed midway (a full disk; here a 1 KB file-size
    limit) left the previous results cut short. Now it is published whole or not at all."""
    import sys

    out = tmp_path / "bench.json"
    out.write_text('{"completed": 1, "previous": "results"}\n')
    # the write fails with EFBIG (SIGXFSZ ignored, which survives exec) past a 1 KB file-size limit
    limited = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'serving.bench', *sys.argv[1:]])")
    with http_server(Streams) as url:
        proc = subprocess.run([sys.executable, "-c", limited, "--base-url", url, "--model", "m", "--num-prompts", "2",
                               "--input-len", "4", "--output-len", "2", "--timeout", "10", "--json", str(out),
                               "--disable-tqdm"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, f"writing {out} failed", "File too large", "nothing was published")
    assert out.read_text() == '{"completed": 1, "previous": "results"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
    with http_server(Streams) as url:  # without the limit the results replace the old file
        proc = run_cli("serving.bench", "--base-url", url, "--model", "m", "--num-prompts", "2", "--input-len", "4",
                       "--output-len", "2", "--timeout", "10", "--json", str(out), "--disable-tqdm", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["completed"] == 2


def test_bench_dataset_lines_are_split_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028 / U+0085 unescaped; str.splitlines() cut such a line in two."""
    from serving.bench import file_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "one\u2028two\x85three"}, ensure_ascii=False) + "\n", encoding="utf-8")
    (row,) = file_prompts(str(path), 1, 0)
    assert row.messages[0]["content"] == "one\u2028two\x85three"


def test_bench_refuses_every_familys_markup_in_its_dataset(tmp_path):
    """The server renders the messages with its chat template and reads control tokens in them as such; which
    family serves is not known here, so every family's markup is refused (a Gemma 4 `<|turn>` went out: only
    Gemma 3's was checked), naming the line."""
    from gemma_tpu.core.errors import UserError
    from serving.bench import file_prompts

    path = tmp_path / "p.jsonl"
    for token in ("<start_of_turn>", "<|turn>"):
        path.write_text(json.dumps({"messages": [{"role": "user", "content": f"what is {token}?"},
                                                 {"role": "assistant", "content": "a"}]}) + "\n")
        with pytest.raises(UserError, match=re.escape(f"{path}:1") + ".*" + re.escape(token)):
            file_prompts(str(path), 1, 0)


def test_bench_prompt_only_chats_are_read_as_training_reads_them(tmp_path):
    """A prompt-only chat (no answer) was sent as given: legacy `functions` were dropped (the request had no tools),
    declarations the server refuses and turns the chat template refuses went out. The trainer's reader reads it now."""
    from serving.bench import file_prompts

    fn = {"name": "get_steps", "description": "d", "parameters": {"type": "object",
                                                                  "properties": {"date": {"type": "string"}}}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"functions": [fn], "system": "be brief",
                                "messages": [{"role": "user", "content": "s?"}]}) + "\n")
    (row,) = file_prompts(str(path), 1, 0)
    assert row.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "s?"}]
    assert row.tools == [{"type": "function", "function": fn}]
    # roles in any case, as the trainer reads them: a capitalised answer was not seen as one (a second was added)
    path.write_text(json.dumps({"messages": [{"role": "User", "content": "s?"}, {"role": "Assistant", "content": "a"},
                                             {"role": "User", "content": "t?"}, {"role": "Model", "content": "b"}]}))
    (row,) = file_prompts(str(path), 1, 0)
    assert row.messages == [{"role": "user", "content": "s?"}]
    bad = {"tools": [{"type": "function", "function": {**fn, "parameters": {"type": "object", "properties": []}}}],
           "messages": [{"role": "user", "content": "hi"}]}
    for row, needle in ((bad, "p.jsonl:1: tools[0].function.parameters.properties: expected an object"),
                        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                         "p.jsonl:1: messages[1]: two user turns in a row")):
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(UserError, match=re.escape(needle)):
            file_prompts(str(path), 1, 0)


def test_tool_results_name_the_call_they_answer():
    """A turn with two calls and its two results: the second result named `call_<turn>_0` of no turn (it
    took the id from the message before it, a tool result); a strict server refuses an unknown id."""
    from gemma_tpu.infer.openai_client import openai_messages

    sent = openai_messages([
        {"role": "user", "content": "steps and sleep?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_steps", "arguments": {"date": "today"}},
                                                            {"name": "get_sleeping_minutes", "arguments": {}}]},
        {"role": "tool", "name": "get_sleeping_minutes", "content": "{\"minutes\": 400}"},
        {"role": "tool", "name": "get_steps", "content": "{\"steps\": 9000}"},
        {"role": "assistant", "content": "9000 steps, 400 minutes."},
        {"role": "user", "content": "and yesterday?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_steps", "arguments": {}}]},
        {"role": "tool", "name": "get_steps", "content": "{}"},
    ])
    ids = {c["function"]["name"] + "@" + str(i): c["id"] for i, m in enumerate(sent) for c in m.get("tool_calls", [])}
    assert [m.get("tool_call_id") for m in sent if m["role"] == "tool"] == [
        ids["get_sleeping_minutes@1"], ids["get_steps@1"], ids["get_steps@6"]]
    # a result past the turn's calls was sent with the id call_<i-1>_0, which named no call: refused, naming it
    from gemma_tpu.core.errors import UserError

    with pytest.raises(UserError, match=r"^messages\[1\]: a tool result with no call of the preceding assistant turn"):
        openai_messages([{"role": "user", "content": "steps?"}, {"role": "tool", "name": "get_steps", "content": "{}"}])


def test_a_server_that_never_answers(tmp_path):
    """A stalled server (it accepts, reads the request, never answers): evaluate waited 300 s per request,
    with no option to wait less, and then said `cannot reach the server (timed out)` of a server it had
    reached. `--timeout` bounds it and the line says what happened."""
    import time

    release = threading.Event()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []

    def accept():
        while not release.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)  # read nothing back, answer nothing

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "1", "--timeout", "1")
        assert time.monotonic() - t0 < 30
        assert_one_line_error(proc, f"{url}/v1/chat/completions: no answer within 1 s")
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--timeout", "1", "--once", "steps?")
        assert_one_line_error(proc, "/v1/chat/completions: no answer within 1 s")
    finally:
        release.set()
        srv.close()
        for c in held:
            c.close()


class Trickle(http.server.BaseHTTPRequestHandler):
    """Answers every request with a whole, valid chat completion, one byte every 0.2 s (~25 s in all); with `status`
    not 200, an OpenAI error of that status (~10 s)."""

    status = 200

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.do_POST()

    def do_POST(self):
        import time

        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"data": [{"id": "m"}], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "You walked 8123 steps today."}}]}).encode()
        if self.status != 200:
            body = json.dumps({"error": {"message": "the request was refused, slowly"}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the client gave up
            pass


def test_a_server_that_trickles_its_answer_is_bound_by_the_timeout():
    """`--timeout` is the whole request: urllib's timeout bounds each socket read, so a server sending its
    answer a byte at a time held evaluate and the chat for the whole trickle (~25 s here at --timeout 1)."""
    import time

    with http_server(Trickle) as url:
        t0 = time.monotonic()
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "1", "--timeout", "1")
        assert time.monotonic() - t0 < 5
        assert_one_line_error(proc, f"{url}/v1/chat/completions: no answer within 1 s")
        t0 = time.monotonic()
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--timeout", "1", "--once", "steps?")
        assert time.monotonic() - t0 < 5
        assert_one_line_error(proc, "/v1/chat/completions: no answer within 1 s")


class TrickledRefusal(Trickle):
    status = 400


def test_a_server_that_trickles_its_error_page_is_bound_by_the_timeout():
    """An error status's body was read without the request's deadline (urllib's timeout bounds each socket read):
    a server trickling its 400 page held evaluate and the chat for all of it, then reported the page."""
    with http_server(TrickledRefusal) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "1", "--timeout", "1", "--retries", "0")
        assert_one_line_error(proc, f"{url}/v1/chat/completions: HTTP 400 (no whole body within 1 s)")
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--timeout", "1", "--once", "steps?",
                           "--retries", "0")
        assert_one_line_error(proc, "/v1/chat/completions: HTTP 400 (no whole body within 1 s)")


class Flaky(ScriptedModel):
    """Chat completions fail with `status` for the first `fail` requests, then answer with a get_steps call;
    `seen` counts the requests."""

    status, fail, seen = 503, 2, 0

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        cls = type(self)
        cls.seen += 1
        if cls.seen <= cls.fail:
            return self._json(cls.status, {"error": {"message": "model is still loading"}})
        call = {"id": "c", "type": "function", "function": {"name": "get_steps", "arguments": "{}"}}
        self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                              "tool_calls": [call]}}]})


def flaky(status: int, fail: int):
    return type("FlakyNow", (Flaky,), {"status": status, "fail": fail, "seen": 0})


@pytest.mark.parametrize("status", [503, 429])
def test_evaluate_retries_a_busy_server(tmp_path, caplog, status):
    """A server still loading (503) or rate limiting (429) gets the request again, 1 then 2 s later."""
    handler = flaky(status, 2)
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "1")
    assert proc.returncode == 0, proc.stderr
    assert handler.seen == 3
    assert re.search(r"^n\s+1$", proc.stdout, re.M), proc.stdout


def test_the_waits_between_many_retries_stop_growing(monkeypatch):
    """`--retries 12` waited 1, 2, 4 ... 2048 s between attempts (over an hour before the last, days with a few more);
    the doubling stops at MAX_RETRY_AFTER, the longest wait a server's Retry-After gets, and every attempt is still
    made."""
    from gemma_tpu.infer.openai_client import MAX_RETRY_AFTER, http_json

    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    handler = flaky(503, 12)
    with http_server(handler) as url:
        assert http_json(url + "/v1/chat/completions", {"messages": []}, retries=12)["choices"]
    assert handler.seen == 13
    assert waits == [1, 2, 4, 8, 16, 32, 64] + [MAX_RETRY_AFTER] * 5, waits


def test_evaluate_waits_for_a_server_still_starting_before_its_first_request():
    """A refused connection is asked again (a server still starting) - but not the first request, the model list:
    evaluate --endpoint started beside `serving.launch` failed at once, unless --served-model skipped that request."""
    from serving.local import free_port

    port = free_port()
    handler = flaky(503, 0)
    started = threading.Event()
    server: list = []

    def start_late():
        time.sleep(0.5)  # the first attempt is refused, the next (1 s later) is answered
        server.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), handler))
        started.set()
        server[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    try:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", f"http://127.0.0.1:{port}",
                           "--limit", "1", "--retries", "2")
    finally:
        assert started.wait(10)
        server[0].shutdown()
        server[0].server_close()
    assert proc.returncode == 0, proc.stderr
    assert handler.seen == 1 and "without a model name" not in proc.stderr


class Locked(Flaky):
    """Answers only requests carrying `Authorization: Bearer sk-test` (vLLM with --api-key: 401 otherwise)."""

    fail, seen, auth = 0, 0, []

    def _locked(self) -> bool:
        type(self).auth.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") == "Bearer sk-test":
            return False
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json(401, {"error": "Unauthorized"})
        return True

    def do_GET(self):
        if not self._locked():
            super().do_GET()

    def do_POST(self):
        if not self._locked():
            super().do_POST()


def test_evaluate_sends_the_api_key(monkeypatch):
    """evaluate --endpoint sent no API key, so a server launched with one (server.api_key_env) answered 401 to
    every request; it now reads it from --api-key-env (VLLM_API_KEY by default), as serving.chat and bench do."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    handler = type("LockedNow", (Locked,), {"seen": 0, "auth": []})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "1")
        assert_one_line_error(proc, "HTTP 401")
        monkeypatch.setenv("MY_KEY", "sk-test")
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "2",
                           "--api-key-env", "MY_KEY")
    assert proc.returncode == 0, proc.stderr
    assert handler.seen == 2 and handler.auth[-3:] == ["Bearer sk-test"] * 3  # /models and both requests
    assert "sk-test" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("key, where", [("sk-te\nst", "character 6 of 8"), ("sk-tést", "character 5 of 7"),
                                        ("sk-test ", "character 8 of 8")])
def test_an_api_key_no_header_can_carry_is_one_line_error_without_the_key(monkeypatch, key, where):
    """A key holding a line break (a file's newline), a non-ASCII letter or an edge space: urllib's ValueError or
    httpx's UnicodeEncodeError traceback (the line break's printing the whole `Bearer KEY` header), or a 401 (a
    server strips the header's edge spaces); now one line naming the variable and where the bad character is, without
    the key, from every client, before any request."""
    monkeypatch.setenv("MY_KEY", key)
    handler = type("LockedNow", (Locked,), {"seen": 0, "auth": []})
    with http_server(handler) as url:
        for entry, *argv in (("serving.chat", "--once", "hi", "--retries", "0"),
                             ("serving.bench", "--num-prompts", "1"),
                             ("gemma_tpu.evaluate", "--data", str(CHAT), "--limit", "1")):
            proc = _in_process(entry, *argv, "--endpoint" if entry.startswith("gemma") else "--base-url", url,
                               "--api-key-env", "MY_KEY")
            line = assert_one_line_error(proc, "--api-key-env: the environment variable MY_KEY holds", where,
                                         "set it to the key alone")
            assert "sk-t" not in proc.stdout + proc.stderr, line
    assert handler.seen == 0


def test_evaluate_gives_up_after_its_retries_and_not_on_a_client_error(tmp_path):
    handler = flaky(503, 100)
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "1",
                           "--retries", "1")
    assert_one_line_error(proc, "HTTP 503", "still loading", "after 2 attempts")
    assert handler.seen == 2
    handler = flaky(400, 100)  # a request the server will never take: asked once
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--limit", "1")
    assert_one_line_error(proc, "HTTP 400")
    assert "attempts" not in proc.stderr and handler.seen == 1
    proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--retries", "-1")
    assert_one_line_error(proc, "--retries -1")


def fail_once(handler, how: str, after: str = "1") -> None:
    """Answer a request as a transient failure: HTTP `how` (429, 503) with `Retry-After: after`, or ("drop") an
    answer whose connection closes short of its Content-Length, as a server killed mid-answer leaves it."""
    handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    if how == "drop":
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        handler.wfile.write(b'{"choices": [')
        handler.close_connection = True
        return
    data = b'{"error": {"message": "try again"}}'
    handler.send_response(int(how))
    handler.send_header("Retry-After", after)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class Throttled(Flaky):
    """Answers the first request 429 with `Retry-After: after` (the time of each request in `times`), then as
    `Flaky` does."""

    after, times = "1", []

    def do_POST(self):
        cls = type(self)
        cls.times.append(time.monotonic())
        if len(cls.times) > 1:
            return super().do_POST()
        fail_once(self, "429", cls.after)


def test_a_retry_waits_as_long_as_retry_after_asks():
    """A 429's Retry-After was ignored: the next attempt came 1 s later whatever the server asked, to be
    rate limited again; it now waits as asked, and a wait past MAX_RETRY_AFTER fails at once, saying so."""
    import email.utils

    from gemma_tpu.infer.openai_client import HTTPStatusError, http_json, retry_after

    handler = type("ThrottledNow", (Throttled,), {"after": "1", "times": [], "fail": 0, "seen": 0})
    with http_server(handler) as url:
        assert http_json(url + "/v1/chat/completions", {"messages": []}, retries=2, backoff=0.01)["choices"]
    assert len(handler.times) == 2 and handler.times[1] - handler.times[0] >= 0.95, handler.times
    handler = type("ThrottledNow", (Throttled,), {"after": "3600", "times": [], "fail": 0, "seen": 0})
    with http_server(handler) as url, pytest.raises(HTTPStatusError, match=r"HTTP 429 .*asks for 3600 s"):
        http_json(url + "/v1/chat/completions", {"messages": []}, retries=2, backoff=0.01)
    assert len(handler.times) == 1
    assert 9 <= retry_after(email.utils.formatdate(time.time() + 10, usegmt=True)) <= 10
    assert [retry_after(v) for v in (None, "", "soon", "nan", "-5", " 2.5 ")] == [None, None, None, None, 0.0, 2.5]


class Dropping(Flaky):
    """The first answer stops partway (the connection closes short of its Content-Length, as a server killed
    mid-answer leaves it), then as `Flaky` does."""

    fail, seen = 0, 0

    def do_POST(self):
        if type(self).seen:
            return super().do_POST()
        type(self).seen += 1
        fail_once(self, "drop")


def test_an_answer_cut_off_midway_is_asked_again():
    from gemma_tpu.infer.openai_client import http_json

    handler = type("DroppingNow", (Dropping,), {"seen": 0})
    with http_server(handler) as url:
        assert http_json(url + "/v1/chat/completions", {"messages": []}, retries=1, backoff=0.01)["choices"]
    assert handler.seen == 2


class Recovers(ScriptedModel):
    """The first chat completion fails as `how` says (a 503, a 429 asking for 1 s, a connection closed midway),
    the next ones answer in words; `times` holds when each came."""

    how, times = "503", []

    def do_POST(self):
        cls = type(self)
        cls.times.append(time.monotonic())
        if len(cls.times) > 1:
            return super().do_POST()
        fail_once(self, cls.how)


@pytest.mark.parametrize("how", ["503", "429", "drop"])
def test_the_tool_calling_chat_retries_a_transient_failure_as_evaluate_does(how):
    """serving.chat asked once: a server restarting (503), rate limiting (429 with Retry-After) or dropping the
    connection ended the question with an error that evaluate --endpoint, asking the same server, rode out. It
    now shares evaluate's retry policy (http_json, DEFAULT_RETRIES, --retries)."""
    handler = type("RecoversNow", (Recovers,), {"how": how, "times": [], "requests": [],
                                                "script": [{"content": "You walked 8123 steps."}]})
    with http_server(handler) as url:
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps today?")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "You walked 8123 steps." and len(handler.times) == 2
        assert handler.times[1] - handler.times[0] >= 0.95  # 1 s apart (backoff and Retry-After alike)
        handler.times.clear()
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps today?",
                           "--retries", "0")
    assert_one_line_error(proc, "/v1/chat/completions")
    assert len(handler.times) == 1


class Recording(ScriptedModel):
    """Keeps each request body; answers a stream (bench) or a whole completion in words."""

    bodies: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        type(self).bodies.append(body)
        if not body.get("stream"):
            return self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]}))
        self.wfile.write(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        self.wfile.write(sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}))
        self.wfile.write(sse("[DONE]"))
        self.close_connection = True


class NoUsageThrottled(Recording):
    """Answers the first request 429 (Retry-After: 7), then streams without `usage` (a server that sends none)."""

    def do_POST(self):
        if not type(self).bodies:
            type(self).bodies.append({})
            return fail_once(self, "429", "7")
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]}))
        self.wfile.write(sse({"choices": [{"index": 0, "delta": {"content": " fine"}, "finish_reason": "stop"}]}))
        self.wfile.write(sse("[DONE]"))
        self.close_connection = True


def test_bench_names_a_turned_away_request_and_tokens_counted_without_usage():
    """A 429 or 503 failed the request as a bare 'HTTP 429: try again': nothing said it was not retried nor when
    the server asked to be asked again; and a server sending no usage had its tokens counted per streamed chunk
    without the table saying so."""
    handler = type("NoUsageThrottledNow", (NoUsageThrottled,), {"bodies": []})
    with http_server(handler) as url:
        proc = _in_process("serving.bench", "--base-url", url, "--model", "m", "--num-prompts", "3", "--input-len",
                           "4", "--output-len", "2", "--concurrency", "1", "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr
    assert "HTTP 429 (rate limited, Retry-After: 7; the benchmark does not retry" in proc.stderr, proc.stderr
    assert re.search(r"^Failed requests:\s+1\b", proc.stdout, re.M) and re.search(
        r"^Total generated tokens:\s+4\b", proc.stdout, re.M), proc.stdout
    assert "no usage from the server for 2 of 2 requests: their generated tokens are counted one per streamed " \
           "chunk" in proc.stdout, proc.stdout
    with http_server(Recording) as url:  # a server that sends usage: nothing to say
        proc = _in_process("serving.bench", "--base-url", url, "--model", "m", "--num-prompts", "1", "--input-len",
                           "4", "--output-len", "2", "--disable-tqdm")
    assert proc.returncode == 0 and "no usage" not in proc.stdout, proc.stdout


def test_every_client_sends_its_sampling(tmp_path):
    """With no `temperature` vLLM samples at T=1 while the local server decodes greedily: serving.bench sent none
    unless asked, so the same benchmark timed answers of different kinds on the two servers. Every client we ship
    now says what it wants (greedy by default)."""
    handler = type("RecordingNow", (Recording,), {"bodies": []})
    with http_server(handler) as url:
        for entry, argv in (("serving.bench", ["--base-url", url, "--num-prompts", "2", "--input-len", "4",
                                               "--output-len", "2", "--disable-tqdm"]),
                            ("serving.chat", ["--base-url", url, "--once", "steps?"]),
                            ("gemma_tpu.evaluate", ["--data", str(CHAT), "--endpoint", url, "--limit", "1"])):
            handler.bodies.clear()
            proc = _in_process(entry, "--model" if entry != "gemma_tpu.evaluate" else "--served-model", "m", *argv)
            assert proc.returncode == 0, (entry, proc.stderr)
            assert handler.bodies and all(b.get("temperature") == 0.0 for b in handler.bodies), (entry, handler.bodies)
        handler.bodies.clear()
        proc = _in_process("serving.bench", "--base-url", url, "--model", "m", "--num-prompts", "1", "--input-len",
                           "4", "--output-len", "2", "--temperature", "0.7", "--disable-tqdm")
        assert proc.returncode == 0 and [b["temperature"] for b in handler.bodies] == [0.7], proc.stderr
        # a sampled chat answer could not be had twice: --seed is the simulated device's, and no seed was sent
        for argv, seeds in (([], [None]), (["--sampling-seed", "5"], [5])):
            handler.bodies.clear()
            proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps?", "--temperature",
                               "0.7", *argv)
            assert proc.returncode == 0, proc.stderr
            assert [(b["temperature"], b.get("seed")) for b in handler.bodies] == [(0.7, s) for s in seeds]
            assert all("top_k" not in b and "top_p" not in b for b in handler.bodies)  # the server's defaults apply
        handler.bodies.clear()  # the local chat's --top-k / --top-p, sent as vLLM's request fields
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps?", "--temperature",
                           "0.7", "--top-k", "20", "--top-p", "0.9")
        assert proc.returncode == 0, proc.stderr
        assert [(b["top_k"], b["top_p"]) for b in handler.bodies] == [(20, 0.9)]
        for argv in (["--top-k", "20"], ["--temperature", "0", "--sampling-seed", "4"]):  # greedy: ignored
            proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps?", *argv)
            assert_one_line_error(proc, f"{argv[-2]} applies to sampled answers: add --temperature")


def test_a_sampling_seed_the_servers_read_as_none_is_refused():
    """`serving.chat --sampling-seed -1` promised the same sampled answer every run, but vLLM (and the local server)
    read seed -1 as no seed: each run sampled afresh. Refused before any request, naming the option."""
    handler = type("RecordingSeed", (Recording,), {"bodies": []})
    with http_server(handler) as url:
        proc = _in_process("serving.chat", "--base-url", url, "--model", "m", "--once", "steps?", "--temperature",
                           "0.7", "--sampling-seed", "-1")
    assert_one_line_error(proc, "--sampling-seed -1", "read seed -1 as no seed", "give another seed")
    assert handler.bodies == []


def test_an_endpoint_failing_midway_keeps_the_examples_done_and_names_where_it_stopped(tmp_path):
    """A 5xx that outlasted the retries at example 3 of 5 lost the two answered (a single model kept nothing) and
    the error did not say which example; now they are printed and written to `<json>.partial.json`."""
    out = tmp_path / "r.json"

    class FailsLater(Flaky):  # answers two requests, then 503 to every one
        def do_POST(self):
            cls = type(self)
            cls.status, cls.fail = 503, 0 if cls.seen < 2 else 10**6
            super().do_POST()

    handler = type("FailsLaterNow", (FailsLater,), {"seen": 0})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "5", "--retries", "0", "--json", str(out))
    assert_one_line_error(proc, f"{CHAT}:3 (example 3 of 5): {url}/v1/chat/completions: HTTP 503")
    assert not out.exists()  # the results file promised the whole model
    partial = json.loads((tmp_path / "r.partial.json").read_text())
    assert partial["models"] == {} and partial["failed"]["completed"] == 2, partial["failed"]
    assert partial["failed"]["metrics"]["n"] == 2 and len(partial["failed"]["examples"]) == 2
    assert "example 3 of 5" in partial["failed"]["error"]
    assert f"endpoint:{url} (first 2 of 5)" in proc.stdout and re.search(r"^n\s+2$", proc.stdout, re.M)
    # the rerun completes: the stopped run's smaller numbers no longer sit beside the complete ones (a reader took
    # them for this run's); a file of the same name that is not our results is left alone
    with http_server(flaky(503, 0)) as url:
        rerun = ("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m", "--limit", "5",
                 "--json", str(out))
        proc = _in_process(*rerun)
        assert proc.returncode == 0 and json.loads(out.read_text())["n"] == 5, proc.stderr
        assert not (tmp_path / "r.partial.json").exists() and "removed " in proc.stderr, proc.stderr
        # the top-level n is each model's: the scored decisions (their records), from `conversations` conversations;
        # under --turns all it was the conversations (5) beside the model's 7
        assert _in_process(*rerun, "--turns", "all", "--json", str(tmp_path / "all.json")).returncode == 0
        doc = json.loads((tmp_path / "all.json").read_text())
        assert (doc["n"], doc["conversations"], doc["turns"]) == (7, 5, "all")
        assert doc["models"][f"endpoint:{url}"]["n"] == len(doc["examples"][f"endpoint:{url}"]) == 7
        (tmp_path / "r.partial.json").write_text('{"notes": "mine"}')
        assert _in_process(*rerun).returncode == 0 and (tmp_path / "r.partial.json").exists()
        # a Ctrl-C once the complete file is published (before the partial was removed) left the older one beside it
        (tmp_path / "r.partial.json").write_text(json.dumps(partial))
        import gemma_tpu.evaluate.run as evaluate_run

        def publish_then_interrupt(target, text, real=evaluate_run.write_text_atomic):
            real(target, text)
            raise KeyboardInterrupt

        with mock.patch.object(evaluate_run, "write_text_atomic", publish_then_interrupt):
            proc = _in_process(*rerun)
        assert proc.returncode != 0 and json.loads(out.read_text())["n"] == 5, proc.stderr
        assert not (tmp_path / "r.partial.json").exists() and "removed " in proc.stderr, proc.stderr


def test_compare_keeps_the_first_models_results_when_the_second_fails(tmp_path):
    out = tmp_path / "r.json"
    good, bad = flaky(503, 0), flaky(400, 100)
    with http_server(good) as a, http_server(bad) as b:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{a}",
                           f"endpoint:{b}", "--limit", "2", "--json", str(out))
    assert_one_line_error(proc, "HTTP 400")
    assert not out.exists()  # the results file promised both models
    partial = json.loads((tmp_path / "r.partial.json").read_text())
    assert list(partial["models"]) == [f"endpoint:{a}"] and partial["models"][f"endpoint:{a}"]["n"] == 2
    assert partial["failed"]["model"] == f"endpoint:{b}" and "HTTP 400" in partial["failed"]["error"]
    assert f"endpoint:{a}" in proc.stdout  # the finished model's table


def test_compare_scores_two_models_of_one_server_each_by_its_name(tmp_path):
    """A base and its LoRA adapter served by one vLLM server (README: `--model coach` selects the adapter) could not be
    compared: --served-model named one model for both sides, so the table scored it twice. `endpoint:URL#MODEL` names
    each side's model, and the label says which."""
    out = tmp_path / "r.json"
    handler = type("RecordingNow", (Recording,), {"bodies": []})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{url}#base",
                           f"endpoint:{url}/v1#coach", "--limit", "2", "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        assert [b["model"] for b in handler.bodies] == ["base", "base", "coach", "coach"]
        assert list(json.loads(out.read_text())["models"]) == [f"endpoint:{url}#base", f"endpoint:{url}/v1#coach"]
        handler.bodies.clear()  # a side without its own name takes --served-model's, under the plain label
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{url}",
                           f"endpoint:{url}#coach", "--served-model", "m", "--limit", "1", "--json", str(out))
        assert proc.returncode == 0 and [b["model"] for b in handler.bodies] == ["m", "coach"], proc.stderr
        assert list(json.loads(out.read_text())["models"]) == [f"endpoint:{url}", f"endpoint:{url}#coach"]
    proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{url}#", "model:x")
    assert_one_line_error(proc, "endpoint:URL#MODEL with both the URL and the model name")


def test_compare_checks_both_models_before_evaluating_either(tmp_path):
    handler = flaky(503, 0)
    with http_server(handler) as url:
        for missing in (f"model:{tmp_path / 'nope'}", f"checkpoint:{tmp_path / 'nope'}"):
            proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{url}", missing,
                               "--limit", "1")
            assert_one_line_error(proc, str(tmp_path / "nope"), f"--compare B ({missing})")  # not model.path
        # the side is named as given, its step or served model included (the @STEP was left out of the line)
        missing = f"checkpoint:{tmp_path / 'nope'}@7"
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--compare", f"endpoint:{url}#m", missing,
                           "--limit", "1")
        assert_one_line_error(proc, str(tmp_path / "nope"), f"--compare B ({missing})")
    assert handler.seen == 0  # no request was spent on the first model


def test_evaluate_limit_reads_only_the_rows_it_evaluates(tmp_path):
    """`--limit N` of a large file read and checked every row: a bad row past the N-th refused the run."""
    from tests.test_serving import scripted

    rows = CHAT.read_text(encoding="utf-8").splitlines()[:2]
    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(rows + ['{"messages": [{"role": "user"}'] ) + "\n", encoding="utf-8")
    out = tmp_path / "r.json"
    handler, server = scripted(*[{"content": "Fine."}] * 2)
    with server as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(data), "--endpoint", url, "--limit", "2",
                           "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        assert len(handler.requests) == 2 and json.loads(out.read_text())["models"]
        proc = _in_process("gemma_tpu.evaluate", "--data", str(data), "--endpoint", url, "--limit", "3")
        assert_one_line_error(proc, f"{data}:3")  # the bad row itself is still refused when it is asked for


class Picky(Flaky):
    """Refuses (HTTP 400, as vLLM answers a prompt over its context) the requests whose numbers are in `refuse`
    (counting from 1), answers the others with a get_steps call."""

    refuse: frozenset = frozenset()

    def do_POST(self):
        cls = type(self)
        if cls.seen + 1 in cls.refuse:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            cls.seen += 1
            return self._json(400, {"error": {"message": "This model's maximum context length is 32 tokens"}})
        cls.status, cls.fail = 503, 0
        super().do_POST()


def test_evaluate_scores_a_refused_request_as_wrong_and_goes_on(tmp_path):
    """One request the server refuses (a prompt over its context) ended the whole evaluation; it is now that
    example's miss (refused_rate, the record says why) - unless the server refuses every one, the rule of a local
    model's prompts past its context (the first five refused in a row ended an endpoint run, not a local one)."""
    out = tmp_path / "r.json"
    handler = type("PickyNow", (Picky,), {"refuse": frozenset({2, 4}), "seen": 0})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "5", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert handler.seen == 5 and f"{CHAT}:2 (" in proc.stderr and "maximum context length" in proc.stderr
    metrics = json.loads(out.read_text())["models"][f"endpoint:{url}"]
    assert metrics["n"] == 5 and metrics["refused_rate"] == pytest.approx(0.4)
    records = json.loads(out.read_text())["examples"][f"endpoint:{url}"]
    assert [r["kind"] for r in records][1::2] == ["refused", "refused"] and "HTTP 400" in records[1]["error"]
    assert re.search(r"^refused_rate\s+0\.4000$", proc.stdout, re.M), proc.stdout
    handler = type("PickyNow", (Picky,), {"refuse": frozenset(range(1, 6)), "seen": 0})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "8", "--json", str(out.with_name("s.json")))
    assert proc.returncode == 0, proc.stderr  # the first five refused, the other three scored
    assert handler.seen == 8 and re.search(r"^refused_rate\s+0\.6250$", proc.stdout, re.M), proc.stdout
    handler = type("PickyNow", (Picky,), {"refuse": frozenset(range(1, 9)), "seen": 0})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(CHAT), "--endpoint", url, "--served-model", "m",
                           "--limit", "8", "--json", str(out.with_name("t.json")))
    assert_one_line_error(proc, f"{CHAT}:1: ", "HTTP 400", "maximum context length", "(as are all 8 prompts)")
    assert handler.seen == 8 and not out.with_name("t.json").exists()


class Checking(Flaky):
    """Answers as `Flaky` does, after refusing (HTTP 400) what the local server's check refuses; keeps the bodies."""

    bodies: list = []

    def do_POST(self):
        from serving.openai_request import RequestError, check_chat_request

        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        type(self).bodies.append(body)
        try:
            check_chat_request(body)
        except RequestError as e:
            return self._json(400, {"error": {"message": str(e), "param": e.param}})
        call = {"id": "c", "type": "function", "function": {"name": "get_steps", "arguments": "{\"date\": \"today\"}"}}
        self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                              "tool_calls": [call]}}]})


def test_flat_tool_declarations_are_sent_in_openai_shape(tmp_path):
    """Data declaring tools flat (`{"name", "parameters"}`, as many datasets do and training reads) went to the
    server as it was: OpenAI, vLLM and our local server refuse it (400), so every example was `refused`."""
    from serving.bench import file_prompts

    flat = [{"name": "get_steps", "description": "steps", "parameters": {"type": "object", "properties": {
        "date": {"type": "string"}}}}, {"type": "function", "function": {"name": "get_heart_rate"}}]
    data = tmp_path / "flat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "tool_calls": [
        {"name": "get_steps", "arguments": {"date": "today"}}]}], "tools": flat}) + "\n")
    handler = type("CheckingNow", (Checking,), {"bodies": []})
    with http_server(handler) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(data), "--endpoint", url, "--served-model", "m")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^argument_accuracy\s+1\.0000$", proc.stdout, re.M), proc.stdout
    assert [t["function"]["name"] for t in handler.bodies[0]["tools"]] == ["get_steps", "get_heart_rate"]
    assert handler.bodies[0]["tools"][0] == {"type": "function", "function": flat[0]}
    assert file_prompts(str(data), 1, 0)[0].tools == handler.bodies[0]["tools"]  # the benchmark sends them alike


def test_bench_reads_a_json_array_dataset(tmp_path):
    """A .json dataset (one array of rows, as the training reader takes) was read line by line: `[` on its
    first line was 'not valid JSON'."""
    from gemma_tpu.core.errors import UserError
    from serving.bench import file_prompts

    rows = [{"prompt": "héllo"}, {"messages": [{"role": "user", "content": "steps?"}, {"role": "assistant",
                                                                                      "content": "9000"}]}]
    data = tmp_path / "d.json"
    data.write_text("\ufeff" + json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    got = file_prompts(str(data), 2, 0)
    assert sorted(p.messages[0]["content"] for p in got) == ["héllo", "steps?"]
    data.write_text(json.dumps([{"prompt": "x"}, 5]))
    with pytest.raises(UserError, match=r"d.json:1: expected a JSON object"):
        file_prompts(str(data), 1, 0)



def test_bench_reads_the_trainers_other_chat_shapes(tmp_path):
    """A ShareGPT or instruction-pair dataset (which training and evaluate read) was refused by the benchmark
    ('expected messages or prompt'): each row's prompt is now its conversation up to the first answer."""
    from gemma_tpu.core.errors import UserError
    from serving.bench import file_prompts

    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "steps?"},
                               {"from": "gpt", "value": "9000"}, {"from": "human", "value": "more"}]},
            {"instruction": "Name a fruit.", "context": "", "response": "Apple."},
            {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}]
    data = write_rows(tmp_path / "d.jsonl", rows)
    got = sorted((p.messages for p in file_prompts(str(data), 3, 0)), key=lambda m: m[-1]["content"])
    assert [m[-1]["content"] for m in got] == ["Name a fruit.", "hi", "steps?"], got
    assert all(m[-1]["role"] == "user" for m in got) and got[2][0] == {"role": "system", "content": "Be brief."}
    for row, needle in (({"text": "plain"}, r"d.jsonl:1: a language-modeling 'text' row"),
                        ({"conversations": [{"from": "gpt", "value": "x"}]}, r"d.jsonl:1: "),
                        ({"nothing": 1}, r"d.jsonl:1: no 'messages', 'prompt'/'completion'")):
        with pytest.raises(UserError, match=needle):
            file_prompts(str(write_rows(tmp_path / "d.jsonl", [row])), 1, 0)


def test_bench_sends_the_system_prompt_the_trainer_reads(tmp_path):
    """A chat row's `system` field (LLaMA-Factory, Anthropic-style exports), which training puts first, was dropped
    by the benchmark's own messages reader, and ShareGPT turns under `messages` were refused ('every message needs a
    role'): the served model was measured on prompts without the system prompt it was trained with."""
    from gemma_tpu.core.errors import UserError
    from serving.bench import file_prompts

    rows = [{"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}], "system": "S1",
             "max_tokens": 5},
            {"messages": [{"from": "system", "value": "S2"}, {"from": "human", "value": "q2"},
                          {"from": "gpt", "value": "a"}]},
            {"messages": [{"role": "user", "content": "q3"}], "system": "S3"}]  # a prompt-only chat
    got = sorted(([m["content"] for m in p.messages], p.max_tokens)
                 for p in file_prompts(str(write_rows(tmp_path / "d.jsonl", rows)), 3, 0))
    assert got == [(["S1", "q1"], 5), (["S2", "q2"], None), (["S3", "q3"], None)], got
    for row, needle in (({"messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}],
                          "system": "B"}, "d.jsonl:1: both a 'system' field and a system message"),):  # the trainer's
        with pytest.raises(UserError, match=needle):
            file_prompts(str(write_rows(tmp_path / "d.jsonl", [row])), 1, 0)
    # a prompt-only chat's system field as training reads any chat's (a number is its JSON text, as content is)
    (only,) = file_prompts(str(write_rows(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "q"}],
                                                                     "system": 3}])), 1, 0)
    assert only.messages == [{"role": "system", "content": "3"}, {"role": "user", "content": "q"}]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_compare_keeps_the_first_models_results_when_sigterm_stops_the_second(tmp_path, sig, code):
    """A preempted machine's SIGTERM (or a closed terminal's SIGHUP) during the second model ended the process at
    once: the first model's results (minutes of work) were lost, where Ctrl-C keeps them. Now both keep them too,
    exit 143 / 129."""
    out = tmp_path / "r.json"

    class Hangs(Flaky):  # lists its model, then never answers a completion
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            type(self).seen += 1
            time.sleep(60)

    with http_server(flaky(503, 0)) as a, http_server(Hangs) as b:
        proc = subprocess.Popen([sys.executable, "-m", "gemma_tpu.evaluate", "--data", str(CHAT), "--compare",
                                 f"endpoint:{a}", f"endpoint:{b}", "--limit", "2", "--json", str(out)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 120
        while Hangs.seen == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert not out.exists()
    partial = json.loads((tmp_path / "r.partial.json").read_text())
    assert list(partial["models"]) == [f"endpoint:{a}"] and partial["models"][f"endpoint:{a}"]["n"] == 2
    assert partial["failed"] == {"model": f"endpoint:{b}", "error": f"stopped by {sig}"}
    assert f"endpoint:{a}" in stdout


def test_a_gemma4_call_written_as_text_is_read_as_the_model_meant():
    """A server without vLLM's gemma4 tool parser hands a Gemma 4 call back as text. Kept whole (special tokens kept)
    it was read with the plain Gemma 3 vocabulary's markers: the call bare, its `<|"|>` string quotes part of each
    value (`'<|"|>2024-01-01<|"|>'`, scored unlike the reference) and `<|tool_call><tool_call|>` left as the answer's
    text. Stripped of its special tokens it is a bare call, its unquoted words text; a value holding a comma cannot
    be told from the next key then, and is a format error, not a guess."""
    from gemma_tpu.formats.function_calling import ToolCall
    from gemma_tpu.infer.openai_client import reply_from_message

    kept = ('Checking. <|tool_call>call:get_steps{date:<|"|>2024-01-01<|"|>,n:3,note:<|"|>a, b<|"|>}<tool_call|>'
            '<|tool_call>call:sleep{}<tool_call|>')
    reply = reply_from_message({"content": kept})
    assert (reply.kind, reply.text) == ("call", "Checking."), reply
    assert reply.calls == [ToolCall("get_steps", {"date": "2024-01-01", "n": 3, "note": "a, b"}), ToolCall("sleep", {})]
    # a turn going on past its call into the tool's answer (`<|tool_response>`): read up to it, as a local model's
    reply = reply_from_message({"content": '<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|><|tool_response>response:f{'})
    assert (reply.kind, reply.calls) == ("call", [ToolCall("f", {"a": "x"})]), reply
    stripped = reply_from_message({"content": "call:get_steps{date:2024-01-01,n:3}"})
    assert (stripped.kind, stripped.calls) == ("call", [ToolCall("get_steps", {"date": "2024-01-01", "n": 3})])
    assert reply_from_message({"content": "call:f{note:a, b}"}).kind == "format_error"


def test_a_gemma4_thought_an_endpoint_hands_back_as_text_is_read_apart():
    """A server without vLLM's gemma4 reasoning parser that keeps special tokens hands a Gemma 4's thought back in the
    content (`<|channel>thought\\n...<channel|>`, empty from a 26B or 31B with thinking off): it was scored as the
    answer's words, and a call after it read with them. Read apart as a local reply is (`gemma_chat.split_thought`),
    as the parser would have: the answer and the calls after it."""
    from gemma_tpu.formats.function_calling import ToolCall
    from gemma_tpu.infer.openai_client import reply_from_message

    reply = reply_from_message({"content": "<|channel>thought\n<channel|>You slept 7 hours."})
    assert (reply.kind, reply.text) == ("text", "You slept 7 hours."), reply
    reply = reply_from_message({"content": '<|channel>thought\nThe steps.<channel|><|tool_call>call:get_steps{date:'
                                           '<|"|>today<|"|>}<tool_call|>'})
    assert (reply.kind, reply.calls, reply.text) == ("call", [ToolCall("get_steps", {"date": "today"})], ""), reply
    cut = reply_from_message({"content": "<|channel>thought\nLet me"})  # cut within its thought: no answer
    assert (cut.kind, cut.text) == ("text", ""), cut
    assert reply_from_message({"content": "No thought, channel open."}).text == "No thought, channel open."

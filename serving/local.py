"""A local OpenAI-compatible server for development: `transformers serve` on a merged directory.

No server of our own: `transformers serve` (from `transformers[serving]`) serves an HF directory on
CPU with `/v1/chat/completions`, streaming and `tools` included. `LocalServer` wraps it for
`python -m serving.launch --local` and for tests:

* the model directory is never modified: the server reads a temporary directory of symlinks to it,
  named after the served model, plus — when the model carries no chat template — the tool-aware
  FunctionGemma template from `gemma_tpu.formats.function_calling`;
* the FunctionGemma markers are ordinary tokens in that directory's tokenizer (`show_call_markers`), so the
  answers keep them (transformers serve leaves special tokens out) and the calls can be read, as vLLM reads them;
* the server runs in that temporary directory with the model given by its bare name, so requests
  may name the model as `NAME` (a pinned `transformers serve` refuses any other name) or not at all;
* its hub cache is an empty directory (offline): its `/v1/models` lists the hub cache, not the
  pinned model, and would otherwise advertise unrelated cached models it then refuses to serve
  (`CheckedChatApp` answers `/v1/models` with the served name instead);
* it runs as `python -m serving.local NAME --host H --port P`: `transformers serve`'s own app behind
  `CheckedChatApp`, which answers `/v1/responses` itself through a chat completion (`serving.responses`: the
  served one fails there), answers a malformed chat (or text) completion with 400 and a JSON error naming the field
  (`serving.openai_request`) instead of a 500, bounds `max_tokens` by the model's context, cuts the stop string
  that ended a text from it (`trim_stops`, `StopTrim`), and returns the FunctionGemma calls in the model's text as
  `tool_calls` (streamed: as `tool_calls` deltas, `StreamedCalls`), as vLLM's parser does; it asks the served app
  for a stream every time (`whole_completion` puts a whole answer together), so a client that goes away stops the
  generation; with an API key (`server.api_key_env`, handed over in the environment) the /v1 paths need it, as vLLM's
  `--api-key` makes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from gemma_tpu.core import strict_json
from gemma_tpu.core.errors import SignalExit, UserError, read_json_object
from gemma_tpu.formats.function_calling import (
    FORCED_CALL_KWARG,
    find_lone_surrogate,
    function_token_map,
    tool_chat_template,
)
from gemma_tpu.hf.directory import check_same_directory, dir_identity
from gemma_tpu.hf.files import config_dtype
from gemma_tpu.models.registry import described_family
from serving.config import chat_template_in

SERVING_EXTRA = "transformers serve needs transformers[serving]: pip install -e '.[serve]'"


def check_port_free(host: str, port: int) -> None:
    """A UserError naming server.port when something on this machine already listens on `host:port` (or `host` is
    no address of this machine): a server started there (transformers serve here, vLLM in a `--net host` container)
    fails to bind only after it started, having loaded the model or pulled its image."""
    import errno

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:  # socket's OverflowError
        raise UserError(f"server.port {port!r}: not a TCP port (0 to 65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # no such name, or an address of another machine: not the port's fault
                raise UserError(f"server.host {host}: cannot listen there ({e.strerror or e}); give an "
                                f"address of this machine (127.0.0.1 keeps the API local)") from None
            raise UserError(f"server.port {port} on {host}: already in use (another server?); choose "
                            f"another with server.port=N") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS's pick), on `host`'s address family (`::1` is IPv6)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def transformers_executable() -> str:
    """The `transformers` CLI of this environment, checked to have its serving extras."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn")):
        raise UserError(SERVING_EXTRA)
    beside = Path(sys.executable).parent / "transformers"
    exe = str(beside) if beside.is_file() else shutil.which("transformers")
    if not exe:
        raise UserError(f"no `transformers` command next to {sys.executable} or on PATH; {SERVING_EXTRA}")
    return exe


def prepare_served_dir(model_dir: Path, name: str, workdir: Path, chat_template: Path | None = None,
                       identity: tuple[int, int] | None = None) -> Path:
    """`workdir/name`: symlinks to every file of `model_dir`, plus `chat_template` if given, else a
    tool chat template when the model has none. Refused where another directory was published at `model_dir` since
    `identity` (`dir_identity`, taken when it was checked; else here, before its listing)."""
    model_dir = Path(model_dir).resolve()
    identity = identity or dir_identity(model_dir)
    served = Path(workdir) / name
    served.mkdir(parents=True)
    for p in sorted(model_dir.iterdir()):
        if chat_template is not None and p.name in ("chat_template.jinja", "chat_template.json"):
            continue
        (served / p.name).symlink_to(p)
    _, has_template = chat_template_in(model_dir)
    if chat_template is not None:
        (served / "chat_template.jinja").write_text(Path(chat_template).read_text())
    elif not has_template:
        from transformers import AutoTokenizer


        tok = AutoTokenizer.from_pretrained(str(model_dir))
        (served / "chat_template.jinja").write_text(tool_chat_template(function_token_map(tok)))
    show_call_markers(served)
    check_same_directory(model_dir, identity)  # links made to one directory's files, its tokenizer read
    return served


_ADDED_TOKENS_KEY = re.compile(rb'"added_tokens"\s*:\s*(?=\[)')


def _added_tokens(data: bytes) -> tuple[list, int, int] | None:
    """tokenizer.json's `added_tokens` list and the byte range it lies in, read without decoding or parsing the rest
    (the vocabulary and merges: 33 MB for Gemma 3, whose whole parse and rewrite took 1.5 s of each local start);
    None for a file without such a list (transformers serve reports a broken file). The key is the first
    `"added_tokens"` followed by ':' and a list of token objects (in the vocabulary such a key maps to an id)."""
    import json

    if not data.lstrip().startswith(b"{"):
        return None
    decoder = json.JSONDecoder()
    for m in _ADDED_TOKENS_KEY.finditer(data):
        start, size = m.end(), 1 << 21
        while True:  # decode a growing window until the list ends inside it
            chunk = data[start:start + size].decode("utf-8", errors="ignore")
            try:
                value, end = decoder.raw_decode(chunk)
                break
            except ValueError:
                if start + size >= len(data):
                    value = None
                    break
                size *= 4
        if isinstance(value, list) and all(isinstance(e, dict) and "content" in e and "id" in e for e in value):
            return value, start, start + len(chunk[:end].encode("utf-8"))
    return None


class _TokenNames:
    """Membership in a tokenizer.json's vocabulary without parsing it: an added token, or the token's JSON string
    anywhere in the file (what `vocab_token_map` asks: which reserved tokens exist)."""

    def __init__(self, added: set, data: bytes):
        self.added, self.data = added, data

    def __contains__(self, token: object) -> bool:
        import json

        return token in self.added or isinstance(token, str) and any(
            json.dumps(token, ensure_ascii=ascii).encode() in self.data for ascii in (True, False))


def show_call_markers(served: Path) -> None:
    """Make the FunctionGemma markers of `served`'s tokenizer (`<start_function_call>`, or the `<unusedN>` a plain
    vocabulary writes them as) ordinary tokens, in files of its own in place of the symlinks: transformers serve
    decodes answers without special tokens, and a merged tool-calling model's markers are special, so its calls
    came back as `call:f{a:x}` with no markers (and no `<escape>`), which the stream never read as calls. vLLM's
    tool parsers keep special tokens too. The ids, and so the prompts, are unchanged."""
    import json

    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS, vocab_token_map

    tj = served / "tokenizer.json"
    try:
        data = tj.read_bytes() if tj.is_file() else None
    except OSError:
        return  # transformers serve reports an unreadable tokenizer itself
    span = _added_tokens(data) if data is not None else None
    if span is None:
        return
    added, start, end = span
    listed = {e.get("content") for e in added}
    shown = set(FUNCTION_MARKERS) | set(vocab_token_map(_TokenNames(listed, data)).values())
    entries = [e for e in added if e.get("content") in shown and e.get("special")]
    if not entries:
        return
    for e in entries:
        e["special"] = False
    # written only when a marker's flag changes, into this start's temporary directory: a file of its own (a symlink
    # cannot differ from its target), ~0.03 s for Gemma 3's 33 MB; a copy kept between starts would be state to
    # keep in step with the model's own file for no more than that
    tj.unlink()  # the rest of the file as it was: only the added tokens are written again
    with open(tj, "wb") as f:
        view = memoryview(data)
        f.write(view[:start])
        f.write(json.dumps(added, ensure_ascii=False, indent=2).encode("utf-8"))
        f.write(view[end:])
    tc = served / "tokenizer_config.json"
    try:
        cfg = json.loads(tc.read_text()) if tc.is_file() else None
    except (OSError, ValueError):
        return
    decoder = cfg.get("added_tokens_decoder") if isinstance(cfg, dict) else None
    flipped = [e for e in (decoder.values() if isinstance(decoder, dict) else ())
               if isinstance(e, dict) and e.get("content") in shown and e.get("special") is not False]
    if flipped:  # else it stays the symlink to the model's own file (it was written again, re-serialised, each start)
        for e in flipped:
            e["special"] = False
        tc.unlink()
        tc.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


def startup_failure(log: str) -> str:
    """`: why` from the output of a server that failed to start: its last line, or, when a module was missing, which
    one (a multimodal Gemma's processor needs torchvision: the last line said only "Could not import module
    'Gemma4Processor'. Are this object's requirements defined correctly?")."""
    import re

    missing = re.findall(r"No module named '([A-Za-z0-9_]+)", log)
    if missing:
        return (f": it needs the Python module {missing[-1]}, which is not installed here (pip install "
                f"{missing[-1]})")
    lines = [line for line in log.splitlines() if line.strip()]
    return (": " + lines[-1].strip()[:300]) if lines else ""


WORKDIR_PREFIX = "gemma-tpu-serve-"  # LocalServer's temporary directory, the served process's working directory
PARENT_ENV = "GEMMA_TPU_SERVE_PARENT"  # the PID of the LocalServer's process, for `stop_with_parent`
# the API key a LocalServer hands its served process (in its environment: the command line is visible to all)
API_KEY_ENV = "GEMMA_TPU_SERVE_API_KEY"


def stop_with_parent(interval: float = 1.0) -> None:
    """In a served process a LocalServer started (its PID in PARENT_ENV): stop once that process is gone. The server
    runs in a session of its own (a Ctrl-C at the terminal reaches the launcher alone, which stops it), so a
    launcher SIGKILLed (an OOM kill, `timeout -s KILL`, a scheduler) left it serving on the port for good, holding
    the model and its temporary directory, and the next launch on that port was refused. It removes that directory
    (its working directory) and sends itself SIGTERM: uvicorn finishes the requests under way, then exits."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(interval)
        workdir = Path.cwd()
        if workdir.name.startswith(WORKDIR_PREFIX):
            shutil.rmtree(workdir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


class LocalServer:
    """`transformers serve` on one model directory, on loopback by default (`chat_template`: a
    .jinja file to use instead of the model's own).

    `with LocalServer(dir, port=p) as server:` starts it, waits until `/health` answers, and stops
    it (and removes its temporary directory) on exit. `log` is a file the server's output is appended to, each
    run after a line naming its start; without one it goes to this process's stderr.
    """

    def __init__(self, model_dir: str | Path, name: str | None = None, host: str = "127.0.0.1",
                 port: int | None = None, log: str | Path | None = None, startup_timeout: float = 300.0,
                 chat_template: str | Path | None = None, max_model_len: int | None = None,
                 identity: tuple[int, int] | None = None, api_key: str | None = None, auto_tools: bool = True):
        self.model_dir = Path(model_dir).resolve()
        self.auto_tools = auto_tools  # False: "auto" tool choice refused, as vLLM without --enable-auto-tool-choice
        self.api_key = api_key  # the /v1 paths need `Authorization: Bearer KEY` (as vLLM's --api-key) when given
        self.identity = identity  # `dir_identity` of model_dir when it was checked (serving.config.inspect_model)
        self.max_model_len = max_model_len  # the context requests are bounded by, if below the model's
        self.chat_template = Path(chat_template).expanduser() if chat_template else None
        self.name = name or self.model_dir.name
        self.host = host
        self.port = port or free_port(self._client_host())
        self.log_path = Path(log) if log else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self._log: IO | None = None
        self._log_start = 0  # where this run's output begins in the log

    def _client_host(self) -> str:
        """The address a client on this machine reaches the server at: the loopback of the family it listens on
        (a server on `::` may be IPv6-only, where 127.0.0.1 finds nothing)."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    @property
    def url(self) -> str:
        host = self._client_host()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"  # an IPv6 address in brackets

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def command(self) -> list[str]:
        transformers_executable()  # the serving extras are installed
        return [sys.executable, "-m", "serving.local", self.name, "--host", self.host, "--port", str(self.port)] + (
            ["--max-model-len", str(self.max_model_len)] if self.max_model_len else []) + (
            [] if self.auto_tools else ["--no-auto-tool-choice"])

    def start(self) -> "LocalServer":
        cmd = self.command()
        check_port_free(self.host, self.port)  # the other server's /health made this one look ready
        self._workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        prepare_served_dir(self.model_dir, self.name, self._workdir, self.chat_template, self.identity)
        hub = self._workdir / "hub-cache"
        hub.mkdir()
        root = str(Path(__file__).resolve().parent.parent)  # `-m serving.local` from the temporary directory
        path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": path, PARENT_ENV: str(os.getpid())}  # it stops when this process is gone
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        if self.log_path is not None:
            # appended to, so a restart keeps the previous run's output (why it stopped); each run starts at a line
            # naming its start, and a failure is read from there on (`_log_tail`)
            self._log = self.log_path.open("a")
            started = time.strftime("%Y-%m-%d %H:%M:%S %z")
            self._log.write(f"===== serving.local: {self.name} ({self.model_dir}) on {self.url}, started {started} "
                            "=====\n")
            self._log.flush()
            self._log_start = self._log.tell()
        self.proc = subprocess.Popen(cmd, cwd=self._workdir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                     start_new_session=True)
        return self

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with self.log_path.open("rb") as f:  # this run's output, not an earlier run's failure
            f.seek(self._log_start)
            return startup_failure(f.read().decode(errors="replace"))

    def wait_ready(self) -> None:
        """Block until GET /health answers 200; a dead server or the timeout is a UserError."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise UserError(f"transformers serve exited with code {code} before it was ready{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise UserError(f"transformers serve did not answer {self.url}/health within "
                                f"{self.startup_timeout:.0f} s{self._log_tail()}")
            time.sleep(0.5)

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate the server (kill after `timeout`) and remove the temporary directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> "LocalServer":
        try:  # start() too: a failure after its temporary directory is made (the log's folder missing) left it
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------ the served process


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as `transformers serve` hands them to the chat template (text parts joined, call arguments
    parsed; `read_messages_as_trained`), for counting the prompt's tokens."""
    import json

    out = []
    for m in messages:
        msg = {"role": m["role"]}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(a) if isinstance(
                a := c["function"].get("arguments", "{}"), str) and a.strip() else (a or {})}} for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        content = m.get("content") or []  # as `read_messages_as_trained` hands it on
        msg["content"] = content if isinstance(content, str) else "".join(p["text"] for p in content)
        out.append(msg)
    return out


def _unexpected_fields(detail: Any) -> tuple[Any, str | None]:
    """transformers serve's refusal of fields it does not read ("Unexpected fields in the request: {'foo'}") as
    (message, param): the field (the first, sorted) in `param`, where a client reads which one it was (it was null).
    Refused as OpenAI refuses an unknown argument (400); vLLM accepts and ignores one (its request models allow
    extra fields and log them), but a field this server silently ignored would be a setting the client believes
    applied, a misspelt `max_token` included. Anything else: (detail, None)."""
    import ast
    import re

    m = re.fullmatch(r"Unexpected fields in the request: (\{.*\})", detail, re.S) if isinstance(detail, str) else None
    try:
        fields = sorted(str(f) for f in ast.literal_eval(m.group(1))) if m else []
    except (ValueError, SyntaxError, TypeError):
        fields = []
    if not fields:
        return detail, None
    return (f"Unexpected field{'s' if len(fields) > 1 else ''} in the request: {', '.join(fields)} (not read by this "
            f"server; leave {'them' if len(fields) > 1 else 'it'} out)"), fields[0]


class CheckedChatApp:
    """ASGI middleware: a POST to /v1/chat/completions (or /v1/completions) is read whole, checked by
    `serving.openai_request` (400 with `{"error": {"message", "type", "param"}}` when malformed, as OpenAI
    and vLLM answer; 404 naming another model than `model_name`, as vLLM answers) and passed on with
    `max_tokens` resolved; GET /v1/models lists `model_name`; anything else passes untouched."""

    def __init__(self, app, context: int | None = None, count_prompt=None, token_map: dict[str, str] | None = None,
                 vocab_size: int | None = None, check_generation_config=None, count_text=None,
                 model_name: str | None = None, forced_calls: bool = False, stop_texts: list[str] | None = None,
                 api_key: str | None = None, auto_tools: bool = True, sampling_defaults: dict | None = None):
        self.app, self.context, self.count_prompt, self.token_map = app, context, count_prompt, token_map
        self.sampling_defaults = dict(sampling_defaults or {})  # the model's temperature / top_p (`sampling_defaults`)
        self.auto_tools = auto_tools  # as vLLM's --enable-auto-tool-choice (tool_calling.enabled)
        self.api_key = api_key  # required on the /v1 paths as vLLM's --api-key requires it (`_authorized`)
        self.stop_texts = list(stop_texts or [])  # what the stop tokens decode to (`stop_token_texts`): cut as stops
        self.vocab_size, self.check_generation_config = vocab_size, check_generation_config
        self.count_text, self.model_name = count_text, model_name
        self.forced_calls = forced_calls  # the chat template opens a call on request (its `forced_call` kwarg)
        self._checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="request-checks")

    def sampling_echo(self, chat: dict) -> dict:
        """The sampling a Response echoes for the checked chat completion `chat` that answers it, as vLLM's
        ResponsesResponse.from_request echoes its SamplingParams: the temperature and top_p the request gets (its own,
        else the model's default, else 1; top_p 1 for a greedy one), `max_output_tokens` as resolved (what the context
        leaves when not given). They were echoed as sent, null when left out, where vLLM writes numbers."""
        temperature = chat.get("temperature", self.sampling_defaults.get("temperature", 1.0))
        top_p = chat.get("top_p", self.sampling_defaults.get("top_p", 1.0)) if temperature >= 1e-5 else 1.0
        return {"temperature": temperature, "top_p": top_p, "max_output_tokens": chat.get("max_tokens")}

    def _thought_tokens(self, text: str) -> int:
        """The tokens of a thought's text (a Response's reasoning_tokens); 0 without the served tokenizer."""
        return self.count_text(text, special=False) if self.count_text else 0

    def force_call(self, body: Any) -> str:
        """For a chat request whose tool_choice names a function or is "required", ask the chat template to open
        the answer with that call (any call) and return the text it writes there (markers as served), which the
        model's text continues; "" when nothing is forced. transformers serve has no guided decoding, so without
        this the model was free to answer in text (vLLM enforces tool_choice)."""
        from gemma_tpu.formats.function_calling import forced_call_prefix, map_markers
        from serving.openai_request import RequestError

        if not self.forced_calls or not isinstance(body, dict):
            return ""
        choice, kwargs = body.get("tool_choice"), body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and FORCED_CALL_KWARG in kwargs:
            # the template opened a call this server did not know of: the answer came back without its opening,
            # as text that was half a call
            raise RequestError(f"chat_template_kwargs.{FORCED_CALL_KWARG}", "set by the server from tool_choice; "
                                                                            "send tool_choice instead")
        if not body.get("tools"):
            return ""
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
            choice.get("function"), dict) else None
        if not (choice == "required" or isinstance(named, str)) or not isinstance(kwargs or {}, dict):
            return ""
        body["chat_template_kwargs"] = {**(kwargs or {}), FORCED_CALL_KWARG: named or True}
        return map_markers(forced_call_prefix(named), self.token_map)

    async def _json(self, send, status: int, obj: dict) -> None:
        import json

        data = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    @staticmethod
    def _openai_errors(send):
        """`send`, with an error of the inner server in OpenAI's shape (`{"error": {"message", "type", "param",
        "code"}}`): transformers serve answers FastAPI's `{"detail": ...}` (422 for a field it does not know, 400
        for others) or a plain-text 500, which OpenAI clients show as a bare status; a 422 becomes the 400 OpenAI
        and vLLM answer for an invalid request."""
        import json

        held: dict = {}
        chunks: list[bytes] = []

        async def wrapped(message):
            if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
                held.update(message)
                return
            if not held or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            status, raw = held["status"], b"".join(chunks)
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                out = raw  # already OpenAI's shape
            else:
                detail = obj.get("detail") if isinstance(obj, dict) and "detail" in obj else raw.decode(errors="replace")
                status = 400 if status == 422 else status
                detail, param = _unexpected_fields(detail)
                out = json.dumps({"error": {"message": detail if isinstance(detail, str) else json.dumps(detail),
                                            "type": error_type(status), "param": param, "code": status}}).encode()
            await send({**held, "status": status, "headers": [
                (k, v) for k, v in held.get("headers", []) if k.lower() not in (b"content-length", b"content-type")] + [
                (b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})

        return wrapped

    def tool_calls(self, raw: bytes, parallel: bool = True, prefix: str = "", named: bool = False,
                   required: bool = False) -> bytes:
        """A non-streamed completion whose content holds FunctionGemma calls, with the calls in `message.tool_calls`
        (arguments as JSON strings; only the first unless `parallel`, as vLLM honours `parallel_tool_calls:
        false`), the text outside them as `content` and finish_reason `tool_calls` (a `named` tool_choice's
        keeps its own, and so does a `required` one's cut at max_tokens: vLLM says "tool_calls" for it only after a
        "stop"), as vLLM's tool parser answers, read as the same text streams (`StreamedCalls`); anything else
        unchanged. `prefix`: the start of a call the chat template wrote (`force_call`), which the content
        continues."""
        import json

        try:
            resp = json.loads(raw)
            choice = resp["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            return raw
        if not isinstance(message, dict) or message.get("tool_calls") or not isinstance(message.get("content"), str):
            return raw
        # read as it streams (`StreamedCalls`), after the prefix: the call the template opened (a forced call that
        # did not come whole is the answer's text with its opening, as it streams)
        content, calls = StreamedCalls(self.token_map, parallel, prefix).whole(message["content"], resp.get("id"))
        if not calls and not prefix:
            return raw
        message["content"] = content or (None if calls else "")
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            # a named tool_choice's call keeps the generation's finish_reason, as in vLLM and OpenAI; an "auto" one's
            # is "tool_calls" even when cut at max_tokens, as vLLM's whole answer says it (its stream says "length")
            if not named and not (required and choice.get("finish_reason") != "stop"):
                choice["finish_reason"] = "tool_calls"
        return json.dumps(resp, ensure_ascii=False).encode()

    def _authorized(self, scope) -> bool:
        """Whether a request may pass the API key check, as vLLM's (its AuthenticationMiddleware): with a key, every
        /v1 path but a CORS preflight (OPTIONS) needs `Authorization: Bearer KEY`, the scheme in any case (vLLM's
        verify_token lowers it: `bearer KEY` was refused here, taken there); /health and the rest do not."""
        import hmac

        if not self.api_key or scope["type"] != "http" or scope["method"] == "OPTIONS" or \
                not scope.get("path", "").startswith("/v1"):
            return True
        scheme, _, given = dict(scope.get("headers", [])).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, self.api_key.encode())

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not self._authorized(scope):  # before anything else, as vLLM's middleware (a trailing slash included)
            # vLLM's AuthenticationMiddleware answers this body, not an OpenAI-shaped error (a client reading
            # error.message there finds a string)
            return await self._json(send, 401, {"error": "Unauthorized"})
        if path.endswith("/") and path != "/":
            # answered by the inner app as vLLM (FastAPI) answers it, before reading the body: a 307 to the path
            # without the slash (where the request is checked), or a 404
            return await self.app(scope, receive, self._openai_errors(send))
        if path.startswith("/v1/models") and scope["method"] == "GET" and self.model_name:
            # the served model, as vLLM lists it (transformers serve lists its hub cache: nothing, offline)
            # vLLM's ModelCard: with the context requests are bounded by (`max_model_len`, which clients size their
            # max_tokens by: it was missing) and the model loaded (`root`: the served directory's name)
            card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": self.model_name, "parent": None, "max_model_len": self.context}
            if path == "/v1/models":
                return await self._json(send, 200, {"object": "list", "data": [card]})
            if path == f"/v1/models/{self.model_name}":  # the SDK's models.retrieve (transformers serve: 404)
                return await self._json(send, 200, card)
            if path.startswith("/v1/models/"):
                return await self._json(send, 404, {"error": {
                    "message": f"The model `{path[len('/v1/models/'):]}` does not exist: this server serves "
                               f"`{self.model_name}`", "type": "NotFoundError", "param": "model", "code": 404}})
        if path.startswith("/v1/audio/"):  # transformers serve's transcription endpoint: a bare 500 on a text model
            return await self._json(send, 404, {"error": {
                "message": f"{path}: this server serves a text model{f' (`{self.model_name}`)' if self.model_name else ''}"
                           f"; it has no audio endpoints", "type": "NotFoundError", "param": None, "code": 404}})
        if scope["type"] != "http" or scope["method"] != "POST" or path not in ("/v1/chat/completions",
                                                                               "/v1/completions", "/v1/responses"):
            # anything else as transformers serve answers it, an error in OpenAI's shape (not FastAPI's {"detail"})
            return await self.app(scope, receive, self._openai_errors(send) if scope["type"] == "http" else send)
        import json

        from serving.openai_request import RequestError, check_chat_request, check_completion_request
        from serving.responses import chat_request, request_param

        send = self._openai_errors(send)
        ctype = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            # vLLM's validate_json_request refuses it (400) before reading the body: a client sending text/plain (or
            # curl -d's form encoding) passed here and failed there
            return await self._json(send, 400, {"error": {
                "message": f"Content-Type {ctype or '(none)'!r}: this endpoint reads a JSON body, sent as "
                           "Content-Type: application/json (Unsupported Media Type: Only 'application/json' is "
                           "allowed, as vLLM answers)", "type": error_type(400), "param": None, "code": 400}})
        translated = False
        raw, more = bytearray(), True  # grown in place: `bytes +=` copied the whole body per chunk (a 100 MB body
        while more:                   # in 64 KB chunks took 77 s of CPU before any check)
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            raw += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            try:
                body = strict_json.loads_finite(bytes(raw))  # NaN, Infinity, 1e999 were taken (and rendered)
            except (json.JSONDecodeError, UnicodeDecodeError, strict_json.NotJSON) as e:
                raise RequestError(None, f"the request body is not valid JSON ({e})") from None
            except RecursionError:
                raise RequestError(None, "the request body is nested too deeply") from None
            bad = find_lone_surrogate(body)
            if bad:  # JSON's unpaired \ud800: the tokenizer (or the inner server) failed on it with a bare 500
                raise RequestError(bad[0] or None, f"holds a lone UTF-16 surrogate (\\u{ord(bad[1].group()):04x} at "
                                                   f"character {bad[1].start()}), which is not text: pair it or remove it")
            # Message text holding the chat markup's control tokens (`<start_of_turn>` in a user message) is rendered
            # and tokenized as markup here, and is neither refused nor warned of: vLLM does the same without a word,
            # and this server stands in for it (a client that passes here passes there, and one that fails, fails
            # there). The server cannot tell a mistake from a client sending markup on purpose, and the clients
            # that take people's text refuse it themselves (serving.chat, the chats, the training data reader).
            model = body.get("model") if isinstance(body, dict) else None
            if model == "":  # vLLM serves its model to a request naming it "" as to one naming none (a 404 here)
                del body["model"]
            elif self.model_name and isinstance(model, str) and model != self.model_name:
                # transformers serve answered 400 {"detail": ...}, which clients read as this request's fault
                return await self._json(send, 404, {"error": {
                    "message": f"The model `{model}` does not exist: this server serves `{self.model_name}`",
                    "type": "NotFoundError", "param": "model", "code": 404}})
            request = body  # a Responses request is answered through the chat completion it amounts to
            if path == "/v1/responses":
                body = chat_request(body)
            translated = path == "/v1/responses"  # from here on an error names a chat field
            forced = self.force_call(body) if path in ("/v1/chat/completions", "/v1/responses") else ""
            check = check_completion_request if path == "/v1/completions" else check_chat_request
            # in a thread of its own (one: the tokenizer is not shared between threads): rendering and counting a long
            # prompt held the event loop, and every other request's stream and /health waited for it
            body = await asyncio.get_running_loop().run_in_executor(self._checks, functools.partial(
                check, body, self.context, self.count_text if check is check_completion_request else self.count_prompt,
                self.vocab_size, self.check_generation_config))
            if not self.auto_tools and check is check_chat_request and body.get("tools") and \
                    body.get("tool_choice", "auto") == "auto":  # vLLM's refusal without --enable-auto-tool-choice
                raise RequestError("tool_choice", '"auto" tool choice (the default with tools) requires tool calling, '
                                                  'which this server has off (tool_calling.enabled: false), as vLLM '
                                                  'refuses it without --enable-auto-tool-choice: send tool_choice '
                                                  '"none" or a named function, or serve with tool calling on')
        except RequestError as e:
            param, message = e.param, str(e)
            if translated and param:  # a field of the chat completion it became: name the one sent
                param = request_param(param, request)
                message = message.replace(e.param, param)
            # `code`: the status, as vLLM's ErrorResponse gives it (and this server's other errors): it was null
            return await self._json(send, 400, {"error": {"message": message, "type": error_type(400),
                                                          "param": param, "code": 400}})
        # the inner server streams every answer (a whole one is put together here, `whole_completion`): its streams stop
        # generating when the client goes away, its whole answers ran on to max_tokens, holding the one generation
        # thread, after the client had given up
        whole = (request.get("stream") is not True) if path == "/v1/responses" else not body.get("stream")
        rid = body.pop("request_id", None)  # vLLM's extension: the completion's id (`completion_id`)
        thought = body.pop("include_reasoning", True)  # vLLM's: false leaves the thought out (transformers serve
        #                                                refuses the field)
        body["stream"] = True
        # a stop string no token can end (a character the vocabulary lacks) is matched on the decoded text
        # (`stop_on_decoded_text`), and cut from the text here as any other
        data = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        if path == "/v1/responses":
            if request.get("request_id") is None:  # vLLM's Response id: `resp_` and a fresh uuid's hex digits (it was
                import uuid                          # `resp_` before transformers serve's chat id)

                request = {**request, "request_id": f"resp_{uuid.uuid4().hex}"}
            request = {**request, **self.sampling_echo(body)}
            return await self._responses(scope, headers, replay, send, request, body, forced, whole)
        named = ServedName(self.model_name, completion_id(path, scope.get("headers", []), rid))
        stops = [s for s in ([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []) if s]
        stops += self.stop_texts
        tools = path == "/v1/chat/completions" and body.get("tools") and body.get("tool_choice") != "none"
        if not whole:
            # the stop strings are cut first (transformers serve streams them), then the calls are read
            filters = [ReasoningName(thought)] if path == "/v1/chat/completions" else []
            filters += ([StopTrim(stops)] if stops else []) + (
                [StreamedCalls(self.token_map, body.get("parallel_tool_calls") is not False, forced,
                               isinstance(body.get("tool_choice"), dict))] if tools else [])
            filters.append(named)  # after the calls: theirs named after the served app's id, as unstreamed
            filters.append(NullFields())
            filters.append(StreamUsage((body.get("stream_options") or {}).get("include_usage") is True))
            filters.append(ErrorEvents())
            status: list[int] = []
            tail = [b""]  # the end of what was sent: a stream ends with `data: [DONE]`, as OpenAI's and vLLM's do

            async def rewrite(message):
                if message["type"] == "http.response.start":
                    status.append(message.get("status", 200))
                    if status[0] == 200:  # the body is rewritten: its length changes
                        message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                          if k.lower() != b"content-length"]}
                    return await send(message)
                if message["type"] != "http.response.body" or status[:1] != [200]:
                    return await send(message)
                more = message.get("more_body", False)
                out = message.get("body", b"")
                for f in filters:
                    out = f.feed(out) + (b"" if more else f.close())
                tail[0] = (tail[0] + out)[-64:]
                if not more and not tail[0].rstrip().endswith(b"data: [DONE]"):  # transformers serve just closed it
                    out += (b"" if tail[0].endswith(b"\n\n") or not tail[0] else b"\n\n") + b"data: [DONE]\n\n"
                if out or not more:
                    await send({**message, "body": out})

            return await self.app({**scope, "headers": headers}, replay, rewrite)
        start: dict = {}
        chunks: list[bytes] = []

        async def collect(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            out = b"".join(chunks)
            if start.get("status") == 200:
                out = whole_completion(out, thought)
                start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-type"] + [
                    (b"content-type", b"application/json")]
                if out.startswith(b'{"error"'):  # the generation failed midway (an error event)
                    start["status"] = 500
            if start.get("status") == 200 and stops:
                out = trim_stops(out, stops)
            if start.get("status") == 200 and tools:
                out = self.tool_calls(out, body.get("parallel_tool_calls") is not False, forced,
                                      isinstance(body.get("tool_choice"), dict), body.get("tool_choice") == "required")
            if start.get("status") == 200:
                out = named.whole(out)
            await _send_whole(send, start, out)

        await self.app({**scope, "headers": headers}, replay, collect)


    async def _responses(self, scope, headers, replay, send, request: dict, chat: dict, forced: str = "",
                         whole: bool = True) -> None:
        """A Responses request answered by the inner app's chat completion `chat`, its calls parsed (after `forced`,
        the call the template opened for a forcing tool_choice), as a Response object, or, when `request` asks for
        a stream, as the Response's events while the chat completion streams."""
        import json

        from serving.responses import response_object

        inner = {**scope, "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "headers": headers}
        stops = ([chat["stop"]] if isinstance(chat.get("stop"), str) else chat.get("stop") or []) + self.stop_texts
        tools = chat.get("tools") and chat.get("tool_choice") != "none"
        parallel = chat.get("parallel_tool_calls") is not False
        if not whole:
            return await self._responses_stream(inner, replay, send, request, stops, tools, parallel, forced)
        start: dict = {}
        chunks: list[bytes] = []

        async def collect(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(inner, replay, collect)
        out = b"".join(chunks)
        if start.get("status") != 200:  # the inner server's error, as it gave it
            return await _send_whole(send, start, out)
        out = whole_completion(out)
        if out.startswith(b'{"error"'):  # the generation failed midway (an error event)
            return await _send_whole(send, {**start, "status": 500, "headers": [(b"content-type", b"application/json")]},
                                     out)
        if stops:
            out = trim_stops(out, stops)
        if tools:
            out = self.tool_calls(out, parallel, forced)
        try:  # on the checks' thread: the thought's tokens are counted by the tokenizer it uses
            resp = await asyncio.get_running_loop().run_in_executor(self._checks, functools.partial(
                response_object, json.loads(out), request, self.model_name, self._thought_tokens))
        except (ValueError, TypeError, AttributeError, KeyError, IndexError):
            return await self._json(send, 502, {"error": {"message": f"the chat completion behind /v1/responses "
                                                                     f"was not one: {out[:200]!r}",
                                                          "type": "server_error", "param": None, "code": None}})
        return await self._json(send, 200, resp)

    async def _responses_stream(self, inner, replay, send, request, stops, tools, parallel, forced) -> None:
        """The streamed chat completion's events through the chat filters (stop strings cut, calls parsed), then
        into the Response's events (`ResponseStream`); an inner error (not 200) is passed on whole."""
        from serving.responses import ResponseStream

        filters = ([StopTrim(stops)] if stops else []) + ([StreamedCalls(self.token_map, parallel, forced)]
                                                          if tools else [])
        filters.append(ChatToResponse(ResponseStream(request, self.model_name, self._thought_tokens)))
        start: dict = {}
        held: list[bytes] = []  # an error's body, sent whole at its end

        def through(out: bytes, more: bool) -> bytes:
            for f in filters:
                out = f.feed(out) + (b"" if more else f.close())
            return out

        async def rewrite(message):
            if message["type"] == "http.response.start":
                start.update(message)
                if message.get("status", 200) == 200:
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8")]})
                return
            if message["type"] != "http.response.body":
                return await send(message)
            more = message.get("more_body", False)
            out = message.get("body", b"")
            if start.get("status", 200) != 200:
                held.append(out)
                return None if more else await _send_whole(send, start, b"".join(held))
            # the end (`response.completed`, the thought's tokens counted) on the checks' thread, as the whole answer
            out = through(out, more) if more else await asyncio.get_running_loop().run_in_executor(
                self._checks, through, out, more)
            if out or not more:
                await send({"type": "http.response.body", "body": out, "more_body": more})

        await self.app(inner, replay, rewrite)


# the null fields of vLLM's choices beyond OpenAI's (`stop_reason`: the stop string, or None for any other end),
# which a client written for vLLM reads: a text completion's on every chunk and whole, with its `token_ids` and
# `prompt_token_ids` (null unless `return_token_ids`, which this server refuses); a chat completion's `stop_reason` on
# its whole choice and its finishing chunk
TEXT_CHOICE_NULLS = ("stop_reason", "token_ids", "prompt_token_ids")
CHAT_CHOICE_NULLS = ("stop_reason", "token_ids")  # a whole chat choice's (its stream's finishing chunk: stop_reason)
# vLLM's whole chat message: null unless set (its `tool_calls` left out when there are none)
CHAT_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")


def whole_completion(stream: bytes, thought: bool = True) -> bytes:
    """The chat or text completion a stream of its chunks (`data: {...}` events) amounts to, as transformers serve
    answers a request without `stream`: the text joined, the last finish_reason, the usage of the last chunk; an
    error event as `{"error": ...}`; anything else unchanged."""
    import json

    text, reasoning, calls, out = [], [], {}, None
    for event in stream.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = event.strip()[len(b"data:"):].strip() if event.strip().startswith(b"data:") else b""
        try:
            chunk = json.loads(data) if data and data != b"[DONE]" else None
        except ValueError:
            return stream
        if isinstance(chunk, dict) and "error" in chunk:
            return json.dumps(openai_error(chunk["error"])).encode()
        choice = (chunk.get("choices") or [None])[0] if isinstance(chunk, dict) else None
        if not isinstance(choice, dict):
            continue
        chat = isinstance(choice.get("delta"), dict)
        piece = choice["delta"].get("content") if chat else choice.get("text")
        text.append(piece if isinstance(piece, str) else "")
        for key in ("reasoning_content", "reasoning"):  # a thinking model's (Gemma 4): transformers serve's name
            if chat and isinstance(choice["delta"].get(key), str):
                reasoning.append(choice["delta"][key])
        for tc in (choice["delta"].get("tool_calls") or []) if chat else []:  # calls transformers serve parsed itself
            if isinstance(tc, dict):
                call = calls.setdefault(tc.get("index", len(calls)), {"id": None, "type": "function",
                                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
        if out is None:
            # `logprobs: null`, as vLLM and OpenAI write it (a request for them is refused): `choice["logprobs"]` failed
            # and vLLM's `stop_reason` (set by `trim_stops` for a stop string), a text completion's token ids too
            nulls = dict.fromkeys(TEXT_CHOICE_NULLS if not chat else CHAT_CHOICE_NULLS)
            out = {"id": chunk.get("id"), "choices": [{"finish_reason": None, "index": 0, "logprobs": None, **nulls}],
                   "created": chunk.get("created"),
                   "model": chunk.get("model"), "object": "chat.completion" if chat else "text_completion"}
        if choice.get("finish_reason") is not None:
            out["choices"][0]["finish_reason"] = choice["finish_reason"]
        if isinstance(chunk.get("usage"), dict):
            out["usage"] = chunk["usage"]
    if out is None:
        return stream
    joined = "".join(text)
    if out["object"] == "chat.completion":
        # with the null fields of vLLM's ChatMessage (its `reasoning` included: a client written for vLLM reads it)
        out["choices"][0]["message"] = {"content": joined, "role": "assistant", **dict.fromkeys(CHAT_MESSAGE_NULLS)}
        if calls:
            out["choices"][0]["message"]["tool_calls"] = [calls[k] for k in sorted(calls)]
        if reasoning and thought:  # named as vLLM names it (`ReasoningName`); null for include_reasoning false
            out["choices"][0]["message"]["reasoning"] = "".join(reasoning)
    else:
        out["choices"][0]["text"] = joined
    return json.dumps(out, ensure_ascii=False).encode()


def error_type(status: int) -> str:
    """An error's `type` as vLLM's ErrorResponse names it (vllm.entrypoints.utils.create_error_response and its
    HTTPException handler): "BadRequestError" for a 400 (OpenAI's "invalid_request_error" was written here),
    "InternalServerError" from 500, else the status's phrase ("Method Not Allowed")."""
    import http

    if status == 400:
        return "BadRequestError"
    if status >= 500:
        return "InternalServerError"
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def openai_error(error: Any) -> dict:
    """An error event's `error` (transformers serve writes a bare string) in the shape vLLM streams it (its
    create_streaming_error_response: type "InternalServerError", code 500)."""
    return {"error": {"type": error_type(500), "param": None, "code": 500,
                      **(error if isinstance(error, dict) else {"message": str(error)})}}


async def _send_whole(send, start: dict, body: bytes) -> None:
    """A response as the inner app started it, with this body and its length."""
    await send({**start, "headers": [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EventStream:
    """A rewriter of a server-sent event stream (`data: {...}` events, blank-line separated): `feed` the body's
    bytes as they come and get the rewritten events whole, `close()` at the end for the rest. Subclasses
    rewrite one event in `_event` and may send what they still hold in `_end`."""

    def __init__(self):
        self.raw = b""  # bytes of an event not yet complete

    def _event(self, event: bytes) -> bytes:
        return event + b"\n\n"

    def _end(self) -> bytes:
        return b""

    def feed(self, data: bytes) -> bytes:
        self.raw += data.replace(b"\r\n", b"\n")
        *events, self.raw = self.raw.split(b"\n\n")
        return b"".join(self._event(e) for e in events if e.strip())

    def close(self) -> bytes:
        out = self._event(self.raw) if self.raw.strip() else b""
        self.raw = b""
        return out + self._end()


def sse_choice(event: bytes) -> tuple[dict | None, dict | None]:
    """The chunk of a `data: {...}` event and its first choice; (None, None) for [DONE], an error event, a
    comment or anything else without a choice object."""
    import json

    data = event[len(b"data:"):].strip() if event.startswith(b"data:") else None
    try:
        chunk = json.loads(data) if data and data != b"[DONE]" else None
        choice = chunk["choices"][0] if isinstance(chunk, dict) and chunk.get("choices") else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None, None
    return (chunk, choice) if isinstance(choice, dict) else (None, None)


def sse_event(chunk: dict) -> bytes:
    import json

    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ServedName(EventStream):
    """A completion (`whole`) or a stream of its chunks (`feed`, `close`) naming the model as it is served (and
    listed by /v1/models), as vLLM names it: transformers serve answers `NAME@main`; and, given `rid`, with that id
    (`completion_id`: vLLM's, where transformers serve answers its bare request id)."""

    def __init__(self, name: str | None, rid: str | None = None):
        super().__init__()
        self.name, self.rid = name, rid

    def whole(self, raw: bytes) -> bytes:
        import json

        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return raw
        if not isinstance(obj, dict):
            return raw
        new = {**({"model": self.name} if self.name and "model" in obj else {}),
               **({"id": self.rid} if self.rid is not None and "id" in obj else {})}
        if all(obj[k] == v for k, v in new.items()):
            return raw
        obj.update(new)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or event[5:].strip() == b"[DONE]":
            return event + b"\n\n"
        return b"data: " + self.whole(event[5:].strip()) + b"\n\n"


def completion_id(path: str, headers: list, request_id: str | None) -> str:
    """The id vLLM gives a chat or text completion (`path`): `chatcmpl-` or `cmpl-` before the request's `X-Request-Id`
    header, else its `request_id` field (vLLM's extension), else a fresh uuid's 32 hex digits (vLLM's `random_uuid`):
    transformers serve's own id, a bare uuid with dashes, was passed on where a client told the endpoint by it."""
    import uuid

    given = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
    base = given if given is not None else request_id if request_id is not None else uuid.uuid4().hex
    return ("cmpl-" if path == "/v1/completions" else "chatcmpl-") + base


def _cut(text: str, stops: list[str]) -> int | None:
    """Where the first of `stops` starts in `text` (None: nowhere)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def trim_stops(raw: bytes, stops: list[str]) -> bytes:
    """A non-streamed chat or text completion that stopped at a stop string, with the text cut where it starts and
    finish_reason "stop": OpenAI and vLLM return the text without it, transformers serve with it (and whatever its
    last token held after it) - and, when the stop string came with the last token max_tokens allowed, with
    finish_reason "length" (which this passed on whole, stop string and all, where a stream was cut); its
    `stop_reason` is the stop string. Anything else unchanged."""
    import json

    try:
        resp = json.loads(raw)
        choice = resp["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return raw
    if not isinstance(choice, dict) or choice.get("finish_reason") not in ("stop", "length"):
        return raw
    holder, key = (choice["message"], "content") if isinstance(choice.get("message"), dict) else (choice, "text")
    text = holder.get(key)
    at = _cut(text, stops) if isinstance(text, str) else None
    if at is None:
        return raw
    holder[key] = text[:at]
    choice["finish_reason"] = "stop"
    # which stop it was, as vLLM says it: a client tells the call stop marker (a hand-over to a tool) from the end of
    # the turn by it (`openai_client.stopped_at_call_marker`)
    choice["stop_reason"] = next(s for s in stops if text.startswith(s, at))
    return json.dumps(resp, ensure_ascii=False).encode()


class StopTrim(EventStream):
    """`trim_stops` for a stream (chat `delta.content` or text `text` events): text that might begin a stop
    string is held until the next piece settles it; from a stop string on, nothing more is sent but the
    finishing event (and what was held, when no stop string came). `feed` bytes as they come, then `close()`."""

    def __init__(self, stops: list[str]):
        super().__init__()
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped: str | bool = False  # the stop string the text stopped at, once it has

    def _settled(self, final: bool) -> str:
        """The held text that can be sent now."""
        if self.stopped:
            return ""
        at = _cut(self.held, self.stops)
        if at is not None:
            self.stopped = next(s for s in self.stops if self.held.startswith(s, at))
            out, self.held = self.held[:at], ""
            return out
        keep = 0 if final else max((k for s in self.stops for k in range(1, min(len(s), len(self.held) + 1))
                                    if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def _event(self, event: bytes) -> bytes:
        chunk, choice = sse_choice(event)
        if not isinstance(choice, dict):
            return event + b"\n\n"
        holder, key = (choice["delta"], "content") if isinstance(choice.get("delta"), dict) else (choice, "text")
        piece = holder.get(key)
        final = choice.get("finish_reason") is not None
        if not isinstance(piece, str) and not final:
            return event + b"\n\n"
        self.held += piece if isinstance(piece, str) else ""
        text = self._settled(final)
        if final and self.stopped and choice.get("finish_reason") == "length":  # as `trim_stops` says it
            choice["finish_reason"] = "stop"
        if final and self.stopped:
            choice["stop_reason"] = self.stopped
        if not text and not final:
            if not (isinstance(choice.get("delta"), dict) and set(holder) - {key}):
                return b""  # all of it held (or past a stop string)
            holder.pop(key, None)  # the role (say) goes on without the held text
        elif text or isinstance(piece, str):
            holder[key] = text
        return sse_event(chunk)


class ReasoningName(EventStream):
    """A chat stream's thought (a thinking model's, Gemma 4's) named `reasoning`, as vLLM's reasoning parsers name it
    (vLLM dropped `reasoning_content`); transformers serve writes `reasoning_content`, which a client written for vLLM
    does not read. With `thought` false (the request's `include_reasoning: false`) the thought is left out, as vLLM
    leaves it out: a chunk of nothing else is not sent."""

    def __init__(self, thought: bool = True):
        super().__init__()
        self.thought = thought

    def _event(self, event: bytes) -> bytes:
        chunk, choice = sse_choice(event)
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "reasoning_content" not in delta:
            return event + b"\n\n"
        if not self.thought:
            rest = {k: v for k, v in delta.items() if k != "reasoning_content"}
            if not rest and choice.get("finish_reason") is None and not chunk.get("usage"):
                return b""
            choice["delta"] = rest
            return sse_event(chunk)
        choice["delta"] = {("reasoning" if k == "reasoning_content" else k): v for k, v in delta.items()}
        return sse_event(chunk)


class NullFields(EventStream):
    """A chat or text completion's stream with the null fields OpenAI and vLLM write on each chunk: `finish_reason`
    and `logprobs` null until set, and `"content": ""` beside the role of a chat's first chunk; and vLLM's own
    (`TEXT_CHOICE_NULLS`). transformers serve leaves every null out (it dumps its chunks `exclude_none`), so a client
    reading `choice["finish_reason"]` failed on the first chunk here. transformers serve's `"system_fingerprint": ""`
    on every chunk is left out, as vLLM leaves out a field it did not set (its chunks are dumped `exclude_unset`)."""

    def _event(self, event: bytes) -> bytes:
        chunk, choice = sse_choice(event)
        if choice is None:
            return event + b"\n\n"
        delta = choice.get("delta")
        opening = isinstance(delta, dict) and "role" in delta and set(delta) <= {"role", "content"}
        nulls = ("finish_reason", "logprobs") + (
            TEXT_CHOICE_NULLS if not isinstance(delta, dict) else ("stop_reason",) if choice.get("finish_reason")
            else ())
        fingerprint = chunk.get("system_fingerprint") == ""
        if all(k in choice for k in nulls) and not (opening and delta.get("content") is None) and not fingerprint:
            return event + b"\n\n"
        if fingerprint:
            del chunk["system_fingerprint"]
        for key in nulls:
            choice.setdefault(key, None)
        if opening and delta.get("content") is None:
            delta["content"] = ""
        return sse_event(chunk)


class ErrorEvents(EventStream):
    """A stream's error event (a generation that failed midway) in OpenAI's shape, `{"error": {"message", ...}}`:
    transformers serve writes `{"error": "text"}`, of which the OpenAI SDK shows only "An error occurred during
    streaming"."""

    def _event(self, event: bytes) -> bytes:
        import json

        try:
            chunk = json.loads(event[len(b"data:"):]) if event.startswith(b"data:") else None
        except ValueError:
            chunk = None
        if not (isinstance(chunk, dict) and "error" in chunk and not isinstance(chunk["error"], dict)):
            return event + b"\n\n"
        return sse_event(openai_error(chunk["error"]))


class StreamUsage(EventStream):
    """A chat or text completion's stream with its token usage where OpenAI and vLLM put it: with
    `stream_options.include_usage` (`include`), every chunk says `"usage": null` and one more chunk with no
    choices carries the usage before `[DONE]`; without it, no chunk carries usage. transformers serve puts it on
    the finishing chunk whatever the request says."""

    def __init__(self, include: bool):
        super().__init__()
        self.include = include
        self.last: dict | None = None  # the last chunk that carried usage (its usage kept in it)

    def _usage_chunk(self) -> bytes:
        if not (self.include and self.last):
            return b""
        out = {k: v for k, v in self.last.items() if k not in ("choices", "usage")}
        out, self.last = {**out, "choices": [], "usage": self.last["usage"]}, None
        return sse_event(out)

    def _event(self, event: bytes) -> bytes:
        chunk, _ = sse_choice(event)
        if chunk is None:
            if event.startswith(b"data:") and event[5:].strip() == b"[DONE]":
                return self._usage_chunk() + event + b"\n\n"
            return event + b"\n\n"
        if isinstance(chunk.get("usage"), dict):
            self.last = dict(chunk)
        elif "usage" not in chunk and not self.include:
            return event + b"\n\n"
        chunk.pop("usage", None)
        return sse_event({**chunk, "usage": None} if self.include else chunk)

    def _end(self) -> bytes:
        return self._usage_chunk()


def tool_call_id() -> str:
    """A fresh tool call's id as vLLM's tool parsers write it (make_tool_call_id: `chatcmpl-tool-` and a uuid's 32
    hex digits); it was `<chat id>_tool_call_<n>`, transformers serve's."""
    import uuid

    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class StreamedCalls(EventStream):
    """Rewrites a streamed chat completion (`data: {chunk}` events) so FunctionGemma calls in the model's
    text arrive as `tool_calls` deltas, as vLLM's functiongemma parser streams them: text before a call
    streams on as `content`; from a call's start marker to its end marker the text is held, then sent as
    one `tool_calls` delta (name and JSON arguments whole); the last chunk's finish_reason `stop` becomes
    `tool_calls` (but for a `named` tool_choice, as vLLM's; `length` stays). Text that only might start a marker is
    held until the next delta settles it, and so is trailing whitespace: the content streamed is the unstreamed one,
    stripped around the calls. A call that does not parse, or is cut off by the end of the stream before its
    arguments close, streams as the text it was (one cut just before its end marker is a call). Calls written without
    their markers stay text, as vLLM's parser reads them. The unstreamed answer is read by these rules too (`whole`).
    Feed the body bytes as they come (`feed`), then `close()` for whatever is left.
    """

    def __init__(self, token_map: dict[str, str] | None, parallel: bool = True, prefix: str = "",
                 named: bool = False):
        from gemma_tpu.formats.function_calling import END_CALL, START_CALL

        self.token_map = token_map or {}
        self.start = self.token_map.get(START_CALL, START_CALL)
        self.end = self.token_map.get(END_CALL, END_CALL)
        super().__init__()
        self.held = prefix  # text not yet sent: a (possible) call marker and what follows it (prefix: a call the
        # chat template opened, which the model's text continues)
        self.calls = 0
        self.parallel = parallel  # False: the first call only (the request's parallel_tool_calls)
        # a named tool_choice: the finish_reason stays the generation's ("stop"), as vLLM and OpenAI give it; "auto"
        # and "required" calls finish with "tool_calls"
        self.named = named
        self.space = ""  # whitespace at the end of the text so far, sent only when more text follows it
        self.texted = False  # some content was sent

    def _content(self, like: dict, text: str) -> bytes:
        """A content chunk for `text`, its trailing whitespace held: the unstreamed answer strips the text around
        the calls (`parse_reply`), so a space before a call (or at the end of an answer with calls) is dropped,
        and one between words is sent with the text that follows it."""
        full = self.space + text
        if not self.texted and self.calls:  # the answer opened with calls: its text starts after them, stripped
            full = full.lstrip()
        body = full.rstrip()
        self.space = full[len(body):]
        if not body:
            return b""
        self.texted = True
        return self._chunk(like, {"content": body})

    def _chunk(self, like: dict, delta: dict, finish: str | None = None) -> bytes:
        out = {k: v for k, v in like.items() if k not in ("choices", "usage")}
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
        return sse_event(out)

    def _text(self, like: dict, final: bool) -> bytes:
        """Chunks for the held text: what is settled as text or as calls (all of it when `final`)."""
        import json

        from gemma_tpu.formats.function_calling import parse_reply

        out, text = b"", ""
        while self.held:
            i = self.held.find(self.start)
            if i < 0:
                keep = 0 if final else next((k for k in range(min(len(self.start) - 1, len(self.held)), 0, -1)
                                             if self.start.startswith(self.held[-k:])), 0)
                text += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            text += self.held[:i]
            j = self.held.find(self.end, i + len(self.start))
            if j < 0 and not final:
                self.held = self.held[i:]
                break
            if j < 0:  # the end: a call whole but for its end marker (cut there, or the response marker after it)
                segment, self.held = self.held[i:], ""
            else:
                segment, self.held = self.held[i:j + len(self.end)], self.held[j + len(self.end):]
            reply = parse_reply(segment, self.token_map)
            if reply.kind != "call":
                text += segment
                continue
            after = reply.text if j < 0 else ""  # what parse_reply read after the call, markers dropped
            out += self._content(like, text)
            text = ""
            if not self.texted:
                self.space = ""  # leading whitespace before a first call: stripped, as unstreamed
            for call in reply.calls:
                if not self.parallel and self.calls:  # parallel_tool_calls: false, the first call only
                    break
                out += self._chunk(like, {"tool_calls": [{
                    "index": self.calls, "id": tool_call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}]})
                self.calls += 1
            text = after
        out += self._content(like, text)
        if final and self.space and not self.calls:  # no call: the text as it came, as unstreamed
            out += self._chunk(like, {"content": self.space})
        if final:
            self.space = ""
        return out

    def _event(self, event: bytes) -> bytes:
        chunk, choice = sse_choice(event)
        if not isinstance(choice, dict) or not isinstance(choice.get("delta", {}), dict):
            return event + b"\n\n"  # the role chunk's siblings, usage, errors, [DONE]: untouched
        delta = dict(choice.get("delta") or {})
        content = delta.pop("content", None)
        finish = choice.get("finish_reason")
        out = b""
        if isinstance(content, str) and content:
            self.held += content
            out += self._text(chunk, final=False)
        elif content is not None:
            delta["content"] = content
        if finish is not None:
            out += self._text(chunk, final=True)
            # "tool_calls" after a "stop" only: a call cut at max_tokens (its end marker the last token allowed)
            # finishes "length", as vLLM's stream says it ("auto" or "required")
            if self.calls and finish in ("stop", "tool_calls") and not self.named:
                choice["finish_reason"] = "tool_calls"
        if delta or finish is not None or "usage" in chunk:
            choice["delta"] = delta
            out += sse_event(chunk)
        return out

    def feed(self, data: bytes) -> bytes:
        self.raw += data.replace(b"\r\n", b"\n")
        *events, self.raw = self.raw.split(b"\n\n")
        return b"".join(self._event(e) for e in events if e.strip())

    def whole(self, text: str, rid: Any) -> tuple[str, list[dict]]:
        """The content and the tool calls a stream of `text` comes to: the unstreamed answer is read by these same
        rules, so both give one answer for one text (parsed whole, a broken call after a valid one turned the
        valid one to text too, where the stream had sent it as a call)."""
        import json

        like = {"id": rid} if rid is not None else {}
        out = self.feed(sse_event({**like, "choices": [{"index": 0, "delta": {"content": text}}]}) + sse_event(
            {**like, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})) + self.close()
        deltas = [json.loads(e[len(b"data:"):])["choices"][0]["delta"] for e in out.split(b"\n\n") if e.strip()]
        return "".join(d.get("content") or "" for d in deltas), [c for d in deltas for c in d.get("tool_calls") or []]

    def _end(self) -> bytes:
        # a stream that ended without a finishing chunk: what is held, the whitespace after the text included
        return self._text({}, final=True) if self.held or self.space else b""


class ChatToResponse(EventStream):
    """A chat completion's stream (its `data:` events) rewritten as a Response's events (`ResponseStream`);
    `[DONE]` ends it, and `response.completed` is written at the end."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def _event(self, event: bytes) -> bytes:
        import json

        data = event[len(b"data:"):].strip() if event.startswith(b"data:") else b""
        try:
            chunk = json.loads(data) if data and data != b"[DONE]" else None
        except ValueError:
            chunk = None
        return self.stream.chunk(chunk) if isinstance(chunk, dict) else b""

    def _end(self) -> bytes:
        return self.stream.finish()


def token_counter(tok, context: int | None = None, field: str = "prompt"):
    """`text -> number of tokens` by tokenizer `tok` (BOS included for a bare text prompt: `special`). A text too
    long to fit `context` tokens whatever it holds (more characters than `context` tokens of the longest the
    vocabulary has, twice over for normalisation) is a RequestError naming `field` before it is tokenized: a 30 MB
    prompt took two minutes to count here, holding the server (its /health included) the while."""
    from serving.openai_request import RequestError

    longest = max((len(t) for t in tok.get_vocab()), default=1)

    def count(text: str, special: bool = True) -> int:
        if context and len(text) > 2 * longest * context:
            raise RequestError(field, f"the prompt is {len(text)} characters, more than {context} tokens (this "
                                      f"server's context) can hold: shorten the {field}")
        return len(tok(text, add_special_tokens=special)["input_ids"])

    return count


def prompt_counter(tok, context: int | None = None):
    """`body -> number of prompt tokens` as the served model's chat template (of tokenizer `tok`) renders
    the request; a template that refuses the conversation, or leaves a system message out of the prompt, is a
    RequestError, and so is a prompt too long to count (see `token_counter`)."""
    from serving.openai_request import PROMPT_END_KWARG, RequestError, prompt_end_arguments

    tokens = token_counter(tok, context, "messages")

    def render(messages: list[dict], tools: list | None, kwargs: dict) -> str:
        return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                       **{"add_generation_prompt": True, **prompt_end_arguments(kwargs)})

    def refused_tool(messages: list[dict], tools: list, kwargs: dict) -> str | None:
        """Where a failed rendering's fault lies in `tools` (`tools[k]`: the first that fails declared alone for a
        plain question; `tools`: they together), or None where the conversation fails without them."""
        kwargs = {k: v for k, v in kwargs.items() if k not in (FORCED_CALL_KWARG, PROMPT_END_KWARG)}
        question = [{"role": "user", "content": "?"}]
        try:
            render(messages, None, kwargs)
            render(question, None, kwargs)
        except Exception:  # noqa: BLE001 - as below
            return None
        for k, tool in enumerate(tools):
            try:
                render(question, [tool], kwargs)
            except Exception:  # noqa: BLE001 - as below
                return f"tools[{k}]"
        return "tools"

    def count(body: dict) -> int:
        messages = _template_messages(body["messages"])
        kwargs = body.get("chat_template_kwargs") or {}
        try:
            text = render(messages, body.get("tools"), kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, raise_exception() in the template, ...
            why = f"({type(e).__name__}: {str(e)[:200]})"
            # a tool the template cannot render (parameters nested past its recursion) is the tool's fault, not the
            # conversation's: named, so the client looks there
            where = refused_tool(messages, body["tools"], kwargs) if body.get("tools") else None
            if where is not None:
                what = "these tools" if where == "tools" else "this tool"
                raise RequestError(where, f"the chat template cannot render {what} {why}") from None
            raise RequestError("messages", f"the chat template refused the conversation {why}") from None
        for i, m in enumerate(messages):
            # Gemma has no system role: its templates fold the text into the first user turn, and with none (and no
            # tools) drop it, and the model answered as if it had not been sent
            if m["role"] in ("system", "developer") and m["content"].strip() and m["content"].strip() not in text:
                raise RequestError(f"messages[{i}]", f"the chat template leaves this {m['role']} message out of the "
                                                     f"prompt (it goes into the first user turn, and there is none): "
                                                     f"send its text as a user message")
        return tokens(text, special=False)

    return count


def check_generation_config(obj: dict) -> None:
    """A request's `generation_config` (transformers serve's extension) that transformers refuses, or that this server
    cannot honour, is a RequestError: beam search was a 500 (the server streams every answer, and a streamer takes no
    beams), and several sequences came back as one choice, their texts run together."""
    from transformers import GenerationConfig

    from serving.openai_request import RequestError

    for key, why in (("num_beams", "beam search cannot stream, and this server streams every answer"),
                     ("num_return_sequences", "this server returns one choice (n=1)")):
        if obj.get(key) not in (None, 1):
            raise RequestError("generation_config", f"{key}={obj[key]!r}: {why}")
    try:
        GenerationConfig(**obj).validate()  # not strict: that refuses harmless unused flags too
    except Exception as e:  # noqa: BLE001 - ValueError, TypeError, ... of an unusable setting
        raise RequestError("generation_config", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None


def read_messages_as_trained(parse):
    """transformers serve's message reader `parse(messages, modality)` (its handlers'
    `get_processor_inputs_from_messages`) made to hand the chat template what training rendered: an assistant
    message's content is kept beside its `tool_calls` (it was dropped: "Sure." before a call was never in the
    prompt, where vLLM hands both to the template), and a text model's content parts are joined with nothing
    between them, as the training data reader (`gemma_tpu.data.records`) and the template's own `text_of` join them
    (it joined them with spaces)."""

    def read(messages: list[dict], modality):
        out = parse(messages, modality)
        for m, parsed in zip(messages, out):
            content = m.get("content") if isinstance(m, dict) else None
            if not content or not (m.get("tool_calls") or isinstance(content, list)):
                continue
            if isinstance(parsed.get("content"), str):  # a text model: its parts as one text
                parsed["content"] = content if isinstance(content, str) else "".join(
                    p.get("text") or "" for p in content
                    if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"))
            elif m.get("tool_calls"):
                parsed["content"] = parse([{"role": m["role"], "content": content}], modality)[0]["content"]
        return out

    return read


SEED_ATTR = "_gemma_tpu_request_seed"  # a request's seed, carried on its GenerationConfig to its generation


def prompt_end_as_asked(cls) -> None:
    """`cls.apply_chat_template` (a tokenizer's, a processor's) ends the prompt as the request asked
    (`serving.openai_request.PROMPT_END_KWARG` in its chat_template_kwargs): transformers serve always asks for a
    generation prompt, so vLLM's `continue_final_message` (and `add_generation_prompt: false`) had no way through."""
    from serving.openai_request import prompt_end_arguments

    original = cls.apply_chat_template

    @functools.wraps(original)
    def apply(self, conversation, *args, **kwargs):
        return original(self, conversation, *args, **prompt_end_arguments(kwargs))

    cls.apply_chat_template = apply


def seed_each_generation(utils) -> None:
    """A request's `seed` seeds its own generation, as vLLM's per-request generator does: transformers serve seeded
    the process's generator when it read a request, so a request read while another generated re-seeded that one
    midway and then sampled from wherever it had left the generator (two concurrent requests with one seed got two
    texts, neither the one it gets alone). The seed now rides on the generation config and is set on the generation
    thread just before that request's generate (`utils`: transformers.cli.serving.utils; requests run there in turn)."""
    build = utils.BaseHandler._build_generation_config

    def build_seeded(self, body, *args, **kwargs):
        seed = body.get("seed") if isinstance(body, dict) else None
        config = build(self, {**body, "seed": None} if seed is not None else body, *args, **kwargs)
        setattr(config, SEED_ATTR, seed)
        return config

    def seeded(generate):
        def wrapper(self, model, processor, inputs, gen_config, *args, **kwargs):
            seed = getattr(gen_config, SEED_ATTR, None)
            if seed is not None:  # queued right before the generate below: nothing runs between them
                self.submit(utils.set_torch_seed, seed)
            return generate(self, model, processor, inputs, gen_config, *args, **kwargs)
        return functools.wraps(generate)(wrapper)

    utils.BaseHandler._build_generation_config = build_seeded
    utils.GenerateManager.generate_streaming = seeded(utils.GenerateManager.generate_streaming)
    utils.GenerateManager.generate_non_streaming = seeded(utils.GenerateManager.generate_non_streaming)


def whole_distribution_by_default(utils) -> None:
    """A sampled request with no top_k samples from the whole distribution, as vLLM samples when neither the
    request nor the model's generation_config names one: transformers' generate fills an unset top_k with its
    default of 50, so `temperature: 0.8` on a model whose generation_config.json has no top_k drew from the 50
    likeliest tokens only (`utils`: transformers.cli.serving.utils)."""
    build = utils.BaseHandler._build_generation_config

    def build_whole(self, body, model_generation_config, *args, **kwargs):
        config = build(self, body, model_generation_config, *args, **kwargs)
        sampled = config.do_sample or (config.do_sample is None and getattr(model_generation_config, "do_sample", None))
        if sampled and config.top_k is None and getattr(model_generation_config, "top_k", None) is None:
            config.top_k = 0  # no top-k (None is "the default": 50)
        return config

    utils.BaseHandler._build_generation_config = build_whole


def eager_experts(manager) -> None:
    """Mixtures of experts run their experts eagerly, as convert.verify runs them (`manager`:
    transformers.cli.serving.model_manager): transformers' default, torch's grouped_mm, needs each expert matrix's
    rows 16-byte aligned, and a Gemma 4 whose experts are 22 wide (88 bytes in float32) trained, merged and verified,
    then answered every request here with a 500 "strides should be multiple of 16 bytes"."""
    load = manager.ModelManager._load_model

    def load_eager(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
            model.set_experts_implementation("eager")
        return model

    manager.ModelManager._load_model = functools.wraps(load)(load_eager)


def stop_on_decoded_text(cls) -> None:
    """`cls._get_stopping_criteria` (transformers' GenerationMixin in the served process) made to stop on the decoded
    text when generate refuses the stop strings (a ValueError, a 500: no token of the vocabulary can end them, e.g.
    an emoji a small vocabulary spells in bytes), as vLLM checks stops on its detokenized text: such a stop was cut
    from the text here, but the generation ran on to max_tokens, and usage counted the tokens past it."""
    import torch
    from transformers import StoppingCriteria

    get = cls._get_stopping_criteria

    class DecodedStops(StoppingCriteria):
        """True once the text generated so far holds a stop string (the prompt's tokens are not read)."""

        def __init__(self, tokenizer, stops: list[str]):
            self.tokenizer, self.stops, self.start = tokenizer, [s for s in stops if s], None
            # the stop ends in the newest token and no token is empty: its bytes' worth of tokens hold it
            self.window = 2 * max((len(s.encode()) for s in self.stops), default=1) + 8

        def __call__(self, input_ids, scores, **kwargs):
            if self.start is None:  # first called once the first new token is appended
                self.start = input_ids.shape[-1] - 1
            tail = input_ids[:, max(self.start, input_ids.shape[-1] - self.window):]
            texts = self.tokenizer.batch_decode(tail, skip_special_tokens=True)
            return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)

    def stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None, *args, **kwargs):
        try:
            return get(self, generation_config, stopping_criteria, tokenizer, *args, **kwargs)
        except ValueError:
            stops = generation_config.stop_strings
            if not stops or tokenizer is None:
                raise
            generation_config.stop_strings = None
            try:
                criteria = get(self, generation_config, stopping_criteria, tokenizer, *args, **kwargs)
            finally:
                generation_config.stop_strings = stops
            criteria.append(DecodedStops(tokenizer, [stops] if isinstance(stops, str) else list(stops)))
            return criteria

    cls._get_stopping_criteria = stopping_criteria


def served_generation_config(served: Path) -> dict:
    """The served directory's generation_config.json as an object; {} when it has none or it cannot be read
    (transformers serve reports that itself)."""
    import json

    path = served / "generation_config.json"
    try:
        gen = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        gen = {}
    return gen if isinstance(gen, dict) else {}


def sampling_defaults(served: Path) -> dict[str, float]:
    """The model's default `temperature` and `top_p` (its generation_config.json), which vLLM samples a request without
    them by (`--generation-config auto`: ModelConfig.get_diff_sampling_param) and echoes in a Response."""
    gen = served_generation_config(served)
    return {k: float(v) for k in ("temperature", "top_p")
            if isinstance(v := gen.get(k), (int, float)) and not isinstance(v, bool)}


def stop_token_texts(tok, served: Path) -> list[str]:
    """The texts transformers serve writes for the tokens that end a generation (generation_config.json's
    eos_token_id, the tokenizer's eos) where they are not special: the `<start_function_response>` a tool-calling
    merge stops on (`show_call_markers` makes it an ordinary token) ended every call's answer, where vLLM leaves
    the stop token out of the text."""
    gen = served_generation_config(served)
    eos = gen.get("eos_token_id")
    ids = ([eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []) + [tok.eos_token_id]
    added = set(tok.get_added_vocab().values())  # markers, never a piece of ordinary text cut wherever it shows
    texts = {tok.decode([i], skip_special_tokens=True) for i in ids if isinstance(i, int) and i in added}
    return sorted(t for t in texts if t.strip())


def local_dtype(config: dict) -> str:
    """The dtype `transformers serve` loads a model of this config.json in: its weights' ("auto"), but float32 for a
    float16 copy of a family that is not served in float16 (Gemma 3, `Family.float16_problem`: transformers' Gemma 3
    overflows in it; vLLM is given --dtype bfloat16 by serving.launch), which holds every float16 value."""
    family = described_family(config)
    return "float32" if family and family.float16_problem and config_dtype(config) == "float16" else "auto"


def _port(text: str) -> int:
    """An argparse `type`: a TCP port, 1..65535 (uvicorn listened on a larger one modulo 65536: 70000 on 4464, and
    said it ran on 70000)."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number in 1..65535")
    return port


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m serving.local NAME --host H --port P [--max-model-len N]` (in the directory holding NAME):
    `transformers serve NAME` with its app behind `CheckedChatApp`, requests bounded by the model's positions or N
    (a config's server.max_model_len, as vLLM bounds them), whichever is smaller."""
    from gemma_tpu.core import cli
    from gemma_tpu.hf.directory import training_run_hint

    p = cli.parser("python -m serving.local", _SERVE_DOC, overrides=False)
    p.add_argument("name", help="the model directory, named as requests name the model (run in its parent)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--max-model-len", type=cli.integer(), help="bound requests by this context too")
    p.add_argument("--no-auto-tool-choice", action="store_true",
                   help='refuse "auto" tool choice, as vLLM without --enable-auto-tool-choice (tool_calling.enabled)')
    args = p.parse_args(argv)
    stop_with_parent()
    api_key = os.environ.pop(API_KEY_ENV, None) or None  # from the LocalServer that started it
    served = Path(args.name).resolve()
    if not (served / "config.json").is_file():
        raise UserError(f"{args.name}: no config.json ({training_run_hint(served)})")
    # not JSON, or not an object: a traceback (serving.launch checks the model first; this is for a run by hand)
    config = read_json_object(served / "config.json", f"{args.name}: no config.json")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    context, vocab = text_config.get("max_position_embeddings"), text_config.get("vocab_size")
    if args.max_model_len and (not isinstance(context, int) or args.max_model_len < context):
        context = args.max_model_len
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served))
    limit = context if isinstance(context, int) else None
    counter = prompt_counter(tok, limit)

    from transformers.cli import serve as serve_cli
    from transformers.cli.serving import server as server_mod
    from transformers.cli.serving import utils as serving_utils

    from transformers.cli.serving import model_manager

    seed_each_generation(serving_utils)
    eager_experts(model_manager)
    whole_distribution_by_default(serving_utils)
    from transformers.generation.utils import GenerationMixin

    stop_on_decoded_text(GenerationMixin)

    build = server_mod.build_server

    def checked_build(*a, **k):
        return CheckedChatApp(build(*a, **k), context if isinstance(context, int) else None, counter,
                              function_token_map(tok), vocab if isinstance(vocab, int) else None,
                              check_generation_config, token_counter(tok, limit), args.name,
                              isinstance(tok.chat_template, str) and FORCED_CALL_KWARG in tok.chat_template,
                              stop_token_texts(tok, served), api_key, not args.no_auto_tool_choice,
                              sampling_defaults(served))

    server_mod.build_server = checked_build  # Serve imports it when constructed
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    ChatCompletionHandler.get_processor_inputs_from_messages = staticmethod(
        read_messages_as_trained(ChatCompletionHandler.get_processor_inputs_from_messages))
    from transformers.processing_utils import ProcessorMixin
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for cls in (PreTrainedTokenizerBase, ProcessorMixin):
        prompt_end_as_asked(cls)
    dtype = local_dtype(config)
    if dtype != "auto":
        print(f"note: {args.name} holds float16 weights, served in {dtype} (float16: "
              f"{described_family(config).float16_problem})", file=sys.stderr)
    graceful_on_hangup()
    try:
        serve_cli.Serve(force_model=args.name, host=args.host, port=args.port, dtype=dtype)
    except SignalExit as e:
        # a LocalServer (`serving.launch --local`) stops its server with SIGTERM (its Ctrl-C, its own SIGTERM, or its
        # end: `stop_with_parent`): the server's normal end, which said 'error: stopped by SIGTERM' (exit 143) under
        # the launcher's clean stop
        if e.signum != signal.SIGTERM or not os.environ.get(PARENT_ENV, "").isdigit():
            raise


def graceful_on_hangup() -> None:
    """uvicorn stops gracefully on SIGINT and SIGTERM (requests under way finish, the port is freed, then the signal
    is raised again: `cli_main` says `stopped by SIGTERM`, exit 143), and left SIGHUP (a closed terminal) to the
    handler there before: `cli_main`'s, raising in uvicorn's event loop, which logged an ERROR with two tracebacks
    before `stopped by SIGHUP`. SIGHUP is one of uvicorn's stop signals now, unless ignored (`nohup`: it stays so)."""
    import uvicorn.server

    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN and signal.SIGHUP not in uvicorn.server.HANDLED_SIGNALS:
        uvicorn.server.HANDLED_SIGNALS = (*uvicorn.server.HANDLED_SIGNALS, signal.SIGHUP)


_SERVE_DOC = """The process `python -m serving.launch --config FILE --local` starts (use that: it serves the merged
directory through a directory of links named after the served model, with the tool chat template a model without
one needs): `transformers serve` behind `CheckedChatApp`, the checks vLLM's OpenAI server makes.

    python -m serving.local NAME --host H --port P [--max-model-len N]   # in the directory holding NAME
"""


if __name__ == "__main__":
    from gemma_tpu.core.cli import cli_main

    sys.exit(cli_main(serve_main))

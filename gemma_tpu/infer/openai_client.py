"""The small OpenAI-compatible client shared by `gemma_tpu.evaluate.run --endpoint` and `serving.chat`.

Standard library only (urllib): JSON requests with one-line errors, the `/v1` base of any URL a user
gives, the served model's name, our normalised messages in OpenAI's shape, and a reply read from
`tool_calls` — or, when a server returns the model's raw text, parsed from the FunctionGemma format
in `content`. The streaming benchmark (serving/bench.py) uses httpx instead.
"""

from __future__ import annotations

import html
import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from gemma_tpu.core import strict_json
from gemma_tpu.core.errors import UserError
from gemma_tpu.formats.function_calling import (
    JSON_RESULT_MAX_DEPTH,
    START_RESPONSE,
    TOOL_NAME,
    ParsedReply,
    ToolCall,
    cut_short,
    find_lone_surrogate,
    handed_over,
    json_depth,
    parse_reply,
    plain_gemma_token_map,
    unmap_markers,
)
from gemma_tpu.formats.gemma_chat import split_thought

log = logging.getLogger("gemma_tpu.infer.openai_client")


class Unreachable(UserError):
    """Nothing answers at the address (connection refused, unknown host, no answer in time)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient  # refused or reset: a server (re)starting may take the next attempt


class HTTPStatusError(UserError):
    """The server answered with an HTTP error status (`code`; `retry_after`: the seconds its Retry-After asks for)."""

    def __init__(self, message: str, code: int, retry_after: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class CutOff(UserError):
    """The connection closed partway through the answer (a server killed or restarted mid-request): transient."""

    transient = True


# Answers a busy or restarting server gives and a later attempt may not: rate limited, internal error
# (vLLM's for a request its engine dropped), bad gateway, unavailable (still loading), gateway timeout.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 120.0  # a longer Retry-After is not waited for: the request fails at once, saying so
# every client's retry policy (evaluate --endpoint, serving.chat): one default and one description of it
DEFAULT_RETRIES = 3
RETRIES_HELP = (f"further attempts of a request the server refused or failed with 429 or 5xx, or whose connection "
                f"dropped (1, 2, 4 ... s apart, at most {MAX_RETRY_AFTER:g} s, or as Retry-After asks; default "
                f"{DEFAULT_RETRIES})")


def retry_after(value: str | None) -> float | None:
    """The seconds a Retry-After header asks for (a number of seconds or an HTTP date); None without a usable one."""
    import datetime
    import email.utils
    import math

    if not value or not value.strip():
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0, api_key: str | None = None,
              retries: int = 0, backoff: float = 1.0) -> dict:
    """POST `payload` (GET without one) and return the JSON object; failures are one-line UserErrors.

    retries: further attempts after a transient failure (an HTTP status in TRANSIENT_STATUS, a refused or reset
    connection, one closed partway through the answer), `backoff` seconds doubling between them (up to
    MAX_RETRY_AFTER), or the longer wait a Retry-After header asks for (up to MAX_RETRY_AFTER: the server's 429 came
    back each time before it); a request that got no answer within `timeout` is not repeated (it would cost another
    `timeout`), nor one to a host that does not resolve."""
    for attempt in range(retries + 1):
        try:
            return _http_json_once(url, payload, timeout, api_key)
        except (HTTPStatusError, Unreachable, CutOff) as e:
            transient = e.code in TRANSIENT_STATUS if isinstance(e, HTTPStatusError) else e.transient
            after = getattr(e, "retry_after", None) if transient else None
            if not transient or attempt == retries or after is not None and after > MAX_RETRY_AFTER:
                if attempt:
                    e.args = (f"{e} (after {attempt + 1} attempts)",)
                if after is not None and after > MAX_RETRY_AFTER and attempt < retries:
                    e.args = (f"{e} (the server asks for {after:g} s before another attempt (Retry-After), more "
                              f"than the {MAX_RETRY_AFTER:g} s waited for)",)
                raise
            # doubling up to the longest wait a Retry-After gets (--retries 12 waited 2048 s before its last attempt)
            wait = max(min(backoff * 2 ** min(attempt, 30), MAX_RETRY_AFTER), after or 0.0)
            log.warning("%s; trying again in %g s (%d of %d)", e, wait, attempt + 1, retries)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _http_json_once(url: str, payload: dict | None, timeout: float, api_key: str | None) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if payload is not None else "GET")
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = _read_by(resp, deadline).decode(errors="replace")
            status, ctype = resp.status, resp.headers.get("Content-Type") or "none"
    except urllib.error.HTTPError as e:
        try:  # by the request's deadline too: a server trickling its error page held the client for all of it
            raw = _read_by(e.fp, deadline) if hasattr(e.fp, "read1") else e.read()
            detail = body_text(raw.decode(errors="replace"), e.headers.get("Content-Type") or "")[:300]
        except TimeoutError:
            detail = f"no whole body within {timeout:g} s"
        except (http.client.HTTPException, OSError):  # the error page itself was cut off
            detail = "no readable body"
        raise HTTPStatusError(f"{url}: HTTP {e.code} ({detail})", e.code,
                              retry_after(e.headers.get("Retry-After"))) from None
    except TimeoutError:  # connected, asked, and no whole answer came (a stalled or overloaded server)
        raise Unreachable(f"{url}: no answer within {timeout:g} s") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"{url}: cannot reach the server ({reason})",
                          transient=isinstance(reason, (ConnectionRefusedError, ConnectionResetError))) from None
    except http.client.HTTPException as e:
        # something answered, but not in HTTP (an SSH or database port: BadStatusLine), or cut its answer
        # short (IncompleteRead: a server stopped mid-answer, which a later attempt may find restarted), or sent a
        # header line past http.client's limit (LineTooLong)
        error = CutOff if isinstance(e, http.client.IncompleteRead) else UserError
        raise error(f"{url}: {_broken_answer(e)}; is this an OpenAI-compatible server?") from None
    obj = json_object(body, lambda why: UserError(f"{url}: {why}"),
                      f"{describe_body(status, ctype, body)}; is this an OpenAI-compatible server?")
    lone = find_lone_surrogate(obj)
    if lone:  # an unpaired \uD800 escape: printing the answer was a UnicodeEncodeError traceback (serving.chat)
        raise UserError(f"{url}: the answer's {lone[0]} holds a lone UTF-16 surrogate ({lone[1].group()!a}), which "
                        "is no text: a broken encoding in the server")
    return obj


# the most an answer's body may hold: a chat completion of tens of thousands of tokens is a few MB; a server sending
# without end (or a wrong URL serving a large file) filled the client's memory until --timeout ran out
MAX_ANSWER_BYTES = 64 << 20


class AnswerTooLarge(http.client.HTTPException):
    """An answer whose body passed MAX_ANSWER_BYTES (read no further)."""


def _read_by(resp, deadline: float) -> bytes:
    """The whole body, or TimeoutError once `deadline` passes: urllib's timeout bounds each socket read,
    so a server trickling its answer a byte at a time held `--timeout 2` for minutes. A body past
    MAX_ANSWER_BYTES is AnswerTooLarge."""
    sock = getattr(getattr(resp.fp, "raw", None), "_sock", None)  # to bound each wait by the time left
    chunks = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if sock is not None:
            sock.settimeout(left)
        try:
            chunk = resp.read1(65536)
        except http.client.IncompleteRead as e:  # a chunked body cut short: its partial is the last chunk's alone
            raise http.client.IncompleteRead(b"".join(chunks) + e.partial, e.expected) from None
        except ConnectionError:  # reset after the headers: the server was reached, its answer cut off (it said
            # "cannot reach the server")
            raise http.client.IncompleteRead(b"".join(chunks), resp.length) from None
        if not chunk:
            if resp.length:  # the connection closed short of Content-Length (read() raises this itself)
                raise http.client.IncompleteRead(b"".join(chunks), resp.length)
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise AnswerTooLarge(size)


def _broken_answer(e: "http.client.HTTPException") -> str:
    """What an answer that http.client could not read as HTTP was, in a few words."""
    if isinstance(e, http.client.IncompleteRead):
        expected = f" of {len(e.partial) + e.expected}" if e.expected is not None else ""
        return f"the answer was cut off ({len(e.partial)}{expected} bytes of its body arrived)"
    if isinstance(e, AnswerTooLarge):
        return (f"the answer passed {MAX_ANSWER_BYTES >> 20} MB and was read no further (no chat completion is that "
                f"large)")
    if isinstance(e, http.client.BadStatusLine):
        return f"the answer is not HTTP ({str(e.line).strip()[:80]!r})"
    return f"the answer could not be read as HTTP ({type(e).__name__}: {str(e)[:120]})"


def json_object(text: str, error, context: str | None = None) -> dict:
    """`text` parsed as a JSON object; otherwise `error(reason)` is raised (reason quotes the text, or
    is `context`: what came back, e.g. status and content type)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise error(f"the answer is not JSON but {context}" if context else
                    f"the answer is not JSON ({' '.join(text.split())[:200]!r})") from None
    except RecursionError:  # a broken or hostile server's `[[[[...`: it was a traceback
        raise error("the answer is JSON nested too deeply to read" + (f" ({context})" if context else "")) from None
    except ValueError as e:  # an integer past Python's 4,300 digits (int's own refusal): it was a traceback
        digits = re.search(r"has (\d+) digits", str(e))
        raise error("the answer is not JSON Python can read (" + (f"a number of {digits.group(1)} digits" if digits
                    else str(e)[:120]) + ")" + (f"; {context}" if context else "")) from None
    if not isinstance(obj, dict):
        raise error(f"expected a JSON object, got {text[:200]!r}")
    return obj


_HIDDEN = re.compile(r"(?is)<(script|style)\b.*?</\1\s*>|<!--.*?-->")
_TITLE = re.compile(r"(?is)<title\b[^>]*>(.*?)</title\s*>")


def body_text(body: str, content_type: str) -> str:
    """A response body in one line: a web page (a proxy's or load balancer's error page) as its title and
    visible text (its first few hundred characters were style sheet and markup); anything else as it came."""
    head = body.lstrip()[:64].lower()
    if not head or "html" not in content_type.lower() and not head.startswith(("<!doctype html", "<html")):
        return " ".join(body.split())
    title = _TITLE.search(body)
    visible = _TITLE.sub(" ", _HIDDEN.sub(" ", body))
    words = [" ".join(html.unescape(re.sub(r"<[^>]*>", " ", t)).split())
             for t in (title.group(1) if title else "", visible)]
    return "web page: " + ": ".join(w for w in words if w) if any(words) else "an empty web page"


def describe_body(status: int, content_type: str, body: str) -> str:
    """`HTTP 200, Content-Type text/html: 'web page: Welcome to nginx!: It works'` (what came back, in one
    line)."""
    text = body_text(body, content_type)
    return f"HTTP {status}, Content-Type {content_type}: {text[:120]!r}" if text else \
        f"HTTP {status}, Content-Type {content_type}, an empty body"


def api_base(url: str) -> str:
    """`http://h:p`, `http://h:p/v1` or an endpoint's address (`.../v1/chat/completions`, `.../v1/completions`,
    `.../v1/responses`, `.../v1/models`) -> `http://h:p/v1`. The other endpoints' addresses were taken as the base:
    requests went to `.../v1/completions/v1/chat/completions` (HTTP 404)."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:  # `http://[::1` (Invalid IPv6 URL), `http://h:abc`, `http://h:99999`
        raise UserError(f"{url!r} is not an http(s) server address ({e}; e.g. http://127.0.0.1:8000)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{url!r} is not an http(s) server address (e.g. http://127.0.0.1:8000)")
    if re.search(r"[\x00-\x20\x7f]", url.strip()):  # `http://a b`: the benchmark's every request failed, one by one
        raise UserError(f"{url!r} is not an http(s) server address (it holds a space or control character; "
                        "e.g. http://127.0.0.1:8000)")
    # the API's paths were appended after them (`http://h:8000#coach/v1/chat/completions`): requests went to `/`
    if parts.fragment or parts.query:
        raise UserError(f"{url!r}: a server address has no {'#fragment' if parts.fragment else '?query'} (the "
                        f"model is named by the client's model option, e.g. evaluate's --served-model)")
    # the path however it is spelt: repeated slashes (`//v1`, `/v1//chat/completions`) and capitals (`/V1`) were kept,
    # and requests went to `//v1/chat/completions` or `/V1/v1/chat/completions` (HTTP 404: servers match paths
    # exactly); the API's own paths are lower case
    path = re.sub("/+", "/", parts.path).rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/responses", "/models", "/v1"):
        if path.lower().endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/v1", "", ""))


def server_key(url: str) -> tuple[str, str, int, str]:
    """What names one server's API however its address is spelt: `http://localhost:8000/v1`, `http://127.0.0.1:8000`,
    `http://[::1]:8000/`, `http://0.0.0.0:8000/v1/chat/completions` -> ('http', 'loopback', 8000, '/v1'); the
    scheme's default port written or not. Loopback names only: other host names are not looked up."""
    import ipaddress
    import urllib.parse

    parts = urllib.parse.urlsplit(api_base(url))
    host = (parts.hostname or "").rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
        loopback = ip.is_loopback or ip.is_unspecified  # 0.0.0.0 (what uvicorn prints) connects here too
    except ValueError:
        loopback = host == "localhost" or host.endswith(".localhost")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, "loopback" if loopback else host, port, re.sub("/+", "/", parts.path)


def served_model_name(base: str, api_key: str | None = None, timeout: float = 30.0, retries: int = 0) -> str | None:
    """The first model the server lists, or None when it lists none (or cannot: `transformers
    serve DIR` answers /v1/models from the hub cache only); the request then names no model and a
    server pinned to one model uses it. `retries`: as `http_json`'s (a server still starting refuses the
    connection; the caller's requests that follow are retried, so this first one is too)."""
    try:
        models = http_json(f"{base}/models", timeout=timeout, api_key=api_key, retries=retries).get("data")
    except Unreachable:  # nothing will work: say so now, in one line
        raise
    except UserError as e:
        log.warning("%s; sending requests without a model name (pass the model name to choose)", e)
        return None
    first = models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else {}
    name = first.get("id")
    return name if isinstance(name, str) and name else None


def api_key_from_env(name: str, option: str = "--api-key-env") -> str | None:
    """The API key the environment variable `name` holds (None when unset or empty), refused (naming `option` and the
    character, never the key) when no HTTP header carries it as given: a line break (a key file's newline) was
    urllib's ValueError traceback printing the whole `Bearer KEY` header, a non-ASCII letter httpx's
    UnicodeEncodeError, and an edge space a 401 (servers strip a header's edge spaces)."""
    import os

    key = os.environ.get(name) or None
    if key is None:
        return None
    for i, ch in enumerate(key):
        edge = i in (0, len(key) - 1)
        if not (" " <= ch <= "~") or (edge and ch == " "):
            what = "a space at its edge" if ch == " " else f"the character U+{ord(ch):04X}"
            raise UserError(f"{option}: the environment variable {name} holds {what} (character {i + 1} of "
                            f"{len(key)}), which an HTTP header cannot carry as the key: set it to the key alone")
    return key


def check_reachable(base: str, api_key: str | None = None, timeout: float = 30.0, retries: int = 0) -> None:
    """Refuse a server that does not answer at all (any HTTP answer, even an error, will do; `retries`: as
    `http_json`'s)."""
    try:
        http_json(f"{base}/models", timeout=timeout, api_key=api_key, retries=retries)
    except Unreachable:
        raise
    except UserError:
        pass


def openai_messages(messages: list[dict]) -> list[dict]:
    """Our normalised messages in OpenAI's shape (developer turns sent as system: more servers know it).
    Calls get ids `call_<message>_<k>`; each tool result names the call of the latest assistant turn it
    answers: the first unanswered one of its name, else the first unanswered one (results in order). A result with no
    call left to answer is refused (UserError): it was sent with the id `call_<i-1>_0`, which named no call (the data
    reader refuses such rows, `normalise_messages`; this is the one home of the ids, so it refuses them too)."""
    out = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of the latest turn's calls still without a result
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]  # normalised or raw OpenAI shape
            for j, c in enumerate(calls):  # json.dumps wrote NaN as `NaN`: a request body no strict server reads
                args = c.get("arguments")
                if isinstance(args, str) and args.strip():  # sent as given: it must be what a strict server reads
                    try:
                        args = strict_json.DECODER.decode(args)
                    except (ValueError, RecursionError) as e:  # JSONDecodeError and NotJSON are ValueErrors
                        raise UserError(f"messages[{i}].tool_calls[{j}] arguments are not JSON a server reads: "
                                        f"{str(e) or 'nested too deep'}") from None
                bad = strict_json.nonfinite_path(args)
                if bad:
                    raise UserError(f"messages[{i}].tool_calls[{j}] {bad} is not a number JSON can carry (NaN, "
                                    f"Infinity)")
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(
                                      c.get("arguments"), str) else json.dumps(c.get("arguments") or {})}}
                                 for j, c in enumerate(calls)]
            open_calls = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if role == "tool":
            k = next((k for k, (_, name) in enumerate(open_calls) if name == m.get("name")), 0)
            if not open_calls:  # an id no call was issued with: a strict server refuses the request (HTTP 400)
                raise UserError(f"messages[{i}]: a tool result with no call of the preceding assistant turn left to "
                                f"answer (each result answers one call)")
            msg["tool_call_id"] = open_calls.pop(k)[0]
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tool declarations in OpenAI's shape: a flat declaration (`{"name", "description", "parameters"}`, as
    many datasets store them and training reads) wrapped as `{"type": "function", "function": {...}}`, which
    is what OpenAI, vLLM and our local server accept (they refused the flat one with HTTP 400)."""
    if not tools or not isinstance(tools, list):
        return tools or None
    return [{"type": "function", "function": t} if isinstance(t, dict) and "function" not in t and "name" in t else t
            for t in tools]


def reply_from_message(message: dict) -> ParsedReply:
    """An OpenAI `choices[0].message` as a ParsedReply: structured calls first, else the content. Arguments
    encoded twice (a JSON string holding the JSON object, as some servers' parsers and models write them) are
    read as that object: the call is unambiguous, and a format error would score a serialisation quirk as a miss.
    Arguments null, "" or "null" are a call without arguments: OpenAI always sends a JSON string, and these are what a
    server's tool parser writes for a call the model gave no arguments (a required one missing is the tool's to refuse,
    `arguments_problem`), not a malformed call. Arguments JSON does not hold (NaN, Infinity, 1e999, a key given twice:
    which value was meant is a guess), as text or as a structured object, are a format error, as the FunctionGemma
    text's parser makes them (a tool loop sent them back as `Infinity`, which an OpenAI client's JSON.parse refuses)."""
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        raw = fn.get("arguments")
        try:
            # null or "" is no arguments; [] / 0 / false are not an object of them (`raw or {}` took them as none)
            args = strict_json.DECODER.decode(raw) if isinstance(raw, str) and raw.strip() else (
                {} if raw is None or isinstance(raw, str) else raw)
            if isinstance(args, str) and args.strip().startswith("{"):
                args = strict_json.DECODER.decode(args)
            args = {} if args is None else args  # "null" (json.dumps of none given): no arguments, as null is
            if json_depth(args) > JSON_RESULT_MAX_DEPTH:  # as the FunctionGemma text's parser refuses it
                return ParsedReply("format_error", [], str(raw)[:200], f"tool_calls arguments nested more than "
                                                                       f"{JSON_RESULT_MAX_DEPTH} levels deep")
        except RecursionError:  # nested past what json.loads (or the depth count) reaches: a traceback in evaluate
            return ParsedReply("format_error", [], str(raw)[:200], f"tool_calls arguments nested more than "
                                                                   f"{JSON_RESULT_MAX_DEPTH} levels deep")
        except json.JSONDecodeError:
            return ParsedReply("format_error", [], str(raw), "tool_calls arguments are not JSON")
        except strict_json.NotJSON as e:
            return ParsedReply("format_error", [], str(raw), f"tool_calls arguments: {e}")
        bad = strict_json.nonfinite_path(args)  # structured arguments (an object, not JSON text) read by the client
        if bad:
            return ParsedReply("format_error", [], str(raw)[:200], f"tool_calls {bad} is not a number JSON can carry "
                                                                   f"(NaN, Infinity)")
        if not isinstance(args, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return ParsedReply("format_error", [], str(raw), "tool call without a name or an object of arguments")
        if not TOOL_NAME.fullmatch(fn["name"]):  # as the FunctionGemma text's parser reads `call:météo{...}`
            return ParsedReply("format_error", [], str(raw), f"tool call name {fn['name'][:80]!r} is not a tool name "
                                                             f"(1 to 64 ASCII letters, digits, '_', '.' or '-')")
        calls.append(ToolCall(fn["name"], args))
    content = without_thought(message.get("content") or "")
    if calls:
        return ParsedReply("call", calls, content)
    # endpoint text may still carry the markers as a plain Gemma 3 vocabulary's <unusedN> tokens, or as a family's own
    # (Gemma 4's, from a server without its tool parser)
    return parse_reply(family_markup_as_ours(content), plain_gemma_token_map())


def thought_of(message: dict) -> str:
    """A chat answer's thought, to show apart from the answer: vLLM's reasoning parser hands it as `reasoning` (0.27;
    `reasoning_content` before), a server without that parser leaves it in the content in the family's markers."""
    for key in ("reasoning", "reasoning_content"):
        if isinstance(message.get(key), str) and message[key].strip():
            return message[key].strip()
    content = message.get("content")
    return split_any_thought(content)[0] if isinstance(content, str) else ""


def without_thought(text: str) -> str:
    """`text` less a thinking model's thought (`split_any_thought`)."""
    return split_any_thought(text)[1]


def split_any_thought(text: str) -> tuple[str, str]:
    """(thought, answer) of `text` in each family's thought markers (the registry's `Family.thought_markers`: Gemma 4's
    `<|channel>thought\n...<channel|>`), as a local reply is read (`gemma_chat.split_thought`): a server without vLLM's
    reasoning parser that keeps special tokens hands it back in the content, where it was scored as the answer's words
    and a call after it read with them. The thought stripped, "" where there is none."""
    from gemma_tpu.models.registry import families  # here: the families load with the first reply read this way

    thoughts = []
    for family in families().values():
        thought, text = split_thought(text, family.thought_markers)
        if thought and thought.strip():
            thoughts.append(thought.strip())
    return "\n".join(thoughts), text


def family_markup_as_ours(text: str) -> str:
    """`text` with each family's own call markup (the registry's `Family.call_markers`: Gemma 4's `<|tool_call>`,
    `<tool_call|>`, its string quote `<|"|>`, `<|tool_response>`) as the FunctionGemma markers it mirrors. Every
    family's: the client does not know which one the server serves. A Gemma 4 call a server handed back as text was
    read with its quotes inside each value (`'<|"|>2024-01-01<|"|>'`) and its markers as the answer's words."""
    from gemma_tpu.models.registry import families  # here: the families load with the first reply read this way

    for family in families().values():
        text = unmap_markers(text, dict(family.call_markers))
    return text


def part_text(part: Any) -> str | None:
    """The text of one content part: a text part's `text`, a refusal part's `refusal` (the model declining, in
    words: it read as "" and the chat showed an empty answer); None for a part without text (an image)."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "refusal":
        return part.get("refusal")
    return part.get("text")


def first_message(resp: dict, url: str) -> dict:
    """`choices[0].message` of a chat completion, or a one-line error naming what came back. The message
    is checked to have OpenAI's shape (`content` a string, null or a list of text or refusal parts, given back as
    a string, or the message's `refusal` where content is empty; `tool_calls` null or a list of objects with a
    `function` object), so the readers after it need not guard every field."""
    try:
        message = resp["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{url}: unexpected response {json.dumps(resp)[:200]}") from None
    if not isinstance(message, dict):
        raise UserError(f"{url}: unexpected message {json.dumps(message)[:200]}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: [{"type": "text", "text": "..."}, {"type": "refusal", ...}]
        texts = [part_text(p) for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise UserError(f"{url}: message content is a list but not of text parts: {json.dumps(content)[:200]}")
        message = {**message, "content": "".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise UserError(f"{url}: message content is not a string: {json.dumps(content)[:200]}")
    refusal = message.get("refusal")  # OpenAI's: the model declined in words, with content null
    if refusal is not None and not isinstance(refusal, str):
        raise UserError(f"{url}: message refusal is not a string: {json.dumps(refusal)[:200]}")
    if refusal and not message.get("content"):
        message = {**message, "content": refusal}
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise UserError(f"{url}: tool_calls is not a list of {{\"function\": {{...}}}} objects: "
                        f"{json.dumps(calls)[:200]}")
    return message


def reply_from_answer(answer: dict, url: str, max_tokens: int,
                      stop_text: Callable[[int], str | None] | None = None,
                      option: str = "--max-new-tokens") -> tuple[ParsedReply, dict]:
    """A chat completion's reply (`reply_from_message` of `first_message`) and its message. A call the server cut
    at `max_tokens` (finish_reason "length") says so (`cut_short`), as a local model's does: it read as the model's
    own syntax error. `stop_text`: the text of a stop token id (`StopTokenTexts`), for a numeric stop_reason.
    `option`: the client's option for `max_tokens`, named in that error (`cut_short`)."""
    message = first_message(answer, url)
    reply = reply_from_message(message)
    choice = answer["choices"][0]
    if choice.get("finish_reason") == "length":
        return cut_short(reply, max_tokens, option), message
    if reply.kind == "text" and stopped_at_call_marker(choice, message, stop_text):
        return handed_over(reply), message
    return reply, message


def call_stop_markers() -> tuple[str, ...]:
    """The texts a served model hands over to a tool with: each family's call stop token (the registry's
    `Family.call_stop_token`: Gemma 3's `<start_function_response>`, Gemma 4's `<|tool_response>`) and the plain
    Gemma 3 vocabulary's reserved token for FunctionGemma's. Every family's: the client does not know which one the
    server serves, and a model stops only at tokens of its own vocabulary."""
    from gemma_tpu.models.registry import families  # here: the families load with the first reply read this way

    own = (f.call_stop_token for f in families().values() if f.call_stop_token)
    return tuple(dict.fromkeys((*own, START_RESPONSE, plain_gemma_token_map()[START_RESPONSE])))


def stopped_at_call_marker(choice: dict, message: dict,
                           stop_text: Callable[[int], str | None] | None = None) -> bool:
    """Whether a completion ended at a call stop marker (`call_stop_markers`: FunctionGemma's
    `<start_function_response>`, the plain Gemma 3 vocabulary's token for it, Gemma 4's `<|tool_response>`): the
    `stop_reason` naming it (vLLM's for a stop string, `serving.launch --local`'s for the stop token it cuts; vLLM's
    for a stop token, such as a merge's generation_config lists, is its id, whose text `stop_text` gives) or the
    content ending with it (a server that keeps the stop text). A reply without a call that stopped there scored as
    an answer in words from an endpoint, a format error from a local model."""
    markers = call_stop_markers()
    reason = choice.get("stop_reason")
    if isinstance(reason, int) and not isinstance(reason, bool) and stop_text is not None:
        reason = stop_text(reason)
    content = message.get("content")
    return (isinstance(reason, str) and reason.strip() in markers) or (
        isinstance(content, str) and content.rstrip().endswith(markers))


class StopTokenTexts:
    """The text of each stop token id a server gives as a completion's `stop_reason`, asked of its `/detokenize`
    (vLLM's; a token's text, special tokens kept) once per id. vLLM names a stop *token* (the eos ids of
    generation_config.json, which a merge lists the call stop marker among) by its id and leaves it out of the
    content, so a reply that handed over to a tool without a call read as an answer in words. None for an id the
    server cannot name (no such endpoint, as with `transformers serve`, which names the stop as text).

    `retries`: the chat requests' policy (`http_json`'s, the caller's --retries), so a server busy or restarting is
    waited for as long for the lookup as for the reply it names. A lookup that still fails leaves that one reply's
    stop unnamed (scored as without the lookup), said in one warning: it does not end the caller's run."""

    def __init__(self, base: str, model: str | None, api_key: str | None = None, timeout: float = 30.0,
                 retries: int = 0):
        self.url = base.rstrip("/").removesuffix("/v1") + "/detokenize"
        self.model, self.api_key, self.timeout, self.retries = model, api_key, timeout, retries
        self.known: dict[int, str | None] = {}
        self.available = True

    def __call__(self, token_id: int) -> str | None:
        if token_id not in self.known and self.available:
            body: dict[str, Any] = {"tokens": [token_id], **({"model": self.model} if self.model else {})}
            try:
                answer = http_json(self.url, body, timeout=self.timeout, api_key=self.api_key, retries=self.retries)
            except UserError as e:
                if isinstance(e, HTTPStatusError) and e.code in (404, 405):  # no /detokenize here: not asked again
                    self.available = False
                else:  # a timeout, a refused connection, a 5xx past the retries: the next reply's id is asked again
                    log.warning("%s; the stop token %d of this reply is left unnamed (read as if the server had not "
                                "given its id)", e, token_id)
                return None
            text = answer.get("prompt")
            self.known[token_id] = text if isinstance(text, str) else None
        return self.known.get(token_id)

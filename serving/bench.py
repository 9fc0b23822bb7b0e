"""`python -m serving.bench --base-url URL [--model NAME] [--num-prompts N --concurrency C --input-len I
--output-len O --dataset random|FILE.jsonl --seed S --json OUT --timeout T]`

Load-test any OpenAI-compatible server with streaming `/v1/chat/completions` requests (asyncio +
httpx, at most C in flight) and report what `vllm bench serve` reports, under its JSON field names,
so the two compare side by side:

    completed, failed                    requests that streamed to the end / that did not
    request_throughput                   completed requests per second of the run
    output_throughput                    generated tokens per second
    total_token_throughput               prompt + generated tokens per second
    {mean,median,std,p90,p99}_ttft_ms    time to first token
    {...}_tpot_ms                        time per output token after the first: (E2EL - TTFT) / (out - 1)
    {...}_itl_ms                         inter-token latency: gaps between streamed chunks
    {...}_e2el_ms                        end-to-end latency of a request
    max_output_tokens_per_s, max_concurrent_requests   peaks over the run

Token counts come from the server's `usage` (requested with `stream_options.include_usage`); a
server that sends none is counted one token per streamed chunk, and the table says so. TTFT is taken at the first chunk
whose `choices` carry generated output (content, reasoning or a tool call): on vLLM that is its
first chunk with `choices` (vLLM sends its role chunk together with the first token), and a server
that sends the role chunk before generating (transformers serve) is not credited with a TTFT of ~0.

A request fails on an HTTP error, a refused or dropped connection, a stream that ends without a
finish reason or `[DONE]`, one that holds no choice at all, an `error` event, or when it takes longer
than --timeout seconds (the whole request, streaming included); a 429 or 503 is not retried (nor by `vllm bench
serve`): its error names the status and the server's Retry-After — so the run ends within about
ceil(N / C) x T seconds whatever the server does. Failures are counted and listed with the table;
exit status 0 when at least one request completed. When none did: one error line (the first failure),
no table, no --json file, exit status 2.

Datasets: `random` (I random words per prompt, roughly I tokens; seeded), or data as the trainer reads it (JSONL,
a JSON array, Parquet, a `datasets` save_to_disk directory) whose rows are chats (`messages`, optional `tools`: the
prompt is the conversation up to its first assistant turn, e.g. data/fitness/test.jsonl), `{"prompt": "..."}`, or
any other chat shape the trainer reads (ShareGPT `conversations`, instruction pairs, prompt-completion message
lists), all read by the trainer's reader (a chat without its answer too: legacy `functions`, a `system` field, the
declarations and turns checked as for training); rows are sampled with the seed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from gemma_tpu.core import cli
from gemma_tpu.core.atomic import check_results_file, write_text_atomic
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.core.config import DataConfig
from gemma_tpu.data.records import iter_raw, message_role, normalise_row, served_markup
from gemma_tpu.infer.openai_client import (
    api_base,
    api_key_from_env,
    body_text,
    check_reachable,
    describe_body,
    json_object,
    openai_messages,
    openai_tools,
    served_model_name,
)

METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
# Everyday words: each is about one token for Gemma's tokenizer when preceded by a space.
_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community "
          "name president team minute idea kid body information back parent face others level office door health "
          "person art war history party result change morning reason research girl guy moment air teacher force "
          "education foot boy age policy process music market sense nation plan college interest death experience "
          "effect use class control care field development role effort rate heart drug show leader light voice "
          "wife police mind price report decision son view relationship town road arm difference value building "
          "action model season society tax director position player record paper space ground form event").split()


@dataclasses.dataclass
class Prompt:
    messages: list[dict]
    tools: list[dict] | None = None
    prompt_len: int = 0  # estimate; the server's usage.prompt_tokens replaces it when reported
    max_tokens: int | None = None


@dataclasses.dataclass
class Result:
    """One request's outcome (times in seconds, as vLLM's RequestFuncOutput)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    usage_reported: bool = False  # output_tokens is the server's usage, not a count of streamed chunks


class RequestFailed(Exception):
    pass


def turned_away(status: int, headers) -> str:
    """What a 429 or 503 means, with its Retry-After, for the error summary (' (...)', or '' for another status):
    the request is failed at once, not retried (as `vllm bench serve` does), and that said a bare 'HTTP 429'
    left the reader to guess whether the server or the benchmark gave up."""
    if status not in (429, 503):
        return ""
    what = "rate limited" if status == 429 else "service unavailable: overloaded or still starting"
    after = (headers.get("retry-after") or "").strip()
    return (f" ({what}{f', Retry-After: {after}' if after else ', no Retry-After'}; the benchmark does not retry: "
            f"lower --concurrency or wait for the server)")


# ------------------------------------------------------------------------------------ datasets


def random_prompts(n: int, input_len: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt([{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(input_len))}],
                   prompt_len=input_len) for _ in range(n)]


def file_prompts(path: str, n: int, seed: int) -> list[Prompt]:
    p = Path(path)
    if not p.exists():  # a directory is the trainer's too (a datasets save_to_disk one): it was "no such file"
        raise UserError(f"--dataset {path}: no such file (use 'random' or a .jsonl file)")
    rows: list[Prompt] = []
    # the training data reader: JSON Lines, a .json array (line numbers of its rows), .parquet, gzip; bad bytes and
    # bad JSON reported at their line
    lines = [(f"{p}:{lineno}", row) for lineno, row in iter_raw(p)]
    for where, row in lines:
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object")
        limit = row.get("max_tokens", row.get("output_len"))
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise UserError(f"{where}: max_tokens / output_len must be a positive integer, got {limit!r:.40}")
        if isinstance(row.get("prompt"), list) and row.get("completion") is None and not row.get("messages"):
            # TRL's conversational prompt-only rows (GRPO's, online DPO's): the prompt's messages are the chat sent;
            # it was refused as a prompt-completion row without its 'completion'
            row = {**{k: v for k, v in row.items() if k not in ("prompt", "completion")}, "messages": row["prompt"]}
        msgs = row.get("messages")
        # a prompt-only chat (no answer) is read by the trainer's reader too, as the prompt of the answer to come: it
        # was sent as given, so legacy `functions` were dropped, declarations the server refuses (`check_tools`) and
        # turns the chat template refuses went out, and a `system` field was read by rules of its own
        prompt_only = isinstance(msgs, list) and msgs and not any(
            isinstance(m, dict) and (message_role(m) == "assistant" or "from" in m) for m in msgs)
        if prompt_only:
            row = {**row, "messages": [*msgs, {"role": "assistant", "content": "(the answer to come)"}]}
        if isinstance(row.get("prompt"), str) and not prompt_only:
            rows.append(Prompt([{"role": "user", "content": row["prompt"]}], None, len(row["prompt"]) // 4, limit))
        else:  # chats, and the trainer's other shapes (ShareGPT, instruction pairs, prompt-completion as message lists)
            # every family's control tokens (the server's tokenizer is not known here): a Gemma 4's `<|turn>` in a
            # message went out, and the server's template read it as a turn of its own
            conv = normalise_row(row, where, DataConfig(), served_markup())
            if "text" in conv:
                raise UserError(f"{where}: a language-modeling 'text' row has no prompt to send; give 'messages' "
                                f"(a chat) or 'prompt' (a string)")
            msgs = conv["messages"]
            k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")  # the reader requires one
            sent = openai_messages(msgs[:k])
            est = sum(len(str(m.get("content") or "")) for m in sent) // 4
            rows.append(Prompt(sent, openai_tools(conv.get("tools")), est, limit))
    if not rows:
        raise UserError(f"--dataset {path}: no rows")
    rng = random.Random(seed)
    order: list[Prompt] = []
    while len(order) < n:
        chunk = rows[:]
        rng.shuffle(chunk)
        order.extend(chunk)
    return order[:n]


# ------------------------------------------------------------------------------------- requests


def _delta_output(delta: dict) -> str | None:
    """What a streamed delta generated (text, reasoning or a tool call), or None for none."""
    for key in ("content", "reasoning_content", "reasoning"):
        if isinstance(delta.get(key), str) and delta[key]:
            return delta[key] if key == "content" else ""
    if delta.get("tool_calls"):
        return ""
    return None


async def sse_data(lines, other: list[str]):
    """(type, data) of each event of a server-sent event stream, read from its `lines` (line ends taken off) as the
    SSE spec reads them: an event's `data:` lines joined by newlines (one leading space off each), its type the last
    `event:` field's value ("message" without one), dispatched at the blank line that ends it (or at the stream's
    end); comments and the `id:` and `retry:` fields are no data. Other non-blank lines (what came back instead of a
    stream) go to `other`, the first 20."""
    data: list[str] | None = None
    kind = "message"
    async for line in lines:
        if not line.strip():
            if data is not None:
                yield kind, "\n".join(data)
            data, kind = None, "message"
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data = (data or []) + [value]
        elif field == "event":
            kind = value or "message"
        elif field not in ("", "id", "retry") and len(other) < 20:
            other.append(line.strip())
    if data is not None:
        yield kind, "\n".join(data)


async def _stream(client, url: str, body: dict, headers: dict, res: Result) -> None:
    st = time.perf_counter()
    res.start_time = st
    first_choice = None
    last = None
    chunks = 0
    usage_tokens = None
    finished = done = False
    text: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = body_text((await resp.aread()).decode(errors="replace"),
                               resp.headers.get("content-type") or "")[:200]
            raise RequestFailed(f"HTTP {resp.status_code}{turned_away(resp.status_code, resp.headers)}: {detail}")
        ctype = resp.headers.get("content-type") or "none"
        other: list[str] = []  # lines that are not events: what came back instead of a stream
        events = 0
        async for kind, data in sse_data(resp.aiter_lines(), other):
            events += 1
            if kind == "error":  # an error event named by its type, whatever its data holds
                raise RequestFailed(f"server error (an `event: error`): {data.strip()[:200]}")
            if kind != "message":  # another type (a proxy's keep-alive `event: ping`): no chunk of the completion
                continue
            if data.strip() == "[DONE]":
                done = True
                break
            chunk = json_object(data, lambda why: RequestFailed(f"bad event: {why}"))
            if chunk.get("error"):
                raise RequestFailed(f"server error: {json.dumps(chunk['error'])[:200]}")
            now = time.perf_counter()
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    res.prompt_len = usage["prompt_tokens"]
            choices = chunk.get("choices") or []
            if not isinstance(choices, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("delta") or {}, dict) for c in choices):
                raise RequestFailed(f"bad event: 'choices' is not a list of objects with a 'delta' object: "
                                    f"{data[:200]!r}")
            for choice in choices:
                if first_choice is None:
                    first_choice = now
                produced = _delta_output(choice.get("delta") or {})
                if produced is not None:
                    if last is None:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(produced)
                if choice.get("finish_reason"):
                    finished = True
    if not events:
        raise RequestFailed(f"not an OpenAI event stream: {describe_body(resp.status_code, ctype, ' '.join(other))}")
    if not (done or finished):
        raise RequestFailed(f"the stream ended before the response was complete ({events} event(s), no "
                            f"finish_reason, no [DONE])")
    if first_choice is None:  # not even a role delta or a finish_reason: the server answered nothing
        raise RequestFailed(f"the stream held no choice ({events} event(s) up to [DONE]): nothing was generated")
    res.latency = time.perf_counter() - st
    if last is None:  # nothing generated (an immediate stop): the first chunk is all there is
        res.ttft = (first_choice or time.perf_counter()) - st
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.usage_reported = usage_tokens is not None
    res.generated_text = "".join(text)
    res.success = True


def _http_error(e: Exception) -> str:
    """httpx's error, with the first reason its causes give: a connection reset mid-stream read as a bare
    'ReadError' (httpx's and httpcore's carry no message; the ConnectionResetError under them does)."""
    cause: BaseException | None = e
    while cause is not None and not str(cause):
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {cause}" if cause is not None else type(e).__name__


async def one_request(client, url: str, prompt: Prompt, model: str | None, output_len: int,
                      extra: dict, headers: dict, timeout: float) -> Result:
    import httpx

    body: dict[str, Any] = {"messages": prompt.messages, "max_tokens": prompt.max_tokens or output_len,
                            "stream": True, "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    if prompt.tools:
        body["tools"] = prompt.tools
    res = Result(prompt_len=prompt.prompt_len)
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, res), timeout)
    except asyncio.TimeoutError:
        res.success, res.error = False, f"timed out after {timeout:g} s"
    except RequestFailed as e:
        res.success, res.error = False, str(e)
    except httpx.HTTPError as e:
        res.success, res.error = False, _http_error(e)
    except OSError as e:
        res.success, res.error = False, f"{type(e).__name__}: {e}"
    return res


async def run_all(url: str, prompts: list[Prompt], model: str | None, args, headers: dict) -> tuple[list[Result], float]:
    import httpx
    from tqdm import tqdm

    # always sent: with none, vLLM samples at T=1 and the local server decodes greedily, so the two timed answers
    # of different kinds (lengths, stops) under the same command
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True  # a vLLM extension: generate exactly --output-len tokens
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr, disable=args.disable_tqdm)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def limited(p: Prompt) -> Result:
            async with sem:
                r = await one_request(client, url, p, model, args.output_len, extra, headers, args.timeout)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


# -------------------------------------------------------------------------------------- metrics


def summarize(results: list[Result], duration: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """vLLM's metrics (its field names), from the per-request results."""
    import numpy as np

    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [x for r in ok for x in r.itl]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        # completed requests whose server sent no usage: their output tokens are streamed chunks (one token each)
        "output_tokens_counted_per_chunk": sum(not r.usage_reported for r in ok),
        "request_throughput": len(ok) / dur, "request_goodput": None,
        "output_throughput": total_out / dur, "total_token_throughput": (total_in + total_out) / dur,
    }
    # peak streamed chunks per wall-clock second, and peak requests in flight (as vLLM computes them)
    peak_tokens, peak_concurrency = 0.0, 0
    if ok:
        t0 = min(r.start_time for r in ok)
        per_second: dict[int, int] = {}
        for r in ok:
            t = r.start_time + r.ttft
            for gap in [0.0, *r.itl]:
                t += gap
                per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        peak_tokens = float(max(per_second.values()))
        events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
        level = 0
        for _, step in events:
            level += step
            peak_concurrency = max(peak_concurrency, level)
    out["max_output_tokens_per_s"] = peak_tokens
    out["max_concurrent_requests"] = peak_concurrency
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        v = np.asarray(values or [0.0], dtype=np.float64) * 1000
        out[f"mean_{key}_ms"] = float(v.mean())
        out[f"median_{key}_ms"] = float(np.median(v))
        out[f"std_{key}_ms"] = float(v.std())
        for p in percentiles:
            out[f"p{_pword(p)}_{key}_ms"] = float(np.percentile(v, p))
    return out


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_table(m: dict[str, Any], concurrency: int, percentiles: Sequence[float]) -> str:
    """The result block, laid out like `vllm bench serve` prints it."""
    row = "{:<40} {:<10}".format
    num = lambda label, v: "{:<40} {:<10.2f}".format(label, v)  # noqa: E731
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"]),
             row("Maximum request concurrency:", concurrency), num("Benchmark duration (s):", m["duration"]),
             row("Total input tokens:", m["total_input_tokens"]), row("Total generated tokens:", m["total_output_tokens"]),
             *([f"  (no usage from the server for {m['output_tokens_counted_per_chunk']} of {m['completed']} "
                f"requests: their generated tokens are counted one per streamed chunk)"]
               if m.get("output_tokens_counted_per_chunk") else []),
             num("Request throughput (req/s):", m["request_throughput"]),
             num("Output token throughput (tok/s):", m["output_throughput"]),
             num("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
             row("Peak concurrent requests:", m["max_concurrent_requests"]),
             num("Total token throughput (tok/s):", m["total_token_throughput"])]
    for key, short, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(num(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(num(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for p in percentiles:
            lines.append(num(f"P{_pword(p)} {short} (ms):", m[f"p{_pword(p)}_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI


def percentile_list(text: str) -> list[float]:
    """An argparse `type`: comma-separated percentiles from 0 to 100 as numpy takes them (0 the least, 100 the
    most), none twice. An empty entry (`50,,90`) was skipped without a word and a repeated one reported twice under
    one key."""
    values: list[float] = []
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty list; give comma-separated percentiles like 50,90,99")
    for item in (x.strip() for x in text.split(",")):
        if not item:
            raise argparse.ArgumentTypeError(f"{text!r} has an empty entry; give comma-separated percentiles like "
                                             "50,90,99")
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a number; give comma-separated percentiles like "
                                             "50,90,99") from None
        if not (math.isfinite(value) and 0 <= value <= 100):
            raise argparse.ArgumentTypeError(f"{item!r} is not a percentile from 0 to 100 (e.g. 50, 99.9)")
        if value in values:
            raise argparse.ArgumentTypeError(f"{item!r} is given twice in {text!r}")
        values.append(value)
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m serving.bench", __doc__, overrides=False)
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", help="model name sent with each request; default: the first the server lists, or none")
    p.add_argument("--num-prompts", type=int, default=100, help="requests the run sends in all")
    p.add_argument("--concurrency", "--max-concurrency", type=int, default=8, dest="concurrency",
                   help="requests in flight at most (--max-concurrency: vLLM bench's name, also taken)")
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt (about one token each)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--dataset", default="random", type=cli.input_path_of("dataset"),
                   help="'random' or a JSONL file (or JSON array) of chats / prompts")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts (or of the order --dataset rows are sent in)")
    p.add_argument("--json", type=cli.output_path_of("JSON file"),
                   help="write the results here (vllm bench serve field names)")
    p.add_argument("--timeout", type=cli.SECONDS, default=300.0, help="seconds a request may take, streaming included")
    p.add_argument("--temperature", type=cli.number(0.0, low_ok=True, high=2.0), default=0.0,  # OpenAI's range
                   help="sent with every request (default 0: greedy, as vllm bench serve asks)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly --output-len tokens (vLLM's ignore_eos extension; "
                        "as `vllm bench serve` does for random prompts)")
    p.add_argument("--metric-percentiles", type=percentile_list, default="90,99",
                   help="comma-separated, each from 0 to 100 (the least and the most), e.g. 50,90,99.9")
    p.add_argument("--api-key-env", default="VLLM_API_KEY",
                   help="environment variable holding the API key, sent when set (default: VLLM_API_KEY)")
    p.add_argument("--save-detailed", action="store_true", help="also write per-request lists (ttfts, itls, ...)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar on stderr")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    for name in ("num_prompts", "concurrency", "input_len", "output_len"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    percentiles = args.metric_percentiles
    check_results_file(args.json, {"--dataset": args.dataset if args.dataset != "random" else None},
                       results_key="completed")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise UserError("serving.bench needs httpx: pip install -e '.[serve]'") from None
    prompts = (random_prompts(args.num_prompts, args.input_len, args.seed) if args.dataset == "random"
               else file_prompts(args.dataset, args.num_prompts, args.seed))
    base = api_base(args.base_url)
    api_key = api_key_from_env(args.api_key_env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # an unreachable server is refused here, in one line, before anything is timed or written
    if args.model:
        check_reachable(base, api_key, timeout=min(args.timeout, 30.0))
    model = args.model or served_model_name(base, api_key, timeout=min(args.timeout, 30.0))
    print(f"benchmarking {base}/chat/completions (model {model or 'default'}): {args.num_prompts} prompts, "
          f"concurrency {args.concurrency}, dataset {args.dataset}", file=sys.stderr, flush=True)
    results, duration = asyncio.run(run_all(f"{base}/chat/completions", prompts, model, args, headers))
    metrics = summarize(results, duration, percentiles)
    errors = [r.error for r in results if not r.success]
    if not metrics["completed"]:  # no table of zeros, no results file
        raise UserError(f"all {len(results)} requests to {base}/chat/completions failed"
                        f"{'' if len(set(errors)) == 1 else ' (first error)'}: {errors[0]}; nothing written")
    if errors:
        print(f"{len(errors)} failed request(s); first errors:", file=sys.stderr)
        for e in list(dict.fromkeys(errors))[:5]:
            print(f"  {e}", file=sys.stderr)
    print(format_table(metrics, args.concurrency, percentiles), flush=True)
    if args.json:
        doc: dict[str, Any] = {
            "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai-chat",
            "backend": "openai-chat", "label": None, "model_id": model, "tokenizer_id": None,
            "base_url": base, "dataset": args.dataset, "num_prompts": args.num_prompts,
            "request_rate": "inf", "burstiness": 1.0, "max_concurrency": args.concurrency,
            "input_len": args.input_len if args.dataset == "random" else None, "output_len": args.output_len,
            "seed": args.seed, "timeout": args.timeout, **metrics, "errors": errors,
        }
        if args.save_detailed:
            doc.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                       latencies=[r.latency for r in results], errors=[r.error for r in results])
        out = Path(args.json)
        write_text_atomic(out, json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

"""`python -m serving.chat --base-url URL [--model NAME] [--once "question"]`

The fitness coach against any OpenAI-compatible server (vLLM-TPU, `serving.launch --local`, ...):
each question goes to `/v1/chat/completions` with the seven tool declarations in `tools`; the
model's call is read from `tool_calls` (a server with a tool-call parser) or parsed from the
FunctionGemma text in `content` (a server that returns raw text), run against the provider
(a simulated watch, or Garmin Connect), and sent back as a `tool` message so the model answers in
words. A call to an unknown tool, wrong arguments, a malformed call or a failed request is reported
to the user, not raised (with `--once`, a server that cannot be reached is a one-line error).

Tool calls are traced on stderr (`-> get_steps(date='yesterday') = {...}`); answers go to stdout.
The API key, if the server wants one, is read from the variable named by --api-key-env.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence, TextIO

from gemma_tpu.core import cli
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.data.records import served_markup
from gemma_tpu.examples.fitness.chat import blank, chat_repl, check_stdin, check_tool_results, question_text
from gemma_tpu.examples.fitness.providers import make_provider
from gemma_tpu.examples.fitness.tools import toolset as fitness_toolset
from gemma_tpu.formats.function_calling import ParsedReply
from gemma_tpu.infer.openai_client import (
    DEFAULT_RETRIES,
    RETRIES_HELP,
    StopTokenTexts,
    api_base,
    api_key_from_env,
    http_json,
    openai_messages,
    reply_from_answer,
    served_model_name,
    thought_of,
)
from gemma_tpu.infer.tool_loop import Toolset, run_tool_loop


class RemoteCoach:
    """One endpoint, one provider; `ask(question)` runs the library's tool loop (`gemma_tpu.infer.tool_loop`)
    and returns the reply text. The tools are the fitness coach's unless a `Toolset` is given."""

    def __init__(self, base_url: str, provider, model: str | None = None, api_key: str | None = None,
                 max_tokens: int = 128, temperature: float = 0.0, timeout: float = 120.0,
                 trace: TextIO | None = sys.stderr, tools: Toolset | None = None, retries: int = DEFAULT_RETRIES,
                 sampling_seed: int | None = None, top_k: int | None = None, top_p: float | None = None):
        self.base = api_base(base_url)
        self.provider = provider
        self.model = model
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.sampling_seed = sampling_seed  # the request's `seed` (vLLM and serving.launch --local honour it)
        self.top_k, self.top_p = top_k, top_p  # sent when given: else the server's (the model's generation_config)
        self.timeout = timeout
        self.retries = retries  # evaluate's policy (http_json): a server restarting or rate limiting is waited for
        self.toolset = tools or fitness_toolset(provider)
        self.trace = trace
        # the server renders the messages with its chat template and tokenizes the prompt whole, control tokens read
        # as such (vLLM and `serving.launch --local` alike): a question holding `<start_of_turn>` opened a turn of
        # its own. Its vocabulary is not known here, so the markup is every family's (records.served_markup: a
        # Gemma 4's `<|turn>` too); the local chat checks its tokenizer's (`Coach`)
        self.markup = served_markup()
        self.stop_text = StopTokenTexts(self.base, model, api_key, min(timeout, 30.0), retries)  # vLLM's stop ids

    def _log(self, text: str) -> None:
        if self.trace is not None:
            print(text, file=self.trace, flush=True)

    def complete(self, messages: list[dict]) -> dict:
        """One chat completion, the whole answer (`choices`, ...)."""
        body: dict[str, Any] = {"messages": openai_messages(messages), "tools": self.toolset.schemas,
                                "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": False}
        if self.model:
            body["model"] = self.model
        if self.sampling_seed is not None:
            body["seed"] = self.sampling_seed
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.top_p is not None:
            body["top_p"] = self.top_p
        return http_json(f"{self.base}/chat/completions", body, timeout=self.timeout, api_key=self.api_key,
                         retries=self.retries)

    def next_reply(self, messages: list[dict]) -> tuple[ParsedReply, str]:
        """The endpoint's next turn: its structured `tool_calls`, else calls parsed from its text (a call cut off at
        --max-tokens says so)."""
        check_tool_results(self.markup, messages)
        reply, message = reply_from_answer(self.complete(messages), f"{self.base}/chat/completions", self.max_tokens,
                                           self.stop_text, option="--max-tokens")
        if thought := thought_of(message):  # a thinking model's (Gemma 4's): traced apart, as the local chat does
            self._log(f"(thought) {thought}")
        return reply, message.get("content") or json.dumps(message.get("tool_calls"))

    def ask(self, question: str) -> str:
        self.markup.check(question, "the question")  # as the local chat refuses it (`Coach.ask`)
        return run_tool_loop(question, self.toolset, self.next_reply, log=self._log)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m serving.chat", __doc__, overrides=False)
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", help="served model (or LoRA adapter) name; default: the first the server lists, "
                                   "or none")
    p.add_argument("--api-key-env", default="VLLM_API_KEY",
                   help="environment variable holding the API key, sent when set (default: VLLM_API_KEY)")
    p.add_argument("--provider", choices=("simulated", "garmin"), default="simulated",
                   help="where the tools read activity data: a simulated device, or your Garmin Connect account")
    p.add_argument("--seed", type=int, default=0, help="simulated device seed")
    p.add_argument("--once", metavar="QUESTION", help="answer one question and exit")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each reply may generate at most (max_tokens)")
    p.add_argument("--temperature", type=cli.number(0.0, low_ok=True, high=2.0), default=0.0,  # OpenAI's range
                   help="sampling temperature sent with each request, 0 to 2 (0: greedy)")
    # --seed is the simulated device's: with --temperature above 0 no run's answers could be had again
    p.add_argument("--sampling-seed", type=int,
                   help="seed sent with each request (its `seed`): a sampled (--temperature > 0) answer is the same "
                        "every run (default: none, the server's own randomness; -1, which the servers read as none, "
                        "is refused)")
    p.add_argument("--top-k", type=cli.integer(0),
                   help="with --temperature: sent as the request's `top_k` (vLLM's extension), the K likeliest tokens, "
                        "0 for all (default: not sent, the served model's generation_config.json applies)")
    p.add_argument("--top-p", type=cli.number(0.0, high=1.0),
                   help="with --temperature: sent as the request's `top_p` (default: not sent, as --top-k)")
    p.add_argument("--timeout", type=cli.SECONDS, default=120.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, help=RETRIES_HELP)
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    cli.setup_logging(logging.WARNING)
    if args.max_tokens <= 0:
        raise UserError(f"--max-tokens {args.max_tokens}: must be positive")
    if args.once is not None and blank(args.once):
        raise UserError("--once needs a question")
    if args.retries < 0:
        raise UserError(f"--retries {args.retries}: must be 0 or more")
    if args.sampling_seed is not None and not -2**63 <= args.sampling_seed < 2**63:  # what the servers take
        raise UserError(f"--sampling-seed {args.sampling_seed}: must be in [-2^63, 2^63)")
    if args.sampling_seed == -1:  # vLLM's SamplingParams (and the local server) read it as None
        raise UserError("--sampling-seed -1: vLLM and serving.launch --local read seed -1 as no seed (each answer "
                        "sampled afresh); give another seed, or leave the option out")
    given = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "sampling_seed")
             if getattr(args, name) is not None]
    if given and not args.temperature:  # ignored by a greedy request: the answers were not the sampled ones asked
        raise UserError(f"{given[0]} applies to sampled answers: add --temperature (above 0; 0 is greedy)")
    if args.once is None:
        check_stdin()  # before the server is asked
    provider = make_provider(args.provider, args.seed)  # fail fast on credentials
    api_key = api_key_from_env(args.api_key_env)
    model = args.model or served_model_name(api_base(args.base_url), api_key, timeout=min(args.timeout, 30),
                                            retries=args.retries)
    coach = RemoteCoach(args.base_url, provider, model, api_key, args.max_tokens, args.temperature, args.timeout,
                        retries=args.retries, sampling_seed=args.sampling_seed, top_k=args.top_k, top_p=args.top_p)
    if args.once is not None:
        print(coach.ask(question_text(args.once)))
        return 0
    return chat_repl(coach.ask, f"Connected to {coach.base} (model {model or 'default'}). ")


if __name__ == "__main__":
    sys.exit(cli_main(main))

"""`python -m gemma_tpu.chat (--model DIR | --checkpoint DIR) [--provider simulated|garmin] [--once "question"]`

The fitness coach, end to end: a question goes to the model with the seven tool declarations;
the model's call is parsed, run against the provider (a simulated watch, or Garmin Connect), and
its response fed back so the model answers in words. Each question is answered on its own (as in
training: one request, one call, one answer). A call to an unknown tool, wrong arguments or a
malformed call is reported to the user, not raised.

Tool calls are traced on stderr (`-> get_steps(date='yesterday') = {...}`); answers go to stdout.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import unicodedata
from typing import Any, Sequence, TextIO

from gemma_tpu.core import cli
from gemma_tpu.core.config import DataConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.data import make_renderer
from gemma_tpu.data.records import Markup
from gemma_tpu.examples.fitness.providers import make_provider
from gemma_tpu.examples.fitness.tools import toolset
from gemma_tpu.formats.function_calling import ParsedReply
from gemma_tpu.hf.files import sampling_defaults
from gemma_tpu.infer.generate import (DECODE_CHUNK, MAX_TEMPERATURE, Generator, Sampling, check_context,
                                      describe_checkpoint, describe_hf_dir, load_checkpoint, load_hf_dir,
                                      prefix_cache_bytes_set)
from gemma_tpu.infer.tool_loop import first_messages, run_tool_loop


class Coach:
    """One model, one provider; `ask(question)` runs the tool loop and returns the reply text."""

    def __init__(self, loaded, provider, max_new_tokens: int = 128, trace: TextIO | None = sys.stderr,
                 generator=None, prefix_cache: bool = True, sampling: Sampling | None = None):
        self.loaded = loaded
        self.provider = provider
        self.toolset = toolset(provider)
        self.renderer = coach_renderer(loaded)
        # a few steps a device call: Ctrl-C cancels an answer within them (it waited for the whole generation)
        self.generator = generator or Generator(loaded, max_new_tokens=max_new_tokens, batch_size=1,
                                                prefix_cache=prefix_cache, decode_chunk=DECODE_CHUNK,
                                                sampling=sampling)
        self.trace = trace

    def _system_ids(self, messages: list[dict]) -> list[int] | None:
        """Ids of the conversation's first turn alone (the generator keeps what the prompt shares
        with them); None where the chat format cannot render that turn on its own."""
        try:
            return self.renderer.render({"tools": self.toolset.schemas, "messages": messages[:1]}).ids
        except (UserError, ValueError):
            return None

    def _log(self, text: str) -> None:
        if self.trace is not None:
            print(text, file=self.trace, flush=True)

    def next_reply(self, messages: list[dict]) -> tuple[ParsedReply, str]:
        """The local model's next turn, parsed."""
        check_tool_results(self.renderer.markup, messages)
        ids = prompt_ids(self.renderer, self.toolset, messages, self.loaded.max_positions)
        check_prompt(self.renderer, self.toolset, messages, ids, getattr(self.generator, "max_new_tokens", None),
                     self.loaded.max_positions)
        # the developer turn (system prompt and tool declarations) starts every prompt: with the
        # prefix cache its keys and values are computed once for the whole session
        out = self.generator.generate([ids], prefix=self._system_ids(messages))[0]
        if out.thought and out.thought.strip():  # a thinking model's (Gemma 4's): traced apart, not the answer
            self._log(f"(thought) {out.thought.strip()}")
        return out.reply(), out.text

    def ask(self, question: str) -> str:
        # the renderer tokenizes the whole prompt at once: a question "what does <start_of_turn> mean?" was read as
        # markup (a turn opened mid-question), so it is refused, as the training data reader refuses such text
        self.renderer.markup.check(question, "the question")
        return run_tool_loop(question, self.toolset, self.next_reply, log=self._log)


def coach_renderer(loaded):
    """The renderer of the coach's prompts for `loaded` (a model, or `describe_*`'s description of one)."""
    return make_renderer(loaded.tokenizer, DataConfig(), loaded.chat_format, loaded.token_map,
                         vocab_size=getattr(loaded.tunix_cfg, "num_embed", None))


def prompt_ids(renderer, tools, messages: list[dict], limit: int | None) -> list[int]:
    """The prompt's ids; one past the model's context `limit` is refused, tokenized only as far as the context
    reaches (a pasted 6 MB log took 34 s and 3 GB to be refused)."""
    r = renderer.render({"tools": tools.schemas, "messages": messages}, add_generation_prompt=True, max_tokens=limit)
    if r.partial:
        raise UserError(f"the prompt is more than {limit} tokens, the model's context (max_position_embeddings): "
                        f"shorten the question")
    return r.ids


def check_question(described, provider, question: str, max_new_tokens: int) -> None:
    """What of `--once QUESTION` is refused whatever the model answers, checked on the model's description
    (`describe_hf_dir`, `describe_checkpoint`: tokenizer and config, no weight) before its load: the question
    holding the chat markup, and its first prompt past the context, were refused after a minute's load."""
    renderer = coach_renderer(described)
    renderer.markup.check(question, "the question")
    tools = toolset(provider)
    messages = first_messages(question, tools)
    ids = prompt_ids(renderer, tools, messages, described.max_positions)
    check_prompt(renderer, tools, messages, ids, max_new_tokens, described.max_positions)


def check_session(described, provider, max_new_tokens: int) -> None:
    """Refuse a session (questions from stdin) whose every prompt passes the model's context with `max_new_tokens`:
    the developer turn (system prompt and tool declarations) and an empty question's user turn already do. Checked on
    the model's description (`describe_hf_dir`, `describe_checkpoint`: no weight read): the weights were loaded (a
    minute for a real model), then each question was answered "(request failed: ...)"."""
    limit = described.max_positions
    if not limit:
        return
    renderer = coach_renderer(described)
    tools = toolset(provider)
    conv = {"tools": tools.schemas, "messages": first_messages("", tools)}
    least = len(renderer.render(conv, add_generation_prompt=True).ids)
    if least + max_new_tokens <= limit:
        return
    parts = renderer.prompt_parts(conv, least)
    given = f" ({', '.join(f'{name} {n}' for name, n in parts[:-1])})" if parts else ""
    if least >= limit:
        raise UserError(f"the prompt of every question is at least {least} tokens{given}, past the model's context of "
                        f"{limit} (max_position_embeddings): a model with a longer context is needed")
    raise UserError(f"--max-new-tokens {max_new_tokens}: the prompt of every question is at least {least} tokens"
                    f"{given}: with up to {max_new_tokens} new tokens it passes the model's context of {limit} "
                    f"(max_position_embeddings); ask for at most {limit - least} new tokens")


def check_prompt(renderer, tools, messages: list[dict], ids: list[int], max_new_tokens: int | None,
                 limit: int | None) -> None:
    """Refuse a prompt (`ids`, of `messages`) that with `max_new_tokens` passes the model's context `limit`, naming
    its parts' tokens (`Renderer.prompt_parts`): the coach's developer turn alone past a small model's context was
    refused with "shorten the prompt", which no question could do."""
    if limit and max_new_tokens and len(ids) + max_new_tokens > limit:
        parts = renderer.prompt_parts({"tools": tools.schemas, "messages": messages}, len(ids))
        check_context([ids], max_new_tokens, limit, parts)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m gemma_tpu.chat", __doc__, overrides=False)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=cli.input_path_of("model directory"),
                       help="base or merged HF directory (or embedded:NAME)")
    which.add_argument("--checkpoint", type=cli.input_path_of("checkpoint directory"),
                       help="gemma-tpu checkpoint directory (base + LoRA)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--provider", choices=("simulated", "garmin"), default="simulated",
                   help="where the tools read activity data: a simulated device, or your Garmin Connect account")
    p.add_argument("--seed", type=int, default=0, help="simulated device seed")
    p.add_argument("--once", metavar="QUESTION", help="answer one question and exit")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="(default: float32 for --model; a --checkpoint's training dtype)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens each reply may generate at most")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute the shared developer turn for every reply (to compare with the cached path)")
    p.add_argument("--temperature", type=cli.number(0.0, low_ok=True, high=MAX_TEMPERATURE), default=0.0,
                   help=f"sample each reply at this temperature, 0 to {MAX_TEMPERATURE:g} (default 0: greedy, the "
                        f"reply evaluation scores)")
    p.add_argument("--top-k", type=cli.integer(0),
                   help="with --temperature: draw from the K likeliest tokens only, 0 for all (default: the model's "
                        "generation_config.json top_k, as vLLM applies it, else all)")
    p.add_argument("--top-p", type=cli.number(0.0, high=1.0),
                   help="with --temperature: draw from the fewest likeliest tokens whose probability reaches P "
                        "(default: the model's generation_config.json top_p, else 1)")
    # --seed is the simulated device's
    p.add_argument("--sampling-seed", type=int,
                   help="with --temperature: the seed of the draws, so that a session's replies are the same every "
                        "run (default: a fresh one each run)")
    return p.parse_args(list(argv))


def sampling_of(args: argparse.Namespace, generation_dir) -> Sampling | None:
    """The replies' `Sampling` from the command line, unset top-k / top-p taken from the model's generation config
    (`sampling_defaults`); None for greedy. A sampling option without --temperature is refused: it would be
    ignored, and the user would take the greedy replies for sampled ones."""
    given = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "sampling_seed")
             if getattr(args, name) is not None]
    if not args.temperature:
        if given:
            raise UserError(f"{given[0]} applies to sampled replies: add --temperature (above 0; 0 is greedy)")
        return None
    defaults = sampling_defaults(generation_dir)
    return Sampling(temperature=args.temperature,
                    top_k=args.top_k if args.top_k is not None else defaults.get("top_k", 0),
                    top_p=args.top_p if args.top_p is not None else defaults.get("top_p", 1.0),
                    seed=args.sampling_seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    cli.setup_logging(logging.WARNING)
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be positive")
    if args.step is not None and not args.checkpoint:
        raise UserError("--step applies to --checkpoint, not --model")
    if args.sampling_seed is not None and not -2 ** 63 <= args.sampling_seed < 2 ** 64:
        raise UserError(f"--sampling-seed {args.sampling_seed}: must be in [-2^63, 2^64)")
    if args.once is not None and blank(args.once):  # before the model, not after its load
        raise UserError("--once needs a question")
    if args.once is None:
        check_stdin()  # before the model too
    if not args.no_prefix_cache:
        prefix_cache_bytes_set()  # a bad $GEMMA_TPU_PREFIX_CACHE_BYTES refused before the model loads
    provider = make_provider(args.provider, args.seed)  # before the model: fail fast on credentials
    # the tokenizer and config: seconds, where the weights take minutes
    described = describe_hf_dir(args.model) if args.model else describe_checkpoint(args.checkpoint, args.step)
    # a bad sampling option or generation config refused before the weights load
    sampling = sampling_of(args, described.generation_dir if described else None)
    if args.once is not None:  # on the tokenizer and config alone: refused before the minutes the weights take
        check_question(described, provider, question_text(args.once), args.max_new_tokens)
    else:
        check_session(described, provider, args.max_new_tokens)
    loaded = (load_hf_dir(args.model, args.dtype or "float32") if args.model
              else load_checkpoint(args.checkpoint, args.step, args.dtype))  # --dtype was ignored here
    coach = Coach(loaded, provider, args.max_new_tokens, prefix_cache=not args.no_prefix_cache, sampling=sampling)
    if args.once is not None:
        print(coach.ask(question_text(args.once)))
        return 0
    return chat_repl(coach.ask, "")


def check_tool_results(markup: Markup, messages: list[dict]) -> None:
    """What the model and the tools wrote, carried back into the next prompt, holding the chat markup's own control
    tokens carries them broken by a word joiner (`Markup.neutralise`): rendered as written, the tokenizer reads them
    as markup. A tool result's (mostly the model's own argument repeated in an error: "unrecognised date
    '<start_of_turn>'") was refused as "...; remove it", ending the question with advice to the user, who never
    wrote it; the model's call arguments (and the text beside its calls) went back as they were, so an argument
    holding '<end_of_turn>' closed the model's turn in the next prompt. The question itself is still refused
    (`Coach.ask`)."""
    for m in messages:
        if m["role"] == "tool" and isinstance(m.get("content"), str):
            m["content"] = markup.neutralise(m["content"])
        elif m["role"] == "assistant" and m.get("tool_calls"):
            if isinstance(m.get("content"), str):
                m["content"] = markup.neutralise(m["content"])
            m["tool_calls"] = [_neutralised_call(markup, c) for c in m["tool_calls"]]


def _neutralised_call(markup: Markup, call: Any) -> Any:
    """One call of an assistant turn, normalised (`{"name", "arguments"}`) or in OpenAI's shape (`{"function":
    {...}}`), its arguments (an object, or its JSON text) neutralised: a new dict, the tool's own left as they are."""
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": _neutralised_call(markup, call["function"])}
    if "arguments" not in call:
        return call
    return {**call, "arguments": markup.neutralised(call["arguments"])}


def question_text(raw: str) -> str:
    """A question as text the tokenizer and JSON accept: bytes that were not UTF-8 (Python keeps them in
    argv, and in stdin under a C.UTF-8 locale, as lone surrogates, which the tokenizer refuses with a
    TypeError) become U+FFFD. A leading byte-order mark is dropped: a questions file saved as "UTF-8 with BOM"
    (Windows Notepad) and piped in sent its first question to the model with U+FEFF before it. The whitespace around
    it too, as of a piped line: `--once "$(cat q.txt)"` of a CRLF file sent the question with its '\\r'."""
    try:
        text = raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte (not U+DC80..U+DCFF)
        text = raw.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text.lstrip("\ufeff").strip()


_FILLERS = frozenset("\u115f\u1160\u3164\uffa0")  # Hangul fillers: letters to Unicode, blank on the screen


def blank(text: str) -> bool:
    """Whether a question shows nothing: whitespace, or only invisible format characters (a zero-width space, word
    joiner, byte-order mark, soft hyphen: `str.strip` keeps them, and such a question went to the model)."""
    return all(c.isspace() or c in _FILLERS or unicodedata.category(c) in ("Cf", "Cc") for c in text)


def check_stdin() -> None:
    """Refuse a session without a standard input to read its questions from (closed: `<&-`, a service without one):
    Python's sys.stdin is None there, and the chat ended in an AttributeError traceback, after the model's load."""
    if sys.stdin is None:
        raise UserError("no standard input to read questions from (it is closed): give one with --once QUESTION, "
                        "or pipe the questions in")


QUIT = ("exit", "quit", "/exit", "/quit", "/bye")  # what ends a session (the slash forms other chat CLIs use)


def chat_repl(ask, greeting: str) -> int:
    """Questions from stdin (a prompt when it is a terminal) until EOF/exit; a failed request is reported
    and the session goes on. On a terminal, Ctrl-C during an answer cancels that answer (its request is dropped)
    and asks again, and Ctrl-C at the prompt leaves as Ctrl-D does: it ended the whole session, mid-answer or not,
    with "error: interrupted". Piped questions stop at Ctrl-C (exit 130), as any command in a pipeline does."""
    check_stdin()
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is not UTF-8 is U+FFFD, not a UnicodeDecodeError (a
        sys.stdin.reconfigure(errors="surrogateescape")  # strict locale) that ends the session; see question_text
    if interactive:
        # a follow-up ("and yesterday?") reaches the model without the turns before it: said, not left to be found
        print(f"{greeting}Ask about steps, sleep, activity, heart rate or Body Battery; each question is answered on "
              f"its own, without the ones before (Ctrl-C cancels an answer, Ctrl-D quits).",
              file=sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            if not interactive:
                raise
            line = ""  # Ctrl-C at the prompt: leave
        if not line:  # Ctrl-D: end the prompt's line, or the shell's prompt follows `you> `
            if interactive:
                print(file=sys.stderr)
            break
        question = question_text(line)
        if blank(question):
            continue
        if question.lower() in QUIT:
            break
        if re.fullmatch(r"/\w+", question):  # "/help", "/reset": a command, which the model would answer as a question
            print(f"{question}: not a command here; {', '.join(QUIT[:2])} or Ctrl-D quits, anything else is asked",
                  file=sys.stderr, flush=True)
            continue
        try:
            answer = ask(question)
        except UserError as e:  # one failed request does not end the session
            answer = f"(request failed: {e})"
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("(cancelled)", file=sys.stderr, flush=True)
            continue
        print(("coach> " if interactive else "") + answer, flush=True)
    return 0

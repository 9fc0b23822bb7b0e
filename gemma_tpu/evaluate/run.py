"""`python -m gemma_tpu.evaluate --data TEST.jsonl (--model DIR | --checkpoint DIR | --endpoint URL | --compare A B)`

Scores tool calling on held-out conversations. For each example the model sees the conversation
up to its first assistant turn (developer/system turn with the tool declarations, user request)
and generates greedily; its first call is compared with the reference call. `--turns all` scores every
trained assistant turn of a multi-turn chat the same way, each after the reference conversation before it
(the tool results and earlier answers as written), one decision each:

    tool_accuracy          the right decision, over all n: the first call names the reference tool (a reference
                           turn of several calls: every one is matched by a call of its name, in any order), or,
                           where the reference makes no call, a reply without one
    argument_accuracy      ... and every reference argument is equal (types normalised: 5 == "5"; a reference null
                           matches one left out; fractional numbers within 1e-6; extra predicted keys pass, inside
                           object arguments too: `arguments_match`)
    call_tool_accuracy, call_argument_accuracy
                           the same over the call_n conversations whose reference makes a call: tool-name and
                           argument accuracy proper (equal to the two above on data where every reference calls)
    declined_accuracy      over the no_call_n conversations whose reference makes no call: replied without one
                           (text; not a call, a format error or a refusal)
    hallucinated_tool_rate a call names a tool the example does not declare
    no_call_rate           plain text, no call attempted
    format_error_rate      text that attempts a call which does not parse (one cut off at --max-new-tokens says so)
    refused_rate           the prompt with --max-new-tokens passes a local model's context, or the server refused
                           the request (HTTP 400/413/422, e.g. a prompt over its context); one line names the
                           conversation, it scores as wrong, and the run goes on
    answer_exact_match, answer_f1, answer_rouge_l
                           for examples whose reference turn is text (chats, instruction pairs): the generated
                           answer against it (`gemma_tpu/evaluate/answers.py`); answers are cut at --max-new-tokens
                           (a prompt ending in the start of the answer, TRL's continue_final_message rows: the model
                           continues it, and the continuation is scored against the reference's)
    eval_loss, perplexity  teacher-forced NLL of the reference assistant turns (calls and answers),
                           loss-bearing tokens only - as in training (up to the model's context); not for --endpoint

Models: `--model` a base or merged HF directory, `--checkpoint` a gemma-tpu Orbax run directory
(base + LoRA of `--step`, default the latest), `--endpoint` any OpenAI-compatible server
(requests carry `messages` + `tools`; calls are read from `tool_calls`, or parsed from `content`).
`--compare A B` puts two of them (`model:DIR`, `checkpoint:DIR[@STEP]`, `endpoint:URL[#MODEL]`) side by side
(`#MODEL`: the served model of that side, such as a base and its LoRA adapter on one vLLM server).
Local models run on the same JAX/Tunix stack as training.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from gemma_tpu.checkpoint.metadata import list_steps
from gemma_tpu.checkpoint.restore import locate
from gemma_tpu.core import cli, strict_json
from gemma_tpu.core.atomic import check_results_file, write_text_atomic
from gemma_tpu.core.config import DataConfig, RunConfig
from gemma_tpu.core.typed_yaml import keys_given
from gemma_tpu.core.errors import SignalExit, UserError, stop_signals_raise
from gemma_tpu.data import eval_batches, load_conversations, make_renderer, prepare_examples, render_error
from gemma_tpu.data.batching import Example
from gemma_tpu.data.records import Markup, served_markup
from gemma_tpu.evaluate.answers import answer_scores
from gemma_tpu.formats.function_calling import CUT_OFF, ParsedReply, ToolCall, arguments_match
from gemma_tpu.infer.generate import (DECODE_CHUNK, Generator, context_excess, describe_checkpoint, describe_hf_dir,
                                      load_checkpoint, load_hf_dir, prefix_cache_bytes_set)
from gemma_tpu.infer.openai_client import (  # noqa: F401
    DEFAULT_RETRIES,
    RETRIES_HELP,
    HTTPStatusError,
    StopTokenTexts,
    api_base,
    api_key_from_env,
    check_reachable,
    http_json,
    openai_messages,
    openai_tools,
    reply_from_answer,
    served_model_name,
    server_key,
)
from gemma_tpu.models import resolve_model

log = logging.getLogger("gemma_tpu.evaluate")

METRICS = ("n", "tool_accuracy", "argument_accuracy", "call_n", "call_tool_accuracy", "call_argument_accuracy",
           "no_call_n", "declined_accuracy", "hallucinated_tool_rate", "no_call_rate",
           "format_error_rate", "refused_rate", "answer_n", "answer_exact_match", "answer_f1", "answer_rouge_l",
           "eval_loss", "perplexity")


@dataclasses.dataclass
class Case:
    """One scored decision: the prompt up to the first trained assistant turn and the reference call
    (an answer marked `train: false`, such as a prompt-completion row's prompt, is context)."""

    prompt: dict  # {"tools": [...], "messages": [...]}
    reference: ToolCall | None  # None: the reference answers without a call
    tool_names: list[str]
    user: str
    answer: str | None = None  # the reference turn's text when it makes no call
    calls: list[ToolCall] = dataclasses.field(default_factory=list)  # every call of the reference turn
    where: str = ""  # FILE:LINE of the conversation
    turn: int | None = None  # the scored assistant message's index in the conversation's messages
    # the start of the reference answer its prompt gives (TRL's continue_final_message rows): the prompt's last
    # message, continued by the model as training saw it continued; `answer` is the reference's continuation
    start: str = ""


TURNS = ("first", "all")  # which trained assistant turns of a conversation are scored


def build_cases(convs: list[dict], turns: str = "first") -> list[Case]:
    """The scored decisions of `convs`: each conversation's first trained assistant turn, or every one (`turns`
    "all"), with the reference conversation before it as the prompt."""
    cases = []
    for conv in convs:
        msgs = conv["messages"]
        trained = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("train", True)]
        names = [(t.get("function", t))["name"] for t in conv.get("tools") or []]
        for k in trained if turns == "all" else trained[:1]:
            calls = msgs[k].get("tool_calls") or []
            ref = ToolCall(calls[0]["name"], calls[0]["arguments"]) if calls else None
            user = next((m["content"] for m in reversed(msgs[:k]) if m["role"] == "user"), "")
            text = msgs[k].get("content") or ""  # text: records normalise contents
            # a given start is the prompt's (it was left out: the model answered from scratch, scored against the
            # start and the continuation); the model continues it, and its continuation is scored
            given = msgs[k].get("given", 0)
            start = [{"role": "assistant", "content": text[:given]}] if given else []
            cases.append(Case({"tools": conv.get("tools"), "messages": msgs[:k] + start}, ref, names, user,
                              None if calls else text[given:], [ToolCall(c["name"], c["arguments"]) for c in calls],
                              conv.get("where", ""), k, text[:given]))
    return cases


def check_answered(convs: list[dict]) -> None:
    """Refuse a conversation that does not end with the assistant's turn, by FILE:LINE: its last question (or tool
    result) has no reference answer, and was never scored under any --turns, without a word (the data reader takes
    it: it trains nothing there)."""
    for conv in convs:
        last = conv["messages"][-1]["role"]
        if last != "assistant":
            what = {"user": "a user message", "tool": "a tool result"}.get(last, f"a {last} message")
            raise UserError(f"{conv.get('where') or 'an example'}: the conversation ends with {what}, without the "
                            f"assistant's turn after it: no reference answer to score it against (end it with the "
                            f"assistant's turn, or drop the messages after the last one)")


def _matched(reference: Sequence[ToolCall], predicted: Sequence[ToolCall], same) -> bool:
    """Every reference call has a predicted call of its own that is `same(ref, pred)` (a matching, found by
    trying each candidate: a turn holds a handful of calls)."""
    def match(i: int, used: frozenset) -> bool:
        return i == len(reference) or any(k not in used and same(reference[i], p) and match(i + 1, used | {k})
                                          for k, p in enumerate(predicted))

    return match(0, frozenset())


NO_CALL = "(no call)"  # the per_tool entry of the references that make no call


def outcome(case: Case, pred: ParsedReply) -> dict[str, Any]:
    """How one reply scored, as its record in the results file says it (`score`'s rates are the means of these):
    the right tool decision, the right arguments too, a call to an undeclared tool, and for a reference turn of text
    the answer's scores (0 for a reply that is not text)."""
    first = pred.first if pred.kind == "call" else None
    if case.reference is None:
        ok_name = ok_args = pred.kind == "text"
    elif len(case.calls) > 1:  # parallel calls: all of them, in any order (the first alone scored it right)
        got = pred.calls if pred.kind == "call" else []
        ok_name = _matched(case.calls, got, lambda r, p: r.name == p.name)
        ok_args = ok_name and _matched(case.calls, got, lambda r, p: r.name == p.name and arguments_match(
            r.arguments, p.arguments))
    else:
        ok_name = first is not None and first.name == case.reference.name
        ok_args = ok_name and arguments_match(case.reference.arguments, first.arguments)
    out = {"tool_correct": bool(ok_name), "arguments_correct": bool(ok_args),
           "hallucinated": pred.kind == "call" and any(c.name not in case.tool_names for c in pred.calls)}
    if case.answer is not None:
        out.update({k: v for k, v in answer_scores([(pred.text if pred.kind == "text" else None, case.answer)]).items()
                    if k != "answer_n"})
    return out


def score(cases: Sequence[Case], predictions: Sequence[ParsedReply]) -> dict[str, Any]:
    """The tool-calling metrics of predictions against their cases (fractions of n; the call_* ones of call_n,
    declined_accuracy of no_call_n, None without such a case)."""
    if len(cases) != len(predictions):
        raise ValueError(f"{len(cases)} cases but {len(predictions)} predictions")
    n = len(cases)
    tool = args = halluc = nocall = fmt = refused = 0
    per_tool: dict[str, list[int]] = {}
    for case, pred in zip(cases, predictions):
        got = outcome(case, pred)
        ok_name, ok_args = got["tool_correct"], got["arguments_correct"]
        tool += ok_name
        args += ok_args
        halluc += got["hallucinated"]
        nocall += pred.kind == "text"
        fmt += pred.kind == "format_error"
        refused += pred.kind == "refused"
        key = case.reference.name if case.reference else NO_CALL
        stats = per_tool.setdefault(key, [0, 0, 0])
        stats[0] += 1
        stats[1] += ok_name
        stats[2] += ok_args
    frac = (lambda k: k / n) if n else (lambda k: 0.0)
    calls = {k: v for k, v in per_tool.items() if k != NO_CALL}
    call_n = sum(v[0] for v in calls.values())
    declined = per_tool.get(NO_CALL, [0, 0, 0])
    return {
        "n": n, "tool_accuracy": frac(tool), "argument_accuracy": frac(args),
        "call_n": call_n,
        "call_tool_accuracy": sum(v[1] for v in calls.values()) / call_n if call_n else None,
        "call_argument_accuracy": sum(v[2] for v in calls.values()) / call_n if call_n else None,
        "no_call_n": declined[0], "declined_accuracy": declined[1] / declined[0] if declined[0] else None,
        "hallucinated_tool_rate": frac(halluc), "no_call_rate": frac(nocall), "format_error_rate": frac(fmt),
        "refused_rate": frac(refused),
        **answer_scores([(pred.text if pred.kind == "text" else None, case.answer)
                         for case, pred in zip(cases, predictions) if case.answer is not None]),
        "per_tool": {k: {"n": v[0], "tool_accuracy": v[1] / v[0], "argument_accuracy": v[2] / v[0]}
                     for k, v in sorted(per_tool.items())},
    }


# ------------------------------------------------------------------------------ local models


def _renderer(loaded, data_cfg: DataConfig):
    return make_renderer(loaded.tokenizer, data_cfg, loaded.chat_format, loaded.token_map,
                         vocab_size=getattr(loaded.tunix_cfg, "num_embed", None))


def refuse(case: Case, number: int, reason: str) -> ParsedReply:
    """A prompt the model cannot take (over its context, refused by the server): one line naming the conversation,
    and a reply that scores as wrong (refused_rate), for the local and the endpoint paths alike."""
    from tqdm import tqdm

    tqdm.write(f"{case.where or f'example {number}'} ({case.user[:60]!r}): refused, scored as wrong: {reason}",
               file=sys.stderr)
    return ParsedReply("refused", [], "", reason)


def check_not_all_refused(cases: Sequence[Case], reasons: dict[int, str]) -> None:
    """End the run when every prompt is refused (`reasons`: case index -> why), naming the first: --max-new-tokens,
    the model, the server or the data is wrong, and a table of zeros would say nothing. One rule for the local and the
    endpoint paths (the endpoint ended after its first five refusals, so the same data and model served ended there
    and scored locally); a run with any prompt taken goes on, its refusals scored as wrong."""
    if reasons and len(reasons) == len(cases):
        first = min(reasons)
        raise UserError(f"{cases[first].where or 'an example'}: {reasons[first]}"
                        + (f" (as are all {len(cases)} prompts)" if len(cases) > 1 else ""))


# the replies gathered so far (case index -> (reply, raw text)), filled by both predict_* as examples are answered:
# a run stopped midway (an error, Ctrl-C, SIGTERM) scores and keeps them (`partial_scores`, `keep_partial`)
Done = dict[int, tuple[ParsedReply, str]]


def prompts_within_context(renderer, cases: Sequence[Case], max_new_tokens: int,
                           limit: int | None) -> tuple[list[list[int]], dict[int, str]]:
    """Every case's prompt ids, and why each that with `max_new_tokens` passes the model's context `limit` is refused
    (case index -> reason). Tokenized only as far as the context reaches (`partial`): a 3 MB question took 30 s and
    2.4 GB to be refused."""
    rendered = [render_prompt(renderer, c, limit) for c in cases]
    over = {i: past_context(renderer, cases[i].prompt, r, max_new_tokens, limit)
            for i, r in enumerate(rendered) if limit and len(r.ids) + max_new_tokens > limit}
    return [r.ids for r in rendered], over


def render_prompt(renderer, case: Case, limit: int | None = None):
    """A case's prompt as the model is asked it (after the start of the answer it gives, if any, left open as
    continue_final_message leaves it; else with the generation prompt); a prompt the renderer refuses (a chat template
    refusing a developer turn) is named by its FILE:LINE, as training names it (it was "example: the tokenizer's chat
    template refused the conversation"). The one home of evaluation prompts: the benchmarks that time or check them
    render theirs here (they rendered every prompt with the generation prompt, so a row giving the start of its
    answer was asked without it)."""
    try:
        return renderer.render({**case.prompt, "where": case.where}, add_generation_prompt=not case.start,
                               max_tokens=limit, continue_final=bool(case.start))
    except UserError as e:
        raise render_error(e, {"where": case.where}, "an example") from None


def past_context(renderer, prompt: dict, rendered, max_new_tokens: int, limit: int) -> str:
    """Why a prompt (`rendered`) with --max-new-tokens passes the context: its tokens by part (`prompt_parts`: the
    system prompt, the tool declarations, the question...) and by how many, so that a test set whose declarations
    alone pass a small model's context says so (it was the prompt's length, as if --max-new-tokens were to blame)."""
    head = f"the prompt is {f'more than {limit}' if rendered.partial else len(rendered.ids)} tokens"
    parts = None if rendered.partial else renderer.prompt_parts(prompt, len(rendered.ids), max_tokens=limit)
    if parts:
        head += f" ({', '.join(f'{name} {n}' for name, n in parts)})"
    tail = "" if rendered.partial else " " + context_excess(len(rendered.ids), max_new_tokens, limit, parts,
                                                            "new tokens (--max-new-tokens)")
    return (f"{head}; with --max-new-tokens {max_new_tokens} it passes the model's context of {limit} "
            f"(max_position_embeddings){tail}")


def check_before_load(spec: Spec, convs: list[dict], cfg: RunConfig, args) -> None:
    """What of the data a local model refuses whatever it answers, checked on its tokenizer and config alone
    (`describe_hf_dir`, `describe_checkpoint`: no weight read): the conversations read again with this model's control
    tokens (read first for its format alone: no tokenizer was known), so a Gemma 4 test set holding its `<turn|>` in a
    message is refused by FILE:LINE, as training refuses it, and every prompt past the context with --max-new-tokens
    (`check_not_all_refused`). Both were found only after the weights had loaded (a minute for a real model)."""
    described = (describe_hf_dir(spec.target) if spec.kind == "model"
                 else describe_checkpoint(spec.target, spec.step))
    renderer = _renderer(described, cfg.data)
    load_conversations(args.data, cfg.data, renderer.markup, args.limit)
    cases = build_cases(convs, args.turns)
    check_not_all_refused(cases, prompts_within_context(renderer, cases, args.max_new_tokens,
                                                        described.max_positions)[1])


def predict_local(loaded, cases: Sequence[Case], data_cfg: DataConfig, max_new_tokens: int, batch_size: int,
                  label: str, prefix_cache: bool = True,
                  done: Done | None = None) -> tuple[list[ParsedReply], list[str]]:
    """Greedy generation for every case, batched; returns parsed replies and raw texts. With
    `prefix_cache`, the prompt prefix all cases share (the developer turn with the tool
    declarations) is computed once (`gemma_tpu.infer.generate`); the outputs are the same.

    A prompt that with `max_new_tokens` passes the model's context is refused and scored as wrong, as a server
    refuses it (vLLM and `serving.launch --local` answer HTTP 400 to a prompt plus max_tokens past the context);
    when every prompt does, the run ends (`check_not_all_refused`). Each reply goes into `done` as its batch ends."""
    from tqdm import tqdm

    prompts, over = prompts_within_context(_renderer(loaded, data_cfg), cases, max_new_tokens, loaded.max_positions)
    check_not_all_refused(cases, over)
    keep = [i for i in range(len(cases)) if i not in over]
    # a few decode steps a device call: a Ctrl-C or SIGTERM is seen when a call returns, and one call a batch made it
    # wait for the whole batch (then lost it all the same)
    gen = Generator(loaded, max_new_tokens=max_new_tokens, batch_size=batch_size, prefix_cache=prefix_cache,
                    decode_chunk=DECODE_CHUNK)
    done = {} if done is None else done
    with tqdm(total=len(keep), desc=f"generate {label}", file=sys.stderr, unit="ex") as bar:
        done.update({i: (refuse(cases[i], i + 1, over[i]), "") for i in sorted(over)})
        gen.generate([prompts[i] for i in keep], on_batch=bar.update,
                     on_result=lambda j, out: done.__setitem__(keep[j], (out.reply(), out.raw or out.text)))
    return [done[i][0] for i in range(len(cases))], [done[i][1] for i in range(len(cases))]


def eval_loss(loaded, convs: list[dict], data_cfg: DataConfig, batch_size: int, label: str,
              strategy: str = "pack") -> float | None:
    """Mean NLL over loss-bearing tokens of the reference conversations, as the trainer computes it.

    Rows are packed as training packs them (with `data.share_prefix: auto`, a developer turn the
    conversations share is computed once per row, and short rows share a row): the same loss as one
    conversation a row (`strategy="pad"` with `share_prefix="off"`; tested), for less forward work. A conversation
    past the model's context counts up to it (None: no reference token within it, in any conversation)."""
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    from gemma_tpu.train.loss import sparse_loss  # deferred: imports jax/torch

    renderer = _renderer(loaded, data_cfg)
    limit = loaded.max_positions  # only the tokens within it count: a longer text is tokenized only that far
    examples = [Example(r.ids, r.loss_mask, c.get("where", "")) for c in convs
                for r in [renderer.render(c, max_tokens=limit)]]
    seq_len = max(data_cfg.seq_len, -(-max(len(e.ids) for e in examples) // 64) * 64)
    if limit and seq_len > limit:  # positions past the context were scored as if the model had them (training refuses)
        over = [e for e in examples if len(e.ids) > limit]
        if over:
            empty = sum(1 for e in over if not e.loss_mask[:limit].any())
            print(f"{over[0].where or 'an example'}: {len(over)} of {len(examples)} conversations pass the model's "
                  f"context of {limit} tokens (max_position_embeddings); eval_loss counts the first {limit} of each"
                  + (f" ({empty} with no reference token among them: left out)" if empty else ""), file=sys.stderr)
            examples = [e for e in examples if e.loss_mask[:limit].any()]
            if not examples:
                return None
        seq_len = limit
    cfg = dataclasses.replace(data_cfg, seq_len=seq_len, strategy=strategy, overlength="truncate", max_loss_tokens=None)
    split = prepare_examples(examples, f"eval loss {label}", cfg, seed=0)
    graphdef, state = nnx.split(loaded.model)

    @jax.jit
    def batch_loss(state, batch):
        model = nnx.merge(graphdef, state)
        return sparse_loss(model, **batch), batch["loss_weights"].sum()

    total = weight = 0.0
    # no more rows a batch than there are rows (a power of two): a short evaluation would otherwise compute
    # 32 mostly empty rows of seq_len (tiny model, `--limit 5`: 6.7 GB and 30 s before, 2.3 GB and 14 s now)
    batch_size = min(batch_size, 1 << (max(len(split.rows), 1) - 1).bit_length())
    batches = eval_batches(split, batch_size)
    for batch in tqdm(batches, desc=f"eval loss {label}", file=sys.stderr, unit="batch"):
        loss, w = batch_loss(state, {k: np.asarray(v) for k, v in batch.items()})
        total += float(loss) * float(w)
        weight += float(w)
    return total / max(weight, 1.0)


# --------------------------------------------------------------------------------- endpoints

# HTTP statuses that refuse one request for what it holds (bad request, too large, unprocessable): the example
# scores as wrong (refused_rate) and the evaluation goes on, unless every request gets one (check_not_all_refused)
REFUSED_STATUS = frozenset({400, 413, 422})


def predict_endpoint(url: str, served: str | None, cases: Sequence[Case], max_new_tokens: int,
                     label: str, timeout: float = 300.0, retries: int = DEFAULT_RETRIES,
                     api_key: str | None = None, done: Done | None = None) -> tuple[list[ParsedReply], list[str]]:
    """Each case asked of the server in turn, its reply put in `done` as it comes. A failure that ends the run
    (after its retries) names the example it stopped at."""
    base = api_base(url)
    name = served or served_model_name(base, api_key, timeout=min(timeout, 30.0), retries=retries)
    preds: list[ParsedReply] = []
    texts: list[str] = []
    try:
        refused = _ask_each(base, name, cases, max_new_tokens, label, timeout, retries, api_key, preds, texts)
    except (Exception, KeyboardInterrupt, SignalExit) as e:
        if isinstance(e, UserError):
            where = cases[len(preds)].where or "an example"
            e.args = (f"{where} (example {len(preds) + 1} of {len(cases)}): {e}",)
        if done is not None:
            done.update(enumerate(zip(preds, texts)))
        raise
    check_not_all_refused(cases, refused)
    return preds, texts


def _ask_each(base: str, name: str | None, cases: Sequence[Case], max_new_tokens: int, label: str, timeout: float,
              retries: int, api_key: str | None, preds: list, texts: list) -> dict[int, str]:
    """`predict_endpoint`'s requests, their replies appended to `preds` and `texts`; returns the refusals."""
    from tqdm import tqdm

    refused: dict[int, str] = {}
    stop_text = StopTokenTexts(base, name, api_key, min(timeout, 30.0), retries)  # vLLM's numeric stop_reason
    for case in tqdm(cases, desc=f"generate {label}", file=sys.stderr, unit="ex"):
        body: dict[str, Any] = {"messages": openai_messages(case.prompt["messages"]),
                                "max_tokens": max_new_tokens, "temperature": 0.0, "stream": False}
        if name:
            body["model"] = name
        if case.prompt.get("tools"):
            body["tools"] = openai_tools(case.prompt["tools"])
        if case.start:  # vLLM's extension: the reply continues the prompt's last (assistant) message
            body.update(continue_final_message=True, add_generation_prompt=False)
        try:
            answer = http_json(f"{base}/chat/completions", body, timeout=timeout, api_key=api_key, retries=retries)
        except HTTPStatusError as e:
            # a refusal of this one request (a prompt over the server's context, a conversation its template
            # refuses) scores the example as wrong and the run goes on; any other answer (wrong model name, auth,
            # path) ends it
            if e.code not in REFUSED_STATUS:
                raise
            refused[len(preds)] = str(e)
            preds.append(refuse(case, len(preds) + 1, str(e)))
            texts.append("")
            continue
        reply, message = reply_from_answer(answer, f"{base}/chat/completions", max_new_tokens, stop_text)
        preds.append(reply)
        texts.append(json.dumps(message, ensure_ascii=False))
    return refused


# ---------------------------------------------------------------------------------- driving


@dataclasses.dataclass
class Spec:
    kind: str  # model | checkpoint | endpoint
    target: str
    step: int | None = None
    served: str | None = None
    own_name: bool = False  # `served` came with the spec (`endpoint:URL#MODEL`): the label names it

    @property
    def label(self) -> str:
        return (f"{self.kind}:{self.target}" + (f"@{self.step}" if self.step is not None else "")
                + (f"#{self.served}" if self.own_name else ""))


def parse_spec(text: str, step: int | None = None, served: str | None = None) -> Spec:
    kind, sep, target = text.partition(":")
    if not sep or kind not in ("model", "checkpoint", "endpoint") or not target:
        raise UserError(f"--compare {text!r}: expected model:DIR, checkpoint:DIR[@STEP] or endpoint:URL[#MODEL]")
    if kind != "endpoint":  # the shell expands no `~` inside a word: checkpoint:~/x "did not exist"
        target = os.path.expanduser(target)
    if kind == "checkpoint" and "@" in target and target.rsplit("@", 1)[1].isdigit():
        target, s = target.rsplit("@", 1)
        step = int(s)
    elif kind == "checkpoint" and "@" in target and not Path(target).exists() \
            and Path(target.rsplit("@", 1)[0]).is_dir():  # was "checkpoint directory DIR@last does not exist"
        raise UserError(f"--compare {text!r}: {target.rsplit('@', 1)[1]!r} is not a step number "
                        f"(checkpoint:DIR@STEP takes the step in digits, e.g. @200; without it, the latest)")
    # each side its own served model (a base and its adapter on one server): --served-model named one for both, so
    # such a comparison scored one model twice
    own = kind == "endpoint" and "#" in target
    if own:
        target, served = target.split("#", 1)
        if not served or not target:
            raise UserError(f"--compare {text!r}: expected endpoint:URL#MODEL with both the URL and the model name")
    return Spec(kind, target, step if kind == "checkpoint" else None, served if kind == "endpoint" else None, own)


def same_model(a: Spec, b: Spec) -> bool:
    """Whether two specs name one model: one directory however spelt (`runs/x`, `./runs/x/`), one checkpoint step, or
    one server address (`http://h:8000`, `http://h:8000/v1`, `http://localhost:8000` and `http://127.0.0.1:8000`) and
    served model. A checkpoint's step given and left to the latest are one step when it is the latest
    (`checkpoint:runs/x@64 checkpoint:runs/x` of a run that stopped at 64 scored it twice)."""
    if a.kind != b.kind or a.served != b.served:
        return False
    if a.step != b.step and (a.kind != "checkpoint" or _step_of(a) != _step_of(b)):
        return False
    if a.kind == "endpoint":
        try:
            return server_key(a.target) == server_key(b.target)
        except UserError:  # said of that side by check_spec, naming it
            return a.target == b.target
    return os.path.realpath(os.path.expanduser(a.target)) == os.path.realpath(os.path.expanduser(b.target))


def _step_of(spec: Spec) -> int | None:
    """A checkpoint spec's step: the one given, else its directory's latest complete step (None without one)."""
    if spec.step is not None:
        return spec.step
    steps = list_steps(spec.target)
    return steps[-1] if steps else None


def check_spec(spec: Spec, timeout: float, api_key: str | None = None, retries: int = 0) -> None:
    """What can be checked of a model without loading it (the directory, the checkpoint step and its base,
    the server answering), so `--compare` fails before the first model's minutes of work, not after."""
    if spec.kind == "model":
        resolve_model(spec.target, what="")  # the caller names the spec
    elif spec.kind == "checkpoint":
        locate(spec.target, spec.step)
    else:
        check_reachable(api_base(spec.target), api_key, timeout=min(timeout, 30.0), retries=retries)


def evaluate_spec(spec: Spec, convs: list[dict], cfg: RunConfig, args) -> tuple[dict, list[dict]]:
    """Metrics (and per-example records) of one model on the conversations."""
    cases = build_cases(convs, args.turns)
    t0 = time.time()
    loss = None
    done: Done = {}
    try:
        if spec.kind == "endpoint":
            preds, texts = predict_endpoint(spec.target, spec.served, cases, args.max_new_tokens, spec.label,
                                            args.timeout, args.retries, api_key_from_env(args.api_key_env),
                                            done=done)
        else:
            loaded = (load_hf_dir(spec.target, cfg.model.dtype) if spec.kind == "model"
                      else load_checkpoint(spec.target, spec.step, args.checkpoint_dtype))
            preds, texts = predict_local(loaded, cases, cfg.data, args.max_new_tokens, args.batch_size, spec.label,
                                         prefix_cache=not args.no_prefix_cache, done=done)
            if not args.no_loss:
                loss = eval_loss(loaded, convs, cfg.data, args.batch_size, spec.label)
            del loaded
            gc.collect()
    except (Exception, KeyboardInterrupt, SignalExit) as e:
        if done:  # the examples answered before it stopped, local or endpoint alike: scored, for keep_partial
            e.partial = partial_scores(cases, done, t0)
        raise
    return scored(cases, preds, texts, loss, t0)


def partial_scores(cases: Sequence[Case], done: Done, t0: float) -> tuple[dict, list[dict], list[int]]:
    """The metrics and records of the examples answered before a run stopped, and their indices (an endpoint's are
    the first k; a local model's the batches finished, shortest prompts first)."""
    idx = sorted(done)
    return (*scored([cases[i] for i in idx], [done[i][0] for i in idx], [done[i][1] for i in idx], None, t0), idx)


def scored(cases: Sequence[Case], preds: Sequence[ParsedReply], texts: Sequence[str], loss: float | None,
           t0: float) -> tuple[dict, list[dict]]:
    """The metrics and per-example records of a model's replies."""
    metrics = score(cases, preds)
    metrics["eval_loss"] = loss
    metrics["perplexity"] = math.exp(min(loss, 80.0)) if loss is not None else None
    metrics["seconds"] = round(time.time() - t0, 1)
    # each record names its example (FILE:LINE) and, as `--turns all` scores several a conversation, its turn; it says
    # how it scored (`outcome`), so the table is the records' means and a reader finds the examples a model got wrong
    records = [{"where": c.where, "turn": c.turn, "user": c.user,
                "reference": dataclasses.asdict(c.reference) if c.reference else None,
                **({"reference_calls": [dataclasses.asdict(x) for x in c.calls]} if len(c.calls) > 1 else {}),
                "reference_answer": c.answer, **({"answer_start": c.start} if c.start else {}),
                "kind": p.kind, "predicted": [dataclasses.asdict(x) for x in p.calls],
                "answer": p.text if p.kind == "text" else None, "error": p.error, "raw": t, **outcome(c, p)}
               for c, p, t in zip(cases, preds, texts)]
    return metrics, records


def recorded_reply(record: dict) -> ParsedReply:
    """The reply a record of `scored` holds, as it was scored: its raw text parsed again differs (a refused prompt's
    is empty, which parses as an answer without a call, and scored right where the reference makes none)."""
    return ParsedReply(record["kind"], [ToolCall(c["name"], c["arguments"]) for c in record["predicted"]],
                       record["answer"] if record["answer"] is not None else record["raw"], record["error"])


def format_table(results: dict[str, dict]) -> str:
    """Metrics down, models across."""
    labels = list(results)
    width = max(24, *(len(l) + 2 for l in labels))

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, int):
            return str(v)
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.2f}"

    lines = ["metric".ljust(24) + "".join(l.rjust(width) for l in labels)]
    for m in METRICS:
        lines.append(m.ljust(24) + "".join(cell(results[l].get(m)).rjust(width) for l in labels))
    return "\n".join(lines)


def results_json(results: dict, details: dict, data: str, n: int, conversations: int | None = None,
                 turns: str | None = None, **extra) -> str:
    """The results file: `n` the scored decisions (each model's `n`, its records' count: one a conversation, or one a
    trained assistant turn with `--turns all`), `conversations` the conversations they come from, `turns` which turns
    were scored, `models` label -> metrics, `examples` label -> records. The top-level `n` was the conversations,
    each model's the decisions: under `--turns all`, 5 and 12 in one file."""
    head = {"data": str(data), "n": n, **({"conversations": conversations} if conversations is not None else {}),
            **({"turns": turns} if turns is not None else {})}
    return strict_json.dumps({**head, "models": results, "examples": details, **extra}, indent=2, ensure_ascii=False)


def describe_stop(error: BaseException) -> str:
    if isinstance(error, SignalExit):
        return f"stopped by {signal.Signals(error.signum).name}"
    return str(error) or type(error).__name__


def partial_path(out: Path) -> Path:
    """Where a stopped run's finished work goes beside `--json` (`<name>.partial.json`)."""
    return out.with_name(f"{out.stem}.partial{out.suffix or '.json'}")


def published(out: Path, text: str) -> bool:
    """Whether `out` holds `text`: the complete results were published, whatever interrupted the rest."""
    try:
        return out.read_text(encoding="utf-8") == text
    except (OSError, ValueError):
        return False


def remove_stale_partial(out: Path) -> None:
    """A complete run's results supersede an earlier stopped run's `<name>.partial.json`: left beside them, a reader
    (or a script globbing the folder) took the old, smaller numbers for this run's. Only a file we wrote (a results
    object with `failed`) is removed, and said so."""
    path = partial_path(out)
    try:
        stale = isinstance(obj := json.loads(path.read_text()), dict) and "failed" in obj
    except (OSError, ValueError):
        return
    if stale:
        path.unlink(missing_ok=True)
        print(f"removed {path} (an earlier stopped run's results; {out} now holds the complete ones)", file=sys.stderr)


def keep_partial(results: dict, details: dict, args, convs: list[dict], failed: str, error: BaseException) -> None:
    """Print the finished models' table and, with --json, write them beside it as `<name>.partial.json`
    (never the --json file itself: a reader of that file expects every model asked for). The examples the failed
    model answered before it stopped (`error.partial`, `partial_scores`) are in the table as its own column and in
    the file under `failed` (`completed`, `metrics`, `examples`, and `answered`: their numbers, when not the first k):
    an endpoint failing at example 150 of 200 lost 149, a local model stopped in its last batch lost them all."""
    partial = getattr(error, "partial", None)
    table, stop = dict(results), {"model": failed, "error": describe_stop(error)}
    if partial:
        metrics, records, idx = partial
        k, n = metrics["n"], len(build_cases(convs, args.turns))
        which = f"first {k}" if idx == list(range(k)) else str(k)
        table[f"{failed} ({which} of {n})"] = metrics
        stop.update(completed=k, metrics=metrics, examples=records)
        if which != f"first {k}":
            stop["answered"] = [i + 1 for i in idx]
    print(format_table(table))
    print(f"{failed} failed: the table above holds the models finished before it"
          + (f" and {which} of its {n} examples" if partial else ""), file=sys.stderr)
    if args.json:
        path = partial_path(Path(args.json))
        write_text_atomic(path, results_json(results, details, args.data, len(build_cases(convs, args.turns)),
                                             len(convs), args.turns, failed=stop))
        print(f"wrote {path}", file=sys.stderr)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m gemma_tpu.evaluate", __doc__, config="YAML run config (data.* rendering settings; "
                   "model.dtype, default float32 for --model, a --checkpoint's training dtype)",
                   config_keys=("data", "model.dtype"))
    # --print-config evaluates nothing: it needed --data and a model only to print the config and exit
    needed = "--print-config" not in argv
    p.add_argument("--data", required=needed, type=cli.input_path_of("data file"),
                   help="JSONL of tool-calling conversations (e.g. data/fitness/test.jsonl)")
    which = p.add_mutually_exclusive_group(required=needed)
    which.add_argument("--model", type=cli.input_path_of("model directory"),
                       help="base or merged HF directory (or hub id / embedded:NAME)")
    which.add_argument("--checkpoint", type=cli.input_path_of("checkpoint directory"),
                       help="gemma-tpu checkpoint directory (base + LoRA)")
    which.add_argument("--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    which.add_argument("--compare", nargs=2, metavar=("A", "B"),
                       help="two of model:DIR, checkpoint:DIR[@STEP], endpoint:URL[#MODEL] (#MODEL: that side's "
                            "served model, else --served-model's)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--served-model", help="model name for --endpoint (default: the first the server lists)")
    # a vLLM server started with an API key (serving.launch with server.api_key_env) answered every request 401
    # the three --endpoint options default to None so that one given with only local models is refused (a
    # `--model DIR --timeout 30` ran with no limit at all, the option silently unused); ENDPOINT_DEFAULTS fills them
    p.add_argument("--api-key-env",
                   help="environment variable holding the --endpoint API key, sent when set (default: VLLM_API_KEY)")
    p.add_argument("--timeout", type=cli.SECONDS, help="seconds an --endpoint request may take (default 300)")
    p.add_argument("--retries", type=int, help=f"--endpoint: {RETRIES_HELP}")
    # of conversations (the data's rows): under --turns all one gives an example for each trained assistant turn
    p.add_argument("--limit", type=int,
                   help="evaluate the first N conversations (rows of --data); the rows after them are not read")
    p.add_argument("--turns", choices=TURNS, default="first",
                   help="score each conversation's first trained assistant turn, or every one after the reference "
                        "conversation before it (multi-turn chats; default: first)")
    p.add_argument("--json", type=cli.output_path_of("JSON file"),
                   help="write metrics and per-example predictions here")
    # with the prefix cache a row prefills only its suffix, and decoding (memory-bound on the weights) serves
    # 32 rows for little more than 8: on the 270M, 200 test conversations 3.3x faster than uncached batches of 8
    p.add_argument("--batch-size", type=int, default=32,
                   help="conversations generated (and scored for the eval loss) together, locally")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens each answer may generate at most (max_tokens of an --endpoint request)")
    p.add_argument("--no-loss", action="store_true", help="skip the teacher-forced eval loss")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: the prefix all prompts share is computed once)")
    return p.parse_args(list(argv))


ENDPOINT_DEFAULTS = {"api_key_env": "VLLM_API_KEY", "timeout": 300.0, "retries": DEFAULT_RETRIES}


def endpoint_only(args: argparse.Namespace, specs: list[Spec]) -> None:
    """Refuse --timeout/--retries/--api-key-env when no model is a server (they were silently unused), then fill
    in the defaults of those not given."""
    given = [name for name in ENDPOINT_DEFAULTS if getattr(args, name) is not None]
    if given and not any(spec.kind == "endpoint" for spec in specs):
        option = "--" + given[0].replace("_", "-")
        local = "--compare names none" if args.compare else f"not --{specs[0].kind}"
        raise UserError(f"{option} applies to --endpoint (and endpoint: specs of --compare), {local}")
    for name, default in ENDPOINT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def main(argv: Sequence[str] | None = None, *, compare_one_model: bool = False) -> int:
    """`compare_one_model`: let `--compare` name one model twice (benchmarks/eval_compiles.py does, on purpose: one
    compilation serves both sides); users are refused, as that scored one model twice, the second labelled "(2)"."""
    args = parse_args(argv or [])

    cli.setup_logging(logging.WARNING)
    cfg = cli.run_config(args, required=False)
    if cfg is None:
        return 0
    # a checkpoint runs in its training dtype unless model.dtype is given (the override was ignored: always that)
    args.checkpoint_dtype = cfg.model.dtype if "model.dtype" in keys_given(args.config, args.overrides) else None
    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit {args.limit}: must be positive")  # which value, as --batch-size says it
    for option, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value <= 0:  # was "--batch-size and --max-new-tokens must be positive", whichever it was
            raise UserError(f"{option} {value}: must be positive")
    if args.retries is not None and args.retries < 0:
        raise UserError(f"--retries {args.retries}: must be 0 or more")
    if args.step is not None and (args.model or args.endpoint):
        raise UserError("--step applies to --checkpoint (and checkpoint: specs of --compare), not "
                        f"{'--model' if args.model else '--endpoint'}")
    # a local model has no served name: `--model DIR --served-model coach` evaluated DIR, the name unused
    if args.served_model is not None and (args.model or args.checkpoint):
        raise UserError("--served-model applies to --endpoint (and endpoint: specs of --compare), not "
                        f"{'--model' if args.model else '--checkpoint'}")
    check_results_file(args.json, {"--data": args.data, "--config": args.config}, results_key="models")
    # the format alone: each model reads the test set again with its own markup before any loads (its tokenizer's, or
    # every family's for an endpoint); Gemma 3's here refused a Gemma 4's text (`<start_of_image>`) as markup
    convs = load_conversations(args.data, cfg.data, Markup(()), limit=args.limit)
    lm = next((c for c in convs if "text" in c), None)
    if lm is not None:  # nothing to prompt with or score against
        raise UserError(f"{lm['where']}: a language-modeling 'text' row; evaluation scores the assistant turns of "
                        f"chats (messages, prompt-completion, ShareGPT or instruction rows)")
    check_answered(convs)
    if args.compare:
        specs = [parse_spec(s, args.step, args.served_model) for s in args.compare]
        if args.step is not None and not any(s.kind == "checkpoint" for s in specs):
            raise UserError(f"--step {args.step} applies to checkpoint: specs, and --compare names none")
        if args.served_model is not None and not any(s.kind == "endpoint" and not s.own_name for s in specs):
            raise UserError(f"--served-model {args.served_model} applies to endpoint: specs without their own "
                            f"#MODEL, and --compare names none")
        if not compare_one_model and same_model(*specs):
            raise UserError(f"--compare names one model twice ({specs[0].label}, {specs[1].label}): give two models "
                            f"to compare (to score one, pass it alone)")
    elif args.model:
        specs = [Spec("model", args.model)]
    elif args.checkpoint:
        specs = [Spec("checkpoint", args.checkpoint, args.step)]
    else:
        specs = [Spec("endpoint", args.endpoint, None, args.served_model)]
    endpoint_only(args, specs)
    if len(specs) > 1:
        for which, spec in zip(("A", "B"), specs):
            try:
                check_spec(spec, args.timeout, api_key_from_env(args.api_key_env), args.retries)
            except UserError as e:  # said of model.path or a checkpoint dir: name the argument that gave it
                raise UserError(f"--compare {which} ({spec.label}): {e}") from None
    if not args.no_prefix_cache and any(spec.kind != "endpoint" for spec in specs):
        prefix_cache_bytes_set()  # a bad $GEMMA_TPU_PREFIX_CACHE_BYTES refused before a model loads
    for which, spec in zip(("A", "B") if len(specs) > 1 else ("",), specs):  # every model's, before any loads
        try:
            if spec.kind != "endpoint":
                check_before_load(spec, convs, cfg, args)
            else:
                # read again with every family's control tokens (read first for the format alone): the server's
                # tokenizer is not known here, and a Gemma 4's `<|turn>` in a message opened a turn of its own there.
                # Here, not when the endpoint's turn comes: --compare A B refused it after A's whole run
                load_conversations(args.data, cfg.data, served_markup(), args.limit)
        except UserError as e:
            raise (UserError(f"--compare {which} ({spec.label}): {e}") if which else e) from None
    results, details = {}, {}
    # SIGTERM (a preempted machine) and SIGHUP (the terminal closed) keep the finished models' results as Ctrl-C
    # does; they used to end the process at once, losing them
    with stop_signals_raise():
        for spec in specs:
            label = spec.label if spec.label not in results else f"{spec.label} (2)"
            try:
                results[label], details[label] = evaluate_spec(spec, convs, cfg, args)
            except (Exception, KeyboardInterrupt, SignalExit) as e:
                if results or getattr(e, "partial", None):  # the work done is kept (minutes of it each model)
                    keep_partial(results, details, args, convs, label, e)
                raise
    print(format_table(results))
    for label, records in details.items():  # format errors a larger --max-new-tokens would not have made
        cut = sum(r["kind"] == "format_error" and (r["error"] or "").startswith(CUT_OFF) for r in records)
        if cut:
            print(f"note: {label}: {cut} of its format errors are calls cut off at --max-new-tokens "
                  f"{args.max_new_tokens} (their records' error says so); raise it to score them", file=sys.stderr)
    if not any(c.reference for c in build_cases(convs, args.turns)):
        print(f"note: {args.data} has no reference tool call; the tool rows only say whether a model called a tool "
              f"unasked (the answer_* rows, eval_loss and perplexity judge the answers; answers are cut at "
              f"--max-new-tokens {args.max_new_tokens})", file=sys.stderr)
    if args.json:
        out = Path(args.json)
        text = results_json(results, details, args.data, len(build_cases(convs, args.turns)), len(convs), args.turns)
        try:
            write_text_atomic(out, text)
        finally:  # a Ctrl-C or SIGTERM once the complete file is published left the older partial beside it
            if published(out, text):
                remove_stale_partial(out)
        print(f"wrote {out}", file=sys.stderr)
    return 0

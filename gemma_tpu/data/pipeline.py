"""From files to batches with grain: tokenize once, pad or pack, shuffle per epoch, shard per process.

The train iterator is a grain `DatasetIterator`; its state (a small dict) is stored in every
checkpoint, so a resumed run continues with exactly the batch it would have seen next.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from gemma_tpu.core.config import DataConfig
from gemma_tpu.core.errors import UserError, shown
from gemma_tpu.data import batching
from gemma_tpu.data.prefixes import PrefixReport, find_shared_prefixes
from gemma_tpu.data.records import is_url, load_conversations, not_found_hint
from gemma_tpu.data.render import Renderer, resolve_chat_format

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """A tokenized split, cut into static rows."""

    source: str
    rows: list[list[batching.Item]] = dataclasses.field(repr=False)
    report: batching.FitReport
    max_loss: int
    seq_len: int
    strategy: str = "pad"
    prefixes: PrefixReport | None = None  # shared prompt prefixes (data.share_prefix: auto), laid out as trees
    _digest: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def digest(self) -> str:
        """A short hash of the rows in order (ids, loss masks, shared-prefix layout): a stored data position
        names rows of this list, so a resume checks that the list is the same. Computed once."""
        if self._digest is None:
            self._digest = self._hash_rows()
        return self._digest

    def _hash_rows(self) -> str:
        h = hashlib.sha256()
        for row in self.rows:
            h.update(b"|")
            for item in row:
                if isinstance(item, batching.Tree):
                    h.update(b"T%d" % item.prefix_len)
                for ex in batching.members(item):
                    h.update(np.ascontiguousarray(ex.ids, np.int32).tobytes())
                    h.update(np.packbits(np.asarray(ex.loss_mask, bool)).tobytes())
        return h.hexdigest()[:16]

    def row_arrays(self, i: int) -> dict[str, np.ndarray]:
        return batching.build_row(self.rows[i], self.seq_len, self.max_loss)

    def loss_tokens(self) -> int:
        """Loss-bearing tokens that fit the loss buffer (what is actually trained)."""
        return sum(min(batching.row_loss_count(r), self.max_loss) for r in self.rows)

    def real_tokens(self) -> int:
        """Non-padding tokens of all rows: what a pass over the split computes (a shared prefix once per row)."""
        return sum(batching.item_size(item) for r in self.rows for item in r)

    def trees(self) -> int:
        return sum(isinstance(item, batching.Tree) for r in self.rows for item in r)

    def useful_fraction(self) -> float:
        """Loss-bearing tokens / all row tokens (padding included)."""
        return self.loss_tokens() / max(len(self.rows) * self.seq_len, 1)

    def nonpad_fraction(self) -> float:
        """Non-padding tokens / all row tokens."""
        return self.real_tokens() / max(len(self.rows) * self.seq_len, 1)

    def stats(self) -> dict[str, Any]:
        """Counts and fractions for reports (inspect, benchmarks, logs)."""
        rep = self.report
        lengths = np.asarray(rep.lengths or [0])
        pct = {f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 95, 99)}
        return {
            "source": self.source, "strategy": self.strategy, "seq_len": self.seq_len,
            "examples_read": rep.read, "examples_kept": rep.kept, "truncated": rep.truncated,
            "dropped": rep.dropped, "dropped_no_loss": rep.no_loss, "overlength": rep.overlength,
            "duplicates": rep.duplicates,
            "length_min": int(lengths.min()), **pct, "length_max": int(lengths.max()),
            "length_mean": round(float(lengths.mean()), 1),
            "rows": len(self.rows), "tokens": self.real_tokens(), "loss_tokens": self.loss_tokens(),
            "row_tokens": len(self.rows) * self.seq_len,
            "nonpad_fraction": round(self.nonpad_fraction(), 4), "useful_fraction": round(self.useful_fraction(), 4),
            "examples_per_row": round(rep.kept / max(len(self.rows), 1), 3), "max_loss": self.max_loss,
            "trees": self.trees(),
            "computed_tokens_per_example": round(self.real_tokens() / max(rep.kept, 1), 1),
            # the kept examples as trained (truncated), one a forward: over every read example, untruncated, it
            # counted dropped and cut-off tokens, and the training log and --dry-run credited sharing with them
            "computed_tokens_per_example_unshared": round(
                sum(len(ex.ids) for r in self.rows for ex in batching.row_examples(r)) / max(rep.kept, 1), 1),
            "shared_prefixes": self.prefixes.stats() if self.prefixes is not None else None,
        }


def make_renderer(tokenizer, data_cfg: DataConfig, family_chat_format: str = "gemma",
                  token_map: dict[str, str] | None = None, vocab_size: int | None = None) -> Renderer:
    """`vocab_size`: the model's, when known: ids past it are refused (see `Renderer`)."""
    fmt = resolve_chat_format(tokenizer, data_cfg.chat_format, family_chat_format)
    return Renderer(tokenizer, fmt, data_cfg.loss_on, token_map=token_map, vocab_size=vocab_size)


def render_error(e: UserError, conv: dict, path: str) -> UserError:
    """A rendering error named with the example's FILE:LINE, once (the template renderer names it itself)."""
    where = conv.get("where") or path
    return e if str(e).startswith(f"{where}:") else UserError(f"{where}: {e}")


SKEW_SAMPLE = 64  # chats of a file compared with the tokenizer's template (a Jinja render each)


def template_skew_warning(convs: list[dict], renderer: Renderer, path: str) -> str | None:
    """One line when the first chats of a file (`Renderer.compares_with_template`) render otherwise than the
    tokenizer's own chat template renders them (None otherwise): training would teach text the served model is never
    shown."""
    checked, first, n = 0, None, 0
    for conv in convs:
        if checked == SKEW_SAMPLE:
            break
        if not renderer.compares_with_template(conv):
            continue
        checked += 1
        diff = renderer.template_difference(conv)
        if diff:
            n += 1
            first = first or f"{conv.get('where') or path}: {diff}"
    if not n:
        return None
    return (f"{path}: {n} of the first {checked} chats render otherwise than the tokenizer's own chat template, "
            f"which a server renders them with (the first: {first}); the model would be trained on text it is "
            f"not served: set data.chat_format=template to train on the template's rendering, or fix the data")


def render_examples(path: str, renderer: Renderer, data_cfg: DataConfig) -> list[batching.Example]:
    """Read, validate and render every example of a file (no length policy applied yet)."""
    out = []
    convs = load_conversations(path, data_cfg, renderer.markup)
    skew = template_skew_warning(convs, renderer, path)
    if skew:
        log.warning("%s", skew)
    joined: list[tuple[str, str]] = []
    for conv in convs:
        try:
            r = renderer.render(conv, max_tokens=data_cfg.seq_len)
        except UserError as e:  # what the chat format cannot carry, named with the example's line
            raise render_error(e, conv, path) from None
        out.append(batching.Example(r.ids, r.loss_mask, conv.get("where", ""), r.partial))
        if r.joined is not None:
            joined.append((conv.get("where") or path, r.joined))
    if joined:
        log.warning("%s", joined_warning(joined, len(out), path))
    return out


def joined_warning(joined: list[tuple[str, str]], n: int, path: str) -> str:
    """One line on the examples whose trained text starts inside a token of the text before it (`Rendered.joined`):
    their ids equal what a chat template and the tokenizer give the whole conversation, but a served model is given
    its prompt tokenized apart, and generates from there."""
    where, token = joined[0]
    # whitespace joins an answer's leading newlines to its turn's; a word, the start of an answer a prompt gives
    # (TRL's continue_final_message rows) cut inside it
    fix = ("strip the answers' leading whitespace" if not token.strip() else
           "end the start of the answer a prompt gives where a word ends")
    return (f"{path}: {len(joined)} of {n} examples have an answer whose first token also holds the end of the "
            f"prompt before it (the first: {where}, token {token!r}); a server tokenizes the prompt apart from the "
            f"answer, so the model is trained on a token it is never served there: {fix}")


def prepare_examples(examples: list[batching.Example], source: str, data_cfg: DataConfig, seed: int,
                     max_loss: int | None = None, strategy: str | None = None) -> Prepared:
    """Apply the over-length policy and cut rows (pad: one example a row; pack: first-fit)."""
    kept, report = batching.fit_length(examples, data_cfg.seq_len, data_cfg.overlength, source)
    if not kept:
        # under truncate an over-length example is cut, not dropped: counting it as both over-length and
        # loss-free said "dropped 3: 3 over-length, 3 with no loss-bearing token left"
        cut = report.overlength if data_cfg.overlength == "truncate" else 0
        # a very long text is tokenized only as far as seq_len reaches (`partial`): its length is a lower bound (a 50 MB
        # line said "the shortest of them 1626 tokens")
        over = [ex for ex in examples if len(ex.ids) > data_cfg.seq_len]
        shortest = min(over, key=lambda ex: len(ex.ids)) if over else None
        longer = (f"; {report.overlength} longer than data.seq_len, the shortest of them "
                  f"{'at least ' if shortest.partial else ''}{len(shortest.ids)} tokens" if shortest else "")
        # the smallest seq_len that keeps some example's first loss-bearing token: what to raise it to
        firsts = [int(np.flatnonzero(ex.loss_mask)[0]) + 1 for ex in examples if ex.loss_mask.any()]
        need = (f"; data.seq_len={min(firsts)} or more trains some of them" if cut and firsts
                and min(firsts) > data_cfg.seq_len else "")
        raise UserError(f"{source}: no usable examples after applying data.seq_len={data_cfg.seq_len} "
                        f"(read {report.read}, dropped {report.dropped}: {report.overlength - cut} over-length, "
                        f"{report.no_loss} with no loss-bearing token left{' after truncation' if cut else ''}"
                        f"{longer}{need})")
    strategy = strategy or data_cfg.strategy
    rng = np.random.default_rng(seed)
    if strategy == "pack":
        # rows are fixed for the run; which examples share a row is seeded, the row order is the stream's
        order = rng.permutation(len(kept))
        kept = [kept[i] for i in order]
    items: list[batching.Item] = list(kept)
    prefixes = None
    if data_cfg.share_prefix == "auto":
        # examples sharing a prompt prefix become trees [P | S1 | S2 ...]; which members share a
        # row is seeded (a group's members come sorted by their ids: similar requests side by side)
        prefixes = find_shared_prefixes(kept, data_cfg.share_prefix_min_tokens, data_cfg.seq_len)
        groups = [(g.prefix_len, [g.members[i] for i in rng.permutation(len(g.members))])
                  for g in prefixes.groups]
        items = batching.make_trees(kept, groups, data_cfg.seq_len)
    rows = batching.make_rows(items, data_cfg.seq_len, strategy)
    m = max_loss or batching.loss_buffer_size(rows, data_cfg.seq_len, data_cfg.max_loss_tokens)
    over = sum(1 for r in rows if batching.row_loss_count(r) > m)
    if over:
        log.warning("%s: %d rows have more than data.max_loss_tokens=%d targets; the excess is not trained",
                    source, over, m)
    return Prepared(source, rows, report, m, data_cfg.seq_len, strategy, prefixes)


def overlength_warning(prepared: Prepared, policy: str) -> str | None:
    """One line on what data.overlength did, when any example was longer than data.seq_len (None otherwise):
    a cut answer trains the model to stop mid-sentence, and dropped examples are data the user paid for."""
    rep = prepared.report
    if not rep.overlength:
        return None
    did = (f"{rep.truncated} truncated (trained up to the cut), {rep.dropped} dropped"
           f"{f' ({rep.no_loss} with no loss-bearing token before the cut)' if rep.no_loss else ''}")
    return (f"{prepared.source}: {rep.overlength} of {rep.read} examples are longer than data.seq_len="
            f"{prepared.seq_len} (the first: {rep.first_overlength}); data.overlength={policy}: {did}; "
            f"raise data.seq_len or see `python -m gemma_tpu.data.inspect`")


def duplicates_warning(prepared: Prepared) -> str | None:
    """One line when examples repeat earlier ones exactly (None otherwise): rows exported twice train twice."""
    rep = prepared.report
    if not rep.duplicates:
        return None
    return (f"{prepared.source}: {rep.duplicates} of {rep.read} examples train exactly what an earlier one trains "
            f"(the first: {rep.first_duplicate}); they are trained as often as they appear - remove them unless "
            f"that is meant")


def overlap_warning(train: Prepared, evaluation: Prepared | None) -> str | None:
    """One line when evaluation examples are also training examples (None otherwise): the validation loss then
    measures memorisation, not generalisation (an eval split sampled from the training file, or the same file)."""
    if evaluation is None:
        return None
    shared = shared_examples(train, evaluation)
    if not shared:
        return None
    return (f"{evaluation.source}: {len(shared)} of {evaluation.report.kept} evaluation examples are also training "
            f"examples in {train.source} (the first: {shared[0].where}); the validation loss measures how well they "
            f"were memorised")


def shared_examples(train: Prepared, evaluation: Prepared) -> list[batching.Example]:
    """The evaluation examples that are also training examples, by line (rows are shuffled)."""
    seen = {batching.example_key(ex) for row in train.rows for item in row for ex in batching.members(item)}
    shared = [ex for row in evaluation.rows for item in row for ex in batching.members(item)
              if batching.example_key(ex) in seen]

    def line(ex: batching.Example) -> int:
        w = ex.where.rsplit(":", 1)[-1]
        return int(w) if w.isdigit() else 0

    return sorted(shared, key=line)


def epochs_warning(prepared: Prepared, batch_size: int, grad_accum_steps: int, num_epochs: int | None,
                   max_steps: int) -> str | None:
    """One line when data.num_epochs ends the stream before train.max_steps (None otherwise): the run then
    stopped early without a word, its learning-rate schedule sized for steps it never takes."""
    if num_epochs is None:
        return None
    steps = len(prepared.rows) * num_epochs // batch_size // max(1, grad_accum_steps)  # TrainStream's batches
    if steps >= max_steps:
        return None
    return (f"{prepared.source}: data.num_epochs={num_epochs} of {len(prepared.rows)} rows is {steps} optimizer steps "
            f"of train.batch_size={batch_size}{f' x {grad_accum_steps} micro-batches' if grad_accum_steps > 1 else ''}"
            f", fewer than train.max_steps={max_steps}: the run ends at step {steps} with the learning-rate "
            f"schedule sized for {max_steps}; set train.max_steps={steps} (or data.num_epochs=null)")


def prepare_split(path: str, renderer: Renderer, data_cfg: DataConfig, seed: int, max_loss: int | None = None,
                  strategy: str | None = None) -> Prepared:
    return prepare_examples(render_examples(path, renderer, data_cfg), path, data_cfg, seed, max_loss, strategy)


def check_data_file(data_cfg: DataConfig, key: str) -> None:
    """data.`key`'s file exists, or a one-line error naming the key and, for a relative path, the working directory
    it is read from (configs/*.yaml name files from the repository's root, not their own): training, its dry run and
    `gemma_tpu.data.inspect` (which said 'data file not found: tests/data/chat_sample.jsonl' alone) alike."""
    path = getattr(data_cfg, key)
    if path and not Path(path).exists():
        where = "" if Path(path).is_absolute() or is_url(path) else \
            f"; a relative path is read from the working directory, {Path.cwd()}"
        raise UserError(f"data file not found: {path}{not_found_hint(path)} (data.{key}{where})")


def prepare_splits(renderer: Renderer, data_cfg: DataConfig, seed: int,
                   batch_size: int) -> tuple[Prepared, Prepared | None]:
    """The training split (filling one batch at least) and the evaluation split, as training and its dry run
    read them: a missing file of either is named before the other is read (minutes for a large set)."""
    for key in ("train_path", "eval_path"):
        check_data_file(data_cfg, key)
    train = prepare_split(data_cfg.train_path, renderer, data_cfg, seed)
    check_one_batch(train, batch_size)  # before the model loads
    return train, (prepare_split(data_cfg.eval_path, renderer, data_cfg, seed) if data_cfg.eval_path else None)


def check_one_batch(prepared: Prepared, batch_size: int) -> None:
    """The training split fills at least one batch: the one check that training, its dry run and
    `gemma_tpu.data.inspect` make (a stream of fewer rows has no batch to give)."""
    n, kept = len(prepared.rows), prepared.report.kept
    if n < batch_size:
        # what puts several examples in a row, when one example a row would fill a batch
        alt = [] if kept < batch_size else [k for k, on in (("data.strategy=pad", prepared.strategy == "pack"),
                                                             ("data.share_prefix=off", prepared.trees())) if on]
        hint = f", set {' and '.join(alt)} (one example a row)," if alt else ""
        raise UserError(f"data.train_path={prepared.source}: {n} rows (from {kept} examples, "
                        f"data.strategy={prepared.strategy}) are fewer than one batch of "
                        f"train.batch_size={batch_size}; lower train.batch_size{hint} or add examples")


class _RowArrays:
    """The map function of the stream, with a short repr: grain takes the repr of its transforms,
    and a bound method of Prepared would print every row's arrays (seconds per thousand rows)."""

    def __init__(self, prepared: Prepared):
        self.prepared = prepared

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        return self.prepared.row_arrays(i)

    def __repr__(self) -> str:
        return f"row_arrays({self.prepared.source!r}, {len(self.prepared.rows)} rows of {self.prepared.seq_len})"


class TrainStream:
    """Seeded, per-epoch shuffled, per-process sharded batches with a checkpointable position.

    The row order is one global stream: rows shuffled (with a new permutation each epoch, folded
    from the seed by grain), epochs concatenated. Global batch k is rows `[k*B, (k+1)*B)` of that
    stream and process i reads every `process_count`-th of them from offset i, so a run on P hosts
    trains on exactly the batches a one-host run sees, the hosts' rows are disjoint, and their union
    over an epoch is the whole split. With a finite `num_epochs` the last partial global batch is
    dropped (every host then has the same number of batches); without, the stream never ends.
    """

    def __init__(self, prepared: Prepared, batch_size: int, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, process_index: int = 0, process_count: int = 1):
        import grain

        if process_count < 1 or not 0 <= process_index < process_count:
            raise UserError(f"process_index={process_index} is not in [0, {process_count})")
        if batch_size % process_count:
            raise UserError(f"train.batch_size={batch_size} must be divisible by the {process_count} processes")
        if num_epochs is not None and num_epochs < 1:
            raise UserError(f"data.num_epochs must be positive or null, got {num_epochs}")
        check_one_batch(prepared, batch_size)
        n = len(prepared.rows)
        self.global_batch = batch_size
        self.local_batch = batch_size // process_count
        self.layout = stream_layout(prepared, batch_size, seed, shuffle, num_epochs)
        self.process_index, self.process_count = process_index, process_count
        ds = grain.MapDataset.range(n)
        if shuffle:
            ds = ds.shuffle(seed=seed % 2**32)
        ds = ds.repeat(num_epochs)
        if num_epochs is not None:
            ds = ds[: len(ds) - len(ds) % batch_size]  # last partial global batch dropped
        ds = ds[process_index::process_count]
        self.index_dataset = ds  # row indices in the order this process reads them
        ds = ds.map(_RowArrays(prepared))
        ds = ds.batch(self.local_batch, drop_remainder=True)
        self.dataset = ds
        self.iterator = iter(ds)
        self.prepared = prepared

    @property
    def batches_per_epoch(self) -> float:
        return len(self.prepared.rows) / self.global_batch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)

    def get_state(self) -> dict[str, Any]:
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any], layout: dict[str, Any] | None = None, where: str = "checkpoint") -> None:
        """Continue from a stored position; `layout`, stored beside it, must match (`check_layout`)."""
        check_layout(layout, self.layout, where, position(state, where))
        self.iterator.set_state(state)


def stream_layout(prepared: Prepared, batch_size: int, seed: int, shuffle: bool = True,
                  num_epochs: int | None = None) -> dict[str, Any]:
    """What a stored data position means, stored beside it: the rows in order and how the stream walks
    them. The process count is not part of it (global batch k is the same rows on any number of hosts)."""
    return {"rows": len(prepared.rows), "rows_digest": prepared.digest(), "train.batch_size": batch_size,
            "train.seed": seed, "data.shuffle": shuffle, "data.num_epochs": num_epochs}


def position(state: Any, where: str = "checkpoint") -> int | None:
    """Global batches a stored data position (`TrainStream.get_state`) has read; None where none is stored. Anything
    else (`where`'s record hand-edited or rewritten) is refused in one line: grain took {"next_index": 3.0} and the
    run died at its first batch in a traceback, and `{}` or a negative index failed once the model had loaded."""
    if state is None:
        return None
    index = state.get("next_index") if isinstance(state, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise UserError(f"{where}: its data position {shown(state)} is not one the trainer writes "
                        f"({{'next_index': <batches read>}}; the step's _CHECKPOINT_METADATA was edited or damaged); "
                        f"move the step aside to resume from the one before")
    return index


def check_layout(saved: dict[str, Any] | None, current: dict[str, Any], where: str,
                 read: int | None = None, settings: Sequence[str] = ()) -> None:
    """A position saved with `saved` (`read`: the global batches it had read, `position`) names other rows than
    `current` would: refused, naming what changed (checkpoints from before layouts were stored have none and are
    not checked). `data.num_epochs` may change: the stream's first batches are the same whatever the number of
    epochs (a run that used up its one epoch was refused another), unless the position is past the new end.
    `settings`: the data settings known to differ from the saving run's ("data.seq_len 192 -> 256"), named as what
    may have changed the rows' contents."""
    if saved is not None and not isinstance(saved, dict):  # an AttributeError traceback in _check_same_rows
        raise UserError(f"{where}: its data layout {shown(saved)} is not one the trainer writes (a mapping; the "
                        f"step's _CHECKPOINT_METADATA was edited or damaged); move the step aside to resume from the "
                        f"one before")
    if saved is not None and saved != current:
        _check_same_rows(saved, current, where, settings)
    epochs = current.get("data.num_epochs")
    if read is not None and epochs is not None and read > current["rows"] * epochs // current["train.batch_size"]:
        raise UserError(f"{where}: its data position is past the end of data.num_epochs={epochs} (batch {read} of "
                        f"{current['rows'] * epochs // current['train.batch_size']}); resume with more epochs or "
                        f"data.num_epochs=null")


def _check_same_rows(saved: dict[str, Any], current: dict[str, Any], where: str,
                     settings: Sequence[str] = ()) -> None:
    ignored = {"rows_digest", "data.num_epochs"}
    if saved.get("data.shuffle") is False and current.get("data.shuffle") is False:
        ignored.add("train.seed")  # unshuffled, the seed orders nothing (the rows it packs together are in the digest)
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in current.items() if k not in ignored and saved.get(k) != v]
    if not changed and saved.get("rows_digest") == current["rows_digest"]:
        return
    if saved.get("rows_digest") != current["rows_digest"]:
        if "train.seed" in ignored and saved.get("train.seed") != current.get("train.seed"):
            changed.append(f"train.seed {saved.get('train.seed')} -> {current.get('train.seed')}, which orders nothing "
                           f"unshuffled but chooses which examples share a row")
        # a changed data.seq_len came out as "rows 56 -> 53; the rows' contents", naming no key
        changed.append(f"the rows' contents: {', '.join(settings)}" if settings else "the rows' contents" if changed
                       else "the rows' contents: the data file, the tokenizer or a data setting that shapes rows")
    raise UserError(f"{where}: its data position is for other training rows ({'; '.join(changed)}); resume with "
                    f"the data and settings it was saved with, or use another checkpoint.dir")


def eval_fingerprint(prepared: Prepared, batch_size: int, max_batches: int | None = None) -> str:
    """What an evaluation of `eval_batches(prepared, batch_size, max_batches)` measured: its rows' digest and how
    many of them it covered. A training run records it in its eval records; a resume whose step was evaluated on
    other data (another data.eval_path, seq_len, tokenizer or data.eval_max_batches) evaluates it again."""
    covered = min(len(prepared.rows), max_batches * batch_size) if max_batches else len(prepared.rows)
    return f"{prepared.digest()}:{covered}"


def eval_batches(prepared: Prepared, batch_size: int, max_batches: int | None = None, process_index: int = 0,
                 process_count: int = 1, token_weighted: bool = False) -> list[dict[str, np.ndarray]]:
    """Every eval row once, in file order; the last batch is completed with weightless empty rows.

    With several processes each returns its share of every global batch (rows `i::process_count`),
    so the global eval batch is `batch_size` rows and every host has the same number of batches.
    `token_weighted`: each batch also carries `loss_scale` ([rows], float32, one value), its share of the
    loss weight over all batches times their number, so that the plain mean of the batches' mean losses (what
    Tunix's eval loop reports) is the mean over every loss token, as `gemma_tpu.evaluate` computes it: the
    same number whichever layout (padded, packed, shared-prefix rows) put the tokens into batches.
    """
    if batch_size % process_count:
        raise UserError(f"batch size {batch_size} must be divisible by the {process_count} processes")
    rows = [prepared.row_arrays(i) for i in range(len(prepared.rows))]
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    chunks = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        chunks.append(chunk + [empty] * (batch_size - len(chunk)))
        if max_batches and len(chunks) >= max_batches:
            break
    weights = [float(sum(r["loss_weights"].sum() for r in chunk)) for chunk in chunks]
    total = sum(weights)
    batches = []
    for chunk, weight in zip(chunks, weights):
        mine = chunk[process_index::process_count]
        batch = {k: np.stack([r[k] for r in mine]) for k in rows[0]}
        if token_weighted:
            scale = weight * len(chunks) / total if total > 0 else 1.0
            batch["loss_scale"] = np.full((len(mine),), scale, np.float32)
        batches.append(batch)
    return batches

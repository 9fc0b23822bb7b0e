"""From files to batches with grain: tokenize once, pad or pack, shuffle per epoch, shard per process.

The train iterator is a grain `DatasetIterator`; its state (a small dict) is stored in every
checkpoint, so a resumed run continues with exactly the batch it would have seen next.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator

import numpy as np

from gemma_tpu.config import DataConfig
from gemma_tpu.data import batching
from gemma_tpu.data.records import load_conversations
from gemma_tpu.data.render import Renderer
from gemma_tpu.errors import UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """A tokenized split, cut into static rows."""

    source: str
    rows: list[list[batching.Example]]
    report: batching.FitReport
    max_loss: int
    seq_len: int

    def row_arrays(self, i: int) -> dict[str, np.ndarray]:
        return batching.build_row(self.rows[i], self.seq_len, self.max_loss)

    def useful_fraction(self) -> float:
        total = len(self.rows) * self.seq_len
        return sum(batching.row_loss_count(r) for r in self.rows) / max(total, 1)

    def nonpad_fraction(self) -> float:
        total = len(self.rows) * self.seq_len
        return sum(len(ex.ids) for r in self.rows for ex in r) / max(total, 1)


def make_renderer(tokenizer, data_cfg: DataConfig, family_chat_format: str = "gemma",
                  token_map: dict[str, str] | None = None) -> Renderer:
    fmt = family_chat_format if data_cfg.chat_format == "auto" else data_cfg.chat_format
    return Renderer(tokenizer, fmt, data_cfg.loss_on, token_map=token_map)


def prepare_split(path: str, renderer: Renderer, data_cfg: DataConfig, seed: int, max_loss: int | None = None,
                  strategy: str | None = None) -> Prepared:
    convs = load_conversations(path, data_cfg)
    examples = []
    for conv in convs:
        r = renderer.render(conv)
        examples.append(batching.Example(r.ids, r.loss_mask))
    kept, report = batching.fit_length(examples, data_cfg.seq_len, data_cfg.overlength, path)
    if not kept:
        raise UserError(f"{path}: no usable examples after applying data.seq_len={data_cfg.seq_len} "
                        f"(read {report.read}, dropped {report.dropped})")
    strategy = strategy or data_cfg.strategy
    if strategy == "pack":
        order = np.random.default_rng(seed).permutation(len(kept))
        kept = [kept[i] for i in order]
    rows = batching.make_rows(kept, data_cfg.seq_len, strategy)
    m = max_loss or batching.loss_buffer_size(rows, data_cfg.seq_len, data_cfg.max_loss_tokens)
    over = sum(1 for r in rows if batching.row_loss_count(r) > m)
    if over:
        log.warning("%s: %d rows have more than data.max_loss_tokens=%d targets; the excess is not trained",
                    path, over, m)
    return Prepared(path, rows, report, m, data_cfg.seq_len)


class TrainStream:
    """Seeded, per-epoch shuffled, per-process sharded batches with a checkpointable position."""

    def __init__(self, prepared: Prepared, batch_size: int, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, process_index: int = 0, process_count: int = 1):
        import grain

        if batch_size % process_count:
            raise UserError(f"train.batch_size={batch_size} must be divisible by the {process_count} processes")
        local_batch = batch_size // process_count
        ds = grain.MapDataset.range(len(prepared.rows))
        ds = ds[process_index::process_count]
        if len(ds) < local_batch:
            raise UserError(f"{prepared.source}: {len(prepared.rows)} rows is fewer than one batch of "
                            f"{batch_size} (train.batch_size)")
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat(num_epochs)
        ds = ds.map(prepared.row_arrays)
        ds = ds.batch(local_batch, drop_remainder=True)
        self.dataset = ds
        self.iterator = iter(ds)
        self.prepared = prepared

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)

    def get_state(self) -> dict[str, Any]:
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.iterator.set_state(state)


def eval_batches(prepared: Prepared, batch_size: int, max_batches: int | None = None) -> list[dict[str, np.ndarray]]:
    """Every eval row once; the last batch is completed with weightless empty rows."""
    rows = [prepared.row_arrays(i) for i in range(len(prepared.rows))]
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        chunk += [empty] * (batch_size - len(chunk))
        batches.append({k: np.stack([r[k] for r in chunk]) for k in rows[0]})
        if max_batches and len(batches) >= max_batches:
            break
    return batches

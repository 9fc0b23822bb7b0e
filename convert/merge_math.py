"""The merge arithmetic, `W + s * B_hf @ A_hf` in float32, as a stream of output-dtype row chunks.

Each chunk is read, widened to fp32 into its own buffer, updated in place by one BLAS call
(`sgemm` with beta=1 accumulates straight into the buffer: no delta-sized temporary) and narrowed
to the output dtype. Chunks are computed by a small thread pool a bounded number ahead of the
writer, so reading, arithmetic and writing overlap while memory stays at a few chunks.

BLAS must run single-threaded here (the CLI sets OPENBLAS_NUM_THREADS=1 before numpy loads): with
rank 16 each product is tiny per row, and OpenBLAS's own threads, spinning on a busy 2-core machine,
made the merge far slower than one thread per chunk (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from gemma_tpu.core.errors import UserError
from gemma_tpu.hf import safetensors_io as sio

T = TypeVar("T")
R = TypeVar("R")

WORK_BYTES = 16 << 20  # fp32 bytes per chunk: big enough for BLAS, small enough for the cache


def add_lora_inplace(w: np.ndarray, b_scaled: np.ndarray, a: np.ndarray) -> None:
    """w (rows, in) fp32 += b_scaled (rows, r) @ a (r, in), in place."""
    try:
        from scipy.linalg import blas

        # Row-major w is column-major w.T = a.T @ b_scaled.T + w.T: sgemm writes into it directly.
        res = blas.sgemm(1.0, a.T, b_scaled.T, beta=1.0, c=w.T, overwrite_c=1)
        if np.shares_memory(res, w):
            return
        w[...] = res.T
    except ImportError:
        w += b_scaled @ a


def merged_rows(weights: sio.WeightsDir, name: str, a_hf: np.ndarray, b_hf: np.ndarray, scale: float,
                out_dtype: np.dtype, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the merged weight, in the output dtype."""
    raw = weights.read_rows(name, start, stop)
    w = np.empty(raw.shape, np.float32)
    np.copyto(w, raw, casting="unsafe")
    del raw
    add_lora_inplace(w, np.ascontiguousarray(b_hf[start:stop] * np.float32(scale)), a_hf)
    if w.dtype == out_dtype:
        return w
    out = np.empty(w.shape, out_dtype)
    with np.errstate(over="ignore"):  # values past float16's range: refused by name (check_float16_range)
        np.copyto(out, w, casting="unsafe")
    return out


def check_float16_range(chunk: np.ndarray, name: str, hint: str) -> None:
    """Narrowing to float16 turns values beyond +-65504 into inf: refused, naming the tensor, rather than
    written (a merged weight or export of infs, noticed by nothing but a --verify)."""
    if chunk.dtype == np.float16 and not np.isfinite(chunk).all():
        raise UserError(f"tensor {name} has values beyond float16's range (+-65504); {hint}")


def ordered_prefetch(pool: cf.Executor, fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[R]:
    """`map(fn, items)` in order, with at most `ahead` results computed before they are consumed."""
    pending: collections.deque = collections.deque()
    try:
        for x in items:
            pending.append(pool.submit(fn, x))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def lora_chunks(pool: cf.Executor, weights: sio.WeightsDir, name: str, a_hf: np.ndarray, b_hf: np.ndarray,
                scale: float, out_dtype: np.dtype, ahead: int = 2) -> Iterator[np.ndarray]:
    t = weights[name]
    ranges = list(sio.row_chunks(t.shape, 4, WORK_BYTES))
    return ordered_prefetch(pool, lambda r: merged_rows(weights, name, a_hf, b_hf, scale, out_dtype, *r),
                            ranges, ahead)


def make_pool() -> cf.ThreadPoolExecutor:
    workers = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    return cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="merge")

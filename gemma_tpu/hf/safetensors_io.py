"""Streaming safetensors: read an HF weights directory lazily, write sharded output incrementally.

Why our own reader/writer: `safetensors.numpy.save_file` (and Tunix's `safetensors_saver`, which
builds the whole merged state dict in memory and writes it as one file) need every tensor in memory
at once; a 4B model in bf16 is 8 GB. The format is simple enough to stream: an 8-byte little-endian
header length, a JSON header giving each tensor's dtype, shape and byte range, then the raw bytes.
The writer plans every shard's header from shapes and dtypes up front, writes it, then appends
tensors one at a time in plan order; the reader uses positioned reads (not a long-lived mmap, whose
touched pages would count towards RSS) so only the chunk in hand is resident.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from gemma_tpu.core.atomic import check_not_being_written, write_file
from gemma_tpu.core.errors import UserError

# safetensors dtype name <-> numpy dtype (bf16 and fp8 through ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = ("F16", "BF16", "F32")  # what --dtype converts between
# The weight dtypes read as the numbers they hold. An int8 (bitsandbytes), packed 4-bit or fp8 checkpoint of the
# same shapes was cast to float and trained on (or merged into, exported), its values without their scales.
WEIGHT_DTYPES = (*FLOAT_DTYPES, "F64")
# CLI / config.json names of the float dtypes
DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DTYPE_NAMES_INV = {v: k for k, v in DTYPE_NAMES.items()}

KICK_BYTES = 256 << 20  # start writeback every this many bytes, so the final fsync is short

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 64 << 20  # unit of streaming copies and casts


def is_computed_buffer(name: str) -> bool:
    """A tensor some writers save that is not a weight: RoPE's inverse frequencies (transformers' older models kept
    `rotary_emb.inv_freq` as a buffer), computed from config.json at load by transformers, Tunix and llama.cpp."""
    return name.endswith(".rotary_emb.inv_freq")


def st_dtype(dtype: np.dtype | str) -> str:
    """numpy dtype -> safetensors dtype name."""
    dt = np.dtype(dtype)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"dtype {dt} has no safetensors equivalent")


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '200KB' -> 2e5, '1GiB' -> 2**30 (decimal units as transformers uses them)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)  # "-1GB": < 0
    if not m:
        raise UserError(f"size {text!r}: expected a number with an optional unit (e.g. 5GB, 500MB, 1GiB)")
    value, unit = float(m.group(1)), m.group(2).upper()
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(unit)
    if scale is None:
        raise UserError(f"size {text!r}: unknown unit {m.group(2)!r}")
    size = int(value * scale)
    if size <= 0 and value > 0:  # "0.5" is half a byte: it said "must be positive", a rule it keeps
        hint = f"; give a unit (e.g. {text.strip()}GB)" if not m.group(2) else ""
        raise UserError(f"size {text!r} is {value * scale:g} bytes, less than one{hint}")
    if size <= 0:
        raise UserError(f"size {text!r} must be positive")
    return size


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in a safetensors file."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the data in `file`
    nbytes: int
    ident: tuple[int, ...] | None = None  # `file_ident` of the file whose header this came from (None: unchecked)

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    def check_same(self, st: os.stat_result) -> None:
        """Refuse to read this tensor from another file than the one its header came from (`st`: what is at
        `file` now). A reader reads each tensor by path, lazily: when another process published a new
        directory in its place meanwhile (a merge's --overwrite: a rename, the old one deleted), the reads
        after it took the new merge's bytes at the old header's offsets, and a GGUF export of `--merged DIR`
        mixed two merges without a word."""
        if self.ident is not None and file_ident(st) != self.ident:
            raise UserError(f"{self.file}: replaced while it was being read (another process published "
                            f"{self.file.parent} anew meanwhile, e.g. a merge's --overwrite); what was read would "
                            f"mix the two, so nothing was written: run again")


def file_ident(st: os.stat_result) -> tuple[int, ...]:
    """Which file, in which state: its device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, absolute offset of the data area) of one safetensors file."""
    header, base, _ = _read_header(path)
    return header, base


def _read_header(path: Path) -> tuple[dict, int, os.stat_result]:
    """`read_header`, and the stat of the file it was read from."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise UserError(f"{path}: implausible safetensors header length {n}")
        size = st.st_size
        if 8 + n > size:
            raise UserError(f"{path}: unreadable safetensors header (a truncated file: header of {n} bytes, file of "
                            f"{size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: unreadable safetensors header (a JSON {type(header).__name__}, not an object)")
    return header, 8 + n, st


def file_tensors(path: Path) -> tuple[list[TensorInfo], dict]:
    """Tensors of one file in data-offset order (the order they were written), and its metadata."""
    header, base, st = _read_header(path)
    meta = header.pop("__metadata__", None) or {}
    size, ident = st.st_size, file_ident(st)
    out = []
    for name, h in header.items():
        if not isinstance(h, dict):
            raise UserError(f"{path}: tensor {name} has no dtype, shape and data_offsets in the header")
        if h.get("dtype") not in DTYPES:
            raise UserError(f"{path}: tensor {name} has unsupported dtype {h.get('dtype')!r}")
        try:
            s, e = (int(x) for x in h["data_offsets"])
            shape = tuple(int(x) for x in h["shape"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: tensor {name} has a malformed shape or data_offsets in the header") from None
        if e - s != math.prod(shape) * DTYPES[h["dtype"]].itemsize or base + e > size:
            raise UserError(f"{path}: tensor {name} has an inconsistent byte range (truncated file?)")
        out.append(TensorInfo(name, h["dtype"], shape, path, base + s, e - s, ident))
    out.sort(key=lambda t: t.start)
    return out, meta


class WeightsDir:
    """The safetensors weights of an HF directory, read lazily, in the base's own order.

    Which files: the shards the index names, else every `*.safetensors` file. A `model.safetensors`
    beside an index naming other files is refused: transformers loads that file and ignores the
    index, vLLM loads the shards, so which weights a run trained on would depend on the reader.
    Order: shards in the order the index first mentions them (else file name order), tensors by
    their offset within each shard, which is the order their writer chose.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        check_not_being_written(self.dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{index}: not a valid safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise UserError(f"{index}: not a valid safetensors index (weight_map must map tensor names to "
                                f"file names)")
            files = list(dict.fromkeys(weight_map.values()))
            for f in files:
                if not (self.dir / f).is_file():
                    raise UserError(f"{index}: shard {f} is missing")
            if (self.dir / SINGLE_FILE).is_file() and files != [SINGLE_FILE]:
                raise UserError(f"{self.dir}: holds both {SINGLE_FILE} and {INDEX_FILE} naming other files "
                                f"(transformers loads the first, vLLM the second); remove the one that is stale")
            self.index_file: Path | None = index
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
            self.index_file = None
        if not files:
            raise UserError(f"{self.dir}: no *.safetensors weights (only safetensors are loaded)")
        self.files = [self.dir / f for f in files]
        self.tensors: dict[str, TensorInfo] = {}
        self.file_metadata: dict[str, dict] = {}
        for path in self.files:
            infos, meta = file_tensors(path)
            self.file_metadata[path.name] = meta
            for t in infos:
                if weight_map is not None and weight_map.get(t.name, path.name) != path.name:
                    continue  # the index is authoritative for where a key lives; one it omits is read from
                    # the shard holding it, as transformers and vLLM read every tensor of the listed shards
                if t.name in self.tensors:
                    raise UserError(f"{self.dir}: tensor {t.name} appears in two files")
                self.tensors[t.name] = t
        if weight_map is not None:
            missing = [k for k in weight_map if k not in self.tensors]
            if missing:
                raise UserError(f"{index}: tensor {missing[0]} is not in {weight_map[missing[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def names(self) -> list[str]:
        return list(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def require_float(self, names: Iterable[str], hint: str = "give the unquantized model") -> None:
        """Refuse, naming it, the first of `names` stored in another dtype than `WEIGHT_DTYPES`."""
        for name in names:
            if self.tensors[name].dtype not in WEIGHT_DTYPES:
                raise UserError(f"{self.dir}: weight '{name}' is {self.tensors[name].dtype}, not floating point (a "
                                f"quantized checkpoint's integer or fp8 weights mean nothing without their scales); "
                                f"{hint}")

    def read(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return read_bytes(t, 0, t.nbytes).view(t.np_dtype).reshape(t.shape)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) along the first axis, as a fresh array; a 0-dim tensor is its one "row" (0, 1),
        as `row_chunks` gives it (it was a reshape error: the row size of a scalar is not its size)."""
        t = self.tensors[name]
        if not t.shape:
            return self.read(name)
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
        return read_bytes(t, start * row, (stop - start) * row).view(t.np_dtype).reshape((stop - start, *t.shape[1:]))


def read_bytes(t: TensorInfo, offset: int, length: int) -> np.ndarray:
    """`length` bytes of tensor `t` from `offset`, by positioned reads into a fresh buffer."""
    buf = np.empty(length, np.uint8)
    view = memoryview(buf)
    fd = os.open(t.file, os.O_RDONLY)
    try:
        t.check_same(os.fstat(fd))
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], t.start + offset + done)
            if n <= 0:
                raise UserError(f"{t.file}: unexpected end of file reading {t.name}")
            done += n
    finally:
        os.close(fd)
    return buf


def row_chunks(shape: tuple[int, ...], itemsize: int, budget: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """Split the first axis into [start, stop) ranges of about `budget` bytes each."""
    if not shape:
        yield 0, 1
        return
    row = max(1, math.prod(shape[1:]) * itemsize)
    step = max(1, budget // row)
    for s in range(0, shape[0], step):
        yield s, min(shape[0], s + step)


# ------------------------------------------------------------------------------ writing


@dataclasses.dataclass(frozen=True)
class OutSpec:
    """A tensor to be written: name, safetensors dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def plan_shards(specs: list[OutSpec], max_shard_bytes: int) -> list[list[OutSpec]]:
    """Greedy, order-preserving: a new shard when the next tensor would overflow the current one
    (a tensor larger than the limit gets a shard of its own), as transformers does."""
    shards: list[list[OutSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_names(n: int, single: str = SINGLE_FILE) -> list[str]:
    if n == 1:
        return [single]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def encode_header(specs: list[OutSpec], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data area 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Writes tensors, in plan order, into `model.safetensors` or `model-0000i-of-0000n.safetensors`
    plus the index; at most one shard file is open and nothing is buffered beyond the chunk given.

    Use: `begin(name)`, then `write(chunk)` until the tensor's bytes are complete (`write_tensor`
    does both for an array already in memory); `close()` writes the index and checks completeness.
    """

    def __init__(self, out_dir: str | Path, specs: list[OutSpec], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None, fsync: bool = True, single_name: str = SINGLE_FILE):
        self.dir = Path(out_dir)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.fsync = fsync
        self.shards = plan_shards(specs, max_shard_bytes)
        self.files = shard_names(len(self.shards), single_name)
        self._order = [(i, s) for i, shard in enumerate(self.shards) for s in shard]
        self._next = 0  # index into _order of the tensor to begin next
        self._fd: int | None = None
        self._shard = -1
        self._current: OutSpec | None = None
        self._remaining = 0
        self._pos = 0  # bytes written to the open file
        self._kicked = 0  # bytes of it whose writeback has been started
        self._in_kernel = hasattr(os, "copy_file_range")

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for _, s in self._order)

    def weight_map(self) -> dict[str, str]:
        return {s.name: self.files[i] for i, s in self._order}

    def begin(self, name: str) -> OutSpec:
        if self._remaining:
            raise RuntimeError(f"{self._current.name}: {self._remaining} bytes not written")
        if self._next >= len(self._order):
            raise RuntimeError(f"{name}: not in the write plan (plan already complete)")
        shard, spec = self._order[self._next]
        if spec.name != name:
            raise RuntimeError(f"tensor {name} written out of order (expected {spec.name})")
        if shard != self._shard:
            self._close_file()
            self._shard = shard
            path = self.dir / self.files[shard]
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._pos = self._kicked = 0
            self._write_all(encode_header(self.shards[shard], self.metadata))
        self._next += 1
        self._current, self._remaining = spec, spec.nbytes
        return spec

    def write(self, chunk: np.ndarray | bytes | memoryview) -> None:
        if isinstance(chunk, np.ndarray):
            data = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        else:
            data = memoryview(chunk).cast("B")
        if len(data) > self._remaining:
            raise RuntimeError(f"{self._current.name}: {len(data)} bytes given, {self._remaining} expected")
        self._write_all(data)
        self._remaining -= len(data)

    def copy_from(self, src: TensorInfo) -> None:
        """Copy a tensor's bytes file-to-file in the kernel (copy_file_range), no user-space buffer;
        plain chunked reads where the kernel or filesystem cannot (EXDEV, ENOSYS, ...)."""
        if src.nbytes > self._remaining:
            raise RuntimeError(f"{self._current.name}: {src.nbytes} bytes given, {self._remaining} expected")
        fd_in = os.open(src.file, os.O_RDONLY)
        try:
            src.check_same(os.fstat(fd_in))
            done = 0
            while done < src.nbytes:
                n = 0
                if self._in_kernel:
                    try:
                        n = os.copy_file_range(fd_in, self._fd, min(src.nbytes - done, 1 << 30), src.start + done)
                    except OSError:  # a full disk too: the plain write below raises it, naming the shard
                        self._in_kernel = False
                if n > 0:
                    self._advance(n)
                else:
                    chunk = read_bytes(src, done, min(src.nbytes - done, CHUNK_BYTES))
                    self._write_all(memoryview(chunk))
                    n = len(chunk)
                done += n
        finally:
            os.close(fd_in)
        self._remaining -= src.nbytes

    def write_tensor(self, name: str, array: np.ndarray) -> None:
        spec = self.begin(name)
        if tuple(array.shape) != spec.shape or st_dtype(array.dtype) != spec.dtype:
            raise RuntimeError(f"{name}: got {array.shape} {array.dtype}, planned {spec.shape} {spec.dtype}")
        self.write(array)

    def close(self) -> None:
        if self._remaining or self._next != len(self._order):
            missing = self._current.name if self._remaining else self._order[self._next][1].name
            raise RuntimeError(f"writer closed before tensor {missing} was complete")
        self._close_file()
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map()}
            write_json(self.dir / INDEX_FILE, index, fsync=self.fsync)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                raise self._naming_shard(e) from None
            view = view[n:]
            self._advance(n)

    def _naming_shard(self, e: OSError) -> OSError:
        """`e` naming the shard being written: os.write and fsync name no file, and a full disk (or a file-size
        limit) was reported as "failed in <the temp dir>" alone."""
        if e.filename is None and self._shard >= 0:
            e.filename = str(self.dir / self.files[self._shard])
        return e

    def _advance(self, n: int) -> None:
        self._pos += n
        if self.fsync and self._pos - self._kicked >= KICK_BYTES:
            _start_writeback(self._fd, self._kicked, self._pos - self._kicked)
            self._kicked = self._pos

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if self.fsync:
                    os.fsync(fd)
            except OSError as e:  # a delayed write error (NFS, a full thin volume) comes back here
                raise self._naming_shard(e) from None
            finally:
                os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range to disk now, without waiting (Linux
    sync_file_range); the closing fsync then finds little left to do."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = fn
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_json(path: Path, obj, fsync: bool = False) -> None:
    """`obj` as indented JSON; a failed write names `path` (`write_file`)."""
    write_file(path, json.dumps(obj, indent=2) + "\n", fsync=fsync)


def cast_chunks(src: TensorInfo, out_dtype: str, budget: int = CHUNK_BYTES) -> Iterable[np.ndarray]:
    """The tensor's data converted to `out_dtype`, chunk by chunk (bounded memory)."""
    step = max(1, budget // 4 // src.np_dtype.itemsize * src.np_dtype.itemsize)
    for off in range(0, src.nbytes, step):
        raw = read_bytes(src, off, min(step, src.nbytes - off))
        yield raw.view(src.np_dtype).astype(np.float32).astype(DTYPES[out_dtype])

"""A cheap fingerprint of a base model's weights, so a checkpoint can tell whether the base it is merged
into (or resumed on, or exported for) is the one it was trained on.

Per file: its name and size; for each `*.safetensors` the SHA-256 of its header (names, dtypes, shapes,
offsets) and of 16 sampled 4 KiB ranges spread evenly over the tensor data; small JSON files
(`config.json`, the shard index) hashed whole. About 70 KiB read per shard whatever its size, so a 60 GB
model is fingerprinted in milliseconds on a local disk. It is not a full checksum: it catches another
model, another revision, a re-quantisation, a truncated or re-saved file, and a model of the same shapes
with other weights (the case that motivated it); it would miss an edit confined to bytes between samples.
With an index, only the shards it names are fingerprinted: readers ignore any other `*.safetensors` file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from gemma_tpu.core.errors import UserError

VERSION = 1
SAMPLES = 16
SAMPLE_BYTES = 4096
INDEX = "model.safetensors.index.json"
WHOLE_FILES = ("config.json", INDEX)


def _file_entry(path: Path) -> dict:
    size = path.stat().st_size
    entry: dict = {"name": path.name, "size": size}
    if path.suffix != ".safetensors":
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        return entry
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise UserError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        header = f.read(n)
        entry["header_sha256"] = hashlib.sha256(header).hexdigest()
        start, span = 8 + n, max(0, size - 8 - n - SAMPLE_BYTES)
        h = hashlib.sha256()
        fd = f.fileno()
        for i in range(SAMPLES):
            h.update(os.pread(fd, SAMPLE_BYTES, start + span * i // (SAMPLES - 1)))
        entry["samples_sha256"] = h.hexdigest()
    return entry


def _index_shards(model_dir: Path) -> set[str] | None:
    """The shards a readable `model.safetensors.index.json` names, else None. With an index, transformers and vLLM
    load those and ignore any other `*.safetensors` beside them (a stray or half-downloaded file), so the model is
    the same with or without one: fingerprinting it refused such a base even with --allow-base-mismatch (a damaged
    stray file has no header to hash) and called a base with one added "not the base it was trained on". A damaged
    index is hashed whole as before (and refused by name by the weights' reader)."""
    try:
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return {f for f in weight_map.values() if isinstance(f, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def fingerprint(model_dir: str | Path) -> dict:
    """{"version", "files": [{"name", "size", "header_sha256", "samples_sha256"} | {"name", "size", "sha256"}]}:
    the safetensors files a reader loads (the index's shards, else every one) and `WHOLE_FILES`."""
    model_dir = Path(model_dir)
    shards = _index_shards(model_dir)
    names = sorted(p.name for p in model_dir.glob("*.safetensors") if shards is None or p.name in shards)
    names += [n for n in WHOLE_FILES if (model_dir / n).is_file()]
    return {"version": VERSION, "files": [_file_entry(model_dir / n) for n in names]}


def first_difference(recorded: dict, model_dir: str | Path) -> str | None:
    """A description of the first file of `model_dir` that differs from `recorded`, or None."""
    model_dir = Path(model_dir)
    shards = _index_shards(model_dir)
    # a file that no index shard is (recorded before the fingerprint skipped those) is not read either
    want = {e["name"]: e for e in recorded.get("files", [])
            if shards is None or not e["name"].endswith(".safetensors") or e["name"] in shards}
    now = {e["name"]: e for e in fingerprint(model_dir)["files"]}
    for name, was in want.items():
        path = model_dir / name
        if name not in now:
            return f"{path} is missing"
        cur = now[name]
        if cur["size"] != was.get("size"):
            return f"{path} is {cur['size']} bytes, was {was.get('size')}"
        for key, what in (("sha256", "content"), ("header_sha256", "tensor header"),
                          ("samples_sha256", "tensor data")):
            if key in was and cur.get(key) != was[key]:
                return f"{path}: {what} differs"
    extra = [n for n in now if n not in want]
    if extra:
        return f"{model_dir / extra[0]} was not part of the base at training time"
    return None


def check_base(recorded: dict | None, model_dir: str | Path, allow: bool, override_hint: str, warn) -> None:
    """Refuse a base that no longer matches the recorded fingerprint (UserError naming the first differing
    file) unless `allow`; `warn(msg)` for runs that recorded none and for allowed mismatches."""
    if not recorded:
        warn(f"the checkpoint recorded no fingerprint of its base (an older run); cannot check that "
             f"{model_dir} is the base it was trained on")
        return
    diff = first_difference(recorded, model_dir)
    if diff is None:
        return
    msg = f"base {model_dir} is not the base this checkpoint was trained on ({diff})"
    if allow:
        warn(f"{msg}; going on as asked")
        return
    raise UserError(f"{msg}; {override_hint} to use it anyway")


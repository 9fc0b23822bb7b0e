"""Lazy access to one step's `model_params`: names, shapes and dtypes from Orbax's metadata (no
data read), and the data of chosen tensors through Orbax's partial restore, straight to host numpy.

The one reader of `model_params`: the merger holds one tensor (or one layer's factors) at a time, and
`gemma_tpu.checkpoint.metadata.read_params` asks it for every param of a step at once (right for LoRA
factors, and for restoring a model). Names are flat and dotted: `layers.0.attn.q_einsum.w_lora_a`,
`embedder.input_embedding`. Every tensor read is checked finite.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from gemma_tpu.core.errors import UserError


_LORA_NAME = re.compile(r".*_lora_[ab]$")


def is_lora_name(name: str) -> bool:
    """A LoRA factor's flat name (`layers.0.attn.q_einsum.w_lora_a`), as a LoRA run's step holds them."""
    return bool(_LORA_NAME.match(name))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    path: tuple[str, ...]  # key path in the Orbax tree (includes nnx's trailing 'value')

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class CheckpointParams:
    """The params of `<ckpt_dir>/<step>/model_params`."""

    def __init__(self, ckpt_dir: str | Path, step: int):
        import orbax.checkpoint as ocp

        # absolute: Orbax's metadata() quietly returns no tree for a relative path
        self.path = Path(ckpt_dir).resolve() / str(step) / "model_params"
        check_item_files(self.path)
        # Orbax warns that the item dir has no _CHECKPOINT_METADATA (the step dir has it); noise.
        logging.getLogger("absl").setLevel(logging.ERROR)
        self._ckptr = ocp.PyTreeCheckpointer()
        try:
            meta = self._ckptr.metadata(self.path)
        except Exception as e:  # corrupt or foreign directory
            self._ckptr.close()
            if not self.path.parent.exists():
                raise step_deleted(self.path.parent) from None
            raise UserError(f"{self.path}: unreadable Orbax metadata ({type(e).__name__}: {e})") from None
        item = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        tree = getattr(item, "tree", item)
        if not isinstance(tree, dict) or not tree:
            self._ckptr.close()  # else Orbax's background loop prints tracebacks at exit
            raise UserError(f"{self.path}: Orbax finds no tensor metadata here (an incomplete or foreign step)")
        self.specs: dict[str, ParamSpec] = {}
        self._walk(tree, ())

    def _walk(self, node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                self._walk(v, path + (str(k),))
            return
        name = ".".join(p for p in path if p != "value")
        self.specs[name] = ParamSpec(name, tuple(int(x) for x in node.shape), np.dtype(node.dtype), path)

    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def holds_lora_factors(self) -> bool:
        """LoRA factors (`..._lora_a` / `..._lora_b`, a LoRA run's save) rather than a full fine-tune's params."""
        return any(is_lora_name(n) for n in self.specs)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Restore just these tensors (one Orbax partial restore) as host numpy arrays."""
        import jax
        import orbax.checkpoint as ocp

        names = list(names)
        if not names:
            return {}
        item: dict = {}
        restore_args: dict = {}
        for n in names:
            spec = self.specs[n]
            node_i, node_r = item, restore_args
            for k in spec.path[:-1]:
                node_i = node_i.setdefault(k, {})
                node_r = node_r.setdefault(k, {})
            node_i[spec.path[-1]] = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
            node_r[spec.path[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
        try:
            restored = self._ckptr.restore(
                self.path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
            )
        except Exception as e:  # a data file missing or cut short (tensorstore/Orbax raise ValueError & co)
            if not self.path.parent.exists():
                raise step_deleted(self.path.parent) from None
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise UserError(f"{self.path}: cannot read tensor {names[0]}{more} ({short_reason(e)}); "
                            f"the step is incomplete or damaged") from None
        out = {}
        for n in names:
            node = restored
            for k in self.specs[n].path:
                node = node[k]
            out[n] = require_finite(np.asarray(node), n, self.path)
        return out

    def read_one(self, name: str) -> np.ndarray:
        return self.read([name])[name]


def require_finite(value: np.ndarray, name: str, where) -> np.ndarray:
    """`value`, unless a floating-point tensor holds NaN/inf: then a one-line UserError naming it."""
    if np.issubdtype(value.dtype, np.floating) and value.size and not np.isfinite(value).all():
        bad = int(value.size - np.isfinite(value).sum())
        raise UserError(f"{where}: tensor {name} holds {bad} non-finite value{'s' if bad > 1 else ''} "
                        f"(NaN/inf); refusing to use it")
    return value


ITEM_FILES = ("_METADATA",)  # every Orbax PyTree item has it; OCDBT items also a manifest per writer


def check_item_files(path: Path) -> None:
    """The files an Orbax PyTree item cannot be read without, named when missing (one line)."""
    path = Path(path)
    if not path.parent.exists():
        raise step_deleted(path.parent)
    if not path.is_dir():
        raise UserError(f"{path}: missing (incomplete checkpoint step?)")
    missing = [path / n for n in ITEM_FILES if not (path / n).is_file()]
    writers = sorted(path.glob("ocdbt.process_*"))
    if writers and not (path / "manifest.ocdbt").is_file():
        missing.append(path / "manifest.ocdbt")
    for w in writers:
        missing += [w / n for n in ("manifest.ocdbt", "d") if not (w / n).exists()]
    if not missing:
        for root in ([path] if (path / "manifest.ocdbt").is_file() else writers):
            missing += _missing_ocdbt_data(root)
    if not missing:
        missing = [f for f in _json_files(path) if not _reads_as_json(f)]
    if missing:
        what = "truncated" if missing[0].is_file() else "missing"
        raise UserError(f"{missing[0]}: {what} (an incomplete or damaged checkpoint step"
                        f"{f'; {len(missing) - 1} more files missing or truncated' if len(missing) > 1 else ''})")


def _json_files(item: Path) -> list[Path]:
    """The JSON records Orbax reads before any array: the item's tree metadata, shardings and per-writer
    array metadata, and the step's own record. One cut short (a copy or a disk that filled) used to be a
    bare JSONDecodeError out of Orbax, naming no file."""
    files = [item / n for n in ("_METADATA", "_sharding")] + sorted(item.glob("array_metadatas/*"))
    return [f for f in files + [item.parent / "_CHECKPOINT_METADATA"] if f.is_file()]


def _reads_as_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def step_deleted(step_dir: Path) -> UserError:
    """A step that was listed as complete and then disappeared: in practice a trainer still running on the
    directory, which keeps only `checkpoint.max_to_keep` steps (the merge or export read it meanwhile)."""
    return UserError(f"{step_dir}: the step was deleted while being read (a trainer still running on "
                     f"{step_dir.parent} deletes steps beyond checkpoint.max_to_keep); run again for the latest "
                     f"step, or wait for the run to end")


def _missing_ocdbt_data(root: Path) -> list[Path]:
    """Data files (`d/<id>`) that an OCDBT database's latest version refers to and that are absent or
    shorter than the byte range it reads from them.

    Found by walking the B-tree with TensorStore's `ocdbt.dump` (node metadata only, no array data).
    Checked before Orbax restores: Orbax reads every array concurrently on an event loop that it closes
    at the first failed read, and the reads still in flight then print one traceback each as they land.
    """
    import tensorstore as ts

    try:
        kv = ts.KvStore.open(f"file://{root.resolve()}/").result()
        manifest = ts.ocdbt.dump(kv).result()
    except Exception:  # noqa: BLE001 - an unreadable manifest (cut short, overwritten): Orbax's metadata read
        return [root / "manifest.ocdbt"]  # would print a traceback per read still in flight (see above)
    ends: dict[Path, int] = {}
    missing: list[Path] = []
    pending = [v["root"]["location"] for v in manifest.get("versions", [])[-1:] if v.get("root", {}).get("location")]
    seen: set[str] = set()
    while pending:
        loc = pending.pop()
        if loc in seen:
            continue
        seen.add(loc)
        file, end = _ocdbt_location(root, loc)
        ends[file] = max(ends.get(file, 0), end)
        if not loc.startswith("btreenode:"):
            continue
        if not file.is_file() or file.stat().st_size < end:
            continue  # reported below; its children cannot be listed
        try:
            node = ts.ocdbt.dump(kv, loc).result()
        except Exception:  # noqa: BLE001 - a damaged node: report its file
            missing.append(file)
            continue
        for entry in node.get("entries", []):
            for key in ("indirect_value", "node"):
                if isinstance(entry.get(key), str):
                    pending.append(entry[key])
            if isinstance(entry.get("location"), str):
                pending.append(entry["location"])
    for file, end in sorted(ends.items()):
        if (not file.is_file() or file.stat().st_size < end) and file not in missing:
            missing.append(file)
    return missing


def _ocdbt_location(root: Path, loc: str) -> tuple[Path, int]:
    """`kind:base_path:relative_path:offset:length` (TensorStore's dump notation) -> (file, end byte)."""
    _kind, base, rest = loc.split(":", 2)
    relative, offset, length = rest.rsplit(":", 2)
    return root / base / relative, int(offset) + int(length)


def short_reason(e: BaseException) -> str:
    """`e` in a line: its innermost direct cause that says something (Orbax wraps TensorStore's error, which names the
    tensor and the fault, in "Encountered error while reading array index: (slice(0, 128, 1), ...). See full
    TensorStore details: <bound method pybind11_...", which names neither), its type and first line, cut to 200."""
    while e.__cause__ is not None and str(e.__cause__).strip():
        e = e.__cause__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__

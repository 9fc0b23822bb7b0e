"""One reader of Hugging Face model directories: where the directory is (local, hub, embedded), its
config.json, its weight index and its hub revision."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from gemma_tpu.assets import embedded as assets
from gemma_tpu.core.config import is_url
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.hf.adapter import ADAPTER_CONFIG
from gemma_tpu.hf.files import WEIGHT_SUFFIXES

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_HUB_URL = re.compile(r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/([A-Za-z0-9][\w.-]*/[\w.-]+)(?:/.*)?")


def _missing(named: str, spec: str) -> str:
    """'NAMED: no such directory', with the hub id a model page's URL names (the address a browser shows was given),
    or what to do with another URL (a bucket's `gs://b/model`)."""
    page = _HUB_URL.fullmatch(spec.strip())
    if page:
        return f"{named}: no such directory (a Hugging Face page's URL: give the hub id, {page.group(1)})"
    if is_url(spec):
        return (f"{named}: a URL; the model is read from a directory of this machine (or a hub id): copy it here "
                f"(gcloud storage cp -r), or mount the bucket (gcsfuse BUCKET /mnt/BUCKET) and give the path under it")
    return f"{named}: no such directory"


def resolve_path(spec: str, revision: str | None = None, what: str = "model.path", weights: bool = False) -> Path:
    """Turn a local dir / hub id / embedded:NAME into a local directory; `what` names the setting in errors (the
    config key or the option; empty where the caller names it). `weights`: the model's weights are read (a base to
    merge into), so a hub snapshot must hold them (`_check_cached_weights`)."""
    if spec.startswith("embedded:"):
        return Path(assets.resolve_embedded(spec))
    named = f"{what} {spec}" if what else spec
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"{named}: not a directory{file_hint(p)}")
        return p
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                repo_id=spec,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"],
            )
        except Exception as e:  # network off, offline mode, gated or missing repo
            raise UserError(f"{named}: not a local directory and not downloadable from the hub "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if weights:
            _check_cached_weights(named, spec, Path(local))
        return Path(local)
    raise UserError(_missing(named, spec))


def _check_cached_weights(named: str, spec: str, local: Path) -> None:
    """The hub snapshot `local` holds the weights: offline (HF_HUB_OFFLINE=1, or the hub unreachable) the download
    returns whatever the cache holds, and one with config.json alone (what `hf download ID config.json` leaves, as
    `gemma_tpu.plan` suggests for its estimate) was taken for the base: 'not the base this checkpoint was trained
    on (.../model.safetensors is missing); pass --allow-base-mismatch', then 'no *.safetensors weights' with it."""
    index = local / "model.safetensors.index.json"
    missing = None
    if index.is_file():
        try:
            shards = sorted({f for f in json.loads(index.read_bytes())["weight_map"].values() if isinstance(f, str)})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # a damaged index: named by the weights' reader
        missing = next((f"{f} (a shard its model.safetensors.index.json names)" for f in shards
                        if not (local / f).is_file()), None)
    else:
        files = sorted(local.glob("*.safetensors"))
        broken = [p.name for p in files if not p.is_file()]  # a link to a blob never downloaded (or deleted)
        missing = (f"{broken[0]} (a link to nothing: {os.readlink(local / broken[0])})" if broken else
                   None if files else "*.safetensors weights")
    if missing:
        raise UserError(f"{named}: its copy in the Hugging Face cache, {local}, has no {missing}: a partial download "
                        f"(`hf download {spec} config.json`, or one cut short) that could not be completed here "
                        f"(offline: HF_HUB_OFFLINE, or the hub unreachable); download the whole model with the "
                        f"network on (`hf download {spec}`), or give a local directory")


def check_revision_applies(spec: str, local: Path, revision: str | None) -> None:
    """`model.revision` picks a hub revision to download; a local directory or an embedded model is used as it is.
    It was ignored without a word there, and recorded in the run's metadata as the base's revision. A hub
    snapshot directory (…/snapshots/<commit>) given with its own commit (or a prefix of it) is accepted."""
    if revision is None:
        return
    downloaded = not spec.startswith("embedded:") and not Path(spec).expanduser().exists()
    parts = Path(local).resolve().parts
    snapshot = parts[-1] if len(parts) >= 2 and parts[-2] == "snapshots" else None
    if downloaded or (snapshot and snapshot.startswith(revision)):
        return
    kind = "an embedded model" if spec.startswith("embedded:") else "a local directory"
    at = f" (a hub snapshot at commit {snapshot})" if snapshot else ""
    raise UserError(f"model.revision={revision} chooses what to download from the hub, but model.path {spec} is {kind}"
                    f"{at}, used as it is: leave model.revision unset, or give the hub id")


def dir_identity(model_dir: Path) -> tuple[int, int] | None:
    """Which published directory is at `model_dir` now: its device and inode. Every publish of a directory (a
    merge, an export: `gemma_tpu.core.atomic`) renames a new one into place, so this changes with it, while files
    merely read or added inside leave it alone. None where there is nothing there."""
    try:
        st = os.stat(model_dir)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_same_directory(model_dir: Path, ident: tuple[int, int] | None) -> None:
    """Refuse what was read from `model_dir` in several reads (config.json, the merge record, the tokenizer, the
    weights' headers) when another directory was published there since the first (`ident`, taken before it): a
    merge's --overwrite between reading config.json and the weights mixed two models without a word (each tensor
    read is checked against its header's file, `safetensors_io.TensorInfo.check_same`, but not the files around)."""
    if ident is not None and dir_identity(model_dir) != ident:
        raise UserError(f"{model_dir}: replaced while it was being read (another process published it anew "
                        f"meanwhile, e.g. a merge's --overwrite); its config.json, tokenizer and weights as read "
                        f"could mix two models, so it was not used: run again")


def read_hf_config(model_dir: Path) -> dict:
    if Path(model_dir).is_file():  # `x-merged/config.json` given for the directory: "config.json/config.json: missing"
        hint = f": give {Path(model_dir).parent}" if Path(model_dir).name == "config.json" else ""
        raise UserError(f"{model_dir}: a file, not a Hugging Face model directory{hint}")
    path = model_dir / "config.json"
    return read_json_object(path, f"{path}: missing ({training_run_hint(Path(model_dir))})")


# the record `convert.merge_orbax` writes into a merged directory; its `base.family` names the merged model's family
MERGE_RECORD = "gemma_tpu_merge.json"
# the record `convert.export_peft` writes into an adapter directory: the checkpoint it came from, its base's fingerprint
ADAPTER_RECORD = "gemma_tpu_adapter.json"
# the record a training run writes beside its Orbax steps (`gemma_tpu.checkpoint.metadata`)
RUN_RECORD = "gemma_tpu_run.json"


def gguf_hint(name: str) -> str:
    """What to do with a GGUF file given for a model: this project reads Hugging Face directories."""
    return (f"a GGUF file is not read here (Hugging Face safetensors directories are): convert it, e.g. transformers' "
            f"AutoModelForCausalLM.from_pretrained(DIR, gguf_file={name!r}).save_pretrained(OUT), with the original "
            f"model's tokenizer files (transformers derives a wrong one from a Gemma GGUF)")


def file_hint(p: Path) -> str:
    """Why a file given for a model directory is not one, and what to give instead: its directory for one of the
    directory's own files (config.json, a weights shard), a conversion for a GGUF."""
    if p.suffix.lower() == ".gguf":
        return f"; {gguf_hint(p.name)}"
    if p.suffix == ".json" or p.suffix.lower() in WEIGHT_SUFFIXES:
        return f" (a file of a model directory: give the directory, {p.parent})"
    return ""


def training_run_hint(model_dir: Path) -> str:
    """Why a directory without config.json is not a model, and what to do where it is a training run's checkpoint
    directory (or a run directory holding one): the commonest mix-up, `runs/x/checkpoints` given for a merged model."""
    for ckpt in (model_dir, model_dir / "checkpoints"):
        if (ckpt / RUN_RECORD).is_file():
            return (f"{ckpt} is a gemma-tpu training checkpoint, not a Hugging Face model directory: merge it first, "
                    f"python -m convert.merge_orbax --checkpoint {ckpt} --out DIR")
    if (model_dir / ADAPTER_CONFIG).is_file():  # an export_peft output given for a model (merge --base, gguf --merged)
        try:
            base = json.loads((model_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            base = None
        base = f"its base {base}" if isinstance(base, str) and base else "its base"
        return (f"{model_dir} is a PEFT adapter, not a whole model: give {base}, or a merged directory from "
                "python -m convert.merge_orbax")
    gguf = sorted(p.name for p in Path(model_dir).glob("*.gguf")) if Path(model_dir).is_dir() else []
    if gguf:
        return f"not a Hugging Face model directory; it holds {gguf[0]}: {gguf_hint(gguf[0])}"
    return "not a Hugging Face model directory"


@contextlib.contextmanager
def naming_config_file(path: Path | str):
    """The families' checks see config.json as a dict and say "config.json: rms_norm_eps='1e-6' is not ...": where the
    file is known, its path replaces that name (a run given several model directories said which one)."""
    try:
        yield
    except UserError as e:
        if not str(e).startswith("config.json: "):
            raise
        raise UserError(f"{path}: {str(e).removeprefix('config.json: ')}") from None


def recorded_family(model_dir: Path) -> str | None:
    """The family a merge recorded in its output directory (`base.family` of MERGE_RECORD); None without one.
    A base whose config.json names an architecture no family claims trains with model.family, and its merge keeps
    that config.json: the record is what says which family the merged model is."""
    path = Path(model_dir) / MERGE_RECORD
    if not path.is_file():
        return None
    base = read_json_object(path, f"{path}: missing").get("base")
    family = base.get("family") if isinstance(base, dict) else None
    return family if isinstance(family, str) and family else None


def safetensors_keys(model_dir: Path) -> dict[str, str]:
    """key -> file name of the weights transformers would load (`safetensors_io.WeightsDir`)."""
    from gemma_tpu.hf.safetensors_io import WeightsDir

    return {name: t.file.name for name, t in WeightsDir(model_dir).tensors.items()}


def hf_revision(model_dir: Path) -> str | None:
    """The hub commit of a snapshot directory (…/snapshots/<sha>), when there is one."""
    parts = Path(model_dir).resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return os.environ.get("GEMMA_TPU_BASE_REVISION")


# config.json copies of known hub models (data shipped with the model registry), for offline planning.
PRESETS_DIR = Path(__file__).resolve().parent.parent / "models" / "presets"


def preset_path(model_path: str) -> Path:
    """`org/name` -> gemma_tpu/models/presets/org--name.json (whether or not it exists); hub ids
    are case-insensitive (google/gemma-4-31B-it and google/gemma-4-31b-it are one repository)."""
    return PRESETS_DIR / (model_path.strip("/").replace("/", "--").lower() + ".json")


def config_json_for(model_path: str) -> dict:
    """config.json of `model_path` without loading (or downloading) weights, for offline planning.

    In order: a local directory's config.json; a prepared `embedded:NAME` model's (or its known
    config); the Hugging Face cache's copy for a hub id (no network); the shipped preset
    (`presets/<org>--<name>.json`). Anything else is a one-line UserError.
    """
    spec = str(model_path)
    local = Path(spec).expanduser()
    if local.is_dir():
        return read_json_object(local / "config.json", f"{local / 'config.json'}: missing (not a Hugging Face "
                                                        f"model directory)")
    if spec.startswith("embedded:"):
        name = spec[len("embedded:"):]
        entry = assets.get_model(name)
        target = assets.target_dir(name)
        if assets.is_complete(target):
            return read_json_object(target / "config.json", f"{target}/config.json: missing")
        if entry.expected_config:
            return dict(entry.expected_config)
        raise UserError(f"{spec}: not prepared yet and no known config; run "
                        f"`python -m gemma_tpu.assets prepare {name}` first")
    if _HUB_ID.match(spec):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(spec, "config.json")
        except Exception:  # no hub library or a malformed cache: fall through to the presets
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            return read_json_object(Path(cached), f"{cached}: unreadable")
        preset = preset_path(spec)
        if preset.is_file():
            return read_json_object(preset, f"{preset}: unreadable")
        known = ", ".join(sorted(p.stem.replace("--", "/") for p in PRESETS_DIR.glob("*.json")))
        # the family (or whether one of ours covers it at all) is in config.json, which is not on this machine
        raise UserError(f"{spec}: no local directory, no cached config.json and no preset, so its architecture is "
                        f"unknown offline: fetch its config.json (`hf download {spec} config.json` puts it in the "
                        f"Hugging Face cache read here) or give the path of a local directory holding it (presets: "
                        f"{known})")
    raise UserError(_missing(f"model.path {spec}", spec))  # as the run (resolve_path) names it

"""The non-weight files of an output HF directory: config, generation config, tokenizer.

A merged model must be servable as is: config.json states the dtype actually written,
generation_config.json stops on the end-of-turn token (chat fine-tunes end every answer with it, and
a config listing only `<eos>` makes vLLM/transformers run on to the length limit), and the tokenizer
files travel with the weights. Everything else at the top level of the base is copied too (licence,
README, processor configs), except weights and weight indexes, which the writer produces, and a PEFT
adapter's config: beside full weights it makes transformers load the directory as that adapter on its base.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

from gemma_tpu.core.atomic import write_file
from gemma_tpu.core.errors import UserError, read_json_object

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")


# a PEFT adapter's description: a directory holding it is loaded by transformers (with peft installed) as that
# adapter on the base it names, not as the weights beside it
ADAPTER_FILES = ("adapter_config.json",)


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


# A multimodal config's sub-configs: every tower's weights are written in the output dtype (the merge casts them all)
SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


def output_config(hf_config: dict, dtype_name: str) -> dict:
    """config.json with the output dtype (both the transformers 5 and the 4.x key), at the top level, in text_config
    and in any sub-config that states one: a vision_config still saying bfloat16 over float32 weights is what vLLM
    reads when the top level has none, and what a reader of the file takes the tower's dtype to be."""
    cfg = json.loads(json.dumps(hf_config))
    cfg["dtype"] = dtype_name
    cfg["torch_dtype"] = dtype_name
    for key in SUB_CONFIGS:
        sub = cfg.get(key)
        if isinstance(sub, dict) and (key == "text_config" or "dtype" in sub or "torch_dtype" in sub):
            sub["dtype"] = dtype_name
            sub["torch_dtype"] = dtype_name
    return cfg


def config_dtype(hf_config: dict) -> str | None:
    """The dtype config.json records for the weights (`dtype`, transformers 4.x's `torch_dtype`; a multimodal
    config's text_config otherwise), or None."""
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    for cfg in (hf_config, text):
        for key in ("dtype", "torch_dtype"):
            if isinstance(cfg.get(key), str):
                return cfg[key]
    return None


def generation_config(base_dir: Path, hf_config: dict, stop_ids: tuple[int, ...]) -> dict:
    """The base's generation config (or one from config.json) with every stop id in eos_token_id."""
    path = base_dir / "generation_config.json"
    gen = read_json_object(path, f"{path}: missing") if path.is_file() else {}
    text = hf_config.get("text_config") or hf_config
    for key in ("bos_token_id", "pad_token_id"):
        if key not in gen and text.get(key, hf_config.get(key)) is not None:
            gen[key] = text.get(key, hf_config.get(key))
    eos = gen.get("eos_token_id", text.get("eos_token_id", hf_config.get("eos_token_id")))
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else eos)
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise UserError(f"{path if path.is_file() else base_dir / 'config.json'}: eos_token_id must be a token id or "
                        f"a list of token ids, got {eos!r:.60}")
    eos = list(eos)
    for i in stop_ids:
        if i not in eos:
            eos.append(i)
    gen["eos_token_id"] = eos
    return gen


def sampling_defaults(model_dir: Path | None) -> dict:
    """The `top_k` and `top_p` the model's generation_config.json names, which vLLM applies to a sampled request that
    does not set them (its default `--generation-config auto`), so that a local sampled answer draws as the served
    one; {} where the file or the keys are absent. A top_k of 0 or less is no cut (vLLM's -1)."""
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    gen = read_json_object(path, f"{path}: missing")
    out: dict = {}
    top_k, top_p = gen.get("top_k"), gen.get("top_p")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise UserError(f"{path}: top_k must be a whole number, got {top_k!r:.40}")
        out["top_k"] = max(top_k, 0)
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise UserError(f"{path}: top_p must be a number above 0 and at most 1, got {top_p!r:.40}")
        out["top_p"] = float(top_p)
    return out


def copy_file(src: Path, dst: Path) -> None:
    """shutil.copyfile, whose write error (a full disk, a file-size limit) named the *source*: the merge said it failed
    in the base model's tokenizer.json; the file being written is named."""
    try:
        shutil.copyfile(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS):
            e.filename, e.filename2 = str(dst), None
        raise


def write_sidecar_files(base_dir: Path, out_dir: Path, hf_config: dict, dtype_name: str,
                        stop_ids: tuple[int, ...]) -> list[str]:
    """Write config.json and generation_config.json, copy the rest; return the names written. A write that fails
    (a full disk) names its file (`write_file`; Path.write_text's error named none)."""
    written = []
    for p in sorted(base_dir.iterdir()):
        if not p.is_file() or p.name.startswith(".") or is_weight_file(p.name) or p.name in ADAPTER_FILES:
            continue
        if p.name in ("config.json", "generation_config.json"):
            continue
        copy_file(p, out_dir / p.name)
        written.append(p.name)
    write_file(out_dir / "config.json", json.dumps(output_config(hf_config, dtype_name), indent=2) + "\n")
    gen = generation_config(base_dir, hf_config, stop_ids)
    write_file(out_dir / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    return sorted(written + ["config.json", "generation_config.json"])

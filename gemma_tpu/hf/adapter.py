"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), checked before another
program loads it: vLLM at a server's start (serving.config), peft in convert.verify. Both took what they could
not use quietly or failed late: vLLM refuses at load what peft accepts, peft warns about keys it cannot place
and goes on with the base's logits."""

from __future__ import annotations

import math
import re
from pathlib import Path

from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.hf.safetensors_io import file_tensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# what vLLM's LoRA loader (and peft) also read, pickled by torch: PEFT's save with safe_serialization=False
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")
# One module of transformers' multimodal classes, spelt two ways: checkpoints written before transformers 4.52
# name the decoder `language_model.model.`, the class (and PEFT's keys since) `model.language_model.`.
SAME_DECODER = ("language_model.model.", "model.language_model.")

# adapter_config.json keys of newer peft whose adapters mean something else than W + s B A on the base as served:
# vLLM (vllm/lora/peft_helper.py) refuses them at load in its newer releases; older ones dropped the key and
# served a plain LoRA, with other numbers than peft's
UNSERVED_FEATURES = {"lora_bias": "LoRA bias", "alora_invocation_tokens": "Activated LoRA (aLoRA)",
                     "layer_replication": "layer replication", "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
                     "use_qalora": "QALoRA"}
# init_lora_weights values that only set the starting factors (a saved adapter is then a plain LoRA); PiSSA, OLoRA,
# CorDA and LoftQ also change the base weights when peft loads the adapter
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")

# PEFT writes `base_model.model.` before the module path; vLLM also reads names without it
_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def read_adapter_config(adapter_dir: Path, where: str, for_vllm: bool = True) -> dict:
    """adapter_config.json with what vLLM's PEFT reader refuses at load (vllm/lora/peft_helper.py) refused here,
    each naming its key; `where` starts each message. `for_vllm=False` (peft, convert.verify) lets DoRA and
    modules_to_save through, which peft loads."""
    cfg = read_json_object(adapter_dir / ADAPTER_CONFIG, f"{where}: {adapter_dir} has no {ADAPTER_CONFIG}")
    if not any((adapter_dir / name).is_file() for name in (ADAPTER_WEIGHTS, *PICKLED_WEIGHTS)):
        raise UserError(f"{where}: {adapter_dir} has no {ADAPTER_WEIGHTS} (nor {' / '.join(PICKLED_WEIGHTS)})")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has no {key!r}")
    r = cfg["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise UserError(f"{where}: {ADAPTER_CONFIG} r={r!r} is not a positive integer")
    alpha = cfg["lora_alpha"]  # vLLM and peft scale by lora_alpha / r: a string ("16") failed in the loader
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} lora_alpha={alpha!r} is not a positive number")
    if for_vllm and cfg.get("use_dora"):
        raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has use_dora=true; vLLM serves no DoRA adapter "
                        "(merge it into the model instead)")
    if for_vllm and cfg.get("modules_to_save"):
        raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has modules_to_save={cfg['modules_to_save']!r}; "
                        "vLLM serves adapters without fully trained modules only (merge it into the model instead)")
    if for_vllm:
        for key, what in UNSERVED_FEATURES.items():
            if cfg.get(key):
                raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has {key}={cfg[key]!r}; vLLM serves no "
                                f"{what} adapter (merge it into the model instead)")
        init = cfg.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower() not in PLAIN_INITS:
            raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has init_lora_weights={init!r}, which changes "
                            "the base's weights when peft loads the adapter; vLLM serves the base unchanged (convert "
                            "it to a plain LoRA with peft's path_initial_model_for_weight_conversion, or merge it)")
    for key, what in (("rank_pattern", "rank"), ("alpha_pattern", "alpha")):
        # peft's per-module overrides: a module name pattern -> its rank / alpha (`pattern_value`)
        pattern = cfg.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} {key}={pattern!r:.60} is not an object of "
                            f"module patterns and their {what}s")
        for module, value in pattern.items():
            if isinstance(value, bool) or not isinstance(value, int if key == "rank_pattern" else (int, float)) \
                    or not value > 0:
                kind = "integer" if key == "rank_pattern" else "number"
                raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} {key}[{module!r}]={value!r:.40} is not a "
                                f"positive {kind}")
    bias = cfg.get("bias", "none")
    if bias not in ("none", None):  # Gemma's projections have no bias to train; vLLM refuses the adapter at load
        raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG} has bias={bias!r}; Gemma has no biases and vLLM "
                        "loads only bias=\"none\" adapters (set it to \"none\" if the adapter holds no bias tensors)")
    return cfg


def pattern_value(pattern: dict | None, module: str):
    """peft's per-module override (`rank_pattern`, `alpha_pattern`): the first key that matches the module name
    from a '.' boundary to its end; None if none does."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def largest_rank(cfg: dict) -> int:
    """The largest rank of an adapter_config.json (`read_adapter_config`): r, or a module's rank_pattern rank above
    it, which its lora_A / lora_B are saved at."""
    return max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()])


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def check_vllm_scaling(adapter_dir: Path, where: str, cfg: dict) -> None:
    """vLLM scales every module's update by the adapter's lora_alpha / r (vllm/lora/peft_helper.py, lora_weights.py:
    it reads neither `rank_pattern` nor `alpha_pattern`); peft scales each by its own alpha / rank. A module whose
    patterns give it another scale would be served with another update than the one trained."""
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if not (ranks or alphas) or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        return
    r, alpha, rslora = cfg["r"], cfg["lora_alpha"], bool(cfg.get("use_rslora"))
    served = _scale(alpha, r, rslora)
    for module in lora_pairs(adapter_dir, where, r, ranks):
        rank, a = pattern_value(ranks, module) or r, pattern_value(alphas, module) or alpha
        if not math.isclose(_scale(a, rank, rslora), served, rel_tol=1e-6):
            raise UserError(f"{where}: {adapter_dir}/{ADAPTER_CONFIG}'s rank_pattern / alpha_pattern give {module} "
                            f"rank {rank} and alpha {a:g}, an update scaled by {_scale(a, rank, rslora):g}, but vLLM "
                            f"scales every module by lora_alpha={alpha:g} over r={r} ({served:g}), reading neither "
                            "pattern: it would serve another model than the one trained (merge it into the model "
                            "instead)")


def lora_pairs(adapter_dir: Path, where: str, r: int,
               rank_pattern: dict | None = None) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """module path (as the model class names it) -> (lora_A shape, lora_B shape), each pair complete and of rank r
    (or the module's `rank_pattern` rank, which peft reads)."""
    path = adapter_dir / ADAPTER_WEIGHTS
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in file_tensors(path)[0]:
        m = _LORA_KEY.fullmatch(t.name)
        if m:
            pairs.setdefault(m["module"], {})[m["ab"]] = t.shape
    if not pairs:
        raise UserError(f"{where}: {path} holds no LoRA weights (lora_A / lora_B tensors)")
    out = {}
    for module, ab in sorted(pairs.items()):
        if len(ab) != 2:
            raise UserError(f"{where}: {path}: {module} has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        rank = pattern_value(rank_pattern, module) or r
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            said = f"r={r}" if rank == r else f"rank_pattern rank {rank}"
            raise UserError(f"{where}: {path}: {module} lora_A {list(a)} and lora_B {list(b)} are not "
                            f"[r, in] and [out, r] with {ADAPTER_CONFIG}'s {said}")
        out[module] = (a, b)
    return out


def adapter_modules(adapter_dir: Path, cfg: dict, where: str) -> list[str] | None:
    """The modules an adapter changes, as vLLM loads them: the path of each module its safetensors weights change
    (`model.layers.5.self_attn.k_proj`; vLLM reads the tensors, not target_modules, which peft also takes as a regex
    or as dotted tails such as `self_attn.k_proj`); over pickled weights (adapter_model.bin), which are not opened
    here, the target_modules list, None where they are a regex."""
    if (adapter_dir / ADAPTER_WEIGHTS).is_file():
        return list(lora_pairs(adapter_dir, where, cfg["r"], cfg.get("rank_pattern")))
    targets = cfg.get("target_modules")
    return list(targets) if isinstance(targets, list) else None


def module_names(modules) -> list[str]:
    """The last part of each module path (`q_proj`, ...), each once, in order."""
    return list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in modules))


def decoder_prefix(base: dict[str, tuple[int, ...]], prefixes) -> str | None:
    """Which of the family's decoder prefixes the base's weight names use (longest first: `model.` would also
    be a prefix of `model.language_model.`); None if no decoder layers are found."""
    for prefix in sorted(prefixes, key=len, reverse=True):
        if any(k.startswith(prefix + "layers.") for k in base):
            return prefix
    return None


def check_adapter_fits(adapter_dir: Path, where: str, r: int, base: dict[str, tuple[int, ...]],
                       prefixes, rank_pattern: dict | None = None) -> None:
    """Every decoder-layer LoRA pair of the adapter is placed on a weight of the base by its full module path, as
    PEFT and vLLM place it: A [r, in] and B [out, r] against the base's [out, in]. Matched by the last part of
    the name (`layers.0.self_attn.q_proj`), a multimodal base's vision tower (SigLIP has q_proj/k_proj/v_proj in
    `layers.N` too) fitted a text adapter it was not trained on; an adapter saved for a text-only class
    (`model.layers.`) on a multimodal base was taken, where PEFT and vLLM leave such keys unused. Pickled weights
    (adapter_model.bin), which vLLM and peft also read, were refused as "no adapter_model.safetensors"."""
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        return  # pickled weights (adapter_model.bin): not unpickled here, their shapes are left to the loader
    text = decoder_prefix(base, prefixes)
    spellings = SAME_DECODER if text in SAME_DECODER else (text,)
    for module, (a, b) in lora_pairs(adapter_dir, where, r, rank_pattern).items():
        if "layers." not in module:  # embeddings, lm_head: named differently across layouts, left to the loader
            continue
        site = module[module.rindex("layers."):]
        place = module[:-len(site)]
        if text is None or place not in spellings:
            have = f"its decoder layers are under {text!r}" if text else "it has no decoder layers"
            raise UserError(f"{where}: the adapter changes {module}, a module the base does not have ({have}; "
                            "an adapter of another model or model class?)")
        shape = base.get(f"{text}{site}.weight")
        if shape is None:
            raise UserError(f"{where}: the adapter changes {module}, which the base has no weight for "
                            "(an adapter of another model?)")
        if (b[0], a[1]) != tuple(shape):
            raise UserError(f"{where}: the adapter's update of {module} is [{b[0]}, {a[1]}], the base's weight "
                            f"is {list(shape)} (an adapter of another model?)")

"""A gemma-tpu checkpoint as the converters see it: metadata, step, family, and checked LoRA sites.

Everything here only reads metadata (JSON and Orbax's tensor metadata), so all validation happens
before a byte of output is written, and each problem is reported as one line naming the tensor.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from convert.mapping import (
    LoraSite,
    axis_sizes_from_factors,
    hf_shape,
    lora_sites,
    weight_shape,
)
from gemma_tpu.checkpoint.metadata import METADATA_FILE, read_metadata, resolve_step
from gemma_tpu.checkpoint.params import CheckpointParams
from gemma_tpu.checkpoint.restore import NoBaseModel, base_dir, check_recorded_targets, lora_config
from gemma_tpu.core.errors import UserError
from gemma_tpu.hf.directory import naming_config_file
from gemma_tpu.hf.fingerprint import check_base
from gemma_tpu.models.registry import (
    Family,
    Layout,
    Projection,
    choose_family,
    described_family,
    read_layout,
    supported_architectures,
    text_config,
    tied_embeddings,
)


@dataclasses.dataclass
class CheckpointSource:
    dir: Path
    step: int
    meta: dict
    family: Family
    hf_config: dict  # the base's config.json as recorded at training time
    layout: Layout  # the model shape the registry's projections need (see gemma_tpu.models.registry.Layout)
    params: CheckpointParams
    is_lora: bool = True  # LoRA factors (else a full fine-tune), as `gemma_tpu.checkpoint.restore.lora_config` says

    @property
    def lora(self) -> dict:
        return self.meta.get("lora") or {}

    @property
    def scale(self) -> float:
        return float(self.lora["alpha"]) / float(self.lora["rank"])

    @property
    def lora_dropout(self) -> float:
        run_lora = (self.meta.get("config") or {}).get("lora") or {}
        return float(run_lora.get("dropout") or self.lora.get("dropout") or 0.0)


def open_checkpoint(ckpt_dir: str | Path, step: int | None = None) -> CheckpointSource:
    ckpt_dir = Path(ckpt_dir)
    meta = read_metadata(ckpt_dir)  # missing dir / no metadata -> UserError
    step = resolve_step(ckpt_dir, step)
    base = meta.get("base_model") or {}
    hf_config = meta.get("hf_config")
    if not isinstance(hf_config, dict):
        raise UserError(f"{ckpt_dir}: metadata has no hf_config (the base's config.json)")
    try:
        family = choose_family(hf_config, base.get("family"), "family", "hf_config")
    except UserError as e:
        raise UserError(f"{ckpt_dir / METADATA_FILE}: base_model: {e}") from None
    params = CheckpointParams(ckpt_dir, step)
    # a LoRA run's rank, alpha and targets are all recorded, and the step holds what the metadata says
    lora = lora_config(ckpt_dir, meta, step, params.holds_lora_factors)
    try:
        layout = read_layout(hf_config, family)
    except UserError as e:  # the recorded copy, not the base's config.json, is the one to look at
        raise UserError(f"{ckpt_dir / METADATA_FILE}: hf_config (the base's config.json when it was trained): "
                        f"{str(e).removeprefix('config.json: ')}") from None
    if lora is not None:
        check_recorded_targets(ckpt_dir, family, layout, lora)
    source = CheckpointSource(ckpt_dir, step, meta, family, hf_config, layout, params, lora is not None)
    return source


def resolve_base(source: CheckpointSource, override: str | None = None, weights: bool = True) -> Path:
    """--base, else the base recorded at training time (see gemma_tpu.checkpoint.restore.base_dir; `weights`: False
    where only its tokenizer is read)."""
    try:
        return base_dir(source.dir, source.meta, override, weights)
    except NoBaseModel as e:
        raise UserError(f"{e}; pass --base") from None


def check_base_matches(source: CheckpointSource, base_dir: Path, allow: bool, tool: str) -> None:
    """The base about to be used is the one the checkpoint was trained on (by the fingerprint recorded
    at training time, gemma_tpu.hf.fingerprint); a mismatch is refused naming the first differing file
    unless --allow-base-mismatch."""
    import sys


    recorded = (source.meta.get("base_model") or {}).get("fingerprint")
    check_base(recorded, base_dir, allow, "pass --allow-base-mismatch",
               lambda msg: print(f"{tool}: warning: {msg}", file=sys.stderr))


# the config.json keys behind `Layout`'s fields (the others are named as the layout's)
_LAYOUT_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "embed_dim": "hidden_size", "head_dim": "head_dim",
                "hidden_dim": "intermediate_size"}


def check_base_layout(source: CheckpointSource, base_dir: Path, base_config: dict) -> None:
    """The base's config.json gives the model shape the checkpoint was trained with (its recorded hf_config): a
    merge publishes that config.json beside weights of the checkpoint's shapes, and one of another shape (edited,
    let through the fingerprint by --allow-base-mismatch, or a vocab_size left out: transformers' default) made a
    model transformers cannot load."""
    where = base_dir / "config.json"
    with naming_config_file(where):  # the families' checks say "config.json: ..."
        layout = read_layout(base_config, source.family)
        vocab = source.family.read_text_config(base_config).get("vocab_size")
    sizes = [(_LAYOUT_KEYS.get(f.name, f"the layer layout ({f.name})"), getattr(layout, f.name),
              getattr(source.layout, f.name)) for f in dataclasses.fields(Layout)]
    sizes.append(("vocab_size", vocab, source.family.read_text_config(source.hf_config).get("vocab_size")))
    for key, have, want in sizes:
        if have != want:
            omitted = " (it omits the key: transformers' default)" if key not in text_config(base_config) else ""
            raise UserError(f"{where}: {key}={have}{omitted}, the checkpoint was trained with {key}={want}; give the "
                            f"base it was trained on (--base)")


def check_base_model_type(source: CheckpointSource, base_dir: Path, base_config: dict) -> None:
    """The base's config.json, which a merge publishes, has the `model_type` transformers picks the model class by:
    one without it (or of another family's, its architecture a Gemma's) merged, and transformers could not load the
    output ('Unrecognized model ... Should have a `model_type` key'). An architecture no family claims keeps its own
    model_type."""
    where = base_dir / "config.json"
    have = base_config.get("model_type")
    want = source.family.model_types
    archs = base_config.get("architectures") or []  # claimed by a family (whose model_type it then contradicts)
    claimed = any(a in supported_architectures() for a in archs) or described_family(base_config, str(where))
    if not isinstance(have, str) or not have or (claimed and have not in want):
        what = "is missing" if have is None else f"is {have!r}"
        raise UserError(f"{where}: model_type {what}, so transformers cannot load the merged model (a "
                        f"{source.family.name} config.json has one of: {', '.join(want)}); fix it or give another "
                        f"base (--base)")


def check_base_weights(source: CheckpointSource, base_dir: Path, base_config: dict, prefix: str,
                       names: list[str]) -> None:
    """Every tensor of the model the base's config.json describes is in its weights `names` (the registry's
    `Family.required_weights`): a LoRA merge copies the tensors it does not change, and a base missing one (a copy
    cut short, an edit, let through the fingerprint by --allow-base-mismatch) was published without it, a model
    transformers fills in with initial values and serves without a word."""
    have = set(names)
    missing = [n for n in source.family.required_weights(base_config, prefix) if n not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{base_dir}: tensor {missing[0]}{more} of the model its config.json describes is missing "
                        f"from the weights; give the whole base (--base)")


def check_base_shapes(source: CheckpointSource, base_dir: Path, base_config: dict, prefix: str,
                      shapes: dict[str, tuple[int, ...]]) -> None:
    """The base's tensors that a merge copies (embeddings, norms: `Family.tensor_shapes`; an untied `lm_head`; the
    projections no LoRA targets: `Family.projection_shapes`) have the shapes its config.json gives them: one of
    another size (an edit, a copy of another model's file, let through the fingerprint by --allow-base-mismatch) was
    published, a model transformers refuses to load."""
    family = source.family
    t = family.read_text_config(base_config)
    want = {prefix + k: (v,) for k, v in (family.tensor_shapes(t) if family.tensor_shapes else {}).items()}
    embed = want.get(prefix + "embed_tokens.weight")
    if embed is not None and not tied_embeddings(base_config):
        want["lm_head.weight"] = embed
    projections = family.projection_shapes(t) if family.projection_shapes else {}
    for key, _, how in family.weight_sources(source.layout, prefix):
        if isinstance(how, Projection) and projections.get(how.hf_name):
            want[key] = projections[how.hf_name]  # its shapes across the layers (Gemma 4's global ones differ)
    for key, allowed in want.items():
        if key in shapes and tuple(shapes[key]) not in allowed:
            makes = " or ".join(str(list(s)) for s in allowed)
            raise UserError(f"{base_dir}: tensor {key} is {list(shapes[key])}, but its config.json makes it "
                            f"{makes}; give the base it was trained on (--base)")


def check_base_tower_shapes(source: CheckpointSource, base_dir: Path, base_config: dict,
                             shapes: dict[str, tuple[int, ...]]) -> None:
    """A multimodal base's vision (audio) tower and its projection, which a merge copies as they are, have the shapes
    its config.json's vision_config (audio_config) gives them (`Family.tower_shapes`): one of another shape (a tower
    copied from another model, an edited vision_config, let through the fingerprint by --allow-base-mismatch) was
    published, a model transformers refuses to load."""
    if source.family.tower_shapes is None:
        return
    for key, want in source.family.tower_shapes(base_config, list(shapes)).items():
        if tuple(shapes[key]) != tuple(want):
            raise UserError(f"{base_dir}: tensor {key} is {list(shapes[key])}, but its config.json makes it "
                            f"{list(want)}; give the base it was trained on (--base)")


_LAYER = re.compile(r"^layers\.(\d+)\.")


def checked_lora_sites(source: CheckpointSource, prefix: str,
                       base_shapes: dict[str, tuple[int, ...]] | None = None) -> list[tuple[LoraSite, dict[str, int]]]:
    """Every LoRA site with the Tunix axis sizes read off its factors, checked against the metadata
    (rank, targets, layer count) and, given `base_shapes`, against the base's tensors."""
    specs = source.params.specs
    rank = int(source.lora["rank"])
    sites = lora_sites(source.family, source.layout, prefix, list(source.lora["targets"]))
    # the shapes of the model the run records: a step whose factors fit another model (a checkpoint dir two runs
    # wrote) was exported as an adapter that peft refuses on load ('size mismatch'), its base being this model
    shapes = source.family.projection_shapes(source.family.read_text_config(source.hf_config)) \
        if source.family.projection_shapes else {}
    out = []
    used = set()
    for site in sites:
        for name in (site.a_name, site.b_name):
            if name not in specs:
                raise UserError(f"checkpoint step {source.step}: LoRA tensor {name} is missing "
                                f"(metadata targets {', '.join(source.lora['targets'])})")
        a, b = specs[site.a_name].shape, specs[site.b_name].shape
        if a[-1] != rank or b[0] != rank:
            raise UserError(f"checkpoint tensor {site.a_name} {a} / {site.b_name} {b}: LoRA rank "
                            f"{a[-1]} does not match metadata lora.rank={rank}")
        sizes = axis_sizes_from_factors(site.proj, a, b)
        recorded = shapes.get(site.proj.hf_name)
        if recorded and hf_shape(site.proj, sizes) not in recorded:
            raise UserError(f"checkpoint tensor {site.a_name} {a} / {site.b_name} {b}: a LoRA update of a "
                            f"{hf_shape(site.proj, sizes)} weight, where the model recorded in "
                            f"{source.dir / METADATA_FILE} (hf_config) has {site.hf_key} of shape {recorded[0]}: "
                            f"the step was written by a run of another model")
        if base_shapes is not None:
            if site.hf_key not in base_shapes:
                raise UserError(f"base has no tensor {site.hf_key} (needed for LoRA {site.a_name})")
            want, have = hf_shape(site.proj, sizes), tuple(base_shapes[site.hf_key])
            if want != have:
                raise UserError(f"shape mismatch for {site.hf_key}: the checkpoint's LoRA gives {want}, "
                                f"the base has {have}")
        used |= {site.a_name, site.b_name}
        out.append((site, sizes))
    extra = [n for n in specs if n not in used]
    if extra:
        m = _LAYER.match(extra[0])
        # (tool-neutral: the PEFT export said "no place in the merge" too)
        why = (f"layer {m.group(1)} is beyond the recorded num_layers={source.layout.num_layers}"
               if m and int(m.group(1)) >= source.layout.num_layers else
               f"its projection is not among lora.targets ({', '.join(source.lora['targets'])}) of "
               f"{source.dir / METADATA_FILE}")
        raise UserError(f"checkpoint tensor {extra[0]} fits none of the recorded LoRA sites: {why}")
    return out


def check_finite_factors(source: CheckpointSource, sites: list[tuple[LoraSite, dict[str, int]]]) -> None:
    """Read every LoRA factor once (a layer at a time, small next to the base) before any output is
    created: a NaN/inf factor is a one-line error naming the tensor (CheckpointParams.read)."""
    by_layer: dict[int, set[str]] = {}
    for s, _ in sites:
        by_layer.setdefault(s.layer, set()).update((s.a_name, s.b_name))
    for layer in sorted(by_layer):
        source.params.read(sorted(by_layer[layer]))


class FactorCache:
    """LoRA factors in PEFT layout (fp32), read one layer at a time: a layer's factors are one
    Orbax partial restore, and only the last two layers are kept."""

    def __init__(self, source: CheckpointSource, sites: list[tuple[LoraSite, dict[str, int]]]):
        self.source = source
        self.by_layer: dict[int, list[LoraSite]] = {}
        self.sizes = {s.hf_key: sz for s, sz in sites}
        for s, _ in sites:
            self.by_layer.setdefault(s.layer, []).append(s)
        self._cache: dict[int, dict[str, np.ndarray]] = {}

    def peft(self, site: LoraSite) -> tuple[np.ndarray, np.ndarray]:
        """(A [r, in], B [out, r]) in float32."""

        raw = self._layer(site.layer)
        a = raw[site.a_name].astype(np.float32)
        b = raw[site.b_name].astype(np.float32)
        return site.proj.lora_to_peft(a, b, weight_shape(site.proj, self.sizes[site.hf_key]))

    def _layer(self, layer: int) -> dict[str, np.ndarray]:
        if layer not in self._cache:
            names = sorted({n for s in self.by_layer[layer] for n in (s.a_name, s.b_name)})
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[layer] = self.source.params.read(names)
        return self._cache[layer]

"""Run as a script with 8 simulated devices: load tiny models on several meshes (weights into their
shards, LoRA / QLoRA, optimizer state) and print, as JSON, every array whose placement differs from
the partition rules. Used by tests/test_sharding.py (it needs XLA_FLAGS before JAX starts)."""

import dataclasses
import json
import re
import sys

MESHES = {"1x1x1": (1, 1, 1), "fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
ONLY_BY_NAME = {"tp8": (1, 1, 8), "fsdp2_tp4": (1, 2, 4)}  # checked with --mesh=NAME or DIR@NAME only


def check(model_dir: str, mesh_name: str, quant: str | None) -> dict:
    import jax
    import optax
    from flax import nnx

    from gemma_tpu import lora
    from gemma_tpu.core.config import LoraConfig, MeshConfig
    from gemma_tpu.models import load_model, resolve_model
    from gemma_tpu.train import mesh as mesh_lib
    from gemma_tpu.train import partition

    d, f, t = {**MESHES, **ONLY_BY_NAME}[mesh_name]
    resolved = resolve_model(model_dir)
    mesh = mesh_lib.build_mesh(MeshConfig(data=d, fsdp=f, tp=t), devices=jax.devices()[:d * f * t])
    sizes = dict(mesh.shape)
    with mesh:
        ruled = dataclasses.replace(resolved, family=partition.with_rules(resolved.family))
        model, cfg = load_model(ruled, "float32", "none", mesh=mesh)
        model = lora.apply_lora(model, resolved.family, cfg, LoraConfig(rank=4, base_quantization=quant), mesh=mesh)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
        partition.shard_optimizer_state(optimizer, mesh)
    params = partition.flat_params(model)
    expected = partition.expected_specs(resolved.family, cfg, [(p, tuple(v.shape)) for p, v in params], sizes)
    bad, split = [], 0
    for path, value in params:
        got = partition.normalize(value.sharding.spec, sizes)
        split += bool(got)
        if got != expected[path]:
            bad.append(f"{path}: placed {got}, rules say {expected[path]}")
    opt_checked = 0
    for path, value in partition.flat_params(nnx.state(optimizer, nnx.optimizer.OptState)):
        m = re.search(r"\.(mu|nu)\.(.+)$", path)
        if not m:
            continue
        opt_checked += 1
        got = partition.normalize(value.sharding.spec, sizes)
        if got != expected[m.group(2)]:
            bad.append(f"{path}: placed {got}, its parameter's rule says {expected[m.group(2)]}")
    # bytes of LoRA factors and their Adam state, in all and on the device holding most of them (its shards)
    held: dict = {}
    total = 0
    opt_state = partition.flat_params(nnx.state(optimizer, nnx.optimizer.OptState))
    trainable = [v for p, v in params if "_lora_" in p] + [v for p, v in opt_state if re.search(r"\.(mu|nu)\.", p)]
    for value in trainable:
        total += value.nbytes
        for shard in value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    attn = {path: list(partition.normalize(value.sharding.spec, sizes)) for path, value in params
            if re.fullmatch(r"layers\.\d+\.attn\.(q|kv|k)_einsum\.w(_lora_[ab])?", path)}
    return {"params": len(params), "split": split, "attn": attn, "opt_checked": opt_checked, "mismatches": bad,
            "lora_bytes": total, "lora_bytes_per_device": max(held.values()),
            "lora": sum(1 for p, _ in params if "_lora_" in p),
            "quantized": sum(1 for p, _ in params if ".qvalue" in p),
            "act_btd": [list(a) if isinstance(a, tuple) else a for a in cfg.shd_config.act_btd]}


def loss_and_grads(model_dir: str, mesh_name: str) -> dict:
    """The training loss and its gradient for every LoRA factor (rank 4, B random: Qwix starts it at zero, which
    leaves A's gradient zero) on a fixed batch, computed on this mesh; as lists, for comparing meshes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gemma_tpu import lora
    from gemma_tpu.core.config import LoraConfig, MeshConfig
    from gemma_tpu.models import load_model, resolve_model
    from gemma_tpu.train import mesh as mesh_lib
    from gemma_tpu.train import partition
    from gemma_tpu.train.loss import sparse_loss

    d, f, t = {**MESHES, **ONLY_BY_NAME}[mesh_name]
    resolved = resolve_model(model_dir)
    mesh = mesh_lib.build_mesh(MeshConfig(data=d, fsdp=f, tp=t), devices=jax.devices()[:d * f * t])
    rng = np.random.default_rng(0)
    b, n, m = 2, 24, 8
    batch = [jnp.asarray(x) for x in (rng.integers(3, 500, (b, n)), np.tile(np.arange(n), (b, 1)),
                                      np.ones((b, n), np.int32), np.tile(np.arange(n - m - 1, n - 1), (b, 1)),
                                      rng.integers(3, 500, (b, m)), np.ones((b, m), np.float32))]
    with mesh:
        ruled = dataclasses.replace(resolved, family=partition.with_rules(resolved.family))
        model, cfg = load_model(ruled, "float32", "none", mesh=mesh)
        model = lora.apply_lora(model, resolved.family, cfg, LoraConfig(rank=4), seed=0, mesh=mesh)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
            if str(path[-1]).endswith("_lora_b"):
                value = var.get_value()
                noise = np.random.default_rng(len(str(path))).normal(0, 0.1, value.shape).astype(np.float32)
                var.set_value(jax.device_put(noise, value.sharding))
        loss, grads = nnx.jit(lambda mdl: nnx.value_and_grad(sparse_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            mdl, *batch))(model)
    flat = {".".join(str(p) for p in path): np.asarray(v.get_value()).ravel().tolist()
            for path, v in nnx.to_flat_state(grads)}
    return {"loss": float(loss), "grads": flat}


def main(argv):
    """argv: model dirs, checked on every mesh and with int8 QLoRA; `--mesh=NAME` first: on that mesh only; a dir
    written `DIR@NAME`: that dir on that mesh only (one process for the dirs of several tests: each start-up costs
    seconds of imports)."""
    if argv and argv[0] == "--grads":  # `--grads DIR@MESH...`: loss and LoRA gradients of each
        print("RESULT " + json.dumps({a: loss_and_grads(*a.rsplit("@", 1)) for a in argv[1:]}))
        return
    out = {}
    only = argv[0].removeprefix("--mesh=") if argv and argv[0].startswith("--mesh=") else None
    for arg in argv[1:] if only else argv:
        model_dir, _, mesh = arg.rpartition("@") if "@" in arg else (arg, "", only)
        for mesh_name in [mesh] if mesh else MESHES:
            out[f"{model_dir}|{mesh_name}|-"] = check(model_dir, mesh_name, None)
        if not mesh:
            out[f"{model_dir}|fsdp4_tp2|int8"] = check(model_dir, "fsdp4_tp2", "int8")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Mesh and sharding on 8 simulated CPU devices: same losses on every mesh layout."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli, xla_env

EIGHT = xla_env(8)
MESHES = {
    "1x1x1": ["mesh.data=1", "mesh.fsdp=1", "mesh.tp=1"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8", "mesh.tp=1"],
    "fsdp4_tp2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tp=2"],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4", "mesh.tp=1"],
}


def train_losses(tiny_dir, ckpt, mesh_args, env):
    # SGD, not AdamW: Adam's first updates are ~±lr whatever a gradient's size, so a ~1e-8 gradient whose
    # sign flips with the summation order (which differs per mesh) moves a weight by lr - the optimizer's
    # sensitivity, not sharding's. SGD keeps the comparison about sharding.
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", "train.max_steps=3", "train.batch_size=8", "data.eval_path=null",
                   "train.optimizer=sgd", "train.learning_rate=0.1", *mesh_args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in (Path(ckpt) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["mode"] == "train"]


def test_same_loss_on_every_mesh(tiny_dir, tmp_path):
    single = train_losses(tiny_dir, tmp_path / "single", MESHES["1x1x1"], xla_env())
    for name, args in MESHES.items():
        got = train_losses(tiny_dir, tmp_path / name, args, EIGHT) if name != "1x1x1" else single
        assert len(got) == 3
        for a, b in zip(got, single):
            assert abs(a - b) < 1e-5, (name, got, single)
        # the LoRA factors an fsdp-only mesh splits over fsdp (lora.factor_spec) keep that placement: one compile
        summary = tmp_path / ("single" if name == "1x1x1" else name) / "summary.json"
        assert json.loads(summary.read_text())["train_step_compiles"] == 1, name

    # fsdp8's factors, gathered from their fsdp shards, merge into the same model as one device's
    from safetensors.numpy import load_file

    from convert.merge_orbax import main as merge

    merged = {}
    for name in ("1x1x1", "fsdp8"):
        ckpt = tmp_path / ("single" if name == "1x1x1" else name)
        assert merge(["--checkpoint", str(ckpt), "--out", str(tmp_path / f"merged_{name}")]) == 0
        merged[name] = {k: v for f in sorted((tmp_path / f"merged_{name}").glob("*.safetensors"))
                        for k, v in load_file(f).items()}
    assert merged["1x1x1"].keys() == merged["fsdp8"].keys()
    for k, v in merged["1x1x1"].items():
        assert abs(merged["fsdp8"][k] - v).max() < 1e-5, k

    # resumed on another slice: the fsdp4_tp2 run's step 2, on 2 devices (fsdp=2), goes on to the same step 3.
    # With SGD (a state of scalars alone) every resume on a multi-device mesh failed ("cannot restore this checkpoint
    # step (ValueError: Received incompatible devices ...)"): Orbax put the restored step counts on one device
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp4_tp2", resumed)
    shutil.rmtree(resumed / "3")
    got = train_losses(tiny_dir, resumed, ["mesh.data=1", "mesh.fsdp=2", "mesh.tp=1"],
                       xla_env(2))
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"] == 2
    assert abs(got[-1] - single[2]) < 1e-5, (got, single)


def test_mesh_that_does_not_fit_is_refused(tiny_dir, tmp_path):
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={tmp_path}/ck", "mesh.fsdp=3", "mesh.tp=1", env=EIGHT)
    assert proc.returncode != 0
    assert "mesh" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def tiny_gemma4_dir(tmp_path_factory):
    tiny = pytest.importorskip("gemma_tpu.assets.tiny")
    if not hasattr(tiny, "write_tiny_gemma4"):
        pytest.skip("no tiny Gemma 4 writer yet")
    return tiny.write_tiny_gemma4(tmp_path_factory.mktemp("tiny4") / "gemma4", seed=0, variant="dense")


@pytest.fixture(scope="module")
def specs(tiny_dir, tiny_gemma4_dir, tmp_path_factory):
    """tests.sharding_specs run once for both tests below (one process: each start-up costs seconds of imports):
    the tiny Gemma 3 and Gemma 4 on every mesh and with int8 QLoRA, and the one-global-KV-head K=V Gemma 4 on
    fsdp=4 × tp=2. The placement per model dir and mesh, keyed `DIR|MESH|QUANT`."""
    import os
    import subprocess
    import sys

    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from tests.conftest import REPO

    k_eq_v = write_tiny_gemma4(tmp_path_factory.mktemp("g4kv1") / "g4", seed=0, variant="dense",
                               num_global_key_value_heads=1)
    proc = subprocess.run([sys.executable, "-m", "tests.sharding_specs", str(tiny_dir), str(tiny_gemma4_dir),
                           f"{k_eq_v}@fsdp4_tp2", f"{tiny_dir}@fsdp2_tp4", f"{tiny_gemma4_dir}@fsdp2_tp4"],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **EIGHT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    return {"k_eq_v": {k: r for k, r in results.items() if k.startswith(f"{k_eq_v}|")},
            "tp4": {k: r for k, r in results.items() if "|fsdp2_tp4|" in k},
            "tiny": {k: r for k, r in results.items() if not k.startswith(f"{k_eq_v}|") and "|fsdp2_tp4|" not in k}}


@pytest.mark.xdist_group("sharding_specs")  # with the K=V test below: one worker, one run of the fixture
def test_every_parameter_has_the_rule_spec(specs):
    """Base weights, LoRA factors, QLoRA weights and Adam state on 1x1x1, fsdp=8, fsdp=4×tp=2 and
    data=2×fsdp=4 are placed exactly as gemma_tpu.train.partition says."""
    results = specs["tiny"]
    assert len(results) == 10
    for key, r in results.items():
        assert not r["mismatches"], (key, r["mismatches"][:10])
        assert r["lora"] > 0 and r["opt_checked"] == 2 * r["lora"], (key, r)
        assert r["act_btd"] == [["data", "fsdp"], None, "tp"], key
        if "1x1x1" in key:
            assert r["split"] == 0, key
        else:
            assert r["split"] >= r["params"] // 3, (key, r)  # not vacuous: many arrays really are split
        if key.endswith("|int8"):
            assert r["quantized"] > 0, key
        if key.endswith(("|fsdp8|-", "|data2_fsdp4|-")):
            # every LoRA factor and its Adam state split over fsdp: B of q/k/v/gate/up and A of o/down, which
            # follow only tp from their base, were whole on every device of an fsdp-only mesh
            fsdp = 8 if "fsdp8" in key else 4
            assert r["lora_bytes_per_device"] * fsdp == r["lora_bytes"], (key, r)


@pytest.mark.xdist_group("sharding_specs")
def test_single_global_kv_head_of_a_k_eq_v_gemma4_loads_on_a_tp_mesh(specs):
    """A Gemma 4 whose K=V global layers have one KV head (k_einsum (1, D, H)): Tunix annotates its head axis
    with 'tp' whatever its size, and fsdp=4 × tp=2 failed to place it (JAX IndivisibleError traceback at load).
    It loads, with LoRA and Adam state, replicated along that axis as the partition rules say."""
    (key, r), = specs["k_eq_v"].items()
    assert key.endswith("|fsdp4_tp2|-"), key
    assert not r["mismatches"], r["mismatches"][:10]
    assert r["lora"] > 0 and r["opt_checked"] == 2 * r["lora"] and r["split"] >= r["params"] // 3, r


def test_norm_scales_are_replicated_where_tp_does_not_divide_the_hidden_size(tmp_path):
    """A Gemma 4 of hidden_size 60 on tp=8 (8 query heads, one KV head, MLP and vocabulary divisible by 8; Gemma 3's
    config requires hidden_size divisible by the heads, so tp then divides it too): only the RMSNorm scales
    have the hidden size under tp, and they were refused ('layers.0.pre_attention_norm.scale: dimension 0 (size 60)
    cannot be split over mesh.tp=8'; loaded past that check, a JAX IndivisibleError traceback); a norm scale is a
    few bytes a layer, replicated. The model loads with LoRA and Adam state, every array placed as the rules say."""
    import os
    import subprocess
    import sys

    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from tests.conftest import REPO

    d = write_tiny_gemma4(tmp_path / "g4", seed=0, variant="dense", hidden_size=60, num_attention_heads=8,
                          num_key_value_heads=1, num_global_key_value_heads=1)
    proc = subprocess.run([sys.executable, "-m", "tests.sharding_specs", "--mesh=tp8", str(d)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **EIGHT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    (r,) = json.loads(line[len("RESULT "):]).values()
    assert not r["mismatches"], r["mismatches"][:10]
    assert r["lora"] > 0 and r["opt_checked"] == 2 * r["lora"] and r["split"] >= r["params"] // 3, r


def test_single_kv_head_lora_keeps_its_placement_one_compile(tmp_path):
    """A Gemma 4 E2B-like model (one KV head, per-layer embeddings) on fsdp=4 × tp=2: XLA handed the kv_einsum LoRA B
    back split over tp after step 1 (its rule placement: replicated), so step 2 compiled the train step again
    ("RECOMPILATION #2 of _train_step"). The step keeps the placements: one compile."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4

    d = write_tiny_gemma4(tmp_path / "g4", seed=0, variant="ple")
    ckpt = tmp_path / "ck"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={d}", f"checkpoint.dir={ckpt}",
                   "train.max_steps=2", "train.batch_size=8", "data.eval_path=null", "mesh.fsdp=4", "mesh.tp=2",
                   env=EIGHT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RECOMPILATION" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((ckpt / "summary.json").read_text())["train_step_compiles"] == 1


def test_a_vocabulary_tp_does_not_divide_trains_as_on_one_device(tmp_path):
    """A vocabulary of 515 (as a real one with a token added, 262,145) at tp=2 was refused ('embedder.input_embedding:
    dimension 0 (size 515, config.json vocab_size) cannot be split over mesh.tp=2'): the embedding is whole on each
    tp shard, and the losses are those of one device."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3
    from tests.test_train import losses

    d = write_tiny_gemma3(tmp_path / "v515", seed=0, vocab_size=515)
    runs = {}
    for name, extra, env in (("one", [], None), ("tp2", ["mesh.fsdp=4", "mesh.tp=2"], EIGHT)):
        runs[name] = tmp_path / name
        proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={d}",
                       f"checkpoint.dir={runs[name]}", "train.max_steps=3", "data.eval_path=null", *extra, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(runs["tp2"]) == pytest.approx(losses(runs["one"]), rel=1e-5)


def test_indivisible_axis_is_refused_before_loading(tiny_dir, tmp_path):
    """tp=8 cannot split 4 query heads: one line naming the parameter, nothing written."""
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={tmp_path}/ck", "mesh.fsdp=1", "mesh.tp=8", env=EIGHT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "cannot be split over mesh.tp=8" in err[0] and "divides 4" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # before the data is read (minutes for a large set): a bad row further on is not what stops the run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"x": 1}\n')
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={tmp_path}/ck", "mesh.fsdp=1", "mesh.tp=8", f"data.train_path={bad}", env=EIGHT)
    err = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 2 and len(err) == 1 and "cannot be split over mesh.tp=8" in err[0], proc.stderr[-2000:]
    assert not (tmp_path / "ck").exists()


def test_indivisible_axis_names_the_mesh_keys():
    """The refusal names the config keys that set the split (`mesh.fsdp`, `mesh.tp`), not only the axis names."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.partition import resolve

    with pytest.raises(UserError, match=r"^embedder\.input_embedding: dimension 0 \(size 509\) cannot be split over "
                                        r"mesh\.fsdp=2 × mesh\.tp=2; choose mesh sizes whose product divides 509$"):
        resolve((("fsdp", "tp"), None), (509, 64), {"fsdp": 2, "tp": 2, "data": 1}, "embedder.input_embedding")
    assert resolve((("fsdp", "tp"), None), (508, 64), {"fsdp": 2, "tp": 2}) == (("fsdp", "tp"),)
    # one axis over the dimension (fsdp 1 is dropped): the key to change is that axis's, not "a product"
    with pytest.raises(UserError, match=r"over mesh\.tp=4; choose a mesh\.tp that divides 509$"):
        resolve((("fsdp", "tp"), None), (509, 64), {"fsdp": 1, "tp": 4}, "embedder.input_embedding")



@pytest.mark.parametrize("family, path, spec, shape, field", [
    ("gemma4", "embedder.per_layer_input_embedding", ("tp", None, "fsdp"), (262_144, 35, 250),
     "hidden_size_per_layer_input"),
    ("gemma4", "layers.3.per_layer_input_gate.w", ("fsdp", "tp"), (1536, 250), "hidden_size_per_layer_input"),
    # (KV heads are replicated instead: test_kv_head_dims_are_replicated_where_tp_does_not_divide_them)
    ("gemma3", "layers.0.attn.q_einsum.w", ("tp", "fsdp", None), (4, 640, 256), "num_attention_heads"),
    ("gemma3", "layers.0.mlp.down_proj.kernel", ("tp", "fsdp"), (2050, 640), "intermediate_size"),
    # a mixture of experts' (the table had none: a refusal named no field)
    ("gemma4", "layers.2.moe.linear", ("fsdp", "tp", None), (128, 22, 2816), "moe_intermediate_size"),
    ("gemma4", "layers.2.moe.gating_einsum", ("fsdp", None, None, "tp"), (127, 2, 704, 2816), "num_experts"),
])
def test_indivisible_axis_names_the_config_field(family, path, spec, shape, field):
    """The refusal named the internal parameter (`embedder.per_layer_input_embedding`) and the mesh keys but not the
    config.json size behind the dimension, which the family registry knows (`partition_dims`)."""
    import re

    from gemma_tpu.core.errors import UserError
    from gemma_tpu.models.registry import get_family
    from gemma_tpu.train.partition import base_spec, config_fields, resolve

    fam = get_family(family)
    assert base_spec(fam, path) == spec  # the table's path is the rule's, its dims the rule's
    assert len(config_fields(fam, path)) == len(spec)
    with pytest.raises(UserError, match=rf"^{re.escape(path)}: dimension \d \(size \d+, config\.json "
                                        rf"{re.escape(field)}\) cannot be split over mesh\.\w+=8; choose"):
        resolve(spec, shape, {"fsdp": 8, "tp": 8}, path, config_fields(fam, path))


@pytest.mark.parametrize("family, path, spec, shape, field, placed", [
    # K and V fused: num_key_value_heads in every layer; K alone (a K=V model's global layers, the 26B-A4B's 2 heads
    # at tp=4 × fsdp=2): num_global_key_value_heads
    ("gemma4", "layers.4.attn.kv_einsum.w", (None, "tp", "fsdp", None), (2, 3, 1536, 256), "num_key_value_heads",
     (None, None, "fsdp")),
    ("gemma4", "layers.5.attn.k_einsum.w", ("tp", "fsdp", None), (2, 2816, 512), "num_global_key_value_heads",
     (None, "fsdp")),
    ("gemma3", "layers.0.attn.kv_einsum.w", (None, "tp", "fsdp", None), (2, 2, 640, 256), "num_key_value_heads",
     (None, None, "fsdp")),
    # a vocabulary with tokens added (262,145 rows): no tensor parallelism at all was possible
    ("gemma3", "embedder.input_embedding", ("tp", "fsdp"), (262_145, 640), "vocab_size", (None, "fsdp")),
    ("gemma4", "embedder.per_layer_input_embedding", ("tp", None, "fsdp"), (262_143, 35, 256), "vocab_size",
     (None, None, "fsdp")),
])
def test_kv_head_and_vocab_dims_are_replicated_where_tp_does_not_divide_them(family, path, spec, shape, field,
                                                                            placed):
    """A KV-head (or vocabulary) dimension that tp does not divide was refused ('... (size 2, config.json
    num_key_value_heads) cannot be split over mesh.tp=8'): it is replicated over tp (registry.REPLICATED_WHEN_
    INDIVISIBLE), the other axes kept; the registry still names its field."""
    from gemma_tpu.models.registry import get_family
    from gemma_tpu.train.partition import base_spec, config_fields, replicated_dims, resolve

    fam = get_family(family)
    assert base_spec(fam, path) == spec and config_fields(fam, path)[spec.index("tp")] == field
    sizes = {"fsdp": 8, "tp": 8}
    assert resolve(spec, shape, sizes, path, config_fields(fam, path)) == placed
    assert list(replicated_dims(spec, shape, sizes, config_fields(fam, path)).values()) == [field]
    assert resolve(spec, shape, {"fsdp": 8, "tp": shape[spec.index("tp")]}, path, config_fields(fam, path))[:2] == (
        spec[:2])  # where tp divides them, they are split as before


@pytest.mark.parametrize("path, shape, dim, field", [
    ("layers.0.mlp.down_proj.kernel.array.qvalue", (2050, 640), 0, "intermediate_size"),
    ("layers.0.mlp.down_proj.kernel_lora_a", (2050, 8), 0, "intermediate_size"),
    ("layers.0.mlp.up_proj.kernel_lora_b", (8, 2050), 1, "intermediate_size"),
    ("layers.0.attn.q_einsum.w_lora_b", (8, 6, 256), 1, "num_attention_heads"),
])
def test_indivisible_quantized_weight_or_lora_factor_names_the_config_field(path, shape, dim, field):
    """A quantized weight (`...kernel.array.qvalue`, what lora.base_quantization trains on) or a LoRA factor that a
    mesh axis does not divide was refused without the config.json field behind the dimension: the registry's table
    names the weight's dims, which theirs are."""
    import re

    from gemma_tpu.core.errors import UserError
    from gemma_tpu.models.registry import get_family, read_layout
    from gemma_tpu.train.partition import placed_spec

    fam = get_family("gemma3")
    layout = read_layout({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 6,
                          "num_key_value_heads": 1, "hidden_size": 640, "head_dim": 256,
                          "intermediate_size": 2050}, fam)
    with pytest.raises(UserError, match=rf"^{re.escape(path)}: dimension {dim} \(size {shape[dim]}, config\.json "
                                        rf"{field}\) cannot be split over mesh\.tp=4"):
        placed_spec(fam, layout, path, shape, {"fsdp": 1, "tp": 4})


def test_lora_factors_on_a_mesh_are_the_same_without_tracer_origin_messages(tiny_dir, monkeypatch):
    """`lora._apply_sharded` builds tracers' AttributeError texts without their (slow) origin walk; the
    factors are bit-identical to the ones built with it, and the walk is back afterwards."""
    import contextlib
    import dataclasses

    import numpy as np
    from flax import nnx
    from jax._src.interpreters import partial_eval as pe

    from gemma_tpu import lora
    from gemma_tpu.core.config import LoraConfig, MeshConfig
    from gemma_tpu.models import load_model, resolve_model
    from gemma_tpu.train import mesh as mesh_lib
    from gemma_tpu.train import partition

    original = pe.DynamicJaxprTracer._origin_msg
    resolved = resolve_model(str(tiny_dir))
    mesh = mesh_lib.build_mesh(MeshConfig())

    def factors():
        with mesh:
            ruled = dataclasses.replace(resolved, family=partition.with_rules(resolved.family))
            model, cfg = load_model(ruled, "float32", "none", mesh=mesh)
            model = lora.apply_lora(model, resolved.family, cfg, LoraConfig(rank=4), seed=3, mesh=mesh)
        return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}

    fast = factors()
    assert pe.DynamicJaxprTracer._origin_msg is original
    monkeypatch.setattr(lora, "cheap_tracer_attribute_errors", contextlib.nullcontext)
    slow = factors()
    assert fast.keys() == slow.keys() and len(fast) > 0
    for k in fast:
        np.testing.assert_array_equal(fast[k], slow[k], err_msg=str(k))
    assert any(np.abs(v).max() > 0 for v in fast.values())  # the A factors are random, not zero


def test_untuned_gemm_flag_warns_on_gpu_only():
    """XLA's last --xla_gpu_autotune_level decides; level 0 on a GPU made the 1B step 13x slower."""
    from gemma_tpu.train.mesh import untuned_gemm_warning

    assert "autotune_level=0" in untuned_gemm_warning("gpu", "--xla_gpu_autotune_level=0")
    assert untuned_gemm_warning("gpu", "--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4") is None
    assert untuned_gemm_warning("gpu", "--xla_gpu_autotune_level=4 --xla_gpu_autotune_level=0")
    assert untuned_gemm_warning("cpu", "--xla_gpu_autotune_level=0") is None
    assert untuned_gemm_warning("gpu", "--xla_force_host_platform_device_count=8") is None


@pytest.mark.xdist_group("sharding_specs")
def test_kv_heads_that_tp_does_not_divide_are_replicated_over_tp(specs):
    """2 KV heads on fsdp=2 × tp=4 (the tiny Gemma 3, and the tiny Gemma 4 whose K=V global layers have 2 heads of
    their own): refused before, as Tunix annotates the head axis 'tp' whatever its count. The K/V projections
    (kv_einsum, and Gemma 4's K-only k_einsum) are replicated over tp, split over fsdp on D; queries stay split
    over tp; LoRA factors and Adam state placed as the rules say."""
    results = specs["tp4"]
    assert len(results) == 2
    for key, r in results.items():
        assert not r["mismatches"], (key, r["mismatches"][:10])
        assert r["lora"] > 0 and r["opt_checked"] == 2 * r["lora"], (key, r)
        attn = r["attn"]
        assert attn["layers.0.attn.q_einsum.w"] == ["tp", "fsdp"], key
        assert attn["layers.0.attn.kv_einsum.w"] == [None, None, "fsdp"], key
        assert attn["layers.0.attn.kv_einsum.w_lora_b"] == [None, "fsdp"], key  # no tp: split over fsdp instead
        if "gemma4" in key:
            assert attn["layers.1.attn.k_einsum.w"] == [None, "fsdp"], key


def test_kv_heads_replicated_over_tp_give_the_tp1_loss_and_lora_gradients(tiny_dir):
    """The tiny Gemma 3's 2 KV heads on fsdp=2 × tp=4 (K/V replicated over tp, queries split): the loss and every
    LoRA factor's gradient (B random, so A's are not zero) equal one device's within float32 summation noise."""
    import os
    import subprocess
    import sys

    import numpy as np

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "tests.sharding_specs", "--grads", f"{tiny_dir}@1x1x1",
                           f"{tiny_dir}@fsdp2_tp4"], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **EIGHT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    one, tp4 = json.loads(line[len("RESULT "):]).values()
    assert abs(one["loss"] - tp4["loss"]) < 1e-5, (one["loss"], tp4["loss"])
    assert one["grads"].keys() == tp4["grads"].keys() and len(one["grads"]) == 2 * 2 * 6  # 2 layers, q kv o g u d
    scale = max(np.abs(g).max() for g in one["grads"].values())
    assert 0.1 < scale < 10
    for k, g in one["grads"].items():
        np.testing.assert_allclose(tp4["grads"][k], g, rtol=0, atol=1e-5 * scale, err_msg=k)

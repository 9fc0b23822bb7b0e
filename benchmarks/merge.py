"""Benchmark the streaming merge on a Gemma 3 4B-shaped checkpoint: peak RSS and wall time vs `cp -r`.

    python benchmarks/merge.py [--scale 1.0] [--workdir DIR] [--keep] [--json OUT]

Builds, without any model object, a synthetic sharded bf16 base with the 4B text shape (34 layers,
hidden 2560, 8 heads / 4 KV heads of 256, intermediate 10240, vocab 262144: ~7.8 GB) through the
same streaming writer the merge uses, and a rank-16 LoRA on all seven projections saved in our
Orbax layout (`<ckpt>/<step>/model_params` + gemma_tpu_run.json). Then it times `cp -r` of the base
and the merge (a subprocess each; peak RSS from wait4's ru_maxrss, plus sampling). `--scale`
multiplies the layer count and vocabulary for a quick run (e.g. 0.1: 3 layers, ~0.8 GB).

Targets: merge peak RSS < 1.5 GB; merge wall time within 2x of cp. Both run with the base in the
page cache (it has just been written), so the comparison is of the work done, not of the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_info, cpu_label  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402
from gemma_tpu.core.atomic import write_text_atomic  # noqa: E402
from gemma_tpu.core.progress import human  # noqa: E402
from gemma_tpu.hf import safetensors_io as sio
from gemma_tpu.models.gemma3 import GEMMA3  # noqa: E402

GEMMA3_4B_TEXT = dict(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, intermediate_size=10240, vocab_size=262144)
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_config(shape: dict) -> dict:
    n = shape["num_hidden_layers"]
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **shape,
        "query_pre_attn_scalar": shape["head_dim"], "sliding_window": 1024, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "layer_types": GEMMA3.layer_types(n),
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "dtype": "bfloat16",
    }


def dims(s: dict) -> tuple[int, int, int, int, int]:
    """hidden, intermediate, head_dim, heads, KV heads."""
    return (s["hidden_size"], s["intermediate_size"], s["head_dim"], s["num_attention_heads"],
            s["num_key_value_heads"])


def base_specs(s: dict) -> list[sio.OutSpec]:
    """HF tensor names and shapes of a Gemma 3 text model, in the order transformers writes them."""
    d, f, h, nq, nk = dims(s)
    specs = [sio.OutSpec("model.embed_tokens.weight", "BF16", (s["vocab_size"], d))]
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in [("input_layernorm.weight", (d,)), ("mlp.down_proj.weight", (d, f)),
                            ("mlp.gate_proj.weight", (f, d)), ("mlp.up_proj.weight", (f, d)),
                            ("post_attention_layernorm.weight", (d,)), ("post_feedforward_layernorm.weight", (d,)),
                            ("pre_feedforward_layernorm.weight", (d,)), ("self_attn.k_norm.weight", (h,)),
                            ("self_attn.k_proj.weight", (nk * h, d)), ("self_attn.o_proj.weight", (d, nq * h)),
                            ("self_attn.q_norm.weight", (h,)), ("self_attn.q_proj.weight", (nq * h, d)),
                            ("self_attn.v_proj.weight", (nk * h, d))]:
            specs.append(sio.OutSpec(p + name, "BF16", shape))
    specs.append(sio.OutSpec("model.norm.weight", "BF16", (d,)))
    return specs


def write_base(out: Path, shape: dict) -> None:
    """Random bf16 weights, streamed from a 64 MB pool so no tensor is ever materialised whole."""
    out.mkdir(parents=True)
    pool = np.random.default_rng(0).normal(0, 0.02, sio.CHUNK_BYTES // 2).astype(sio.DTYPES["BF16"]).view(np.uint8)
    specs = base_specs(shape)
    writer = sio.ShardedWriter(out, specs, sio.parse_size("2GB"), fsync=False)
    for i, spec in enumerate(specs):
        writer.begin(spec.name)
        left, off = spec.nbytes, (i * 4096) % (len(pool) // 2)
        while left:
            n = min(left, len(pool) - off)
            writer.write(pool[off:off + n])
            left -= n
            off = 0
    writer.close()
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    gen = {"bos_token_id": 2, "eos_token_id": list(GEMMA3.stop_token_ids), "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))


def lora_tree(shape: dict, rng: np.random.Generator) -> dict:
    """The nested tree Tunix's CheckpointManager saves for nnx.state(model, nnx.LoRAParam)."""
    d, f, h, nq, nk = dims(shape)
    r = RANK

    def rand(*s):
        return {"value": rng.normal(0, 0.01, s).astype(np.float32)}

    layers = {}
    for i in range(shape["num_hidden_layers"]):
        layers[str(i)] = {
            "attn": {
                "q_einsum": {"w_lora_a": rand(d, r), "w_lora_b": rand(r, nq, h)},
                "kv_einsum": {"w_lora_a": rand(d, r), "w_lora_b": rand(r, 2, nk, h)},
                "attn_vec_einsum": {"w_lora_a": rand(nq, h, r), "w_lora_b": rand(r, d)},
            },
            "mlp": {
                "gate_proj": {"kernel_lora_a": rand(d, r), "kernel_lora_b": rand(r, f)},
                "up_proj": {"kernel_lora_a": rand(d, r), "kernel_lora_b": rand(r, f)},
                "down_proj": {"kernel_lora_a": rand(f, r), "kernel_lora_b": rand(r, d)},
            },
        }
    return {"layers": layers}


def write_checkpoint(ckpt: Path, base: Path, shape: dict) -> None:
    import orbax.checkpoint as ocp

    from gemma_tpu.checkpoint.metadata import write_metadata

    tree = lora_tree(shape, np.random.default_rng(1))
    mgr = ocp.CheckpointManager(ckpt, item_handlers={"model_params": ocp.PyTreeCheckpointHandler()})
    mgr.save(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)), force=True)
    mgr.wait_until_finished()
    mgr.close()
    write_metadata(ckpt, {
        "base_model": {"path": str(base), "local_dir": str(base), "revision": None, "family": "gemma3"},
        "hf_config": hf_config(shape),
        "lora": {"enabled": True, "rank": RANK, "alpha": ALPHA, "targets": TARGETS, "base_quantization": None},
        "dtype": "bfloat16",
        "config": {},
    })


# The measuring parent must be small: a child's ru_maxrss includes the memory image it was forked
# from (the pre-exec copy of the parent), so this stdlib-only launcher sits between us and the
# command and reports wall time, exact peak RSS (wait4) and a sampled peak.
_LAUNCHER = r"""
import json, os, subprocess, sys, threading, time
t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
peak = [0]
done = threading.Event()
def sample():
    while not done.is_set():
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except OSError:
            return
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
err = proc.stderr.read()
_, status, usage = os.wait4(proc.pid, 0)
done.set()
print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2), "peak_rss_bytes": usage.ru_maxrss * 1024,
                  "sampled_peak_rss_bytes": peak[0], "rc": os.waitstatus_to_exitcode(status),
                  "stderr_tail": err.decode(errors="replace")[-800:]}))
"""


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run a command through the small launcher; wall time and peak RSS of the command itself."""
    proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"launcher failed: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result['rc']}):\n{result['stderr_tail']}")
    return result


def check_output(base: Path, ckpt: Path, out: Path) -> dict:
    """Spot-check the result: one LoRA'd tensor against numpy, one copied tensor byte for byte."""
    from convert.mapping import weight_shape
    from gemma_tpu.checkpoint.params import CheckpointParams
    from gemma_tpu.models import get_family

    bw, mw = sio.WeightsDir(base), sio.WeightsDir(out)
    fam = get_family("gemma3")
    cfg = fam.tunix_config(json.loads((ckpt / "gemma_tpu_run.json").read_text())["hf_config"])
    proj = {p.hf_name: p for p in fam.projections(cfg)}["v_proj"]
    params = CheckpointParams(ckpt, 1).read(["layers.0.attn.kv_einsum.w_lora_a", "layers.0.attn.kv_einsum.w_lora_b"])
    a, b = params["layers.0.attn.kv_einsum.w_lora_a"], params["layers.0.attn.kv_einsum.w_lora_b"]
    sizes = {"D": a.shape[0], "C": 2, "K": b.shape[2], "H": b.shape[3]}
    a_hf, b_hf = proj.lora_to_peft(a, b, weight_shape(proj, sizes))
    key = "model.layers.0.self_attn.v_proj.weight"
    expected = (bw.read(key).astype(np.float32) + (ALPHA / RANK) * (b_hf @ a_hf)).astype(sio.DTYPES["BF16"])
    lora_ok = mw.read(key).tobytes() == expected.tobytes()
    copy_ok = mw.read("model.norm.weight").tobytes() == bw.read("model.norm.weight").tobytes()
    return {"lora_tensor_exact": lora_ok, "copied_tensor_exact": copy_ok,
            "keys_equal": mw.names() == bw.names()}


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=cli.number(0.0), default=1.0, help="multiply layers and vocab (quick runs: 0.1)")
    p.add_argument("--workdir", type=cli.work_dir, help="where to build (default: a temp dir, deleted unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-fsync", action="store_true", help="run the merge with --no-fsync (cp does not fsync)")
    args = p.parse_args(argv)
    check_json(args.json, results_key="merge")
    shape = dict(GEMMA3_4B_TEXT)
    shape["num_hidden_layers"] = max(1, round(shape["num_hidden_layers"] * args.scale))
    shape["vocab_size"] = max(256, round(shape["vocab_size"] * args.scale))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="merge-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    base, ckpt, out, copy = work / "base", work / "ckpt", work / "merged", work / "cp"
    try:
        t = time.perf_counter()
        # a --workdir's base and checkpoint are reused only when whole and of this shape (their record, written
        # last): a run stopped while writing them (minutes at --scale 1) left a base the next run took as is, and
        # one of another --scale was timed under this shape's name
        built = work / "setup.json"
        try:
            reusable = json.loads(built.read_text()) == shape and base.is_dir() and ckpt.is_dir()
        except (OSError, ValueError):
            reusable = False
        if not reusable:
            built.unlink(missing_ok=True)
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(ckpt, ignore_errors=True)
            write_base(base, shape)
            write_checkpoint(ckpt, base, shape)
            write_text_atomic(built, json.dumps(shape))
        setup = time.perf_counter() - t
        base_bytes = sum(f.stat().st_size for f in base.iterdir())
        print(f"base: {base} ({human(base_bytes)}, {shape['num_hidden_layers']} layers, setup {setup:.0f}s)",
              file=sys.stderr)

        shutil.rmtree(copy, ignore_errors=True)
        cp = run_measured(["cp", "-r", str(base), str(copy)])
        shutil.rmtree(copy)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        shutil.rmtree(out, ignore_errors=True)  # a fresh target, as for cp: no old output to delete
        cmd = [sys.executable, "-m", "convert.merge_orbax", "--checkpoint", str(ckpt), "--out", str(out)]
        if args.no_fsync:
            cmd.append("--no-fsync")
        merge = run_measured(cmd, env)
        check = check_output(base, ckpt, out)
        # stamped as every benchmark's results are: a cp/merge wall time means nothing without its machine and date
        result = {
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "machine": {**cpu_info(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
            "shape": shape, "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS},
            "base_bytes": base_bytes, "fsync": not args.no_fsync, "cp": cp, "merge": merge, "check": check,
            "ratio_wall": round(merge["wall_s"] / max(cp["wall_s"], 1e-9), 2),
            "targets": {"peak_rss_below_1.5GB": merge["peak_rss_bytes"] < 1.5e9,
                        "wall_within_2x_cp": merge["wall_s"] <= 2 * cp["wall_s"]},
        }
        print(f"merge vs cp -r on {cpu_label()}, {result['date']}")
        rows = [("", "wall s", "peak RSS", "GB/s"),
                ("cp -r", f"{cp['wall_s']:.1f}", human(cp["peak_rss_bytes"]), f"{base_bytes / cp['wall_s'] / 1e9:.2f}"),
                ("merge", f"{merge['wall_s']:.1f}", human(merge["peak_rss_bytes"]),
                 f"{base_bytes / merge['wall_s'] / 1e9:.2f}")]
        for r in rows:
            print(f"{r[0]:<8}{r[1]:>10}{r[2]:>14}{r[3]:>8}")
        print(f"merge/cp wall: {result['ratio_wall']}x; checks: {check}; targets: {result['targets']}")
        if args.json:
            write_json(args.json, result)
        return 0 if all(check.values()) else 1
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Full fine-tuning (lora.enabled=false) with its memory-light default, adafactor, on a sharded mesh; the
checkpoint converts to an HF directory through the same merge command."""

from __future__ import annotations

import json
import shutil

from gemma_tpu.core.config import load_config
from tests.conftest import run_cli, xla_env

EIGHT = xla_env(8)


def test_optimizer_defaults_follow_lora():
    # configs/tiny.yaml names adamw; unset, the optimizer follows lora.enabled
    assert load_config("configs/tiny.yaml", ["train.optimizer=null"]).train.optimizer == "adamw"
    assert load_config("configs/tiny.yaml", ["lora.enabled=false", "train.optimizer=null"]).train.optimizer == "adafactor"
    assert load_config("configs/tiny.yaml", ["lora.enabled=false", "train.optimizer=adamw"]).train.optimizer == "adamw"


def test_adafactor_full_finetune_on_fsdp_tp_mesh_then_merge(tiny_dir, tmp_path):
    ckpt = tmp_path / "full"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", "lora.enabled=false", "train.optimizer=null", "train.max_steps=4", "train.batch_size=8",
                   "train.learning_rate=0.01", "data.eval_path=null", "mesh.fsdp=4", "mesh.tp=2", env=EIGHT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    assert meta["config"]["train"]["optimizer"] == "adafactor"
    losses = [json.loads(l)["loss"] for l in (ckpt / "metrics.jsonl").read_text().splitlines()
              if json.loads(l)["mode"] == "train"]
    assert len(losses) == 4 and all(l == l for l in losses) and losses[-1] < losses[0]

    # resumed from step 2 on another slice (2 devices, fsdp=2): the same step 4. Every adafactor resume failed
    # (IndexError / IndivisibleError, one device too): the factored moments' annotations were fitted after the restore
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed)
    shutil.rmtree(resumed / "4")
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={resumed}", "lora.enabled=false", "train.optimizer=null", "train.max_steps=4",
                   "train.batch_size=8", "train.learning_rate=0.01", "data.eval_path=null", "mesh.fsdp=2", "mesh.tp=1",
                   env=xla_env(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and abs(summary["final_train_loss"] - losses[-1]) < 1e-4, (summary, losses)
    out = tmp_path / "merged"
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "full fine-tune" in proc.stderr and (out / "config.json").is_file()

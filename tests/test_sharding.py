"""Mesh and sharding on 8 simulated CPU devices: same losses on every mesh layout."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
MESHES = {
    "1x1x1": ["mesh.data=1", "mesh.fsdp=1", "mesh.tp=1"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8", "mesh.tp=1"],
    "fsdp4_tp2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tp=2"],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4", "mesh.tp=1"],
}


def train_losses(tiny_dir, ckpt, mesh_args, env):
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", "train.max_steps=3", "train.batch_size=8", "data.eval_path=null",
                   *mesh_args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in (Path(ckpt) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["mode"] == "train"]


def test_same_loss_on_every_mesh(tiny_dir, tmp_path):
    single = train_losses(tiny_dir, tmp_path / "single", MESHES["1x1x1"], {"XLA_FLAGS": ""})
    for name, args in MESHES.items():
        got = train_losses(tiny_dir, tmp_path / name, args, EIGHT) if name != "1x1x1" else single
        assert len(got) == 3
        for a, b in zip(got, single):
            assert abs(a - b) < 1e-5, (name, got, single)


def test_mesh_that_does_not_fit_is_refused(tiny_dir, tmp_path):
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={tmp_path}/ck", "mesh.fsdp=3", "mesh.tp=1", env=EIGHT)
    assert proc.returncode != 0
    assert "mesh" in proc.stderr and "Traceback" not in proc.stderr

"""Two JAX processes on loopback (4 CPU devices each, gloo collectives) train the tiny model to the
same losses as one process with 8 devices; each process reads only its slice of every batch."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, xla_env

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(tiny_dir, ckpt):
    return [sys.executable, "-m", "gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
            f"checkpoint.dir={ckpt}", f"train.max_steps={STEPS}", "train.batch_size=8", "data.eval_max_batches=1",
            "checkpoint.every_steps=100"]


def _env(devices: int, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **xla_env(devices)}
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    env.update(extra)
    return env


def _metrics(ckpt: Path, mode: str) -> list[float]:
    rows = [json.loads(l) for l in (ckpt / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["mode"] == mode]


# SGD, not AdamW: Adam's first updates are ~±lr whatever a gradient's size, so a ~1e-8 gradient whose sign flips
# with the summation order (which differs per mesh and per process count) would move a weight by lr
SGD = ["train.optimizer=sgd", "train.learning_rate=0.1"]


@pytest.fixture(scope="module")
def one_process_losses(tiny_dir, tmp_path_factory):
    """The one-process reference both process pairs are compared with (run once: ~40 s of CI), before the pairs: on
    a 2-core machine three training processes at once took no less time in all and once starved one past its
    600 s limit in CI. Any mesh of the same 8 devices gives these losses (tests/test_sharding.py)."""
    single = tmp_path_factory.mktemp("multihost") / "single"
    ref = subprocess.run(_args(tiny_dir, single) + SGD, cwd=REPO, capture_output=True, text=True, env=_env(8),
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return {mode: _metrics(single, mode) for mode in ("train", "eval")}


@pytest.mark.xdist_group("multihost_pair")  # with the dcn pair: one worker, one reference run
def test_two_processes_match_one_process(tiny_dir, tmp_path, one_process_losses):
    port = _free_port()
    multi = tmp_path / "multi"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]  # files, not pipes: an unread pipe can block a writer
    files = [log.open("w") for log in logs]
    procs = [subprocess.Popen(_args(tiny_dir, multi) + SGD, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                       JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
             for i, f in enumerate(files)]
    for p, f in zip(procs, files):
        p.wait(timeout=600)
        f.close()
    errs = [log.read_text() for log in logs]
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    for err in errs:
        assert "process 0 of 2" in err or "process 1 of 2" in err, err[-2000:]
        assert "4 local / 8 global devices" in err, err[-2000:]

    want, got = one_process_losses["train"], _metrics(multi, "train")
    assert len(want) == len(got) == STEPS
    for a, b in zip(got, want):
        assert abs(a - b) < 1e-5, (got, want)
    want_eval, got_eval = one_process_losses["eval"], _metrics(multi, "eval")
    assert len(got_eval) == len(want_eval) == 2
    for a, b in zip(got_eval, want_eval):
        assert abs(a - b) < 1e-5, (got_eval, want_eval)
    # one writer: every metric once, the checkpoint complete
    assert (multi / str(STEPS) / "model_params").is_dir()
    assert json.loads((multi / "summary.json").read_text())["steps"] == STEPS


def test_tp_across_processes_is_refused_before_the_model_loads():
    """2 processes with mesh.tp spanning them (data×fsdp = 1): each process passes its own half of every batch,
    which JAX cannot lay on a batch replicated over both ("Invalid host data, each dimension should match either
    global or process shape", a traceback at the first batch after the model loaded). Refused up front."""
    from gemma_tpu.core.config import RunConfig
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.run import check_batch_divisible

    cfg = RunConfig()
    with pytest.raises(UserError, match=r"^mesh data×fsdp = 1 does not split the batch over the 2 processes: .* a "
                                        r"multiple of 2 \(keep mesh.tp=4 within one host's devices\)$"):
        check_batch_divisible(cfg, {"data": 1, "fsdp": 1, "tp": 4}, 2)
    with pytest.raises(UserError, match="data×fsdp = 2 does not split the batch over the 4 processes"):
        check_batch_divisible(cfg, {"data": 1, "fsdp": 2, "tp": 4}, 4)
    check_batch_divisible(cfg, {"data": 1, "fsdp": 2, "tp": 2}, 2)  # each process's devices hold one fsdp shard
    check_batch_divisible(cfg, {"data": 1, "fsdp": 1, "tp": 4}, 1)


def test_each_process_reads_its_slice():
    """Process p's batches are rows p::2 of the one-process batches: disjoint, and together the same rows."""
    import numpy as np

    from gemma_tpu.data import batching
    from gemma_tpu.data.pipeline import Prepared, TrainStream

    ex = [batching.Example(np.array([2, 10 + i, 11 + i, 1], np.int32), np.array([0, 0, 1, 1], bool), f"row{i}")
          for i in range(24)]
    rows = batching.make_rows(ex, 8, "pad")
    prepared = Prepared("mem", rows, batching.FitReport(), 8, 8)
    one = TrainStream(prepared, 8, seed=0)
    two = [TrainStream(prepared, 8, seed=0, process_index=p, process_count=2) for p in range(2)]
    for _ in range(5):
        full = next(one)["tokens"][:, 1]
        parts = [next(s)["tokens"][:, 1] for s in two]
        assert len(parts[0]) == len(parts[1]) == 4
        assert not set(parts[0]) & set(parts[1])
        assert sorted([*parts[0], *parts[1]]) == sorted(full)
        assert list(parts[0]) == list(full[0::2]) and list(parts[1]) == list(full[1::2])


def test_when_jax_distributed_starts(monkeypatch):
    """Config keys win over JAX_* variables; a TPU pod is detected; one process needs nothing."""
    import pytest

    from gemma_tpu.core.config import MeshConfig
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.mesh import distributed_settings

    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES",
              "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    assert distributed_settings(MeshConfig()) is None
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert distributed_settings(MeshConfig()) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                                  "process_id": 3}
    assert distributed_settings(MeshConfig(coordinator_address="h:1", num_processes=2, process_id=0)) == {
        "coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
    with pytest.raises(UserError, match="process_id=5 is not in"):
        distributed_settings(MeshConfig(process_id=5))
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    with pytest.raises(UserError, match="needs mesh.coordinator_address"):
        distributed_settings(MeshConfig())
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    monkeypatch.delenv("JAX_PROCESS_ID")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1-w-0,t1-w-1,t1-w-2,t1-w-3")
    assert distributed_settings(MeshConfig()) == {}  # jax.distributed.initialize() detects the pod
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert distributed_settings(MeshConfig()) is None  # a single-host slice (v5p-8)


@pytest.mark.parametrize("mesh, named", [
    (dict(coordinator_address="10.0.0.2:1234"), "mesh.coordinator_address=10.0.0.2:1234"),
    (dict(process_id=2), "mesh.process_id=2"),
    (dict(coordinator_address="h:1", process_id=0), "mesh.coordinator_address=h:1 and mesh.process_id=0"),
])
def test_a_multi_process_key_without_the_process_count_is_refused(monkeypatch, mesh, named):
    """mesh.coordinator_address (or mesh.process_id) without mesh.num_processes started no jax.distributed: each
    host ran the whole run alone as one process, silently. Refused; num_processes=1 is a single-process run."""
    from gemma_tpu.core.config import MeshConfig
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.mesh import distributed_settings

    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES",
              "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match=rf"^{re.escape(named)} set without mesh.num_processes \(or JAX_NUM_"):
        distributed_settings(MeshConfig(**mesh))
    assert distributed_settings(MeshConfig(**mesh, num_processes=1)) is None
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert distributed_settings(MeshConfig(**mesh)) is None


def test_mesh_shapes():
    import pytest

    from gemma_tpu.core.config import MeshConfig
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.mesh import mesh_shape

    assert mesh_shape(MeshConfig(), 8) == (1, 8, 1)
    assert mesh_shape(MeshConfig(data=2, fsdp=-1, tp=2), 16) == (2, 4, 2)
    assert mesh_shape(MeshConfig(data=-1, fsdp=4, tp=1), 8) == (2, 4, 1)
    assert mesh_shape(MeshConfig(data=1, fsdp=4, tp=1, dcn_data=2), 8) == (2, 4, 1)  # 2 slices × 4 chips
    with pytest.raises(UserError, match="only one of"):
        mesh_shape(MeshConfig(data=-1, fsdp=-1), 8)
    with pytest.raises(UserError, match="not divisible"):
        mesh_shape(MeshConfig(fsdp=-1, tp=3), 8)


_LOAD_CHILD = r"""
import json, sys
import numpy as np
from gemma_tpu.core.config import MeshConfig
from gemma_tpu.train import mesh as mesh_lib
mesh_lib.initialize_distributed(MeshConfig())
import jax
from flax import nnx
from gemma_tpu.models import load_model, resolve_model
from gemma_tpu.models import sharded_weights
from gemma_tpu.train.partition import flat_params, with_rules

mesh = mesh_lib.build_mesh(MeshConfig(fsdp=-1))
out = {}
for name, path in json.loads(sys.argv[1]).items():
    resolved = resolve_model(path)
    ruled = type(resolved)(**{**resolved.__dict__, "family": with_rules(resolved.family)})
    with mesh:
        model, cfg = load_model(ruled, "float32", mesh=mesh)
        stats = sharded_weights.LAST_STATS
        ref = resolved.family.reference_loader(path, ruled.family.tunix_config(resolved.hf_config, np.float32),
                                                mesh=mesh, dtype=np.float32)
    ours, theirs = dict(flat_params(model)), dict(flat_params(ref))
    assert ours.keys() == theirs.keys()
    replicated = 0
    for k, a in ours.items():
        b = theirs[k]
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), k
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            assert sa.index == sb.index and np.array_equal(np.asarray(sa.data), np.asarray(sb.data)), k
        if a.sharding.is_fully_replicated:
            replicated += a.size * a.dtype.itemsize
    out[name] = {"read": stats.bytes_read, "checkpoint": stats.checkpoint_bytes, "replicated": replicated,
                 "process": jax.process_index()}
print("RESULT " + json.dumps(out))
"""


def test_each_host_reads_only_its_shards(tiny_dir, tmp_path):
    """Two processes load the tiny Gemma 3 and a tiny Gemma 4 onto one fsdp=8 mesh: every local shard
    equals Tunix's loader's, and each byte of a sharded weight is read by exactly one process (a
    replicated one by both), so each host reads about half the checkpoint."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4

    models = {"gemma3": str(tiny_dir), "gemma4": str(write_tiny_gemma4(tmp_path / "g4", variant="ple"))}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_CHILD, json.dumps(models)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o, _ in outs]
    assert {r["gemma3"]["process"] for r in results} == {0, 1}
    for name in models:
        per = [r[name] for r in results]
        checkpoint, replicated = per[0]["checkpoint"], per[0]["replicated"]
        assert replicated < 0.2 * checkpoint, per
        assert sum(p["read"] for p in per) == checkpoint + replicated, per
        for p in per:
            assert p["read"] < 0.6 * checkpoint, per


@pytest.mark.xdist_group("multihost_pair")
def test_dcn_data_groups_processes(tiny_dir, tmp_path, one_process_losses):
    """mesh.dcn_data=2 on two processes without TPU slices: each process is one DCN group (its
    devices form one row of the data axis, so only data parallelism crosses hosts), and training
    on that mesh gives the losses of one process."""
    port = _free_port()
    multi = tmp_path / "dcn"
    procs = [subprocess.Popen(_args(tiny_dir, multi) + SGD + ["mesh.data=1", "mesh.fsdp=4", "mesh.tp=1",
                                                              "mesh.dcn_data=2"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
        # each process's devices form one row of the data axis: one DCN group a process
        assert "mesh.dcn_data=2 (data=2 fsdp=4 tp=1): the process of each data row [[0], [1]]" in err, err[-3000:]
    for mode in ("train", "eval"):
        want, got = one_process_losses[mode], _metrics(multi, mode)
        assert len(want) == len(got) == {"train": STEPS, "eval": 2}[mode]
        for a, b in zip(got, want):
            assert abs(a - b) < 1e-5, (mode, got, want)

"""The base is the base (gemma_tpu.hf.fingerprint): a checkpoint records a cheap fingerprint of its base's
weights; merge, PEFT export and resume refuse a base that no longer matches (naming the first differing
file) unless told otherwise, and runs that recorded none are warned about, not refused."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.assets.tiny import write_tiny_gemma3
from gemma_tpu.core.cli import cli_main
from gemma_tpu.hf.fingerprint import fingerprint, first_difference
from tests.test_convert import make_checkpoint


def _cli(main, *args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli_main(main, [str(a) for a in args])
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A tiny Gemma 3 of exactly the same shapes as conftest's, with other weights."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("other") / "gemma3", seed=1)


def test_fingerprint_is_content_not_path(tiny_dir, other, tmp_path):
    fp = fingerprint(tiny_dir)
    names = [f["name"] for f in fp["files"]]
    assert "model.safetensors" in names and "config.json" in names
    copy = shutil.copytree(tiny_dir, tmp_path / "copy")
    assert first_difference(fp, copy) is None
    st = next(f for f in fp["files"] if f["name"] == "model.safetensors")
    st_other = next(f for f in fingerprint(other)["files"] if f["name"] == "model.safetensors")
    assert st["size"] == st_other["size"] and st["header_sha256"] == st_other["header_sha256"]  # same shapes
    assert first_difference(fp, other) == f"{other / 'model.safetensors'}: tensor data differs"


def test_fingerprint_names_missing_truncated_and_extra_files(tiny_dir, tmp_path):
    fp = fingerprint(tiny_dir)
    d = shutil.copytree(tiny_dir, tmp_path / "d")
    (d / "extra.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    assert first_difference(fp, d) == f"{d / 'extra.safetensors'} was not part of the base at training time"
    (d / "extra.safetensors").unlink()
    size = (d / "model.safetensors").stat().st_size
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(size - 100)
    assert first_difference(fp, d) == f"{d / 'model.safetensors'} is {size - 100} bytes, was {size}"
    (d / "model.safetensors").unlink()
    assert first_difference(fp, d) == f"{d / 'model.safetensors'} is missing"


@pytest.fixture(scope="module")
def replaced(tiny_dir, other, tmp_path_factory):
    """A LoRA checkpoint of a copy of the tiny base, whose weights are then replaced in place by
    another model of the same shapes (the issue's case: the merge used to succeed silently)."""
    work = tmp_path_factory.mktemp("fp")
    base = shutil.copytree(tiny_dir, work / "base")
    make_checkpoint(base, work / "ck")
    shutil.copyfile(other / "model.safetensors", base / "model.safetensors")
    return work


def test_merge_refuses_a_replaced_base(replaced):
    from convert.merge_orbax import main

    out = replaced / "merged"
    rc, err = _cli(main, "--checkpoint", replaced / "ck", "--out", out)
    assert rc == 2, err
    line = next(l for l in err.splitlines() if l.startswith("error:"))
    assert f"{replaced / 'base' / 'model.safetensors'}: tensor data differs" in line
    assert "--allow-base-mismatch" in line and not out.exists()
    rc, err = _cli(main, "--checkpoint", replaced / "ck", "--out", out, "--allow-base-mismatch")
    assert rc == 0, err
    assert "warning: base" in err and "going on as asked" in err and (out / "model.safetensors").is_file()


def test_export_refuses_a_replaced_base(replaced):
    from convert.export_peft import main

    out = replaced / "adapter"
    rc, err = _cli(main, "--checkpoint", replaced / "ck", "--out", out)
    assert rc == 2 and "tensor data differs" in err and not out.exists(), err
    rc, err = _cli(main, "--checkpoint", replaced / "ck", "--out", out, "--allow-base-mismatch")
    assert rc == 0 and (out / "adapter_model.safetensors").is_file(), err


def test_evaluate_and_chat_refuse_a_replaced_base(replaced):
    """The checkpoint's model for evaluate and chat (`load_checkpoint`) was restored on the replaced base without
    a word: the trained factors on another model. Refused as the merge refuses it; a base the caller passes
    (the merge's --verify, after its own check) is taken as given."""
    from gemma_tpu.checkpoint.restore import restore_model
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.infer.generate import load_checkpoint

    with pytest.raises(UserError, match=r"model\.safetensors: tensor data differs\); merge it with "
                                        r"convert\.merge_orbax --allow-base-mismatch") as e:
        load_checkpoint(str(replaced / "ck"))
    assert "\n" not in str(e.value)
    assert restore_model(replaced / "ck", base=replaced / "base").step == 1


def test_old_run_without_fingerprint_is_warned_not_refused(tiny_dir, tmp_path):
    from convert.merge_orbax import main

    make_checkpoint(tiny_dir, tmp_path / "ck")
    meta_path = tmp_path / "ck" / "gemma_tpu_run.json"
    meta = json.loads(meta_path.read_text())
    assert meta["base_model"]["fingerprint"]["files"]
    del meta["base_model"]["fingerprint"]
    meta_path.write_text(json.dumps(meta))
    rc, err = _cli(main, "--checkpoint", tmp_path / "ck", "--out", tmp_path / "m")
    assert rc == 0, err
    assert "recorded no fingerprint of its base" in err


def _shard(model_dir: Path) -> None:
    """model.safetensors split in two shards with an index, as transformers writes a larger model."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(model_dir / "model.safetensors"))
    names = list(t)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: t[k] for k in part}, str(model_dir / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in part}
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_safetensors_file_the_index_does_not_name_is_not_part_of_the_base(tiny_dir, tmp_path):
    """transformers and vLLM load the shards the index names and ignore any other *.safetensors file beside them:
    one added after training (a stray copy, a download cut short) left the model as it was, but the merge refused
    the base ('not the base it was trained on'), and a damaged one ('truncated safetensors file') even with
    --allow-base-mismatch."""
    from convert.merge_orbax import main

    base = shutil.copytree(tiny_dir, tmp_path / "base")
    _shard(base)
    make_checkpoint(base, tmp_path / "ck")
    (base / "stray.safetensors").write_bytes(b"abc")
    shutil.copyfile(base / "model-00001-of-00002.safetensors", base / "copy.safetensors")
    rc, err = _cli(main, "--checkpoint", tmp_path / "ck", "--out", tmp_path / "m")
    assert rc == 0, err
    assert "warning" not in err
    from safetensors.numpy import load_file

    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert np.array_equal(merged["model.norm.weight"],
                          load_file(str(base / "model-00002-of-00002.safetensors"))["model.norm.weight"])
    # a shard the index names is still checked
    with open(base / "model-00002-of-00002.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 4)
    rc, err = _cli(main, "--checkpoint", tmp_path / "ck", "--out", tmp_path / "m2")
    assert rc == 2 and "model-00002-of-00002.safetensors is" in err and not (tmp_path / "m2").exists(), err

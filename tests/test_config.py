"""Typed config: YAML + dotted overrides, unknown keys and bad types rejected by name."""


import os
import re
from pathlib import Path

import pytest
import yaml

from gemma_tpu.core.config import RunConfig, load_config, validate
from gemma_tpu.core.typed_yaml import parse_override
from gemma_tpu.core.errors import UserError
from tests.conftest import REPO, assert_one_line_error, run_cli

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in CONFIGS if not p.name.startswith("serve")], ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.path


def test_required_key_names_exist():
    cfg = load_config(REPO / "configs/tiny.yaml", [
        "model.path=/x", "data.train_path=a.jsonl", "data.eval_path=b.jsonl", "data.seq_len=128", "lora.rank=4",
        "lora.alpha=8", "lora.targets=[q_proj,k_proj,v_proj]", "train.max_steps=20", "train.batch_size=2",
        "train.learning_rate=1e-3", "train.seed=3", "checkpoint.dir=/tmp/x", "checkpoint.every_steps=5"])
    assert (cfg.model.path, cfg.data.seq_len, cfg.lora.rank, cfg.train.max_steps) == ("/x", 128, 4, 20)
    assert cfg.lora.targets == ["q_proj", "k_proj", "v_proj"]
    assert cfg.train.learning_rate == pytest.approx(1e-3)
    assert cfg.checkpoint.every_steps == 5 and cfg.train.seed == 3


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(UserError, match=r"unknown config key 'train.max_stpes'"):
        load_config(REPO / "configs/tiny.yaml", ["train.max_stpes=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n  dtyp: float32\n")
    with pytest.raises(UserError, match=r"bad.yaml line 3: unknown config key 'model.dtyp'"):
        load_config(bad)


@pytest.mark.parametrize("override", ["checkpoint.dir=None", "model.path=None", "data.response_field=None",
                                      "checkpoint.dir='null'"])
def test_python_none_for_a_key_that_cannot_be_null_is_refused(override):
    """`checkpoint.dir=None` (meant: no checkpoints) made a directory named None, and a quoted 'null' one named
    null."""
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"^override '{re.escape(override)}': {re.escape(key)}: got the text "
                                        r"'(None|null)'; this key cannot be null"):
        load_config(REPO / "configs/tiny.yaml", [override])


@pytest.mark.parametrize("override, meant", [
    ("train.learnig_rate=1e-3", "did you mean 'train.learning_rate'?"),
    ("data.learning_rate=1e-3", "did you mean 'train.learning_rate'?"),  # the right name in the wrong section
    ("training.max_steps=3", "did you mean 'train'?"),
    ("optimizer=adamw", "did you mean 'train.optimizer'?"),
    ("train.gradient_accumulation_steps=4", "the transformers/TRL name; here it is 'train.grad_accum_steps'"),
    ("lora.r=16", "here it is 'lora.rank'"),
    ("lora.lora_alpha=32", "here it is 'lora.alpha'"),
    ("train.per_device_train_batch_size=4", "here it is 'train.batch_size' (rows per optimizer step over all"),
    ("train.warmup_ratio=0.03", "here it is 'train.warmup_steps' (a number of steps, not a fraction"),
    ("data.max_seq_length=1024", "here it is 'data.seq_len'"),
    ("data.dataset_text_field=body", "here it is 'data.text_field'"),
    # TRL's side to cut over-long examples from: was "did you mean 'data.instruction_field'?"
    ("data.truncation_mode=keep_end", "here it is 'data.overlength' (truncate keeps the start, as TRL's keep_start"),
    ("train.MAX_STEPS=3", "did you mean 'train.max_steps'?"),  # another case: no letter in common to difflib
    ("train.epochs=2", "did you mean 'data.num_epochs'?"),  # a close name in another section: no hint at all
    ("data.eval_file=x.jsonl", "did you mean 'data.eval_path'?"),  # train_file had a hint, eval_file none
    ("data.validation_file=x.jsonl", "here it is 'data.eval_path'"),
    # a key of its own section ending in the name first: axolotl's datasets' `path` is the data file, not model.path
    ("data.path=x.jsonl", "did you mean 'data.train_path', 'data.eval_path' or 'model.path'?"),
    ("lora.remat=block", "did you mean 'train.remat'?"),  # not model.remat, its older name
    # a MaxText recipe's mesh and batch
    ("mesh.ici_fsdp_parallelism=8", "the MaxText name; here it is 'mesh.fsdp'"),
    ("mesh.ici_tensor_parallelism=2", "the MaxText name; here it is 'mesh.tp'"),
    ("mesh.dcn_data_parallelism=2", "the MaxText name; here it is 'mesh.dcn_data' (the number of slices)"),
    ("train.per_device_batch_size=2", "here it is 'train.batch_size' (rows over all devices: per_device_batch_size"),
    # another tool's way of starting from another config (Hydra's defaults, extends): none here, which it now says
    ("extends=configs/tiny.yaml", "a config does not include another here"),
    ("defaults=[base]", "a config does not include another here"),
    # other words for a key of the section: no hint, or one for another section's key of the same leaf
    ("model.name=google/gemma-3-1b-it", "did you mean 'model.path'?"),
    ("base_model=google/gemma-3-1b-it", "the axolotl name; here it is 'model.path'"),
    ("data.file=x.jsonl", "did you mean 'data.train_path'?"),
    ("checkpoint.path=runs/x", "did you mean 'checkpoint.dir'?"),  # it said model.path
    ("mesh.dp=2", "did you mean 'mesh.data'?"),  # it said mesh.fsdp
    ("mesh.model=2", "did you mean 'mesh.tp'?"),
    ("checkpoint.save_every=50", "did you mean 'checkpoint.every_steps'?"),
    ("lora.modules=[q_proj]", "did you mean 'lora.targets'?"),
])
def test_unknown_key_suggests_the_key_meant(override, meant):
    """An unknown key listed the section's keys only: a typo, a key in the wrong section or a transformers/TRL
    recipe's name for one of ours ('gradient_accumulation_steps') left the user to find it."""
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", ["train.learning_rate=1e-3", override, "train.seed=1"])
    unknown = override.split("=")[0].replace("training.max_steps", "training")  # a section it does not have
    assert str(e.value).startswith(f"override '{override}': unknown config key '{unknown}'"), str(e.value)
    assert meant in str(e.value) and "\n" not in str(e.value)


def test_every_suggested_key_exists():
    """The tables of other names point at keys RunConfig has, and name none it has (a rename would leave a hint to
    a key that is gone, or shadow a real key)."""
    from gemma_tpu.core.config import RunConfig
    from gemma_tpu.core.recipe_names import FOREIGN_NAMES, SYNONYMS
    from gemma_tpu.core.typed_yaml import leaf_keys

    keys = set(leaf_keys(RunConfig))
    assert {v[0] for v in FOREIGN_NAMES.values()} | set(SYNONYMS.values()) <= keys
    assert not keys & set(SYNONYMS) and not {k.rpartition(".")[2] for k in keys} & set(FOREIGN_NAMES)


@pytest.mark.parametrize("override,ours", [
    ("model.dtype=bf16", "here it is bfloat16"), ("train.optimizer=adamw_torch", "here it is adamw"),
    ("train.schedule=cosine", "here it is warmup_cosine"), ("train.schedule=constant_with_warmup", "constant"),
    # int4 was told "did you mean 'int8'?" (twice the 4-bit choice's memory); TRL's names had no hint
    ("lora.base_quantization=int4", "here it is nf4"), ("lora.base_quantization=4bit", "here it is nf4"),
    ("data.loss_on=completion_only", "here it is assistant"), ("data.format=conversational", "here it is messages"),
    ("data.format=language_modeling", "here it is text"),
])
def test_a_transformers_value_names_ours(override, ours):
    """A recipe's value for a choice key (`bf16`, `adamw_torch`, `cosine`) listed our choices only: the refusal now
    names the one it is (never rewritten silently)."""
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", [override])
    assert "transformers/TRL spelling" in str(e.value) and ours in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"override '{override}'") or override.split("=")[0] in str(e.value)


def test_unknown_key_in_the_file_is_blamed_on_the_file_not_the_key_it_suggests(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  learning_rate: 1e-3\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(bad))} line 2: unknown config key 'data.learning_rate' "
                                        r"\(did you mean 'train.learning_rate'\?"):
        load_config(bad, ["train.learning_rate=1e-3"])


def test_a_dotted_key_in_the_file_says_to_nest_it(tmp_path):
    """`train.max_steps: 3` at the top of a file (as an override spells it) was "unknown config key
    'train.max_steps'" with the section names: a key that exists, refused as unknown, and nothing said why."""
    bad = tmp_path / "dotted.yaml"
    bad.write_text("model:\n  dtype: float32\ntrain.max_steps: 3\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(bad))} line 3: unknown config key 'train.max_steps' "
                                        r"\(a dotted key is for the command line; in the file nest it under its "
                                        r"section, train: \{max_steps: \.\.\.\}; known: checkpoint"):
        load_config(bad)


@pytest.mark.parametrize("text", ["2024.10", "0123", "1_000", "1:30", "0x1F", "1e3", "-0.50"])
def test_a_number_given_to_a_string_key_keeps_its_spelling(text, tmp_path):
    """YAML 1.1 reads these as numbers and the string key got the number's digits: checkpoint.dir=2024.10 wrote
    to '2024.1', model.revision=0123 (octal) asked the hub for revision '83', 1:30 (base 60) became '90'."""
    cfg = load_config(None, ["checkpoint.dir=runs/x", f"model.revision={text}", f"data.instruction_field={text}"])
    assert cfg.model.revision == text and cfg.data.instruction_field == text
    path = tmp_path / "c.yaml"
    path.write_text(f"checkpoint:\n  dir: {text}\nmodel:\n  revision: {text}\ntrain:\n  max_steps: 0x10\n"
                    f"  learning_rate: 1.50e-3\n")
    cfg = load_config(path)
    assert (cfg.checkpoint.dir, cfg.model.revision) == (text, text)
    assert type(cfg.train.max_steps) is int and cfg.train.max_steps == 16  # numeric keys get plain numbers
    assert type(cfg.train.learning_rate) is float and cfg.train.learning_rate == pytest.approx(1.5e-3)
    assert yaml.safe_load(cfg.to_yaml())["model"]["revision"] == text


@pytest.mark.parametrize("text", ["2026-01-01", "2026-01-01 10:00:00", "2026-01-01T10:00:00Z"])
def test_a_date_given_to_a_string_key_keeps_its_text(text, tmp_path):
    """YAML 1.1 reads these as dates: `checkpoint.dir=2026-01-01` (a run named by its day) or a dated
    `model.revision` tag was refused as "expected a string, got datetime.date(2026, 1, 1)"."""
    cfg = load_config(None, [f"checkpoint.dir={text}", f"model.revision={text}"])
    assert (cfg.checkpoint.dir, cfg.model.revision) == (text, text)
    path = tmp_path / "c.yaml"
    path.write_text(f"checkpoint:\n  dir: {text}\nmodel:\n  revision: {text}\n")
    cfg = load_config(path)
    assert (cfg.checkpoint.dir, cfg.model.revision) == (text, text)
    assert yaml.safe_load(cfg.to_yaml())["checkpoint"]["dir"] == text  # written back quoted, read back as text
    with pytest.raises(UserError, match=rf"^override 'train.max_steps={text}': train.max_steps: expected an "
                                        rf"integer, got '{text}'$"):
        load_config(None, [f"train.max_steps={text}"])


def _refused_in_override_and_file(key: str, text: str, message: str, tmp_path) -> Path:
    """`key=text` is refused on the command line (naming the override) and in a file (naming its line 2) with the
    regex `message`; returns the file, for more cases."""
    with pytest.raises(UserError, match=rf"^override '{re.escape(key)}={re.escape(text)}': {message}"):
        load_config(None, [f"{key}={text}"])
    section, leaf = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {leaf}: {text}\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} line 2: {message}"):
        load_config(path)
    return path


@pytest.mark.parametrize("key, text, message", [
    ("train.seed", "010", "010 is octal to YAML 1.1 (8); write 8, or 10 without the leading zero"),
    ("train.max_steps", "-0_10", "-0_10 is octal to YAML 1.1 (-8); write -8, or -10 without the leading zero"),
    ("lora.alpha", "016", "016 is octal to YAML 1.1 (14); write 14, or 16 without the leading zero"),
    ("train.max_steps", "1:30", "1:30 is a base-60 number to YAML 1.1 (90); write the number itself"),
    ("train.learning_rate", "1:30.5", "1:30.5 is a base-60 number to YAML 1.1 (90.5)"),
])
def test_a_number_only_yaml11_reads_as_written_is_refused_for_a_number_key(key, text, message, tmp_path):
    """`train.seed=010` ran with seed 8 and `max_steps: 1:30` ran 90 steps: YAML 1.1 octal and base 60, which
    YAML 1.2, JSON and Python read otherwise or refuse. Hex, binary, 1_000 and a plain 0 still load."""
    _refused_in_override_and_file(key, text, f"{re.escape(key)}: {re.escape(message)}", tmp_path)
    cfg = load_config(None, ["train.max_steps=0x10", "train.seed=0", "train.batch_size=0b10", "lora.alpha=1_000"])
    assert (cfg.train.max_steps, cfg.train.seed, cfg.train.batch_size, cfg.lora.alpha) == (16, 0, 2, 1000.0)


@pytest.mark.parametrize("key, why", [
    ("train.grad_accum_steps", "optax counts micro-batches in int32"),
    ("train.batch_size", "a 32-bit integer"),
    ("checkpoint.every_steps", "a 32-bit integer"),
    ("data.max_loss_tokens", "a 32-bit integer"),
    ("mesh.fsdp", "a 32-bit integer"),
])
def test_an_integer_key_past_int32_is_refused_by_key(key, why, tmp_path):
    """`train.grad_accum_steps=1e30` was taken: the run read micro-batches for ever, holding each in memory (4 GB in
    five minutes of a tiny model), and other counts past 32 bits failed later or never; every integer key now
    stops at 2**31 - 1, in the file (by its line) as on the command line. train.seed keeps its own 2**63."""
    for text, value in (("1e30", 10**30), ("2147483648", 2**31), ("99999999999999999999999", 10**23 - 1)):
        _refused_in_override_and_file(key, text, rf"{re.escape(key)} must be at most 2147483647 \({why}\), "
                                                 rf"got {value}$", tmp_path)
    section, leaf = key.split(".")
    cfg = load_config(None, [f"{key}=2147483647", "train.seed=9223372036854775807"])
    assert getattr(getattr(cfg, section), leaf) == 2147483647 and cfg.train.seed == 2**63 - 1


@pytest.mark.parametrize("key, text, kind, value", [
    ("train.max_steps", "'5'", "an integer", 5),
    ("train.learning_rate", "'1e-3'", "a number", 1e-3),
    ("lora.alpha", '"16"', "a number", 16.0),
    ("checkpoint.async_save", "'true'", "true/false", True),
])
def test_a_quoted_value_of_a_number_or_boolean_key_is_text(key, text, kind, value, tmp_path):
    """YAML's types are the truth, in the file and in an override (parsed as a YAML scalar): `max_steps: '5'` ran 5
    steps where `async_save: 'true'` was refused as text. A quoted value is text for every key, refused in one
    form naming the key and the type; unquoted, YAML 1.2's `1e3` and `3e-4` (text to YAML 1.1) are numbers."""
    bare = text.strip("'\"")
    message = rf"{re.escape(key)}: expected {re.escape(kind)}, got '{re.escape(bare)}' \(quoted, so text to YAML; " \
              rf"write it without the quotes: {re.escape(bare)}\)$"
    path = _refused_in_override_and_file(key, text, message, tmp_path)
    section, leaf = key.split(".")
    path.write_text(f"{section}:\n  {leaf}: {bare}\n")
    assert getattr(getattr(load_config(path), section), leaf) == value
    path.write_text("train:\n  learning_rate: 3e-4\n  max_steps: 1e3\ncheckpoint:\n  dir: 1e3\n")
    cfg = load_config(path)
    assert (cfg.train.learning_rate, cfg.train.max_steps, cfg.checkpoint.dir) == (3e-4, 1000, "1e3")


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=" + "x" * 5000, "train.max_steps: expected an integer, got 'xxx"),
    ("train.bogus=" + "x" * 5000, "unknown config key 'train.bogus'"),
    ("lora.targets=[" + "x" * 5000, "is an unclosed YAML list"),
    ("data.seq_len=" + "x" * 5000 + " #c", "YAML reads '#c' as a comment"),
    ("train.max_steps:" + "x" * 5000, "is not of the form section.key=value"),
], ids=["type", "unknown", "unclosed", "comment", "no-equals"])
def test_a_long_override_is_named_by_its_key_with_its_value_cut(override, message):
    """A 5,000-character override value made a 5,000-character error line (the whole override, then the value again
    in the message); a name too long for the file system raised OSError."""
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    text = str(e.value)
    assert text.startswith(f"override '{override[:20]}") and message in text and len(text) < 500, text[:600]
    assert "(50" in text  # the cut says how long the value was


@pytest.mark.parametrize("key", ["train.run_dir", "data.train_path", "checkpoint.dir", " train.profile_dir "])
def test_a_bare_tilde_override_of_a_path_is_refused(key, tmp_path):
    """`train.run_dir=~` is YAML's null: the run silently wrote its metrics under checkpoint.dir (and
    `checkpoint.dir=~` said "expected a string, got None"); a user typing ~ for a path means the home directory."""
    with pytest.raises(UserError, match=rf"^override '{re.escape(key)}=~': a bare ~ is null to YAML, not the home "
                                        rf"directory; write {key.strip()}=null to leave it unset"):
        load_config(None, [f"{key}=~"])
    cfg = load_config(None, ["train.run_dir=null", "checkpoint.dir=~/runs/a"])  # the two meanings, spelt out
    assert cfg.train.run_dir is None and cfg.checkpoint.dir == os.path.expanduser("~/runs/a")
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  run_dir: ~\n")  # in a file, ~ is the usual YAML null
    assert load_config(path).train.run_dir is None


@pytest.mark.parametrize("key", ["~", "null", "yes", "1", "2026-01-01"])
def test_a_key_yaml_reads_as_a_value_is_named_as_written(key, tmp_path):
    """A key written `~:` was refused as "unknown config key 'None'" with no line (the file has no None), `yes:`
    as 'True': keys are names, so they are read as their text."""
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  max_steps: 3\n  {key}: 3\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} line 3: unknown config key "
                                        rf"'train.{re.escape(key)}' \(known: "):
        load_config(path)
    path.write_text(f"{key}:\n  max_steps: 3\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} line 1: unknown config key '{re.escape(key)}'"):
        load_config(path)


def test_an_override_mapping_with_a_key_twice_is_refused():
    """`train={max_steps: 3, max_steps: 4}` kept the last silently, where the same mapping in a file is refused."""
    with pytest.raises(UserError, match=r"^override 'train=\{max_steps: 3, max_steps: 4\}': 'max_steps' appears "
                                        r"twice in one mapping"):
        load_config(None, ["train={max_steps: 3, max_steps: 4}"])


def test_a_key_overridden_twice_takes_the_last_and_says_so(caplog):
    """`train.max_steps=3 --set train.max_steps=5` (a launcher appending its own override) took the last without a
    word; it still does (Helm's and OmegaConf's rule, in --help) and warns naming both. The same value twice is
    quiet."""
    with caplog.at_level("WARNING", logger="gemma_tpu.core.typed_yaml"):
        cfg = load_config(None, ["train.max_steps=3", "train.seed=1", "train.max_steps=5", "train.seed=1"])
    assert (cfg.train.max_steps, cfg.train.seed) == (5, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "train.max_steps is overridden twice ('train.max_steps=3', then 'train.max_steps=5'): the last wins"]


def test_a_config_of_the_other_tool_names_its_command():
    """A serving config given to training stopped at "unknown config key 'model.dir' (did you mean
    'checkpoint.dir'?", and a training config given to serving at "unknown config key 'model.path'"."""
    from serving.config import load_serve_config

    serve = REPO / "configs/serve-gemma3-270m-fitness.yaml"
    with pytest.raises(UserError, match=rf"^{re.escape(str(serve))}: its 'server' section says this is a serving "
                                        rf"config \(python -m serving.launch --config {re.escape(str(serve))}\); this "
                                        rf"command takes a config with the sections model, lora, data, train"):
        load_config(serve)
    tiny = REPO / "configs/tiny.yaml"
    with pytest.raises(UserError, match=rf"^{re.escape(str(tiny))}: its 'data' section says this is a training "
                                        rf"config \(python -m gemma_tpu.train --config {re.escape(str(tiny))}\)"):
        load_serve_config(tiny)


def test_peft_all_linear_targets_every_projection():
    """PEFT's target_modules="all-linear", in most TRL recipes, was refused as an unknown module."""
    from gemma_tpu.core.config import ALL_TARGETS

    assert load_config(None, ["lora.targets=all-linear"]).lora.targets == list(ALL_TARGETS)
    assert load_config(None, ["lora.targets=[all-linear]"]).lora.targets == list(ALL_TARGETS)
    with pytest.raises(UserError, match=r"lora.targets: unknown module 'all-linear'"):
        load_config(None, ["lora.targets=[q_proj,all-linear]"])


def test_a_list_written_as_text_reads_as_the_list(tmp_path):
    """`targets: "[q_proj, v_proj]"` (quoted in YAML, or a quoted override) was refused as unknown module '[q_proj',
    while the same list unquoted worked: the file, the override and the bare list now agree."""
    cfg = tmp_path / "quoted.yaml"
    cfg.write_text('lora:\n  targets: "[q_proj, v_proj]"\n')
    assert load_config(cfg).lora.targets == ["q_proj", "v_proj"]
    for ov in ('lora.targets="[q_proj, v_proj]"', "lora.targets='[q_proj,v_proj]'", "lora.targets=[q_proj,v_proj]",
               "lora.targets=q_proj,v_proj", "lora.targets=\"['q_proj', 'v_proj']\""):
        assert load_config(None, [ov]).lora.targets == ["q_proj", "v_proj"], ov
    with pytest.raises(UserError, match=r"lora.targets: unknown module 'qproj'"):
        load_config(None, ['lora.targets="[qproj, v_proj]"'])
    from gemma_tpu.core.typed_yaml import _coerce

    assert _coerce("[--seed, 1.10]", list[str], "x") == ["--seed", "1.10"]  # read as the file is: 1.10 as written


def test_bad_values_are_named(tmp_path):
    with pytest.raises(UserError, match=r"train.batch_size: expected an integer"):
        load_config(None, ["train.batch_size=four"])
    with pytest.raises(UserError, match=r"model.dtype: 'float16' is not one of"):
        load_config(None, ["model.dtype=float16"])
    with pytest.raises(UserError, match=r"lora.targets: unknown module 'qproj'"):
        load_config(None, ["lora.targets=[qproj]"])
    with pytest.raises(UserError, match=r"not of the form"):
        parse_override("train.max_steps")
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match=r"broken.yaml line \d+: not valid YAML"):
        load_config(bad)


def test_print_config_writes_a_dollar_of_a_path_so_it_reads_back(tmp_path):
    """`checkpoint.dir=/runs/a$$b` (a `$` of the path) was printed as `/runs/a$b`, which --config then read as the
    variable b and refused: the printed config must read back to the same paths."""
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", "--print-config",
                   f"checkpoint.dir={tmp_path}/a$$b", f"data.train_path={REPO}/tests/data/chat$$sample.jsonl")
    assert proc.returncode == 0, proc.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(proc.stdout)
    cfg = load_config(printed)
    assert cfg.checkpoint.dir == f"{tmp_path}/a$b"
    assert cfg.data.train_path == f"{REPO}/tests/data/chat$sample.jsonl"
    assert cfg.model.path == "embedded:tiny-gemma3"


def test_print_config_cli():
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", "--print-config", "train.max_steps=20")
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 20" in proc.stdout and "seq_len:" in proc.stdout


def test_config_given_with_equals_tilde_is_read_from_home(tmp_path):
    """`--config=~/run.yaml`: the shell expands no `~` after '=', and it was "config file not found: ~/run.yaml"."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "run.yaml").write_text("train:\n  max_steps: 7\n")
    proc = run_cli("gemma_tpu.train", "--config=~/run.yaml", "--print-config", cwd=tmp_path,
                   env={"HOME": str(home), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["train"]["max_steps"] == 7


def test_typo_cli_is_one_line():
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", "train.max_stpes=3")
    assert_one_line_error(proc, "train.max_stpes")


def test_overrides_between_options_cli():
    """Overrides after an option (`--print-config a=1 --debug b=2`) were refused: argparse took the first run
    of positionals only ('unrecognized arguments: lora.rank=2')."""
    proc = run_cli("gemma_tpu.train", "train.max_steps=20", "--config", "configs/tiny.yaml", "--print-config",
                   "lora.rank=2", "--no-compile", "train.seed=7", "--set", "train.seed=8", "--set=data.seq_len=64")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    # `--set KEY=VALUE` (Helm's spelling) is an override in its place: it was 'unrecognized arguments'
    assert (cfg["train"]["max_steps"], cfg["lora"]["rank"], cfg["train"]["seed"]) == (20, 2, 8)
    assert cfg["data"]["seq_len"] == 64


@pytest.mark.parametrize("argv, message", [
    # HfArgumentParser's spelling (a TRL recipe's command line), absl/Hydra's dotted options: "unrecognized arguments"
    (["--learning_rate", "1e-4"], "--learning_rate 1e-4: config keys are set by overrides, not options: write "
                                  "train.learning_rate=1e-4"),
    (["--max-steps=3"], "--max-steps=3: config keys are set by overrides, not options: write train.max_steps=3"),
    (["--train.max_steps=3"], "--train.max_steps=3: config keys are set by overrides, not options: write "
                              "train.max_steps=3"),
    (["--per_device_train_batch_size", "4"], "write train.batch_size=4 (the transformers/TRL name"),
    (["--shuffle", "--print-config"], "--shuffle: config keys are set by overrides, not options: write "
                                      "data.shuffle=true"),
])
def test_a_config_key_given_as_an_option_names_the_override(argv, message):
    from gemma_tpu.train.run import parse_args

    with pytest.raises(UserError) as e:
        parse_args(["--config", "configs/tiny.yaml", *argv])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_vllm_option_given_to_the_launcher_names_the_override():
    from serving.launch import parse_args

    with pytest.raises(UserError, match=r"--max-model-len 4096: config keys are set by overrides, not options: "
                                        r"write server.max_model_len=4096"):
        parse_args(["--config", "configs/serve-gemma3-270m-fitness.yaml", "--max-model-len", "4096", "--print"])


@pytest.mark.parametrize("override, message", [
    ("foo.bar=1", "override 'foo.bar=1': unknown config key 'foo'"),
    ("train.foo.bar=1", "override 'train.foo.bar=1': unknown config key 'train.foo'"),
    ("train..max_steps=3", "override 'train..max_steps=3' has no valid key"),
])
def test_unknown_section_from_an_override_names_the_override(override, message):
    """An override through a section that does not exist was blamed on the config file
    ('configs/tiny.yaml: unknown config key ...'), and 'train..max_steps' read as a key named 'train.'."""
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", [override])
    assert str(e.value).startswith(message), str(e.value)


def test_seed_past_64_bits_is_refused():
    """A seed of 2**63 loaded and dry-ran, then failed with an OverflowError traceback in JAX's PRNG (nnx.Rngs)
    once the model had loaded."""
    with pytest.raises(UserError, match=r"override 'train.seed=9223372036854775808': train.seed must be below 2\*\*63"):
        load_config(REPO / "configs/tiny.yaml", ["train.seed=9223372036854775808"])
    assert load_config(REPO / "configs/tiny.yaml", ["train.seed=9223372036854775807"]).train.seed == 2 ** 63 - 1


@pytest.mark.parametrize("override", ["model.path=", "model.path=' '"])
def test_empty_model_path_is_named(override):
    """An empty model.path was read as the working directory: 'error: config.json: missing', naming no key."""
    with pytest.raises(UserError, match=rf"override '{re.escape(override)}': model.path is empty"):
        load_config(REPO / "configs/tiny.yaml", [override])


def test_section_override_sets_its_keys_and_keeps_the_rest():
    """'train={max_steps: 3}' replaced the file's whole train section: batch_size, learning_rate and
    eval_every_steps went silently back to their defaults."""
    cfg = load_config(REPO / "configs/tiny.yaml", ["train={max_steps: 3}", "lora={rank: 2}"])
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.learning_rate) == (3, 4, pytest.approx(0.01))
    assert (cfg.lora.rank, cfg.lora.alpha) == (2, 8.0)
    with pytest.raises(UserError, match=r"override 'lora=\{foo: 1\}': unknown config key 'lora.foo'"):
        load_config(REPO / "configs/tiny.yaml", ["lora={foo: 1}"])


def test_mapping_valued_key_override_still_replaces():
    """Only dataclass sections merge; a mapping value (serving's container.env) is replaced whole."""
    from gemma_tpu.core.typed_yaml import _set_dotted
    from serving.config import ServeConfig

    tree = {"container": {"env": {"A": "1"}}}
    _set_dotted(tree, "container.env", {"B": "2"}, "override", ServeConfig)
    assert tree["container"]["env"] == {"B": "2"}
    tree = {"container": {"env": {"A": "1"}, "name": "x"}}
    _set_dotted(tree, "container", {"env": {"B": "2"}}, "override", ServeConfig)
    assert tree["container"] == {"env": {"B": "2"}, "name": "x"}


@pytest.mark.parametrize("override, message", [
    ("checkpoint.dir=", "checkpoint.dir is empty"),
    ("lora.targets=[q_proj, v_proj, q_proj]", "lora.targets: 'q_proj' is listed twice"),
    ("train.grad_clip=", "train.grad_clip is empty (give a value, or null to leave it unset)"),
    ("data.num_epochs=", "data.num_epochs is empty (give a value, or null to leave it unset)"),
])
def test_empty_checkpoint_dir_and_repeated_target_are_named(override, message):
    """An empty checkpoint.dir was the working directory (checkpoints, metadata and the run lock written among
    the user's files); a target listed twice loaded, and the FLOPs estimate counted its adapters twice. An empty
    value of a key that also takes null (an unset $VAR) said "expected a number, got ''", not that null is one."""
    with pytest.raises(UserError, match=rf"override '{re.escape(override)}': {re.escape(message)}"):
        load_config(REPO / "configs/tiny.yaml", [override])


def test_yaml_boolean_for_a_choice_says_why():
    """'data.overlength=off' read as False: 'False is not one of ...' did not say where the False came from."""
    with pytest.raises(UserError, match=r"data.overlength: False is not one of .*YAML reads a bare yes/no/on/off"):
        load_config(None, ["data.overlength=off"])
    assert load_config(None, ["data.share_prefix=off"]).data.share_prefix == "off"  # the one choice named off


@pytest.mark.parametrize("word", ["on", "yes", "true", '"on"'])
def test_on_for_an_auto_or_off_choice_is_auto(word, tmp_path):
    """`data.share_prefix: off` loaded (YAML's false read as the choice off) but its opposite `on` was refused
    as "True is not one of 'auto', 'off'"; for a choice of auto|off, on is auto. Quoted, "on" (the README's word,
    quoted as YAML advice goes) was still refused as "'on' is not one of 'auto', 'off'" while "off" loaded."""
    assert load_config(None, [f"data.share_prefix={word}"]).data.share_prefix == "auto"
    path = tmp_path / "c.yaml"
    path.write_text(f"data:\n  share_prefix: {word}\n")
    assert load_config(path).data.share_prefix == "auto"
    if word.startswith('"'):
        return
    with pytest.raises(UserError, match=r"data.strategy: True is not one of 'pad', 'pack' \(YAML reads a bare"):
        load_config(None, [f"data.strategy={word}"])  # a choice with no auto/off pair is still refused


@pytest.mark.parametrize("text", ["", "\n# only a comment\n"])
def test_empty_config_file_is_refused(tmp_path, text):
    """An empty --config (say, a redirect of a --print-config that failed) ran on every default: the 270M
    embedded model, runs/default."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    proc = run_cli("gemma_tpu.train", "--config", str(empty), "--print-config")
    assert_one_line_error(proc, f"{empty}: empty config file")
    assert not proc.stdout


@pytest.mark.parametrize("address", ["", None, "10.0.0.2:1234", "tpu-vm-0.internal:8476", "[::1]:8476"])
def test_coordinator_address_forms_that_load(address):
    """Empty or null: one host (or the JAX_* environment); host:port with a host name, IPv4 or bracketed IPv6."""
    cfg = load_config(REPO / "configs/tiny.yaml")
    cfg.mesh.coordinator_address = address
    validate(cfg)


def test_integer_keys_take_whole_numbers_written_as_floats(tmp_path):
    """`train.max_steps=1e3` (or `max_steps: 1e3` in the YAML, a string to YAML 1.1) and `2.0` were refused
    as "expected an integer"; a whole number is taken exactly, a fraction still refused naming the key."""
    cfg = load_config(None, ["train.max_steps=1e3", "train.batch_size=2.0", "train.warmup_steps=1.0e+2",
                             "data.num_epochs=3.", "mesh.fsdp=-1.0", "train.seed=12345678901234567e0"])
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.warmup_steps) == (1000, 2, 100)
    assert (cfg.data.num_epochs, cfg.mesh.fsdp, cfg.train.seed) == (3, -1, 12345678901234567)
    assert all(type(v) is int for v in (cfg.train.max_steps, cfg.train.batch_size, cfg.data.num_epochs))
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 1e3\n  batch_size: 2.0\n")
    cfg = load_config(path)
    assert (cfg.train.max_steps, cfg.train.batch_size) == (1000, 2)
    for text in ("1.5", "1e-3", ".inf", "nan"):
        with pytest.raises(UserError, match=rf"override 'train.max_steps={re.escape(text)}': train.max_steps: "
                                             rf"expected an integer"):
            load_config(None, [f"train.max_steps={text}"])
    path.write_text("train:\n  max_steps: 2.5\n")
    with pytest.raises(UserError, match=rf"{re.escape(str(path))} line 2: train.max_steps: expected an integer, got 2.5 "
                                         rf"\(not a whole number\)"):
        load_config(path)
    with pytest.raises(UserError, match=r"data.num_epochs: expected an integer, got 0.5 \(not a whole number\)"):
        load_config(None, ["data.num_epochs=0.5"])
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", "--print-config", "train.max_steps=1e3")
    assert proc.returncode == 0 and "max_steps: 1000\n" in proc.stdout, proc.stderr


@pytest.mark.parametrize("lines", [1, 2])
def test_a_data_file_given_as_the_config_says_so(tmp_path, lines):
    """`--config data.jsonl` was "unknown config key 'messages'" (one line: YAML reads a JSON object) or "not valid
    YAML (expected '<document start>' ...)"; a .json config stays a config (JSON is YAML)."""
    from serving.config import load_serve_config

    path = tmp_path / "d ü.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * lines)
    with pytest.raises(UserError, match=rf"^config file {re.escape(str(path))} is a data file, not a YAML config "
                                        rf"\(training data is given as data.train_path=FILE\)$"):
        load_config(path)
    with pytest.raises(UserError, match=rf"^config file {re.escape(str(path))} is a data file, not a YAML config$"):
        load_serve_config(path, need_dir=False)
    (tmp_path / "c.json").write_text('{"train": {"max_steps": 3}}')
    assert load_config(tmp_path / "c.json").train.max_steps == 3


def test_a_config_from_a_pipe_says_so(tmp_path):
    """`--config <(sed ... configs/x.yaml)` (a pipe, /dev/fd/63) was "config file not found", a path that exists;
    the config is read more than once (its keys' lines for errors), which a pipe cannot give."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=rf"^config file {re.escape(str(fifo))} is not a regular file \(a pipe"):
        load_config(fifo)


@pytest.mark.parametrize("data, message", [
    ("train:\n  max_steps: 3\n".encode("utf-16"), "c.yaml: UTF-16 text (it starts with a UTF-16 byte-order mark); "
                                                    "save it as UTF-8"),
    ("train:\n  max_steps: 3\n".encode("utf-16-le"), "c.yaml: UTF-16 text (ASCII characters with NUL bytes between "
                                                       "them); save it as UTF-8"),
    (b"# caf\xe9\ntrain: {max_steps: 3}\n", "c.yaml line 1: not UTF-8 text (byte offset 5: 0xe9, 'é' in "
                                            "Latin-1/Windows-1252); save it as UTF-8"),
])
def test_a_config_in_another_encoding_names_it(data, message, tmp_path):
    """A config saved as UTF-16 (PowerShell's `>`, Notepad's 'Unicode') was 'not UTF-8 text (byte offset 0)', where
    the same bytes as a data file were named UTF-16; a Latin-1 byte was an offset alone, no line, no byte."""
    (tmp_path / "c.yaml").write_bytes(data)
    with pytest.raises(UserError) as e:
        load_config(tmp_path / "c.yaml")
    assert str(e.value) == f"{tmp_path}/{message}"


@pytest.mark.parametrize("data, message", [
    ('{"model_type": "gemma3"}'.encode("utf-16"), "config.json: UTF-16 text (it starts with a UTF-16 byte-order "
                                                  "mark); save it as UTF-8"),
    (b'{"name": "caf\xe9"}', "config.json line 1: not UTF-8 text (byte offset 13: 0xe9, 'é' in Latin-1/Windows-1252); "
                             "save it as UTF-8"),
])
def test_a_json_file_in_another_encoding_names_it(data, message, tmp_path):
    """config.json, tokenizer_config.json, adapter_config.json (read_json_object) said 'not UTF-8 text' alone, as
    configs did; and were read in the locale's encoding, not UTF-8."""
    from gemma_tpu.core.errors import read_json_object

    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(UserError) as e:
        read_json_object(tmp_path / "config.json", "missing")
    assert str(e.value) == f"{tmp_path}/{message}"


def test_config_that_is_a_directory_says_so(tmp_path):
    """`--config runs/` (a directory that exists) was 'config file not found', sending users after a typo."""
    proc = run_cli("gemma_tpu.train", "--config", str(tmp_path), "--print-config")
    assert_one_line_error(proc, f"config file {tmp_path} is a directory; give a YAML file")
    assert not proc.stdout


@pytest.mark.parametrize("arg, hint", [
    ("configs/tiny.yaml", "(a config file is given with --config configs/tiny.yaml)"),
    ("train.max_steps: 3", "(write it train.max_steps=3)"),
    ("train.max_steps", ""),
])
def test_an_override_without_equals_says_what_was_meant(arg, hint):
    """A config file given without --config, or a YAML `key: value`, was only 'not of the form section.key=value'."""
    proc = run_cli("gemma_tpu.train", "--print-config", arg)
    line = assert_one_line_error(proc, f"override '{arg}' is not of the form section.key=value")
    assert line.endswith("section.key=value" + (f" {hint}" if hint else "")), line


def test_home_in_run_paths_is_expanded(tmp_path, monkeypatch):
    """`checkpoint.dir=~/runs/a` reaches the program unexpanded (the shell expands ~ only in variable
    assignments): the run wrote a directory named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["checkpoint.dir=~/runs/a", "data.train_path=~/d.jsonl", "train.run_dir=~/tb"])
    assert cfg.checkpoint.dir == f"{tmp_path}/runs/a" and cfg.train.run_dir == f"{tmp_path}/tb"
    assert cfg.data.train_path == f"{tmp_path}/d.jsonl" and cfg.data.eval_path is None
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  eval_path: ~/e.jsonl\n")
    assert load_config(path).data.eval_path == f"{tmp_path}/e.jsonl"
    # ... and so are environment variables, which nothing expands in a YAML file (or a quoted override): the run
    # wrote a directory named '$HOME'; a '$' that names no variable is part of the name
    monkeypatch.setenv("GEMMA_TPU_TEST_DATA", str(tmp_path / "d"))
    path.write_text("model:\n  path: $HOME/m\ndata:\n  train_path: ${GEMMA_TPU_TEST_DATA}/t.jsonl\n"
                    "checkpoint:\n  dir: $HOME/runs/a\ntrain:\n  run_dir: runs/cost$5\n")
    cfg = load_config(path)
    assert (cfg.model.path, cfg.data.train_path) == (f"{tmp_path}/m", f"{tmp_path}/d/t.jsonl")
    assert (cfg.checkpoint.dir, cfg.train.run_dir) == (f"{tmp_path}/runs/a", "runs/cost$5")
    # `$$` is a `$` of the path (docker compose's escape): a directory named `$HOME` or `$x` could not be given
    cfg = load_config(path, ["checkpoint.dir=/r/$$HOME/a", "train.run_dir=/r/$${X}$$$HOME"])
    assert (cfg.checkpoint.dir, cfg.train.run_dir) == ("/r/$HOME/a", f"/r/${{X}}${tmp_path}")
    # docker compose's defaults are read; another `${` or a `$(` is refused: `${RUNS:-runs}/a` and `$(pwd)/a` were
    # kept as written, a directory of that name made in the working directory
    monkeypatch.delenv("GEMMA_TPU_TEST_UNSET", raising=False)
    monkeypatch.setenv("GEMMA_TPU_TEST_EMPTY", "")
    cfg = load_config(None, ["checkpoint.dir=${GEMMA_TPU_TEST_UNSET:-/r}/a", "train.run_dir=${GEMMA_TPU_TEST_EMPTY-x}y",
                             "data.train_path=${GEMMA_TPU_TEST_DATA:-/nope}/t.jsonl"])
    assert (cfg.checkpoint.dir, cfg.train.run_dir, cfg.data.train_path) == ("/r/a", "y", f"{tmp_path}/d/t.jsonl")
    for value, message in [("${GEMMA_TPU_TEST_EMPTY:?give the runs directory}/a",
                            "the environment variable GEMMA_TPU_TEST_EMPTY is set but empty: give the runs directory"),
                           ("${HOME/a", "'${' starts no variable form read here ($NAME, ${NAME}, ${NAME:-default}, "
                                        "${NAME:?message}; $$ for a $ of the path)"),
                           ("$(pwd)/a", "'$(' is a shell's command substitution, not run here: write the path out")]:
        with pytest.raises(UserError) as e:
            load_config(None, [f"checkpoint.dir={value}"])
        assert str(e.value).startswith(f"override 'checkpoint.dir={value}': checkpoint.dir={value!r}: {message}")


@pytest.mark.parametrize("text, line, message", [
    ("data:\n  seq_len: 64\n  strategy: packed\n", 3, "data.strategy: 'packed' is not one of"),
    ("train:\n  batch_size: 2\n  learning_rate: 0\n", 3, "train.learning_rate must be positive"),
    ("train: 3\n", 1, "train: expected a mapping, got 3"),
    ("lora:\n  rank: 4\n  rnak: 8\n", 3, "unknown config key 'lora.rnak' (did you mean 'lora.rank'?"),
    ("base: &t {max_steps: x}\ntrain:\n  <<: *t\n", 1, "train.max_steps: expected an integer, got 'x'"),
    ("base: &t {max_steps: 3}\ntrian:\n  seed: 1\n", 1, "unknown config key 'base'"),  # referred to by nothing
    ("train:\n  <<: {max_steps: x}\n  seed: 1\n", 2, "train.max_steps: expected an integer, got 'x'"),
    ("train:\n  max_steps: 3\n  schedule: warmup_cosine\n  warmup_steps: 5\n", 4,
     "train.warmup_steps=5 is longer than train.max_steps=3"),
    # the constant schedule warms up too (optim.make_schedule): its warmup past the run was cut to the run unsaid
    ("train:\n  max_steps: 3\n  warmup_steps: 5\n", 3, "train.warmup_steps=5 is longer than train.max_steps=3"),
    ("data:\n  shuffle: on\n  strategy: yes\n", 3, "data.strategy: True is not one of 'pad', 'pack' (YAML reads a "
     "bare yes/no/on/off/true/false as a boolean; write one of the choices)"),
    # a key left without its value (null) where null is not taken: it was "expected an integer, got None"
    ("train:\n  seed: 1\n  max_steps:\n", 3, "train.max_steps: null (no value given), which this key does not take; "
     "give an integer"),
    ("data:\n  strategy: ~\n", 2, "data.strategy: null (no value given), which this key does not take; give one of "
     "'pad', 'pack'"),
])
def test_a_bad_value_in_the_file_names_its_line(tmp_path, text, line, message):
    """A bad value in a long YAML file named the key but not where it is ('run.yaml: data.strategy: ...');
    the error now gives the line of the key, as YAML syntax errors and repeated keys already did."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path} line {line}: {message}"), str(e.value)


def test_a_bad_value_from_an_override_still_names_the_override(tmp_path):
    """The file line is only given when the file set the value: an override that set it is named instead."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 3\n")
    with pytest.raises(UserError, match=r"^override 'train.max_steps=0': train.max_steps must be positive"):
        load_config(path, ["train.max_steps=0"])
    proc = run_cli("gemma_tpu.train", "--config", str(path), "--print-config", "data.strategy=zip")
    assert_one_line_error(proc, "override 'data.strategy=zip': data.strategy: 'zip' is not one of")
    path.write_text("model:\n  path: x\n\ndata:\n  seq_len: 4\n")
    proc = run_cli("gemma_tpu.train", "--config", str(path), "--print-config")
    assert_one_line_error(proc, f"{path} line 5: data.seq_len must be at least 8, got 4")
    assert not proc.stdout


@pytest.mark.parametrize("key", ["instruction_field", "response_field", "text_field"])
def test_an_empty_field_name_is_refused(key):
    """`data.text_field=` passed and every row then failed with "missing field ''"."""
    with pytest.raises(UserError, match=rf"^override 'data.{key}=': data.{key} is empty"):
        load_config(REPO / "configs/tiny.yaml", [f"data.{key}="])
    assert load_config(REPO / "configs/tiny.yaml", ["data.context_field=null"]).data.context_field is None



@pytest.mark.parametrize("overrides, message", [
    (["data.response_field=instruction"], "data.instruction_field and data.response_field both name 'instruction'"),
    (["data.instruction_field=q", "data.response_field=a", "data.context_field=a"],
     "data.context_field and data.response_field both name 'a'"),
    (["data.context_field=instruction"], "data.instruction_field and data.context_field both name 'instruction'")])
def test_one_field_named_for_two_parts_of_an_instruction_row_is_refused(overrides, message):
    """An instruction row read with its answer field naming its question field trained the model to echo the
    question (and a context field naming either put it in the prompt twice, or the answer in the prompt), silently."""
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(REPO / "configs/tiny.yaml", overrides)

@pytest.mark.parametrize("override", ["train.run_dir=None", "train.grad_clip=none", "data.num_epochs=None",
                                      "train.optimizer=None", "model.revision=None", "model.family=None",
                                      "train.profile_dir='null'", 'data.eval_path="NULL"'])
def test_python_none_for_a_nullable_key_is_refused(override):
    """`train.run_dir=None` was the text 'None': the run wrote its metrics to a directory named None (and a
    revision or a family named 'None' failed far later); `train.profile_dir: 'null'` (quoted) profiled into a
    directory named null. A choice spelled none (train.remat) still loads."""
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"^override '{re.escape(override)}': {re.escape(key)}: got the text "
                                        r"'([Nn]one|null|NULL)', not null; write null"):
        load_config(REPO / "configs/tiny.yaml", [override])
    assert load_config(REPO / "configs/tiny.yaml", ["train.remat=none"]).train.remat == "none"
    assert load_config(REPO / "configs/tiny.yaml", [f"{key}=null"]) is not None


@pytest.mark.parametrize("override, meant", [
    ("data.strategy=packed", "'pack'"), ("data.strategy=Pack", "'pack'"), ("train.schedule=warmup_cosin", "'warmup_cosine'"),
    ("data.overlength=truncated", "'truncate'"), ("model.dtype=bfloat", "'bfloat16'"), ("mesh.accelerator=V5E", "'v5e'"),
])
def test_a_misspelt_choice_suggests_the_choice_meant(override, meant):
    """A choice typed in another case or misspelt was only told the list of choices."""
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", [override])
    assert str(e.value).endswith(f"(did you mean {meant}?)"), str(e.value)
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", ["data.format=chat"])
    assert "did you mean" not in str(e.value)


def test_a_large_value_in_the_wrong_place_is_quoted_cut_to_a_line(tmp_path):
    """The value of a wrong type was quoted whole: a 5,000-item list as train.run_dir made a 35 KB error line, and an
    alias of an alias (YAML's "billion laughs", a few hundred bytes of file) one of 34 MB."""
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + \
        [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcd", "bcde")]
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(rows) + "\ntrain:\n  run_dir: *e\n  seed: 1\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path} line 7: train.run_dir: expected a string, got [[[[") and \
        len(str(e.value)) < 200 + len(str(path)), str(e.value)[:300]
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/tiny.yaml", ["lora.targets=" + "x" * 1000 + ": 1"])
    shown = str(e.value).partition("lora.targets: expected a list, got ")[2]
    assert shown.startswith("{'xxx") and "..." in shown and len(shown) < 100, str(e.value)[-300:]


@pytest.mark.parametrize("text, line, message", [
    ("base: &b\n  max_steps: 3\ntrain:\n  <<: *b\n  seed: &b 2\n", 5,
     "found duplicate anchor 'b'; first occurrence (line 1), second occurrence"),
    ("train:\n  max_steps: 3\n---\ntrain:\n  seed: 1\n", 3,
     "expected a single document in the stream (line 1), but found another document"),
])
def test_a_yaml_error_says_both_halves_of_pyyaml_message(text, line, message, tmp_path):
    """PyYAML splits some errors into a context and a problem: a duplicate anchor was "not valid YAML (second
    occurrence)" and a second document "(but found another document)", the half that says nothing alone."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    where = re.escape(f"{path} line {line}")
    with pytest.raises(UserError, match=rf"^{where}: not valid YAML \({re.escape(message)}\)$"):
        load_config(path)


@pytest.mark.parametrize("key", ["checkpoint.dir", "data.train_path", "model.path", "lora.targets"])
def test_a_nul_character_in_a_config_text_is_refused_by_key(key, tmp_path):
    """YAML's "\\0" escape put a NUL into a path: checkpoint.dir stopped training with a ValueError traceback
    (embedded null byte) from os.path.realpath. A NUL byte in the file itself was PyYAML's two-line message with a
    character position, no line."""
    section, leaf = key.split(".")
    path = tmp_path / "run.yaml"
    value = '["q_proj\\0"]' if leaf == "targets" else '"runs/a\\0b"'
    path.write_text(f"train:\n  max_steps: 3\n{section}:\n  {leaf}: {value}\n")
    where = re.escape(f"{path} line 4: {key}{'[0]' if leaf == 'targets' else ''}: ")
    with pytest.raises(UserError, match=rf"^{where}'.*\\x00.*' holds a NUL character, which no path, name or text"):
        load_config(path)
    path.write_bytes(b"train:\n  max_steps: 3\n  seed: 1\x00\n")
    where = re.escape(f"{path} line 3")
    with pytest.raises(UserError, match=rf"^{where}: not valid YAML \(character #x0000, which YAML does not allow in a "
                                        rf"file; a NUL byte"):
        load_config(path)


def test_a_tab_in_the_yaml_says_to_indent_with_spaces(tmp_path):
    """A tab-indented config got PyYAML's "found character '\\t' that cannot start any token" only."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n\tmax_steps: 3\n")
    proc = run_cli("gemma_tpu.train", "--config", str(path), "--print-config")
    assert_one_line_error(proc, f"{path} line 2: not valid YAML", "YAML indents with spaces, not tabs")
    assert not proc.stdout


@pytest.mark.parametrize("text", ["train:\n  max_steps:\t3\n", "train:\n  max_steps: 3\t# steps\n"])
def test_a_tab_after_text_is_not_called_indentation(text, tmp_path):
    """A tab between a key and its value, or before a comment, was refused with "YAML indents with spaces, not tabs",
    in a file indented with spaces: that tab indents nothing."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path} line 2: not valid YAML (") and str(e.value).endswith(
        "a tab after text on its line, before a value or a comment, which PyYAML (the reader here) refuses where "
        "YAML 1.2 allows it; write a space)"), str(e.value)


def test_a_list_override_split_by_the_shell_says_to_quote_it():
    """`lora.targets=[q_proj, v_proj]` unquoted reaches us as two words: the first was read as the text
    '[q_proj,' and refused as `unknown module '[q_proj'`; now the unclosed list is named with the fix."""
    with pytest.raises(UserError, match=r"^override 'lora.targets=\[q_proj,': '\[q_proj,' is an unclosed YAML list; "
                                        r"a space splits a shell word, so quote the whole override"):
        load_config(None, ["lora.targets=[q_proj,", "v_proj]"])
    assert load_config(None, ["lora.targets=[q_proj, v_proj]"]).lora.targets == ["q_proj", "v_proj"]
    assert load_config(None, ["lora.targets=[q_proj,v_proj]"]).lora.targets == ["q_proj", "v_proj"]
    # a mapping's advice was the list's ('data=[a, b]', or no spaces: `{train_path:x}` is the key 'train_path:x')
    with pytest.raises(UserError) as e:
        load_config(None, ["data={train_path:", "x}"])
    assert str(e.value) == ("override 'data={train_path:': '{train_path:' is an unclosed YAML mapping; a space splits "
                            "a shell word, so quote the whole override ('data={train_path: ...}', the space after the "
                            "colon kept) or set its keys one by one (data.train_path=...)")
    assert load_config(None, ["data={train_path: x}"]).data.train_path == "x"


@pytest.mark.parametrize("overrides, message", [
    (["train.profile_dir=prof", "train.profile_skip_steps=-1"], "train.profile_skip_steps must be at least 0, got -1"),
    (["train.profile_dir=prof", "train.profile_steps=0"], "train.profile_steps must be positive, got 0"),
    (["train.profile_dir=prof", "train.profile_skip_steps=5"],  # tiny: max_steps 6
     "train.profile_skip_steps=5 + train.profile_steps=2 go past train.max_steps=6"),
    (["train.profile_dir="], "train.profile_dir is empty"),
])
def test_bad_profile_window_is_refused_naming_the_key(overrides, message):
    """A profile window Tunix would refuse (a ValueError once the model had loaded) or cut short, named at load."""
    with pytest.raises(UserError, match=rf"override '{re.escape(overrides[-1])}': {re.escape(message)}"):
        load_config(REPO / "configs/tiny.yaml", overrides)
    cfg = load_config(REPO / "configs/tiny.yaml", ["train.profile_dir=~/p", "train.profile_skip_steps=4"])
    assert cfg.train.profile_dir == os.path.expanduser("~/p") and cfg.train.profile_steps == 2



@pytest.mark.parametrize("override", ["data.eval_path=", "data.eval_path=' '", "data={eval_path: ''}"])
def test_an_empty_eval_path_is_not_taken_as_unset(override):
    """`data.eval_path=` (or an empty shell variable after the '=') read as '' and then as unset: the run trained
    without evaluation and said nothing. It is refused as an empty profile_dir is; null unsets."""
    with pytest.raises(UserError, match=rf"^override '{re.escape(override)}': data.eval_path is empty \(give a "
                                        rf"file, or null for no evaluation\)$"):
        load_config(REPO / "configs/tiny.yaml", [override])
    with pytest.raises(UserError, match=r"data.train_path is empty \(give a file"):
        load_config(REPO / "configs/tiny.yaml", ["data.train_path="])
    assert load_config(REPO / "configs/tiny.yaml", ["data.eval_path=null"]).data.eval_path is None


def _optional_text_keys() -> list[str]:
    """Every `str | None` key of RunConfig."""
    import dataclasses
    import typing

    return [f"{section}.{key}" for section, tp in typing.get_type_hints(RunConfig).items()
            if dataclasses.is_dataclass(tp) for key, t in typing.get_type_hints(tp).items() if t == (str | None)]


@pytest.mark.parametrize("key", [k for k in _optional_text_keys() if k != "mesh.coordinator_address"])
def test_an_empty_optional_text_key_is_refused_not_taken_as_unset(key):
    """`train.run_dir=` (an empty shell variable) was read as '' and then as unset: the metrics went into
    checkpoint.dir; `model.revision=` took the hub's main branch, `model.family=` the detected one, all
    silently. Every optional text key refuses an empty value (null unsets it), as data.eval_path does."""
    for override in (f"{key}=", f"{key}=' '"):
        with pytest.raises(UserError, match=rf"^override '{re.escape(override)}': {re.escape(key)} is empty"):
            load_config(REPO / "configs/tiny.yaml", [override])
    section, _, name = key.partition(".")
    assert getattr(getattr(load_config(REPO / "configs/tiny.yaml", [f"{key}=null"]), section), name) is None


def test_an_empty_coordinator_address_still_means_unset():
    """Documented: empty or null leaves the coordinator to the JAX_* environment (or one host)."""
    assert load_config(REPO / "configs/tiny.yaml", ["mesh.coordinator_address="]).mesh.coordinator_address == ""
    assert {"model.revision", "train.run_dir", "data.eval_path"} <= set(_optional_text_keys())


def test_a_top_level_anchor_reused_by_the_sections_is_not_an_unknown_key(tmp_path):
    """`common: &c {...}` then `train: {<<: *c}` (YAML's way to share settings between sections or files' variants)
    was refused as "unknown config key 'common'"; a top-level key that nothing refers to still is."""
    path = tmp_path / "run.yaml"
    path.write_text("common: &c\n  batch_size: 2\n  max_steps: 3\ntargets: &t [q_proj, v_proj]\n"
                    "train:\n  <<: *c\n  seed: 7\nlora:\n  targets: *t\n")
    cfg = load_config(path)
    assert (cfg.train.batch_size, cfg.train.max_steps, cfg.train.seed) == (2, 3, 7)
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    path.write_text("defaults: &d\n  train: {max_steps: 4}\n<<: *d\nmodel:\n  dtype: bfloat16\n")  # merged at the top
    cfg = load_config(path)
    assert (cfg.train.max_steps, cfg.model.dtype) == (4, "bfloat16")
    path.write_text("common: &c\n  batch_size: 2\ntrain:\n  seed: 7\n")
    with pytest.raises(UserError, match=r"line 1: unknown config key 'common'"):
        load_config(path)


def test_keys_given_are_the_file_and_override_keys_not_defaults(tmp_path):
    """What `evaluate --checkpoint` reads to tell a model.dtype asked for from the default float32."""
    from gemma_tpu.core.typed_yaml import keys_given

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {dtype: bfloat16}\nmodel:\n  <<: *b\ntrain:\n  max_steps: 3\n")
    assert {"model.dtype", "train.max_steps"} <= keys_given(path) and "train.batch_size" not in keys_given(path)
    assert keys_given(None, ["lora={rank: 2}", "train.seed=1"]) == {"lora", "lora.rank", "train.seed"}
    assert keys_given(None) == set()


def test_evaluation_settings_without_an_eval_path_are_accepted():
    """Decided (round 9): `data.eval_max_batches` and `train.eval_every_steps` without `data.eval_path` load. The
    shipped configs set them beside eval_path, and `data.eval_path=null` is how a run turns evaluation off (the kill
    harness and the resume tests do): refusing them would make that override need two more."""
    cfg = load_config(REPO / "configs/tiny.yaml", ["data.eval_path=null"])
    assert cfg.data.eval_path is None and cfg.data.eval_max_batches == 2 and cfg.train.eval_every_steps == 3


@pytest.mark.parametrize("overrides, message", [
    (["train.optimizer=sgd", "train.weight_decay=0.01"],
     "train.weight_decay=0.01 is not applied by train.optimizer=sgd (plain SGD has no weight decay here)"),
    (["train.schedule=constant", "train.min_lr_ratio=0.1"],
     "train.min_lr_ratio=0.1 is the floor of a decaying schedule, and train.schedule=constant does not decay"),
])
def test_a_setting_the_chosen_optimizer_or_schedule_ignores_is_refused(overrides, message):
    """optax.sgd has no weight decay and a constant schedule never decays to a floor: both settings were accepted
    and did nothing (a run meant to be regularised, or to anneal, was not). Refused naming the key; with the
    settings that use them they load."""
    with pytest.raises(UserError, match=rf"^override '{re.escape(overrides[1])}': {re.escape(message)}"):
        load_config(REPO / "configs/tiny.yaml", overrides)
    assert load_config(REPO / "configs/tiny.yaml", ["train.optimizer=adamw", "train.weight_decay=0.01"])
    assert load_config(REPO / "configs/tiny.yaml", ["train.schedule=warmup_cosine", "train.min_lr_ratio=0.1"])
    assert load_config(REPO / "configs/tiny.yaml", ["train.optimizer=sgd", "train.schedule=constant"])


@pytest.mark.parametrize("override, leaf", [("train.max_steps.deep=1", "max_steps"),
                                            ("lora.targets.x.y=1", "targets"), ("data.train_path.x=a", "train_path")])
def test_an_override_through_a_key_no_file_gave_is_blamed_on_it(override, leaf):
    """`train.max_steps.deep=1` without a file giving train.max_steps built {'deep': 1} and was blamed on the config
    ("config: train.max_steps: expected an integer, got {'deep': 1}"); with the key in the file it said which
    override goes through a key that is not a section, as it does now either way."""
    key = override.partition("=")[0]
    with pytest.raises(UserError, match=rf"^override '{re.escape(override)}': '{re.escape(key)}' goes through "
                                        rf"'{leaf}', which is not a section$"):
        load_config(None, [override])


@pytest.mark.parametrize("section", ["train:\n", "train: null\n", "train: ~\n  # max_steps: 3\n"])
def test_an_override_into_a_section_the_file_leaves_empty(tmp_path, section):
    """A section whose keys are all commented out is null to YAML, and builds as its defaults; an override of one of
    its keys was refused as going through "'train', which is not a section". A key that is null stays refused."""
    p = tmp_path / "c.yaml"
    p.write_text(f"model:\n  path: x\n{section}data:\n  context_field: null\n")
    cfg = load_config(p, ["train.max_steps=4", "train.batch_size=2"])
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.learning_rate) == (4, 2, pytest.approx(3e-4))
    with pytest.raises(UserError, match=r"override 'data.context_field.x=1': 'data.context_field.x' goes through "
                                        r"'context_field', which is not a section"):
        load_config(p, ["data.context_field.x=1"])


@pytest.mark.parametrize("override, kept", [
    ("checkpoint.dir=runs/exp #2", "'runs/exp'"),  # quoted for the shell: the run went into another run's dir
    ("data.eval_path=#1", "null"),  # read as null: no evaluation, without a word
    ("train.max_steps=3 # fewer", "'3'"),
])
def test_an_override_value_that_yaml_would_cut_at_a_comment_is_refused(override, kept):
    with pytest.raises(UserError, match=rf"override '{re.escape(override)}': YAML reads '#.*' as a comment, so the "
                                        rf"value would be {re.escape(kept)}; to keep the '#', quote the value"):
        load_config(None, [override])


def test_a_hash_yaml_keeps_in_an_override_value_is_kept():
    cfg = load_config(None, ["data.train_path=data/a#1.jsonl", "checkpoint.dir=\"runs/exp #2\""])
    assert (cfg.data.train_path, cfg.checkpoint.dir) == ("data/a#1.jsonl", "runs/exp #2")

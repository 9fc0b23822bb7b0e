"""Serving: the docker run command and the model checks behind it, the local server, the benchmark
client and the tool-calling chat client.

The acceptance path runs for real on CPU: train the tiny model a few steps, merge it, serve the
merged directory with `serving.launch --local` (transformers serve) on loopback, benchmark it and
chat with it, stop it. Docker is replaced by a recording fake; the model behind the tool round trip
is a scripted fake OpenAI endpoint (a random tiny model never calls tools), and faulty servers
(500s, dropped connections, stalls) are fakes too.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.models.registry import described_family
from serving.config import DEFAULT_IMAGE, VLLM_TPU_IMAGE
from serving.local import free_port
from tests.conftest import REPO, assert_one_line_error, run_cli

CONFIG_270M = str(REPO / "configs" / "serve-gemma3-270m-fitness.yaml")
CONFIG_31B = str(REPO / "configs" / "serve-gemma4-31b-v6e8.yaml")
NAME_270M = "gemma3-270m-fitness"
TOOL_NAMES = {"get_steps", "get_daily_step_goal", "get_step_goal_progress", "get_sleeping_minutes",
              "get_active_minutes", "get_heart_rate", "get_body_battery_level"}


# ---------------------------------------------------------------------------------- helpers


HIDDEN, Q_OUT = 16, 8  # the one weight the fake models have (layer 0's q_proj) and the fake adapters change


def save_tensors(path: Path, tensors: dict[str, tuple[int, ...]]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.zeros(shape, np.float32) for k, shape in tensors.items()}, str(path))


def fake_model_dir(root: Path, arch: str = "Gemma3ForCausalLM", kv: int = 1, nested: bool = False, shards: int = 0,
                   tokenizer: bool = True, template: bool = True, generation: bool = True) -> Path:
    """A directory with the files vLLM reads: a two-layer model's tensors, all of shape (1,) but layer 0's q_proj."""
    root.mkdir(parents=True)
    text = {"num_key_value_heads": kv, "num_attention_heads": 2 * kv, "max_position_embeddings": 32768,
            "num_hidden_layers": 2}
    cfg = {"architectures": [arch], **({"text_config": text} if nested else text)}
    (root / "config.json").write_text(json.dumps(cfg))
    q = {f"model.{'language_model.' if nested else ''}layers.0.self_attn.q_proj.weight": (Q_OUT, HIDDEN)}
    q = {**every_weight(cfg, nested), **q}
    if shards:  # the index names each tensor's shard, as a loader checks it does
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {**dict.fromkeys(q, names[0]),
                                            **{f"layer.{i}.weight": n for i, n in enumerate(names) if i}}}))
        for i, n in enumerate(names[1:], 1):
            save_tensors(root / n, {f"layer.{i}.weight": (1,)})
    save_tensors(root / (names[0] if shards else "model.safetensors"), q)
    if generation:
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
        (root / "tokenizer_config.json").write_text("{}")
    if template:
        (root / "chat_template.jinja").write_text("{{ messages }}")
    return root


def every_weight(cfg: dict, nested: bool) -> dict[str, tuple[int, ...]]:
    """Each tensor name the model `cfg` (config.json) describes, of shape (1,)."""
    family = described_family(cfg)
    prefix = f"model.{'language_model.' if nested else ''}"
    return dict.fromkeys(family.required_weights(cfg, prefix) if family else [], (1,))


def fake_adapter(root: Path, r: int, nested: bool = False, hidden: int = HIDDEN) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"]}))
    stem = f"base_model.model.model.{'language_model.' if nested else ''}layers.0.self_attn.q_proj"
    save_tensors(root / "adapter_model.safetensors", {f"{stem}.lora_A.weight": (r, hidden),
                                                      f"{stem}.lora_B.weight": (Q_OUT, r)})
    return root


def words(stdout: str) -> list[str]:
    """The printed command as argv (its continuation lines joined)."""
    return shlex.split(stdout.replace("\\\n", " "))


def flag(argv: list[str], name: str) -> str:
    assert name in argv, (name, argv)
    return argv[argv.index(name) + 1]


def has_pair(argv: list[str], a: str, b: str) -> bool:
    return any(x == a and y == b for x, y in zip(argv, argv[1:]))


def launch_inproc(capsys, *args: str) -> tuple[int, str, str]:
    """serving.launch in this process (no interpreter start): exit code, stdout, stderr."""
    from serving.launch import main

    code = cli_main(main, list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(code: int, err: str, *needles: str) -> str:
    assert code != 0 and "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]):
    """A threaded HTTP server on a free loopback port; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


# -------------------------------------------------------------------------- container image


def test_dockerfile_pins_the_vllm_tpu_image():
    text = (REPO / "serving" / "Dockerfile").read_text()
    froms = [l.split()[1] for l in text.splitlines() if l.startswith("FROM ")]
    assert froms == [VLLM_TPU_IMAGE]
    repo, tag = VLLM_TPU_IMAGE.split(":")
    assert repo == "vllm/vllm-tpu" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)  # versioned, not latest/nightly
    assert DEFAULT_IMAGE.endswith(":" + tag)
    # the entrypoint executes its arguments as a command: the default command is a whole `vllm serve`
    cmd = json.loads(re.search(r"^CMD (\[.*?\])", text, re.S | re.M).group(1).replace("\\\n", ""))
    assert cmd[:2] == ["vllm", "serve"] and "--host" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"


# ----------------------------------------------------------------------------- launch --print


def test_print_270m_config(tmp_path):
    d = fake_model_dir(tmp_path / "merged")
    env = {"HF_TOKEN": "hf-secret-value-1", "MY_KEY": "api-secret-value-2"}
    proc = run_cli("serving.launch", "--config", CONFIG_270M, "--print", f"model.dir={d}", "server.api_key_env=MY_KEY",
                   env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for secret in env.values():
        assert secret not in proc.stdout + proc.stderr
    argv = words(proc.stdout)
    assert argv[:3] == ["VLLM_API_KEY=$MY_KEY", "docker", "run"]  # the key travels by name only
    docker = argv[1:argv.index("vllm")]
    assert "--privileged" in docker and has_pair(docker, "--net", "host") and flag(docker, "--shm-size") == "16g"
    assert has_pair(docker, "-v", f"{d}:/models/{NAME_270M}:ro")
    assert has_pair(docker, "-v", f"{Path('~/.cache/vllm').expanduser().resolve()}:/root/.cache/vllm")
    assert has_pair(docker, "-e", "HF_TOKEN") and has_pair(docker, "-e", "VLLM_API_KEY")
    assert docker[-1] == DEFAULT_IMAGE
    serve = argv[argv.index("vllm"):]
    assert serve[:3] == ["vllm", "serve", f"/models/{NAME_270M}"]
    assert flag(serve, "--served-model-name") == NAME_270M
    assert (flag(serve, "--host"), flag(serve, "--port")) == ("127.0.0.1", "8000")
    assert flag(serve, "--tensor-parallel-size") == "1" and flag(serve, "--dtype") == "bfloat16"
    assert flag(serve, "--max-model-len") == "2048" and flag(serve, "--max-num-batched-tokens") == "2048"
    assert flag(serve, "--max-num-seqs") == "64" and flag(serve, "--chat-template-content-format") == "openai"
    assert "--enable-auto-tool-choice" in serve and flag(serve, "--tool-call-parser") == "functiongemma"
    assert flag(serve, "--chat-template") == f"/models/{NAME_270M}/chat_template.jinja"
    assert "--enable-lora" not in serve and "--api-key" not in serve


def test_a_chat_template_file_is_served_with_tool_calling_off_too(tmp_path, capsys):
    """tool_calling.chat_template naming a file, with tool_calling.enabled false, was dropped without a word (no
    --chat-template, no mount, no check), and `--chat-template` in server.extra_args is refused as set by that key: a
    model without a template of its own could not be given one, and every chat completion failed on the VM."""
    d = fake_model_dir(tmp_path / "m", template=False)
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "tool_calling.enabled=false", f"tool_calling.chat_template={t}")
    assert code == 0, err
    argv = words(out)
    serve = argv[argv.index("vllm"):]
    assert flag(serve, "--chat-template") == "/templates/t.jinja" and "--enable-auto-tool-choice" not in serve
    assert has_pair(argv, "-v", f"{t}:/templates/t.jinja:ro")
    t.write_bytes(b"\xff\xfe{\x00{\x00")  # checked as with tool calling on
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "tool_calling.enabled=false", f"tool_calling.chat_template={t}")
    one_error_line(code, err, f"tool_calling.chat_template: {t} is UTF-16 text")


def test_a_model_without_a_chat_template_served_without_tool_calling_is_warned_of(tmp_path, capsys):
    """With tool calling off and no template (neither the model's nor tool_calling.chat_template), vLLM answers every
    chat completion with an error, while --local answered them with the tool template it writes: nothing said so."""
    d = fake_model_dir(tmp_path / "m", template=False)
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "tool_calling.enabled=false")
    assert code == 0, err
    assert f"warning: model.dir {d} has no chat template" in err and "vLLM answers /v1/completions only" in err
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for extra in ([f"tool_calling.chat_template={t}"], []):  # a template given; the model's own
        if not extra:
            (d / "chat_template.jinja").write_text(t.read_text())
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                       "tool_calling.enabled=false", *extra)
        assert code == 0 and "no chat template" not in err, err


def test_serving_paths_expand_environment_variables(tmp_path, monkeypatch):
    """`model.dir: $RUNS/x-merged` (and the adapter, chat template and compile cache paths) was read literally, a
    directory named '$RUNS', where the run config expands it; a variable not set is refused naming the key."""
    from serving.config import load_serve_config

    monkeypatch.setenv("GEMMA_TPU_TEST_RUNS", str(tmp_path))
    path = tmp_path / "serve.yaml"
    path.write_text("model:\n  dir: $GEMMA_TPU_TEST_RUNS/x-merged\nlora:\n  adapters:\n    - name: coach\n"
                    "      dir: ${GEMMA_TPU_TEST_RUNS}/coach\ntool_calling:\n"
                    "  chat_template: $GEMMA_TPU_TEST_RUNS/t.jinja\ncontainer:\n"
                    "  compile_cache: $GEMMA_TPU_TEST_RUNS/cache\n")
    cfg = load_serve_config(path, need_dir=False)
    assert (cfg.model.dir, cfg.lora.adapters[0].dir) == (f"{tmp_path}/x-merged", f"{tmp_path}/coach")
    assert (cfg.tool_calling.chat_template, cfg.container.compile_cache) == (f"{tmp_path}/t.jinja", f"{tmp_path}/cache")
    assert cfg.model_dir == tmp_path / "x-merged" and cfg.served_name == "x-merged"
    # a link's own name is served, not its target's (a content-hashed directory's), and '.' is the directory it is
    (tmp_path / "snap" / "0f3a9c").mkdir(parents=True)
    (tmp_path / "fitness").symlink_to(tmp_path / "snap" / "0f3a9c")
    cfg = load_serve_config(path, [f"model.dir={tmp_path}/fitness/"], need_dir=False)
    assert cfg.model_dir == tmp_path / "snap" / "0f3a9c" and cfg.served_name == "fitness"
    monkeypatch.chdir(tmp_path / "fitness")
    assert load_serve_config(path, ["model.dir=."], need_dir=False).served_name == "0f3a9c"
    with pytest.raises(UserError, match=r"^override 'model.dir=\$GEMMA_TPU_UNSET/m': model.dir='\$GEMMA_TPU_UNSET/m' "
                                        r"names the environment variable GEMMA_TPU_UNSET, which is not set"):
        load_serve_config(path, ["model.dir=$GEMMA_TPU_UNSET/m"], need_dir=False)
    path.write_text("container:\n  compile_cache: ${GEMMA_TPU_UNSET}/cache\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} line 2: container.compile_cache="):
        load_serve_config(path, need_dir=False)


def test_serving_paths_expand_the_home_directory_when_read(tmp_path, monkeypatch):
    """`model.dir: ~/x-merged` stayed '~/x-merged' in the config (each consumer expanded it, or not: --print-config
    showed it unexpanded); it is expanded when the config is read, by expand_env as a run config's paths are, and a
    ~user this machine does not know is refused naming the key."""
    from serving.config import load_serve_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_serve_config(None, ["model.dir=~/x-merged", "lora.adapters=[{name: coach, dir: ~/coach}]",
                                   "tool_calling.chat_template=~/t.jinja"], need_dir=False)
    assert (cfg.model.dir, cfg.lora.adapters[0].dir) == (f"{tmp_path}/x-merged", f"{tmp_path}/coach")
    assert (cfg.tool_calling.chat_template, cfg.container.compile_cache) == (f"{tmp_path}/t.jinja",
                                                                             f"{tmp_path}/.cache/vllm")
    with pytest.raises(UserError, match=r"^override 'model.dir=~gemma_tpu_no_such_user/m': model.dir='~gemma_tpu_no_"
                                        r"such_user/m': '~gemma_tpu_no_such_user' is the home directory of user"):
        load_serve_config(None, ["model.dir=~gemma_tpu_no_such_user/m"], need_dir=False)


def test_an_unknown_key_in_an_overridden_list_names_the_override():
    """`lora.adapters=[{name: a, dir: /x, rank: 3}]` was blamed on the config file's line of `lora.adapters: []`,
    which holds no such key; the override that gave it is named."""
    from serving.config import load_serve_config

    with pytest.raises(UserError, match=r"^override 'lora.adapters=\[\{name: a, dir: /x, rank: 3\}\]': unknown config "
                                        r"key 'lora.adapters\[0\].rank' \(known: dir, name\)"):
        load_serve_config(REPO / "configs/serve-gemma3-270m-fitness.yaml",
                          ["lora.adapters=[{name: a, dir: /x, rank: 3}]"], need_dir=False)
    # vLLM's --lora-modules form, `name=dir`: the entry's keys are named (it said "expected a mapping" alone)
    with pytest.raises(UserError, match=r"^override 'lora.adapters=\[coach=/x\]': lora.adapters\[0\]: expected a "
                                        r"mapping, got 'coach=/x' \(write it \{name: \.\.\., dir: \.\.\.\}\)$"):
        load_serve_config(REPO / "configs/serve-gemma3-270m-fitness.yaml", ["lora.adapters=[coach=/x]"],
                          need_dir=False)


@pytest.mark.parametrize("override,flag", [
    ("server.gpu_memory_utilization=0.95", "--gpu-memory-utilization"),
    ("server.enable_prefix_caching=true", "--enable-prefix-caching"), ("model.quantization=fp8", "--quantization"),
])
def test_a_vllm_serve_option_given_as_a_key_is_pointed_to_extra_args(override, flag):
    """The server section mirrors `vllm serve` (max_model_len, max_num_seqs, ...), so a vLLM user writes its other
    options as keys too: `server.gpu_memory_utilization` was an unknown key with the section's keys listed, and
    nothing said that server.extra_args passes it."""
    from serving.config import load_serve_config

    with pytest.raises(UserError) as e:
        load_serve_config(REPO / "configs/serve-gemma3-270m-fitness.yaml", [override], need_dir=False)
    key = override.split("=")[0]
    assert str(e.value).startswith(f"override '{override}': unknown config key '{key}'"), str(e.value)
    assert "server.extra_args" in str(e.value) and f"[{flag}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    # said "lora.adapters: name '': use letters, digits, '.', '_' and '-'"
    (["lora.adapters=[{dir: /x/coach}]"], "lora.adapters[0]: name is not set (give {name: NAME, dir: DIR}: clients "
                                          "send NAME as the model)"),
    # both said "lora.adapters: names must be unique and differ from the served model name", naming neither
    (["lora.adapters=[{name: coach, dir: /x/a}, {name: coach, dir: /x/b}]"],
     "lora.adapters: 'coach' is the name of two adapters (lora.adapters[0] and [1]); give each its own"),
    (["model.name=coach", "lora.adapters=[{name: coach, dir: /x/a}]"],
     "lora.adapters[0]: 'coach' is the served model's name (model.name) too; give the adapter another"),
])
def test_adapter_names_are_refused_by_what_is_wrong(overrides, message):
    from serving.config import load_serve_config

    with pytest.raises(UserError) as e:
        load_serve_config(REPO / "configs/serve-gemma3-270m-fitness.yaml", overrides, need_dir=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("key, value", [
    ("server.api_key_env", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),  # the token where its variable's name goes
    ("container.hf_token_env", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("server.api_key_env", "a3f9c2e1b4d5f6a7b8c9d0e1f2a3b4c5"),  # `openssl rand -hex 16`, as the README makes one
    ("server.api_key_env", "sk-proj-AbCdEf0123456789AbCdEf0123456789"),
])
def test_a_secret_given_for_its_variables_name_is_refused_unshown(tmp_path, key, value):
    """A token written where the variable's name goes passed as a name (`-e hf_...`, `VLLM_API_KEY="$a3f9..."`): the
    secret was printed in the docker command and seen in the process list; one that is no name (`sk-...`) was
    refused by echoing it, into the terminal and any log."""
    from serving.config import load_serve_config

    section, name = key.split(".")
    path = tmp_path / "serve.yaml"
    path.write_text(f"model:\n  dir: /x/m\n{section}:\n  {name}: {value}\n")
    with pytest.raises(UserError) as e:
        load_serve_config(path, need_dir=False)
    assert str(e.value).startswith(f"{path} line 4: {key} ") and "looks like a key or token itself" in str(e.value)
    assert value not in str(e.value) and value[:8] not in str(e.value), str(e.value)


def test_an_empty_chat_template_is_said_to_be_empty():
    """`tool_calling.chat_template=` (an unset $TEMPLATE) was "tool_calling.chat_template: . is not a file"."""
    from serving.config import load_serve_config

    with pytest.raises(UserError, match=r"^override 'tool_calling.chat_template=': tool_calling.chat_template is "
                                        r"empty \(give model, the directory's own template, or a .jinja file\)$"):
        load_serve_config(REPO / "configs/serve-gemma3-270m-fitness.yaml", ["tool_calling.chat_template="],
                          need_dir=False)


def test_an_empty_serving_config_points_to_a_serving_config(tmp_path):
    """An empty (or truncated to comments) serving config, or a directory given for it, was told to give 'a config
    such as configs/tiny.yaml', a training config the launcher refuses."""
    from serving.config import load_serve_config

    (tmp_path / "serve.yaml").write_text("# nothing yet\n")
    for given, needle in ((tmp_path / "serve.yaml", "empty config file (no sections); give a config such as "),
                          (tmp_path, "is a directory; give a YAML file (e.g. ")):
        with pytest.raises(UserError, match=re.escape(needle + "configs/serve-gemma3-270m-fitness.yaml")):
            load_serve_config(given, need_dir=False)


def test_print_config_without_a_config_prints_the_defaults(capsys):
    """`--print-config` alone (a user asking what the defaults are) stopped at "model.dir is not set"; it prints
    them, model.dir null, and says serving needs it. Serving without one is still refused, as is a bad override."""
    import yaml

    code, out, err = launch_inproc(capsys, "--print-config", "server.port=8001")
    cfg = yaml.safe_load(out)
    assert code == 0 and cfg["model"]["dir"] is None and cfg["server"]["port"] == 8001, err
    assert "note: model.dir is not set; serving needs it" in err
    one_error_line(*launch_inproc(capsys, "--print")[::2], "model.dir is not set")
    code, out, err = launch_inproc(capsys, "--print-config", "server.port=0")
    assert out == "" and one_error_line(code, err, "server.port must be in 1..65535")


def test_print_config_writes_a_dollar_of_a_path_so_it_reads_back(tmp_path, capsys, monkeypatch):
    """`$$` is a `$` of the path; --print-config printed the path as expanded (`a$x`), which `--config` read back as
    the variable x (refused: not set). The expanded paths print their `$` as `$$`; other keys are printed as given."""
    from serving.config import load_serve_config

    monkeypatch.delenv("x", raising=False)
    monkeypatch.setenv("GEMMA_TPU_TEST_D", "b$y")
    code, out, err = launch_inproc(capsys, "--print-config", f"model.dir={tmp_path}/a$$x", "model.name=m",
                                   "lora.adapters=[{name: coach, dir: $GEMMA_TPU_TEST_D}]",
                                   f"container.compile_cache={tmp_path}/c$$", "container.env={NOTE: p$$q}")
    assert code == 0, err
    (tmp_path / "printed.yaml").write_text(out)
    cfg = load_serve_config(tmp_path / "printed.yaml", need_dir=False)
    assert (cfg.model.dir, cfg.lora.adapters[0].dir) == (f"{tmp_path}/a$x", "b$y")
    assert cfg.container.compile_cache == f"{tmp_path}/c$" and cfg.container.env == {"NOTE": "p$$q"}


def test_a_context_past_the_models_limits_is_served_where_vllm_is_told_to_allow_it(tmp_path, capsys):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the container's environment lets vLLM take a longer --max-model-len than
    max_position_embeddings or tokenizer_config.json's model_max_length; so does the launcher."""
    d = _short_tokenizer_limit(tmp_path / "m")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.max_model_len=65536", "server.max_num_batched_tokens=65536",
                                   "container.env={VLLM_ALLOW_LONG_MAX_MODEL_LEN: '1'}")
    assert code == 0 and flag(words(out), "--max-model-len") == "65536", err


def test_a_directory_published_anew_while_it_is_checked_is_refused(tmp_path, capsys, monkeypatch):
    """The launcher reads model.dir file by file (config.json, the weights' headers, generation_config.json, the
    tokenizer) and --local links its files and reads its tokenizer again: a merge's --overwrite publishing another
    model there meanwhile was checked half as one model, half as the other, and served. Refused in one line, nothing
    printed or started; an adapter directory published anew (export_peft --overwrite) alike."""
    import serving.config as sc
    import serving.launch as sl
    from tests.test_convert import publish_anew, replaced_while_read

    d, other = fake_model_dir(tmp_path / "m"), fake_model_dir(tmp_path / "other", kv=2)

    def republishing(real, dst, src):
        def call(*a):
            publish_anew(dst, src)
            return real(*a)
        return call

    with monkeypatch.context() as m:  # after config.json and the weights were read
        m.setattr(sc, "check_tokenizer", republishing(sc.check_tokenizer, d, other))
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [replaced_while_read(d)], err
    assert code == 2 and out == ""
    with monkeypatch.context() as m:  # --local: between the check and the served directory's links
        m.setattr(sl, "weights_warning", republishing(sl.weights_warning, d, other))
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--local", f"model.dir={d}",
                                       f"server.port={free_port()}")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [replaced_while_read(d)], err
    assert code == 2 and "serving" not in err
    a, b = fake_adapter(tmp_path / "a", r=8), fake_adapter(tmp_path / "b", r=16)
    with monkeypatch.context() as m:
        m.setattr(sc, "check_adapter_tokenizer", republishing(sc.check_adapter_tokenizer, a, b))
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                       f"lora.adapters=[{{name: a, dir: {a}}}]")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [replaced_while_read(a)], err
    assert code == 2 and out == ""


def test_a_link_retargeted_while_its_model_is_checked_launches_the_checked_one(tmp_path, capsys, monkeypatch):
    """model.dir a link (`models/coach` -> a merge), retargeted by a new merge's publish after its model was checked:
    the command mounted the link's new target, a model never checked. One resolution for the whole launch."""
    import serving.config as sc

    checked, other = fake_model_dir(tmp_path / "a"), fake_model_dir(tmp_path / "b", kv=2)
    link = tmp_path / "coach"
    link.symlink_to(checked)

    def retarget(real):
        def call(*a):
            (tmp_path / "coach.new").symlink_to(other)
            os.replace(tmp_path / "coach.new", link)
            return real(*a)
        return call

    monkeypatch.setattr(sc, "check_tokenizer", retarget(sc.check_tokenizer))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={link}")
    assert code == 0, err
    assert f"-v {checked}:/models/" in out and str(other) not in out, out


def test_a_directory_whose_files_link_outside_it_is_refused_for_the_container(tmp_path, capsys):
    """A Hugging Face cache snapshot as model.dir: its files are links to ../../blobs/, which every check read on the
    host, and which lead nowhere in the container that mounts the snapshot alone (vLLM failed to read config.json
    minutes into its start). Refused in one line, naming the link; links inside the directory are fine."""
    snap = fake_model_dir(tmp_path / "hub" / "snapshots" / "abc")
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir()
    for f in sorted(snap.iterdir()):
        f.rename(blobs / f.name)
        f.symlink_to(Path("../../blobs") / f.name)
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={snap}")
    one_error_line(code, err, f"model.dir {snap}: chat_template.jinja is a symbolic link to "
                   f"{blobs}/chat_template.jinja, outside the directory", "cp -rL")
    assert out == ""
    inside = fake_model_dir(tmp_path / "inside")
    (inside / "chat_template.jinja").rename(inside / "template.jinja")
    (inside / "chat_template.jinja").symlink_to("template.jinja")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={inside}")
    assert code == 0, err


def test_a_chat_template_file_that_is_no_text_is_refused_before_local_serving(tmp_path, capsys):
    """tool_calling.chat_template naming a file that is not UTF-8 (a binary, a UTF-16 export): --local stopped with a
    UnicodeDecodeError traceback where it copied the template."""
    d = fake_model_dir(tmp_path / "m")
    (tmp_path / "t.jinja").write_bytes("{{ messages }}".encode("utf-16"))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--local", f"model.dir={d}",
                                   f"tool_calling.chat_template={tmp_path / 't.jinja'}", f"server.port={free_port()}")
    one_error_line(code, err, f"tool_calling.chat_template: {tmp_path / 't.jinja'} is UTF-16 text (it starts with "
                              f"a UTF-16 byte-order mark); save it as UTF-8")
    (tmp_path / "t.jinja").write_bytes(b"{{ messages }}\xff\xfe")  # binary, not text
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--local", f"model.dir={d}",
                                   f"tool_calling.chat_template={tmp_path / 't.jinja'}", f"server.port={free_port()}")
    one_error_line(code, err, f"tool_calling.chat_template: {tmp_path / 't.jinja'} is not UTF-8 text (byte 14)")
    # a template with a Jinja syntax error passed and failed in vLLM at the first request (the model loaded): refused
    # naming the line; transformers' `{% generation %}` block and loop controls are syntax it compiles
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                      "{% break %}{% endfor %}\n{{ messages[0].content }\n")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"tool_calling.chat_template={tmp_path / 't.jinja'}")
    one_error_line(code, err, f"tool_calling.chat_template: {tmp_path / 't.jinja'} line 2: unexpected '}}'")
    assert out == ""
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                      "{% break %}{% endfor %}\n")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"tool_calling.chat_template={tmp_path / 't.jinja'}")
    assert code == 0, err


def test_a_chat_template_given_as_json_is_refused_for_vllm_and_local_serving(tmp_path, capsys):
    """tool_calling.chat_template naming a chat_template.json (or a tokenizer_config.json-like object under another
    name): vLLM's --chat-template (and --local, which writes it as chat_template.jinja) read the file's text as the
    template, and every prompt was that JSON. Refused, saying to give the template itself as a .jinja file."""
    d = fake_model_dir(tmp_path / "m")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (tmp_path / "t.txt").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for name in ("chat_template.json", "t.txt"):
        for mode in ("--print", f"--local server.port={free_port()}"):
            code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, *mode.split(), f"model.dir={d}",
                                           f"tool_calling.chat_template={tmp_path / name}")
            one_error_line(code, err, f"tool_calling.chat_template: {tmp_path / name} holds JSON",
                           "reads the file's text as the template", "save its \"chat_template\" as a .jinja file")
            assert out == ""


def test_a_training_checkpoint_as_model_dir_says_to_merge_it(tmp_path, capsys):
    """model.dir=runs/x/checkpoints (the training output, not the merge) said only "no config.json"; it now says what
    the directory is and the merge command, for vLLM (--print) and the local server alike."""
    from gemma_tpu.hf.directory import RUN_RECORD
    from serving.local import serve_main

    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / RUN_RECORD).write_text("{}")
    hint = f"{ckpt} is a gemma-tpu training checkpoint, not a Hugging Face model directory: merge it first, " \
           f"python -m convert.merge_orbax --checkpoint {ckpt} --out DIR"
    for mode in ("--print", "--local"):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, mode, f"model.dir={ckpt.parent}")
        assert out == "" and one_error_line(code, err, f"model dir {ckpt.parent}: no config.json ({hint})")
    assert cli_main(serve_main, [str(ckpt)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {ckpt}: no config.json ({hint})"


@pytest.mark.parametrize("kv,tp", [(1, 2), (2, 4), (4, 2)])
def test_tensor_parallel_past_the_kv_heads_is_served(tmp_path, capsys, kv, tp):
    """vLLM copies KV heads to tp > num_key_value_heads devices when tp is a multiple (a one-KV-head Gemma 3 on a
    v5e-4): such a tp is launched, not refused as "a divisor of 1"."""
    d = fake_model_dir(tmp_path / "m", kv=kv)  # 2 * kv query heads
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"server.tensor_parallel_size={tp}")
    assert code == 0, err
    assert flag(words(out), "--tensor-parallel-size") == str(tp)


def test_print_31b_config_with_adapters(tmp_path, capsys, monkeypatch):
    d = fake_model_dir(tmp_path / "g4", arch="Gemma4ForConditionalGeneration", kv=16, nested=True, shards=3)
    a = fake_adapter(tmp_path / "coach", r=12, nested=True)
    monkeypatch.setenv("VLLM_API_KEY", "api-secret-value-3")
    args = ["--config", CONFIG_31B, "--print", f"model.dir={d}", "model.name=g4",
            f"lora.adapters=[{{name: coach, dir: {a}}}]", "server.host=0.0.0.0"]
    # tpu-inference's JAX Gemma 4 (MODEL_IMPL_TYPE auto, as the config sets it, or flax_nnx) applies no adapter
    for impl in ("auto", "flax_nnx"):
        code, out, err = launch_inproc(capsys, *args, f"container.env.MODEL_IMPL_TYPE={impl}")
        one_error_line(code, err, f"container.env.MODEL_IMPL_TYPE={impl}", "applies no LoRA adapter",
                       "python -m convert.merge_orbax", "MODEL_IMPL_TYPE=vllm")
    # vLLM's own --model-impl is not tpu-inference's switch: the adapters stay refused under auto
    code, out, err = launch_inproc(capsys, *args, "server.extra_args=[--model-impl,vllm]")
    one_error_line(code, err, "--model-impl vllm", "MODEL_IMPL_TYPE=auto", "set container.env.MODEL_IMPL_TYPE=vllm")
    code, out, err = launch_inproc(capsys, *args, "container.env.MODEL_IMPL_TYPE=vllm",
                                   "server.extra_args=[--model-impl,vllm]")
    assert code == 0 and flag(words(out)[words(out).index("vllm"):], "--model-impl") == "vllm", err
    code, out, err = launch_inproc(capsys, *args, "container.env.MODEL_IMPL_TYPE=vllm")
    assert code == 0, err
    assert "api-secret-value-3" not in out + err
    argv = words(out)
    assert argv[:2] == ["docker", "run"]
    assert has_pair(argv, "-v", f"{a}:/adapters/coach:ro") and has_pair(argv, "-e", "VLLM_API_KEY")
    assert has_pair(argv, "-e", "MODEL_IMPL_TYPE=vllm") and flag(argv, "--shm-size") == "64g"
    serve = argv[argv.index("vllm"):]
    assert serve[:3] == ["vllm", "serve", "/models/g4"] and flag(serve, "--host") == "0.0.0.0"
    assert flag(serve, "--tensor-parallel-size") == "8" and flag(serve, "--max-model-len") == "4096"
    assert flag(serve, "--tool-call-parser") == "gemma4"
    assert flag(serve, "--lora-modules") == "coach=/adapters/coach"
    assert flag(serve, "--max-lora-rank") == "16"  # the smallest rank vLLM accepts that fits r=12
    assert flag(serve, "--max-loras") == "1"


def test_several_adapters_share_a_batch(tmp_path, capsys):
    """Two adapters got vLLM's default --max-loras 1: requests for the second waited for batches of their own.
    Now --max-loras is the number of adapters (a smaller lora.max_loras is vLLM's to take: a warning), and
    --max-lora-rank fits the largest rank."""
    d = fake_model_dir(tmp_path / "m")
    a, b = fake_adapter(tmp_path / "a", r=8), fake_adapter(tmp_path / "b", r=40)
    adapters = f"lora.adapters=[{{name: a, dir: {a}}}, {{name: b, dir: {b}}}]"
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", adapters)
    assert code == 0 and "warning" not in err, err
    serve = words(out)[words(out).index("vllm"):]
    assert flag(serve, "--max-loras") == "2" and flag(serve, "--max-lora-rank") == "64"
    modules = serve.index("--lora-modules") + 1
    assert serve[modules:modules + 2] == ["a=/adapters/a", "b=/adapters/b"]
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", adapters,
                                   "lora.max_loras=1", "lora.max_lora_rank=128",
                                   "server.extra_args=[--max-cpu-loras=2]")
    assert code == 0, err
    serve = words(out)[words(out).index("vllm"):]
    assert flag(serve, "--max-loras") == "1" and flag(serve, "--max-lora-rank") == "128"
    assert "warning: lora.max_loras=1 is below the 2 adapters configured" in err
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", "lora.max_loras=2",
                                   "lora.max_lora_rank=8")
    assert code == 0 and "--enable-lora" not in out, err
    assert "warning: lora.max_loras=2 and lora.max_lora_rank=8 have no effect without lora.adapters" in err
    for overrides, needles in ((["lora.max_loras=0"], ["lora.max_loras", "at least 1"]),
                               (["server.extra_args=[--max-loras,4]"], ["--max-loras", "lora.max_loras"]),
                               (["server.extra_args=[--max_cpu_loras,1]"], ["--max-cpu-loras 1", "lora.max_loras=2"]),
                               (["server.extra_args=[--max-cpu-lo=1]"], ["--max-cpu-loras 1"])):  # abbreviated
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", adapters,
                                       *overrides)
        one_error_line(code, err, *needles)
        assert out == ""


def _no_tokenizer(p):
    return fake_model_dir(p, tokenizer=False)


def _sparse_4b_config(p):
    """google/gemma-3-4b-it's config.json names no head counts: transformers' defaults (8 heads, 4 KV heads)."""
    d = fake_model_dir(p, arch="Gemma3ForConditionalGeneration", nested=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}))
    save_tensors(d / "model.safetensors", every_weight(json.loads((d / "config.json").read_text()), nested=True))
    return d


def _json_template(p, in_tokenizer: bool):
    """A model whose template is in chat_template.json (as a processor saves it), and in tokenizer_config.json
    when `in_tokenizer`."""
    d = fake_model_dir(p, template=False)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    if in_tokenizer:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return d


def test_a_template_in_chat_template_json_is_not_passed_as_the_template(tmp_path, capsys):
    """--chat-template /models/NAME/chat_template.json: vLLM read the JSON text as the Jinja template. The
    tokenizer's own template serves tool calls instead."""
    d = _json_template(tmp_path / "m", in_tokenizer=True)
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}")
    assert code == 0, err
    assert "--enable-auto-tool-choice" in words(out) and "--chat-template" not in words(out)


def _missing_shard(p):
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    return d


def _damaged_shard(p):
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True, shards=2)
    (d / "model-00001-of-00002.safetensors").write_bytes((20).to_bytes(8, "little") + b'{"w": {"dtype": ')
    return d


def _stale_single_file(p):
    """A model.safetensors left beside an index naming other shards: transformers serve (--local) loaded the file,
    vLLM the shards."""
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True, shards=2)
    save_tensors(d / "model.safetensors", {"model.language_model.layers.0.self_attn.q_proj.weight": (Q_OUT, HIDDEN)})
    return d


def _index_names_another_shard(p):
    """An index naming a tensor's shard wrongly: transformers serve filled that tensor with random values."""
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["layer.1.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _short_tokenizer_limit(p, n=1024):
    """A tokenizer_config.json whose model_max_length is shorter than max_position_embeddings (32768 here)."""
    d = fake_model_dir(p)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": n}))
    return d


def _k_eq_v_gemma4(p, global_kv: int, last: str = "full_attention"):
    """A Gemma 4 whose K=V full-attention layers have `global_kv` KV heads (its sliding layers 4); its last layer
    full attention whatever layer_types says (transformers makes it so: a list of sliding layers alone was not
    checked)."""
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=4, nested=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(attention_k_eq_v=True, num_global_key_value_heads=global_kv,
                              layer_types=["sliding_attention", last])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _mlp_width(p, width: int):
    """A Gemma 3 of 8 query heads and 4 KV heads (tensor_parallel_size 8 shares them out) whose MLP is `width` wide."""
    d = fake_model_dir(p, kv=4)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": width}))
    return d


def _moe_gemma4(p, expert_width: int):
    """A Gemma 4 mixture of experts of 8 query and 4 KV heads whose experts are `expert_width` wide."""
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=4, nested=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(enable_moe_block=True, num_experts=4, top_k_experts=2,
                              moe_intermediate_size=expert_width)
    (d / "config.json").write_text(json.dumps(cfg))
    save_tensors(d / "model.safetensors", {**every_weight(cfg, nested=True),
                                           "model.language_model.layers.0.self_attn.q_proj.weight": (Q_OUT, HIDDEN)})
    return d


@pytest.mark.parametrize("config,make,overrides,needles", [
    (CONFIG_270M, fake_model_dir, ["server.tensor_parallel_size=3"],  # its one KV head copied, but 2 heads
     ["tensor_parallel_size=3", "num_attention_heads=2"]),
    (CONFIG_31B, lambda p: fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=12, nested=True), [],
     ["tensor_parallel_size=8", "num_key_value_heads=12"]),
    (CONFIG_270M, _sparse_4b_config, ["server.tensor_parallel_size=6"],  # was "no num_key_value_heads"
     ["tensor_parallel_size=6", "num_key_value_heads=4"]),
    # vLLM bounds the context by the smaller of the two and refuses a longer --max-model-len when the engine starts
    (CONFIG_270M, _short_tokenizer_limit, [],
     ["server.max_model_len=2048 exceeds model_max_length=1024", "tokenizer_config.json"]),
    # vLLM asserts it of the K=V full-attention layers' own count when it builds the model, minutes into the start
    (CONFIG_31B, lambda p: _k_eq_v_gemma4(p, 3), ["server.tensor_parallel_size=2"],
     ["tensor_parallel_size=2", "num_global_key_value_heads=3"]),
    (CONFIG_31B, lambda p: _k_eq_v_gemma4(p, 3, "sliding_attention"), ["server.tensor_parallel_size=2"],
     ["tensor_parallel_size=2", "num_global_key_value_heads=3"]),
    # vLLM's MLP layers assert that the chips split its width evenly, minutes into the start (an AssertionError)
    (CONFIG_270M, lambda p: _mlp_width(p, 100), ["server.tensor_parallel_size=8"],
     ["tensor_parallel_size=8 does not divide intermediate_size=100", "config.json"]),
    # vLLM's FusedMoE splits each expert's width over the chips alike (the dense intermediate_size passed)
    (CONFIG_31B, lambda p: _moe_gemma4(p, 22), ["server.tensor_parallel_size=8"],
     ["tensor_parallel_size=8 does not divide moe_intermediate_size=22", "config.json", "--enable-expert-parallel"]),
    (CONFIG_270M, _no_tokenizer, [], ["no tokenizer"]),
    (CONFIG_270M, lambda p: fake_model_dir(p, arch="LlamaForCausalLM"), [], ["LlamaForCausalLM", "Gemma3ForCausalLM"]),
    (CONFIG_31B, _missing_shard, [], ["model-00002-of-00002.safetensors"]),
    # read by the server only once started: a safetensors traceback (--local), minutes into vLLM's start
    (CONFIG_31B, _damaged_shard, [], ["model-00001-of-00002.safetensors", "unreadable safetensors header"]),
    (CONFIG_31B, _stale_single_file, [], ["holds both model.safetensors and model.safetensors.index.json",
                                          "remove the one that is stale"]),
    (CONFIG_31B, _index_names_another_shard, [], ["tensor layer.1.weight is not in model-00001-of-00002.safetensors"]),
    (CONFIG_270M, lambda p: fake_model_dir(p, generation=False), [], ["generation_config.json"]),
    (CONFIG_270M, lambda p: (fake_model_dir(p), (p / "model.safetensors").unlink()) and p, [], ["no weights"]),
    (CONFIG_270M, lambda p: fake_model_dir(p, template=False), [], ["no chat template"]),
    # vLLM's --chat-template reads a file's text as the template: the JSON was passed, and was the prompt
    (CONFIG_270M, lambda p: _json_template(p, in_tokenizer=False), [], ["chat_template.json", ".jinja"]),
    (CONFIG_270M, lambda p: fake_model_dir(p, arch="Gemma4ForCausalLM"), [], ["tool_calling.parser", "gemma4"]),
    (CONFIG_270M, fake_model_dir, ["server.dtype=float16"], ["server.dtype"]),
    (CONFIG_270M, fake_model_dir, ["server.tensor_parralel_size=1"], ["tensor_parralel_size"]),
    (CONFIG_270M, fake_model_dir, ["container.env={HF_TOKEN: abc}"], ["container.env.HF_TOKEN"]),
    (CONFIG_270M, lambda p: p, [], ["not a directory"]),
    (CONFIG_270M, fake_model_dir, ['server.host=""'], ["server.host ''"]),
    (CONFIG_270M, fake_model_dir, ["server.host=127.0.0.1 --evil"], ["server.host '127.0.0.1 --evil'"]),
    (CONFIG_270M, fake_model_dir, ['container.image=""'], ["container.image ''", "image reference"]),
    (CONFIG_270M, fake_model_dir, ["container.image=vllm/vllm-tpu latest"], ["container.image 'vllm/vllm-tpu latest'"]),
    (CONFIG_270M, fake_model_dir, ["container.name=my server"], ["container.name 'my server'"]),
    (CONFIG_270M, fake_model_dir, ['container.compile_cache=""'], ["container.compile_cache is empty"]),
    # docker takes a zero --shm-size as its default (64m) without a word
    (CONFIG_270M, fake_model_dir, ["container.shm_size=0g"], ["container.shm_size '0g' is zero"]),
    # docker reads a bare number as bytes: `shm_size: 16` gave the container 16 bytes of shared memory
    (CONFIG_270M, fake_model_dir, ["container.shm_size=16"], ["container.shm_size '16' has no unit", "16 bytes",
                                                              "16g"]),
    # rendered as --max-model-len 100000000000000000000 where vLLM is told to allow a context past the model's
    (CONFIG_270M, fake_model_dir, ["server.max_model_len=1e20", "container.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"],
     ["override 'server.max_model_len=1e20'", "server.max_model_len=100000000000000000000 is past", "2147483647"]),
    (CONFIG_270M, fake_model_dir, ["model.dir=~"], ["override 'model.dir=~'", "model.dir is not set"]),  # YAML null
    # a template that is no text, or empty: vLLM failed on it once the container was up
    (CONFIG_270M, lambda p: (fake_model_dir(p), (p / "chat_template.jinja").write_bytes(b"\xff{{ x }}")) and p, [],
     ["/m/chat_template.jinja is not UTF-8 text (byte 0)"]),
    (CONFIG_270M, lambda p: (fake_model_dir(p), (p / "chat_template.jinja").write_text(" \n")) and p, [],
     ["/m/chat_template.jinja is empty"]),
    # text that never reads the conversation (a system prompt saved as the template): every prompt was that text
    (CONFIG_270M, lambda p: (fake_model_dir(p), (p / "chat_template.jinja").write_text("You are a coach.\n")) and p,
     [], ["/m/chat_template.jinja never reads `messages`: not a chat template"]),
    # two symbolic links leading to each other: a RuntimeError traceback where the launcher resolved the path
    (CONFIG_270M, lambda p: (p.symlink_to(p.with_name("loop")), p.with_name("loop").symlink_to(p)) and p, [],
     ["model.dir", "/m: cannot resolve the path", "leads back to itself"]),
    # docker splits -v at ':': "invalid volume specification" from docker, after --print had shown the command
    (CONFIG_270M, lambda p: fake_model_dir(p.with_name("a:b")), [], ["model.dir", "a:b", "holds ':'"]),
    # vLLM's SchedulerConfig refuses it minutes into the container's start
    (CONFIG_270M, fake_model_dir, ["server.max_num_seqs=4096"],
     ["server.max_num_batched_tokens=2048", "server.max_num_seqs=4096"]),
    # vLLM's SchedulerConfig refuses it without chunked prefill, when the engine starts
    (CONFIG_270M, fake_model_dir,
     ["server.extra_args=[--no-enable-chunked-prefill]", "server.max_num_batched_tokens=1024"],
     ["server.max_num_batched_tokens=1024 is below server.max_model_len=2048", "--no-enable-chunked-prefill"]),
    # vLLM keeps the last of a repeated option: the server listened on 9000 while the config (and clients) said 8000
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--port,9000]"], ["--port", "server.port"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max_model_len=100]"], ["server.max_model_len"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--api-key,sk-1]"], ["server.api_key_env"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--chat-template-content-format,string]"],
     ["server.chat_template_content_format"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max-model-l,100]"], ["server.max_model_len"]),  # abbreviated
    # a help option: `vllm serve` printed its help and exited 0, and the container stopped serving nothing
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-h]"], ["-h makes `vllm serve` print its help and exit"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--enforce-eager,--help=all]"],
     ["--help=all makes `vllm serve` print its help and exit"]),
    # a misspelt option: vLLM's usage error only on the TPU VM, after the image pull and minutes of container start
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--gpu-memory-utilisation,0.9]"],
     ["--gpu-memory-utilisation is not an option of `vllm serve`", "did you mean --gpu-memory-utilization?",
      "vllm/vllm-tpu:v0.27.0"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--enable-prefix-caching,--kv-cache-dtype=fp8,--enforce_eagre]"],
     ["--enforce_eagre is not an option", "did you mean --enforce-eager?"]),
    # a value outside an option's fixed set: the same usage error of vLLM's parser, as late
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--kv-cache-dtype,fp8_e4m3fn]"],
     ["--kv-cache-dtype 'fp8_e4m3fn' is not a value `vllm serve` takes in vllm/vllm-tpu:v0.27.0",
      "did you mean fp8_e4m3?", "it takes auto, bfloat16, float16, fp8, "]),
    # a number vLLM's engine refuses as it starts (CacheConfig: gpu_memory_utilization in (0, 1]), on the TPU VM
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--gpu-memory-utilization,1.5]"],
     ["--gpu-memory-utilization '1.5' is not a fraction of the accelerator's memory in (0, 1]"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--gpu_memory_utilization=nan]"],
     ["--gpu-memory-utilization 'nan' is not a fraction"]),
    # a parallel size below 1 (vLLM's ParallelConfig: ge=1), refused as the engine starts, on the TPU VM
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--pipeline-parallel-size,0]"],
     ["--pipeline-parallel-size '0' is not a number of pipeline stages (at least 1)"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-pp,0]"], ["--pipeline-parallel-size '0' is not"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--data_parallel_size=-2]"],
     ["--data-parallel-size '-2' is not a number of data-parallel replicas (at least 1)"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-dcp=0]"], ["--decode-context-parallel-size '0' is not"]),
    # vLLM's short -n is --nnodes (and -r --node-rank): `-n 0` passed where `--nnodes 0` was refused
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-n,0]"], ["--nnodes '0' is not a number of nodes (at least 1)"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max-parallel-loading-workers,0]"],
     ["--max-parallel-loading-workers '0' is not"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--block-size=0]"],
     ["--block-size '0' is not a number of tokens a KV cache block holds (at least 1)"]),
    # a word (or a fraction) where vLLM's parser converts the value to a number: its usage error, on the TPU VM
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--seed,x]"],
     ["--seed 'x' is not an integer, which `vllm serve` takes in vllm/vllm-tpu:v0.27.0"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max-logprobs=2.5,--enforce-eager]"],
     ["--max-logprobs '2.5' is not an integer"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--cpu-offload-gb,lots]"],
     ["--cpu-offload-gb 'lots' is not a number"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max-cpu-loras,four]"],  # optional: "None" too
     ["--max-cpu-loras 'four' is not an integer (or None)"]),
    # a word no option takes: vLLM's parser reads it as a second model argument ("unrecognized arguments"), on the VM
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[foo,--enforce-eager]"],
     ["server.extra_args: 'foo' is no option's value", "unrecognized arguments"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--seed,1,2]"], ["'2' is no option's value (--seed takes one"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--kv-cache-dtype=fp8,fp8]"],
     ["'fp8' is no option's value (--kv-cache-dtype=fp8 took its value"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=['']"], ["'' is no option's value"]),
    # the option named as written: it said `-n=2`, a word the user never wrote
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-n2,x]"], ["'x' is no option's value (-n2 took its value)"]),
    # a switch (vLLM's BooleanOptionalAction: --x / --no-x) takes no value: its parser stops at `--x=true` ("ignored
    # explicit argument 'true'"), and at `--x true` as a second model; both passed here
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--enable-prefix-caching=true]"],
     ["server.extra_args: --enable-prefix-caching=true gives a value to a switch", "write --enable-prefix-caching",
      "or --no-enable-prefix-caching"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--no-enable_prefix_caching=0]"],
     ["--no-enable_prefix_caching=0 gives a value to a switch"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-ep=false]"], ["-ep=false gives a value to a switch"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--enable-prefix-caching,'true']"],
     ["'true' is no option's value (--enable-prefix-caching is a switch, which takes none)"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-dph,1]"], ["'1' is no option's value (-dph is a switch"]),
    # a store_true switch has no --no- form, and took a value unremarked (vLLM's argparse: "ignored explicit argument")
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--disable-log-stats=x]"],
     ["server.extra_args: --disable-log-stats=x gives a value to a switch", "write --disable-log-stats to turn it "
      "on, or leave it out to keep it off"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--aggregate_engine_logging=1]"],
     ["--aggregate_engine_logging=1 gives a value to a switch"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--disable-log-stats,'yes']"],
     ["'yes' is no option's value (--disable-log-stats is a switch, which takes none)"]),
    # argparse takes no option for the value: "expected one argument"
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--seed]"], ["--seed needs a value (an integer)"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--seed,--enforce-eager]"], ["--seed needs a value"]),
    # an abbreviation of several options: vLLM's argparse refuses it as ambiguous (--max passed with a warning)
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max,4]"],
     ["--max abbreviates several options of `vllm serve` (--max-cpu-loras, ", "give the option in full"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--max-num,4]"],
     ["(--max-num-batched-tokens, --max-num-scheduled-tokens, --max-num-seqs)", "refuses as ambiguous"]),
    # a single-dash word abbreviates the single-dash options as argparse reads it: `-p` could be -pcp or -pp, and
    # `-t` is -tp, which the config sets (both were "not an option of `vllm serve`")
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-p,2]"],
     ["-p abbreviates several options of `vllm serve` (-pcp, -pp), which its parser refuses as ambiguous"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-t,4]"],
     ["server.extra_args: -t is set from the config; set server.tensor_parallel_size instead"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[-pc,0]"],
     ["--prefill-context-parallel-size '0' is not a number of context-parallel ranks (at least 1)"]),
    (CONFIG_270M, fake_model_dir, ["container.env.MODEL_IMPL_TYPE=flax"],  # tpu-inference refused it at start
     ["container.env.MODEL_IMPL_TYPE='flax'", "did you mean flax_nnx?", "auto, flax_nnx, vllm"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--logprobs_mode=raw]"],
     ["--logprobs-mode 'raw' is not a value", "raw_logits, raw_logprobs"]),
    # the speculative draft's own variable, refused by tpu-inference at engine start as MODEL_IMPL_TYPE is
    (CONFIG_270M, fake_model_dir, ["container.env.DRAFT_MODEL_IMPL_TYPE=jax"],
     ["container.env.DRAFT_MODEL_IMPL_TYPE='jax'", "auto, flax_nnx, vllm"]),
    (CONFIG_270M, fake_model_dir, ["server.extra_args=[--model-impl=torchax]"],
     ["--model-impl 'torchax' is not a model implementation vLLM takes", "auto, vllm, transformers, terratorch"]),
    # vLLM's --model-impl does not choose tpu-inference's implementation: under MODEL_IMPL_TYPE auto Gemma 4 was
    # served by the JAX model, the option (and, with adapters, the LoRA) quietly unused
    (CONFIG_31B, lambda p: fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True),
     ["server.extra_args=[--model_impl,vllm]"],
     ["--model-impl vllm chooses among vLLM's PyTorch models", "MODEL_IMPL_TYPE=auto", "MODEL_IMPL_TYPE=vllm"]),
    (CONFIG_31B, lambda p: fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=16, nested=True),
     ["server.extra_args=[--model-impl,transformers]", "container.env.MODEL_IMPL_TYPE=flax_nnx"],
     ["--model-impl transformers", "MODEL_IMPL_TYPE=flax_nnx (it serves its JAX model)"]),
])
def test_invalid_configs_are_refused_in_one_line(tmp_path, capsys, config, make, overrides, needles):
    d = make(tmp_path / "m")
    code, out, err = launch_inproc(capsys, "--config", config, "--print", f"model.dir={d}", *overrides)
    one_error_line(code, err, *needles)
    assert out == ""


@pytest.mark.parametrize("nested,impl,refused", [(False, None, True), (False, "flax_nnx", True),
                                                 (False, "vllm", False), (True, None, False)])
def test_a_text_only_gemma4_is_refused_where_tpu_inferences_jax_model_cannot_load_it(tmp_path, capsys, nested, impl,
                                                                                    refused):
    """tpu-inference's JAX Gemma 4 (MODEL_IMPL_TYPE auto, the default, or flax_nnx) reads the decoder's config from
    config.json's text_config and its weights under model.language_model., as Google's multimodal releases have
    them: a text-only Gemma4ForCausalLM (a Gemma4TextConfig: no text_config, weights under model.) was passed and
    failed at the engine's start on the TPU VM. vLLM's own Gemma 4 (MODEL_IMPL_TYPE=vllm) reads both layouts."""
    d = fake_model_dir(tmp_path / "m", arch="Gemma4ForCausalLM", kv=4, nested=nested)
    env = [f"container.env.MODEL_IMPL_TYPE={impl}"] if impl else []
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}", *env)
    if refused:
        one_error_line(code, err, f"model dir {d}", "text_config", f"MODEL_IMPL_TYPE={impl or 'auto'}",
                       "set container.env.MODEL_IMPL_TYPE=vllm")
        assert out == ""
    else:
        assert code == 0, err


def test_experts_spread_whole_over_the_chips_need_not_split_their_width(tmp_path, capsys):
    """With expert parallelism vLLM keeps each expert whole on a chip: moe_intermediate_size need not divide (the
    dense MLP's width still must); `--no-enable-expert-parallel` after it takes it back, as vLLM's parser does."""
    d = _moe_gemma4(tmp_path / "m", 22)
    for ep in ("-ep", "--enable-expert-parallel", "--enable_expert_parallel"):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                       f"server.extra_args=[{ep}]")
        assert code == 0, err
        assert ep in words(out)
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   "server.extra_args=[-ep,--no-enable-expert-parallel]")
    one_error_line(code, err, "does not divide moe_intermediate_size=22")


def _ple_gemma4(p, width: int):
    """A Gemma 4 (2 layers, 8 query and 4 KV heads) whose per-layer inputs are `width` wide."""
    d = fake_model_dir(p, arch="Gemma4ForConditionalGeneration", kv=4, nested=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(hidden_size_per_layer_input=width)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_per_layer_input_projection_splits_over_the_chips_on_vllms_own_model_only(tmp_path, capsys):
    """vLLM's PyTorch Gemma 4 (MODEL_IMPL_TYPE=vllm, what LoRA adapters are served on) splits the per-layer input
    projection (num_hidden_layers x hidden_size_per_layer_input outputs, a ColumnParallelLinear) evenly over the chips
    and asserts it divides, minutes into the engine's start; the check passed it. tpu-inference's JAX model (auto)
    keeps that projection whole: any width is served."""
    d = _ple_gemma4(tmp_path / "m", 6)  # 2 layers x 6 = 12 outputs: not 8 chips' share
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   "container.env.MODEL_IMPL_TYPE=vllm")
    one_error_line(code, err, "tensor_parallel_size=8 does not divide num_hidden_layers x hidden_size_per_layer_input"
                              " = 2 x 6 = 12", "config.json", "MODEL_IMPL_TYPE")
    assert out == ""
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}")
    assert code == 0, err
    d = _ple_gemma4(tmp_path / "m4", 4)  # 8 outputs: one a chip
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   "container.env.MODEL_IMPL_TYPE=vllm")
    assert code == 0, err


def test_gemma4_attention_softcap_that_only_vllms_own_model_applies_is_refused_there(tmp_path, capsys):
    """attn_logit_softcapping is no field of transformers' Gemma4TextConfig (a Gemma 2/3 key a converted config.json may
    carry): transformers and training ignore it, and tpu-inference's JAX model too, but vLLM's own Gemma 4
    (MODEL_IMPL_TYPE=vllm) passes it to its attention as the logit cap: that server ran another model than the one
    trained and merged, without a word. A null cap is what transformers' configs of other families write."""
    d = fake_model_dir(tmp_path / "m", arch="Gemma4ForConditionalGeneration", kv=4, nested=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["attn_logit_softcapping"] = 50.0
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   "container.env.MODEL_IMPL_TYPE=vllm")
    one_error_line(code, err, "config.json has attn_logit_softcapping=50.0", "MODEL_IMPL_TYPE=vllm",
                   "transformers")
    assert out == ""
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}")  # the JAX model
    assert code == 0, err
    cfg["text_config"]["attn_logit_softcapping"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   "container.env.MODEL_IMPL_TYPE=vllm")
    assert code == 0, err


@pytest.mark.parametrize("arch,nested,cap,refused", [
    ("Gemma3ForConditionalGeneration", True, 30.0, True), ("Gemma3ForConditionalGeneration", True, None, False),
    ("Gemma3ForCausalLM", False, 30.0, False)])
def test_gemma3_final_softcap_only_vllm_applies_to_a_multimodal_model_is_refused(tmp_path, capsys, arch, nested,
                                                                                 cap, refused):
    """transformers' Gemma3ForConditionalGeneration never reads text_config.final_logit_softcapping (its
    Gemma3ForCausalLM does), and training follows it; vLLM builds the multimodal model's decoder as its
    Gemma3ForCausalLM on the text config, which caps the final logits by it: the server ran another model than the one
    trained and merged, without a word. A text model's cap is applied on both sides."""
    d = fake_model_dir(tmp_path / "m", arch=arch, nested=nested)
    cfg = json.loads((d / "config.json").read_text())
    (cfg["text_config"] if nested else cfg)["final_logit_softcapping"] = cap
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}")
    if refused:
        one_error_line(code, err, "config.json has text_config.final_logit_softcapping=30.0",
                       "Gemma3ForConditionalGeneration", "vLLM")
        assert out == ""
    else:
        assert code == 0, err


_SLIDE, _FULL = {"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "proportional", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.25}
_HALF = {**_SLIDE, "partial_rotary_factor": 0.5}
# name: (family, edit of the text config, impls refused (auto: tpu-inference's JAX model; vllm: vLLM's own), needle)
_ROPE_CASES = {
    "gemma3 entry": ("gemma3", {"rope_parameters": {"sliding_attention": _HALF,
                                                    "full_attention": {**_SLIDE, "rope_theta": 1e6}}},
                     ("auto",), "rope_parameters.sliding_attention.partial_rotary_factor=0.5"),
    "gemma3 top level": ("gemma3", {"partial_rotary_factor": 0.5,
                                    "layer_types": ["sliding_attention", "full_attention"]},
                         ("auto",), "config.json has partial_rotary_factor=0.5"),
    # laid over the entries only where each is of a layer type the model has (standardize_rope_params)
    "gemma3 top level, sliding layers alone": ("gemma3", {"partial_rotary_factor": 0.5}, (), ""),
    "gemma3 whole head": ("gemma3", {"partial_rotary_factor": 1.0}, (), ""),
    "gemma4 sliding entry": ("gemma4", {"rope_parameters": {"sliding_attention": _HALF, "full_attention": _FULL}},
                             ("auto", "vllm"), "rope_parameters.sliding_attention.partial_rotary_factor=0.5"),
    "gemma4 top level": ("gemma4", {"partial_rotary_factor": 0.25}, ("auto", "vllm"),
                         "has partial_rotary_factor=0.25"),
    "gemma4 top level, global layers alone": ("gemma4", {"partial_rotary_factor": 0.25,
                                                         "layer_types": ["full_attention"] * 2,
                                                         "rope_parameters": {"sliding_attention": _SLIDE,
                                                                             "full_attention": _FULL}}, (), ""),
    "gemma4 proportional factor": ("gemma4", {"rope_parameters": {"sliding_attention": _SLIDE,
                                                                  "full_attention": {**_FULL, "factor": 2.0}}},
                                   ("auto", "vllm"), "rope_parameters.full_attention.factor=2.0"),
    "gemma4 linear": ("gemma4", {"rope_parameters": {"sliding_attention": {**_SLIDE, "rope_type": "linear",
                                                                           "factor": 2.0},
                                                     "full_attention": _FULL}},
                      ("auto",), "rope_parameters.sliding_attention.factor=2.0"),
    "gemma4 default factor": ("gemma4", {"rope_parameters": {"sliding_attention": {**_SLIDE, "factor": 8.0},
                                                             "full_attention": _FULL}},
                              ("auto",), "rope_parameters.sliding_attention.factor=8.0"),
    "gemma4 no angles": ("gemma4", {"rope_parameters": {"sliding_attention": _SLIDE,
                                                        "full_attention": {**_FULL, "partial_rotary_factor": 0.0}}},
                         ("vllm",), "rope_parameters.full_attention.partial_rotary_factor=0.0"),
    "gemma4 not a number": ("gemma4", {"partial_rotary_factor": "0.5"}, ("auto", "vllm"),
                            "config.json: partial_rotary_factor='0.5' is not of type int or float"),
    "gemma4 as published": ("gemma4", {"rope_parameters": {"sliding_attention": _SLIDE, "full_attention": _FULL}},
                            (), ""),
}


@pytest.mark.parametrize("name", list(_ROPE_CASES))
def test_rope_that_vllm_would_rotate_otherwise_than_transformers_is_refused_by_key(tmp_path, capsys, name):
    """transformers' default RoPE (Gemma 3's layers, Gemma 4's sliding ones) rotates whole heads whatever
    partial_rotary_factor says, and training with it; vLLM's get_rope rotates int(head_size * partial_rotary_factor)
    of each head for default RoPE, tpu-inference's JAX Gemma 4 that share of its angles, both after laying a top-level
    factor over every rope_parameters entry. Proportional RoPE's factor is divided into the frequencies by transformers
    and ignored by both servers; tpu-inference scales linear RoPE as llama3 RoPE. Each served another model than the
    one trained and merged, without a word: refused in one line naming the key, where it would be served so. A
    default entry's factor (transformers ignores it) is scaled as llama3 RoPE by tpu-inference too; a proportional
    share of 0 (transformers rotates nothing there) is refused by vLLM's get_rope minutes into the engine start."""
    family, edit, refused, needle = _ROPE_CASES[name]
    nested = family == "gemma4"
    d = fake_model_dir(tmp_path / "m", arch="Gemma4ForConditionalGeneration" if nested else "Gemma3ForCausalLM",
                       kv=4 if nested else 1, nested=nested)
    cfg = json.loads((d / "config.json").read_text())
    (cfg["text_config"] if nested else cfg).update(json.loads(json.dumps(edit)))
    (d / "config.json").write_text(json.dumps(cfg))
    for impl in ("auto", "vllm") if nested else ("auto",):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_31B if nested else CONFIG_270M, "--print",
                                       f"model.dir={d}", f"container.env.MODEL_IMPL_TYPE={impl}")
        if impl in refused:
            one_error_line(code, err, needle, "transformers")
            assert out == ""
        else:
            assert code == 0, err


def _edit_weights(src: Path, dst: Path, drop: str = "", add: str = "") -> Path:
    """A copy of the model directory `src` whose model.safetensors lacks `drop` and holds an extra `add`."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop(drop, None) if drop else None
    if add:
        tensors[add] = np.zeros(4, np.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def other_warnings(err: str) -> list[str]:
    """The warnings in `err` but the one that the tiny model (no chat template of its own) served with tool calling off
    gets (`template_warning`)."""
    return [line for line in err.splitlines() if "warning" in line and "has no chat template" not in line]


def test_a_directory_missing_a_tensor_of_its_model_is_refused(tiny_dir, tmp_path, capsys):
    """One decoder tensor gone from a merged directory (a copy cut short, an edited checkpoint) passed --print and
    --local: vLLM refused it when the engine started and transformers serve filled it with random values. A
    tensor the config has no place for is only warned of (the servers ignore it); the directory itself passes."""
    args = ["--config", CONFIG_270M, "tool_calling.enabled=false", "server.max_model_len=512"]
    code, out, err = launch_inproc(capsys, *args, "--print", f"model.dir={tiny_dir}")
    assert code == 0 and not other_warnings(err), err
    gone = "model.layers.0.mlp.down_proj.weight"
    d = _edit_weights(tiny_dir, tmp_path / "m", drop=gone)
    for mode in ("--print", "--local"):
        code, out, err = launch_inproc(capsys, *args, mode, f"model.dir={d}")
        one_error_line(code, err, str(d), "1 tensor", gone, "missing from the weights", "vLLM refuses")
        assert out == ""
    extra = "model.layers.9.mlp.down_proj.weight"  # tiny_dir has 2 layers
    d = _edit_weights(tiny_dir, tmp_path / "x", add=extra)
    code, out, err = launch_inproc(capsys, *args, "--print", f"model.dir={d}")
    assert code == 0, err
    assert f"warning: model.dir: 1 tensor the model its config.json describes has no place for ({extra})" in err


def test_missing_generation_config_names_the_server_that_needs_it(tmp_path, capsys):
    d = fake_model_dir(tmp_path / "m", generation=False)
    code, _, err = launch_inproc(capsys, "--config", CONFIG_270M, "--local", f"model.dir={d}")
    one_error_line(code, err, "generation_config.json", "the local server reads its stop tokens")
    assert "vLLM" not in err


def test_adapter_checks(tmp_path, capsys):
    d = fake_model_dir(tmp_path / "m")
    big = fake_adapter(tmp_path / "big", r=600)
    code, _, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                 f"lora.adapters=[{{name: big, dir: {big}}}]")
    one_error_line(code, err, "rank 600")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                 f"lora.adapters=[{{name: e, dir: {empty}}}]")
    one_error_line(code, err, "adapter_config.json")
    # an adapter of another model, a weights file cut short, one without LoRA tensors: vLLM failed on each in
    # its start on the TPU VM; now one line before the container
    other = fake_adapter(tmp_path / "other", r=8, hidden=32)
    cut = fake_adapter(tmp_path / "cut", r=8)
    (cut / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes()[:-8])
    bare = fake_adapter(tmp_path / "bare", r=8)
    save_tensors(bare / "adapter_model.safetensors", {"x.weight": (2, 2)})
    dora, saved = fake_adapter(tmp_path / "dora", r=8), fake_adapter(tmp_path / "saved", r=8)
    for a, extra in ((dora, {"use_dora": True}), (saved, {"modules_to_save": ["lm_head"]})):
        (a / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                                           **extra}))
    for a, needles in ((dora, ["lora.adapters.a:", "use_dora=true", "vLLM serves no DoRA"]),
                       (saved, ["lora.adapters.a:", "modules_to_save=['lm_head']"]),
                       (other, ["lora.adapters.a:", "layers.0.self_attn.q_proj is [8, 32]", "[8, 16]",
                                "another model"]),
                       (cut, [f"{cut}/adapter_model.safetensors", "truncated"]),
                       (bare, ["lora.adapters.a:", "no LoRA weights"])):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                       f"lora.adapters=[{{name: a, dir: {a}}}]")
        one_error_line(code, err, *needles)
        assert out == ""


@pytest.mark.parametrize("deployed, left_out", [
    ("[--lora-target-modules, o_proj]", "q_proj"),
    ("[--lora_target_modules=down_proj, --enforce-eager]", "q_proj"),
    ("[--lora-target-modules, qkv_proj]", None),  # vLLM's packed layer of q, k and v
    ("[--lora-target-modules, v_proj, o_proj]", None),  # one member wraps the packed layer: q_proj's update applies
    ("[--lora-target-mod, o_proj]", "q_proj"),  # vLLM's argparse takes an unambiguous abbreviation: it was let through
])
@pytest.mark.parametrize("multimodal", [False, True])
def test_lora_target_modules_leaving_out_an_adapters_module_is_refused(tmp_path, capsys, deployed, left_out,
                                                                       multimodal):
    """vLLM's --lora-target-modules wraps only the modules it names (or their packed qkv_proj / gate_up_proj) in LoRA
    layers and loads an adapter of others without a word: the adapter was served without those updates.
    convert.export_peft writes a multimodal base's target_modules as a regex (keeping PEFT out of the vision tower's
    own q/k/v_proj), which the check did not read: its modules are read off the adapter's weights."""
    if multimodal:
        d = fake_model_dir(tmp_path / "m", arch="Gemma3ForConditionalGeneration", nested=True)
        a = fake_adapter(tmp_path / "a", r=8, nested=True)  # q_proj, as export_peft names a multimodal adapter's
        regex = r"model\.language_model\.layers\.\d+\.(?:self_attn|mlp)\.(?:q_proj)"
        (a / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": regex}))
    else:
        d, a = fake_model_dir(tmp_path / "m"), fake_adapter(tmp_path / "a", r=8)  # targets q_proj
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: coach, dir: {a}}}]", f"server.extra_args={deployed}")
    if left_out:
        one_error_line(code, err, f"leaves out {left_out} of lora.adapters.coach", "without their updates")
    else:
        assert code == 0 and "--lora-target-modules" in out, err


@pytest.mark.parametrize("k_eq_v,targets,layers,refused", [
    (True, ["q_proj", "k_proj"], (0, 1), True), (True, ["q_proj"], (), False),
    (False, ["q_proj", "k_proj"], (0, 1), False),
    # peft's layers_to_transform (or a regex) left the global layer out: vLLM serves it as trained
    (True, ["q_proj", "k_proj"], (0,), False),
    # target_modules as peft also takes them, a name's dotted tail: vLLM loads the tensors whatever they say
    (True, ["self_attn.q_proj", "self_attn.k_proj"], (1,), True)])
def test_a_k_proj_adapter_on_a_k_eq_v_gemma4_is_refused_where_vllm_would_not_update_the_values(
        tmp_path, capsys, k_eq_v, targets, layers, refused):
    """A Gemma 4 with attention_k_eq_v takes its global layers' keys as their values: transformers (with PEFT) and
    training use k_proj's output, LoRA update included, for both. vLLM's own Gemma 4 (the one that takes adapters)
    copies the base k_proj weight into its packed qkv_proj's value slot and applies the adapter's k_proj update to
    the key slot alone: the adapter was served with values the trained model never had, without a word. Judged by
    target_modules' names, an adapter whose k_proj skips the global layer (layer 1 here) was refused, and one
    naming `self_attn.k_proj` passed; vLLM applies what the tensors hold, layer by layer."""
    d = fake_model_dir(tmp_path / "m", arch="Gemma4ForConditionalGeneration", kv=4, nested=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(attention_k_eq_v=k_eq_v, num_global_key_value_heads=4)
    (d / "config.json").write_text(json.dumps(cfg))
    k_out, stem = 4, "model.language_model.layers"
    save_tensors(d / "model.safetensors", {**every_weight(cfg, nested=True), f"{stem}.0.self_attn.q_proj.weight":
                                           (Q_OUT, HIDDEN), **{f"{stem}.{i}.self_attn.k_proj.weight": (k_out, HIDDEN)
                                                               for i in (0, 1)}})
    a = fake_adapter(tmp_path / "a", r=8, nested=True)
    (a / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": targets}))
    ks = {f"base_model.model.{stem}.{i}.self_attn.k_proj.lora_{ab}.weight": shape
          for i in layers for ab, shape in (("A", (8, HIDDEN)), ("B", (k_out, 8)))}
    save_tensors(a / "adapter_model.safetensors", {f"base_model.model.{stem}.0.self_attn.q_proj.lora_A.weight":
                                                   (8, HIDDEN), f"base_model.model.{stem}.0.self_attn.q_proj."
                                                   "lora_B.weight": (Q_OUT, 8), **ks})
    code, out, err = launch_inproc(capsys, "--config", CONFIG_31B, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: coach, dir: {a}}}]", "container.env.MODEL_IMPL_TYPE=vllm")
    if refused:
        one_error_line(code, err, "lora.adapters.coach", "layers.1.self_attn.k_proj", "attention_k_eq_v",
                       "convert.merge_orbax")
        assert out == ""
    else:
        assert code == 0 and "--enable-lora" in out, err


def test_adapter_checks_place_each_module_by_its_full_path(tmp_path, capsys):
    """Matched by the name's tail (`layers.N.self_attn.q_proj`), a multimodal base's vision tower (SigLIP has its
    own q_proj in layers.N) fitted a text adapter's layer the decoder lacks, and an adapter saved for the text-only
    class (`model.layers.`) passed on a multimodal base, where vLLM and PEFT leave its keys unused. A bias other
    than "none" is refused by vLLM at load; each is now one line before the container."""
    d = fake_model_dir(tmp_path / "m", arch="Gemma3ForConditionalGeneration", nested=True)
    save_tensors(d / "model.safetensors", {**every_weight(json.loads((d / "config.json").read_text()), nested=True),
                                           "model.language_model.layers.0.self_attn.q_proj.weight": (Q_OUT, HIDDEN),
                                           "model.vision_tower.vision_model.encoder.layers.5.self_attn.q_proj.weight":
                                           (Q_OUT, HIDDEN)})
    deep = fake_adapter(tmp_path / "deep", r=8, nested=True)
    stem = "base_model.model.model.language_model.layers.5.self_attn.q_proj"
    save_tensors(deep / "adapter_model.safetensors", {f"{stem}.lora_A.weight": (8, HIDDEN),
                                                      f"{stem}.lora_B.weight": (Q_OUT, 8)})
    text_only = fake_adapter(tmp_path / "text_only", r=8)
    biased = fake_adapter(tmp_path / "biased", r=8, nested=True)
    (biased / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                                            "bias": "lora_only"}))
    for a, needles in ((deep, ["lora.adapters.a:", "model.language_model.layers.5.self_attn.q_proj",
                               "no weight for"]),
                       (text_only, ["lora.adapters.a:", "model.layers.0.self_attn.q_proj",
                                    "under 'model.language_model.'"]),
                       (biased, ["lora.adapters.a:", "bias='lora_only'", "Gemma has no biases"])):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                       f"lora.adapters=[{{name: a, dir: {a}}}]")
        one_error_line(code, err, *needles)
        assert out == ""
    ok = fake_adapter(tmp_path / "ok", r=8, nested=True)
    pickled = fake_adapter(tmp_path / "pickled", r=8, nested=True)  # peft's safe_serialization=False
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    unprefixed = fake_adapter(tmp_path / "unprefixed", r=8, nested=True)  # vLLM reads names without base_model.model.
    stem = "model.language_model.layers.0.self_attn.q_proj"
    save_tensors(unprefixed / "adapter_model.safetensors", {f"{stem}.lora_A.weight": (8, HIDDEN),
                                                            f"{stem}.lora_B.weight": (Q_OUT, 8)})
    for a in (ok, pickled, unprefixed):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                       f"lora.adapters=[{{name: a, dir: {a}}}]")
        assert code == 0, err
    (pickled / "adapter_model.bin").unlink()
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: a, dir: {pickled}}}]")
    one_error_line(code, err, "lora.adapters.a:", "has no adapter_model.safetensors (nor adapter_model.bin")


@pytest.mark.parametrize("extra, needles", [
    ({"init_lora_weights": "pissa"}, ["init_lora_weights='pissa'", "changes the base's weights"]),
    ({"init_lora_weights": "loftq"}, ["init_lora_weights='loftq'"]),
    ({"lora_bias": True}, ["lora_bias=True", "no LoRA bias adapter"]),
    ({"layer_replication": [[0, 1], [0, 1]]}, ["layer_replication=[[0, 1], [0, 1]]"]),
    ({"alora_invocation_tokens": [5, 6]}, ["Activated LoRA"]),
    ({"lora_alpha": "16"}, ["lora_alpha='16' is not a positive number"]),  # vLLM: str / int in its loader
    ({"lora_alpha": float("nan")}, ["lora_alpha=nan is not a positive number"]),
    ({"rank_pattern": ["q_proj"]}, ["rank_pattern=['q_proj'] is not an object of module patterns and their ranks"]),
    ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern['q_proj']=0 is not a positive integer"]),
    ({"alpha_pattern": {"q_proj": "32"}}, ["alpha_pattern['q_proj']='32' is not a positive number"]),
])
def test_an_adapter_of_a_newer_peft_feature_vllm_does_not_serve_is_refused(tmp_path, capsys, extra, needles):
    """adapter_config.json of a newer peft: PiSSA/LoftQ inits (the base's weights change when peft loads them),
    LoRA bias, layer replication, aLoRA. Older vLLM dropped the key and served a plain LoRA with other numbers than
    peft's; newer vLLM refuses at load, on the TPU VM. One line before the container; unknown keys that change
    nothing (a newer peft's bookkeeping) and the inits that only set the starting factors are taken. So is a
    lora_alpha that is no number (vLLM divides it by r in its loader)."""
    d = fake_model_dir(tmp_path / "m")
    a = fake_adapter(tmp_path / "a", r=8)
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (a / "adapter_config.json").write_text(json.dumps({**cfg, **extra}))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: a, dir: {a}}}]")
    one_error_line(code, err, "lora.adapters.a:", *needles)
    assert out == ""
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": "gaussian",
                                                       "peft_version": "0.99.0", "some_future_key": {"x": 1}}))
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: a, dir: {a}}}]")
    assert code == 0, err


def test_an_adapter_with_per_module_ranks_gets_room_for_its_largest(tmp_path, capsys):
    """peft's rank_pattern saves a module at another rank than r: its lora_A / lora_B were refused as mis-shaped
    ("not [r, in] and [out, r]"), and --max-lora-rank was sized by r alone (vLLM could not hold the module). Now
    the largest rank sizes it; a module whose patterns give it another scale than lora_alpha / r (the one scale
    vLLM applies to every module) is refused, naming it."""
    d = fake_model_dir(tmp_path / "m")
    a = fake_adapter(tmp_path / "a", r=16)  # q_proj saved at rank 16, r=8 for the rest
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"q_proj": 16}}
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "alpha_pattern": {"q_proj": 32}}))  # scale 2, as r's
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: a, dir: {a}}}]")
    assert code == 0, err
    assert flag(words(out), "--max-lora-rank") == "16"
    (a / "adapter_config.json").write_text(json.dumps(cfg))  # q_proj scaled by 16 / 16 in peft, 16 / 8 in vLLM
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   f"lora.adapters=[{{name: a, dir: {a}}}]")
    one_error_line(code, err, "lora.adapters.a:", "model.layers.0.self_attn.q_proj rank 16 and alpha 16",
                   "vLLM scales every module by lora_alpha=16 over r=8 (2)")
    assert out == ""


def test_an_adapter_on_a_model_dir_that_holds_its_update_already_is_refused(tmp_path, capsys):
    """model.dir set to the run's merge with the run's own adapter beside it (the README serves the base with the
    adapter, or the merge alone): the shapes fit, and vLLM added the update a second time without a word. Refused by
    the records convert writes (the merge's and the export's checkpoint); a model.dir whose weights differ from the
    base fingerprinted at training is warned of (another model of the same shapes, or the base re-saved)."""
    from gemma_tpu.hf.directory import ADAPTER_RECORD, MERGE_RECORD
    from gemma_tpu.hf.fingerprint import fingerprint

    base, merged, other = (fake_model_dir(tmp_path / n, kv=k) for n, k in (("base", 1), ("merged", 1), ("other", 2)))
    (merged / MERGE_RECORD).write_text(json.dumps({"tool": "convert.merge_orbax", "checkpoint": "/runs/x/checkpoints",
                                                   "kind": "lora", "base": {"dir": str(base)}}))
    a = fake_adapter(tmp_path / "a", r=8)
    (a / ADAPTER_RECORD).write_text(json.dumps({"tool": "convert.export_peft", "checkpoint": "/runs/x/checkpoints",
                                                "base": {"fingerprint": fingerprint(base)}}))
    adapters = f"lora.adapters=[{{name: a, dir: {a}}}]"
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={base}", adapters)
    assert code == 0 and "warning" not in err, err
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={merged}", adapters)
    one_error_line(code, err, f"lora.adapters.a: model.dir {merged} is a merge of /runs/x/checkpoints, the run this "
                   "adapter was exported from", "a second time", f"or the adapter on its base {base}")
    assert out == ""
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={other}", adapters)
    assert code == 0 and "--enable-lora" in out, err
    assert f"warning: lora.adapters.a was trained on another base than model.dir ({other}/config.json" in err


def test_a_tool_calling_adapter_is_refused_on_a_base_without_its_markers(tmp_path, capsys):
    """README's recipe served the fitness coach's adapter on plain Gemma 3. vLLM decodes every adapter with
    model.dir's tokenizer, which names the markers' ids <unusedN> (special tokens it drops from the text): no tool
    call reached the parser. Refused naming the marker; on its merge (markers published alike) it is taken."""
    from convert.tool_tokens import install_tool_tokens
    from gemma_tpu.assets.tiny import _write_small_tokenizer
    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS

    token_map = {m: f"<unused{5 + i}>" for i, m in enumerate(FUNCTION_MARKERS)}
    d, a = fake_model_dir(tmp_path / "m"), fake_adapter(tmp_path / "coach", r=8)
    _write_small_tokenizer(d, 512)
    _write_small_tokenizer(a, 512)  # what convert.export_peft ships beside a tool-calling adapter
    install_tool_tokens(a, token_map)
    args = ("--config", CONFIG_270M, "--print", f"model.dir={d}", f"lora.adapters=[{{name: coach, dir: {a}}}]")
    code, out, err = launch_inproc(capsys, *args)
    one_error_line(code, err, "lora.adapters.coach:", "<start_function_declaration>", "model.dir's tokenizer lacks",
                   "convert.merge_orbax")
    assert out == ""
    install_tool_tokens(d, token_map)
    code, out, err = launch_inproc(capsys, *args)
    assert code == 0, err
    assert flag(words(out), "--lora-modules") == "coach=/adapters/coach"


# ------------------------------------------------------------------------ launch (docker run)


def _fake_docker(bin_dir: Path, log: Path, daemon: bool = True) -> None:
    """A `docker` that records its arguments and the secrets it was handed."""
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps({{"args": args, "VLLM_API_KEY": os.environ.get("VLLM_API_KEY"),
                         "HF_TOKEN": os.environ.get("HF_TOKEN")}}) + "\\n")
if args[0] == "version":
    if not {daemon!r}:
        sys.stderr.write("Cannot connect to the Docker daemon at unix:///var/run/docker.sock\\n")
        sys.exit(1)
    print("28.0")
elif args[:2] == ["image", "inspect"]:
    sys.exit(1)
elif args[0] == "run" and os.environ.get("FAKE_DOCKER_SERVE"):  # in the foreground until a signal, as docker run is
    import signal, time
    def stop(signum, _frame):
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"signal": signum}}) + "\\n")
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    open(os.environ["FAKE_DOCKER_SERVE"], "w").close()
    time.sleep(120)
""")
    script.chmod(0o755)


def test_launch_runs_docker_with_the_printed_command(tmp_path):
    d = fake_model_dir(tmp_path / "merged")
    log = tmp_path / "docker.jsonl"
    _fake_docker(tmp_path / "bin", log)
    cache = tmp_path / "vllm-cache"
    args = ["--config", CONFIG_270M, f"model.dir={d}", "server.api_key_env=MY_KEY",
            f"container.compile_cache={cache}", f"server.port={free_port()}"]  # free: one in use is refused
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "MY_KEY": "api-secret-4", "HF_TOKEN": "hf-secret-5"}
    printed = run_cli("serving.launch", *args, "--print", env=env, timeout=120)
    assert printed.returncode == 0, printed.stderr
    proc = run_cli("serving.launch", *args, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "api-secret-4" not in proc.stdout + proc.stderr and "hf-secret-5" not in proc.stdout + proc.stderr
    calls = [json.loads(l) for l in log.read_text().splitlines()]
    assert [c["args"][0] for c in calls] == ["version", "image", "build", "run"]
    assert calls[2]["args"][:3] == ["build", "-t", DEFAULT_IMAGE] and str(REPO / "serving" / "Dockerfile") in calls[2]["args"]
    run = calls[3]
    assert ["docker"] + run["args"] == words(printed.stdout)[1:]  # exactly what --print shows
    assert (run["VLLM_API_KEY"], run["HF_TOKEN"]) == ("api-secret-4", "hf-secret-5")  # by name, from this env
    assert cache.is_dir()
    log.unlink()  # the upstream image itself is pulled by docker run, never built here
    proc = run_cli("serving.launch", *args, f"container.image={VLLM_TPU_IMAGE}", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(l)["args"] for l in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["version", "run"] and VLLM_TPU_IMAGE in calls[1]


def test_a_signal_to_the_launcher_alone_stops_the_container(tmp_path):
    """`kill PID` of the launcher (or its terminal closing) ended it and left the docker client and the container
    serving on, holding the TPU; the launcher hands SIGTERM/SIGHUP to the client, whose proxy stops the server."""
    d = fake_model_dir(tmp_path / "merged")
    log = tmp_path / "docker.jsonl"
    _fake_docker(tmp_path / "bin", log)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        serving = tmp_path / f"serving-{sig}"
        env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_DOCKER_SERVE": str(serving)}
        proc = subprocess.Popen([sys.executable, "-m", "serving.launch", "--config", CONFIG_270M, f"model.dir={d}",
                                 f"container.image={VLLM_TPU_IMAGE}", f"container.compile_cache={tmp_path / 'c'}",
                                 f"server.port={free_port()}"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not serving.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert serving.exists(), proc.communicate()[1][-2000:]
        proc.send_signal(sig)  # the launcher alone, not its process group
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err[-2000:]
        assert {"signal": int(sig)} in [json.loads(l) for l in log.read_text().splitlines()], err[-2000:]


def test_launch_errors_without_docker_daemon_or_key(tmp_path):
    d = fake_model_dir(tmp_path / "merged")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = run_cli("serving.launch", "--config", CONFIG_270M, f"model.dir={d}", env={"PATH": str(empty)})
    assert_one_line_error(proc, "docker not found")
    _fake_docker(tmp_path / "bin", tmp_path / "log.jsonl", daemon=False)
    path = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = run_cli("serving.launch", "--config", CONFIG_270M, f"model.dir={d}", env=path)
    assert_one_line_error(proc, "cannot reach the Docker daemon")
    # vLLM binds the port on this machine (--net host): one taken is refused before the image is built or run
    _fake_docker(tmp_path / "bin-up", tmp_path / "up.jsonl")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = run_cli("serving.launch", "--config", CONFIG_270M, f"model.dir={d}", f"server.port={port}",
                       env={"PATH": f"{tmp_path / 'bin-up'}:{os.environ['PATH']}"})
    assert_one_line_error(proc, f"server.port {port} on 127.0.0.1: already in use")
    assert [json.loads(line)["args"][0] for line in (tmp_path / "up.jsonl").read_text().splitlines()] == ["version"]
    env = {k: v for k, v in os.environ.items() if k != "UNSET_KEY_VAR"}
    proc = subprocess.run([sys.executable, "-m", "serving.launch", "--config", CONFIG_270M, f"model.dir={d}",
                           "server.api_key_env=UNSET_KEY_VAR"], cwd=REPO, capture_output=True, text=True,
                          env={**env, **path}, timeout=120)
    assert_one_line_error(proc, "UNSET_KEY_VAR")


# ------------------------------------------------------------------- CI acceptance: local server


@pytest.fixture(scope="module")
def merged(tiny_long_dir, tmp_path_factory) -> Path:
    """The tiny model trained 3 steps with LoRA and merged: a real merged directory. Its 4,096 positions hold
    the ~1,200-token fitness prompts of its character-level tokenizer (the local server refuses prompts
    past the context, as vLLM does)."""
    root = tmp_path_factory.mktemp("serving")
    ck, out = root / "ckpt", root / "merged"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_long_dir}", f"checkpoint.dir={ck}",
                   "train.max_steps=3", "checkpoint.every_steps=3", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(ck), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _snapshot(d: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in d.iterdir()}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def local_server(merged, tmp_path_factory):
    """`python -m serving.launch --local` on the merged model, on a free loopback port."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    port = free_port()
    log_path = tmp_path_factory.mktemp("local") / "launch.log"
    before = _snapshot(merged)
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serving.launch", "--config", CONFIG_270M, "--local",
                                 f"model.dir={merged}", f"server.port={port}"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 240
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail("serving.launch --local did not start: " + log_path.read_text()[-3000:])
                    time.sleep(0.5)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert code == 0, log_path.read_text()[-3000:]
    assert not _port_open(port)  # the transformers serve child is gone too
    assert _snapshot(merged) == before  # the model directory was not touched


def test_local_served_dir_adds_a_template_without_touching_the_model(tiny_dir, tmp_path):
    from serving.local import prepare_served_dir

    before = _snapshot(tiny_dir)
    served = prepare_served_dir(tiny_dir, "tiny", tmp_path / "w")  # tiny_dir has no chat template
    assert "declaration:" in (served / "chat_template.jinja").read_text()  # gemma_tpu.formats.function_calling' template
    assert (served / "config.json").is_symlink() and _snapshot(tiny_dir) == before
    own = tmp_path / "own.jinja"
    own.write_text("{{ 'mine' }}")
    served = prepare_served_dir(tiny_dir, "tiny2", tmp_path / "w", own)
    assert (served / "chat_template.jinja").read_text() == "{{ 'mine' }}"


def test_a_merged_tool_models_calls_reach_the_server_with_their_markers(tiny_dir, tmp_path):
    """A merged tool-calling model's FunctionGemma markers are special tokens, and transformers serve decodes
    answers without special tokens: its calls came back as `call:get_steps{}` with no markers, which streamed as
    plain text (and, whole, were parsed only by guessing at bare text, `<escape>` lost). The served directory now
    has the markers as ordinary tokens (the model directory untouched), and the `<start_function_response>` it
    stops on is cut from the answer, as vLLM leaves the stop token out: both paths give the call, and no text."""
    import shutil

    from transformers import AutoTokenizer

    from convert.tool_tokens import install_tool_tokens
    from gemma_tpu.formats.function_calling import function_token_map
    from serving.local import CheckedChatApp, prepare_served_dir, stop_token_texts

    merged = tmp_path / "merged"
    shutil.copytree(tiny_dir, merged)
    install_tool_tokens(merged, function_token_map(AutoTokenizer.from_pretrained(str(merged))))
    tj = merged / "tokenizer.json"  # laid out as transformers' save_pretrained writes it
    tj.write_text(json.dumps(json.loads(tj.read_text()), indent=2, ensure_ascii=False))
    before = _snapshot(merged)
    answer = "<start_function_call>call:get_steps{date:<escape>a, b<escape>}<end_function_call>"
    ids = AutoTokenizer.from_pretrained(str(merged))(answer + "<start_function_response>",
                                                      add_special_tokens=False).input_ids
    assert AutoTokenizer.from_pretrained(str(merged)).decode(ids, skip_special_tokens=True) == \
        "call:get_steps{date:a, b}"  # what was served
    served = prepare_served_dir(merged, "m", tmp_path / "w")
    # only the added tokens are written again: the vocabulary and merges (33 MB for Gemma 3) byte for byte as they
    # were (their parse and rewrite took 1.5 s of each local start of the 270M; 0.19 s now)
    old, new = (merged / "tokenizer.json").read_bytes(), (served / "tokenizer.json").read_bytes()
    head = old.index(b'"added_tokens"')
    tail = old[old.index(b'"normalizer"', head):]
    assert new[:head] == old[:head] and new.endswith(tail) and len(tail) > len(old) // 2
    tok = AutoTokenizer.from_pretrained(str(served))
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == answer + "<start_function_response>" and _snapshot(merged) == before
    assert tok(answer, add_special_tokens=False).input_ids == ids[:-1]  # the prompts' ids are unchanged
    assert tok.decode(tok("<bos>hi<end_of_turn>", add_special_tokens=False).input_ids, skip_special_tokens=True) == "hi"
    stops = stop_token_texts(tok, served)
    assert stops == ["<start_function_response>"]
    # a tokenizer_config.json without a marker to flip stays the model's file: it was re-serialised into a file of
    # its own on each start (tokenizer.json is written only because a flag in it changes)
    other = shutil.copytree(merged, tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(
        {**config, "added_tokens_decoder": {"0": {"content": "<pad>", "special": True}}}))
    again = prepare_served_dir(other, "m2", tmp_path / "w")
    assert (again / "tokenizer_config.json").is_symlink() and not (again / "tokenizer.json").is_symlink()

    async def inner(scope, receive, send):  # transformers serve streaming what it decoded, 3 characters a chunk
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for k in range(0, len(text), 3):
            chunk = {"id": "r", "choices": [{"index": 0, "delta": {"content": text[k:k + 3]}}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        end = {"id": "r", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await send({"type": "http.response.body",
                    "body": b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n"})

    def ask(stream: bool) -> bytes:
        import asyncio

        sent = []
        tool = {"type": "function", "function": {"name": "get_steps", "parameters": {"type": "object"}}}
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "stream": stream})

        async def receive():
            return {"type": "http.request", "body": body.encode(), "more_body": False}

        async def send(message):
            sent.append(message)

        app = CheckedChatApp(inner, token_map=function_token_map(tok), stop_texts=stops)
        asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                         "headers": [(b"content-type", b"application/json")]}, receive,
                        send))
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    message = json.loads(ask(False))["choices"][0]["message"]
    assert message["content"] is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in message["tool_calls"]] == [("get_steps", {"date": "a, b"})]
    chunks = [json.loads(e[len("data: "):]) for e in ask(True).decode().split("\n\n")
              if e.strip() and e.strip() != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls") or []] == ['{"date": "a, b"}']
    # a hand-over without a call: the stop cut is named (`stop_reason`, as vLLM names a stop string), so a client
    # scores it as a local model's (a format error; it read as an answer in words, the marker gone)
    from gemma_tpu.formats.function_calling import NO_CALL_AT_STOP
    from gemma_tpu.infer.openai_client import reply_from_answer

    text = "Let me check.<start_function_response>"
    whole = json.loads(ask(False))
    assert whole["choices"][0]["message"]["content"] == "Let me check."
    assert whole["choices"][0]["stop_reason"] == "<start_function_response>"
    reply, _ = reply_from_answer(whole, "u", 64)
    assert (reply.kind, reply.error) == ("format_error", NO_CALL_AT_STOP)
    last = [json.loads(e[len("data: "):]) for e in ask(True).decode().split("\n\n")
            if e.strip() and e.strip() != "data: [DONE]"][-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "<start_function_response>"


def test_a_server_missing_a_module_names_it(tiny_dir, tmp_path, monkeypatch):
    """A multimodal Gemma 4 (as Google releases it) needs torchvision for transformers serve's processor; without
    it the one line said "Could not import module 'Gemma4Processor'. Are this object's requirements defined
    correctly?", the module missing only in the log."""
    from serving.local import LocalServer

    chained = ("try:\n import torchvision_absent_here.transforms\nexcept ImportError as e:\n"
               " raise ModuleNotFoundError(\"Could not import module 'Gemma4Processor'\") from e")
    monkeypatch.setattr(LocalServer, "command", lambda self: [sys.executable, "-c", chained])
    server = LocalServer(tiny_dir, name="tiny", log=tmp_path / "serve.log", startup_timeout=60)
    with pytest.raises(UserError, match=r"exited with code 1 before it was ready: it needs the Python module "
                                        r"torchvision_absent_here, which is not installed here \(pip install "):
        server.__enter__()
    assert server.proc.poll() == 1 and server._workdir is None  # stopped and cleaned up


def test_local_server_runs_a_gemma4_whose_experts_grouped_mm_cannot(tmp_path):
    """transformers runs Gemma 4's experts with torch's grouped_mm by default, which needs each expert matrix's rows
    16-byte aligned: a merged mixture of experts 22 wide (88 bytes in float32) trains, merges and verifies (eager
    experts), but `serving.launch --local` answered every request with a 500 "strides should be multiple of 16
    bytes". The local server runs the experts eagerly, as convert.verify does: the greedy answer is the reference's."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    from convert.verify import hf_logits
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from serving.local import LocalServer

    d = write_tiny_gemma4(tmp_path / "moe", seed=3, variant="moe", moe_intermediate_size=22)
    prompt = "Hello there"
    with LocalServer(d, name="moe", log=tmp_path / "serve.log") as server:
        req = urllib.request.Request(server.base_url + "/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode())
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, body = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read().decode(errors="replace")
    assert status == 200, body
    tok = load_tokenizer(d)
    ids = tok(prompt).input_ids
    want = tok.decode([int(hf_logits(d, [ids])[0][-1].argmax())])
    assert body["choices"][0]["text"] == want


def test_a_restarted_local_servers_log_keeps_the_previous_run(tiny_dir, tmp_path, monkeypatch):
    """The engine log was opened "w": a restart wiped the previous run's output (why it stopped). It is appended to
    after a line naming the start, and a start failure is read from this run's output only."""
    from serving.local import LocalServer

    log = tmp_path / "serve.log"
    log.write_text("ModuleNotFoundError: No module named 'old_module'\n")
    monkeypatch.setattr(LocalServer, "command",
                        lambda self: [sys.executable, "-c", "raise SystemExit('engine: out of memory')"])
    server = LocalServer(tiny_dir, name="tiny", log=log, startup_timeout=60)
    with pytest.raises(UserError, match=r"exited with code 1 before it was ready: engine: out of memory$"):
        server.__enter__()
    text = log.read_text()
    assert text.startswith(f"ModuleNotFoundError: No module named 'old_module'\n===== serving.local: tiny ({tiny_dir})")
    assert re.search(r", started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} =====\nengine: out of memory\n$", text)


# A launcher (as serving.launch --local) whose served process is a stand-in that only watches for its launcher
LAUNCHER = """
import sys, tempfile, time
from serving import local
from serving.local import LocalServer
local.prepare_served_dir = lambda *args: None  # the model is not served here
served = ("import time; from serving.local import stop_with_parent; stop_with_parent(0.1); "
          "print('watching', flush=True); time.sleep(120)")
LocalServer.command = lambda self: [sys.executable, "-c", served]
tempfile.tempdir = sys.argv[2]
server = LocalServer(sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever adopted it, maybe never in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_served_process_stops_when_its_launcher_is_killed(tmp_path):
    """`serving.launch --local` SIGKILLed (an OOM kill, `timeout -s KILL`, a scheduler): the transformers serve
    process runs in a session of its own, so it went on serving on the port for good, holding the model and its
    temporary directory, and the next launch on that port was refused. It stops (after the requests under way)
    and removes the directory."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "model"), str(tmp_path)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    served = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "watching"
        (workdir,) = tmp_path.iterdir()
        assert workdir.name.startswith("gemma-tpu-serve-") and _running(served)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while _running(served) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(served) and list(tmp_path.iterdir()) == []
    finally:
        if _running(served):
            os.kill(served, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def test_a_server_that_fails_to_start_leaves_no_temporary_directory(tiny_dir, tmp_path, monkeypatch):
    """`with LocalServer(...)` whose start() failed after making its temporary directory (here: the log's folder
    does not exist) left the directory of symlinks and template behind; it is removed, as when it fails later."""
    import tempfile

    from serving.local import LocalServer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(LocalServer, "command", lambda self: [sys.executable, "-c", "pass"])
    template = tmp_path / "own.jinja"
    template.write_text("{{ 'mine' }}")
    with pytest.raises(FileNotFoundError):
        with LocalServer(tiny_dir, name="tiny", log=tmp_path / "absent" / "serve.log", chat_template=template):
            pass
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_context_past_the_models_is_refused_locally_as_by_vllm_and_an_unset_one_follows_the_model(
        tiny_dir, tmp_path, capsys):
    """A server.max_model_len past the model's max_position_embeddings: vLLM refuses it when its engine starts (and
    --print says so), where --local quietly served the model's shorter context, so a config tried locally failed on
    the VM. Refused alike, in one line naming the key, nothing started. Left unset, the default of 2048 follows a
    model whose context is shorter (tiny_dir: 1,024 positions), for vLLM and --local alike."""
    for mode in ("--print", "--local"):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, mode, f"model.dir={tiny_dir}",
                                       f"server.port={free_port()}")
        one_error_line(code, err, "server.max_model_len=2048 exceeds the model's max_position_embeddings=1024",
                       "leave it unset to follow the model")
        assert out == "" and "serving" not in err
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{dir: {tiny_dir}}}\n")
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--print")
    assert code == 0 and flag(words(out), "--max-model-len") == "1024", err
    # without chunked prefill a step must hold the context: the one followed, not the unset 2048 (refused before)
    unchunked = "server.extra_args=[--no-enable-chunked-prefill]"
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--print", unchunked,
                                   "server.max_num_batched_tokens=1024")
    assert code == 0 and flag(words(out), "--max-model-len") == "1024", err
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--print", unchunked,
                                   "server.max_num_batched_tokens=512")
    one_error_line(code, err, "server.max_num_batched_tokens=512 is below server.max_model_len=1024")
    # --print-config of such a config reads back the same: it printed the unset context as 2048, which, read back as
    # given, was refused for this model ("exceeds"); unset prints null, and null is unset
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--print-config")
    assert code == 0 and "max_model_len: null" in out, err
    (tmp_path / "printed.yaml").write_text(out)
    code, out, err = launch_inproc(capsys, "--config", str(tmp_path / "printed.yaml"), "--print")
    assert code == 0 and flag(words(out), "--max-model-len") == "1024", err


def test_local_server_is_bounded_by_max_model_len(tiny_dir, tmp_path, capsys, monkeypatch):
    """`serving.launch --local` bounded requests by the model's positions only, where vLLM takes server.max_model_len:
    a request without max_tokens generated to the end of the model's context (32k positions for Gemma 3 270M, on
    a CPU), and prompts the vLLM server refuses were answered."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    from serving.launch import LocalServer

    seen = []

    def requests_then_ctrl_c(server):
        def chat(**extra):
            req = urllib.request.Request(server.base_url + "/chat/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}
                                                         ).encode())
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        seen.extend([chat(), chat(max_tokens=100)])
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalServer, "wait", requests_then_ctrl_c)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{dir: {tiny_dir}}}\nserver: {{max_model_len: 64, port: {free_port()}}}\n")
    code, _, err = launch_inproc(capsys, "--config", str(cfg), "--local")
    assert code == 0, err
    (code, whole), (refused, error) = seen
    usage = whole["usage"]  # tiny_dir has 1,024 positions
    assert code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 64, whole
    assert refused == 400 and error["error"]["param"] == "max_tokens", error
    assert f"context of 64 tokens: ask for at most {64 - usage['prompt_tokens']}" in error["error"]["message"]


def test_local_server_takes_the_api_key_as_vllm_does(tiny_dir, tmp_path, capsys, monkeypatch):
    """`--local` ignored server.api_key_env: the config said the API needed a key, transformers serve answered anyone
    (beyond loopback without the warning a keyless server gets), and a client that forgot its key passed here and
    failed on vLLM. The /v1 paths now need `Authorization: Bearer KEY` (401 otherwise), as vLLM's; /health does not.
    A variable that is not set is refused before anything starts, as for the container."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    from serving.launch import LocalServer

    seen = []

    def requests_then_ctrl_c(server):
        def ask(path, key=None, body=None):
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
            req = urllib.request.Request(server.url + path, headers=headers, method="POST" if body else "GET",
                                         data=json.dumps(body).encode() if body else None)
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        seen.extend([ask("/health"), ask("/v1/models"), ask("/v1/models", "wrong"), ask("/v1/models", "s3cret"),
                     ask("/v1/chat/completions", None, chat), ask("/v1/chat/completions", "s3cret", chat)])
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalServer, "wait", requests_then_ctrl_c)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{dir: {tiny_dir}}}\nserver: {{port: {free_port()}, api_key_env: GEMMA_TPU_TEST_KEY}}\n")
    monkeypatch.delenv("GEMMA_TPU_TEST_KEY", raising=False)
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--local")
    one_error_line(code, err, "server.api_key_env: environment variable GEMMA_TPU_TEST_KEY is not set")
    assert not seen
    monkeypatch.setenv("GEMMA_TPU_TEST_KEY", "s3cret\n")  # no client could send it (a traceback in each)
    code, out, err = launch_inproc(capsys, "--config", str(cfg), "--local")
    one_error_line(code, err, "server.api_key_env: the environment variable GEMMA_TPU_TEST_KEY holds the character "
                              "U+000A (character 7 of 7)")
    assert not seen and "s3cret" not in out + err
    monkeypatch.setenv("GEMMA_TPU_TEST_KEY", "s3cret")
    code, _, err = launch_inproc(capsys, "--config", str(cfg), "--local")
    assert code == 0, err
    assert seen == [200, 401, 401, 200, 401, 200]


def test_local_server_without_tool_calling_refuses_auto_tool_choice_as_vllm_does(tiny_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """tool_calling.enabled: false renders no --enable-auto-tool-choice, and vLLM answers a request with tools (and
    tool_choice "auto", the default with tools) 400; `--local` answered it, parsing calls from the text, so a client
    that passed here failed there. "none" still passes (the tools unread), as in vLLM."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    from serving.launch import LocalServer

    seen = []

    def requests_then_ctrl_c(server):
        def chat(**extra):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{
                "type": "function", "function": {"name": "get_steps", "parameters": {"type": "object"}}}], **extra}
            req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        seen.extend([chat(), chat(tool_choice="auto"), chat(tool_choice="none")])
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalServer, "wait", requests_then_ctrl_c)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{dir: {tiny_dir}}}\nserver: {{port: {free_port()}}}\ntool_calling: {{enabled: false}}\n")
    code, _, err = launch_inproc(capsys, "--config", str(cfg), "--local")
    assert code == 0, err
    (plain, refused), (auto, _), (none, _) = seen
    assert (plain, auto, none) == (400, 400, 200), seen
    assert refused["error"]["param"] == "tool_choice", refused
    assert "requires tool calling, which this server has off (tool_calling.enabled: false)" in refused["error"][
        "message"], refused


def test_local_server_on_a_port_in_use_is_refused_before_it_starts(tiny_dir, tmp_path, capsys):
    """`serving.launch --local` on a port another server holds: transformers serve loaded the model, failed to
    bind, and meanwhile the other server's /health 200 made it announce `serving ... at <that port>`; then
    `transformers serve exited with code 3`. Now one line before anything starts."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{dir: {tiny_dir}}}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = cli_main(__import__("serving.launch", fromlist=["main"]).main,
                        ["--config", str(cfg), "--local", f"server.port={port}"])
        err = capsys.readouterr().err
        one_error_line(code, err, f"server.port {port} on 127.0.0.1: already in use", "server.port=N")
        assert "serving" not in err.replace("server.port", "") and not other_warnings(err)
        # adapters in the config: --local serves the base alone, and says so (requests for them got a bare 404)
        code = cli_main(__import__("serving.launch", fromlist=["main"]).main,
                        ["--config", str(cfg), "--local", f"server.port={port}",
                         f"lora.adapters=[{{name: coach, dir: {tmp_path}}}]"])
        err = capsys.readouterr().err
        assert "warning: --local serves model.dir alone, not lora.adapters (coach)" in err and code != 0
        # server.extra_args: options of `vllm serve` transformers serve never reads; they were dropped without a word
        code = cli_main(__import__("serving.launch", fromlist=["main"]).main,
                        ["--config", str(cfg), "--local", f"server.port={port}",
                         "server.extra_args=[--generation-config,vllm]"])
        err = capsys.readouterr().err
        assert ("warning: --local serves without server.extra_args (--generation-config vllm), options of `vllm "
                "serve` that only the container reads") in err and code != 0, err


def test_server_host_written_as_in_a_url_or_not_of_this_machine(tmp_path, capsys):
    """`server.host: "[::1]"` (an IPv6 address as a URL writes it) passed the config and reached vLLM's uvicorn and
    --local's bind as a name that does not resolve; `::1` printed --local's address as http://::1:PORT. A host that
    is no address of this machine was blamed on the port ("choose another with server.port=N")."""
    from serving.local import LocalServer

    d = fake_model_dir(tmp_path / "m")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", "server.host='[::1]'")
    assert code == 0 and has_pair(words(out), "--host", "::1"), err
    assert LocalServer(d, host="::1", port=8123).url == "http://[::1]:8123"
    picked = LocalServer(d, host="::1")  # no port given: the OS picks one on the IPv6 loopback (was a gaierror)
    assert picked.url == f"http://[::1]:{picked.port}" and picked.port > 0
    assert LocalServer(d, host="::", port=8123).url == "http://[::1]:8123"  # an IPv6 wildcard's loopback is ::1
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--local", f"model.dir={d}",
                                   "server.host=192.0.2.1", f"server.port={free_port()}")  # TEST-NET-1: not ours
    line = one_error_line(code, err, "server.host 192.0.2.1: cannot listen there", "an address of this machine")
    assert "server.port" not in line


def test_bench_against_local_server(local_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("serving.bench", "--base-url", local_server, "--model", NAME_270M, "--num-prompts", "6",
                   "--concurrency", "3", "--input-len", "16", "--output-len", "8", "--seed", "0", "--json", str(out),
                   "--timeout", "120", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["num_prompts"], r["max_concurrency"]) == (6, 0, 6, 3)
    assert r["mean_ttft_ms"] > 0 and r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["total_token_throughput"] > 0
    assert r["total_output_tokens"] > 0 and r["total_input_tokens"] >= 6 * 16  # usage from the server
    for key in ("mean_tpot_ms", "median_itl_ms", "p90_e2el_ms", "std_e2el_ms", "duration"):
        assert key in r
    assert r["max_output_tokens_per_s"] > 0 and 1 <= r["max_concurrent_requests"] <= 3
    # chats from a JSONL file (the fitness test split: tools and all)
    proc = run_cli("serving.bench", "--base-url", local_server + "/v1", "--num-prompts", "2", "--output-len", "4",
                   "--dataset", str(REPO / "data" / "fitness" / "test.jsonl"), "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["completed"] == 2


def test_chat_against_local_server(local_server):
    proc = run_cli("serving.chat", "--base-url", local_server, "--model", NAME_270M, "--once",
                   "how many steps did I take yesterday?", "--max-tokens", "16", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() and "Traceback" not in proc.stderr


# ---------------------------------------------------------- tool round trip (scripted fake model)


class ScriptedModel(http.server.BaseHTTPRequestHandler):
    """A fake OpenAI chat endpoint: replies are taken from `script` in order; requests are recorded."""

    script: list = []
    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"body": body, "auth": self.headers.get("Authorization")})
        reply = type(self).script.pop(0)
        message = reply(body) if callable(reply) else reply
        self._json(200, {"id": "x", "object": "chat.completion", "model": body.get("model"),
                         "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                      "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]})

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def scripted(*replies):
    handler = type("Scripted", (ScriptedModel,), {"script": list(replies), "requests": []})
    return handler, http_server(handler)


def test_chat_tool_round_trip(tmp_path):
    from gemma_tpu.examples.fitness.providers import SimulatedDevice

    steps = SimulatedDevice(0).steps(dt.date.today() - dt.timedelta(days=1))

    def answer(body):
        tool = body["messages"][-1]
        return {"content": f"You took {json.loads(tool['content'])['steps']:,} steps yesterday."}

    call = {"content": None, "tool_calls": [{"id": "call_abc", "type": "function", "function": {
        "name": "get_steps", "arguments": json.dumps({"date": "yesterday"})}}]}
    handler, server = scripted(call, answer)
    with server as url:
        proc = run_cli("serving.chat", "--base-url", url, "--once", "how many steps did I take yesterday?",
                       env={"VLLM_API_KEY": "chat-key"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"You took {steps:,} steps yesterday."
    assert "-> get_steps(date='yesterday') = " in proc.stderr and str(steps) in proc.stderr
    first, second = (r["body"] for r in handler.requests)
    assert all(r["auth"] == "Bearer chat-key" for r in handler.requests)
    assert first["model"] == "scripted" and {t["function"]["name"] for t in first["tools"]} == TOOL_NAMES
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    sent_call = second["messages"][2]["tool_calls"][0]
    assert sent_call["function"]["name"] == "get_steps"
    assert json.loads(sent_call["function"]["arguments"]) == {"date": "yesterday"}
    assert second["messages"][3]["tool_call_id"] == sent_call["id"]
    assert json.loads(second["messages"][3]["content"])["steps"] == steps


def test_an_answer_holding_a_lone_surrogate_is_one_line_error():
    """A server's answer escaping half a UTF-16 pair (`"\\ud800"`): serving.chat printed it, a UnicodeEncodeError
    traceback. Refused where every whole answer is read (gemma_tpu.infer.openai_client.http_json), naming where."""
    from gemma_tpu.examples.fitness.providers import SimulatedDevice
    from serving.chat import RemoteCoach

    _, server = scripted({"content": "You took \ud800 steps."})
    with server as url:
        coach = RemoteCoach(url, SimulatedDevice(0), trace=None)
        with pytest.raises(UserError, match=r"chat/completions: the answer's choices\[0\]\.message\.content holds a "
                                            r"lone UTF-16 surrogate \('\\ud800'\), which is no text"):
            coach.ask("how many steps?")


def test_chat_parses_functiongemma_text_and_reports_unknown_tools():
    from gemma_tpu.examples.fitness.providers import SimulatedDevice
    from serving.chat import RemoteCoach

    text_call = {"content": "<start_function_call>call:get_sleeping_minutes{date:<escape>yesterday<escape>}"
                            "<end_function_call>"}
    handler, server = scripted(text_call, {"content": "You slept well."})
    with server as url:
        coach = RemoteCoach(url + "/v1/chat/completions", SimulatedDevice(0), trace=None)
        assert coach.ask("how did I sleep?") == "You slept well."
    assert handler.requests[1]["body"]["messages"][-1]["name"] == "get_sleeping_minutes"

    unknown = {"content": None, "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "get_weather", "arguments": "{}"}}]}
    bad_json = {"content": None, "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "get_steps", "arguments": "{date"}}]}
    _, server = scripted(unknown, bad_json, {"content": "call:get_steps{when:today}"})
    with server as url:
        coach = RemoteCoach(url, SimulatedDevice(0), trace=None)
        assert "model called unknown tool get_weather" in coach.ask("weather?")
        assert "malformed tool call" in coach.ask("steps?")
        assert "bad arguments" in coach.ask("steps?")


def test_the_clients_take_any_endpoints_address_as_the_server():
    """`--base-url .../v1/completions` (or /responses, /models) was taken as the API base, and the chat asked
    `.../v1/completions/v1/chat/completions` (HTTP 404); `.../v1/chat/completions` was already read as the server."""
    from gemma_tpu.infer.openai_client import api_base

    for tail in ("", "/", "/v1", "/v1/", "/v1/chat/completions", "/v1/completions", "/v1/responses/", "/v1/models"):
        assert api_base("http://h:8000" + tail) == "http://h:8000/v1", tail
    assert api_base("https://h/openai/v1/completions") == "https://h/openai/v1"
    # capitals and repeated slashes were kept: requests went to `/V1/v1/chat/completions`, `//v1/...` (HTTP 404)
    for tail in ("/V1", "/V1/", "//v1", "/v1//", "/v1//chat/completions", "/V1/Chat/Completions", "//"):
        assert api_base("http://h:8000" + tail) == "http://h:8000/v1", tail
    assert api_base("http://h/API//V1/models") == "http://h/API/v1"
    # a model name after '#' (as evaluate --compare's endpoint:URL#MODEL) or a query had the paths appended after it
    # (`http://h:8000#coach/v1/chat/completions`, sent to `/`): refused in one line
    for bad, needle in (("http://h:8000#coach", "no #fragment"), ("http://h:8000/v1?api-version=1", r"no \?query"),
                        ("http://h 1:8000", "holds a space"), ("http://h:8000/v\t1", "holds a space")):
        with pytest.raises(UserError, match=needle):
            api_base(bad)


def test_server_key_names_one_server_however_spelt():
    """evaluate --compare refuses one model named twice; `http://localhost:8000/v1` and `http://127.0.0.1:8000` were
    compared as strings and scored as two models."""
    from gemma_tpu.infer.openai_client import server_key

    one = {server_key(u) for u in ("http://localhost:8000/v1", "http://127.0.0.1:8000", "http://[::1]:8000/",
                                    "HTTP://LocalHost:8000/v1/chat/completions", "http://0.0.0.0:8000//v1",
                                    "http://127.0.0.2:8000/v1/")}
    assert one == {("http", "loopback", 8000, "/v1")}
    assert server_key("http://h") == server_key("http://h:80/v1/") != server_key("https://h")
    assert server_key("https://h/") == server_key("https://H:443/v1")
    for other in ("http://localhost:8001", "http://h:8000", "https://localhost:8000", "http://localhost:8000/x"):
        assert server_key(other) != server_key("http://127.0.0.1:8000"), other


def test_chat_unreachable_server_is_one_line_error():
    proc = run_cli("serving.chat", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--once", "hi",
                   "--retries", "0",
                   timeout=120)
    assert_one_line_error(proc, "cannot reach the server")


# ------------------------------------------------------------------------ bench under failure


class Faulty(http.server.BaseHTTPRequestHandler):
    """Request k gets behaviour k % 5: a 500, a good stream, a dropped connection, a stall, a stream
    cut short without a finish reason."""

    counter = 0
    lock = threading.Lock()
    release = threading.Event()

    def log_message(self, *args):
        pass

    def finish(self):
        try:
            super().finish()
        except OSError:  # the client (or we) hung up
            pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with Faulty.lock:
            k = Faulty.counter
            Faulty.counter += 1
        kind = k % 5
        if kind == 0:
            body = b'{"error": "boom"}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if kind == 3:
            Faulty.release.wait(30)  # stalls past the client's timeout
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if kind == 2:
            self.send_header("Content-Length", "100000")  # promises more than it sends, then hangs up
        self.end_headers()
        chunk = lambda **kw: {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, **kw}]}  # noqa
        self.wfile.write(sse(chunk(delta={"role": "assistant", "content": ""})))
        for word in ("one", " two", " three"):
            time.sleep(0.01)
            self.wfile.write(sse(chunk(delta={"content": word})))
            self.wfile.flush()
        if kind == 2:
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if kind == 1:
            self.wfile.write(sse(chunk(delta={}, finish_reason="stop")))
            self.wfile.write(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}))
            self.wfile.write(sse("[DONE]"))
        # kind 4: the connection closes here, without a finish reason or [DONE]


def test_bench_counts_failures_and_never_hangs(tmp_path):
    Faulty.counter = 0
    Faulty.release.clear()
    out = tmp_path / "bench.json"
    try:
        with http_server(Faulty) as url:
            t0 = time.monotonic()
            proc = run_cli("serving.bench", "--base-url", url, "--model", "m", "--num-prompts", "10", "--concurrency",
                           "5", "--input-len", "8", "--output-len", "4", "--timeout", "2", "--json", str(out),
                           "--save-detailed", timeout=60)
            elapsed = time.monotonic() - t0
    finally:
        Faulty.release.set()
    assert proc.returncode == 0, proc.stderr[-3000:]  # some requests completed
    assert elapsed < 30
    assert "Serving Benchmark Result" in proc.stdout and re.search(r"Failed requests:\s+8", proc.stdout)
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (2, 8)
    assert r["duration"] < 10 and r["total_output_tokens"] == 6 and r["mean_ttft_ms"] > 0
    errors = [e for e in r["errors"] if e]
    assert sum("HTTP 500" in e for e in errors) == 2
    assert sum("timed out after 2 s" in e for e in errors) == 2
    assert sum("ended before the response was complete" in e for e in errors) == 2
    assert sum("RemoteProtocolError" in e or "ReadError" in e for e in errors) == 2, errors
    assert len(r["ttfts"]) == 10 and len(r["itls"]) == 10


class EventStream(http.server.BaseHTTPRequestHandler):
    """Answers a POST with an event stream: the byte pieces `pieces()` gives, each flushed as it is written."""

    def log_message(self, *args):
        pass

    @staticmethod
    def chunk(**kw) -> dict:
        return {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, **kw}]}

    def pieces(self):
        raise NotImplementedError

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in self.pieces():
            self.wfile.write(piece)
            self.wfile.flush()


class SpecStream(EventStream):
    """An event stream as the SSE spec allows it: CRLF line ends, comments, `event:`/`id:` fields, and each event's
    JSON spread over several `data:` lines (joined by a newline into one event)."""

    def pieces(self):
        chunk = self.chunk
        events = [chunk(delta={"role": "assistant", "content": "one"}), chunk(delta={"content": " two"}),
                  chunk(delta={}, finish_reason="stop"), {"id": "x", "choices": [], "usage": {
                      "prompt_tokens": 5, "completion_tokens": 2}}]
        yield b": keep-alive\r\n\r\n"
        for k, e in enumerate(events):
            lines = json.dumps(e, indent=1).splitlines()  # one event, many lines
            yield (f"event: message\r\nid: {k}\r\n".encode()
                   + b"".join(f"data: {line}\r\n".encode() for line in lines) + b"\r\n")
        yield b"data: [DONE]\r\n\r\n"


def test_bench_reads_an_event_of_several_data_lines_as_one_event():
    """An event's `data:` lines are one event (joined by a newline, as the SSE spec reads them): each line was read as
    an event of its own, and a server that spreads its JSON over lines failed every request as a 'bad event'."""
    import asyncio

    import httpx

    from serving.bench import Prompt, one_request

    async def go(url):
        async with httpx.AsyncClient() as client:
            return await one_request(client, f"{url}/v1/chat/completions", Prompt([{"role": "user", "content": "hi"}],
                                     None, 1, None), "m", 4, {}, {}, 10.0)

    with http_server(SpecStream) as url:
        res = asyncio.run(go(url))
    assert res.success, res.error
    assert (res.generated_text, res.output_tokens, res.prompt_len) == ("one two", 2, 5)
    assert len(res.itl) == 1 and res.ttft > 0


class TypedEvents(EventStream):
    """A stream whose events carry SSE types: `tail` (set per test) is written between the text and the finishing
    chunk, then [DONE]."""

    tail = b""

    def pieces(self):
        yield (sse(self.chunk(delta={"role": "assistant", "content": "one"})) + TypedEvents.tail
               + sse(self.chunk(delta={}, finish_reason="stop")) + sse("[DONE]"))


@pytest.mark.parametrize("tail, error", [
    # an error event (its type in the `event:` field, as SSE names events): counted as a completed request
    (b'event: error\ndata: {"message": "the engine died", "code": 500}\n\n', "the engine died"),
    (b'event: error\ndata: engine died\n\n', "engine died"),
    # an event of another type (a keep-alive a proxy sends) is not a chunk: it failed the request as a 'bad event'
    (b"event: ping\ndata: ping\n\n", None),
])
def test_bench_reads_the_type_of_an_event(tail, error):
    import asyncio

    import httpx

    from serving.bench import Prompt, one_request

    async def go(url):
        async with httpx.AsyncClient() as client:
            return await one_request(client, f"{url}/v1/chat/completions", Prompt([{"role": "user", "content": "hi"}],
                                     None, 1, None), "m", 4, {}, {}, 10.0)

    TypedEvents.tail = tail
    with http_server(TypedEvents) as url:
        res = asyncio.run(go(url))
    if error is None:
        assert res.success and res.generated_text == "one", res.error
    else:
        assert not res.success and "server error" in res.error and error in res.error, res.error


def test_bench_with_no_server_is_one_line_error_and_writes_nothing(tmp_path):
    """Nothing listening: refused before the benchmark starts (a server that dies mid-run is counted
    as failed requests instead, see above)."""
    out = tmp_path / "b.json"
    proc = run_cli("serving.bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                   "--num-prompts", "3", "--timeout", "5", "--json", str(out), timeout=60)
    assert_one_line_error(proc, "cannot reach the server")
    assert not out.exists()


def test_bench_reads_a_datasets_save_to_disk_directory_as_the_trainer_does(tmp_path):
    """--dataset DIR (a `datasets` save_to_disk directory, which training reads) was refused as "no such file"; a
    directory of something else is named as one, as the trainer names it."""
    import datasets

    from serving.bench import file_prompts

    chat = [{"role": "user", "content": "How many push-ups?"}, {"role": "assistant", "content": "Ten."}]
    rows = [{"messages": json.dumps(chat), "prompt": None}, {"messages": None, "prompt": "Squats?"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    prompts = file_prompts(str(tmp_path / "saved"), 4, seed=0)
    assert sorted({p.messages[0]["content"] for p in prompts}) == ["How many push-ups?", "Squats?"]
    assert all(len(p.messages) == 1 for p in prompts)
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match=r"plain is a directory; give a .jsonl, .json or .parquet file or a "):
        file_prompts(str(tmp_path / "plain"), 4, seed=0)


def test_bench_reads_trls_conversational_prompt_only_rows(tmp_path):
    """TRL's prompt-only rows with a conversational prompt (`{"prompt": [messages]}`, GRPO's and online DPO's data)
    were refused as prompt-completion rows missing 'completion', where a prompt-only `messages` row was read."""
    from serving.bench import file_prompts

    tool = {"type": "function", "function": {"name": "get_steps", "description": "Steps.",
                                             "parameters": {"type": "object", "properties": {}}}}
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Steps today?"}],
             "tools": [tool]},
            {"prompt": [{"role": "user", "content": "Squats?"}], "completion": None}]
    path = tmp_path / "grpo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = sorted(file_prompts(str(path), 2, seed=0), key=lambda p: len(p.messages))
    assert [m["content"] for m in prompts[0].messages] == ["Squats?"] and not prompts[0].tools
    assert [(m["role"], m["content"]) for m in prompts[1].messages] == [("system", "Be brief."),
                                                                         ("user", "Steps today?")]
    assert [t["function"]["name"] for t in prompts[1].tools] == ["get_steps"]


def test_bench_argument_errors_are_one_line(tmp_path):
    proc = run_cli("serving.bench", "--base-url", "http://127.0.0.1:1", "--dataset", str(tmp_path / "nope.jsonl"))
    assert_one_line_error(proc, "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"nothing": 1}\n')
    proc = run_cli("serving.bench", "--base-url", "http://127.0.0.1:1", "--dataset", str(bad))
    assert_one_line_error(proc, f"{bad}:2")


@pytest.mark.parametrize("given, needle", [
    ("50,,90", "'50,,90' has an empty entry"),  # was read as 50,90 without a word
    ("", "an empty list"),
    ("100.5", "'100.5' is not a percentile from 0 to 100"),
    ("101", "'101' is not a percentile"),
    ("-5", "'-5' is not a percentile"),
    ("nan", "'nan' is not a percentile"),
    ("90,ninety", "'ninety' is not a number"),
    ("90,90.0", "'90.0' is given twice in '90,90.0'"),  # was reported twice, under one key
])
def test_bench_metric_percentiles_are_refused_by_option_name(capsys, given, needle):
    from serving.bench import main

    code = cli_main(main, ["--base-url", "http://127.0.0.1:1", f"--metric-percentiles={given}"])
    one_error_line(code, capsys.readouterr().err, "argument --metric-percentiles: " + needle)


def test_bench_metric_percentiles_take_the_ends_as_numpy_does(capsys):
    """0 and 100 are the least and the most (numpy's ends, vLLM's bench passes them on too); `--help` said "each above
    0 and below 100"."""
    import serving.bench
    from serving.bench import percentile_list

    assert percentile_list("0, 50,99.9,100") == [0.0, 50.0, 99.9, 100.0]
    text = _help(capsys, serving.bench)
    assert "--metric-percentiles METRIC_PERCENTILES comma-separated, each from 0 to 100" in text
    assert "below 100" not in text


def _help(capsys, module) -> str:
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_says_what_the_command_does_and_its_defaults(capsys):
    """`--help` showed the docstring's first line only: a usage line, cut mid-option where it wrapped
    (`... --concurrency C --input-len I`), nothing of what the command does; options without help text
    hid their defaults (`--num-prompts NUM_PROMPTS`); serving.launch offered `train.max_steps=20` as its
    override example, a key it refuses."""
    import serving.bench
    import serving.launch

    from gemma_tpu.examples.fitness import chat

    text = _help(capsys, serving.bench)
    assert "--output-len O --dataset random|FILE.jsonl" in text and "Load-test any OpenAI-compatible server" in text
    assert "--num-prompts NUM_PROMPTS requests the run sends in all (default: 100)" in text
    assert "--seed SEED seed of the random prompts (or of the order --dataset rows are sent in) (default: 0)" in text
    assert ("--concurrency CONCURRENCY, --max-concurrency CONCURRENCY requests in flight at most (--max-concurrency:"
            " vLLM bench's name, also taken) (default: 8)") in text
    # a user coming from `vllm bench serve` types its name: it was refused as an unknown option
    assert serving.bench.parse_args(["--base-url", "http://x", "--max-concurrency", "3"]).concurrency == 3
    assert "--json JSON write the results here (vllm bench serve field names) --timeout" in text  # no default shown
    text = _help(capsys, serving.launch)
    assert "e.g. server.port=8001" in text and "train.max_steps" not in text
    assert "renders the `docker run` of the vLLM-TPU image" in text
    text = _help(capsys, chat)
    assert "--provider {simulated,garmin} where the tools read activity data: a simulated device, or your Garmin " \
           "Connect account (default: simulated)" in text


# Runs `python -m MODULE ARGS` with only the distributions named in argv[1] (and what they require) importable
# beside the standard library and this repository: what a TPU VM has after the README's pip line.
ONLY_THESE_PACKAGES = r'''
import importlib.metadata as md, re, runpy, sys
from packaging.requirements import Requirement
allowed, seen = {"gemma_tpu", "serving", "convert"}, set()
def walk(name):
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    seen.add(key)
    d = md.distribution(name)
    tops = (d.read_text("top_level.txt") or "").split() or {
        str(f).split("/")[0].removesuffix(".py") for f in d.files or [] if "/" in str(f) or str(f).endswith(".py")}
    allowed.update(tops)
    for r in map(Requirement, d.requires or []):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            walk(r.name)
for name in sys.argv[1].split(","):
    walk(name)
class OnlyThese:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in allowed and not top.startswith("_"):
            raise ModuleNotFoundError(f"No module named {top!r}")
sys.meta_path.insert(0, OnlyThese())
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
'''


def test_the_clients_and_launcher_run_with_the_readme_vm_packages(tmp_path):
    """The README's VM step installs a few packages, not the training stack: serving.launch and serving.chat
    imported ml_dtypes (through the model registry's safetensors reader), which that line left out, and
    stopped on a fresh VM with `ModuleNotFoundError` before checking anything."""
    line = re.search(r"^python3 -m pip install --user (.+)$", (REPO / "README.md").read_text(), re.M).group(1)
    packages = [re.split(r"[=<>!~\[]", p.strip('"\''))[0] for p in line.split()]
    d = fake_model_dir(tmp_path / "m")
    for argv in (["serving.launch", "--config", CONFIG_270M, "--print", f"model.dir={d}"],
                 ["serving.chat", "--help"], ["serving.bench", "--help"]):
        proc = subprocess.run([sys.executable, "-c", ONLY_THESE_PACKAGES, ",".join(packages), *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{argv[0]} with only {packages}: {proc.stderr[-1500:]}"


def test_a_server_open_beyond_loopback_without_a_key_is_warned_of(tmp_path, capsys):
    """`server.host=0.0.0.0` with no API key put an open API on the VM's network (the container runs with
    --net host) without a word; the command is still printed (a firewall may stand in front)."""
    d = fake_model_dir(tmp_path / "m")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", "server.host=0.0.0.0")
    assert code == 0 and "--host 0.0.0.0" in out
    assert [l for l in err.splitlines() if l.startswith("warning: server.host 0.0.0.0")], err
    for extra in (["server.host=0.0.0.0", "server.api_key_env=SOME_KEY"], []):
        code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", *extra)
        assert code == 0 and "server.host" not in err, err


def test_extra_args_are_read_as_vllms_parser_reads_them(tmp_path, capsys):
    """The pinned release's options pass in every spelling its parser takes ('_' for '-', `--x=V`, a JSON option's
    `--x.field`, `--no-x`, `-O3`, an unambiguous abbreviation, negative values, a value of an option's fixed set);
    with another container.image a word the pinned release lacks is a warning (that image may take it), not a
    refusal."""
    d = fake_model_dir(tmp_path / "m")
    ok = ("server.extra_args=[--enable_prefix_caching, --gpu-memory-utilization=0.9, --compilation-config.mode, 3, "
          "--no-enable-log-requests, -O3, --seed, -1, --kv_cache_dtype=fp8_e5m2, --scheduling-pol, priority, "
          "--block-size, 32, --disable-log-stat]")
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}", ok)
    assert code == 0 and "warning" not in err, err
    serve = words(out)[words(out).index("vllm"):]
    assert serve[-3:] == ["--block-size", "32", "--disable-log-stat"]
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "container.image=vllm/vllm-tpu:nightly", "server.extra_args=[--new-flag,1]")
    assert code == 0 and "--new-flag" in out, err
    assert ("warning: server.extra_args: --new-flag is not an option of `vllm serve` in vllm/vllm-tpu:v0.27.0 "
            "(serving/vllm_serve_flags.txt); container.image vllm/vllm-tpu:nightly may take it") in err, err
    # a one-letter option's value written onto it, as argparse reads it (`-n2` is `--nnodes 2`): it was refused as an
    # option `vllm serve` lacks ("did you mean -n?"); its value is checked as given apart (`-n0`: at least one node)
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.extra_args=[-n2, -r0, -qfp8]")
    assert code == 0 and words(out)[-3:] == ["-n2", "-r0", "-qfp8"] and "warning" not in err, err
    # a single-dash abbreviation of one single-dash option, which argparse takes (`-pc` is -pcp): it was refused
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.extra_args=[-pc, 2]")
    assert code == 0 and words(out)[-2:] == ["-pc", "2"] and "warning" not in err, err
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.extra_args=[-n, 2, -n0]")
    assert code == 2 and "--nnodes '0' is not a number of nodes (at least 1)" in one_error_line(code, err), err
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.extra_args=[-nx]")
    assert code == 2 and "-n 'x' is not an integer" in one_error_line(code, err), err
    # on the pinned image a word close to none of its options (a plugin's, say) is a warning, not a refusal
    code, out, err = launch_inproc(capsys, "--config", CONFIG_270M, "--print", f"model.dir={d}",
                                   "server.extra_args=[--zzz-plugin-knob,1]")
    assert code == 0 and "--zzz-plugin-knob" in out, err
    assert "--zzz-plugin-knob is not an option of `vllm serve` in vllm/vllm-tpu:v0.27.0" in err
    assert "a plugin may add it" in err, err


def test_the_option_list_is_of_the_pinned_release():
    """Pinning another vllm-tpu image without remaking the list would check extra_args against the wrong release."""
    from serving.config import VLLM_FLAGS_FILE, VLLM_TPU_IMAGE, vllm_serve_flags

    version = VLLM_TPU_IMAGE.rsplit(":v", 1)[1]
    assert f"vllm-tpu=={version} " in VLLM_FLAGS_FILE.read_text().splitlines()[0], \
        f"run: python scripts/vllm_serve_flags.py {version}"
    assert {"--max-model-len", "--enable-lora", "--tool-call-parser", "-tp"} <= vllm_serve_flags()


def test_serving_local_run_by_hand_says_what_it_is_and_refuses_a_non_model_in_one_line(tmp_path, capsys):
    """`python -m serving.local --help` printed a bare usage (what NAME is, and that `serving.launch --local` is
    the way to run it, were nowhere), and a NAME without config.json ended in a FileNotFoundError traceback."""
    from gemma_tpu.core.cli import cli_main
    from serving.local import serve_main

    with pytest.raises(SystemExit) as stop:
        cli_main(serve_main, ["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "serving.launch --config FILE --local" in out and "--debug" in out
    assert cli_main(serve_main, [str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'nowhere'}: no config.json (not a Hugging Face model directory)"]
    # a port past 65535: uvicorn listened on it modulo 65536 (70000: 4464) and said it ran on 70000
    for port in ("70000", "65536"):
        assert cli_main(serve_main, [str(tmp_path / "nowhere"), "--port", port]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"argument --port: {port!r}: expected a port number in 1..65535" in err[0], err
    # and from Python (`LocalServer(dir, port=70000).start()` checks the port first): socket's OverflowError
    from gemma_tpu.core.errors import UserError
    from serving.local import check_port_free
    for port in (70000, -1, "80"):
        with pytest.raises(UserError, match=r"not a TCP port \(0 to 65535\)"):
            check_port_free("127.0.0.1", port)
    # a config.json that is not JSON, or not an object: a JSONDecodeError / AttributeError traceback
    for name, text, needle in (("cut", '{"model_type":', "not valid JSON (line 1"), ("list", "[1]", "a JSON object")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        assert cli_main(serve_main, [str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{tmp_path / name / 'config.json'}: " in err[0] and needle in err[0], err


def test_a_local_server_stopped_by_sighup_stops_as_by_sigterm(tiny_dir, tmp_path):
    """`python -m serving.local` (run by hand) whose terminal closes: uvicorn stops gracefully on SIGINT and SIGTERM
    only, and SIGHUP raised in its event loop, an ERROR with two tracebacks before 'stopped by SIGHUP'. It stops as
    on SIGTERM now: exit 129, one line, the port freed."""
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving.local", tiny_dir.name, "--port", str(port)],
                                cwd=tiny_dir.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while not _port_open(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 129, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and text.strip().splitlines()[-1] == "error: stopped by SIGHUP", text[-3000:]
    assert not _port_open(port)


def test_a_local_server_stopped_by_its_launcher_ends_quietly(tiny_dir, tmp_path):
    """The served process of `serving.launch --local` (a LocalServer: its PID in GEMMA_TPU_SERVE_PARENT) is stopped by
    SIGTERM when the launcher stops (Ctrl-C, exit 0): it said 'error: stopped by SIGTERM' (exit 143) under that clean
    stop. It ends with 0 and no error line; run by hand, the same SIGTERM is still 'stopped by SIGTERM', 143."""
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    from serving.local import PARENT_ENV

    for parent, code in ((str(os.getpid()), 0), (None, 143)):
        port = free_port()
        log = tmp_path / f"serve-{code}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop(PARENT_ENV, None)
        if parent:
            env[PARENT_ENV] = parent
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "serving.local", tiny_dir.name, "--port", str(port)],
                                    cwd=tiny_dir.parent, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 240
            while not _port_open(port):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == code, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        assert "Traceback" not in text and ("error:" in text) == (code != 0), text[-3000:]
        assert not _port_open(port)

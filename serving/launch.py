"""`python -m serving.launch --config configs/serve-*.yaml [overrides] [--print | --local]`

Serve a merged model with vLLM on a TPU VM: checks the model directory (see serving/config.py),
renders the `docker run` of the vLLM-TPU image (serving/Dockerfile) and runs it in the foreground.

    --print   print the command and exit (no Docker needed); paste it on the VM, or read it
    --local   no TPU, no Docker: serve the directory on this machine with `transformers serve`
              (CPU is fine for small models), on server.host:server.port, until Ctrl-C

The container: `--privileged --net host` (TPU devices, and the API on the host's network),
`--shm-size`, /dev/shm shared, the model mounted read-only at /models/NAME, adapters at
/adapters/NAME, the vLLM compile cache (~/.cache/vllm) mounted so restarts skip XLA compilation.
Secrets travel by name only: `-e HF_TOKEN` (docker copies the value from this environment), and
the API key as `-e VLLM_API_KEY`, which `vllm serve` reads as its `--api-key` (kept off the command
line, so it is neither printed here nor visible in the container's process list); when
server.api_key_env names another variable, the printed command starts `VLLM_API_KEY="$NAME"`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from gemma_tpu.core import cli
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.infer.openai_client import api_key_from_env
from serving.config import (
    DEFAULT_CONTEXT,
    MODEL_DIR_HINT,
    VLLM_TPU_IMAGE,
    ModelFacts,
    ServeConfig,
    as_written,
    inspect_model,
    load_serve_config,
    extra_args_warning,
    lora_warning,
    max_loras,
    open_api_warning,
    stop_token_warning,
    template_warning,
    weights_warning,
)
from serving.local import LocalServer, check_port_free

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile"
MODELS_MOUNT = "/models"
ADAPTERS_MOUNT = "/adapters"
TEMPLATES_MOUNT = "/templates"
CACHE_MOUNT = "/root/.cache/vllm"  # the image runs as root


class DockerCommand:
    """`docker run` options, image, and the `vllm serve` command, kept apart for printing."""

    def __init__(self, options: list[list[str]], image: str, serve: list[list[str]], env_prefix: str | None):
        self.options, self.image, self.serve, self.env_prefix = options, image, serve, env_prefix

    @property
    def argv(self) -> list[str]:
        return ["docker", "run", *(a for g in self.options for a in g), self.image,
                *(a for g in self.serve for a in g)]

    def shell(self) -> str:
        """One copy-pasteable shell command, one option group per line."""
        lines = [(self.env_prefix + " " if self.env_prefix else "") + "docker run"]
        lines += ["  " + shlex.join(g) for g in self.options]
        lines.append("  " + shlex.quote(self.image))
        lines += ["  " + shlex.join(g) for g in self.serve]
        return " \\\n".join(lines)


def _mount(key: str, host: Path, inside: str, mode: str = "") -> list[str]:
    """`-v HOST:INSIDE[:ro]`; docker splits the spec at ':', so a host path holding one mounted something else
    or was refused by docker ("invalid volume specification") after the launcher had said nothing."""
    if ":" in str(host):
        raise UserError(f"{key} {host}: docker -v cannot mount a path that holds ':' (the path is resolved, so "
                        "a symlink to it does not help); rename it")
    return ["-v", f"{host}:{inside}" + (f":{mode}" if mode else "")]


def _check_links_inside(key: str, host: Path) -> None:
    """A directory the container mounts alone (`docker -v`): a symbolic link in it to a file outside (a Hugging Face
    cache snapshot's files link to ../../blobs/) leads nowhere in the container, and vLLM failed to read the model
    minutes into its start, after every check here had read the files through the links."""
    root = host.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted((*dirnames, *filenames)):
            link = Path(dirpath) / name
            if link.is_symlink():
                target = link.resolve()
                if target != root and root not in target.parents:
                    raise UserError(f"{key} {host}: {link.relative_to(root)} is a symbolic link to {target}, outside "
                                    "the directory; the container mounts the directory alone, where it leads nowhere "
                                    f"(a Hugging Face cache snapshot is such a directory): copy it with its files "
                                    f"(cp -rL {shlex.quote(str(host))} DIR) and serve the copy")


def render(cfg: ServeConfig, facts: ModelFacts) -> DockerCommand:
    """The docker run command for `cfg` (the model already checked by `inspect_model`)."""
    name = cfg.served_name
    c, s, t = cfg.container, cfg.server, cfg.tool_calling
    model_in = f"{MODELS_MOUNT}/{name}"
    cache = Path(c.compile_cache).expanduser().resolve()
    _check_links_inside("model.dir", cfg.model_dir)
    for a in cfg.lora.adapters:
        _check_links_inside(f"lora.adapters.{a.name}.dir", a.path)
    opts = [["--rm", "--name", c.name or f"gemma-tpu-serve-{name}"],
            ["--privileged", "--net", "host", "--shm-size", c.shm_size, "-v", "/dev/shm:/dev/shm"],
            _mount("model.dir", cfg.model_dir, model_in, "ro"),
            _mount("container.compile_cache", cache, CACHE_MOUNT)]
    for a in cfg.lora.adapters:
        opts.append(_mount(f"lora.adapters.{a.name}.dir", a.path,
                           f"{ADAPTERS_MOUNT}/{a.name}", "ro"))
    template = None
    if t.chat_template != "model":  # with tool calling off too: the key is the one way to give vLLM a template
        host = Path(t.chat_template).expanduser().resolve()
        template = f"{TEMPLATES_MOUNT}/{host.name}"
        opts.append(_mount("tool_calling.chat_template", host, template, "ro"))
    elif t.enabled:
        template = f"{model_in}/{facts.chat_template_file}" if facts.chat_template_file else None
    renamed = []
    for inside, host_var in _secrets(cfg):
        opts.append(["-e", inside])
        if host_var != inside:
            renamed.append(f'{inside}="${host_var}"')
    env_prefix = " ".join(renamed) or None
    for k, v in sorted(c.env.items()):
        opts.append(["-e", f"{k}={v}"])
    serve = [["vllm", "serve", model_in, "--served-model-name", name],
             ["--host", s.host, "--port", str(s.port)],
             ["--tensor-parallel-size", str(s.tensor_parallel_size),
              "--max-model-len", str(facts.max_model_len or s.max_model_len or DEFAULT_CONTEXT),
              "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--max-num-seqs", str(s.max_num_seqs),
              "--dtype", s.dtype, "--chat-template-content-format", s.chat_template_content_format]]
    if t.enabled:
        serve.append(["--enable-auto-tool-choice", "--tool-call-parser", t.parser]
                     + (["--chat-template", template] if template else []))
    elif template:
        serve.append(["--chat-template", template])
    if cfg.lora.adapters:
        serve.append(["--enable-lora", "--lora-modules",
                      *(f"{a.name}={ADAPTERS_MOUNT}/{a.name}" for a in cfg.lora.adapters),
                      "--max-lora-rank", str(facts.lora_rank), "--max-loras", str(max_loras(cfg))])
    if s.extra_args:
        serve.append(list(s.extra_args))
    return DockerCommand(opts, c.image, serve, env_prefix)


def _secrets(cfg: ServeConfig) -> list[tuple[str, str]]:
    """(variable inside the container, variable on the host) for each secret passed by name."""
    out = []
    if cfg.container.hf_token_env:
        out.append(("HF_TOKEN", cfg.container.hf_token_env))
    if cfg.server.api_key_env:
        out.append(("VLLM_API_KEY", cfg.server.api_key_env))  # vllm serve reads it as --api-key
    return out


def api_key(cfg: ServeConfig) -> str | None:
    """The API key server.api_key_env names (None without one); a variable that is not set is refused."""
    name = cfg.server.api_key_env
    if name and not os.environ.get(name):
        raise UserError(f"server.api_key_env: environment variable {name} is not set (export it, or set "
                        "server.api_key_env=null for a server without an API key)")
    return api_key_from_env(name, "server.api_key_env") if name else None  # one a client's header can carry


def _docker_env(cfg: ServeConfig) -> dict[str, str]:
    """This environment, with each secret copied under the name the container expects, so that
    `docker run -e NAME` passes it on (values never reach the command line)."""
    env = dict(os.environ)
    for inside, host_var in _secrets(cfg):
        value = api_key(cfg) if inside == "VLLM_API_KEY" else os.environ.get(host_var)
        if value:
            env[inside] = value
        else:
            env.pop(inside, None)
    return env


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"docker {args[0]} did not answer within {timeout:.0f} s") from None


def run_container(cfg: ServeConfig, cmd: DockerCommand) -> int:
    """Build the image when missing, then run the container in the foreground."""
    if shutil.which("docker") is None:
        raise UserError("docker not found on PATH: install Docker on the TPU VM (or use --print to see the "
                        "command, --local to serve on this machine without a TPU)")
    env = _docker_env(cfg)
    probe = _docker("version", "--format", "{{.Server.Version}}")
    if probe.returncode != 0:
        first = (probe.stderr.strip().splitlines() or ["no answer"])[0]
        raise UserError(f"cannot reach the Docker daemon ({first})")
    # vLLM binds server.host:server.port on this machine (--net host): a port in use failed only once the image was
    # built or pulled and the container started, in a traceback from inside it
    check_port_free(cfg.server.host, cfg.server.port)
    upstream = cfg.container.image.split(":")[0] == VLLM_TPU_IMAGE.split(":")[0]
    if cfg.container.build and not upstream and _docker("image", "inspect", cfg.container.image).returncode != 0:
        # (an image that is not built here, e.g. vllm/vllm-tpu:TAG itself, is pulled by docker run)
        if not DOCKERFILE.is_file():
            raise UserError(f"image {cfg.container.image} is not present and {DOCKERFILE} is missing")
        build = ["docker", "build", "-t", cfg.container.image, "-f", str(DOCKERFILE), str(DOCKERFILE.parent)]
        print("+ " + shlex.join(build), file=sys.stderr, flush=True)
        if subprocess.run(build).returncode != 0:
            raise UserError(f"docker build of {cfg.container.image} failed (see above)")
    Path(cfg.container.compile_cache).expanduser().mkdir(parents=True, exist_ok=True)
    print("+ " + cmd.shell(), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd.argv, env=env)
    # a SIGTERM or SIGHUP to this launcher alone (kill PID, a closed terminal, a supervisor) goes on to the docker
    # client, whose signal proxy hands it to the server: the launcher died and left the client and the container
    # serving on, holding the TPU, with nothing in the foreground to stop them
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, _frame: proc.send_signal(signum)) for sig in forwarded}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # docker forwards the signal to the container; wait for it to stop
                proc.send_signal(signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_local(cfg: ServeConfig) -> int:
    """`transformers serve` on this machine, until Ctrl-C or SIGTERM."""

    key = api_key(cfg)  # required by the served /v1 paths, as vLLM's --api-key: a client without it fails here too
    facts = inspect_model(cfg, for_vllm=False)
    for warning in (weights_warning(facts), template_warning(cfg, facts)):
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    t = cfg.tool_calling
    template = t.chat_template if t.chat_template != "model" else None  # tool calling on or off, as vLLM gets it
    # bounded by server.max_model_len as vLLM is: a request without max_tokens ran to the model's whole context (32k
    # positions for Gemma 3 270M), and prompts vLLM refuses were answered
    server = LocalServer(cfg.model_dir, name=cfg.served_name, host=cfg.server.host, port=cfg.server.port,
                         chat_template=template, max_model_len=facts.max_model_len, identity=facts.identity,
                         api_key=key, auto_tools=t.enabled)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.start()
        server.wait_ready()
        print(f"serving {cfg.served_name} ({cfg.model_dir}) at {server.base_url} with transformers serve; "
              f"requests use model={cfg.served_name!r} (or none). Ctrl-C stops it.", file=sys.stderr, flush=True)
        code = server.wait()
        raise UserError(f"transformers serve exited with code {code}")
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m serving.launch", __doc__, config="serving config, e.g. configs/serve-gemma3-270m-fitness.yaml",
                   override_example="server.port=8001", config_root=ServeConfig)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the docker run command and exit")
    mode.add_argument("--local", action="store_true", help="serve here with transformers serve (no TPU, no Docker)")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    # printing the config needs no model: without --config it stopped at "model.dir is not set", defaults unseen
    cfg = load_serve_config(args.config, args.overrides, need_dir=not args.print_config)
    if args.print_config:
        cli.print_config(as_written(cfg))  # the form --config reads back: a path's `$` as `$$`
        if not cfg.model.dir:
            print(f"note: model.dir is not set; serving needs it ({MODEL_DIR_HINT})", file=sys.stderr)
        return 0
    if open_api_warning(cfg):
        print(f"warning: {open_api_warning(cfg)}", file=sys.stderr)
    if args.local:
        if cfg.lora.adapters:  # transformers serve has no adapters: requests naming them got a 404 unexplained
            names = ", ".join(a.name for a in cfg.lora.adapters)
            print(f"warning: --local serves model.dir alone, not lora.adapters ({names}): requests naming them get "
                  "404 (merge an adapter with python -m convert.merge_orbax to serve it here)", file=sys.stderr)
        if cfg.server.extra_args:  # `vllm serve`'s options: `--generation-config vllm` (say) changed vLLM's answers
            print(f"warning: --local serves without server.extra_args ({' '.join(cfg.server.extra_args)[:200]}), "
                  "options of `vllm serve` that only the container reads: the answers here are vLLM's without them",
                  file=sys.stderr)
        return serve_local(cfg)
    facts = inspect_model(cfg)
    for warning in (stop_token_warning(cfg, facts), lora_warning(cfg), extra_args_warning(cfg),
                    weights_warning(facts), template_warning(cfg, facts), *facts.adapter_warnings):
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    cmd = render(cfg, facts)
    if args.print:
        print(cmd.shell())
        return 0
    return run_container(cfg, cmd)


if __name__ == "__main__":
    sys.exit(cli_main(main))

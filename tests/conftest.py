"""Shared pytest fixtures: tiny random Gemma 3 checkpoints written by transformers, helpers to run CLIs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: needs the real embedded model (about a minute to prepare once)")
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        from importlib.metadata import version

        from packaging.version import Version

        if Version(pytest.__version__) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8.0"):
            # xdist 3.8 groups by renaming `item._nodeid`, which pytest 9.2 no longer reads: the real-model
            # tests then ran on both workers at once, and each worker converted the 270M (2026-11-24)
            raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} "
                                    "ignores --dist loadgroup; install pytest<9.2 (the test extra pins it)")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook of this name, which reads the group marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`--dist loadgroup`), every real-model test runs on one worker, one at a time:
    each holds the 270M (several GB), and two at once could exhaust a 24 GiB machine."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("real_model"))


def _signal_state() -> tuple:
    import signal

    return ({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
            signal.pthread_sigmask(signal.SIG_BLOCK, []))


_SIGNALS_AT_START = _signal_state()  # this process's Ctrl-C and SIGTERM handling before any test ran


def _put_signals_back(where: str) -> None:
    import signal
    import warnings

    now = _signal_state()
    if now == _SIGNALS_AT_START:
        return
    handlers, blocked = now
    warnings.warn(f"{where}: signal handling changed (handlers {handlers}, blocked "
                  f"{sorted(int(b) for b in blocked)}); put back as the process started")
    for s, h in _SIGNALS_AT_START[0].items():
        if h is not None:
            signal.signal(s, h)
    signal.pthread_sigmask(signal.SIG_SETMASK, _SIGNALS_AT_START[1])


@pytest.fixture(autouse=True)
def signals_as_found(request):
    """Each test starts with the worker's Ctrl-C and SIGTERM handling as the process started with it: a test (or a
    fixture it set up) that left SIGINT ignored, handled or blocked (a suite run, 2026-11-27: tests/test_interrupts.py
    then lost its Ctrl-C, in process and in its children, which inherit an ignored or blocked signal) is named in a
    warning, and the handlers and signal mask are put back, before the next test and after this one."""
    _put_signals_back(f"before {request.node.nodeid} (set by an earlier test's fixture or teardown)")
    yield
    _put_signals_back(f"after {request.node.nodeid}")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A 2-layer random Gemma3ForCausalLM (GQA: 4 heads, 2 KV heads) as a real HF directory."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "gemma3", seed=0)


@pytest.fixture(scope="session")
def tiny_long_dir(tmp_path_factory) -> Path:
    """`tiny_dir`'s model (same weights) declaring 4,096 positions: its character-level tokenizer makes a
    fitness prompt ~1,700 tokens, past the 1,024 generation refuses to exceed (as vLLM does)."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_long") / "gemma3", seed=0, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def tiny_mha_dir(tmp_path_factory) -> Path:
    """Same, with as many KV heads as query heads (Tunix fuses q/k/v into one weight)."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_mha") / "gemma3", seed=1, num_key_value_heads=4)


@pytest.fixture(scope="session")
def tiny_odd_dir(tmp_path_factory) -> Path:
    """A Gemma 3 of another shape: 7 layers (sliding x5, global, sliding: the 2-layer models have no
    global layer), one KV head, head_dim 32 != hidden/heads with queries scaled by hidden/heads (as the
    27B), linear rope scaling on global layers, a vocabulary of 509."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_odd") / "gemma3", seed=2, num_hidden_layers=7,
                             num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=16, vocab_size=509,
                             rope_parameters=rope)


@pytest.fixture
def small_disk(tmp_path):
    """`small_disk("64k")`: a tmpfs of that size mounted at tmp_path/disk (a full disk on demand; root only,
    the test is skipped where mount is not permitted), unmounted after the test."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted) or ''}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def xla_env(devices: int | None = None) -> dict:
    """XLA_FLAGS for a child process on `devices` simulated CPU devices (None: one), keeping the other XLA flags this
    process has (scripts/test.sh sets a compile-time one that a child's own XLA_FLAGS would otherwise drop)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    if devices:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
    return {"XLA_FLAGS": " ".join(kept)}


def run_cli(*args: str, env: dict | None = None, timeout: int = 900, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `python -m ...` as a user would, capturing output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def holding(code: str, *args: str) -> subprocess.Popen:
    """A Python process running `code` (with `args` as sys.argv[1:]) that prints `held` once it holds what it
    takes (a lock, an output being written): returned then, still running, for a test to contend with or kill."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, an `error:` line naming the thing, and no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]

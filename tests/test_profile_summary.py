"""benchmarks/profile_summary.py: op categories, self times, the one-line error without xprof, and (when xprof is
installed) a summary of a real JAX trace (the training run that writes one: test_train's profiling test)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("profile_summary", REPO / "benchmarks" / "profile_summary.py")
ps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ps)


@pytest.mark.parametrize("name, hint, expected", [
    ("all-reduce.3", "", "collective"),
    ("fusion.12", "all-gather fusion", "collective"),
    ("dot.5", "", "matmul/convolution"),
    ("cublas-gemm.1", "custom-call", "matmul/convolution"),
    ("custom-call.7", "custom-call", "custom call (attention etc.)"),
    ("__cudnn$fmha", "", "custom call (attention etc.)"),
    ("copy_bitcast_fusion.13", "", "copy/transpose"),
    ("fusion.4", "data formatting", "copy/transpose"),
    ("loop_multiply_fusion.2", "", "fusion: loop"),
    ("fusion.9", "output fusion", "fusion: output"),
    ("ynn_fusion.63", "", "fusion: ynn (CPU dot library)"),
    ("subtract_exponential_fusion", "", "fusion: other"),
    ("rng-bit-generator", "", "other"),
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "", "matmul/convolution"),  # cuBLAS kernels in a GPU trace
    ("gemm_fusion_dot_627", "", "matmul/convolution"),
    ("input_add_reduce_fusion_179", "", "fusion: input"),
    ("fusion_4440", "", "fusion: other"),
])
def test_categories(name, hint, expected):
    assert ps.category(name, hint) == expected


def test_self_time_subtracts_nested_events_on_the_same_thread_only():
    ev = [{"name": "outer", "pid": 1, "tid": 1, "ts": 0, "dur": 10}, {"name": "inner", "pid": 1, "tid": 1, "ts": 2,
          "dur": 3}, {"name": "next", "pid": 1, "tid": 1, "ts": 10, "dur": 4},
          {"name": "other thread", "pid": 1, "tid": 2, "ts": 1, "dur": 5}]
    got = {e["name"]: t for e, t in ps.self_times(ev)}
    assert got == {"outer": 7, "inner": 3, "next": 4, "other thread": 5}


def test_gpu_kernels_are_the_stream_lines_of_the_gpu():
    """A CUDA-graph step shows one command_buffer op on XLA's op line; the kernels are on the Stream lines."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #14(Memset,Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops - from #14"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #14 lookalike"}}]
    events = [{"ph": "X", "name": "nvjet_x", "pid": 1, "tid": 7, "ts": 0, "dur": 5},
              {"ph": "X", "name": "command_buffer_1", "pid": 1, "tid": 8, "ts": 0, "dur": 9},
              {"ph": "X", "name": "host_thing", "pid": 2, "tid": 7, "ts": 0, "dur": 3}]
    assert [e["name"] for e in ps.gpu_kernels({"traceEvents": meta + events}, events)] == ["nvjet_x"]


def test_without_xprof_one_line_error_naming_the_install(tmp_path):
    code = ("import sys, runpy; sys.modules['xprof'] = None; sys.argv = ['profile_summary.py', sys.argv[1]]; "
            "runpy.run_path('benchmarks/profile_summary.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the xprof package is missing") \
        and "pip install xprof" in lines[0], proc.stderr


def test_summary_of_a_jax_trace(tmp_path):
    """Two annotated steps of a jitted matmul + softmax, traced by JAX in a child process, summarised."""
    pytest.importorskip("xprof.convert.raw_to_tool_data")
    code = """
import sys, jax, jax.numpy as jnp
f = jax.jit(lambda a: jax.nn.softmax(a @ a.T).sum())
a = jnp.ones((256, 256)); f(a).block_until_ready()
jax.profiler.start_trace(sys.argv[1])
for i in range(2):
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        f(a).block_until_ready()
jax.profiler.stop_trace()
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # xprof's own numpy/protobuf stay out of jax's way
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "prof")], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = ps.summarise(ps.newest_xplane(tmp_path / "prof"), top=5)
    assert s["steps"] == 2 and s["step_nums"] == [1, 2] and s["step_time_ms"] > 0
    assert any(r["category"] == "matmul/convolution" or r["category"].startswith("fusion") for r in s["categories"])
    assert sum(r["share_of_device"] for r in s["categories"]) == pytest.approx(1.0, abs=1e-3)
    assert all(r["share_of_step"] > 0 for r in s["categories"] if r["self_ms"] > 0.01)
    assert len(s["top_ops"]) <= 5 and s["top_ops"][0]["self_ms"] > 0


def test_a_json_that_cannot_take_the_summary_is_refused_before_the_conversion(tmp_path, capsys):
    """`--json` was written after the (minutes-long) xprof conversion, unchecked: a directory, a path under a file
    or the trace itself ended in a traceback with the table printed and nothing saved, or replaced the input."""
    trace = tmp_path / "prof"
    trace.mkdir()
    (trace / "host.xplane.pb").write_bytes(b"\x08\x01binary")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "earlier.json").write_text(json.dumps({"categories": []}))
    cases = {str(trace): "is a directory", str(tmp_path / "notes.txt" / "s.json"): "notes.txt is a file",
             str(trace / "host.xplane.pb"): "is not an earlier summary", str(tmp_path / "notes.txt"): "not an earlier"}
    for out, words in cases.items():
        assert ps.main([str(trace), "--json", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --json {out}: ") and words in err[0], (out, err)
    assert (trace / "host.xplane.pb").read_bytes() == b"\x08\x01binary"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert ps.json_refusal(tmp_path / "earlier.json") is None and ps.json_refusal(tmp_path / "new" / "s.json") is None
    ps.write_json_atomic(tmp_path / "new" / "s.json", {"categories": [1]})
    assert json.loads((tmp_path / "new" / "s.json").read_text()) == {"categories": [1]}
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["s.json"]


# the summary of a trace written to --json OUT, where SIGTERM lands as the finished temp file is renamed over OUT
SIGTERM_AT_RENAME = """
import os, signal, sys, types, runpy
sys.modules['xprof'] = types.ModuleType('xprof')
sys.modules['xprof.convert'] = types.ModuleType('xprof.convert')
sys.modules['xprof.convert.raw_to_tool_data'] = types.ModuleType('xprof.convert.raw_to_tool_data')
ps = runpy.run_path('benchmarks/profile_summary.py')
ps['main'].__globals__.update(summarise=lambda trace, top: {'categories': ['new']}, newest_xplane=lambda d: d,
                              print_table=lambda s: None)
real = os.replace
def replace(a, b):
    signal.raise_signal(signal.SIGTERM)
    real(a, b)
os.replace = replace
sys.exit(ps['main']([sys.argv[1], '--json', sys.argv[2]]))
"""


def test_sigterm_while_the_json_is_written_leaves_the_earlier_summary_and_no_temp_file(tmp_path):
    """profile_summary.py's own JSON writer (xprof's environment cannot import the project's): a SIGTERM ended it
    where it stood, leaving `.s.json.tmp-PID` beside the summary for good (and the scratch copy of the trace). It
    now stops with one line, exit 143, the earlier summary whole, nothing else left; a SIGKILLed write's temp file
    is removed by the next write."""
    out = tmp_path / "s.json"
    out.write_text(json.dumps({"categories": ["old"]}))
    proc = subprocess.run([sys.executable, "-c", SIGTERM_AT_RENAME, str(tmp_path), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (143, "error: stopped by SIGTERM\n")
    assert json.loads(out.read_text()) == {"categories": ["old"]} and [p.name for p in tmp_path.iterdir()] == ["s.json"]
    (tmp_path / f".s.json.tmp-{2 ** 22 + 7}").write_text("{")  # a SIGKILLed writer's, its PID above pid_max
    ps.write_json_atomic(out, {"categories": ["new"]})
    assert json.loads(out.read_text()) == {"categories": ["new"]} and [p.name for p in tmp_path.iterdir()] == ["s.json"]

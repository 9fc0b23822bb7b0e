"""Where a profiled training step's device time goes, from a `train.profile_dir` trace.

    python benchmarks/profile_summary.py DIR [--json OUT] [--top N]

Reads the newest `*.xplane.pb` (or `*.xplane.pb.gz`; join split parts with `cat` first) under DIR, through a
scratch copy, with Google's `xprof` converters and prints, per HLO op category
(matmul/convolution, fusions by kind, collectives, copies/transposes, custom calls such as attention kernels,
other), the self time, its share of all device op time ("of dev") and of the profiled steps' wall time ("of step";
on XLA:CPU ops run on several threads at once, so these can sum past 100%) and, where the profile has it (GPU/TPU),
the FLOP rate; then the top-N ops by self time. Device op times come from xprof's `hlo_stats` tool; a CPU trace has
no device planes there, so the XLA ops the CPU runtime traced on its threads are read from xprof's trace
conversion instead (no FLOP rates then). Steps are the trainer's `train` step annotations in the trace.

`xprof` is not a dependency of the project (it pins its own numpy/protobuf): install it aside and run this with
a plain Python, e.g. `pip install --target /tmp/xprof xprof; PYTHONPATH=/tmp/xprof python3
benchmarks/profile_summary.py runs/NAME/prof`. The script imports nothing else from the project.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "send", "recv",
              "all_reduce", "all_gather", "reduce_scatter", "nccl")
MATMUL = ("dot", "convolution", "gemm", "cublas", "matmul", "nvjet", "xmma", "cutlass")  # cuBLAS kernel names too
CUSTOM = ("custom-call", "custom_call", "cudnn", "flash", "attention", "triton", "mosaic", "pallas", "splash")
COPY = ("copy", "transpose", "bitcast", "data formatting", "dynamic-update-slice", "dynamic_update_slice",
        "memcpy", "memset")


def category(name: str, hint: str = "") -> str:
    """Our coarse bucket for one HLO op, from its name and xprof's own category (`hint`) where given."""
    h, n = hint.lower(), name.lower()
    text = f"{h} {n}"
    if any(k in text for k in COLLECTIVE):
        return "collective"
    if any(k in text for k in MATMUL):  # gemm fusions and cuBLAS custom calls are matmuls too
        return "matmul/convolution"
    if any(k in text for k in CUSTOM):
        return "custom call (attention etc.)"
    if any(n.startswith(k) or k in h for k in COPY):  # copy_bitcast_fusion, transpose_fusion, wrapped_transpose
        return "copy/transpose"
    if n.startswith("ynn_fusion"):  # XLA:CPU hands these to the XNNPACK/YNNPACK library: dots and what they fuse
        return "fusion: ynn (CPU dot library)"
    if "fusion" in text:
        m = re.search(r"\b(loop|input|output|reduce|reduction|scatter|concatenate)\b", h) \
            or re.match(r"(loop|input|output|reduce|reduction|scatter|concatenate)_", n)
        return f"fusion: {m.group(1) if m else 'other'}"
    return f"other: {h}" if h else "other"


def newest_xplane(root: Path) -> Path:
    """The newest `*.xplane.pb` (or `*.xplane.pb.gz`, as a device run may send it back) under `root`."""
    found = sorted([*root.rglob("*.xplane.pb"), *root.rglob("*.xplane.pb.gz")], key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"error: {root}: no *.xplane.pb under it (train.profile_dir's trace)")
    return found[-1]


def working_copy(xplane: Path, into: Path) -> Path:
    """The trace copied (or gunzipped) into a scratch folder: xprof writes its cache (`ALL_HOSTS.op_stats*.pb`)
    beside the file it reads, and the profile's own folder may be read-only or not ours to write to."""
    out = into / xplane.name.removesuffix(".gz")
    with (gzip.open(xplane) if xplane.suffix == ".gz" else open(xplane, "rb")) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def tool(xplane: Path, name: str):
    """One xprof tool's output, as JSON."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([str(xplane)], name, {})
    if data is None:
        raise SystemExit(f"error: {xplane}: xprof's {name} converter returned nothing")
    return json.loads(data if isinstance(data, str) else data.decode())


def gviz_rows(table: dict) -> list[dict]:
    ids = [c["id"] for c in table.get("cols", [])]
    return [{k: (c or {}).get("v") for k, c in zip(ids, r["c"])} for r in table.get("rows", [])]


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, self time µs) for complete events: duration less that of the events nested in it on its thread."""
    out = []
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e["pid"], e.get("tid")), []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, child time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][1]:
                top = stack.pop()
                out.append((top[0], top[0]["dur"] - top[2]))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        out += [(top[0], top[0]["dur"] - top[2]) for top in stack]
    return out


HOST_EVENTS = ("command_buffer::update", "command_buffer::execute")


def gpu_kernels(trace: dict, events: list[dict]) -> list[dict]:
    """The kernel events on the lines named `Stream #N(...)` of `/device:GPU:0` (XLA's GPU trace layout)."""
    meta = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M"]
    gpu = {e["pid"] for e in meta if e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:GPU:0")}
    streams = {(e["pid"], e.get("tid")) for e in meta if e.get("name") == "thread_name" and e.get("pid") in gpu
               and str(e.get("args", {}).get("name", "")).startswith("Stream #")}
    return [e for e in events if (e["pid"], e.get("tid")) in streams]


def summarise(xplane: Path, top: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        return _summarise(working_copy(xplane, Path(scratch)), top) | {"xplane": str(xplane),
                                                                       "xplane_bytes": xplane.stat().st_size}


def _summarise(xplane: Path, top: int) -> dict:
    trace = tool(xplane, "trace_viewer")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    # the trainer's jax.profiler.StepTraceAnnotation("train", step_num=...), 0-based loop iterations
    steps = [e for e in events if e["name"].startswith("train") and "step_num" in e.get("args", {})]
    step_us = sum(e["dur"] for e in steps)
    ops: dict[str, dict] = {}
    rows = gviz_rows(tool(xplane, "hlo_stats"))
    if rows:  # GPU/TPU: xprof's per-op device statistics
        source = "xprof hlo_stats"
        for r in rows:
            name = r.get("hlo_op_name") or "?"
            o = ops.setdefault(name, {"op": name, "category": category(name, r.get("category") or ""),
                                      "occurrences": 0, "self_us": 0.0, "gflop": 0.0})
            t = float(r.get("total_self_time") or 0.0)
            o["occurrences"] += int(r.get("occurrences") or 0)
            o["self_us"] += t
            o["gflop"] += float(r.get("model_flop_rate") or 0.0) * t * 1e-6  # GFLOP/s × s
            o.setdefault("program", r.get("program_id"))
    elif kernels := gpu_kernels(trace, events):
        # GPU without hlo_stats rows: XLA ran the step as a CUDA graph (command buffer), so its op line holds one
        # "command_buffer" op; the kernels the graph ran are on the GPU's stream lines, named after their fusions
        source = "xprof trace (GPU stream kernels)"
        for e in kernels:
            o = ops.setdefault(e["name"], {"op": e["name"], "category": category(e["name"]), "occurrences": 0,
                                           "self_us": 0.0, "gflop": 0.0})
            o["occurrences"] += 1
            o["self_us"] += e["dur"]
    else:  # CPU: the XLA ops the runtime traced (events carrying `hlo_op`), on the first device
        source = "xprof trace (XLA CPU runtime events)"
        xla = [e for e in events if "hlo_op" in e.get("args", {})]
        first = min((e["args"].get("device_ordinal", "0") for e in xla), default="0")
        xla = [e for e in xla if e["args"].get("device_ordinal", "0") == first]
        for e, t in self_times(xla):
            name = e["args"]["hlo_op"]
            o = ops.setdefault(name, {"op": name, "category": category(name), "occurrences": 0, "self_us": 0.0,
                                      "gflop": 0.0, "program": e["args"].get("hlo_module")})
            o["occurrences"] += 1
            o["self_us"] += t
    busy = sum(o["self_us"] for o in ops.values())  # above the steps' wall time where ops overlap (XLA:CPU threads)

    def row(label, items):
        t = sum(o["self_us"] for o in items)
        g = sum(o["gflop"] for o in items)
        return {label: items[0][label] if label == "op" else label, "self_ms": round(t / 1e3, 3),
                "share_of_device": round(t / busy, 4) if busy else None,
                "share_of_step": round(t / step_us, 4) if step_us else None,
                "tflop_per_s": round(g / (t * 1e-6) / 1e3, 2) if g and t else None}

    cats: dict[str, list] = {}
    for o in ops.values():
        cats.setdefault(o["category"], []).append(o)
    by_cat = sorted(({**row("category", v), "category": k, "ops": len(v)} for k, v in cats.items()),
                    key=lambda r: -r["self_ms"])
    tops = sorted(ops.values(), key=lambda o: -o["self_us"])[:top]
    # host time XLA spends updating a CUDA graph before launching it (buffer addresses changed): the GPU waits
    host = {name: sum(e["dur"] for e in events if e["name"] == name) for name in HOST_EVENTS}
    return {
        "xplane": str(xplane), "xplane_bytes": xplane.stat().st_size, "source": source,
        "host_ms_per_step": {k: round(v / len(steps) / 1e3, 3) for k, v in host.items() if v and steps},
        "steps": len(steps), "step_nums": sorted(int(e["args"]["step_num"]) + 1 for e in steps),
        "step_time_ms": round(step_us / len(steps) / 1e3, 3) if steps else None,
        "device_busy_ms": round(busy / 1e3, 3),
        "device_busy_share": round(busy / step_us, 4) if step_us else None,
        "categories": by_cat,
        "top_ops": [{**row("op", [o]), "op": o["op"], "category": o["category"], "occurrences": o["occurrences"],
                     "program": o.get("program")} for o in tops],
    }


def print_table(s: dict) -> None:
    pct = lambda x: f"{100 * x:6.2f}%" if x is not None else "      -"  # noqa: E731
    rate = lambda x: f"{x:9.2f}" if x is not None else "        -"  # noqa: E731
    print(f"{s['xplane']} ({s['xplane_bytes'] / 1e6:.1f} MB, {s['source']})")
    print(f"profiled steps: {s['steps']} {s['step_nums']}, mean step {s['step_time_ms']} ms, device busy "
          f"{s['device_busy_ms']} ms = {pct(s['device_busy_share']).strip()} of the steps' wall time")
    for name, ms in s.get("host_ms_per_step", {}).items():
        print(f"host {name}: {ms} ms a step")
    head = f"{'self ms':>11} {'of dev':>8} {'of step':>8} {'TFLOP/s':>9}"
    cells = lambda r: (f"{r['self_ms']:>11.3f} {pct(r['share_of_device'])} {pct(r['share_of_step'])} "  # noqa: E731
                       f"{rate(r['tflop_per_s'])}")
    print(f"\n{'category':<34} {'ops':>5} {head}")
    for r in s["categories"]:
        print(f"{r['category'][:34]:<34} {r['ops']:>5} {cells(r)}")
    print(f"\n{'top op (self time)':<40} {'category':<22} {'n':>5} {head}")
    for r in s["top_ops"]:
        print(f"{r['op'][:40]:<40} {r['category'][:22]:<22} {r['occurrences']:>5} {cells(r)}")


def json_refusal(path: Path | None) -> str | None:
    """Why `--json` could not take the summary, said before the (minutes-long) conversion, or None. The project's
    own check (gemma_tpu.core.atomic) is not importable beside xprof's pinned packages: the same rules here."""
    if path is None:
        return None
    if path.is_dir():
        return "is a directory (give a file name)"
    if path.is_file() and path.stat().st_size:
        try:
            earlier = json.loads(path.read_bytes())
        except (ValueError, OSError):
            earlier = None
        if not (isinstance(earlier, dict) and "categories" in earlier):
            return "exists and is not an earlier summary (no 'categories'); remove it or give another file name"
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    import os

    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in {folder} (permission denied)"
    return None


class Terminated(BaseException):
    """SIGTERM, raised (see `main`) so that the scratch copy of the trace and a half-written summary are removed:
    Python's default SIGTERM ended the process where it stood, leaving `.<name>.tmp-<pid>` beside --json."""


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise Terminated


def _fsync(path: Path) -> None:
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a directory on a filesystem that cannot sync one
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, doc) -> None:
    """The summary written beside its target, synced, and renamed over it: never left cut short (Ctrl-C, SIGTERM,
    a full disk, a power loss), and no `.<name>.tmp-<pid>` left but by a SIGKILL, which the next write removes.
    (xprof's pinned environment cannot import the project: gemma_tpu.core.atomic's own is not used.)"""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    for left in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):  # a SIGKILLed write's, its process gone
        pid = left.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            left.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="train.profile_dir (or any folder above the *.xplane.pb)")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--top", type=int, default=20, help="ops listed by self time (default: 20)")
    args = p.parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread, where Python runs no handlers
        previous = None
    try:
        return _run(args)
    except Terminated:
        print("error: stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    if not args.dir.is_dir():
        print(f"error: {args.dir}: not a directory", file=sys.stderr)
        return 2
    bad_json = json_refusal(args.json)
    if bad_json:
        print(f"error: --json {args.json}: {bad_json}; nothing written", file=sys.stderr)
        return 2
    try:
        import xprof.convert.raw_to_tool_data  # noqa: F401
    except ImportError as e:
        print(f"error: the xprof package is missing ({e}); pip install xprof (e.g. pip install --target "
              f"/tmp/xprof xprof, then PYTHONPATH=/tmp/xprof python3 {sys.argv[0]} ...)", file=sys.stderr)
        return 2
    try:
        s = summarise(newest_xplane(args.dir), args.top)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print_table(s)
    if args.json:
        write_json_atomic(args.json, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())

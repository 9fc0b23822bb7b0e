"""Write serving/vllm_serve_flags.txt: the options `vllm serve` takes in the vLLM-TPU release serving/config.py
pins, so that serving.launch refuses a misspelt `server.extra_args` option here instead of on the TPU VM (after
pulling the image and minutes into the container's start).

    python scripts/vllm_serve_flags.py 0.27.0

Maintenance only (the tests read the file, never run this): it downloads the `vllm-tpu==VERSION` wheel (pure
Python) and the few packages its argument parser imports into a scratch folder, builds the parser of `vllm serve`
on vLLM's CPU platform (the options do not depend on the platform) and lists every option string, with the values
it takes where argparse checks them against a fixed set (`--kv-cache-dtype auto bfloat16 ...`). Run it when
VLLM_TPU_IMAGE changes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "serving" / "vllm_serve_flags.txt"
# what vLLM's parser modules import beyond what the project's venv has (torch, transformers, pydantic, ...)
EXTRA = ["cbor2", "pyzmq", "aiohttp", "multidict", "yarl", "propcache", "aiohappyeyeballs", "aiosignal",
         "frozenlist", "openai-harmony", "msgspec", "pybase64", "cachetools", "py-cpuinfo", "partial-json-parser"]

PROBE = """
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
flags = {s: [] for a in parser._actions for s in a.option_strings}
def number_type(t):  # int or float, or vLLM's optional_type of one (which also takes "" and "None"), else None
    inner = [c.cell_contents for c in t.__closure__ or ()] if getattr(t, "__name__", "") == "_optional_type" else []
    base = t if t in (int, float) else next((c for c in inner if c in (int, float)), None)
    return base and ":" + base.__name__ + ("?" if inner else "")
for a in parser._actions:  # a fixed set of values argparse checks as written (no converting type, one value)
    if a.nargs == 0:  # no value at all: a switch (store_true, --x/--no-x), which argparse refuses `--x=V` for
        for s in a.option_strings:
            flags[s] = [":switch"]
    elif a.choices is not None and a.type in (None, str) and a.nargs is None:
        for s in a.option_strings:
            flags[s] = [str(c) for c in a.choices]
    elif a.choices is None and a.nargs is None and number_type(a.type):  # a number argparse converts (int("x"))
        for s in a.option_strings:
            flags[s] = [number_type(a.type)]
print(json.dumps(sorted(flags.items())))
"""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    version = argv[0]
    pip = [sys.executable, "-m", "pip", "-q"]
    with tempfile.TemporaryDirectory() as scratch:
        s = Path(scratch)
        subprocess.run(pip + ["download", "--no-deps", f"vllm-tpu=={version}", "--python-version", "3.12",
                              "--only-binary=:all:", "-d", str(s / "wheel")], check=True)
        with zipfile.ZipFile(next((s / "wheel").glob("*.whl"))) as whl:
            whl.extractall(s / "src", [n for n in whl.namelist() if n.startswith("vllm/")])
        subprocess.run(pip + ["install", "--no-deps", "--target", str(s / "deps")] + EXTRA, check=True)
        import json
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(s / "deps"), str(s / "src")])}
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
        flags = json.loads(out.stdout.strip().splitlines()[-1])
    OUT.write_text(f"# The options of `vllm serve` in vllm-tpu=={version} (the release of the pinned vllm/vllm-tpu "
                   f"image), one a line;\n# made by scripts/vllm_serve_flags.py {version}. serving/config.py checks "
                   "server.extra_args against them.\n# An option whose value argparse checks against a fixed set is "
                   "followed by that set (vllm serve stops at any other value);\n# one whose value argparse converts "
                   "to a number by :int or :float (:int? and :float? take \"None\" and an empty value too);\n"
                   "# one that takes no value (a switch: store_true, --x / --no-x) by :switch.\n"
                   + "\n".join(" ".join([flag, *choices]) for flag, choices in flags) + "\n")
    print(f"{OUT}: {len(flags)} options of vllm-tpu {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

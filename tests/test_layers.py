"""The import contract (pyproject.toml, [tool.importlinter]) holds, and it does catch a forbidden import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_contract_holds():
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 2, proc.stdout


def copy_tree(dst: Path) -> Path:
    for name in ("gemma_tpu", "convert", "serving"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


@pytest.mark.parametrize("module, line, broken", [
    # the library must not import the products above it
    ("gemma_tpu/models/registry.py", "import convert.merge_orbax  # noqa", "gemma_tpu is not allowed to import convert"),
    # a low stage must not import a higher one (here: hf -> train)
    ("gemma_tpu/hf/directory.py", "from gemma_tpu.train import loss  # noqa", "gemma_tpu.hf is not allowed to import gemma_tpu.train"),
    # independent siblings stay independent, even inside a function body
    ("convert/inspect.py", "def _f():\n    import serving.config  # noqa", "convert is not allowed to import serving"),
])
def test_contract_catches_a_forbidden_import(tmp_path, module, line, broken):
    root = copy_tree(tmp_path)
    path = root / module
    path.write_text(path.read_text() + "\n\n" + line + "\n")
    proc = lint(root)
    assert proc.returncode != 0
    assert broken in proc.stdout, proc.stdout

"""Safe by default: a scan of everything we ship for calls that load code or pickles, leak tokens or
expose servers. A hit names the file and line; an intended exception needs a `# safety: <reason>`
comment on that line, so every exception is visible in review."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIPPED = ["gemma_tpu", "convert", "serving", "benchmarks", "scripts"]

# (name, regex on source lines) - a textual scan catches uses that ast calls would miss (templates, strings)
FORBIDDEN_TEXT = [
    ("torch.load (pickle)", re.compile(r"\btorch\.load\s*\(")),
    ("pickle", re.compile(r"\b(c?pickle|dill|joblib)\.(load|loads)\s*\(")),
    ("trust_remote_code enabled", re.compile(r"trust_remote_code\s*=\s*True")),
    ("yaml.load without a safe loader", re.compile(r"\byaml\.(load|unsafe_load|full_load)\s*\(")),
    ("numpy pickle load", re.compile(r"allow_pickle\s*=\s*True")),
    ("shell=True", re.compile(r"shell\s*=\s*True")),
    ("weights_only=False", re.compile(r"weights_only\s*=\s*False")),
    ("server bound to all interfaces by default", re.compile(r"""(host|bind)\s*[:=]\s*(str\s*=\s*)?["']0\.0\.0\.0["']""")),
]
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
SECRET_PRINT = re.compile(r"(print|log\w*\.(info|warning|debug|error))\s*\(.*\b(HF_TOKEN|token_value|api_key_value)\b")


def shipped_files() -> list[Path]:
    out = []
    for top in SHIPPED:
        out += sorted((REPO / top).rglob("*.py"))
    return out


def _allowed(line: str) -> bool:
    return "# safety:" in line


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_forbidden_calls(path: Path):
    text = path.read_text()
    lines = text.splitlines()
    hits = []
    for i, line in enumerate(lines, 1):
        if _allowed(line) or line.lstrip().startswith("#"):
            continue
        for what, rx in FORBIDDEN_TEXT:
            if rx.search(line):
                hits.append(f"{path.relative_to(REPO)}:{i}: {what}: {line.strip()}")
        if SECRET_PRINT.search(line):
            hits.append(f"{path.relative_to(REPO)}:{i}: a secret printed or logged: {line.strip()}")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            if not _allowed(lines[node.lineno - 1]):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: builtin {node.func.id}()")
    assert not hits, "\n".join(hits)


def test_scan_catches_what_it_should(tmp_path):
    """The scanner itself: each pattern fires on a known-bad line (so a broken regex cannot pass silently)."""
    bad = ["m = torch.load(p)", "pickle.loads(b)", "AutoModel.from_pretrained(p, trust_remote_code=True)",
           "yaml.load(f)", "np.load(p, allow_pickle=True)", "subprocess.run(c, shell=True)",
           "torch.load(p, weights_only=False)", 'host: str = "0.0.0.0"']
    for line, (what, rx) in zip(bad, FORBIDDEN_TEXT, strict=True):
        assert rx.search(line), what
    assert SECRET_PRINT.search('print(os.environ["HF_TOKEN"])')


def test_weights_are_read_only_from_safetensors():
    """Loading code never globs pickled weight formats."""
    for path in shipped_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']\*?\.(bin|pt|pth|ckpt)["']""", line) and "WEIGHT_SUFFIXES" not in line \
                    and not _allowed(line):
                pytest.fail(f"{path.relative_to(REPO)}:{i}: reads a pickle-format weight file: {line.strip()}")

"""README.md is what a new user copies: every `python -m` module it names must answer `--help`, every option a
README command line passes must be one that module takes, every config key it names must exist in the typed
configs, and every repository path it names must exist. Docs drift fails here instead of at the user's prompt."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import io
import re
import runpy
import signal
import sys
import typing
from unittest import mock

import pytest

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
# a command continued over lines with a backslash is one line to a shell
_COMMAND_TEXT = README.replace("\\\n", " ")
_OURS = r"(?:gemma_tpu|convert|serving)(?:\.[a-z_]+)*"


def _modules() -> list[str]:
    return sorted(set(re.findall(rf"python3? -m ({_OURS})", README)))


_HELP: dict[str, str] = {}
_PARSERS: dict[str, argparse.ArgumentParser] = {}  # the parser that answered `--help`


@contextlib.contextmanager
def _signals_kept():
    """Run from its own command line (`sys.argv`), a command handles Ctrl-C, SIGTERM and SIGHUP itself for the rest of
    the process (cli._stops_raise, _end_on_stop); run here, the process is pytest's: they are put back."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def _help(module: str) -> str:
    """`python -m MODULE --help`, run in this process (a subprocess a module would cost ~15 s)."""
    if module not in _HELP:
        out = io.StringIO()
        argv = sys.argv
        sys.argv = [module, "--help"]
        parse = argparse.ArgumentParser.parse_known_args

        def recorded(self, *args, **kwargs):
            _PARSERS.setdefault(module, self)
            return parse(self, *args, **kwargs)

        try:
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop, _signals_kept(), \
                    mock.patch.object(argparse.ArgumentParser, "parse_known_args", recorded):
                runpy.run_module(module, run_name="__main__", alter_sys=False)
        finally:
            sys.argv = argv
        assert stop.value.code in (0, None), f"python -m {module} --help exited {stop.value.code}"
        _HELP[module] = out.getvalue()
    return _HELP[module]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module", _modules())
def test_every_readme_module_answers_help(module):
    assert "usage:" in _help(module), module


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_every_option_of_a_readme_command_is_taken():
    """`python -m X ... --opt` in README (code blocks and inline commands): X's --help lists --opt."""
    missing = []
    for m in re.finditer(rf"python3? -m ({_OURS})([^`\n#]*)", _COMMAND_TEXT):
        module, rest = m.groups()
        text = _help(module)
        for opt in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))):
            if not re.search(re.escape(opt) + r"(?![\w-])", text):
                missing.append(f"python -m {module} {opt}")
    assert not missing, missing


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_every_option_of_a_readme_module_says_what_it_does():
    """Each option (and each subcommand's) has a help text: `--num-prompts NUM_PROMPTS (default: 100)` alone left a
    user to guess what was counted, `--provider {simulated,garmin}` what it provides."""
    bare = []
    for module in _modules():
        _help(module)
        todo = [_PARSERS[module]]
        while todo:
            p = todo.pop()
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    todo += a.choices.values()
                elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                    bare.append(f"{p.prog} {'/'.join(a.option_strings) or a.dest}")
    assert not bare, bare


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_config_key_readme_names_exists():
    """`section.key` in README is a field of the training config or of the serving config's section."""
    from gemma_tpu.core.config import RunConfig
    from serving.config import ServeConfig

    known: dict[str, set[str]] = {}
    for top in (RunConfig, ServeConfig):
        for f in dataclasses.fields(top):
            known.setdefault(f.name, set()).update(_fields(f.default_factory))
    named = set(re.findall(r"(?<![\w./])(" + "|".join(known) + r")\.([a-z_]+)(?==|`|[\s:,)])", README))
    assert len(named) > 40  # the pattern still finds README's keys
    files = {"py", "safetensors", "json", "jsonl", "yaml"}  # `model.safetensors`, `lora.py` are files, not keys
    modules = {(s, k) for s, k in named if (REPO / "gemma_tpu" / s / f"{k}.py").exists()}  # `data.inspect`
    unknown = sorted(f"{s}.{k}" for s, k in named - modules if k not in known[s] and k not in files)
    assert not unknown, unknown


def test_every_repository_path_readme_names_exists():
    paths = set(re.findall(r"(?<![\w/.~-])((?:benchmarks|scripts|tests|configs|serving|convert|gemma_tpu)/"
                           r"[\w./-]*\w)", README))
    assert len(paths) > 30
    missing = sorted(p for p in paths if not (REPO / p).exists() and "*" not in p and "<" not in p)
    assert not missing, missing


def test_shipped_configs_load():
    from gemma_tpu.core.config import load_config
    from serving.config import load_serve_config

    for path in sorted((REPO / "configs").glob("*.yaml")):
        (load_serve_config if path.name.startswith("serve-") else load_config)(str(path), [])


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_mha_dir"])
def test_readme_lora_targets_are_accepted(fixture, request):
    """README's `lora.targets=[q_proj,v_proj]` example was refused on every Gemma (k_proj and v_proj share one Tunix
    weight; with as many KV heads as query heads q, k and v do): each target list README shows must train."""
    from gemma_tpu.core.typed_yaml import parse_override
    from gemma_tpu.models import resolve_model

    r = resolve_model(str(request.getfixturevalue(fixture)))
    shown = re.findall(r"`(lora\.targets=\[[^]`]*\])`", README)
    assert shown
    for text in shown:
        r.family.targets_to_modules(r.family.tunix_config(r.hf_config), list(parse_override(text)[1]))


def test_every_option_of_a_readme_script_command_is_taken():
    """`benchmarks/X.py ... --opt` in README: X.py defines --opt (read from its source: running each would cost
    a subprocess)."""
    missing = []
    for script, rest in re.findall(r"((?:benchmarks|scripts)/[a-z_]+\.py)([^`\n]*)", README):
        source = (REPO / script).read_text()
        missing += [f"{script} {o}" for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
                    if f'"{o}"' not in source]
    assert not missing, missing


def _test_names() -> set[str]:
    return {n for p in (REPO / "tests").glob("test_*.py")
            for n in re.findall(r"^\s*def (test_\w+)", p.read_text(), re.M)}


def test_every_test_readme_cites_exists():
    """README answers "what was tested" with test names (`test_ctrl_c_mid_run_...` a prefix), tests/test_bad_input.py
    case ids (`merge-nonfinite-factor`, globs such as `config-*`) and parts of test names (`second_writer`): a test
    renamed or a case dropped left README citing a test nobody runs."""
    names = _test_names()
    cases = set(re.findall(r'\bCase\(\s*"([^"]+)"', (REPO / "tests" / "test_bad_input.py").read_text()))
    assert len(names) > 500 and len(cases) > 100  # the patterns still find the tests
    files = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    missing = []
    for name, prefix in re.findall(r"(?<![\w/])(test_\w+?)(_\.\.\.)?(?![\w.])", README.replace("`", " ")):
        if name not in files and not any(n == name or prefix and n.startswith(name + "_") for n in names):
            missing.append(name + (prefix or ""))
    for segment in re.findall(r"Test(?:s|ed):(.*?)(?=\n\* |\n\n|\n#)", README, re.S):
        for cited in re.findall(r"`([^`]+)`", segment):
            if re.fullmatch(r"[a-z*][a-z0-9*]*(?:-[a-z0-9*]+)+", cited):  # a case id of tests/test_bad_input.py
                if not fnmatch.filter(cases, cited):
                    missing.append(cited)
            elif re.fullmatch(r"[a-z]+(?:_[a-z0-9]+)+", cited) and not cited.startswith("test_"):  # part of a name
                if not any(cited in n for n in names):
                    missing.append(cited)
    assert not missing, missing


def test_readme_versions_are_the_pinned_ones():
    """The versions README names (`torch==...` installed first, the VM's `transformers==...`, the vLLM TPU image,
    Tunix's version whose behaviour our subclasses correct) are the ones pyproject.toml and serving/Dockerfile pin."""
    pyproject = (REPO / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^";,\s]+)', pyproject))
    stale = []
    shown = re.findall(r"(?<![\w.-])([A-Za-z][A-Za-z0-9_.-]*)==([0-9][\w.]*)", README)
    assert shown
    stale += [f"{n}=={v} (pyproject: {pins.get(n)})" for n, v in shown if pins.get(n) != v]
    image = re.search(r"^FROM (\S+)", (REPO / "serving" / "Dockerfile").read_text(), re.M).group(1)
    stale += [f"FROM {i} (Dockerfile: {image})" for i in re.findall(r"vllm/vllm-tpu:[\w.]+", README) if i != image]
    stale += [f"Tunix {v} (pyproject: google-tunix=={pins['google-tunix']})"
              for v in re.findall(r"Tunix (\d+\.\d+\.\d+)", README) if v != pins["google-tunix"]]
    assert not stale, stale


def test_config_table_keys_exist():
    """README's configuration table names each section's keys bare (`| `train` | `max_steps`, ... |`), which the
    `section.key` check above does not see: each key outside the parentheses is a field of that section, and the
    values it lists for a key (`dtype` (float32 \\| bfloat16)) are the ones that field takes."""
    from gemma_tpu.core.accelerators import ACCELERATORS
    from gemma_tpu.core.config import RunConfig

    sections = {f.name: _fields(f.default_factory) for f in dataclasses.fields(RunConfig)}
    hints = {f.name: typing.get_type_hints(f.default_factory) for f in dataclasses.fields(RunConfig)}

    def choices_of(section: str, key: str) -> set[str]:  # the values a Literal field (or mesh.accelerator) takes
        if (section, key) == ("mesh", "accelerator"):
            return set(ACCELERATORS)
        hint = hints[section][key]
        literal = next((a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is typing.Literal), hint)
        return set(typing.get_args(literal))

    rows = re.findall(r"^\| `([a-z]+)` \| (.*) \|$", README, re.M)
    assert {s for s, _ in rows} == set(sections), rows  # one row a section
    unknown = []
    for section, text in rows:
        depth, outside = 0, []
        for ch in text:  # the keys, without the parenthesised values and notes
            depth += (ch == "(") - (ch == ")")
            outside.append(ch if depth == 0 and ch != ")" else " ")
        keys = re.findall(r"`([a-z_]+)`", "".join(outside))
        assert keys, section
        unknown += [f"{section}.{k}" for k in keys if k not in sections[section]]
        for key, values in re.findall(r"`([a-z_]+)` \(((?:[a-z0-9_-]+ \\\| )+[a-z0-9_-]+)[;:)]", text):
            choices = choices_of(section, key)
            unknown += [f"{section}.{key}={v}" for v in values.split(" \\| ") if v not in choices]
    assert not unknown, unknown


_MAIN_GUARD = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)


def entry_modules(package_dir, package: str) -> list[str]:
    """Every module under `package_dir` that runs with `python -m`: a package with `__main__.py`, or a module that
    checks `__name__ == "__main__"`."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if path.name == "__main__.py" and len(parts) > 1:
            found.append(".".join((package, *parts[:-1])))
        elif path.name != "__main__.py" and _MAIN_GUARD.search(path.read_text(encoding="utf-8")):
            found.append(".".join((package, *parts)))
    return found


@pytest.mark.parametrize("package", ["gemma_tpu", "convert", "serving"])
def test_python_m_package_lists_every_command(package):
    """`python -m gemma_tpu` was Python's "is a package and cannot be directly executed"; its list must name every
    module of the package that runs with `python -m` (a new command missing from COMMANDS fails here)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop, _signals_kept(), \
            mock.patch.object(sys, "argv", [package]):
        runpy.run_module(package, run_name="__main__", alter_sys=False)
    assert stop.value.code == 0
    listed = set(re.findall(rf"python -m ({package}\.[a-z_.]+)", out.getvalue()))
    assert listed == set(entry_modules(REPO / package, package))

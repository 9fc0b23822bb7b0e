"""The tool-call format, the chat markup and the family facts each have one home.

Marker strings and vocabulary ids live in `gemma_tpu/formats` and in the family registry
(`gemma_tpu/models/registry.py` and the family entries `gemma3.py` / `gemma4.py`); every other module
of the product takes them from there. The scan reads string and integer constants (docstrings and
comments may name a marker).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gemma_tpu.formats import function_calling as fc
from gemma_tpu.formats import gemma_chat
from gemma_tpu.models.gemma3 import GEMMA3
from gemma_tpu.models.gemma4 import GEMMA4

REPO = Path(__file__).resolve().parent.parent
HOMES = ("gemma_tpu/formats/", "gemma_tpu/models/registry.py", "gemma_tpu/models/gemma3.py",
         "gemma_tpu/models/gemma4.py")
# gemma_tpu.assets sits below formats and models in the import contract (pyproject.toml), so the
# tiny tokenizer and the embedded model's known config spell their special tokens and ids themselves;
# `test_assets_agree_with_the_registry` holds them to the registry.
BELOW_THE_HOMES = ("gemma_tpu/assets/",)
MARKER = re.compile(r"<(start|end)_of_turn>|<(start|end)_function_\w+>|<escape>|<unused\d*|<turn\|>")
STOP_IDS = {106}


def literals(source: str) -> list[tuple[int, str]]:
    """(line, what) for every marker string or stop-id integer outside docstrings."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docstrings:
            continue
        if isinstance(node.value, str) and MARKER.search(node.value):
            found.append((node.lineno, MARKER.search(node.value).group(0)))
        elif type(node.value) is int and node.value in STOP_IDS:
            found.append((node.lineno, str(node.value)))
    return found


def test_the_scan_sees_a_literal_and_ignores_docstrings():
    assert literals('"""Stops on <end_of_turn> (106)."""\nX = 1\n') == []
    assert literals('STOP = 106\n') == [(1, "106")]
    assert literals('def f():\n    """<escape>"""\n    return "<start_of_turn>user\\n"\n') == [(3, "<start_of_turn>")]
    assert literals('M = {"<escape>": "<unused6>"}\n') == [(1, "<escape>"), (1, "<unused6")]


def test_markers_and_stop_ids_live_only_in_formats_and_the_registry():
    offenders = []
    for package in ("gemma_tpu", "convert", "serving"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(HOMES + BELOW_THE_HOMES):
                continue
            offenders += [f"{rel}:{line}: {what}" for line, what in literals(path.read_text())]
    assert offenders == [], "take these from gemma_tpu.formats or the family registry:\n" + "\n".join(offenders)


def test_assets_agree_with_the_registry():
    from gemma_tpu.assets import embedded, tiny

    real = embedded.REGISTRY["gemma3-270m"]
    assert real.expected_config["layer_types"] == GEMMA3.layer_types(18)
    assert real.generation_config["eos_token_id"] == list(GEMMA3.stop_token_ids)
    assert tiny._SPECIALS[GEMMA3.end_of_turn_id] == GEMMA3.end_of_turn_token == gemma_chat.END_OF_TURN
    assert tiny._SPECIALS[2] == "<bos>" and gemma_chat.BOS_ID == 2


def test_layer_patterns():
    assert GEMMA3.layer_types(7) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert GEMMA4.layer_types(12) == GEMMA3.layer_types(12)
    assert GEMMA3.layer_types(12).count("full_attention") == 2


def test_serving_facts_come_from_the_registry():
    from serving.config import vllm_families

    served = vllm_families()
    assert {a: f.name for a, f in served.items()} == {
        "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
        "Gemma4ForCausalLM": "gemma4", "Gemma4ForConditionalGeneration": "gemma4"}
    assert (GEMMA3.vllm_tool_parser, GEMMA4.vllm_tool_parser) == ("functiongemma", "gemma4")


def test_chat_markup():
    assert gemma_chat.turn(gemma_chat.USER, "hi") == "<start_of_turn>user\nhi<end_of_turn>\n"
    assert gemma_chat.open_turn(gemma_chat.MODEL) + "ok" + gemma_chat.close_turn() == \
        gemma_chat.turn(gemma_chat.MODEL, "ok")


def test_end_of_turn_id_is_the_tokenizers(tmp_path):
    """The recorded id (serving checks a directory without loading its tokenizer) is the one
    generation looks up in the tokenizer."""
    from transformers import AutoTokenizer

    from gemma_tpu.assets import embedded
    from gemma_tpu.assets.tiny import _write_small_tokenizer
    from gemma_tpu.infer.generate import _token_id

    _write_small_tokenizer(tmp_path, 512)
    toks = [AutoTokenizer.from_pretrained(str(tmp_path))]
    real = embedded.target_dir("gemma3-270m")
    if embedded.is_complete(real):
        toks.append(AutoTokenizer.from_pretrained(str(real)))
    for tok in toks:
        assert _token_id(tok, GEMMA3.end_of_turn_token) == GEMMA3.end_of_turn_id
        assert _token_id(tok, GEMMA4.end_of_turn_token) is None  # not a Gemma 4 vocabulary
        assert tok.eos_token_id in GEMMA3.stop_token_ids


def test_plain_token_map_is_what_a_plain_gemma3_vocabulary_gets():
    from transformers import AutoTokenizer

    from gemma_tpu.assets import embedded

    plain = fc.plain_gemma_token_map()
    assert list(plain) == list(fc.FUNCTION_MARKERS)
    assert list(plain.values()) == [f"<unused{i}>" for i in range(len(fc.FUNCTION_MARKERS))]
    real = embedded.target_dir("gemma3-270m")
    if not embedded.is_complete(real):
        pytest.skip("the embedded Gemma 3 270M is not prepared")
    assert fc.function_token_map(AutoTokenizer.from_pretrained(str(real))) == plain

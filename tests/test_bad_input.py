"""Malformed input for every entry point: one `error:` line naming the file / line / key, a non-zero
exit, no traceback, and nothing written or changed.

The corpus is `CASES` below (one entry a case: id, entry point, argv, files to create, needles) with
the bigger fixtures (dataset files, YAML configs, broken model dirs, checkpoint metadata) under
`tests/bad_inputs/`. Placeholders in argv, file contents and needles: {tmp} (the case's own
directory, also its working directory), {tiny} (a tiny HF model dir), {ckpt} (a tiny trained LoRA
checkpoint), {repo}, {port} (a port nobody listens on). A `files` key ending in "/" is an empty directory.

Most cases call the entry point's `main` through `cli_main` in this process (what `python -m` does,
without 3-6 s of imports each); `sub=True` cases run the real `python -m` (at least one per entry
point). Every case snapshots size and mtime of everything under its directory, the shared model and
checkpoint, and the repository, before and after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import REPO, assert_one_line_error, run_cli

DATA = Path(__file__).resolve().parent / "bad_inputs"
CHAT = REPO / "tests" / "data" / "chat_sample.jsonl"

# train: the tiny config with absolute paths and no eval; cases append their own overrides
TRAIN = ["--config", "{repo}/configs/tiny.yaml", "model.path={tiny}", f"data.train_path={CHAT}",
         "data.eval_path=null", "checkpoint.dir={tmp}/ck"]
MISSING_SHARD_INDEX = (DATA / "index_missing_shard.json").read_text()  # names a shard that is not there
LAUNCH = ["--print", "--config", "{repo}/configs/serve-gemma3-270m-fitness.yaml"]


@dataclasses.dataclass
class Case:
    id: str
    entry: str  # the module run as `python -m`
    argv: list[str]
    needles: list[str]
    files: dict[str, str | bytes | Callable[[Path, dict], None]] = dataclasses.field(default_factory=dict)
    sub: bool = False  # run as a real subprocess

    def __str__(self) -> str:
        return self.id


# --------------------------------------------------------------------------- file builders


def fill(text: str, ctx: dict) -> str:
    for key, value in ctx.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def copy_of(src_key: str, drop: tuple[str, ...] = (), config: dict | None = None, meta: dict | None = None,
            write: dict[str, str | bytes] | None = None) -> Callable[[Path, dict], None]:
    """A copy of the tiny model ({tiny}) or checkpoint ({ckpt}) with files dropped, config.json /
    gemma_tpu_run.json keys replaced and files (over)written."""

    def make(dest: Path, ctx: dict) -> None:
        shutil.copytree(ctx[src_key], dest)
        for name in drop:
            p = dest / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        for fname, changes in (("config.json", config), ("gemma_tpu_run.json", meta)):
            if changes:
                obj = json.loads((dest / fname).read_text())
                for dotted, value in changes.items():
                    node = obj
                    *head, last = dotted.split(".")
                    for part in head:
                        node = node[part]
                    node[last] = value
                (dest / fname).write_text(json.dumps(obj))
        for name, content in (write or {}).items():
            (dest / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    return make


def tiny_model(**overrides) -> Callable[[Path, dict], None]:
    """A tiny Gemma 3 of another shape, written by transformers (`write_tiny_gemma3`)."""

    def make(dest: Path, ctx: dict) -> None:
        from gemma_tpu.assets.tiny import write_tiny_gemma3

        write_tiny_gemma3(dest, seed=0, **overrides)

    return make


def small_vocab_with_tiny_tokenizer(dest: Path, ctx: dict) -> None:
    """A 150-token tiny model carrying {tiny}'s 512-token tokenizer (another model's)."""
    tiny_model(vocab_size=150)(dest, ctx)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(ctx["tiny"]) / name, dest / name)


def parquet(rows: list[dict]) -> Callable[[Path, dict], None]:
    def make(dest: Path, ctx: dict) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), dest)

    return make


def from_corpus(name: str) -> Callable[[Path, dict], None]:
    """A file of tests/bad_inputs/, placeholders filled in."""

    def make(dest: Path, ctx: dict) -> None:
        raw = (DATA / name).read_bytes()
        try:
            dest.write_text(fill(raw.decode(), ctx))
        except UnicodeDecodeError:  # deliberately not UTF-8: copied as is
            dest.write_bytes(raw)

    return make


def corrupt_header() -> bytes:
    """A safetensors file whose JSON header is cut off."""
    header = b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 4], "data_offs'
    return len(header).to_bytes(8, "little") + header


def misshapen(key: str) -> Callable[[Path, dict], None]:
    """A copy of the tiny model ({tiny}) whose tensor `key` lost its last row (config.json unchanged)."""

    def make(dest: Path, ctx: dict) -> None:
        from safetensors.numpy import load_file, save_file

        copy_of("tiny")(dest, ctx)
        weights = load_file(str(dest / "model.safetensors"))
        weights[key] = weights[key][:-1].copy()
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})

    return make


def integer_weights(key: str) -> Callable[[Path, dict], None]:
    """A copy of the tiny model ({tiny}) whose tensor `key` is stored as int8, as a quantized checkpoint stores it."""

    def make(dest: Path, ctx: dict) -> None:
        import numpy as np
        from safetensors.numpy import load_file, save_file

        copy_of("tiny")(dest, ctx)
        weights = load_file(str(dest / "model.safetensors"))
        weights[key] = np.clip(np.round(weights[key] * 1000), -127, 127).astype(np.int8)
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})

    return make


def nonfinite_factor(step_tensor: str = "layers.0.attn.q_einsum.w_lora_b") -> Callable[[Path, dict], None]:
    """A copy of the checkpoint ({ckpt}) whose LoRA factor `step_tensor` holds a NaN (what a run with
    train.learning_rate=nan used to save)."""

    def make(dest: Path, ctx: dict) -> None:
        import numpy as np
        import orbax.checkpoint as ocp

        from gemma_tpu.checkpoint.metadata import list_steps

        shutil.copytree(ctx["ckpt"], dest)
        item = dest.resolve() / str(list_steps(dest)[-1]) / "model_params"
        ckptr = ocp.PyTreeCheckpointer()
        tree = ckptr.restore(item)
        node = tree
        for k in step_tensor.split("."):
            node = node[k]
        node["value"] = np.asarray(node["value"]).copy()
        node["value"].flat[3] = np.nan
        shutil.rmtree(item)
        ckptr.save(item, tree)

    return make


def without_tensor(name: str) -> Callable[[Path, dict], None]:
    """A copy of {tiny} whose model.safetensors lacks the tensor `name` (a conversion that dropped one)."""

    def make(dest: Path, ctx: dict) -> None:
        from safetensors.numpy import load_file, save_file

        shutil.copytree(ctx["tiny"], dest)
        tensors = load_file(dest / "model.safetensors")
        del tensors[name]
        save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})

    return make


def other_base(dest: Path, ctx: dict) -> None:
    """A tiny Gemma 3 of the same shapes as {tiny} with other weights (a base replaced after training)."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    write_tiny_gemma3(dest, seed=1)


def ckpt_pointing_to(base: str) -> Callable[[Path, dict], None]:
    """A copy of the checkpoint whose recorded base directory is `base` (placeholders filled)."""

    def make(dest: Path, ctx: dict) -> None:
        copy_of("ckpt", meta={"base_model.local_dir": fill(base, ctx)})(dest, ctx)

    return make


def damaged(src_key: str, remove: str = "", truncate: tuple[str, int] | None = None) -> Callable[[Path, dict], None]:
    """A copy of {tiny} / {ckpt} with the files matching the glob `remove` deleted (directories kept) or
    every file matching the glob `truncate[0]` cut short by `truncate[1]` bytes (a negative count: cut to its
    first -N bytes). Every match, not one: an OCDBT `d/` directory also holds superseded B-tree nodes that
    nothing reads, and cutting only one of those leaves a sound checkpoint."""

    def make(dest: Path, ctx: dict) -> None:
        shutil.copytree(ctx[src_key], dest)
        for p in dest.glob(remove) if remove else []:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if truncate:
            for p in sorted(dest.glob(truncate[0])):
                size = p.stat().st_size
                os.truncate(p, size - truncate[1] if truncate[1] >= 0 else min(size, -truncate[1]))

    return make


# ----------------------------------------------------------------------------------- corpus

CASES = [
    # ---- datasets (through training, which validates every example before writing anything)
    Case("data-bad-json-line", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/bad.jsonl"],
         ["{tmp}/bad.jsonl:2", "not valid JSON"], {"bad.jsonl": from_corpus("bad_json_line.jsonl")}, sub=True),
    # Python's JSON reader recurses per level: a RecursionError traceback, in JSON Lines and in a .json array
    Case("data-nested-too-deep", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "nested more than"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                     + "[" * 100_000 + "]" * 100_000 + "\n"}),
    Case("data-nested-too-deep-in-an-array", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.json"],
         ["{tmp}/d.json:3", "nested more than"],
         {"d.json": '[{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},\n\n'
                    + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}]\n"}),
    # what Python's JSON reader accepts silently: the first of two "content" keys dropped, NaN read as a number
    Case("data-duplicate-key", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "key 'content' appears twice"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                     '{"messages": [{"role": "user", "content": "hi", "content": "ho"}, {"role": "assistant", '
                     '"content": "x"}]}\n'}),
    Case("data-nan-literal", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.json"],
         ["{tmp}/d.json:2", "NaN is not JSON"],
         {"d.json": '[{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},\n'
                    '{"messages": [{"role": "user", "content": NaN}, {"role": "assistant", "content": "x"}]}]\n'}),
    # an integer of more digits than Python converts (4,300): a ValueError traceback out of the JSON reader
    Case("data-integer-past-python-digits", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "a number of 5001 digits (Python reads integers of at most 4300)"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                     '{"id": 1' + "0" * 5000 + ', "messages": [{"role": "user", "content": "hi"}, {"role": '
                     '"assistant", "content": "x"}]}\n'}),
    # ... and inside JSON kept as a string (tool-call arguments): NaN trained as `{x:NaN}`, a lone surrogate a
    # TypeError traceback from the tokenizer
    Case("data-nan-in-string-arguments", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "messages[3]: 'tool_calls[0].function.arguments' (a JSON string): NaN is not JSON"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "messages": '
                     '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", '
                     '"content": "f?"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
                     '"function": {"name": "f", "arguments": "{\\"x\\": NaN}"}}]}]}\n'}),
    Case("data-inspect-lone-surrogate-in-string-arguments", "gemma_tpu.data.inspect",
         [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "tool_calls[0].function.arguments.x holds a lone UTF-16 surrogate"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "messages": '
                     '[{"role": "user", "content": "f?"}, {"role": "assistant", "tool_calls": [{"type": "function", '
                     '"function": {"name": "f", "arguments": "{\\"x\\": \\"\\\\ud800\\"}"}}]}]}\n'}),
    Case("data-unknown-role", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "'wizard'"], {"d.jsonl": from_corpus("unknown_role.jsonl")}),
    Case("data-no-messages", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "'messages'"], {"d.jsonl": from_corpus("no_messages.jsonl")}),
    Case("data-undeclared-tool", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "'get_weather'", "not in 'tools'"], {"d.jsonl": from_corpus("undeclared_tool.jsonl")}),
    # declarations the renderer took as they came: both of a name declared twice, a schema written as a string
    Case("data-tool-declared-twice", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "tools[1].function.name: 'get_steps' is declared twice (also tools[0])"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n{"tools": [{"type": "function", "function": {"name": "get_steps", "description": "Steps.", "parameters": {}}}, {"type": "function", "function": {"name": "get_steps", "description": "Steps.", "parameters": {}}}], "messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": {}}}]}]}\n'}),
    Case("data-tool-parameters-not-a-schema", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "tools[0].function.parameters: expected a JSON Schema object", "[1, 2]"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "get_steps", "description": "Steps.", "parameters": "[1, 2]"}}], "messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": {}}}]}]}\n'}),
    # a declared parameter no call can pass (its name is not a key the call text carries), a required one not declared
    Case("data-tool-property-name-with-colon", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "tools[0].function.parameters.properties: property name 'time:zone' cannot be written"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "get_steps", "parameters": {"type": '
                     '"object", "properties": {"time:zone": {"type": "string"}}}}}], "messages": [{"role": "user", '
                     '"content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", '
                     '"function": {"name": "get_steps", "arguments": {}}}]}]}\n'}),
    Case("data-tool-required-undeclared", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "tools[0].function.parameters.required[0]: 'dat' is not a declared property"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "get_steps", "parameters": {"type": '
                     '"object", "properties": {"date": {"type": "string"}}, "required": ["dat"]}}}], "messages": '
                     '[{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": '
                     '[{"type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}}]}]}\n'}),
    # what FunctionGemma's call text cannot carry: trained as text that parses back to another call
    Case("data-call-key-with-colon", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "call 'get_steps' arguments", "key 'time:zone'"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n{"tools": [{"type": "function", "function": {"name": "get_steps", "description": "Steps.", "parameters": {"type": "object", "properties": {}}}}], "messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": {"time:zone": "UTC"}}}]}]}\n'}),
    Case("data-call-value-with-escape", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "arguments.q", "<escape>"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "get_steps", "description": "Steps.", "parameters": {"type": "object", "properties": {}}}}], "messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": {"q": "a<escape>b"}}}]}]}\n'}),
    # `call:get steps{...}` parses back as no call at all: the model was trained on calls it cannot make
    Case("data-tool-name-not-writable", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:1", "tools[0].function.name: 'get steps' is not a tool name"],
         {"d.jsonl": '{"tools": [{"type": "function", "function": {"name": "get steps", "description": "Steps.", "parameters": {"type": "object", "properties": {}}}}], "messages": [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get steps", "arguments": {}}}]}]}\n'}),
    Case("data-unmatched-tool-call-id", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "messages[2]", "'call_9'", "matches no call", "'call_1'"],
         {"d.jsonl": from_corpus("unmatched_tool_call_id.jsonl")}),
    Case("data-inspect-unmatched-tool-call-id", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "'call_9'"], {"d.jsonl": from_corpus("unmatched_tool_call_id.jsonl")}),
    Case("data-two-user-turns", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "messages[1]", "two user turns in a row"],
         {"d.jsonl": from_corpus("two_user_turns.jsonl")}),
    Case("data-lone-surrogate", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "messages[1].content", "lone UTF-16 surrogate", "\\udc00"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                     '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\\udc00"}]}\n'}),
    Case("data-not-utf8", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl:2", "UTF-8"], {"d.jsonl": from_corpus("latin1.jsonl")}),
    # another compression than gzip, or UTF-16 without its byte-order mark: "not UTF-8 text (byte 2 of the line)" and
    # "NUL bytes, as a file cut short by a crash", not what the file is
    Case("data-zstd-compressed", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl: a zstd-compressed file; only gzip is read"], {"d.jsonl": b"\x28\xb5\x2f\xfd" + bytes(20)}),
    Case("data-utf16-without-bom", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/d.jsonl"],
         ["{tmp}/d.jsonl: UTF-16 text", "save it as UTF-8"],
         {"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'.encode("utf-16-le")}),
    Case("data-empty-file", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/empty.jsonl"],
         ["{tmp}/empty.jsonl", "empty"], {"empty.jsonl": ""}),
    Case("data-parquet-wrong-columns", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/d.parquet"],
         ["{tmp}/d.parquet:1", "'messages'"], {"d.parquet": parquet([{"question": "q", "answer": "a"}])}),
    Case("data-instruction-missing-field", "gemma_tpu.train",
         [*TRAIN, "data.train_path={tmp}/d.jsonl", "data.format=instruction"],
         ["{tmp}/d.jsonl:2", "'response'"], {"d.jsonl": from_corpus("instruction_missing_response.jsonl")}),
    Case("data-missing-file", "gemma_tpu.train", [*TRAIN, "data.train_path={tmp}/nope.jsonl"],
         ["{tmp}/nope.jsonl"]),
    # a glob, as datasets' data_files takes: "not found", with the files it matches in plain sight
    Case("data-path-a-pattern", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/parts/*.jsonl"],
         ["data file not found: {tmp}/parts/*.jsonl (a pattern matching 2 files, e.g. {tmp}/parts/a.jsonl",
          "patterns are not expanded"],
         {"parts/a.jsonl": CHAT.read_text(), "parts/b.jsonl": CHAT.read_text()}),
    # several files, comma-separated or as a YAML list: "not found" / "expected a string" said nothing of one file
    Case("data-path-comma-list", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/a.jsonl,{tmp}/b.jsonl"],
         ["data file not found: {tmp}/a.jsonl,{tmp}/b.jsonl (a comma-separated list of 2 files; a single file is read: "
          "concatenate them into one, e.g. cat {tmp}/a.jsonl {tmp}/b.jsonl > all.jsonl)"],
         {"a.jsonl": CHAT.read_text(), "b.jsonl": CHAT.read_text()}),
    # what a TRL recipe gives load_dataset: a hub dataset id, or a URL; both were "not found ... a relative path is read
    # from the working directory", as if a file of that name were missing there
    Case("data-path-a-hub-dataset-id", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path=trl-lib/Capybara"],
         ["data file not found: trl-lib/Capybara (no such file here; a Hugging Face Hub dataset id is not downloaded: "
          "datasets.load_dataset('trl-lib/Capybara', split='train').to_json('train.jsonl')"]),
    Case("data-path-a-url", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path=https://example.org/d/train.jsonl"],
         ["data file not found: https://example.org/d/train.jsonl (a URL; data files are read from this machine's "
          "disk: download it first) (data.train_path)"]),
    Case("data-path-yaml-list", "gemma_tpu.data.inspect", [*TRAIN, "data.eval_path=[{tmp}/a.jsonl,{tmp}/b.jsonl]"],
         ["data.eval_path: expected a string, got [", "(a single file is read: concatenate the files into one)"],
         {"a.jsonl": CHAT.read_text(), "b.jsonl": CHAT.read_text()}),
    Case("data-bad-eval-file", "gemma_tpu.train", [*TRAIN, "data.eval_path={tmp}/eval.jsonl"],
         ["{tmp}/eval.jsonl:1", "no assistant message"], {"eval.jsonl": from_corpus("no_assistant.jsonl")}),
    # fewer rows than one batch: inspect and the dry run exited 0, training refused it only once the model had
    # loaded, naming no key; all three now refuse it the same way
    Case("data-fewer-rows-than-a-batch", "gemma_tpu.train", [*TRAIN, "train.batch_size=100"],
         [f"data.train_path={CHAT}: ", "rows (from 64 examples, data.strategy=pad)", "train.batch_size=100"]),
    Case("dry-run-fewer-rows-than-a-batch", "gemma_tpu.train", [*TRAIN, "--dry-run", "--no-compile",
                                                                "train.batch_size=100"],
         [f"data.train_path={CHAT}: ", "rows (from 64 examples", "fewer than one batch of train.batch_size=100"]),
    Case("data-inspect-fewer-rows-than-a-batch", "gemma_tpu.data.inspect", [*TRAIN, "train.batch_size=100", "-n", "0"],
         [f"data.train_path={CHAT}: ", "rows (from 64 examples", "fewer than one batch of train.batch_size=100"]),
    Case("data-inspect-packed-rows-fewer-than-a-batch", "gemma_tpu.data.inspect",
         [*TRAIN, "data.strategy=pack", "train.batch_size=64", "-n", "0"],
         [f"data.train_path={CHAT}", "from 64 examples, data.strategy=pack", "train.batch_size=64",
          "set data.strategy=pad and data.share_prefix=off (one example a row)"]),
    Case("data-inspect-bad-split", "gemma_tpu.data.inspect", [*TRAIN, "--split", "test"], ["--split", "'test'"]),
    Case("data-inspect-bad-line", "gemma_tpu.data.inspect", [*TRAIN, "data.train_path={tmp}/bad.jsonl"],
         ["{tmp}/bad.jsonl:2"], {"bad.jsonl": from_corpus("bad_json_line.jsonl")}, sub=True),
    # ---- run configs
    # a bucket URL was taken for a local path: `checkpoint.dir=gs://b/run` trained into a directory named `gs:` in
    # the working directory and failed at the first save; `--out s3://...` and `--checkpoint gs://...` the same way
    Case("config-checkpoint-dir-url", "gemma_tpu.train", [*TRAIN, "checkpoint.dir=gs://bucket/run"],
         ["checkpoint.dir='gs://bucket/run': a URL", "gcsfuse"]),
    Case("config-model-path-url", "gemma_tpu.train", [*TRAIN, "model.path=gs://bucket/gemma"],
         ["model.path gs://bucket/gemma: a URL", "gcsfuse"]),
    Case("merge-out-url", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "s3://bucket/merged"],
         ["--out", "'s3://bucket/merged' is a URL", "written on this machine"]),
    Case("export-checkpoint-url", "convert.export_peft", ["--checkpoint", "gs://bucket/run", "--out", "{tmp}/a"],
         ["--checkpoint", "'gs://bucket/run' is a URL", "read from this machine's disk"]),
    Case("config-unknown-key", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"], ["{tmp}/c.yaml", "train.max_step"],
         {"c.yaml": from_corpus("unknown_key.yaml")}, sub=True),
    Case("config-wrong-type", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"],
         ["{tmp}/c.yaml", "train.batch_size", "'four'"], {"c.yaml": from_corpus("wrong_type.yaml")}),
    Case("config-bad-enum", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "data.strategy=zip"],
         ["data.strategy", "'zip'"]),
    Case("config-negative-steps", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "train.max_steps=-3"],
         ["train.max_steps", "-3"]),
    # trained, then an OverflowError traceback from the ETA of the first progress line
    Case("config-steps-beyond-int32", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "train.max_steps=99999999999999999999"],
         ["train.max_steps", "at most 2147483647"]),
    # the second --config replaced the first without a word
    Case("config-given-twice", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--config", "{repo}/configs/gemma3-270m-fitness.yaml", "--print-config"],
         ["--config given twice", "configs/tiny.yaml", "overrides"]),
    # `--config "$CFG"` with CFG unset: the config printed (and evaluate ran) was the defaults, without a word
    Case("config-empty-path", "gemma_tpu.train", ["--config", "", "--print-config"],
         ["--config is empty (an unset variable?); give a YAML config file"]),
    Case("config-empty-path-evaluate", "gemma_tpu.evaluate", ["--config", " ", "--data", str(CHAT)],
         ["--config is empty (an unset variable?)"]),
    Case("config-yaml-syntax", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"], ["{tmp}/c.yaml line 3", "YAML"],
         {"c.yaml": from_corpus("syntax_error.yaml")}),
    Case("config-not-a-mapping", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"], ["{tmp}/c.yaml", "mapping"],
         {"c.yaml": "- model\n- train\n"}),
    Case("config-duplicate-section", "gemma_tpu.train", ["--config", "{tmp}/c.yaml", "--print-config"],
         ["{tmp}/c.yaml line 3", "'train' appears twice", "line 1"],
         {"c.yaml": "train:\n  max_steps: 3\ntrain:\n  batch_size: 2\n"}),  # max_steps silently back to 100
    Case("config-duplicate-key-in-flow", "gemma_tpu.train", ["--config", "{tmp}/c.yaml", "--print-config"],
         ["{tmp}/c.yaml line 1", "'max_steps' appears twice"], {"c.yaml": "train: {max_steps: 3, max_steps: 4}\n"}),
    Case("config-not-utf8", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"], ["{tmp}/c.yaml", "not UTF-8"],
         {"c.yaml": b"# caf\xe9\ntrain: {max_steps: 3}\n"}),
    Case("config-missing-file", "gemma_tpu.train", ["--config", "{tmp}/nope.yaml"], ["{tmp}/nope.yaml"]),
    Case("config-override-without-value", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "train.max_steps"],
         ["'train.max_steps'", "section.key=value"]),
    # the same through --set (it was refused as an unrecognized argument, not as the empty value it is)
    Case("config-set-override-without-value", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--set", "train.max_steps="],
         ["override 'train.max_steps=': train.max_steps: expected an integer, got ''"]),
    Case("config-override-through-scalar", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "train.max_steps.x=1"], ["train.max_steps.x"]),
    Case("train-unknown-option", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "--stpes", "3"],
         ["--stpes"]),
    # another trainer's flags for our config keys are told the override that sets them (they were unrecognized only)
    Case("train-config-key-as-options", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--max-steps", "3", "--learning_rate=1e-4", "--lora_r", "8"],
         ["--max-steps 3: config keys are set by overrides, not options: write train.max_steps=3"]),
    Case("launch-config-key-as-option", "serving.launch", [*LAUNCH, "--port=8001"],
         ["--port=8001: config keys are set by overrides, not options: write server.port=8001"]),
    # evaluate reads data.* and model.dtype: a key it reads is named, a training key is not (it would change nothing)
    Case("evaluate-config-key-as-option", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--model", "{tiny}", "--max-steps", "3", "--seq-len=512"],
         ["--seq-len=512: config keys are set by overrides, not options: write data.seq_len=512"]),
    Case("train-config-without-option", "gemma_tpu.train", ["{repo}/configs/tiny.yaml"],
         ["--config FILE is required: give it as --config {repo}/configs/tiny.yaml"]),
    Case("plan-no-config", "gemma_tpu.plan", [], ["--config"]),
    Case("config-nan-learning-rate", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "train.learning_rate=nan"],
         ["train.learning_rate", "finite", "'nan'"]),
    # YAML 1.1 readings no user means: octal 010 (seed 8), a bare ~ for a path (null: metrics under checkpoint.dir)
    Case("config-octal-seed", "gemma_tpu.train", [*TRAIN, "train.seed=010"],
         ["override 'train.seed=010'", "octal to YAML 1.1 (8)"]),
    Case("config-tilde-run-dir", "gemma_tpu.train", [*TRAIN, "train.run_dir=~"],
         ["override 'train.run_dir=~'", "a bare ~ is null to YAML, not the home directory"]),
    # a variable nothing expands (quoted for the shell, or in the YAML file): a directory named '$GEMMA_TPU_UNSET'
    Case("config-unset-variable-in-a-path", "gemma_tpu.train", [*TRAIN, "checkpoint.dir=$GEMMA_TPU_UNSET/ck"],
         ["override 'checkpoint.dir=$GEMMA_TPU_UNSET/ck'", "environment variable GEMMA_TPU_UNSET, which is not set"]),
    Case("config-inf-in-yaml", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"], ["{tmp}/c.yaml", "train.grad_clip", "finite"],
         {"c.yaml": "train:\n  grad_clip: .inf\n"}),
    # ... and in YAML (PyYAML's int()): a ValueError traceback, not the key
    Case("config-integer-past-python-digits", "gemma_tpu.train", ["--config", "{tmp}/c.yaml"],
         ["{tmp}/c.yaml line 2", "train.max_steps", "too large for an integer"],
         {"c.yaml": "train:\n  max_steps: 1" + "0" * 5000 + "\n"}),
    Case("config-zero-learning-rate", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "train.learning_rate=0"],
         ["train.learning_rate", "positive"]),
    Case("config-negative-weight-decay", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml",
                                                              "train.weight_decay=-0.1"], ["train.weight_decay", "-0.1"]),
    Case("config-dropout-one", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "lora.dropout=1"],
         ["override 'lora.dropout=1': ", "lora.dropout", "1.0"]),
    Case("config-qlora-without-lora", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "lora.enabled=false",
                                                          "lora.base_quantization=nf4"],
         ["lora.base_quantization=nf4 needs lora.enabled=true"]),
    Case("config-unknown-override-key", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "train.max_step=3"],
         ["override 'train.max_step=3': unknown config key 'train.max_step'", "max_steps"]),
    Case("config-rank-beyond-model", "gemma_tpu.train", [*TRAIN, "lora.rank=64"], ["{tiny}", "lora.rank=64", "(32)"]),
    # 'unknown model family' did not say which setting held it
    Case("config-unknown-family", "gemma_tpu.train", [*TRAIN, "model.family=gemma9"],
         ["model.family: unknown model family 'gemma9'", "gemma3", "leave it unset"]),
    Case("data-inspect-unknown-family", "gemma_tpu.data.inspect", [*TRAIN, "model.family=gemma9"],
         ["model.family: unknown model family 'gemma9'"]),
    # an eval_path unset by an override was reported 'not set in configs/tiny.yaml', where it is set (an empty one,
    # `data.eval_path=`, is refused when the config loads: tests/test_config.py)
    Case("data-inspect-eval-path-emptied", "gemma_tpu.data.inspect", [*TRAIN, "--split", "eval", "data.eval_path=null"],
         ["data.eval_path is not set (in {repo}/configs/tiny.yaml or as data.eval_path=FILE)"]),
    Case("config-seq-len-beyond-model", "gemma_tpu.train", [*TRAIN, "data.seq_len=4096"],
         ["data.seq_len=4096", "max_position_embeddings=1024"]),
    # inspect laid out batches of a seq_len training refuses (and a huge one was a numpy MemoryError traceback)
    Case("data-inspect-seq-len-beyond-model", "gemma_tpu.data.inspect", [*TRAIN, "data.seq_len=4096", "-n", "0"],
         ["data.seq_len=4096 exceeds the model's max_position_embeddings=1024"]),
    Case("config-unknown-lora-target", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "lora.targets=[q_proj,qkv_proj]"], ["lora.targets", "'qkv_proj'"]),
    Case("config-bool-not-bool", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "lora.enabled=maybe"],
         ["lora.enabled", "'maybe'"]),
    # a string key given a bare yes/no/on/off (YAML: a boolean) said 'expected a string, got True', not why
    Case("config-yaml-boolean-for-a-string", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--print-config", "model.path=yes"],
         ["override 'model.path=yes': model.path: expected a string, got True", "YAML reads a bare yes/no",
          "quote it"]),
    # a whole section set to null went silently back to its defaults (tiny.yaml's max_steps 6 -> 100)
    Case("config-section-null", "gemma_tpu.train", ["--config", "{repo}/configs/tiny.yaml", "--print-config",
                                                    "train=null"],
         ["override 'train=null': a section takes a mapping", "train={key: value}"]),
    # two axes taking "the rest" were refused only when the mesh was built, naming no key
    Case("config-two-mesh-axes-fill", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--print-config", "mesh.data=-1", "mesh.fsdp=-1"],
         ["override 'mesh.fsdp=-1': mesh.data and mesh.fsdp are both -1", "at most one axis"]),
    # not host:port: accepted, then jax.distributed failed (or hung) at start-up
    Case("config-coordinator-no-port", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--print-config", "mesh.coordinator_address=10.0.0.2"],
         ["override 'mesh.coordinator_address=10.0.0.2'", "host:port", "'10.0.0.2'"]),
    Case("config-coordinator-port-out-of-range", "gemma_tpu.train",
         ["--config", "{repo}/configs/tiny.yaml", "--print-config", "mesh.coordinator_address=h:70000"],
         ["mesh.coordinator_address must be host:port with a port in 1..65535", "'h:70000'"]),
    # the dry run plans a mesh axis of -1 for the local devices (one here): the error did not say how to plan
    # for the machine the run is meant for, nor name the key
    Case("dry-run-mesh-needs-more-devices", "gemma_tpu.train", [*TRAIN, "--dry-run", "--no-compile", "mesh.dcn_data=3"],
         ["mesh.dcn_data=3", "local device(s)", "--devices N"]),
    Case("plan-unknown-key", "gemma_tpu.plan", ["--config", "{repo}/configs/tiny.yaml", "mesh.tpu=4"], ["mesh.tpu"],
         sub=True),
    # ---- base model directories
    Case("model-no-config-json", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"], ["{tmp}/m/config.json"],
         {"m": copy_of("tiny", drop=("config.json",))}),
    Case("model-config-not-json", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/config.json", "not valid JSON"], {"m": copy_of("tiny", write={"config.json": "{\"model_type\": "})}),
    Case("model-unsupported-architecture", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/config.json", "LlamaForCausalLM"],
         {"m": copy_of("tiny", config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})}),
    Case("model-missing-shard", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["model-00002-of-00002.safetensors", "missing"],
         {"m": copy_of("tiny", write={"model.safetensors.index.json": MISSING_SHARD_INDEX})}),
    Case("model-corrupt-safetensors", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/model.safetensors"], {"m": copy_of("tiny", write={"model.safetensors": corrupt_header()})}),
    # said before the data is read (minutes for a large set), by the run and its dry run alike: the data file is
    # missing too (the data's error came first, and the dry run planned such a model with exit 0)
    *[Case(f"model-{what}-checked-before-the-data{'-dry-run' if dry else ''}", "gemma_tpu.train",
           [*TRAIN, "model.path={tmp}/m", "data.train_path={tmp}/none.jsonl", *(["--dry-run", "--no-compile"] * dry)],
           needles, {"m": make})
      for what, needles, make in [
          ("missing-shard", ["{tmp}/m/model.safetensors.index.json", "model-00002-of-00002.safetensors is missing"],
           copy_of("tiny", write={"model.safetensors.index.json": MISSING_SHARD_INDEX})),
          ("corrupt-safetensors", ["{tmp}/m/model.safetensors", "safetensors"],
           copy_of("tiny", write={"model.safetensors": corrupt_header()})),
          ("misshapen-tensor", ["{tmp}/m/model.safetensors", "model.layers.1.mlp.up_proj.weight has shape [127, 64]",
                                "config.json implies [128, 64]"], misshapen("model.layers.1.mlp.up_proj.weight")),
          # a bitsandbytes int8 checkpoint's weights (same shapes, scales elsewhere) were cast to float and trained on
          ("integer-weights", ["{tmp}/m", "model.layers.0.self_attn.q_proj.weight' is I8, not floating point"],
           integer_weights("model.layers.0.self_attn.q_proj.weight")),
      ] for dry in (False, True)],
    Case("model-no-tokenizer", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"], ["{tmp}/m", "tokenizer"],
         {"m": copy_of("tiny", drop=("tokenizer.json", "tokenizer_config.json"))}),
    Case("model-no-such-dir", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/nope"], ["{tmp}/nope"]),
    # config.json keys Tunix's Gemma 3 cannot express (each loaded silently with other numbers before)
    Case("model-untied-embeddings", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "tie_word_embeddings=false"], {"m": copy_of("tiny", config={"tie_word_embeddings": False})}),
    Case("model-attention-bias", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "attention_bias=True"], {"m": copy_of("tiny", config={"attention_bias": True})}),
    # shapes transformers writes but cannot run either (a Tunix traceback before)
    Case("model-kv-heads-not-dividing", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "num_key_value_heads=4 must divide num_attention_heads=6"],
         {"m": tiny_model(hidden_size=48, num_attention_heads=6, num_key_value_heads=4, head_dim=8,
                          query_pre_attn_scalar=8)}),
    Case("model-odd-head-dim", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "head_dim=15 must be even"], {"m": tiny_model(head_dim=15, query_pre_attn_scalar=15)}),
    Case("model-sliding-window-pattern", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "sliding_window_pattern=2"],  # a transformers 4.x config: no layer_types
         {"m": copy_of("tiny", config={"layer_types": None, "sliding_window_pattern": 2})}),
    Case("model-layer-types", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],  # was 'layer_types is not supported'
         ["config.json", "layer_types[1]='full_attention' ('sliding_attention' expected) is not supported"],
         {"m": copy_of("tiny", config={"layer_types": ["sliding_attention", "full_attention"]})}),
    Case("model-sliding-window-null", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["config.json", "sliding_window=None"],  # read as 4096 before; transformers refuses it
         {"m": copy_of("tiny", config={"sliding_window": None})}),
    # a value of another type than transformers declares: int("4") trained it, transformers refuses the config
    Case("model-string-number", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/config.json: num_attention_heads='4' is not of type int"],  # the file named, not a bare config.json
         {"m": copy_of("tiny", config={"num_attention_heads": "4"})}),
    Case("model-string-number-dry-run", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m", "--dry-run"],
         ["{tmp}/m config.json: rms_norm_eps='1e-6' is not of type float"],
         {"m": copy_of("tiny", config={"rms_norm_eps": "1e-6"})}),
    # a tokenizer with ids past the model's embedding rows: XLA clamped them, the first loss was NaN
    Case("model-tokenizer-past-vocab", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         [f"{CHAT}:1", "token id", "past the model's vocabulary (vocab_size 150"], {"m": small_vocab_with_tiny_tokenizer}),
    # config.json's vocabulary is not the weights': said from the header, before the data is rendered
    Case("model-config-vocab-is-not-the-weights", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/model.safetensors", "model.embed_tokens.weight has shape [512, 64], config.json implies [150, 64]"],
         {"m": copy_of("tiny", config={"vocab_size": 150})}),
    # the dry run read only the training split: a broken evaluation file passed it with exit 0
    Case("dry-run-bad-eval-data", "gemma_tpu.train",
         [*TRAIN, "data.eval_path={tmp}/bad.jsonl", "--dry-run", "--no-compile"], ["{tmp}/bad.jsonl:2", "not valid JSON"],
         {"bad.jsonl": '{"prompt": "hi", "completion": "yo"}\n{"prompt": \n'}),
    # a missing evaluation file was found only after the training split was prepared (minutes for a large set)
    Case("train-missing-eval-file-named-before-the-train-data", "gemma_tpu.train",
         [*TRAIN, "data.train_path={tmp}/bad.jsonl", "data.eval_path={tmp}/none.jsonl"],
         ["data file not found: {tmp}/none.jsonl (data.eval_path)"], {"bad.jsonl": '{"prompt": \n'}),
    # ---- checkpoints
    Case("ckpt-empty-dir", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck", "gemma_tpu_run.json"], {"ck/": ""}, sub=True),
    Case("ckpt-steps-without-metadata", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck", "gemma_tpu_run.json"], {"ck": copy_of("ckpt", drop=("gemma_tpu_run.json",))}, sub=True),
    Case("ckpt-other-family", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "'llama'"], {"ck": copy_of("ckpt", meta={"base_model.family": "llama"})}),
    Case("ckpt-no-such-step", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--step", "99", "--out", "{tmp}/out"],
         ["{ckpt}", "step 99"]),
    Case("ckpt-corrupt-run-json", "convert.inspect", ["{tmp}/ck"], ["{tmp}/ck/gemma_tpu_run.json", "JSON"],
         {"ck": copy_of("ckpt", write={"gemma_tpu_run.json": '{"format": "gemma-tpu-checkpoint", '})}, sub=True),
    # a damaged or hand-edited gemma_tpu_run.json: AttributeError / TypeError tracebacks, or used as written (a
    # rank of 4.7 merged at alpha/4.7, an alpha of "nan" wrote a model of NaNs, "8" went into adapter_config.json)
    Case("ckpt-run-json-lora-not-an-object", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "lora=['x'] is not an object"], {"ck": copy_of("ckpt", meta={"lora": ["x"]})}),
    Case("ckpt-run-json-fractional-rank", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "lora.rank=4.7 is not a positive integer"],
         {"ck": copy_of("ckpt", meta={"lora.rank": 4.7})}),
    Case("ckpt-run-json-alpha-nan", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "lora.alpha='nan' is not a positive number"],
         {"ck": copy_of("ckpt", meta={"lora.alpha": "nan"})}),
    Case("ckpt-run-json-alpha-string", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "lora.alpha='8' is not a positive number"],
         {"ck": copy_of("ckpt", meta={"lora.alpha": "8"})}),
    # its entries read by name: a TypeError traceback in the merge, the export and a resume
    Case("ckpt-run-json-fingerprint-files-damaged", "convert.export_peft",
         ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "base_model.fingerprint.files=[1] is not a list of files"],
         {"ck": copy_of("ckpt", meta={"base_model.fingerprint.files": [1]})}),
    # the tool-call markers' tokens (marker -> token): an AttributeError traceback where the merge installs them
    Case("ckpt-run-json-token-map-string", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "token_map='x' is not an object of marker -> token names"],
         {"ck": copy_of("ckpt", meta={"token_map": "x"})}),
    # the adapter's lora_dropout: a string was a ValueError traceback, 2.5 went into adapter_config.json, which peft
    # then refuses to load (nn.Dropout takes a probability)
    Case("ckpt-run-json-dropout-string", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "config.lora.dropout='x' is not a number in [0, 1)"],
         {"ck": copy_of("ckpt", meta={"config.lora.dropout": "x"})}),
    Case("ckpt-run-json-dropout-past-one", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "config.lora.dropout=2.5 is not a number in [0, 1)"],
         {"ck": copy_of("ckpt", meta={"config.lora.dropout": 2.5})}),
    Case("ckpt-run-json-targets-string", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "lora.targets='q_proj' is not a list of names"],
         {"ck": copy_of("ckpt", meta={"lora.targets": "q_proj"})}),
    # a target no projection of the family has (the embeddings): the registry's message named lora.targets alone,
    # which read as the config's key
    *[Case(f"ckpt-run-json-target-not-a-projection-{tool}", tool, [*args, "--checkpoint", "{tmp}/ck"],
           ["{tmp}/ck/gemma_tpu_run.json: lora.targets: 'embed_tokens' is not a projection of family gemma3"],
           {"ck": copy_of("ckpt", meta={"lora.targets": ["q_proj", "embed_tokens"]})})
      for tool, args in (("convert.merge_orbax", ["--out", "{tmp}/out"]),
                         ("convert.export_peft", ["--out", "{tmp}/out"]),
                         ("gemma_tpu.evaluate", ["--data", f"{CHAT}"]))],
    # factors of more projections than the recorded targets: the PEFT export said "no place in the merge"
    Case("ckpt-run-json-fewer-targets-than-factors", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out",
                                                                            "{tmp}/out"],
         ["checkpoint tensor layers.0.attn.attn_vec_einsum.w_lora_a fits none of the recorded LoRA sites: its "
          "projection is not among lora.targets (q_proj) of {tmp}/ck/gemma_tpu_run.json"],
         {"ck": copy_of("ckpt", meta={"lora.targets": ["q_proj"]})}),
    Case("ckpt-run-json-base-model-string", "convert.inspect", ["{tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json", "base_model='x' is not an object"],
         {"ck": copy_of("ckpt", meta={"base_model": "x"})}),
    Case("ckpt-run-json-fingerprint-string", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "base_model.fingerprint='x' is not an object"],
         {"ck": copy_of("ckpt", meta={"base_model.fingerprint": "x"})}),
    # the recorded config.json copy is what is damaged: the error named the base's config.json
    Case("ckpt-run-json-hf-config-damaged", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json: hf_config", "num_hidden_layers='2' is not of type int"],
         {"ck": copy_of("ckpt", meta={"hf_config.num_hidden_layers": "2"})}),
    Case("ckpt-run-json-dtype-unknown", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--checkpoint", "{tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json", "dtype='fp16' is not float32 or bfloat16"],
         {"ck": copy_of("ckpt", meta={"dtype": "fp16"})}),
    Case("ckpt-foreign-format", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/gemma_tpu_run.json", "format"], {"ck": copy_of("ckpt", meta={"format": "something-else"})}),
    # a section of gemma_tpu_run.json null or a config value of another type: AttributeError / TypeError tracebacks
    Case("ckpt-resume-run-json-lora-null", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json: lora is null (no LoRA settings recorded) but step 1 holds LoRA factors"],
         {"ck": copy_of("ckpt", meta={"lora": None})}),
    Case("ckpt-resume-run-json-base-model-null", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck", "checkpoint was trained with base model=null"],
         {"ck": copy_of("ckpt", meta={"base_model": None})}),
    Case("ckpt-resume-run-json-accumulation-string", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json", "config.train holds a value of the wrong type"],
         {"ck": copy_of("ckpt", meta={"config.train.grad_accum_steps": "2"})}),
    Case("ckpt-resume-run-json-config-null", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json", "config is not a mapping"], {"ck": copy_of("ckpt", meta={"config": None})}),
    Case("ckpt-resume-run-json-train-null", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/gemma_tpu_run.json", "config.train is not a mapping"],
         {"ck": copy_of("ckpt", meta={"config.train": None})}),
    Case("ckpt-resume-other-family", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"], ["family", "gemma4"],
         {"ck": copy_of("ckpt", meta={"base_model.family": "gemma4"})}),
    # settings that change the optimizer state's tree: Orbax's restore failed after the model loaded, advising
    # to move the (sound) step aside
    Case("ckpt-resume-other-optimizer", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck", "train.optimizer=sgd"],
         ["{tmp}/ck", "train.optimizer=adamw", "sgd", "another checkpoint.dir"], {"ck": copy_of("ckpt")}),
    Case("ckpt-resume-clipping-turned-off", "gemma_tpu.train",
         [*TRAIN, "checkpoint.dir={tmp}/ck", "train.grad_clip=null"],
         ["{tmp}/ck", "train.grad_clip=1.0, this run has null"],
         {"ck": copy_of("ckpt")}),
    # resumed on an int8 base, and gemma_tpu_run.json then said the whole run was QLoRA
    Case("ckpt-resume-base-quantized", "gemma_tpu.train",
         [*TRAIN, "checkpoint.dir={tmp}/ck", "lora.base_quantization=int8"],
         ["{tmp}/ck", "lora.base_quantization=null, this run has int8"], {"ck": copy_of("ckpt")}),
    Case("ckpt-resume-accumulation-turned-on", "gemma_tpu.train",
         [*TRAIN, "checkpoint.dir={tmp}/ck", "train.grad_accum_steps=2"], ["{tmp}/ck", "train.grad_accum_steps=1", "2"],
         {"ck": copy_of("ckpt")}),
    Case("ckpt-resume-steps-without-metadata", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck", "gemma_tpu_run.json"], {"ck": copy_of("ckpt", drop=("gemma_tpu_run.json",))}),
    Case("merge-nonfinite-factor", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["layers.0.attn.q_einsum.w_lora_b", "non-finite"], {"ck": nonfinite_factor()}, sub=True),
    Case("export-nonfinite-factor", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["layers.1.mlp.down_proj.kernel_lora_a", "non-finite"], {"ck": nonfinite_factor("layers.1.mlp.down_proj.kernel_lora_a")}),
    Case("train-dir-locked", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck", "in use by another trainer", "PID 1 on tpu-vm-7"],
         {"ck/gemma_tpu_run.lock": '{"pid": 1, "host": "tpu-vm-7", "started": "2026-11-23T10:00:00+00:00"}'}),
    Case("merge-base-replaced", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/other", "--out", "{tmp}/out"],
         ["{tmp}/other/model.safetensors", "tensor data differs", "--allow-base-mismatch"], {"other": other_base},
         sub=True),
    Case("export-base-replaced", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/other/model.safetensors", "tensor data differs", "--allow-base-mismatch"],
         {"other": other_base, "ck": ckpt_pointing_to("{tmp}/other")}),
    # evaluate restored the checkpoint on the replaced base without a word (merge, export and resume refuse it)
    Case("evaluate-ckpt-base-replaced", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--checkpoint", "{tmp}/ck", "--json", "{tmp}/r.json"],
         ["{tmp}/other/model.safetensors", "tensor data differs", "--allow-base-mismatch"],
         {"other": other_base, "ck": ckpt_pointing_to("{tmp}/other")}),
    Case("ckpt-resume-base-replaced", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck", "model.path={tmp}/other"],
         ["{tmp}/other/model.safetensors", "tensor data differs", "checkpoint.allow_base_mismatch"],
         {"other": other_base, "ck": copy_of("ckpt")}),
    # ---- partial and foreign files (a copy cut short, a step missing Orbax files, outputs that cannot be written)
    Case("ckpt-step-missing-data-dir", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/1/model_params/ocdbt.process_0/d", "missing"],
         {"ck": damaged("ckpt", "1/model_params/ocdbt.process_0/d")}, sub=True),
    Case("ckpt-step-missing-data-files", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/1/model_params/ocdbt.process_0/d/", "missing", "incomplete or damaged"],
         {"ck": damaged("ckpt", "1/model_params/ocdbt.process_0/d/*")}),
    Case("ckpt-step-truncated-data-file", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/1/model_params/ocdbt.process_0/d/", "truncated", "incomplete or damaged"],
         {"ck": damaged("ckpt", truncate=("1/model_params/ocdbt.process_0/d/*", -100))}),
    Case("ckpt-step-missing-metadata", "convert.inspect", ["{tmp}/ck"], ["{tmp}/ck/1/model_params/_METADATA", "missing"],
         {"ck": damaged("ckpt", "1/model_params/_METADATA")}),
    # Orbax's JSON records cut short: a bare JSONDecodeError naming no file before
    Case("ckpt-resume-truncated-metadata", "gemma_tpu.train", [*TRAIN, "train.max_steps=3"],
         ["{tmp}/ck/1/model_params/_METADATA", "truncated", "move it aside"],
         {"ck": damaged("ckpt", truncate=("1/model_params/_METADATA", -40))}),
    # the step's own record (its data position) cut short by a copy: one line, without the way out
    Case("ckpt-resume-truncated-step-record", "gemma_tpu.train", [*TRAIN, "train.max_steps=3"],
         ["{tmp}/ck/1/_CHECKPOINT_METADATA", "not valid JSON", "cannot restore this checkpoint step", "move it aside"],
         {"ck": damaged("ckpt", truncate=("1/_CHECKPOINT_METADATA", -40))}),
    Case("ckpt-step-truncated-array-metadata", "convert.merge_orbax", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/1/model_params/array_metadatas/process_0", "truncated"],
         {"ck": damaged("ckpt", truncate=("1/model_params/array_metadatas/*", 30))}),
    Case("ckpt-step-missing-manifest", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/ck/1/model_params/manifest.ocdbt", "missing"], {"ck": damaged("ckpt", "1/model_params/manifest.ocdbt")}),
    Case("ckpt-step-truncated-manifest", "convert.inspect", ["{tmp}/ck"],  # tracebacks from Orbax's loop before
         ["{tmp}/ck/1/model_params/manifest.ocdbt", "truncated", "incomplete or damaged"],
         {"ck": damaged("ckpt", truncate=("1/model_params/manifest.ocdbt", -50))}, sub=True),
    Case("ckpt-resume-step-missing-files", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/1/optimizer_state/_METADATA", "missing"], {"ck": damaged("ckpt", "1/optimizer_state/_METADATA")}),
    Case("model-truncated-safetensors", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m"],
         ["{tmp}/m/model.safetensors"], {"m": damaged("tiny", truncate=("model.safetensors", 1000))}),
    Case("inspect-truncated-safetensors", "convert.inspect", ["{tmp}/m"], ["{tmp}/m/model.safetensors", "truncated"],
         {"m": damaged("tiny", truncate=("model.safetensors", 1000))}),
    Case("merge-out-under-a-file", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "{tmp}/f/merged"],
         ["--out {tmp}/f/merged", "{tmp}/f is not a directory"], {"f": "a file"}),
    Case("export-out-under-a-file", "convert.export_peft", ["--checkpoint", "{ckpt}", "--out", "{tmp}/f/a/b"],
         ["--out {tmp}/f/a/b", "{tmp}/f is not a directory"], {"f": "a file"}),
    Case("train-checkpoint-dir-under-a-file", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/f/ck"],
         ["checkpoint.dir={tmp}/f/ck", "{tmp}/f is not a directory"], {"f": "a file"}),
    # said before the data is read (a large set takes minutes): this one's data file is missing too
    Case("train-checkpoint-dir-checked-before-the-data", "gemma_tpu.train",
         [*TRAIN, "checkpoint.dir={tmp}/f/ck", "data.train_path={tmp}/none.jsonl"],
         ["checkpoint.dir={tmp}/f/ck", "{tmp}/f is not a directory"], {"f": "a file"}),
    # a step directory (the one holding the weights) was "no gemma_tpu_run.json (not a gemma-tpu checkpoint)"
    Case("ckpt-dir-is-a-step", "gemma_tpu.chat", ["--checkpoint", "{ckpt}/1", "--once", "hi"],
         ["{ckpt}/1 is step 1 of the checkpoint directory {ckpt}", "give {ckpt} (and --step 1)"]),
    Case("inspect-a-step-directory", "convert.inspect", ["{ckpt}/1"], ["{ckpt}/1 is step 1", "--step 1"]),
    # a model or an adapter given for the training checkpoint said "no gemma_tpu_run.json (not a gemma-tpu checkpoint
    # directory)" alone; a merge's or an export's output names the checkpoint it came from
    Case("ckpt-dir-is-a-model", "convert.export_gguf", ["--checkpoint", "{tmp}/m", "--out", "{tmp}/out.gguf"],
         ["{tmp}/m is a Hugging Face model directory (config.json), not a gemma-tpu training checkpoint (no "
          "gemma_tpu_run.json)"], {"m": copy_of("tiny")}),
    Case("ckpt-dir-is-a-merged-model", "convert.merge_orbax", ["--checkpoint", "{tmp}/m", "--out", "{tmp}/out"],
         ["{tmp}/m is a Hugging Face model directory (config.json), not a gemma-tpu training checkpoint (no "
          "gemma_tpu_run.json): it was made from step 3 of {tmp}/runs/x; give {tmp}/runs/x"],
         {"m": copy_of("tiny"), "m/gemma_tpu_merge.json": '{"checkpoint": "{tmp}/runs/x", "step": 3}'}),
    Case("ckpt-dir-is-an-adapter", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--checkpoint", "{tmp}/a"],
         ["{tmp}/a is a PEFT adapter directory (adapter_config.json), not a gemma-tpu training checkpoint (no "
          "gemma_tpu_run.json)"], {"a/adapter_config.json": "{}"}),
    # a directory inside a step (Orbax's item, which holds the tensors) said "no gemma_tpu_run.json" too
    Case("ckpt-dir-inside-a-step", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}/1/model_params", "--out", "{tmp}/out"],
         ["{ckpt}/1/model_params is inside step 1 of the checkpoint directory {ckpt}: give {ckpt}, not "
          "{ckpt}/1/model_params (and --step 1)"]),
    Case("inspect-a-directory-inside-a-step", "convert.inspect", ["{ckpt}/1/model_params"],
         ["{ckpt}/1/model_params is inside step 1 of the checkpoint directory {ckpt}: give {ckpt}"]),
    Case("ckpt-dir-is-a-file", "convert.merge_orbax", ["--checkpoint", "{ckpt}/gemma_tpu_run.json", "--out", "{tmp}/out"],
         ["{ckpt}/gemma_tpu_run.json", "is a file, not a directory"]),
    # a model given as a file: a GGUF (not read here: how to convert it), or one file of a model directory
    Case("train-model-is-a-gguf-file", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m.gguf"],
         ["model.path {tmp}/m.gguf: not a directory", "a GGUF file is not read here", "gguf_file='m.gguf'"],
         {"m.gguf": b"GGUF\x03\x00\x00\x00"}),
    Case("train-model-dir-holds-a-gguf", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/g"],
         ["{tmp}/g/config.json: missing", "it holds m.gguf", "a GGUF file is not read here"],
         {"g/m.gguf": b"GGUF\x03\x00\x00\x00"}),
    Case("train-model-is-its-config-file", "gemma_tpu.train", [*TRAIN, "model.path={tiny}/config.json"],
         ["{tiny}/config.json: not a directory", "give the directory, {tiny}"]),
    # training wrote its steps, gemma_tpu_run.json and metrics among a model's files
    Case("train-checkpoint-dir-is-the-base", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m", "checkpoint.dir={tmp}/m"],
         ["checkpoint.dir={tmp}/m", "is the base model's directory"], {"m": copy_of("tiny")}),
    Case("train-run-dir-inside-the-base", "gemma_tpu.train", [*TRAIN, "model.path={tmp}/m", "train.run_dir={tmp}/m/tb"],
         ["train.run_dir={tmp}/m/tb", "inside the base model's directory"], {"m": copy_of("tiny")}),
    # set aside as an incomplete step at the start, the run's own lock with it: the run failed at its first save
    Case("train-run-dir-named-like-a-step-of-the-checkpoint-dir", "gemma_tpu.train",
         [*TRAIN, "train.run_dir={tmp}/ck/2"],
         ["train.run_dir={tmp}/ck/2 is a directory of checkpoint.dir={tmp}/ck named like checkpoint step 2"], sub=True),
    # another run's step (or a directory inside one): trained into without a word, then deleted with that step by
    # the other run's max_to_keep; the converters given it read the other run's step
    Case("train-checkpoint-dir-is-a-step-of-another-run", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={ckpt}/1"],
         ["checkpoint.dir={ckpt}/1 is a directory of the run in {ckpt} named like its checkpoint step 1",
          "the converters given {ckpt}/1 read that step", "write the run elsewhere"]),
    Case("train-run-dir-inside-a-step-of-another-run", "gemma_tpu.train", [*TRAIN, "train.run_dir={ckpt}/3/logs"],
         ["train.run_dir={ckpt}/3/logs is inside a directory of the run in {ckpt} named like its checkpoint step 3"]),
    # not a step to Orbax (it reads `4`, never `04`): the reason is the resume's refusal of a misnamed step
    Case("train-run-dir-named-like-a-padded-step-of-the-checkpoint-dir", "gemma_tpu.train",
         [*TRAIN, "train.run_dir={tmp}/ck/04/logs"],
         ["train.run_dir={tmp}/ck/04/logs is inside a directory of checkpoint.dir={tmp}/ck named like checkpoint "
          "step 4 with leading zeros (04), which a run on checkpoint.dir refuses as a misnamed step",
          "write the run elsewhere"]),
    Case("train-checkpoint-dir-holds-a-model", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/merged"],
         ["checkpoint.dir={tmp}/merged", "holds a model (config.json)"], {"merged": copy_of("tiny")}),
    # the run's own outputs in the way: refused before anything is written (a resume blamed its sound step, "move it
    # aside"; a fresh run wrote its metadata first; summary.json, after every step had trained)
    Case("train-metrics-file-is-a-directory", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/metrics.jsonl: not a regular file", "checkpoint.dir"], {"ck/metrics.jsonl/": ""}),
    Case("train-resume-metrics-file-is-a-directory", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/metrics.jsonl: not a regular file"],
         {"ck": copy_of("ckpt", drop=("metrics.jsonl",)), "ck/metrics.jsonl/": ""}),
    Case("train-tensorboard-is-a-file", "gemma_tpu.train", [*TRAIN, "train.run_dir={tmp}/rd"],
         ["{tmp}/rd/tensorboard: not a directory", "train.run_dir"], {"rd/tensorboard": "notes"}),
    Case("train-summary-is-a-directory", "gemma_tpu.train", [*TRAIN, "checkpoint.dir={tmp}/ck"],
         ["{tmp}/ck/summary.json: not a regular file"], {"ck/summary.json/": ""}),
    Case("ckpt-missing-checkpoint-dir", "convert.export_peft", ["--checkpoint", "{tmp}/nope", "--out", "{tmp}/out"],
         ["{tmp}/nope"]),
    # ---- merge and export targets
    Case("merge-existing-target", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "{tmp}/out"],
         ["{tmp}/out", "--overwrite"], {"out/README": "mine"}),
    Case("merge-target-inside-checkpoint", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "{ckpt}/merged"],
         ["{ckpt}/merged", "inside"]),
    # a model nested in another model's directory (an earlier merge, an HF download): it was written
    Case("merge-target-inside-an-earlier-merge", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/m1/sub"],
         ["--out {tmp}/m1/sub", "inside {tmp}/m1", "an earlier output: gemma_tpu_merge.json"],
         {"m1/gemma_tpu_merge.json": "{}", "m1/config.json": "{}"}),
    Case("export-target-inside-a-model", "convert.export_peft", ["--checkpoint", "{ckpt}", "--out", "{tmp}/hf/adapter"],
         ["--out {tmp}/hf/adapter", "inside {tmp}/hf", "config.json and weights"],
         {"hf/config.json": "{}", "hf/model.safetensors": b"x"}),
    # --overwrite replaces an earlier output, not a directory of other files (`--out .` deleted the cwd's files)
    Case("merge-overwrite-foreign-dir", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", ".", "--overwrite"],
         ["--out .", "holds other files (notes.txt)", "gemma_tpu_merge.json"], {"notes.txt": "mine"}, sub=True),
    Case("export-overwrite-foreign-dir", "convert.export_peft",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/models", "--overwrite"],
         ["--out {tmp}/models", "holds other files (a, b, c and 1 more)", "gemma_tpu_adapter.json"],
         {"models/a/config.json": "{}", "models/b": "x", "models/c": "x", "models/d": "x"}),
    # an empty path is the working directory to pathlib: it was refused as '. already exists'
    Case("merge-empty-out", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "", "--overwrite"],
         ["--out", "an empty path names no output directory to write"]),
    Case("gguf-empty-out", "convert.export_gguf", ["--merged", "{tiny}", "--out", " "],
         ["argument --out: an empty path names no output .gguf file to write"]),  # said "a file or directory"
    Case("eval-empty-json", "gemma_tpu.evaluate", ["--model", "{tiny}", "--json", ""],
         ["--json", "an empty path names no JSON file to write"]),
    Case("merge-target-is-a-file", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/out.txt", "--overwrite"], ["{tmp}/out.txt", "not a directory"],
         {"out.txt": "mine"}),
    # a base whose non-weight files broke after training (the fingerprint covers weights and config.json):
    # refused before the merge, not a traceback after every weight was written
    Case("merge-base-bad-generation-config", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/m", "--out", "{tmp}/out"],
         ["{tmp}/m/generation_config.json", "not valid JSON"],
         {"m": copy_of("tiny", write={"generation_config.json": '{"eos_token_id": '})}, sub=True),
    Case("merge-base-eos-not-ids", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/m", "--out", "{tmp}/out"],
         ["{tmp}/m/generation_config.json", "eos_token_id", "'<eos>'"],
         {"m": copy_of("tiny", write={"generation_config.json": '{"eos_token_id": "<eos>"}'})}),
    Case("merge-base-bad-tokenizer-json", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/m", "--out", "{tmp}/out"],
         ["{tmp}/m/tokenizer.json", "not valid JSON"], {"m": copy_of("tiny", write={"tokenizer.json": '{"added_'})}),
    Case("export-base-bad-tokenizer-config", "convert.export_peft", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/out"],
         ["{tmp}/m/tokenizer_config.json", "expected a JSON object"],
         {"m": copy_of("tiny", write={"tokenizer_config.json": "[]"}), "ck": ckpt_pointing_to("{tmp}/m")}),
    Case("merge-bad-shard-size", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/out", "--max-shard-size", "5XB"], ["--max-shard-size", "'5XB'"]),
    Case("merge-zero-shard-size", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/out", "--max-shard-size", "0"], ["--max-shard-size"]),
    # a value starting with '-' that is not a plain number was argparse's 'expected one argument' (read as an option)
    Case("merge-negative-shard-size", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/out", "--max-shard-size", "-1GB"],
         ["--max-shard-size: size '-1GB' must be positive"]),
    Case("verify-negative-exponent-threshold", "convert.verify", ["{tiny}", "{tiny}", "--max-kl", "-1e-3"],
         ["argument --max-kl: '-1e-3': expected a number >= 0"]),
    Case("merge-bad-dtype", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--out", "{tmp}/out", "--dtype", "int8"],
         ["--dtype", "'int8'"]),
    Case("merge-missing-base", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--out", "{tmp}/out", "--base", "{tmp}/nobase"], ["{tmp}/nobase"]),
    # the families' checks of the base's config.json said "config.json: ...", naming no directory
    Case("merge-base-config-layer-count-not-its-layer-types", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/b", "--out", "{tmp}/out", "--allow-base-mismatch"],
         ["{tmp}/b/config.json: layer_types has 2 entries for num_hidden_layers=3"],
         {"b": copy_of("tiny", config={"num_hidden_layers": 3})}),
    # a base config.json of another shape than its weights and the checkpoint (an edit let through the fingerprint
    # by --allow-base-mismatch) was published beside the checkpoint's weights: a model transformers cannot load
    Case("merge-base-config-another-shape", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/b", "--out", "{tmp}/out", "--allow-base-mismatch"],
         ["{tmp}/b/config.json", "hidden_size=32", "the checkpoint was trained with hidden_size=64"],
         {"b": copy_of("tiny", config={"hidden_size": 32})}),
    Case("merge-base-config-another-vocabulary", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/b", "--out", "{tmp}/out", "--allow-base-mismatch"],
         ["{tmp}/b/config.json", "vocab_size=1000", "the checkpoint was trained with vocab_size=512"],
         {"b": copy_of("tiny", config={"vocab_size": 1000})}),
    # a base missing a tensor its config.json needs (a copy cut short, an edit, let through the fingerprint): the merge
    # published the model without it, which transformers fills with initial values and serves without a word
    Case("merge-base-missing-a-norm", "convert.merge_orbax",
         ["--checkpoint", "{ckpt}", "--base", "{tmp}/b", "--out", "{tmp}/out", "--allow-base-mismatch"],
         ["{tmp}/b", "model.layers.1.post_feedforward_layernorm.weight", "missing"],
         {"b": without_tensor("model.layers.1.post_feedforward_layernorm.weight")}),
    Case("export-no-such-step", "convert.export_peft",
         ["--checkpoint", "{ckpt}", "--step", "5", "--out", "{tmp}/out"], ["{ckpt}", "step 5"]),
    Case("export-existing-target", "convert.export_peft", ["--checkpoint", "{ckpt}", "--out", "{tmp}/out"],
         ["{tmp}/out", "--overwrite"], {"out/adapter_config.json": "{}"}),
    Case("export-target-is-checkpoint", "convert.export_peft", ["--checkpoint", "{ckpt}", "--out", "{ckpt}",
                                                                "--overwrite"], ["{ckpt}", "input"]),
    # ---- verify / inspect
    # a file of something else is said to be one without --overwrite too ("already exists (use --overwrite ...)",
    # then refused with it, was a dead end)
    Case("gguf-existing-target", "convert.export_gguf", ["--merged", "{tiny}", "--out", "{tmp}/o.gguf"],
         ["--out {tmp}/o.gguf: --overwrite replaces an earlier output", "something else"], {"o.gguf": "keep me"},
         sub=True),
    # --overwrite replaced any file with the GGUF (a dataset, a script given as --out by mistake)
    Case("gguf-overwrite-a-foreign-file", "convert.export_gguf",
         ["--merged", "{tiny}", "--out", "{tmp}/train.jsonl", "--overwrite"],
         ["{tmp}/train.jsonl", "--overwrite replaces an earlier output", "something else"],
         {"train.jsonl": '{"messages": []}\n'}),
    # the file was written as {tmp}/models, under the name of the folder it was meant to go into
    Case("gguf-out-with-a-trailing-slash", "convert.export_gguf", ["--merged", "{tiny}", "--out", "{tmp}/models/"],
         ["--out {tmp}/models/", "names a directory"]),
    Case("gguf-unknown-type", "convert.export_gguf", ["--merged", "{tiny}", "--out", "{tmp}/o.gguf", "--type", "q5_k"],
         ["--type q5_k", "f16, bf16, q8_0, q4_0"]),
    Case("gguf-unsupported-architecture", "convert.export_gguf", ["--merged", "{tmp}/m", "--out", "{tmp}/o.gguf"],
         ["{tmp}/m/config.json", "LlamaForCausalLM"],
         {"m": copy_of("tiny", config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})}),
    Case("gguf-checkpoint-other-family", "convert.export_gguf", ["--checkpoint", "{tmp}/ck", "--out", "{tmp}/o.gguf"],
         ["{tmp}/ck/gemma_tpu_run.json", "'llama'"], {"ck": copy_of("ckpt", meta={"base_model.family": "llama"})}),
    Case("verify-no-such-dir", "convert.verify", ["{tmp}/a", "{tiny}"], ["{tmp}/a"], sub=True),
    Case("verify-dir-without-config", "convert.verify", ["{tiny}", "{tmp}/b"], ["{tmp}/b/config.json"],
         {"b/model.safetensors": corrupt_header()}),
    Case("verify-empty-prompt", "convert.verify", ["{tiny}", "{tiny}", "--prompt", ""], ["--prompt", "empty prompt"]),
    Case("verify-prompt-past-context", "convert.verify", ["{tiny}", "{tiny}", "--prompt", "hi", "--prompt", "x" * 2000],
         ["--prompt 2: 2001 tokens, past the model's context of 1024 (max_position_embeddings)"]),
    # a nan threshold passed every comparison: the gate could never fail
    Case("verify-nan-threshold", "convert.verify", ["{tiny}", "{tiny}", "--max-kl", "nan"], ["--max-kl", "'nan'"]),
    Case("verify-bad-threshold", "convert.verify", ["{tiny}", "{tiny}", "--max-kl", "tiny"], ["--max-kl", "'tiny'"]),
    # transformers' own errors were tracebacks (SafetensorError, RuntimeError "ignore_mismatched_sizes"), and a
    # missing weight was filled with random values and compared
    Case("verify-truncated-safetensors", "convert.verify", ["{tiny}", "{tmp}/m"],
         ["{tmp}/m/model.safetensors", "truncated"], {"m": damaged("tiny", truncate=("model.safetensors", 1000))}),
    Case("verify-weight-shape-not-config", "convert.verify", ["{tiny}", "{tmp}/m"],
         ["{tmp}/m", "model.embed_tokens.weight", "config.json"], {"m": copy_of("tiny", config={"hidden_size": 96})}),
    Case("verify-missing-weight", "convert.verify", ["{tiny}", "{tmp}/m"],
         ["{tmp}/m", "model.layers.1.mlp.up_proj.weight", "missing"],
         {"m": without_tensor("model.layers.1.mlp.up_proj.weight")}),
    Case("verify-unknown-architecture", "convert.verify", ["{tiny}", "{tmp}/m"], ["{tmp}/m", "nonsense"],
         {"m": copy_of("tiny", config={"model_type": "nonsense"})}),
    Case("inspect-no-such-step", "convert.inspect", ["{ckpt}", "--step", "7"], ["{ckpt}", "step 7"]),
    Case("inspect-no-such-path", "convert.inspect", ["{tmp}/nope"], ["{tmp}/nope"]),
    Case("inspect-neither-checkpoint-nor-model", "convert.inspect", ["{tmp}/d"], ["{tmp}/d", "neither"],
         {"d/notes.txt": "hello"}),
    Case("inspect-corrupt-safetensors", "convert.inspect", ["{tmp}/m"], ["{tmp}/m/model.safetensors"],
         {"m": copy_of("tiny", write={"model.safetensors": corrupt_header()})}),
    # a config.json or adapter_config.json that is not a JSON object was a JSONDecodeError / AttributeError
    # traceback; --step on an HF directory (no steps) was ignored
    Case("inspect-config-json-not-json", "convert.inspect", ["{tmp}/m"], ["{tmp}/m/config.json", "not valid JSON"],
         {"m": copy_of("tiny", write={"config.json": "{bad"})}),
    Case("inspect-config-json-a-list", "convert.inspect", ["{tmp}/m"], ["{tmp}/m/config.json", "a JSON object"],
         {"m": copy_of("tiny", write={"config.json": "[1, 2]"})}),
    Case("inspect-adapter-config-not-json", "convert.inspect", ["{tmp}/m"],
         ["{tmp}/m/adapter_config.json", "not valid JSON"], {"m": copy_of("tiny", write={"adapter_config.json": "{"})}),
    Case("inspect-step-on-hf-dir", "convert.inspect", ["{tiny}", "--step", "3"],
         ["--step 3", "{tiny}", "not a gemma-tpu checkpoint"]),
    # ---- evaluate
    Case("evaluate-bad-compare-spec", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "modle:{tiny}", "model:{tiny}"], ["modle:"], sub=True),
    # said "model.path {tmp}/nope: no such directory", a config key the command line never gave
    Case("evaluate-model-missing", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tmp}/nope"],
         ["error: --model {tmp}/nope: no such directory"]),
    Case("evaluate-compare-model-missing", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "model:{tiny}", "model:{tmp}/nope"],
         ["error: --compare B (model:{tmp}/nope): {tmp}/nope: no such directory"]),
    Case("chat-model-missing", "gemma_tpu.chat", ["--model", "{tmp}/nope", "--once", "hi"],
         ["error: --model {tmp}/nope: no such directory"]),
    # `--model "$M"` with M unset: taken for no --model, evaluate asked an endpoint of None (a traceback), chat raised
    # a TypeError, and the merge went on with the recorded base, --base unsaid
    Case("evaluate-empty-model", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", ""],
         ["argument --model: an empty path names no model directory"]),
    Case("evaluate-empty-checkpoint", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--checkpoint", " "],
         ["argument --checkpoint: an empty path names no checkpoint directory"]),
    Case("chat-empty-model", "gemma_tpu.chat", ["--model", "", "--once", "hi"],
         ["argument --model: an empty path names no model directory"]),
    Case("merge-empty-base", "convert.merge_orbax", ["--checkpoint", "{ckpt}", "--base", "", "--out", "{tmp}/out"],
         ["argument --base: an empty path names no base model"]),
    Case("evaluate-limit-negative", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tiny}", "--limit", "-3"],
         ["--limit -3: must be positive"]),
    Case("evaluate-unreachable-endpoint", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--endpoint", "http://127.0.0.1:{port}", "--json", "{tmp}/r.json"],
         ["127.0.0.1:{port}", "cannot reach"]),
    # an endpoint's tokenizer is not known: every family's markup is refused in the data (a Gemma 4's `<|turn>` opened
    # a turn of its own on the server), before any request
    Case("evaluate-endpoint-gemma4-markup-in-data", "gemma_tpu.evaluate",
         ["--data", "{tmp}/t.jsonl", "--endpoint", "http://127.0.0.1:{port}"],
         ["{tmp}/t.jsonl:1", "'<turn|>' at character 2"],
         {"t.jsonl": '{"messages": [{"role": "user", "content": "hi<turn|>\\n<|turn>model"}, '
                     '{"role": "assistant", "content": "yo"}]}\n'}),
    Case("evaluate-bad-data", "gemma_tpu.evaluate", ["--data", "{tmp}/t.jsonl", "--model", "{tiny}"],
         ["{tmp}/t.jsonl:1", "'wizard'"], {"t.jsonl": from_corpus("unknown_role.jsonl")}),
    Case("evaluate-text-rows", "gemma_tpu.evaluate", ["--data", "{tmp}/t.jsonl", "--model", "{tiny}"],
         ["{tmp}/t.jsonl:2", "language-modeling 'text' row"],
         {"t.jsonl": '{"prompt": "hi", "completion": "yo"}\n{"text": "plain prose"}\n'}),
    # a conversation ending with a question (or a tool result) without its reference answer: that last turn was never
    # scored, under any --turns, without a word
    Case("evaluate-unanswered-last-turn", "gemma_tpu.evaluate", ["--data", "{tmp}/t.jsonl", "--model", "{tiny}"],
         ["{tmp}/t.jsonl:2", "ends with a user message, without the assistant's turn after it"],
         {"t.jsonl": '{"prompt": "hi", "completion": "yo"}\n{"messages": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "yo"}, {"role": "user", "content": "and you?"}]}\n'}),
    Case("evaluate-tokenizer-past-vocab", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tmp}/m"],
         ["token id", "past the model's vocabulary (vocab_size 150"], {"m": small_vocab_with_tiny_tokenizer}),
    Case("evaluate-json-is-a-dir", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tiny}", "--json", "{tmp}"],
         ["--json {tmp}", "directory"]),
    Case("evaluate-json-is-the-data", "gemma_tpu.evaluate",
         ["--data", "{tmp}/test.jsonl", "--endpoint", "http://127.0.0.1:{port}", "--json", "{tmp}/./test.jsonl"],
         ["--json {tmp}/./test.jsonl", "--data input", "replace it"],
         {"test.jsonl": lambda d, ctx: shutil.copy(CHAT, d)}),
    Case("inspect-json-is-the-data", "gemma_tpu.data.inspect",
         [*TRAIN, "data.train_path={tmp}/d.jsonl", "--json", "{tmp}/d.jsonl"], ["--json {tmp}/d.jsonl", "data input"],
         {"d.jsonl": lambda d, ctx: shutil.copy(CHAT, d)}),
    # ---- serving configs and model dirs
    Case("serve-tp-not-dividing-kv-heads", "serving.launch",
         [*LAUNCH, "model.dir={tmp}/m", "server.tensor_parallel_size=3", "server.max_model_len=1024"],
         ["server.tensor_parallel_size=3", "num_key_value_heads=2"],
         {"m": copy_of("tiny", write={"chat_template.jinja": "{{ messages }}"})}, sub=True),
    Case("serve-no-tokenizer", "serving.launch", [*LAUNCH, "model.dir={tmp}/m"], ["{tmp}/m", "tokenizer"],
         {"m": copy_of("tiny", drop=("tokenizer.json",))}),
    Case("serve-generation-config-not-json", "serving.launch", [*LAUNCH, "model.dir={tmp}/m"],
         ["{tmp}/m/generation_config.json", "not valid JSON"],
         {"m": copy_of("tiny", write={"generation_config.json": '{"eos_token_id": [1, 106'})}),
    Case("serve-tokenizer-config-not-json", "serving.launch", [*LAUNCH, "model.dir={tmp}/m"],
         ["{tmp}/m/tokenizer_config.json", "not valid JSON"],
         {"m": copy_of("tiny", write={"tokenizer_config.json": '{"chat_template": "{{ messages'})}),
    Case("serve-unsupported-architecture", "serving.launch", [*LAUNCH, "model.dir={tmp}/m"], ["LlamaForCausalLM"],
         {"m": copy_of("tiny", config={"architectures": ["LlamaForCausalLM"]})}),
    Case("serve-missing-shard", "serving.launch", [*LAUNCH, "model.dir={tmp}/m"],
         ["model-00002-of-00002.safetensors"],
         {"m": copy_of("tiny", write={"model.safetensors.index.json": MISSING_SHARD_INDEX})}),
    Case("serve-unknown-key", "serving.launch", [*LAUNCH, "model.dir={tiny}", "server.prot=8001"], ["server.prot"]),
    Case("serve-port-out-of-range", "serving.launch", [*LAUNCH, "model.dir={tiny}", "server.port=70000"],
         ["override 'server.port=70000': server.port must be in 1..65535", "70000"]),
    Case("serve-port-not-a-number", "serving.launch", [*LAUNCH, "model.dir={tiny}", "server.port=eighty"],
         ["server.port", "'eighty'"]),
    Case("serve-config-duplicate-section", "serving.launch", ["--print", "--config", "{tmp}/s.yaml"],
         ["{tmp}/s.yaml line 2", "'model' appears twice"], {"s.yaml": "model: {dir: {tiny}}\nmodel: {name: coach}\n"}),
    Case("serve-config-unknown-section", "serving.launch", ["--print", "--config", "{tmp}/s.yaml"],
         ["{tmp}/s.yaml", "sever"], {"s.yaml": from_corpus("serve_unknown_section.yaml")}),
    # ---- clients
    Case("bench-not-a-url", "serving.bench", ["--base-url", "localhost:8000", "--num-prompts", "1"],
         ["'localhost:8000'", "http"], sub=True),
    Case("bench-unreachable", "serving.bench",
         ["--base-url", "http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2", "--timeout", "3",
          "--json", "{tmp}/b.json"], ["127.0.0.1:{port}", "cannot reach"]),
    Case("bench-bad-dataset-line", "serving.bench",
         ["--base-url", "http://127.0.0.1:{port}", "--dataset", "{tmp}/p.jsonl"], ["{tmp}/p.jsonl:2"],
         {"p.jsonl": from_corpus("bad_json_line.jsonl")}),
    Case("bench-dataset-not-utf8", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--dataset",
                                                     "{tmp}/p.jsonl"], ["{tmp}/p.jsonl:2", "not UTF-8"],
         {"p.jsonl": from_corpus("latin1.jsonl")}),
    Case("bench-dataset-bad-max-tokens", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--dataset",
                                                           "{tmp}/p.jsonl"], ["{tmp}/p.jsonl:2", "max_tokens", "'ten'"],
         {"p.jsonl": '{"prompt": "hi"}\n{"prompt": "hi", "max_tokens": "ten"}\n'}),
    Case("bench-json-is-the-dataset", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--dataset",
                                                        "{tmp}/p.jsonl", "--json", "{tmp}/p.jsonl"],
         ["--json {tmp}/p.jsonl", "--dataset input"], {"p.jsonl": '{"prompt": "hi"}\n'}),
    Case("bench-bad-percentiles", "serving.bench", ["--base-url", "http://127.0.0.1:{port}",
                                                    "--metric-percentiles", "90,ninety"], ["--metric-percentiles"]),
    Case("bench-json-under-a-file", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                       "--json", "{tmp}/f/b.json"],
         ["--json {tmp}/f/b.json", "{tmp}/f is not a directory"], {"f": "a file"}),
    Case("evaluate-json-under-a-file", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--endpoint", "http://127.0.0.1:{port}", "--json", "{tmp}/f/r.json"],
         ["--json {tmp}/f/r.json", "{tmp}/f is not a directory"], {"f": "a file"}),
    # an existing file that no run of the command wrote (here: training data) was replaced by the results
    Case("evaluate-json-is-other-data", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--endpoint", "http://127.0.0.1:{port}", "--json", "{tmp}/train.jsonl"],
         ["--json {tmp}/train.jsonl", "not an earlier results file", "'models'"], {"train.jsonl": CHAT.read_text()}),
    Case("bench-json-is-other-data", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                       "--json", "{tmp}/r.json"],
         ["--json {tmp}/r.json", "not an earlier results file", "'completed'"], {"r.json": '{"models": {}}'}),
    Case("chat-unreachable", "serving.chat", ["--base-url", "http://127.0.0.1:{port}", "--model", "m", "--once", "hi",
                                              "--retries", "0"],
         ["127.0.0.1:{port}", "cannot reach"], sub=True),
    Case("chat-gemma4-markup-in-question", "serving.chat",
         ["--base-url", "http://127.0.0.1:{port}", "--model", "m", "--once", "what does <tool_call|> mean?"],
         ["the question", "'<tool_call|>' at character 10", "control token"]),
    Case("chat-url-bad-ipv6", "serving.chat", ["--base-url", "http://[::1", "--model", "m", "--once", "hi"],
         ["'http://[::1'", "not an http(s) server address", "Invalid IPv6 URL"]),
    Case("evaluate-url-port-not-a-number", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--endpoint", "http://127.0.0.1:abc", "--served-model", "m"],
         ["'http://127.0.0.1:abc'", "not an http(s) server address", "'abc'"]),
    Case("bench-url-port-out-of-range", "serving.bench", ["--base-url", "http://127.0.0.1:99999", "--model", "m"],
         ["'http://127.0.0.1:99999'", "not an http(s) server address", "out of range"]),
    # `float` took nan and inf: a socket or JSON-encoder traceback
    Case("bench-nan-timeout", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                "--timeout", "nan"], ["--timeout", "'nan'", "> 0"]),
    Case("bench-nan-temperature", "serving.bench", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                    "--temperature", "nan"], ["--temperature", "'nan'", ">= 0"]),
    Case("chat-inf-timeout", "serving.chat", ["--base-url", "http://127.0.0.1:{port}", "--model", "m", "--once", "hi",
                                              "--timeout", "inf"], ["--timeout", "'inf'"]),
    Case("chat-negative-temperature", "serving.chat", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                       "--once", "hi", "--temperature", "-1"], ["--temperature", "'-1'"]),
    Case("chat-temperature-past-openai-range", "serving.chat", ["--base-url", "http://127.0.0.1:{port}", "--model", "m",
                                                                "--once", "hi", "--temperature", "2.5"],
         ["--temperature", "'2.5'", ">= 0 and <= 2"]),
    Case("evaluate-inf-timeout", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--endpoint", "http://127.0.0.1:{port}",
                                                        "--timeout", "inf"], ["--timeout", "'inf'"]),
    Case("chat-negative-retries", "serving.chat", ["--base-url", "http://127.0.0.1:{port}", "--model", "m", "--once",
                                                   "hi", "--retries", "-1"], ["--retries -1", "0 or more"]),
    Case("chat-not-a-url", "serving.chat", ["--base-url", "ftp://127.0.0.1", "--model", "m", "--once", "hi"],
         ["'ftp://127.0.0.1'", "http"]),
    Case("local-chat-bad-dtype", "gemma_tpu.chat", ["--model", "{tiny}", "--dtype", "float16", "--once", "hi"],
         ["--dtype", "'float16'"]),
    Case("local-chat-zero-new-tokens", "gemma_tpu.chat", ["--model", "{tiny}", "--max-new-tokens", "0", "--once", "hi"],
         ["--max-new-tokens 0", "positive"]),
    # refused on the checkpoint's metadata and its base's tokenizer, before the model loads
    Case("local-chat-checkpoint-markup-question", "gemma_tpu.chat",
         ["--checkpoint", "{ckpt}", "--once", "what does <end_of_turn> mean?"], ["the question", "'<end_of_turn>'"]),
    Case("local-chat-step-without-checkpoint", "gemma_tpu.chat", ["--model", "{tiny}", "--step", "3", "--once", "hi"],
         ["--step", "--checkpoint"]),
    # the generator's check said "prompt 2 is 1743 tokens", not which example of which file; one such prompt
    # among others is scored as refused (tests/test_fitness.py), every prompt past the context ends the run
    Case("evaluate-prompt-past-the-context", "gemma_tpu.evaluate", ["--data", "{tmp}/d.jsonl", "--model", "{tiny}"],
         ["{tmp}/d.jsonl:1", "1024 (max_position_embeddings)", "all 2 prompts"],
         {"d.jsonl": "".join(line + "\n"
                             for line in (REPO / "data" / "fitness" / "test.jsonl").read_text().splitlines()[:2])}),
    # "--batch-size and --max-new-tokens must be positive", whichever of them was given
    Case("evaluate-zero-new-tokens", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tiny}",
                                                            "--max-new-tokens", "0"], ["--max-new-tokens 0: must be"]),
    Case("evaluate-negative-batch-size", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tiny}",
                                                                "--batch-size", "-4"], ["--batch-size -4: must be"]),
    Case("evaluate-step-with-model", "gemma_tpu.evaluate", ["--data", f"{CHAT}", "--model", "{tiny}", "--step", "2"],
         ["--step", "--checkpoint", "not --model"]),
    Case("evaluate-step-compare-without-checkpoint", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "model:{tiny}", "model:{tiny}", "--step", "3"],
         ["--step 3", "checkpoint: specs", "--compare names none"]),
    # a step not in digits was read as part of the directory: "checkpoint directory {ckpt}@last does not exist"
    Case("evaluate-compare-step-not-a-number", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "checkpoint:{ckpt}@last", "model:{tiny}"],
         ["--compare 'checkpoint:{ckpt}@last': 'last' is not a step number", "e.g. @200"]),
    # one model named twice was scored twice, the second labelled "(2)"; one directory or server however spelt
    Case("evaluate-compare-one-model-twice", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "model:{tiny}", "model:{tiny}/"],
         ["--compare names one model twice", "model:{tiny}, model:{tiny}/"]),
    Case("evaluate-compare-one-checkpoint-step-twice", "gemma_tpu.evaluate",  # @1 is the latest step, the default
         ["--data", f"{CHAT}", "--compare", "checkpoint:{ckpt}@1", "checkpoint:{ckpt}/"],
         ["--compare names one model twice", "checkpoint:{ckpt}@1, checkpoint:{ckpt}/"]),
    Case("evaluate-compare-one-endpoint-twice", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "endpoint:http://127.0.0.1:9#a", "endpoint:http://127.0.0.1:9/v1#a"],
         ["--compare names one model twice", "endpoint:http://127.0.0.1:9#a"]),
    # one loopback server however named (localhost, 127.0.0.1, [::1]), the http port written or not, a trailing slash
    Case("evaluate-compare-one-loopback-endpoint-twice", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "endpoint:http://localhost:80/#a", "endpoint:http://[::1]/v1#a"],
         ["--compare names one model twice", "endpoint:http://localhost:80/#a"]),
    Case("evaluate-served-model-with-model", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--model", "{tiny}", "--served-model", "coach"],
         ["--served-model", "--endpoint", "not --model"]),
    Case("evaluate-served-model-compare-without-endpoint", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "model:{tiny}", "endpoint:http://127.0.0.1:9#a", "--served-model", "b"],
         ["--served-model b", "endpoint: specs without their own #MODEL", "--compare names none"]),
    # --timeout/--retries/--api-key-env with only local models were silently unused (`--timeout 30` set no limit)
    Case("evaluate-timeout-with-model", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--model", "{tiny}", "--timeout", "30"],
         ["--timeout applies to --endpoint", "not --model"]),
    Case("evaluate-retries-compare-without-endpoint", "gemma_tpu.evaluate",
         ["--data", f"{CHAT}", "--compare", "model:{tiny}", "checkpoint:{ckpt}", "--retries", "0"],
         ["--retries applies to --endpoint", "--compare names none"]),
    Case("local-chat-no-such-model", "gemma_tpu.chat", ["--model", "{tmp}/nope", "--once", "hi"], ["{tmp}/nope"],
         sub=True),
    # ---- fitness data generator and embedded assets
    Case("fitness-bad-seed", "gemma_tpu.examples.fitness", ["generate", "--out", "{tmp}/fit", "--seed", "x1"],
         ["--seed", "'x1'"], sub=True),
    Case("fitness-negative-size", "gemma_tpu.examples.fitness", ["generate", "--out", "{tmp}/fit", "--train", "-5"],
         ["--train -5"]),
    Case("fitness-out-is-a-file", "gemma_tpu.examples.fitness", ["generate", "--out", "{tmp}/fit"],
         ["{tmp}/fit", "not a directory"], {"fit": "not a dir"}),
    # a directory of the user's own data: its train.jsonl was replaced by the coach's, without a word
    Case("fitness-out-holds-other-data", "gemma_tpu.examples.fitness", ["generate", "--out", "{tmp}/d"],
         ["--out {tmp}/d: {tmp}/d/train.jsonl holds data this command did not write", "another --out"],
         {"d/train.jsonl": CHAT.read_text()}),
    # stats read the rows by hand: a non-JSON line or a chat without a tool call was a traceback
    Case("fitness-stats-bad-json", "gemma_tpu.examples.fitness", ["stats", "--data", "{tmp}/d"],
         ["{tmp}/d/train.jsonl:2", "not valid JSON"], {"d/train.jsonl": CHAT.read_text().splitlines()[0] + "\n{oops\n"}),
    Case("fitness-stats-no-splits", "gemma_tpu.examples.fitness", ["stats", "--data", "{tmp}"],
         ["--data {tmp}: holds none of train.jsonl, validation.jsonl, test.jsonl"]),
    Case("fitness-stats-split-is-a-dir", "gemma_tpu.examples.fitness", ["stats", "--data", "{tmp}/d"],
         ["{tmp}/d/test.jsonl: not a file"], {"d/test.jsonl/x": "x"}),
    Case("assets-no-command", "gemma_tpu.assets", [], ["command"]),
    Case("assets-unknown-model", "gemma_tpu.assets", ["prepare", "gemma9-1t", "--cache-dir", "{tmp}/cache"],
         ["gemma9-1t"], sub=True),
    # `--cache-dir "$CACHE"` with CACHE unset: the model was prepared into ./embedded of the working directory
    Case("assets-empty-cache-dir", "gemma_tpu.assets", ["prepare", "tiny-gemma3", "--cache-dir", ""],
         ["argument --cache-dir: an empty path names no cache directory to write"]),
]

MAIN = {"gemma_tpu.assets": "_main"}  # the function cli_main wraps, where it is not `main`
# Command packages whose `__main__` calls a `main` kept in a module of the package.
MAIN_MODULE = {"gemma_tpu.train": "gemma_tpu.train.run", "gemma_tpu.evaluate": "gemma_tpu.evaluate.run",
               "gemma_tpu.assets": "gemma_tpu.assets.embedded", "gemma_tpu.examples.fitness": "gemma_tpu.examples.fitness.__main__"}


# ------------------------------------------------------------------------------- machinery

SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "gemma_tpu.egg-info"}


def snapshot(root: Path, repo: bool = False) -> dict[str, tuple]:
    """path -> (kind, size, mtime_ns) of everything under root. For the repository (repo=True): files
    only, without caches, virtualenv and git, and without source files (.py/.md), which people may be
    editing while the tests run (no entry point writes them)."""
    out: dict[str, tuple] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not (repo and d in SKIP_DIRS)]
        d = Path(dirpath)
        if not repo:
            st = d.stat()
            out[str(d)] = ("dir", 0, st.st_mtime_ns)
        for name in filenames:
            p = d / name
            if repo and p.suffix in (".py", ".md"):
                continue
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            out[str(p)] = ("file", st.st_size, st.st_mtime_ns)
    return out


def diff(before: dict, after: dict) -> list[str]:
    changed = [f"new {p}" for p in sorted(set(after) - set(before))]
    changed += [f"removed {p}" for p in sorted(set(before) - set(after))]
    changed += [f"changed {p}" for p in sorted(set(before) & set(after)) if before[p] != after[p]]
    return changed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shared(tiny_dir, tmp_path_factory) -> dict:
    """The tiny model and a 1-step LoRA checkpoint of it, both read-only for the cases."""
    root = tmp_path_factory.mktemp("bad_inputs")
    ckpt = root / "ckpt"
    proc = run_cli("gemma_tpu.train", "--config", str(REPO / "configs" / "tiny.yaml"), f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", "train.max_steps=1", "checkpoint.every_steps=1",
                   "checkpoint.async_save=false", "data.eval_path=null", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"tiny": str(tiny_dir), "ckpt": str(ckpt), "repo": str(REPO), "port": free_port()}


def prepare(case: Case, tmp: Path, ctx: dict) -> list[str]:
    """Create the case's files under tmp; the argv with placeholders filled in."""
    for rel, content in case.files.items():
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/"):
            dest.mkdir()
        elif callable(content):
            content(dest, ctx)
        elif isinstance(content, bytes):
            dest.write_bytes(content)
        else:
            dest.write_text(fill(content, ctx))
    return [fill(a, ctx) for a in case.argv]


def invoke(case: Case, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m ENTRY argv` (sub=True), else the same `main` through `cli_main` in this process."""
    if case.sub:
        return run_cli(case.entry, *argv, cwd=cwd, timeout=300)
    from gemma_tpu.core.cli import cli_main

    module = importlib.import_module(MAIN_MODULE.get(case.entry, case.entry))
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(getattr(module, MAIN.get(case.entry, "main")), argv)
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input(case: Case, shared, tmp_path):
    ctx = {**shared, "tmp": str(tmp_path)}
    argv = prepare(case, tmp_path, ctx)
    roots = [tmp_path, Path(shared["tiny"]), Path(shared["ckpt"])]
    before = [snapshot(r) for r in roots] + [snapshot(REPO, repo=True)]
    proc = invoke(case, argv, tmp_path)
    after = [snapshot(r) for r in roots] + [snapshot(REPO, repo=True)]
    line = assert_one_line_error(proc, *(fill(n, ctx) for n in case.needles))
    assert "Traceback" not in proc.stdout
    changes = [c for b, a in zip(before, after) for c in diff(b, a)]
    assert not changes, f"{case.id} wrote or changed files: {changes[:10]} ({line})"


def test_there_are_enough_cases():
    entries = {c.entry for c in CASES}
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert {c.entry for c in CASES if c.sub} == entries, "every entry point needs one real subprocess case"


def test_debug_shows_the_traceback(shared, tmp_path):
    case = next(c for c in CASES if c.id == "config-unknown-key")
    argv = prepare(case, tmp_path, {**shared, "tmp": str(tmp_path)})
    proc = invoke(dataclasses.replace(case, sub=True), [*argv, "--debug"], tmp_path)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UserError" in proc.stderr and "train.max_step" in proc.stderr

"""The GGUF export on the real model, through llama.cpp: file sizes, export cost, tokens/s on this CPU,
tokenizer agreement and greedy agreement with the HF model.

    python benchmarks/edge_gguf.py [--model embedded:gemma3-270m | --checkpoint RUN] [--types f16,q8_0,q4_0]
        [--n 40] [--max-new 32] [--threads 2] [--workdir DIR] [--json OUT]

Needs `pip install -e '.[edge]'` (llama-cpp-python builds llama.cpp from source). For each type it
exports with `python -m convert.export_gguf` (wall time, peak RSS of the process, file size), then
loads the file in llama.cpp and, on the first `--n` conversations of data/fitness/test.jsonl rendered
as the coach renders them (tools, question; generation prompt):
* tokenization: llama.cpp's tokens of each prompt and of a set of hard strings (non-ASCII scripts,
  digits, whitespace runs, emoji, markup, the tool-call markers) vs our HF tokenizer's;
* greedy decoding of up to `--max-new` tokens (stops: the GGUF's end-of-generation tokens) vs
  transformers' greedy decoding of the HF model in fp32 (same stops): identical token sequences,
  identical first token, and for tool-calling models identical parsed tool calls;
* speed: prompt tokens/s (prefill) and generated tokens/s, single sequence, `--threads` threads.
Prints a table and writes JSON (default benchmarks/results/edge_gguf_<model>.json).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_info, cpu_label  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402

HARD_STRINGS = [  # also tests/test_export_gguf.py's tokenizer cases
    "The capital of France is",
    "  two leading, three trailing   ",
    "tabs\tand\t\tnewlines\n\n\nend",
    "1234567890 3.14159 -42 1e-6 2026-11-23",
    "naïve café, Straße, 中文, 日本語, Русский, العربية, हिन्दी, 한국어",
    "emoji 🏋️‍♂️💪🏽 and a rare char \U0001d539",
    "def f(x):\n    return x ** 2  # <b>bold</b> <table><tr>",
    "<start_of_turn>user\nHow many steps did I walk?<end_of_turn>\n<start_of_turn>model\n",
    "<start_function_call>call:get_steps{date:<escape>2026-11-23<escape>}<end_function_call><start_function_response>",
    "<start_function_response>response:get_steps{steps:8421}<end_function_response>",
    "<start_function_declaration>declaration:get_steps{description:<escape>Steps<escape>}<end_function_declaration>",
    "     \n\n   \t ",
    "ÀÉÎÕÜ àéîõü ñ ç ß ø å æ œ",
]




# Runs the export in a fresh interpreter and reports that process's own VmHWM. (wait4's ru_maxrss is no use here:
# Linux carries the parent's high-water mark into a forked child across exec, so a child of this process, which
# holds the HF model, "peaks" at this process's size.)
_PEAK_WRAPPER = """
import atexit, runpy, sys
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("PEAK_RSS_KB " + line.split()[1] + "\\n")
atexit.register(_peak)
sys.argv = ["convert.export_gguf", *sys.argv[1:]]
runpy.run_module("convert.export_gguf", run_name="__main__")
"""


def export(src_args: list[str], out: Path, kind: str) -> dict:
    cmd = [sys.executable, "-c", _PEAK_WRAPPER, *src_args, "--out", str(out), "--type", kind, "--overwrite"]
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        err = proc.stderr.strip()
        sys.exit(f"export failed ({kind}): {err.splitlines()[-1] if err else proc.returncode}")
    peak = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    return {"seconds": round(wall, 1), "peak_rss_mb": round(int(peak[-1]) / 1024, 1) if peak else None,
            "bytes": out.stat().st_size}


def render_prompts(tokenizer, n: int) -> tuple[list[dict], dict]:
    """The first n test decisions (prompt up to the first assistant turn), rendered as training
    and `gemma_tpu.evaluate` render them; and the token map used."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations, make_renderer
    from gemma_tpu.evaluate.run import build_cases, render_prompt
    from gemma_tpu.formats.function_calling import function_token_map

    token_map = function_token_map(tokenizer)
    data_cfg = DataConfig()
    renderer = make_renderer(tokenizer, data_cfg, "gemma", token_map)
    cases = build_cases(load_conversations(str(REPO / "data/fitness/test.jsonl"), data_cfg))[:n]
    out = []
    for case in cases:
        r = render_prompt(renderer, case)
        out.append({"text": r.text, "ids": list(r.ids)})
    return out, token_map


def reload_check(path: Path, hf_logits: list, prompts: list[dict]) -> dict:
    """transformers' own GGUF loader on the file vs the HF model: max abs logit diff, mean KL, argmax."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    diffs, kls, agree, n = [], [], 0, 0
    with torch.no_grad():
        for pr, ref in zip(prompts, hf_logits):
            got = model(input_ids=torch.tensor([pr["ids"]])).logits[0].float().numpy()
            diffs.append(float(np.abs(got - ref).max()))
            la = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
            lb = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
            kls.append((np.exp(la) * (la - lb)).sum(-1))
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            n += len(ref)
    del model
    kl = np.concatenate(kls)
    return {"tf_max_abs_diff": max(diffs), "tf_kl_mean": float(kl.mean()), "tf_kl_max": float(kl.max()),
            "tf_argmax_agree": agree / n, "tf_positions": n}


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF dir or embedded:NAME (default embedded:gemma3-270m)")
    src.add_argument("--checkpoint", help="a gemma-tpu checkpoint (merged on the fly by the export)")
    p.add_argument("--types", default="f16,q8_0,q4_0")
    p.add_argument("--n", type=cli.integer(1), default=40, help="test conversations to decode")
    p.add_argument("--max-new", type=cli.integer(1), default=32)
    p.add_argument("--threads", type=cli.integer(1), default=2)
    p.add_argument("--workdir", type=cli.work_dir)
    p.add_argument("--no-llama", action="store_true", help="only the export and the transformers reload check")
    p.add_argument("--logit-prompts", type=cli.integer(0), default=4, help="prompts for the transformers logits check")
    p.add_argument("--json")
    args = p.parse_args()
    check_json(args.json)
    try:
        import llama_cpp
    except ImportError:
        if not args.no_llama:
            sys.exit("llama-cpp-python is not installed: pip install -e '.[edge]' (or --no-llama)")
        llama_cpp = None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemma_tpu.hf.directory import resolve_path

    if args.checkpoint:
        from convert.merge_orbax import plan_tensors

        plan_tensors(args.checkpoint)  # a bad checkpoint refused in one line before the merge subprocess
        hf_dir, label = None, Path(args.checkpoint).name
        src_args = ["--checkpoint", args.checkpoint]
        merged_dir = Path(tempfile.mkdtemp(prefix="edge-merged-"))
        subprocess.run([sys.executable, "-m", "convert.merge_orbax", "--checkpoint", args.checkpoint, "--out",
                        str(merged_dir / "m"), "--dtype", "float32"], cwd=REPO, check=True)
        hf_dir = merged_dir / "m"
    else:
        spec = args.model or "embedded:gemma3-270m"
        hf_dir = resolve_path(spec)
        label = spec.replace("embedded:", "").replace("/", "_")
        src_args = ["--merged", str(hf_dir)]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="edge-gguf-"))
    work.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    prompts, token_map = render_prompts(tokenizer, args.n)
    from gemma_tpu.formats.function_calling import parse_reply

    def parsed(ids: list[int]):
        reply = parse_reply(tokenizer.decode(ids, skip_special_tokens=False), token_map)
        return reply.kind, [(c.name, c.arguments) for c in reply.calls]
    stop_ids = set()
    gen_path = hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", [1, 106])
    stop_ids |= set([eos] if isinstance(eos, int) else eos)
    resp = tokenizer.convert_tokens_to_ids("<start_function_response>")
    if isinstance(resp, int) and resp != tokenizer.unk_token_id:
        stop_ids.add(resp)

    # the HF reference, fp32, greedy
    print(f"HF greedy on {len(prompts)} prompts ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    hf_out, t = [], time.monotonic()
    with torch.no_grad():
        for pr in (prompts if llama_cpp is not None else []):
            ids = torch.tensor([pr["ids"]])
            out = model.generate(ids, max_new_tokens=args.max_new, do_sample=False, eos_token_id=sorted(stop_ids),
                                 pad_token_id=0)
            toks = out[0, ids.shape[1]:].tolist()
            cut = next((i for i, x in enumerate(toks) if x in stop_ids), len(toks))
            hf_out.append(toks[:cut])
    hf_seconds = time.monotonic() - t
    with torch.no_grad():
        hf_logits = [model(input_ids=torch.tensor([pr["ids"]])).logits[0].float().numpy()
                     for pr in prompts[:args.logit_prompts]]
    del model

    results = []
    for kind in args.types.split(","):
        path = work / f"{label}-{kind}.gguf"
        print(f"export {kind} ...", file=sys.stderr)
        ex = export(src_args, path, kind)
        row = {"type": kind, **ex, "file_mb": round(ex["bytes"] / 1e6, 1), **reload_check(path, hf_logits, prompts)}
        print(json.dumps(row), file=sys.stderr)
        if llama_cpp is None:
            results.append(row)
            continue
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                              n_batch=512, verbose=False)
        vocab = llm._model.vocab
        tok_mismatch = []
        for text in HARD_STRINGS + [pr["text"] for pr in prompts]:
            ours = tokenizer(text, add_special_tokens=False).input_ids
            theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
            if list(ours) != list(theirs):
                tok_mismatch.append(text[:60])
        same, first, calls_same, prefill_tok, prefill_s, dec_tok, dec_s = 0, 0, 0, 0, 0.0, 0, 0.0
        for pr, ref in zip(prompts, hf_out):
            llm.reset()
            t0 = time.monotonic()
            llm.eval(pr["ids"])
            prefill_s += time.monotonic() - t0
            prefill_tok += len(pr["ids"])
            got = []
            t0 = time.monotonic()
            for _ in range(args.max_new):
                tok = llm.sample(top_k=1, temp=0.0)
                if llama_cpp.llama_vocab_is_eog(vocab, tok):
                    break
                got.append(tok)
                llm.eval([tok])
            dec_s += time.monotonic() - t0
            dec_tok += len(got) + 1
            same += got == ref
            first += (got[:1] == ref[:1])
            calls_same += parsed(got) == parsed(ref)
        row.update({
               "tokenization_mismatches": len(tok_mismatch), "tokenization_checked": len(HARD_STRINGS) + len(prompts),
               "tokenization_mismatch_examples": tok_mismatch[:3],
               "greedy_identical": same, "first_token_identical": first, "parsed_reply_identical": calls_same,
               "prompts": len(prompts),
               "prefill_tokens_per_s": round(prefill_tok / max(prefill_s, 1e-9), 1),
               "decode_tokens_per_s": round(dec_tok / max(dec_s, 1e-9), 1)})
        results.append(row)
        del llm
        print(json.dumps(row), file=sys.stderr)

    print(f"\n{label}: {len(prompts)} fitness test prompts, greedy up to {args.max_new} tokens, "
          f"{args.threads} threads, {cpu_label()}")
    print("| type | file | export | export peak RSS | transformers reload: max abs logit diff | mean KL "
          "| argmax agree |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['type']} | {r['file_mb']} MB | {r['seconds']} s | {r['peak_rss_mb']} MB | "
              f"{r['tf_max_abs_diff']:.3g} | {r['tf_kl_mean']:.3g} | {r['tf_argmax_agree']:.4f} |")
    if llama_cpp is not None:
        print()
        print("| type | file | export | export peak RSS | tokenizer equal | greedy identical | first token "
              "| parsed reply identical | prefill tok/s | decode tok/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in (results if llama_cpp is not None else []):
        print(f"| {r['type']} | {r['file_mb']} MB | {r['seconds']} s | {r['peak_rss_mb']} MB | "
              f"{r['tokenization_checked'] - r['tokenization_mismatches']}/{r['tokenization_checked']} | "
              f"{r['greedy_identical']}/{r['prompts']} | {r['first_token_identical']}/{r['prompts']} | "
              f"{r['parsed_reply_identical']}/{r['prompts']} | "
              f"{r['prefill_tokens_per_s']} | {r['decode_tokens_per_s']} |")
    versions = {}
    from importlib import metadata

    for dist in ("llama-cpp-python", "gguf", "transformers", "torch", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    res = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "machine": {**cpu_info(), "cpus_usable": len(os.sched_getaffinity(0)),
                       "load_avg": os.getloadavg(), "versions": versions},
           "model": label, "n_prompts": len(prompts), "max_new_tokens": args.max_new, "threads": args.threads,
           "hf_greedy_seconds": round(hf_seconds, 1), "results": results}
    out = write_json(args.json or REPO / "benchmarks" / "results" / f"edge_gguf_{label}.json", res)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmarks end to end on the tiny model: training throughput (both sides), prefix-cached evaluation, and
the two shared-prefix training layouts."""

import json
import math
import os
import subprocess
import sys

import pytest

from gemma_tpu.core.errors import UserError
from tests.conftest import REPO


def test_train_throughput_tiny_both_sides(tmp_path):
    # short chats keep rendering (done by both children) quick and fit the tiny model's 1,024 positions whichever
    # tokenizer tiny-gemma3 carries (the real Gemma 3 one when gemma3-270m is prepared in the same cache, else a
    # character-level one, under which a fitness-coach example is ~1,700 ids)
    subset = tmp_path / "short-chats-8.jsonl"
    subset.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"How many push-ups should I do on day {i} of my plan?"},
        {"role": "assistant", "content": f"Start with {10 + i} push-ups in three sets, resting a minute between."},
    ]}) + "\n" for i in range(8)))
    seq_len = 512
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", "--model", "embedded:tiny-gemma3", "--config",
         "configs/tiny.yaml", "--data", str(subset), "--steps", "1", "--warmup", "1", "--batch", "1",
         "--seq-len", str(seq_len), "--device", "cpu", "--json", str(out), "--sides", "ours,torch"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ours/torch useful tokens/s" in proc.stdout and "initial loss" in proc.stdout
    # the unshared side (the same trainer with data.share_prefix=off) is left out: ~45 s of the suite's 45 minutes

    res = json.loads(out.read_text())
    for key in ("date", "command", "machine", "settings", "sides", "ratio_useful_tokens_per_s", "initial_loss"):
        assert key in res, key
    for key in ("cpu_model", "cpus_usable", "versions"):
        assert key in res["machine"], key
    assert res["machine"]["versions"]["torch"] and res["machine"]["versions"]["jax"]
    assert res["settings"]["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                       "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]}
    ours, torch = res["sides"]["ours"], res["sides"]["torch"]
    for side in (ours, torch):
        for key in ("s_per_step", "examples_per_s", "tokens_per_s", "useful_tokens_per_s", "nonpad_tokens_per_s",
                    "tflops_per_s", "peak_rss_gb", "initial_loss"):
            assert side[key] is not None and side[key] > 0, key
        assert len(side["step_times"]) == 2 and side["timed_steps"] == 1
    assert ours["compiles"] == 1 and ours["eval_compiles"] == 0
    # same rows on both sides: same token counts per step
    assert ours["useful_tokens_per_step"] == torch["useful_tokens_per_step"] > 0
    assert ours["examples_per_step"] == torch["examples_per_step"] == 1  # batch 1, padded: one example a row
    assert "ours/torch trained examples/s" in proc.stdout
    assert ours["tokens_per_step"] == torch["tokens_per_step"] == seq_len
    lo, lt = ours["initial_loss"], torch["initial_loss"]
    assert math.isfinite(lo) and math.isfinite(lt)
    assert abs(lo - lt) < 1e-3 * max(1.0, abs(lt)), (lo, lt)
    assert res["initial_loss"]["match"] is True
    assert res["ratio_useful_tokens_per_s"] > 0


def _eval_prefix_cache(tmp_path, *args) -> tuple[str, dict]:
    """benchmarks/eval_prefix_cache.py on the tiny model: (its stdout, its JSON record)."""
    out = tmp_path / "eval_prefix_cache.json"
    proc = subprocess.run([sys.executable, "benchmarks/eval_prefix_cache.py", *args, "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_eval_prefix_cache_tiny(tmp_path):
    """Both sides of the prefix-cache evaluation benchmark on the tiny model: identical predictions,
    a table and the JSON record."""
    stdout, res = _eval_prefix_cache(tmp_path, "--limit", "4", "--batch-size", "2", "--max-new-tokens", "4",
                                     "--fixed-date", "2025-06-15")
    assert "predictions identical: yes" in stdout and "speed-up" in stdout
    assert res["identical"] is True and res["settings"]["n"] == 4 and res["settings"]["fixed_date"] == "2025-06-15"
    assert res["sides"]["prefix cache"]["prefix_stats"]["computed"] == 1
    assert res["sides"]["prefix cache"]["prefix_stats"]["reused_batches"] == 2
    assert res["settings"]["shared_prefix_tokens"] > 300  # the developer turn with the declarations
    assert res["machine"]["cpu_model"]


def test_eval_prefix_cache_sides_each_pay_their_compilations(tmp_path):
    """Prompts with no shared prefix: the cached side runs the uncached side's functions. Generators of one model
    share their jitted functions, so it ran on the first side's compilations and reported a 781x speed-up (0.0 s)
    for the same work; each side now compiles its own, as an evaluation run alone does."""
    sides = _eval_prefix_cache(tmp_path, "--data", "tests/data/chat_sample.jsonl", "--limit", "2", "--batch-size",
                               "2", "--max-new-tokens", "2")[1]["sides"]
    assert sides["prefix cache"]["prefix_stats"]["computed"] == 0  # no prefix: the same path as uncached
    assert sides["prefix cache"]["compilations"] == sides["uncached"]["compilations"] > 0


def test_eval_prefix_cache_asks_a_given_answer_start_as_evaluate_does(tmp_path):
    """A row whose prompt gives the start of its answer (TRL's continue_final_message): `gemma_tpu.evaluate` asks the
    model to continue that start; the benchmark rendered every prompt with a generation prompt, so it timed prompts
    without the start (a prompt evaluation never asks). Its prompt is the tokenizer's continue_final_message one."""
    from gemma_tpu.infer.generate import describe_hf_dir

    prompt = [{"role": "user", "content": "What is six times seven?"},
              {"role": "assistant", "content": "The answer is six times seven, which is"}]
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": " 42."}]}) + "\n")
    tok = describe_hf_dir("embedded:tiny-gemma3").tokenizer
    served = tok.apply_chat_template(prompt, tokenize=True, continue_final_message=True, return_dict=False)
    res = _eval_prefix_cache(tmp_path, "--data", str(data), "--limit", "1", "--batch-size", "1",
                             "--max-new-tokens", "1")[1]
    assert res["settings"]["prompt_tokens"]["max"] == len(served)


def test_prefix_layouts_tiny(tmp_path):
    """The broadcast shared-prefix layout on the tiny model (window 16, so its suffixes sit past it): its loss
    and LoRA gradients equal one conversation a row. Only the check runs: the timed sides are the check's
    step functions under a timer (each a child process, ~45 s of the suite; the suite ran 46 min on the AVX2
    EPYC, 2026-11-26); the tree side is the trainer's own layout, timed by every training test."""
    system = ("You are a careful assistant for a bakery. Answer in one short sentence, and name the price. "
              "Prices are in euros; items are numbered; never invent an item that is not on the list.")
    data = tmp_path / "bakery.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Price of item {i}?" + " Please." * (i % 5)},
        {"role": "assistant", "content": f"Item {i} costs {i % 7 + 1} euros."}]}) + "\n" for i in range(40)))
    out = tmp_path / "layouts.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/prefix_layouts.py", "--model", "embedded:tiny-gemma3", "--config",
         "configs/tiny.yaml", "--set", f"data.train_path={data}", "--set", "data.seq_len=256", "--check",
         "--sides", "", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = {r["side"]: r for r in json.loads(out.read_text())["results"]}
    check = res["check"]
    assert check["loss_abs_diff"] < 1e-5 and check["grad_max_abs_diff"] < 1e-5, check
    assert check["grad_max_abs"] > 1e-3  # gradients that could differ
    assert set(res) == {"check"}
    assert "check (" in proc.stdout


def test_eval_compiles_tiny(tmp_path):
    """The compare-evaluation compile benchmark on the tiny model compared with itself: the shared side
    compiles nothing for the second model, the separate side does, and both predict the same."""
    out = tmp_path / "eval_compiles.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/eval_compiles.py", "--a", "embedded:tiny-gemma3", "--b", "embedded:tiny-gemma3",
         "--limit", "3", "--batch-size", "2", "--max-new-tokens", "4", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "predictions identical: True" in proc.stdout
    res = json.loads(out.read_text())
    shared, separate = (res["sides"][s]["models"] for s in ("shared", "separate"))
    first, second = (k for k in shared if k != "(loading)")
    assert shared[first]["compilations"] >= 2 and shared[second]["compilations"] == 0
    assert separate[second]["compilations"] == separate[first]["compilations"]
    assert res["cpu"]["cpu_model"]


def test_recipe_sweep_reads_held_out_sets_as_training_reads_data(tmp_path):
    """The held-out sets were copied into one JSONL by their text lines: a JSON array (or gzip, Parquet) set made
    every recipe's evaluation fail after its training; two sets of one name were one column of the table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from recipe_sweep import combine_heldout

    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "é"}]}
    arr, lines = tmp_path / "val.json", tmp_path / "test.jsonl"
    arr.write_text(json.dumps([row, row], indent=2))
    lines.write_text("\ufeff" + json.dumps(row) + "\r\n\n" + json.dumps(row))
    out, spans = combine_heldout([str(arr), str(lines)])
    assert [json.loads(x) for x in out] == [row] * 4 and spans == [("val", 0, 2), ("test", 2, 4)]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "test.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="another held-out set is also named 'test'"):
        combine_heldout([str(lines), str(tmp_path / "b" / "test.jsonl")])


def test_recipe_sweep_scores_each_set_apart():
    """The sweep evaluates all held-out sets in one run and scores each set on its own slice of the replies."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pytest
    from recipe_sweep import parse_recipe, score_spans

    from gemma_tpu.evaluate.run import build_cases, scored
    from gemma_tpu.formats.function_calling import parse_reply

    assert parse_recipe("lr2e3: train.learning_rate=0.002 train.max_steps=32") == (
        "lr2e3", ["train.learning_rate=0.002", "train.max_steps=32"])
    assert parse_recipe("main:") == ("main", [])
    for bad, says in (("no colon", "expected 'NAME: key=value"), ("a/b: x=1", "expected"),
                      ("r: train.max_steps", "is not a key=value")):
        with pytest.raises(SystemExit, match=says):
            parse_recipe(bad)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("get_steps", "get_sleep")]

    def conv(name):
        return {"tools": tools, "messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "tool_calls": [{"name": name, "arguments": {}}]}]}

    def raw(name):
        return f"<start_function_call>call:{name}{{}}<end_function_call>"

    convs = [conv("get_steps"), conv("get_sleep"), conv("get_steps")]
    replies = [raw("get_steps")] * 3
    records = scored(build_cases(convs), [parse_reply(r) for r in replies], replies, None, 0.0)[1]
    got = score_spans(convs, records, [("test", 0, 2), ("validation", 2, 3)])
    assert (got["test"]["n"], got["test"]["tool_accuracy"]) == (2, 0.5)
    assert (got["validation"]["n"], got["validation"]["tool_accuracy"]) == (1, 1.0)
    with pytest.raises(ValueError, match="3 conversations but 2"):
        score_spans(convs, records[:2], [("test", 0, 3)])


def test_recipe_sweep_scores_each_reply_as_evaluate_scored_it():
    """A prompt past the model's context is refused and scored as wrong by `gemma_tpu.evaluate`; its record's raw
    reply is empty, which the sweep parsed again as an answer without a call: right, where the reference makes none.
    The sweep's numbers of a set now equal evaluate's own for the same replies."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from recipe_sweep import score_spans

    from gemma_tpu.evaluate.run import build_cases, refuse, scored
    from gemma_tpu.formats.function_calling import parse_reply

    tools = [{"type": "function", "function": {"name": "get_steps", "parameters": {"type": "object",
                                                                                     "properties": {}}}}]
    convs = [{"tools": tools, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", **answer}]}
             for i, answer in enumerate([{"content": "No tool needed."},
                                         {"tool_calls": [{"name": "get_steps", "arguments": {}}]},
                                         {"content": "Fine."}])]
    cases = build_cases(convs)
    raws = ["No tool needed.", "<start_function_call>call:get_steps{}<end_function_call>", ""]
    preds = [parse_reply(raws[0]), parse_reply(raws[1]), refuse(cases[2], 3, "the prompt is 600 tokens")]
    metrics, records = scored(cases, preds, raws, None, 0.0)
    assert metrics["tool_accuracy"] == pytest.approx(2 / 3)
    got = score_spans(convs, records, [("test", 0, 3)])["test"]
    assert {k: got[k] for k in ("tool_accuracy", "argument_accuracy", "format_error_rate")} == pytest.approx(
        {k: metrics[k] for k in ("tool_accuracy", "argument_accuracy", "format_error_rate")})


# Each benchmark wrote its --json at the end of the run, unchecked: a path it could not write (under a file, in a
# folder not writable) was a traceback after minutes of measurement, the results lost; a --json naming an input or
# another file replaced it. All are refused first now, in one line, with nothing written.
BENCHMARKS_WITH_JSON = ["train_throughput", "data_efficiency", "eval_prefix_cache", "prefix_layouts", "kill_harness",
                        "merge", "startup", "edge_gguf"]


def test_benchmarks_refuse_a_json_they_could_not_write_before_running(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": []}\n')
    for name in BENCHMARKS_WITH_JSON + ["eval_compiles"]:
        extra = ["--b", str(tmp_path / "nope")] if name == "eval_compiles" else []
        for bad, why in ((data / "r.json", f"{data} is not a directory"), (tmp_path, "is a directory"),
                         (data, "exists and is not an earlier results file of this command")):
            proc = subprocess.run([sys.executable, f"benchmarks/{name}.py", *extra, "--json", str(bad)], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
            assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --json {bad}") and why in proc.stderr, (
                name, proc.stderr[-2000:])
    assert data.read_text() == '{"messages": []}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]


@pytest.mark.parametrize("args, needle", [
    (["data_efficiency", "--seq-lens", "256,abc"], "argument --seq-lens: 'abc' is not an integer"),  # ValueError
    (["data_efficiency", "--seq-lens", "0"], "argument --seq-lens: '0': expected an integer >= 1"),  # ran, wrote
    (["data_efficiency", "--batch-size", "0"], "argument --batch-size: '0': expected"),  # ZeroDivisionError
    (["eval_compiles", "--b", "x", "--limit", "0"], "argument --limit: '0': expected"),  # a child's traceback
    (["prefix_layouts", "--sides", "tree,bogus"], "--sides 'tree,bogus': choose from tree, broadcast"),  # ran tree
    (["kill_harness", "--per-chain", "-1"], "argument --per-chain: '-1': expected"),
    (["merge", "--scale", "0"], "argument --scale: '0': expected a number > 0"),
    (["train_throughput", "--seq-len", "0"], "argument --seq-len: '0': expected"),
    # a work dir that is a file (or under one): 'error: File exists: X' (the option not named) or a traceback, after
    # the benchmark had started; a negative count or tolerance ran a whole benchmark (or stopped it without 'error:')
    (["train_throughput", "--workdir", "README.md"], "argument --workdir: 'README.md' is a file, not a directory"),
    (["train_throughput", "--workdir", "README.md/w"],
     f"argument --workdir: 'README.md/w': {REPO}/README.md is a file"),
    (["kill_harness", "--work", "README.md"], "argument --work: 'README.md' is a file, not a directory"),
    (["merge", "--workdir", "README.md"], "argument --workdir: 'README.md' is a file, not a directory"),
    (["edge_gguf", "--workdir", "README.md"], "argument --workdir: 'README.md' is a file, not a directory"),
    (["recipe_sweep", "--config", "configs/tiny.yaml", "--recipe", "a: train.max_steps=1", "--eval",
      "tests/data/chat_sample.jsonl", "--out", "README.md"], "argument --out: 'README.md' is a file, not a directory"),
    # a missing input was found by a child, after the parent had started it: 'the separate child failed (exit 2)'
    (["eval_compiles", "--b", "x", "--data", "no/such.jsonl"], "error: --data no/such.jsonl: no such file"),
    (["prefix_layouts", "--config", "no/such.yaml"], "no/such.yaml"),
    (["prefix_layouts", "--set", "bogus.key=1"], "error: override 'bogus.key=1': unknown config key 'bogus'"),
    (["eval_prefix_cache", "--fixed-date", "2024-13-45"], "error: --fixed-date 2024-13-45: expected a date"),
    (["train_throughput", "--steps", "-1"], "argument --steps: '-1': expected an integer >= 1"),
    (["train_throughput", "--loss-tol", "-1"], "argument --loss-tol: '-1': expected a number >= 0"),
    (["train_throughput", "--loss-tol", "-1e-3"], "argument --loss-tol: '-1e-3': expected a number >= 0"),
    (["merge", "--scale", "-1e-2"], "argument --scale: '-1e-2': expected a number > 0"),  # 'expected one argument'
    # a model or tokenizer directory that is not there: a traceback, the parent's or a child's after others had run
    (["data_efficiency", "--tokenizer", "no/such/tok"], "error: --tokenizer no/such/tok: no such directory"),
    (["train_throughput", "--model", "no/such/model"], "error: --model no/such/model: no such directory"),
    (["prefix_layouts", "--model", "no/such/model"], "error: --model no/such/model: no such directory"),
    (["eval_compiles", "--b", "no/such/model"], "error: --b no/such/model: no such directory"),
    (["startup", "--model", "no/such/model"], "error: --model no/such/model: no such directory"),
    (["kill_harness", "--model", "no/such/model"], "error: --model no/such/model: no such directory"),
    # an owner/name neither here nor downloaded: each child tried the hub (offline, failing after the others ran)
    (["eval_compiles", "--b", "nosuchowner/nosuchmodel"],
     "error: --b nosuchowner/nosuchmodel: no such directory, nor a hub model downloaded to this machine; benchmarks "
     "do not download"),
    (["startup", "--model", "runs/merged-typo"], "error: --model runs/merged-typo: no such directory, nor a hub model"),
    # a bad override was a child's traceback after the data child had rendered the set
    (["train_throughput", "--set", "bogus.key=1"], "error: override 'bogus.key=1': unknown config key 'bogus'"),
    (["train_throughput", "--baseline-set", "data.seq_len=x"], "data.seq_len: expected an integer, got 'x'"),
    (["train_throughput", "--data", "no/such.jsonl"], "no/such.jsonl: no such file"),  # left an empty temp dir
    (["recipe_sweep", "--config", "configs/tiny.yaml", "--recipe", "a: data.seq_len=x", "--eval",
      "tests/data/chat_sample.jsonl", "--out", "{tmp}/sweep"],  # each such recipe trained and failed
     "error: --recipe a: override 'data.seq_len=x': data.seq_len: expected an integer"),
])
def test_benchmark_argument_errors_are_one_line_before_anything_runs(tmp_path, args, needle):
    temp = tmp_path / "tmp"  # what the benchmark would leave in the temp dir
    temp.mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, f"benchmarks/{args[0]}.py", *args[1:], "--json", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert needle in (proc.stderr.strip().splitlines() or [""])[-1], proc.stdout[-2000:] + proc.stderr[-2000:]
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's cache, not ours
    assert list(tmp_path.iterdir()) == [temp] and left == []


# A benchmark child writes its results for the parent to read; it wrote them in place, so a child stopped mid-write
# (its disk full; here a 10 KB file-size limit, set by `limit()`) left half a file. The child's work is replaced by
# a fake returning 100 KB.
CHILD_WRITES = {
    "train_throughput": ("benchmarks.train_throughput",
                         "t.CHILDREN['fake'] = lambda spec: limit() or {'x': 'y' * 100_000}",
                         ["--child", "fake", "--spec", "{spec}", "--out", "{out}"]),
    "eval_compiles": ("benchmarks.eval_compiles",
                      "import gemma_tpu.evaluate.run as r\n"
                      "def fake(argv, **kw):\n"
                      "    doc = {'examples': {'m': [{'raw': 'y' * 100_000}]}}\n"
                      "    open(argv[argv.index('--json') + 1], 'w').write(json.dumps(doc))\n"
                      "    limit()\n"
                      "r.main = fake",
                      ["--child", "shared", "--b", "x", "--out", "{out}"]),
}


@pytest.mark.parametrize("name", sorted(CHILD_WRITES))
def test_a_benchmark_child_stopped_mid_write_leaves_no_half_results(tmp_path, name):
    module, fake, argv = CHILD_WRITES[name]
    spec, out = tmp_path / "spec.json", tmp_path / "out" / "child.json"
    out.parent.mkdir()
    spec.write_text("{}")
    argv = [a.format(spec=spec, out=out) for a in argv]
    code = ("import json, resource, signal, sys\n"
            "def limit():\n"
            "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))\n"
            f"import {module} as t\n{fake}\nfrom gemma_tpu.core import cli\n"
            f"sys.exit(cli.cli_main(t.main, {argv!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"writing {out} failed" in proc.stderr and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert list(out.parent.iterdir()) == []


def test_merge_benchmark_stamps_its_machine_and_date(tmp_path):
    """benchmarks/merge.py's results carried no machine, date or command (every other benchmark records them,
    benchmarks/machine.py): a cp/merge wall time that could not be told apart from another machine's.
    Its --workdir holds what a run stopped while writing the base left (a part of it): that base was taken as is."""
    out = tmp_path / "merge.json"
    (tmp_path / "w" / "base").mkdir(parents=True)
    (tmp_path / "w" / "base" / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 100)
    proc = subprocess.run([sys.executable, "benchmarks/merge.py", "--scale", "0.01", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from benchmarks.machine import cpu_info, cpu_label

    assert f"merge vs cp -r on {cpu_label()}, " in proc.stdout
    res = json.loads(out.read_text())
    assert res["machine"]["cpu_model"] == cpu_info()["cpu_model"] and res["machine"]["cpus"] > 0
    assert res["date"] and "benchmarks/merge.py" in res["command"] and all(res["check"].values())

"""Sampled generation (`gemma_tpu.infer.generate.Sampling`, `python -m gemma_tpu.chat --temperature`): the draws
follow the distribution vLLM's settings describe, repeat with a seed, and do not depend on how a chat chunks its
decode; greedy stays greedy."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

PROMPTS = [[2] + [(7 * i + j) % 400 + 100 for i in range(12)] for j in range(4)]


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from gemma_tpu.infer.generate import load_hf_dir

    return load_hf_dir(str(tiny_dir))


def _draws(logits, temperature=1.0, top_p=1.0, top_k=0, rows=20000, seed=0):
    """`rows` draws from one row of `logits` (each row of the batch draws on its own)."""
    import jax

    from gemma_tpu.infer.generate import Sampling, _pick

    batch = np.broadcast_to(np.asarray(logits, np.float32), (rows, len(logits)))
    key = jax.random.fold_in(np.array([0, seed], np.uint32), 0)
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k).arrays(key)
    return np.bincount(np.asarray(_pick(batch, sampling, 3)), minlength=len(logits)) / rows


LOGITS = [2.0, 1.5, 1.0, 0.0, -1.0, -3.0]


def _softmax(x):
    e = np.exp(np.asarray(x, np.float64) - max(x))
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_tempered_distribution(temperature):
    freq = _draws(LOGITS, temperature=temperature)
    np.testing.assert_allclose(freq, _softmax(np.asarray(LOGITS) / temperature), atol=0.012)


def test_a_temperature_below_vllms_least_is_raised_to_it():
    """vLLM raises a temperature in (0, 0.01) to 0.01 and samples there: two logits 0.02 apart draw 88% / 12%, not
    the likelier one alone as at 1e-6."""
    close = [0.0, -0.02, -5.0]
    np.testing.assert_allclose(_draws(close, temperature=1e-6), _softmax(np.asarray(close) / 0.01), atol=0.012)


def test_top_k_and_top_p_cut_as_vllm_orders_them():
    """top-k first (the 3 likeliest), then top-p over what is left: the likeliest whose mass before them is short
    of p stay, renormalised."""
    freq = _draws(LOGITS, top_k=3)
    np.testing.assert_allclose(freq, np.r_[_softmax(LOGITS[:3]), 0, 0, 0], atol=0.012)
    p = _softmax(LOGITS)  # 0.43, 0.26, 0.16, ...: a top_p of 0.6 keeps two (0.43 < 0.6, 0.69 >= 0.6)
    freq = _draws(LOGITS, top_p=0.6)
    np.testing.assert_allclose(freq, np.r_[p[:2] / p[:2].sum(), 0, 0, 0, 0], atol=0.012)
    freq = _draws(LOGITS, top_p=0.6, top_k=1)  # the likeliest alone
    np.testing.assert_allclose(freq, [1, 0, 0, 0, 0, 0])
    freq = _draws(LOGITS, top_p=1e-6)  # a tiny top_p still keeps the likeliest
    np.testing.assert_allclose(freq, [1, 0, 0, 0, 0, 0])
    assert (_draws(LOGITS, top_k=100) > 0).all()  # a top_k past the vocabulary is every token


def test_sampled_generation_repeats_with_a_seed_and_ignores_chunking(loaded):
    from gemma_tpu.infer.generate import Generator, Sampling

    def run(seed, chunk=None, **kw):
        gen = Generator(loaded, max_new_tokens=10, batch_size=2, prefix_cache=False, decode_chunk=chunk,
                        sampling=Sampling(temperature=1.5, seed=seed, **kw))
        return [o.ids for o in gen.generate(PROMPTS)] + [o.ids for o in gen.generate(PROMPTS[:1])]

    first = run(7)
    assert run(7) == first  # the same seed: the same draws, call after call
    assert run(7, chunk=3) == first  # a chat's chunked decode draws as one call does
    assert run(8) != first
    assert first[0] != first[-1]  # a later call of one generator draws anew
    assert run(2 ** 40 + 7) != first  # the seed's high bits count (PRNGKey kept only the low 32)
    greedy = [o.ids for o in Generator(loaded, max_new_tokens=10, batch_size=2, prefix_cache=False).generate(PROMPTS)]
    assert first[:4] != greedy
    # the likeliest token alone (top_k 1) is the greedy choice, whatever the temperature and seed
    assert run(3, top_k=1)[:4] == greedy
    unseeded = [Generator(loaded, max_new_tokens=10, batch_size=2, prefix_cache=False,
                          sampling=Sampling(temperature=2.0)).generate(PROMPTS) for _ in range(2)]
    assert [o.ids for o in unseeded[0]] != [o.ids for o in unseeded[1]]  # no seed: a fresh one each generator


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 0.0, "temperature 0.0: must be above 0 and at most 2 (0 is greedy"),
    ("temperature", 2.5, "temperature 2.5: must be above 0 and at most 2"),
    ("temperature", float("nan"), "temperature nan"),
    ("top_p", 0.0, "top_p 0.0: must be above 0 and at most 1"),
    ("top_p", 1.5, "top_p 1.5"),
    ("top_k", -1, "top_k -1: must be a whole number, 0 (every token) or more"),
    ("top_k", 2.5, "top_k 2.5"),
    ("seed", 2 ** 64, "seed 18446744073709551616: must be a whole number"),
])
def test_bad_sampling_settings_are_refused_by_name(field, value, message):
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.infer.generate import Sampling

    with pytest.raises(UserError, match=re.escape(message)):
        Sampling(**{"temperature": 1.0, field: value})


def _chat(capsys, model, *args) -> str:
    """The reply `python -m gemma_tpu.chat --once` prints (in this process: the model compiles once per test)."""
    from gemma_tpu.examples.fitness import chat

    capsys.readouterr()
    assert chat.main(["--model", str(model), "--max-new-tokens", "12", *args]) == 0
    return capsys.readouterr().out


def test_chat_samples_with_a_seed_and_the_models_defaults(tiny_long_dir, tmp_path, capsys):
    """`--temperature` samples; with `--sampling-seed` a reply is the same every run; the model's
    generation_config.json top_k / top_p apply where the command line sets none (top_k 1 there: the greedy reply)."""
    question = ["--once", "how many steps did I take yesterday?"]  # tiny_long_dir: a context for the declarations
    greedy = _chat(capsys, tiny_long_dir, *question)
    sampled = _chat(capsys, tiny_long_dir, *question, "--temperature", "2", "--sampling-seed", "5")
    assert sampled.strip() and sampled != greedy
    assert _chat(capsys, tiny_long_dir, *question, "--temperature", "2", "--sampling-seed", "5") == sampled
    model = tmp_path / "model"
    shutil.copytree(tiny_long_dir, model)
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen_path.write_text(json.dumps({**gen, "top_k": 1, "top_p": 0.9}))
    assert _chat(capsys, model, *question, "--temperature", "2", "--sampling-seed", "5") == greedy
    assert _chat(capsys, model, *question, "--temperature", "2", "--sampling-seed", "5", "--top-k", "0",
                 "--top-p", "1") == sampled  # the command line's settings win


@pytest.mark.parametrize("args, message", [
    (["--top-k", "4"], "--top-k applies to sampled replies: add --temperature"),
    (["--temperature", "0", "--sampling-seed", "3"], "--sampling-seed applies to sampled replies"),
    (["--temperature", "2.5"], "argument --temperature: '2.5': expected a number >= 0 and <= 2"),
    (["--temperature", "1", "--top-p", "0"], "argument --top-p: '0': expected a number > 0 and <= 1"),
    (["--temperature", "1", "--top-k", "-2"], "argument --top-k: '-2': expected an integer >= 0"),
    (["--temperature", "1", "--sampling-seed", str(2 ** 64)], "--sampling-seed 18446744073709551616: must be in"),
])
def test_chat_refuses_bad_sampling_options(tiny_dir, args, message, capsys):
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.examples.fitness import chat

    with pytest.raises((UserError, SystemExit)) as refused:  # argparse's own exits (the command prints one line)
        chat.main(["--model", str(tiny_dir), "--once", "steps yesterday?", *args])
    assert message in str(refused.value) + capsys.readouterr().err


def test_chat_refuses_a_bad_generation_config_before_the_weights_load(tiny_dir, tmp_path, monkeypatch):
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.examples.fitness import chat

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    monkeypatch.setattr(chat, "load_hf_dir", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(UserError, match=re.escape(f"{model / 'generation_config.json'}: top_p must be a number "
                                                  f"above 0 and at most 1, got 0")):
        chat.main(["--model", str(model), "--once", "steps yesterday?", "--temperature", "1"])

"""Prefix-cached generation (issue 15, point 5): the shared prompt's keys and values are computed
once and copied into every batch; greedy outputs must equal the uncached path's exactly."""

from __future__ import annotations

import os

import pytest

SHARED = [2] + [(7 * i) % 400 + 100 for i in range(40)]  # 41 ids: longer than the window (16)
SUFFIXES = [[300], [301, 302, 303, 304, 305], [(3 * i) % 300 + 110 for i in range(20)],
            [(5 * i) % 300 + 120 for i in range(35)], [330, 331], [(11 * i) % 300 + 105 for i in range(9)]]


def _prompts():
    return [SHARED + s for s in SUFFIXES]


@pytest.fixture(scope="module", params=["gqa", "mha"])
def loaded(request, tiny_dir, tiny_mha_dir):
    """Both KV layouts (Tunix fuses q/k/v when there are as many KV heads as query heads)."""
    from gemma_tpu.infer.generate import load_hf_dir

    return load_hf_dir(str(tiny_dir if request.param == "gqa" else tiny_mha_dir))


# What does not depend on the KV layout (the chat's named prefix, the band control, refusals) runs on one:
# test_prefix_cache_matches_uncached covers the cache on both (~40 s of the suite on the AVX2 EPYC, 2026-11-26).
ONE_LAYOUT = pytest.mark.parametrize("loaded", ["gqa"], indirect=True)


def test_prefix_cache_matches_uncached(loaded):
    """Six prompts sharing 41 ids (window 16, so prefix + suffix crosses it), suffixes of 1..35 ids
    (different left paddings), two batches: same ids as without the cache, prefix computed once."""
    from gemma_tpu.infer.generate import Generator

    prompts = _prompts()
    plain = Generator(loaded, max_new_tokens=12, batch_size=4, prefix_cache=False).generate(prompts)
    gen = Generator(loaded, max_new_tokens=12, batch_size=4)
    cached = gen.generate(prompts)
    assert [o.ids for o in cached] == [o.ids for o in plain]
    assert len({tuple(o.ids) for o in plain}) > 1  # the prompts lead to different continuations
    assert gen.prefix_stats == {"computed": 1, "reused_batches": 2, "prefix_tokens": len(SHARED)}
    again = gen.generate(prompts[:3])  # a later call starting with the same ids reuses the cache
    assert [o.ids for o in again] == [o.ids for o in plain[:3]]
    assert gen.prefix_stats["computed"] == 1


@ONE_LAYOUT
def test_prefix_cache_single_prompt_with_named_prefix(loaded):
    """One prompt per call (the chat): the named prefix is computed on the first call and reused."""
    from gemma_tpu.infer.generate import Generator

    prompts = _prompts()
    plain = Generator(loaded, max_new_tokens=10, batch_size=1, prefix_cache=False)
    gen = Generator(loaded, max_new_tokens=10, batch_size=1)
    for p in prompts[1:4]:
        assert gen.generate([p], prefix=SHARED + [999])[0].ids == plain.generate([p])[0].ids
    assert gen.prefix_stats["computed"] == 1 and gen.prefix_stats["reused_batches"] == 3
    # calls alternating between two prefixes (two chats' system turns): only the last prefix's cache was kept, so
    # each call recomputed its own; both are kept now (least recently used dropped past PREFIX_CACHE_ENTRIES)
    other = [2] + [(13 * i) % 400 + 90 for i in range(40)]
    for p in [other + [301, 302], prompts[1], other + [310], prompts[2]]:
        named = other if p[:len(other)] == other else SHARED
        assert gen.generate([p], prefix=named + [999])[0].ids == plain.generate([p])[0].ids
    assert gen.prefix_stats["computed"] == 2 and gen.prefix_stats["reused_batches"] == 7


def test_prefix_caches_kept_are_bounded_least_recently_used_first(monkeypatch):
    import collections

    import numpy as np

    from gemma_tpu.infer import generate as g

    gen = object.__new__(g.Generator)
    gen._prefixes = collections.OrderedDict((k, {"k": np.zeros(1000, np.uint8)}) for k in [(1,), (2,), (3,)])
    gen._prefixes.move_to_end((1,))  # used last
    gen.prefix_cache_bytes = 1 << 30
    monkeypatch.setattr(g, "PREFIX_CACHE_ENTRIES", 2)
    gen._evict_prefixes()
    assert list(gen._prefixes) == [(3,), (1,)]
    gen.prefix_cache_bytes = 1500  # by memory too, keeping the latest whatever its size
    gen._evict_prefixes()
    assert list(gen._prefixes) == [(1,)]
    gen.prefix_cache_bytes = 10
    gen._evict_prefixes()
    assert list(gen._prefixes) == [(1,)]


def test_prefix_cache_budget_is_sized_from_free_memory(monkeypatch):
    """The kept prefix caches were bounded by a fixed 2 GiB, whatever the device: most of a small accelerator's
    free memory, a sliver of a large one's. Now PREFIX_CACHE_FRACTION of what is free where they live (the device's
    memory_stats, else the host's available memory), or $GEMMA_TPU_PREFIX_CACHE_BYTES."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.infer import generate as g

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    monkeypatch.delenv(g.PREFIX_CACHE_BYTES_ENV, raising=False)
    tpu = Device({"bytes_limit": 16 << 30, "bytes_in_use": 6 << 30})  # 10 GiB free once the weights are in
    assert g.free_memory(tpu) == 10 << 30
    assert g.prefix_cache_budget(tpu) == pytest.approx(g.PREFIX_CACHE_FRACTION * (10 << 30), abs=1)
    assert g.prefix_cache_budget(Device({"bytes_limit": 141 << 30, "bytes_in_use": 1 << 30})) > 2 << 30
    host = g.free_memory(Device(None))  # a CPU device has no stats: the host's available memory
    assert host is not None and 0 < host <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert g.prefix_cache_budget(Device(None)) == pytest.approx(g.PREFIX_CACHE_FRACTION * host, rel=0.5)
    # several devices (a host's 8 accelerators, the model sharded over them): the least free bounds it, each holding
    # its copy or shard of the caches; only the first was asked, and a full device 3 went unseen
    import jax

    many = [tpu, Device({"bytes_limit": 16 << 30, "bytes_in_use": 15 << 30}), Device(None), tpu]
    assert g.free_memory(many) == 1 << 30
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: many)
    assert g.free_memory() == 1 << 30
    assert g.prefix_cache_budget() == pytest.approx(g.PREFIX_CACHE_FRACTION * (1 << 30), abs=1)
    monkeypatch.setenv(g.PREFIX_CACHE_BYTES_ENV, "123456")
    assert g.prefix_cache_budget(tpu) == 123456
    monkeypatch.setenv(g.PREFIX_CACHE_BYTES_ENV, "0")  # only the latest prefix kept
    assert g.prefix_cache_budget(tpu) == 0
    for bad in ("2GB", "-1", "1.5"):
        monkeypatch.setenv(g.PREFIX_CACHE_BYTES_ENV, bad)
        with pytest.raises(UserError, match=f"^GEMMA_TPU_PREFIX_CACHE_BYTES='{bad}': must be a whole number of bytes"):
            g.prefix_cache_budget(tpu)


@ONE_LAYOUT
def test_sliding_band_is_needed(loaded, monkeypatch):
    """Control: with Tunix's own prefill band (built from row numbers) the suffix prefill of the
    sliding layers sees the wrong keys, and the outputs change."""
    from gemma_tpu.infer import generate as g

    prompts = _prompts()
    plain = g.Generator(loaded, max_new_tokens=12, batch_size=4, prefix_cache=False).generate(prompts)
    monkeypatch.setattr(g, "band_from", lambda model, start, slots: None)
    monkeypatch.setattr(g, "_JIT_PAIRS", [])  # the decode compiled by earlier tests for this structure has the true band
    wrong = g.Generator(loaded, max_new_tokens=12, batch_size=4).generate(prompts)  # (its list goes with the patch)
    assert [o.ids for o in wrong] != [o.ids for o in plain]


def test_same_structure_shares_compilations_not_weights(tiny_dir, tmp_path):
    """Two models of one structure (an evaluation's base and merged model): the second generator reuses
    the first one's jitted decode and prefix forward, and still decodes with its own weights."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3
    from gemma_tpu.infer import generate as g

    prompts = _prompts()
    first = g.load_hf_dir(str(tiny_dir))
    other = g.load_hf_dir(str(write_tiny_gemma3(tmp_path / "other", seed=5)))
    gen_first = g.Generator(first, max_new_tokens=12, batch_size=4)
    out_first = gen_first.generate(prompts)
    gen_other = g.Generator(other, max_new_tokens=12, batch_size=4)
    assert gen_other._fn is gen_first._fn and gen_other._prefix_fn is gen_first._prefix_fn
    out_other = gen_other.generate(prompts)
    fn, prefix_fn, *_ = g._jit_pair(gen_other._graphdef)  # compiled for this model alone
    gen_alone = g.Generator(other, max_new_tokens=12, batch_size=4)
    gen_alone._fn, gen_alone._prefix_fn = fn, prefix_fn
    assert [o.ids for o in out_other] == [o.ids for o in gen_alone.generate(prompts)]
    assert [o.ids for o in out_other] != [o.ids for o in out_first]  # its own weights, not the first's


def test_chat_reuses_the_system_turn(tiny_long_dir):
    """The fitness chat names its developer turn (system prompt + seven tool declarations) as the
    prefix: computed on the first model call, reused by every later one; the answers are those of
    the uncached chat."""
    import datetime as dt

    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.examples.fitness.providers import SimulatedDevice
    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(tiny_long_dir))
    answers = {}
    for cached in (False, True):
        gen = Generator(loaded, max_new_tokens=8, batch_size=1, prefix_cache=cached)
        coach = Coach(loaded, SimulatedDevice(0, today=dt.date(2025, 3, 14)), generator=gen, trace=None)
        answers[cached] = [coach.ask(q) for q in ("steps today?", "how did I sleep?")]
        if cached:
            assert gen.prefix_stats["computed"] == 1 and gen.prefix_stats["reused_batches"] >= 2
            assert gen.prefix_stats["prefix_tokens"] > 300  # the declarations are inside the prefix
    assert answers[True] == answers[False]


def test_gemma4_decodes_uncached(tmp_path):
    """Tunix Gemma 4's multi-token forward writes its cache from slot 0 and attends only to its own
    tokens, so it cannot continue a cached prefix: the generator falls back to whole prompts."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(write_tiny_gemma4(tmp_path / "g4", seed=0, variant="dense")))
    gen = Generator(loaded, max_new_tokens=6, batch_size=4)
    assert gen.prefix_cache is False
    outs = gen.generate(_prompts()[:3])
    assert gen.prefix_stats["computed"] == 0 and all(len(o.ids) >= 1 for o in outs)
    chunked = Generator(loaded, max_new_tokens=6, batch_size=4, decode_chunk=4)  # the chat's way: same ids
    assert [o.ids for o in chunked.generate(_prompts()[:3])] == [o.ids for o in outs]


def test_prefix_cache_with_lora(tiny_dir):
    """A LoRA model (Qwix factors, non-zero B) through the patched sliding band: same ids."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gemma_tpu.core.config import LoraConfig
    from gemma_tpu.infer.generate import Generator, LoadedModel, load_hf_dir
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import resolve_model

    base = load_hf_dir(str(tiny_dir))
    model = apply_lora(base.model, resolve_model(str(tiny_dir)).family, base.tunix_cfg, LoraConfig(rank=4))
    rng = np.random.default_rng(0)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.LoRAParam):
            var.set_value(jnp.asarray(rng.normal(0.0, 0.3, var.get_value().shape).astype(np.float32)))
    loaded = LoadedModel(model, base.tokenizer, base.token_map, base.chat_format, "lora", base.tunix_cfg)
    prompts = _prompts()
    plain = Generator(loaded, max_new_tokens=10, batch_size=4, prefix_cache=False).generate(prompts)
    gen = Generator(loaded, max_new_tokens=10, batch_size=4)
    assert [o.ids for o in gen.generate(prompts)] == [o.ids for o in plain]
    assert gen.prefix_stats["computed"] == 1
    base_ids = Generator(base, max_new_tokens=10, batch_size=4, prefix_cache=False).generate(prompts)
    assert [o.ids for o in base_ids] != [o.ids for o in plain]  # the LoRA factors do change the outputs


@ONE_LAYOUT
def test_prompt_past_the_context_is_refused(loaded):
    """A prompt that with its new tokens would pass max_position_embeddings (1024 in the tiny model) is a
    one-line error naming the prompt, before anything is computed; one that fits exactly is generated."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.infer.generate import Generator

    assert loaded.max_positions == 1024
    gen = Generator(loaded, max_new_tokens=8, batch_size=2)
    long = SHARED + [(13 * i) % 300 + 100 for i in range(1024 - 8 - len(SHARED) + 1)]
    with pytest.raises(UserError, match=r"prompt 2 is 1017 tokens; with up to 8 new tokens it passes the model's "
                                        r"context of 1024 \(max_position_embeddings\)"):
        gen.generate([SHARED + [300], long])
    with pytest.raises(UserError, match=r"^the prompt is 1017 tokens;"):  # one prompt (a chat's): no number
        gen.generate([long])
    assert len(gen.generate([long[:-1]], max_new_tokens=8)) == 1


@ONE_LAYOUT
def test_max_new_tokens_zero_is_refused(loaded):
    """`max_new_tokens=0` is an error naming it (it was read as the generator's default of 8 and generated)."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.infer.generate import Generator

    gen = Generator(loaded, max_new_tokens=8, batch_size=2)
    for bad in (0, -3, 2.5):
        with pytest.raises(UserError, match=rf"max_new_tokens must be a whole number of at least 1, got {bad}"):
            gen.generate([SHARED + [300]], max_new_tokens=bad)
    assert len(gen.generate([SHARED + [300]], max_new_tokens=1)[0].ids) == 1


@ONE_LAYOUT
def test_ctrl_c_stops_a_chunked_generation_between_chunks(loaded):
    """The whole decode was one device call, and Python handles a signal only between calls: a Ctrl-C in the chat
    took effect when the answer was done. With `decode_chunk` (the chat's), it stops within that many steps; the
    ids decoded in chunks are the ones of one call, cached prefix or not."""
    import os
    import signal

    from gemma_tpu.examples.fitness.chat import DECODE_CHUNK
    from gemma_tpu.infer.generate import Generator

    prompts = _prompts()
    whole = Generator(loaded, max_new_tokens=12, batch_size=4, prefix_cache=False).generate(prompts)
    for cache in (False, True):
        chunked = Generator(loaded, max_new_tokens=12, batch_size=4, prefix_cache=cache, decode_chunk=5)
        assert [o.ids for o in chunked.generate(prompts)] == [o.ids for o in whole]
    gen = Generator(loaded, max_new_tokens=40, batch_size=1, decode_chunk=4)
    real, calls = gen._decode_fn, []

    def decode(*args):
        calls.append(int(args[-1]))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the device call runs
        return real(*args)

    gen._decode_fn = decode
    with pytest.raises(KeyboardInterrupt):
        gen.generate([[2, 500]])
    assert calls == [4, 8]  # the third chunk never started
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.examples.fitness.providers import make_provider

    assert Coach(loaded, make_provider("simulated", 0), trace=None).generator.decode_chunk == DECODE_CHUNK


@ONE_LAYOUT
def test_a_chunked_decode_reuses_its_cache_in_place(loaded):
    """Each chunk is a device call taking the decode's carry (the KV cache) and returning the next one: without
    donating it, both caches were live during every call, twice the cache memory of one call a batch, which an
    evaluation's 32-row batches now pay (they decode in chunks so a Ctrl-C lands). The carry is donated: each call
    writes the cache it was given, and the ids are those of one call."""
    import jax

    from gemma_tpu.infer.generate import Generator

    prompts = _prompts()
    whole = Generator(loaded, max_new_tokens=12, batch_size=4, prefix_cache=False).generate(prompts)
    gen = Generator(loaded, max_new_tokens=12, batch_size=4, decode_chunk=5)
    real, given = gen._decode_fn, []

    def decode(state, carry, *args):
        given.append(carry[1])
        return real(state, carry, *args)

    gen._decode_fn = decode
    assert [o.ids for o in gen.generate(prompts)] == [o.ids for o in whole]
    leaves = jax.tree.leaves(given)
    assert len(given) >= 3 and leaves and all(leaf.is_deleted() for leaf in leaves)


@ONE_LAYOUT
def test_ids_past_the_tokenizer_are_said_once(loaded, caplog):
    """A model's embedding may have more rows than its tokenizer has tokens (a Gemma 3's 262,208 for 262,145): an id
    past them decodes to nothing, as vLLM decodes it, and an answer made of them read as empty without a word. The
    generator says so once, naming the ids."""
    import logging

    from gemma_tpu.infer.generate import Generator

    gen = Generator(loaded, max_new_tokens=8, batch_size=1)
    size = len(loaded.tokenizer)
    ok = loaded.tokenizer.encode("ok", add_special_tokens=False)
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.infer.generate"):
        out = gen.generation([*ok, size + 7, size, 106])
        again = gen.generation([size + 9, 106])
    assert (out.text, out.stop, again.text) == ("ok", "end_of_turn", "")
    said = [r.getMessage() for r in caplog.records if "past its tokenizer" in r.getMessage()]
    assert said == [f"the model generated ids past its tokenizer's {size} tokens ({size}, {size + 7}): they decode "
                    f"to nothing, as vLLM decodes them; said once"]

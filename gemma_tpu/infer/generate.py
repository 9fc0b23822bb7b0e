"""KV-cached generation on the Tunix model, shared by `evaluate` and `chat`: greedy, or sampled (`Sampling`).

We decode with the same JAX model that training uses (a base HF directory loaded through Tunix,
or a base plus the LoRA factors of a gemma-tpu checkpoint), so what is measured is what was
trained. Tunix's own sampler re-tokenizes strings (adding BOS, dropping control tokens); we
render ids ourselves, so this module takes ids.

Static shapes: prompts are left-padded to a bucket length and the batch is filled to a fixed
size, so one compilation serves every prompt of a bucket. Left padding keeps the last prompt
token of every row at the same cache index, which is what Tunix's cache (one write index for the
batch) needs. Decoding is a `lax.while_loop` that stops when every row has produced a stop token
(the end of a turn, `<eos>`, or the marker the model emits to hand over to a tool); an interactive
caller (`decode_chunk`) runs it a few steps a call, so that a Ctrl-C is handled between them.

Prefix cache (on by default, `prefix_cache=False` turns it off): when the prompts of a call share
a prefix (an evaluation's developer turn with the tool declarations, or the `prefix` a caller
names, such as the chat's system turn), its keys and values are computed once, kept across calls
(the PREFIX_CACHE_ENTRIES most recently used prefixes, within PREFIX_CACHE_FRACTION of the free device memory or
$GEMMA_TPU_PREFIX_CACHE_BYTES: `prefix_cache_budget`), and copied into every batch; only each prompt's
remainder is prefilled. The rows keep exactly the uncached layout (left padding, then prefix, then suffix), so
the decode masks are unchanged: row i's first C cache slots are the prefix cache shifted right by its padding,
and the prefill covers slots C..W (for a row padded by g, that recomputes the last g prefix tokens in slots that
would otherwise hold padding). Tunix Gemma 3's prefill sliding-window band is |row - key slot| < window,
right only for a forward that starts at slot 0; for the suffix prefill the sliding layers get the
band of the slots its rows are written to (`band_from`). Tunix Gemma 4's multi-token forward
writes its cache from slot 0 and attends only to its own tokens, so models with their own
`init_cache` decode uncached.

Sampling (`Sampling`: temperature, top-k, top-p, seed) picks each token in the same compiled loop; its settings
and key are arguments, so one compilation serves every setting, and a greedy generator's program is the one it
always was (no sampling argument at all). A draw depends on the seed, the generator's call and batch count and the
step, never on how many steps a device call runs: a chat's answer is the same with any `decode_chunk`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import numbers
import secrets
from typing import Any, Callable, Sequence

import numpy as np

from gemma_tpu.checkpoint.restore import locate, resolve_base, restore_model, run_chat_format
from gemma_tpu.core.errors import UserError
from gemma_tpu.formats import function_calling as fc
from gemma_tpu.formats import gemma_chat
from gemma_tpu.hf.tokenizer import load_tokenizer
from gemma_tpu.models import load_model, resolve_model, sliding_window

log = logging.getLogger(__name__)

PAD_ID = 0
DEFAULT_BUCKETS = (128, 256, 512, 768, 1024, 1536, 2048)
SUFFIX_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PREFIX_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
MIN_PREFIX_TOKENS = 32  # a shorter shared prefix is not worth a second forward and its compilation
# prefixes whose KV caches are kept across calls, least recently used dropped first: one kept, calls alternating
# between two prefixes (an evaluation's two tool sets, two chats' system turns) recomputed each every call
PREFIX_CACHE_ENTRIES = 4
# and at most this share of the memory free where they live when the generator starts (`prefix_cache_budget`: the
# accelerator's, else the host's; $GEMMA_TPU_PREFIX_CACHE_BYTES sets the bytes instead); the latest is kept whatever
# its size. A fixed 2 GiB was most of a small accelerator's free memory and a sliver of a large one's
PREFIX_CACHE_FRACTION = 0.1
PREFIX_CACHE_BYTES_ENV = "GEMMA_TPU_PREFIX_CACHE_BYTES"
# decode steps a device call where a Ctrl-C should land promptly (the chat, evaluation; Generator's decode_chunk)
DECODE_CHUNK = 16


def free_memory(device=None) -> int | None:
    """Bytes free on `device` (a device or several; default: every local JAX device) by its `memory_stats()`
    (bytes_limit less bytes_in_use; of several, the least: each holds its own copy or shard of what is kept, so the
    fullest bounds it), else the host's available memory (MemAvailable; a CPU device has no stats); None where
    neither is known. Only the first local device was asked: on a host of 8 accelerators, the model's shards and
    another process filling device 3 were not seen."""
    import os

    if device is None:
        import jax

        device = jax.local_devices()
    frees = []
    for each in (device if isinstance(device, (list, tuple)) else [device]):
        try:
            stats = each.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without the call (or failing in it): the host's memory then
            stats = {}
        if stats.get("bytes_limit"):
            frees.append(max(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), 0))
    if frees:
        return min(frees)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def prefix_cache_bytes_set() -> int | None:
    """$GEMMA_TPU_PREFIX_CACHE_BYTES as bytes (None: not set), refused unless a whole number, 0 or more; a command
    calls it before its model loads, so that a bad value is not found only once the weights are in."""
    import os

    raw = os.environ.get(PREFIX_CACHE_BYTES_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{PREFIX_CACHE_BYTES_ENV}={raw[:40]!r}: must be a whole number of bytes, 0 or more")
    return value


def prefix_cache_budget(device=None) -> int:
    """Bytes the kept prefix caches may hold: $GEMMA_TPU_PREFIX_CACHE_BYTES (a whole number of bytes) where set,
    else PREFIX_CACHE_FRACTION of `free_memory(device)`, else (memory unknown) 2 GiB."""
    value = prefix_cache_bytes_set()
    if value is not None:
        return value
    free = free_memory(device)
    return int(free * PREFIX_CACHE_FRACTION) if free is not None else 2 << 30


@dataclasses.dataclass
class Generation:
    """One decoded continuation."""

    ids: list[int]  # generated ids, the stop token included when there was one
    text: str  # decoded text with FunctionGemma markers restored (token map reversed, the family's call markup read)
    stop: str  # "end_of_turn" | "call" | "eos" | "length"
    # a thinking model's thought, apart from `text` ("" for an empty thought block; `gemma_chat.split_thought`); None:
    # none
    thought: str | None = None
    raw: str | None = None  # the whole decoded continuation, a thought's markup included (None: `text`)

    def reply(self) -> fc.ParsedReply:
        """The continuation parsed. One that handed over to a tool (the call stop token) without writing a call is
        a format error, not an answer in words: evaluate scored it as a correct decline where the chat said so. A call
        cut off by the token limit says so (`fc.cut_short`)."""
        reply = fc.parse_reply(self.text)
        if self.stop == "call":
            return fc.handed_over(reply)
        return fc.cut_short(reply, len(self.ids)) if self.stop == "length" else reply


def context_excess(total: int, max_new: int, limit: int, parts: Sequence[tuple[str, int]] | None = None,
                   new_tokens: str = "new tokens") -> str:
    """What a prompt of `total` tokens with `max_new` new tokens passing the context `limit` passes it by, and what
    would fit: "by 40: shorten the question by at least 40 tokens or ask for at most 88 new tokens". `parts`: the
    prompt's tokens by part, in order, as (name, count) (`Renderer.prompt_parts`), the last the part its user writes,
    the others given (a chat's system prompt, its tool declarations): when the given parts alone leave no room it
    says so, rather than "shorten the prompt" (a chat whose developer turn alone passed the context was told to
    shorten its question). `new_tokens`: how the caller's option names them."""
    over = total + max_new - limit
    if not parts or len(parts) < 2:
        return f"by {over}: shorten the prompt or ask for fewer {new_tokens}"
    given_list = [name for name, _ in parts[:-1]]
    given_names = " and ".join(filter(None, [", ".join(given_list[:-1]), given_list[-1]]))
    given, (last_name, last) = sum(n for _, n in parts[:-1]), parts[-1]
    ways = ([f"shorten {last_name} by at least {over} tokens"] if last > over else []) + \
           ([f"ask for at most {limit - total} {new_tokens}"] if total < limit else [])
    if given >= limit:
        return (f"by {over}: {given_names} alone come to {given} tokens, "
                + (f"{given - limit} past the context" if given > limit else "the whole context")
                + f", whatever {last_name}: a model with a longer context is needed")
    if ways:
        return f"by {over}: {' or '.join(ways)}"
    return (f"by {over}: {given_names} take {given} of its {limit} tokens, leaving {limit - given} for {last_name} and "
            f"the reply: shorten {last_name} and ask for fewer {new_tokens}")


def check_context(prompts: Sequence[Sequence[int]], max_new: int, limit: int | None,
                  parts: Sequence[tuple[str, int]] | None = None) -> None:
    """Refuse prompts that, with `max_new` new tokens, pass the model's context `limit` (None: not known), saying by how
    many tokens and what would fit (`context_excess`; `parts`: the one prompt's tokens by part, named in the error)."""
    longest = max((len(p) for p in prompts), default=0)
    if not limit or longest + max_new <= limit:
        return
    i = next(i for i, p in enumerate(prompts) if len(p) == longest)
    which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"  # one (a chat's question): no number
    parts = parts if len(prompts) == 1 else None
    shown = f" ({', '.join(f'{name} {n}' for name, n in parts)})" if parts else ""
    raise UserError(f"{which} is {longest} tokens{shown}; with up to {max_new} new tokens it passes the model's "
                    f"context of {limit} (max_position_embeddings) {context_excess(longest, max_new, limit, parts)}")


@dataclasses.dataclass
class LoadedModel:
    """A model ready for generation and scoring, with what is needed to render prompts for it."""

    model: Any  # Tunix nnx model (possibly with LoRA)
    tokenizer: Any
    token_map: dict[str, str]
    chat_format: str
    description: str
    tunix_cfg: Any = None
    family: Any = None  # the registry Family (its end-of-turn token); None: the chat markup's alone
    max_positions: int | None = None  # the model's context length; None: not known, not checked
    # the directory whose generation_config.json holds the model's sampling defaults (a checkpoint's: its base's)
    generation_dir: Any = None


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampled decoding, the order vLLM applies a request's settings in: logits divided by `temperature`, then
    only the `top_k` likeliest tokens (0: every token), then the fewest likeliest whose probability reaches `top_p`
    (1: no cut); `seed` makes a generator's draws repeatable (None: a fresh seed each generator)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        def number(value) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and bool(np.isfinite(value))

        if not number(self.temperature) or not 0 < self.temperature <= MAX_TEMPERATURE:
            raise UserError(f"temperature {self.temperature!r}: must be above 0 and at most {MAX_TEMPERATURE:g} "
                            f"(0 is greedy: no sampling)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(f"top_p {self.top_p!r}: must be above 0 and at most 1")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise UserError(f"top_k {self.top_k!r}: must be a whole number, 0 (every token) or more")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            raise UserError(f"seed {self.seed!r}: must be a whole number in [-2^63, 2^64)")

    def arrays(self, key) -> tuple:
        """`_pick`'s (temperature, top_p, top_k, key): arguments of the compiled decode, not constants of it."""
        return (np.float32(max(self.temperature, MIN_TEMPERATURE)), np.float32(self.top_p), np.int32(self.top_k),
                key)


MAX_TEMPERATURE = 2.0  # vLLM's and OpenAI's limit
MIN_TEMPERATURE = 0.01  # a smaller one is raised to it, as vLLM raises it (dividing by 1e-30 overflowed to inf)


def _pick(logits, sampling, step):
    """The next id of each row from its [B, V] logits: the likeliest (`sampling` None), or a draw by `sampling`'s
    (temperature, top_p, top_k, key) arrays, the key folded with the generation `step`."""
    import jax
    import jax.numpy as jnp

    if sampling is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature, top_p, top_k, key = sampling
    scaled = logits.astype(jnp.float32) / temperature
    v = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = jnp.arange(v)[None, :] < k
    probs = jax.nn.softmax(jnp.where(in_k, ordered, -jnp.inf), axis=-1)
    # a sorted token stays while the mass before it is short of top_p (the likeliest always does)
    keep = in_k & ((jnp.cumsum(probs, axis=-1) - probs) < top_p)
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return jax.random.categorical(jax.random.fold_in(key, step), masked, axis=-1).astype(jnp.int32)


def _decode_text(tokenizer, ids: Sequence[int], token_map: dict[str, str]) -> str:
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return fc.unmap_markers(text, token_map)


def _token_id(tokenizer, token: str | None) -> int | None:
    """The id of `token` when the vocabulary has it as one token, else None."""
    if token is None:
        return None
    i = tokenizer.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and i != getattr(tokenizer, "unk_token_id", None) else None


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    step = 512
    return ((n + step - 1) // step) * step


def init_cache(model, batch: int, size: int) -> dict:
    """Tunix Gemma 3's cache layout: per layer k, v [B, S, K, H] and a write index. Models that
    lay out their own cache (Gemma 4: per-layer head sizes, none for KV-sharing layers) make it."""
    import jax.numpy as jnp

    cfg = model.config
    emb = model.embedder.input_embedding
    dtype = (emb.get_value() if hasattr(emb, "get_value") else emb.value).dtype
    if hasattr(model, "init_cache"):
        return model.init_cache(batch, size, dtype)
    shape = (batch, size, cfg.num_kv_heads, cfg.head_dim)
    return {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                           "end_index": jnp.zeros((batch,), jnp.int32)}
            for i in range(cfg.num_layers)}


def _project_last_only(model) -> None:
    """Make this (traced, throw-away) model copy project only the last position onto the vocabulary.

    The forward must go through `model.__call__`, the method Qwix intercepts to apply LoRA, and
    that method projects every position: for a 512-token prefill on the 270M model the 262k-wide
    projection is more than half the work. Overriding `embedder.decode` on the instance (not the
    class) keeps the cache update and the LoRA path untouched and returns [B, 1, V] logits.
    """
    embedder = model.embedder
    full = type(embedder).decode

    def decode_last(x):
        return full(embedder, x[:, -1:])

    object.__setattr__(embedder, "decode", decode_last)


def band_from(model, start: int, slots: int) -> None:
    """Give this (traced, throw-away) model's sliding-window layers the band of a prefill whose rows
    are written from cache slot `start` on: row t may see slots s with start + t - s < window.

    Tunix Gemma 3 builds the prefill band from row numbers (|t - s| < window), which is the right
    band only when the forward starts at slot 0. Widening the layer's own window to the cache size
    makes that band all-ones; the true band goes into the mask this layer (only) receives
    (`models.sliding_window`, which does the same by token positions for cache-free forwards).
    """
    import jax.numpy as jnp

    for layer in model.layers:
        attn = layer.attn
        w = sliding_window.window(attn)
        if w is None:
            continue
        block = type(attn).block

        def banded(x, segment_pos, cache, attn_mask, _attn=attn, _window=w, _block=block):
            rows = start + jnp.arange(x.shape[1])[None]
            keys = jnp.arange(attn_mask.shape[-1])[None]
            return _block(_attn, x, segment_pos, cache, attn_mask & sliding_window.position_band(rows, keys, _window))

        sliding_window.set_window(attn, slots)
        object.__setattr__(attn, "remat_config", None)  # inference: no remat, and `block` is ours
        object.__setattr__(attn, "block", banded)


def _prefix_forward(graphdef, state, tokens, *, length: int):
    """KV cache of the one prefix `tokens[0, :length]` ([1, bucket] ids, right-padded: the padding
    comes after the prefix, so causality keeps it out of the prefix's keys and values)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(graphdef, state)
    _project_last_only(model)
    n = tokens.shape[1]
    cache = init_cache(model, 1, n)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    attn = jnp.tril(jnp.ones((n, n), bool))[None]
    _, cache = model(tokens, positions, cache, attn)
    return jax.tree.map(lambda a: a[:, :length] if a.ndim == 4 else a, cache)


def _shifted_prefix(prefix_cache, pad, size: int):
    """Row i's cache with prefix slot j at slot j + pad[i] (slots before stay zero and masked),
    the rest of `size` slots empty, write index after the prefix."""
    import jax.numpy as jnp

    def place(leaf):
        if leaf.ndim != 4:
            return leaf
        c = leaf.shape[1]
        src = jnp.arange(c)[None, :] - pad[:, None]  # [B, C]: prefix slot shown at each slot
        rows = jnp.where((src >= 0)[..., None, None], leaf[0][jnp.clip(src, 0, c - 1)], 0)
        return jnp.pad(rows, ((0, 0), (0, size - c), (0, 0), (0, 0)))

    b = pad.shape[0]
    out = {}
    for name, layer in prefix_cache.items():
        c = layer["k"].shape[1]
        out[name] = {k: place(v) for k, v in layer.items() if k != "end_index"}
        out[name]["end_index"] = jnp.full((b,), c, jnp.int32)
    return out


def _forward(graphdef, state, toks, pos, cache, attn, start=0):
    from flax import nnx

    # A fresh module tree per trace level: Qwix's LoRA writes module attributes when called,
    # which nnx forbids on modules created outside the while loop's body.
    model = nnx.merge(graphdef, state)
    _project_last_only(model)
    if start:
        band_from(model, start, attn.shape[-1])
    return model(toks, pos, cache, attn)


def _prefill(graphdef, state, tokens, prompt_mask, prefix_cache=None, sampling=None, *, max_new: int):
    """Prefill the left-padded prompts: the decode's first carry (step, cache, next ids, positions, key mask,
    output ids, rows done); `sampling`: `_pick`'s.

    With `prefix_cache` (the keys and values of the first C ids every prompt starts with), the
    first C slots of each row come from it and only slots C.. are prefilled.
    """
    import jax.numpy as jnp
    from flax import nnx

    b, p = tokens.shape
    size = p + max_new
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1) - 1, 0).astype(jnp.int32)
    causal = jnp.tril(jnp.ones((p, p), bool))
    attn = prompt_mask[:, None, :] & causal[None]
    attn = jnp.pad(attn, ((0, 0), (0, 0), (0, max_new)))
    if prefix_cache is None:
        cache = init_cache(nnx.merge(graphdef, state), b, size)
        logits, cache = _forward(graphdef, state, tokens, positions, cache, attn)
    else:
        c = prefix_cache["layer_0"]["k"].shape[1]
        pad = p - jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)
        cache = _shifted_prefix(prefix_cache, pad, size)
        logits, cache = _forward(graphdef, state, tokens[:, c:], positions[:, c:], cache, attn[:, c:], start=c)
    first = _pick(logits[:, -1], sampling, 0)
    keys = jnp.concatenate([prompt_mask, jnp.zeros((b, max_new), bool)], axis=1)
    out = jnp.full((b, max_new), PAD_ID, jnp.int32)
    return jnp.int32(0), cache, first, positions[:, -1], keys, out, jnp.zeros((b,), bool)


def _decode(graphdef, state, carry, stop_ids, until, sampling=None):
    """Decode from `carry` (`_prefill`'s) until step `until` or until every row stopped, greedily or by `sampling`."""
    import jax
    import jax.numpy as jnp

    max_new = carry[5].shape[1]
    p = carry[4].shape[1] - max_new

    def cond(c):
        step, _, _, _, _, _, done = c
        return (step < until) & (step < max_new) & ~jnp.all(done)

    def body(c):
        step, cache, tok, pos, keys, out, done = c
        out = out.at[:, step].set(jnp.where(done, PAD_ID, tok))
        done = done | jnp.isin(tok, stop_ids)
        keys = keys.at[:, p + step].set(True)
        pos = pos + 1
        logits, cache = _forward(graphdef, state, tok[:, None], pos[:, None], cache, keys[:, None, :])
        nxt = _pick(logits[:, -1], sampling, step + 1)
        return step + 1, cache, nxt, pos, keys, out, done

    return jax.lax.while_loop(cond, body, carry)


def _generate(graphdef, state, tokens, prompt_mask, stop_ids, prefix_cache=None, sampling=None, *, max_new: int):
    """Prefill the left-padded prompts, then decode until every row stopped, in one call.
    Returns the [B, max_new] generated ids (PAD after a row's stop token) and their count."""
    carry = _decode(graphdef, state,
                    _prefill(graphdef, state, tokens, prompt_mask, prefix_cache, sampling, max_new=max_new),
                    stop_ids, max_new, sampling)
    return carry[5], carry[0]


def _jit_pair(graphdef):
    import jax

    return (jax.jit(functools.partial(_generate, graphdef), static_argnames=("max_new",)),
            jax.jit(functools.partial(_prefix_forward, graphdef), static_argnames=("length",)),
            jax.jit(functools.partial(_prefill, graphdef), static_argnames=("max_new",)),
            # the carry (the KV cache) is donated: a chunk writes the cache it is given, where both were live (twice
            # the memory of one call a batch, on an evaluation's 32 rows)
            jax.jit(functools.partial(_decode, graphdef), donate_argnums=(1,)))


_JIT_PAIRS: list[tuple[Any, tuple]] = []  # (graphdef, its jitted pair), newest last; compared by ==, since a
_MAX_JIT_PAIRS = 8                        # GraphDef holding Tunix's ModelConfig cannot be hashed


def _jitted(graphdef):
    """The jitted decode, prefix forward and decode halves (prefill, steps) of one model structure. Generators
    of models with the same structure (the base and the merged model an evaluation compares, a model reloaded)
    share them, and so their compilations: only the weights differ, and they are arguments."""
    for known, pair in _JIT_PAIRS:
        try:
            same = bool(known == graphdef)
        except (TypeError, ValueError):  # a static attribute that does not compare (an array): not shared
            same = False
        if same:
            return pair
    pair = _jit_pair(graphdef)
    _JIT_PAIRS.append((graphdef, pair))
    del _JIT_PAIRS[:-_MAX_JIT_PAIRS]
    return pair


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix of ids all `seqs` share."""
    if not seqs:
        return 0
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for other in seqs[1:]:
        a, b = np.asarray(first[:n]), np.asarray(other[:n])
        diff = np.nonzero(a != b)[0]
        n = int(diff[0]) if len(diff) else n
    return n


class Generator:
    """Batched generation from token ids, compiled once per (bucket, batch size): greedy, or by `sampling`.

    Batches are `batch_size` rows (a smaller power of two for the last one), prompts sorted by
    length so that a batch shares a bucket. With `prefix_cache` (the default), the prefix the
    prompts of a call share (at least `MIN_PREFIX_TOKENS` ids) is computed once and reused by
    every batch and by later calls that start with it; suffixes are bucketed by `SUFFIX_BUCKETS`.
    With `decode_chunk` N, a batch decodes N steps a device call, Python running between them: a Ctrl-C
    (KeyboardInterrupt) stops the generation within N steps, where one call ran to its end first (an
    interactive chat's choice; None: one call a batch, as evaluation runs).
    """

    def __init__(self, loaded: LoadedModel, *, max_new_tokens: int = 64, batch_size: int = 8,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, prefix_cache: bool = True,
                 decode_chunk: int | None = None, sampling: Sampling | None = None):
        from flax import nnx

        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.token_map = loaded.token_map
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.buckets = tuple(sorted(buckets))
        # Stop ids from the tokenizer: the end of a turn as the chat markup writes it and as the
        # family's vocabulary names it (one id in Gemma vocabularies), <eos>, and the marker that
        # ends a tool call (the model hands over to the tool there).
        turn_ends = [gemma_chat.END_OF_TURN, getattr(loaded.family, "end_of_turn_token", None)]
        self.end_of_turn_ids = list(dict.fromkeys(i for i in (_token_id(self.tokenizer, t) for t in turn_ends)
                                                  if i is not None))
        self.eos_id = getattr(self.tokenizer, "eos_token_id", None)
        # the call-ending marker of our format (mapped onto the vocabulary) and the family's own (Gemma 4's
        # <|tool_response>, which a merge lists in generation_config's stop ids, so vLLM stops there too)
        call_ends = [self.token_map.get(fc.START_RESPONSE, fc.START_RESPONSE),
                     getattr(loaded.family, "call_stop_token", None)]
        self.call_end_ids = list(dict.fromkeys(i for i in (_token_id(self.tokenizer, t) for t in call_ends)
                                               if i is not None))
        stops = self.end_of_turn_ids + [i for i in [self.eos_id] if i is not None] + self.call_end_ids
        self.stop_ids = np.asarray(stops, np.int32)
        # the family's own call markup (Gemma 4's `<|tool_call>`, `<|"|>`), read as the FunctionGemma markup it mirrors
        self.call_markers = dict(getattr(loaded.family, "call_markers", None) or ())
        # a thinking model's thought markers (Gemma 4's channel): its thought is read apart from the answer
        self.thought_markers = getattr(loaded.family, "thought_markers", None)
        # the tokenizer's size: a model's embedding may have more rows (a Gemma 3's 262,208 for 262,145 tokens), and an
        # id past it decodes to nothing (as vLLM decodes it), said once a generator (`_unknown_ids`)
        try:
            self.tokenizer_size: int | None = len(self.tokenizer)
        except TypeError:  # a tokenizer without a length: not checked
            self.tokenizer_size = None
        self._said_unknown = False
        self._graphdef, self._state = nnx.split(loaded.model)
        self._fn, self._prefix_fn, self._prefill_fn, self._decode_fn = _jitted(self._graphdef)
        self.decode_chunk = decode_chunk
        self.sampling = sampling
        # the seed every batch's key derives from (folded with the batch's count): repeatable when given
        self._seed = (None if sampling is None else sampling.seed % 2 ** 64 if sampling.seed is not None
                      else secrets.randbits(64))
        self._batches = 0
        # models that lay out their own cache (Gemma 4) cannot continue a filled cache with a
        # multi-token forward: see the module docstring
        self.prefix_cache = prefix_cache and not hasattr(loaded.model, "init_cache")
        # prefix ids -> KV cache, kept across calls (least recently used first; PREFIX_CACHE_ENTRIES and at most
        # prefix_cache_bytes, sized once the model's weights are in memory)
        self.prefix_cache_bytes = prefix_cache_budget() if self.prefix_cache else 0
        self._prefixes: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self.prefix_stats = {"computed": 0, "reused_batches": 0, "prefix_tokens": 0}

    def _stop_reason(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.end_of_turn_ids:
            return "end_of_turn"
        if ids and ids[-1] in self.call_end_ids:
            return "call"
        if ids and self.eos_id is not None and ids[-1] == self.eos_id:
            return "eos"
        return "length"

    def generation(self, ids: Sequence[int]) -> Generation:
        """The `Generation` of a row's generated `ids`, cut after its first stop id (PAD only follows one): its text
        decoded without the stop token, a thinking model's thought apart (`gemma_chat.split_thought`), the FunctionGemma
        markers restored (the token map reversed, and the family's own call markup read as them), and why it stopped."""
        stops = set(self.stop_ids.tolist())
        kept: list[int] = []
        for t in ids:
            kept.append(int(t))
            if t in stops:
                break
        body = kept[:-1] if kept and kept[-1] in stops else kept  # the text leaves the stop token out
        self._unknown_ids(body)
        raw = _decode_text(self.tokenizer, body, self.token_map)
        thought, answer = gemma_chat.split_thought(raw, self.thought_markers)
        return Generation(kept, fc.unmap_markers(answer, self.call_markers), self._stop_reason(kept), thought,
                          fc.unmap_markers(raw, self.call_markers))

    def _unknown_ids(self, ids: Sequence[int]) -> None:
        """Warn, the first time only, that generated `ids` hold ids past the tokenizer's vocabulary (rows of the
        model's embedding no token has): they decode to nothing, so an answer made of them read as empty or shorter
        without a word."""
        if self._said_unknown or self.tokenizer_size is None:
            return
        unknown = sorted({int(t) for t in ids if t >= self.tokenizer_size})
        if unknown:
            self._said_unknown = True
            shown = ", ".join(map(str, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            log.warning("the model generated ids past its tokenizer's %d tokens (%s): they decode to nothing, as vLLM "
                        "decodes them; said once", self.tokenizer_size, shown)

    def _shared_prefix(self, prompts: Sequence[Sequence[int]], prefix: Sequence[int] | None):
        """(C, KV cache of the first C ids) for this call's prompts, or (0, None)."""
        if not self.prefix_cache or not prompts:
            return 0, None
        seqs = ([list(prefix)] if prefix is not None else []) + [list(p) for p in prompts]
        if len(seqs) < 2:
            return 0, None
        c = min(common_prefix_len(seqs), min(len(p) for p in prompts) - 1)  # every row keeps a suffix
        if c < MIN_PREFIX_TOKENS:
            return 0, None
        ids = tuple(int(t) for t in prompts[0][:c])
        if ids in self._prefixes:
            self._prefixes.move_to_end(ids)
        else:
            n = _bucket(c, PREFIX_BUCKETS)
            tokens = np.full((1, n), PAD_ID, np.int32)
            tokens[0, :c] = ids
            self._prefixes[ids] = self._prefix_fn(self._state, tokens, length=c)
            self.prefix_stats["computed"] += 1
            self.prefix_stats["prefix_tokens"] = c
            self._evict_prefixes()
        return c, self._prefixes[ids]

    def _evict_prefixes(self) -> None:
        """Drop the least recently used prefix caches past PREFIX_CACHE_ENTRIES or `prefix_cache_bytes`."""
        import jax

        def size(cache) -> int:
            return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree_util.tree_leaves(cache))

        while len(self._prefixes) > 1 and (len(self._prefixes) > PREFIX_CACHE_ENTRIES or
                                           sum(map(size, self._prefixes.values())) > self.prefix_cache_bytes):
            self._prefixes.popitem(last=False)

    def _batch_sampling(self):
        """`_pick`'s sampling arrays for the next batch (None: greedy), its key the seed folded with the count of
        batches this generator has drawn: no two batches (nor two answers of a chat) draw alike."""
        if self.sampling is None:
            return None
        import jax

        # the seed's 64 bits as the key (PRNGKey kept only the low 32 without jax_enable_x64: seeds 5 and 2**62 + 5 drew
        # alike)
        seed = np.array([(self._seed >> 32) & 0xFFFFFFFF, self._seed & 0xFFFFFFFF], np.uint32)
        key = jax.random.fold_in(seed, self._batches)
        self._batches += 1
        return self.sampling.arrays(key)

    def _decode_batch(self, tokens, mask, cache, max_new: int) -> tuple[np.ndarray, int]:
        """One batch's generated ids and step count: in one device call, or `decode_chunk` steps a call."""
        sampling = self._batch_sampling()
        # greedy calls pass what they always did (no sampling argument): the same calls, the same programs
        extra = (cache, sampling) if sampling is not None else (cache,) if cache is not None else ()
        drawn = (sampling,) if sampling is not None else ()
        if not self.decode_chunk:
            out, steps = self._fn(self._state, tokens, mask, self.stop_ids, *extra, max_new=max_new)
            return np.asarray(out), int(steps)
        carry = self._prefill_fn(self._state, tokens, mask, *extra, max_new=max_new)
        step = 0
        while step < max_new:
            carry = self._decode_fn(self._state, carry, self.stop_ids, np.int32(min(step + self.decode_chunk, max_new)),
                                    *drawn)
            step = int(carry[0])  # waits for the call: a Ctrl-C meanwhile is raised here
            if bool(np.all(np.asarray(carry[6]))):
                break
        return np.asarray(carry[5]), step

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                 on_batch: Callable[[int], None] | None = None,
                 prefix: Sequence[int] | None = None,
                 on_result: Callable[[int, Generation], None] | None = None) -> list[Generation]:
        """Continue each prompt (ids starting with BOS); `on_batch(n)` reports progress, `on_result(i, generation)`
        each prompt's as its batch ends (a caller stopped midway keeps those: batches go shortest first). `prefix`:
        ids the prompts (and later calls) are expected to start with, such as a system turn; with
        the prefix cache on, the part of it the prompts do share is computed once and kept."""
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        # 0 was read as the default before
        if not isinstance(max_new, numbers.Integral) or isinstance(max_new, bool) or max_new < 1:
            raise UserError(f"max_new_tokens must be a whole number of at least 1, got {max_new!r}")
        if any(len(p) == 0 for p in prompts):
            raise UserError("cannot generate from an empty prompt")
        check_context(prompts, max_new, self.loaded.max_positions)
        shared, cache = self._shared_prefix(prompts, prefix)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a bucket
        results: list[Generation | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            longest = max(len(prompts[i]) for i in idx)
            length = (shared + _bucket(longest - shared, SUFFIX_BUCKETS) if cache is not None
                      else _bucket(longest, self.buckets))
            rows = min(self.batch_size, 1 << (len(idx) - 1).bit_length())  # a short last batch stays short
            tokens = np.full((rows, length), PAD_ID, np.int32)
            mask = np.zeros((rows, length), bool)
            for row in range(rows):  # rows past the prompts are a lone BOS (ignored)
                prompt = np.asarray(prompts[idx[row]] if row < len(idx) else [gemma_chat.BOS_ID], np.int32)
                if len(prompt) == 0:
                    raise UserError("cannot generate from an empty prompt")
                tokens[row, length - len(prompt):] = prompt
                mask[row, length - len(prompt):] = True
            if cache is not None:
                self.prefix_stats["reused_batches"] += 1
            out, steps = self._decode_batch(tokens, mask, cache, max_new)
            for row, i in enumerate(idx):
                results[i] = self.generation(out[row, :steps].tolist())
                if on_result:
                    on_result(i, results[i])
            if on_batch:
                on_batch(len(idx))
        return results  # type: ignore[return-value]


# ------------------------------------------------------------------------------- loading


def load_hf_dir(path: str, dtype: str = "float32", what: str = "--model") -> LoadedModel:
    """A base or merged HF directory (or hub id / embedded:NAME) through `load_model`; `what` names the option that
    gave it in errors (they said "model.path", a config key the command line never gave)."""

    resolved = resolve_model(path, what=what)
    tokenizer = load_tokenizer(resolved.local_dir)
    model, tunix_cfg = load_model(resolved, dtype)
    return LoadedModel(model, tokenizer, fc.function_token_map(tokenizer), resolved.family.chat_format,
                       f"model:{path}", tunix_cfg, resolved.family, resolved.max_positions, resolved.local_dir)


def load_checkpoint(ckpt_dir: str, step: int | None = None, dtype: str | None = None) -> LoadedModel:
    """The checkpoint's model as trained (base, QLoRA quantization included, plus the LoRA factors of
    one step, the latest by default), restored by `gemma_tpu.checkpoint.restore`."""
    restored = restore_model(ckpt_dir, step, dtype)
    return LoadedModel(restored.model, load_tokenizer(restored.tokenizer_dir), restored.token_map,
                       restored.chat_format, f"checkpoint:{ckpt_dir}@{restored.step}", restored.tunix_cfg,
                       restored.family, restored.max_positions, restored.tokenizer_dir)


def describe_hf_dir(path: str, what: str = "--model") -> LoadedModel:
    """What `load_hf_dir(path)` gives but the model (None): the tokenizer, token map, chat format and context length,
    read in seconds, so that a caller checks its prompts before the weights load (minutes for a real model)."""
    resolved = resolve_model(path, what=what)
    tokenizer = load_tokenizer(resolved.local_dir)
    return LoadedModel(None, tokenizer, fc.function_token_map(tokenizer), resolved.family.chat_format,
                       f"model:{path}", None, resolved.family, resolved.max_positions, resolved.local_dir)


def describe_checkpoint(ckpt_dir: str, step: int | None = None) -> LoadedModel:
    """What `load_checkpoint` gives but the model (None), read from the run's metadata and its base's tokenizer and
    config without a weight: see `describe_hf_dir`."""
    from pathlib import Path

    meta, step, base_path = locate(ckpt_dir, step)
    resolved = resolve_base(Path(ckpt_dir), meta, base_path)
    return LoadedModel(None, load_tokenizer(resolved.local_dir), dict(meta.get("token_map") or {}),
                       run_chat_format(meta, resolved), f"checkpoint:{ckpt_dir}@{step}", None, resolved.family,
                       resolved.max_positions, resolved.local_dir)

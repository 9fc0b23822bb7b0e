"""`python -m convert`: the conversion commands, one line each."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.commands import print_commands

COMMANDS = {
    "convert.merge_orbax": "merge a checkpoint's LoRA into its base: an HF safetensors directory (--verify)",
    "convert.export_peft": "a checkpoint's LoRA as a PEFT adapter directory (transformers, vLLM)",
    "convert.verify": "compare two model directories by their logits",
    "convert.export_gguf": "a checkpoint or merged Gemma 3 text model as one GGUF file for llama.cpp",
    "convert.inspect": "describe a checkpoint or model directory without loading its weights",
}

if __name__ == "__main__":
    sys.exit(cli_main(lambda argv: print_commands("convert", COMMANDS, argv=argv)))

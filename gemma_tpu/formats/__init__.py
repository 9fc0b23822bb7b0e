"""Text formats the models are trained on and served with: FunctionGemma tool calls (markers, token map,
rendering, parsing, chat template) and the Gemma chat markup. Pure string code, no model or tokenizer loading."""

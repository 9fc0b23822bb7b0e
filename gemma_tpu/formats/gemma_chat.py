"""The Gemma chat markup: one home for every writer of Gemma turns.

A turn is `<start_of_turn>ROLE\\nTEXT<end_of_turn>\\n`. Roles are `user` and `model`, plus `developer`
for the turn that carries FunctionGemma declarations; Gemma has no system role (a leading system
message folds into the first user turn). The sequence starts with BOS, which is added as an id, not
as text.
"""

from __future__ import annotations

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
USER, MODEL, DEVELOPER = "user", "model", "developer"
# Gemma vocabularies' <bos> id, for a tokenizer that does not name its own.
BOS_ID = 2
# Where a multimodal Gemma's picture (or sound) goes: tokens of the vocabulary that are not flagged special (Gemma
# 3's <start_of_image> is id 255999, beside HTML tags that are plain text), so a text holding one was tokenized as the
# image marker and trained without an image.
# (`[multimodal]`: Gemma 3's id 5, an added token not flagged special, read as that id wherever it stands in text)
MEDIA_MARKERS = ("[multimodal]", "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_audio>",
                 "<end_of_audio>", "<audio_soft_token>")


def open_turn(role: str) -> str:
    """The text that starts a `role` turn (also the generation prompt, for `model`)."""
    return f"{START_OF_TURN}{role}\n"


def close_turn() -> str:
    """The text that ends a turn; the model is trained to write its end marker, the newline is context."""
    return f"{END_OF_TURN}\n"


def turn(role: str, text: str) -> str:
    """One whole turn."""
    return f"{open_turn(role)}{text}{close_turn()}"

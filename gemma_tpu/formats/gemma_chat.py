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


def split_thought(text: str, markers: tuple[str, str, str] | None) -> tuple[str | None, str]:
    """(thought, answer) of a decoded reply, as vLLM's reasoning parser for the family splits it (Gemma 4's `gemma4`:
    `markers` (start, end, label) `<|channel>`, `<channel|>`, `thought\\n`): no marker, no thought; else what
    precedes the start marker is dropped, the thought runs to the end marker (to the end of the reply without one:
    a reply cut within its thought has no answer) less its label, and the answer is what follows. A Gemma 4 26B or
    31B writes an empty thought block with thinking off where its prompt does not hold one (its chat template puts
    `<|channel>thought\\n<channel|>` after the generation prompt), a thinking one a whole thought: either was scored
    as part of the answer ("channel thought" two words of it), where a server with the parser returns the answer
    alone."""
    if not markers:
        return None, text
    start, end, label = markers
    if start not in text and end not in text:
        return None, text
    before, found, after = text.partition(start)
    rest = after if found else before
    thought, closed, answer = rest.partition(end)
    return thought.removeprefix(label), answer if closed else ""

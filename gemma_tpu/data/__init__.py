"""Data: read examples, render chats to ids + loss masks, cut static rows, stream batches with grain."""

from gemma_tpu.data.pipeline import (
                                     Prepared,
                                     TrainStream,
                                     check_layout,
                                     check_one_batch,
                                     duplicates_warning,
                                     epochs_warning,
                                     eval_batches,
                                     eval_fingerprint,
                                     make_renderer,
                                     overlap_warning,
                                     overlength_warning,
                                     prepare_examples,
                                     prepare_split,
                                     prepare_splits,
                                     render_error,
                                     render_examples,
                                     stream_layout,
)
from gemma_tpu.data.records import load_conversations
from gemma_tpu.data.render import Renderer

__all__ = ["Prepared", "Renderer", "TrainStream", "check_layout", "check_one_batch", "duplicates_warning",
           "epochs_warning", "eval_batches", "eval_fingerprint", "load_conversations", "make_renderer",
           "overlap_warning", "overlength_warning", "prepare_examples", "prepare_split", "prepare_splits",
           "render_error", "render_examples", "stream_layout"]

"""What the embedded-model builders share: the error of a failed build and a timed log step."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

from gemma_tpu.core.errors import UserError

log = logging.getLogger("gemma_tpu.assets")

class AssetError(UserError):
    """Preparing an embedded model failed in a way the user can act on (bad source, bad cache)."""


@contextlib.contextmanager
def log_step(what: str) -> Iterator[None]:
    """Log the start and duration of a long step (progress goes to stderr via logging)."""
    log.info("%s ...", what)
    t = time.monotonic()
    yield
    log.info("%s: done in %.1f s", what, time.monotonic() - t)

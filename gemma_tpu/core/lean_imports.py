"""Keep PyTorch and pandas out of the processes that never use them (1.4 s + 0.2 s of a CLI start on a
2-core CPU; whole processes, medians of 5: a tokenizer load 3.0 s -> 1.1 s, `import gemma_tpu.train.trainer`
4.1 s -> 2.1 s, `python -m gemma_tpu.evaluate` on a tiny model and one example 8.5 s -> 5.6 s).

Three library modules import them at module level without needing them there:

- `transformers.modeling_gguf_pytorch_utils` (imported by every fast tokenizer, through
  `tokenization_utils_tokenizers`) runs `if is_torch_available(): import torch` and uses torch only inside
  `load_gguf_checkpoint` (GGUF weights -> tensors);
- `tunix.utils.trajectory_logger` (tunix's `__init__` -> the agentic RL learner) runs `import pandas as pd`
  and uses pandas only inside its functions;
- `tensorboardX.writer` (tunix.sft.metrics_logger -> metrax.logging -> tensorboardX) runs `try: import
  torch; numpy_compatible = torch.Tensor except ImportError: ...`, a name used only in type hints.

Within `deferred_imports()`, while one of those module bodies runs for the first time and the module it
imports is not imported yet, its import gets a stand-in (`_Deferred`) that imports the real module at its
first attribute read and rebinds the importer's global to it (so `load_gguf_checkpoint` and the trajectory
logger behave as before), or, for tensorboardX, fails as if torch were absent. A stand-in is never left in
`sys.modules`; every other import, and those modules' own function-level imports, are untouched: a process
that loads a PyTorch model still gets torch when it does. `cli_main` runs every entry point within it.
An environment variable could not do this: transformers 5 dropped `USE_TORCH` (its `is_torch_available`
asks only whether torch is installed), and one set by our package would reach the test processes whose
reference models need torch."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from importlib.abc import Loader, MetaPathFinder

LAZY, ABSENT = "lazy", "absent"
# importer -> (the module its top-level import names, what that import gets while the importer first runs)
DEFERRED = {
    "transformers.modeling_gguf_pytorch_utils": ("torch", LAZY),
    "tunix.utils.trajectory_logger": ("pandas", LAZY),
    "tensorboardX.writer": ("torch", ABSENT),  # ModuleNotFoundError, which the module catches
}


class _Deferred(types.ModuleType):
    """What a LAZY import binds: the first attribute read imports the real module and rebinds the
    importer's globals to it. Dunder names are not forwarded: the import machinery probes them (`__path__`)
    while it makes the stand-in, and answering would import the module then."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        target = self.__name__
        if sys.modules.get(target) is self:
            del sys.modules[target]
        real = importlib.import_module(target)
        owner = sys.modules.get(self.__dict__.get("_importer", ""))
        if owner is not None:
            for key, value in list(vars(owner).items()):
                if value is self:
                    setattr(owner, key, real)
        return getattr(real, name)


class _StandIn(Loader):
    def __init__(self, importer: str):
        self.importer = importer

    def create_module(self, spec):
        module = _Deferred(spec.name, f"stand-in for {spec.name}, imported at first use (gemma_tpu.core.lean_imports)")
        module._importer = self.importer
        return module

    def exec_module(self, module):
        pass


class _Unstub(Loader):
    """An importer's own loader, then the stand-in it got taken back out of `sys.modules`."""

    def __init__(self, loader: Loader, target: str):
        self.loader, self.target = loader, target

    def __getattr__(self, name):  # get_source, is_package, get_filename...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        finally:
            if isinstance(sys.modules.get(self.target), _Deferred):
                del sys.modules[self.target]


def _importer() -> str | None:
    """The module whose code runs the import being resolved, if its body is running for the first time."""
    frame = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("importlib"):
        frame = frame.f_back
    if frame is None or not getattr(frame.f_globals.get("__spec__"), "_initializing", False):
        return None
    return frame.f_globals.get("__name__")


class _Gate(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in DEFERRED:  # an importer: its own spec, with a loader that takes the stand-in back
            if DEFERRED[fullname][1] != LAZY:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = _Unstub(spec.loader, DEFERRED[fullname][0])
                    return spec
            return None
        if "." in fullname:
            return None
        who = _importer()
        if who not in DEFERRED or DEFERRED[who][0] != fullname:
            return None
        if DEFERRED[who][1] == ABSENT:
            raise ModuleNotFoundError(f"{fullname} deferred by gemma_tpu.core.lean_imports", name=fullname)
        return importlib.util.spec_from_loader(fullname, _StandIn(who))


@contextlib.contextmanager
def deferred_imports():
    """Within: the imports `DEFERRED` names are deferred or skipped (above)."""
    gate = _Gate()
    sys.meta_path.insert(0, gate)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(gate)

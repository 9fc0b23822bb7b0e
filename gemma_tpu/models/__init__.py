"""Models: the family registry (a leaf: facts as data), one module per family (config translation,
weight tables, Tunix model patches), loading a checked model from an HF directory, and the sharded
weight reader. Importing this package registers every family."""

from gemma_tpu.models import gemma3, gemma4  # noqa: F401  (each registers its Family)
from gemma_tpu.models.loading import ResolvedModel, load_model, resolve_model
from gemma_tpu.models.registry import Family, Projection, detect_family, get_family

__all__ = ["Family", "Projection", "ResolvedModel", "detect_family", "get_family", "load_model", "resolve_model"]

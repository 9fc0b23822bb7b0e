"""Model families (registry), loading from HF directories, and forward helpers."""

from gemma_tpu.models.loading import ResolvedModel, load_model, resolve_model
from gemma_tpu.models.registry import Family, Projection, detect_family, get_family

__all__ = ["Family", "Projection", "ResolvedModel", "detect_family", "get_family", "load_model", "resolve_model"]

"""Model implementations on flattened token batches with paged attention."""

from engine.models.registry import build_model

__all__ = ["build_model"]

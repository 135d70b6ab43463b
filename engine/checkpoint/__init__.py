"""Checkpoints on disk: reading them into a model (`loader`), their files, tensor names and
quantized formats, describing one without loading it, and writing synthetic ones for tests."""

from engine.checkpoint.loader import load_model, weights_id

__all__ = ["load_model", "weights_id"]

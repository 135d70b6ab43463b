"""deepmesh: a serving stack for DeepSeek-V4-family models."""

__version__ = "0.1.0"

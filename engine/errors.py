"""Exceptions the engine raises for bad input; each is a ValueError so callers can map them to 4xx."""


class EngineError(ValueError):
    """Base class of every error caused by what a caller asked the engine to do."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve: bad token ids, empty prompt, bad sampling params."""


class UnknownRequestError(EngineError):
    """A request id the engine does not hold (abort of a finished or never-added request)."""


class UnsupportedCheckpointError(EngineError):
    """A checkpoint that exists but that this engine cannot run (quantized, other architecture)."""

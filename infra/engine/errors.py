"""Errors of the embedded engine that its HTTP server maps to status codes."""


class EngineInputError(ValueError):
    """A request the engine cannot serve (bad token ids, too long, bad params). HTTP 400."""

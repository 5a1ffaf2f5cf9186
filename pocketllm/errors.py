"""Exceptions raised by PocketLLM's public surface."""


class PocketLLMError(Exception):
    """Base class of every PocketLLM error."""


class InvalidRequestError(PocketLLMError, ValueError):
    """A request or parameter value that cannot be served as given.

    ``param`` names the offending field when one is to blame (the HTTP layer turns it into a 400).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UnsupportedFeatureError(PocketLLMError):
    """The selected backend, device or checkpoint cannot do what was asked."""


class CheckpointError(PocketLLMError):
    """A checkpoint that cannot be loaded (missing files, pickle formats, unknown architecture)."""


class EngineDeadError(PocketLLMError):
    """The engine loop stopped (shut down or crashed); no more requests can be served."""

"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class SpecDecError(Exception):
    """Base class for every error caused by user input or environment, not by a bug."""


class ConfigError(SpecDecError, ValueError):
    """A configuration value is invalid."""


class ModelLoadError(SpecDecError):
    """A model could not be found or loaded."""


class VocabularyMismatchError(SpecDecError):
    """The draft and target models do not share a vocabulary token for token."""


class PromptError(SpecDecError, ValueError):
    """A prompt is empty or does not fit the model's context (`too_long`: the latter)."""

    def __init__(self, message: str, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long

"""Typed errors that cross package boundaries. Messages tell the user what to do."""

from __future__ import annotations


class KvserveError(Exception):
    """Base of every error kvserve raises on purpose."""


class ModelLoadError(KvserveError):
    """A model path, file or format cannot be used (missing, corrupt, unsupported)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture has no implementation in kvserve."""


class PromptTooLongError(KvserveError):
    """A prompt (plus max_tokens) does not fit the model's context or the KV cache."""


class InvalidRequestError(KvserveError):
    """A request's parameters are invalid (bad sampling params, empty prompt, ...)."""

"""Typed errors. Every error megalith raises on bad input is one of these, with the offending value."""

from __future__ import annotations


class MegalithError(Exception):
    """Base class of every error megalith raises on purpose."""


class ConfigError(MegalithError, ValueError):
    """A configuration value is invalid (wrong size, unknown choice, inconsistent options)."""


class DistributedError(MegalithError, RuntimeError):
    """A collective or peer process failed or timed out; the message names the peer and cause."""


class CheckpointError(MegalithError, RuntimeError):
    """A checkpoint is missing, incomplete, or does not match the model/optimizer it is loaded into."""


class DataError(MegalithError, ValueError):
    """Input data is malformed; the message names the file and line where known."""


class MissingDependencyError(MegalithError, ImportError):
    """An optional dependency is needed for this feature and is not installed."""

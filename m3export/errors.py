"""Errors users can act on: each names the file, tensor or field at fault. The CLI prints them in one line."""

from __future__ import annotations


class M3Error(Exception):
    """Base class for every error the CLI reports as 'error: ...' with exit code 2."""


class CheckpointError(M3Error):
    """A checkpoint file, index or tensor is missing, malformed or inconsistent with the config."""


class ArtifactError(M3Error):
    """An artifact directory is missing files, has a bad manifest, or was written by an incompatible version."""


class BackendUnavailable(M3Error):
    """A requested backend (TensorRT, CUDA, ...) is not installed or not usable on this machine."""


class MediaError(M3Error, ValueError):
    """An image or video is unreadable, empty, too large, or does not match its placeholders in the prompt."""

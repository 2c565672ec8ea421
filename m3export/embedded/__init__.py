"""The embedded default model: a small M3 really trained on Python source, shipped inside the package.

``code-tiny/`` is a checkpoint in the release's original layout (``model.safetensors`` in BF16, ``config.json``,
``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``, and ``training.json`` with the held-out
metrics recorded at training time). It has the full M3 architecture at small size (dense + lightning-indexer
sparse layers with 16-token index blocks, sigmoid-routed MoE with a shared expert, two MTP modules) and was
produced by ``scripts/train_tiny.py``. Commands use it when no checkpoint is given; the random-weight presets
(``tiny``, ``mini``) stay for tests and benchmarks.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError

NAME = "code-tiny"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / NAME


def default_model() -> Path:
    """Directory of the embedded checkpoint; a clear error if the package was installed without it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise CheckpointError(f"{DEFAULT_MODEL_DIR}: the embedded default checkpoint is missing (package data not "
                              "installed?); reinstall m3export or rebuild it with scripts/train_tiny.py")
    return DEFAULT_MODEL_DIR

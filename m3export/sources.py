"""What a command, the engine or the server was pointed at: a preset, a checkpoint directory or an artifact.

One function decides it, with one precedence, for every entry point (loading, export, generate, the Triton
repository writer, the runtime's tokenizer lookup): an existing directory wins over a preset name, and a
directory is an artifact when it holds ``manifest.json`` (an in-place export adds one to a checkpoint, which then
runs as that artifact; ``m3export export --checkpoint`` still reads it as a checkpoint). A path that is neither
a directory nor a preset name is treated as a checkpoint, so the checkpoint loader reports what is wrong with it.

The names of the runtime backends live here too, so command-line choices need no heavy import.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import PRESETS

PRESET, CHECKPOINT, ARTIFACT = "preset", "checkpoint", "artifact"
MANIFEST = "manifest.json"  # marks an exported artifact (m3export.export.manifest reads and writes it)
BACKENDS = ("torch", "onnxruntime", "tensorrt")  # runtime backends, by name (m3export.runtime.backends)


def source_kind(source: str | os.PathLike) -> str:
    """``"artifact"``, ``"checkpoint"`` or ``"preset"``: see the module docstring for the precedence."""
    path = Path(source)
    if path.is_dir():
        return ARTIFACT if (path / MANIFEST).is_file() else CHECKPOINT
    return PRESET if str(source) in PRESETS else CHECKPOINT


def is_preset(source: str | os.PathLike) -> bool:
    return source_kind(source) == PRESET


def default_backend(source: str | os.PathLike) -> str:
    """The backend a source runs on when none is asked for: an exported artifact on the one it was exported for
    (its ONNX graphs, in ONNX Runtime); checkpoints and presets, which have no graphs, on torch."""
    return "onnxruntime" if source_kind(source) == ARTIFACT else "torch"

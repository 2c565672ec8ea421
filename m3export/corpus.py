"""The training corpus of the embedded model: the Python standard library's own source files.

They are present wherever Python is, so nothing is downloaded. The held-out split is by file and depends only
on the file's path relative to the stdlib root (a hash), so every machine and every run agrees on it, and a file
added or removed by another Python version never moves any other file across the split.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})  # installed packages and the test suites
HELDOUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str) -> bool:
    """True for the ~5 % of files that training never sees (decided by a hash of the relative path)."""
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def stdlib_files(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``.py`` file of the split (``train`` or ``heldout``), path order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")) or is_heldout(rel) != (split == "heldout"):
            continue
        try:
            out.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of files in other encodings: not worth a special case
    return out


def encode_files(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (``tokenizer``: a ``tokenizers.Tokenizer``), in parallel batches."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def heldout_windows(file_ids: list[list[int]], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` windows of ``length`` tokens: each file's first window in file order, then each file's
    second, and so on, so a small evaluation slice covers many files rather than the start of one."""
    out: list[list[int]] = []
    r = 0
    while len(out) < count:
        round_ = [ids[r * length:(r + 1) * length] for ids in file_ids if len(ids) >= (r + 1) * length]
        if not round_:
            break
        out.extend(round_[: count - len(out)])
        r += 1
    return out

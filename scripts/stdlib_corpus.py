"""The training text of the bundled model: this interpreter's own standard-library sources.

The Python standard library ships on every machine with Python, under the PSF licence, so it may be
redistributed. Files are picked deterministically (sorted relative paths); a fixed ~5% is held out by a
hash of the path, so every script agrees on the split without storing file lists.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# NOTE: tests, generated codec tables and the pydoc topic dump are left out: they are not ordinary code
# and their repetitiveness would flatter both perplexity and draft acceptance.
EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
HELDOUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str) -> bool:
    return hashlib.sha1(relative.encode()).digest()[0] % HELDOUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative paths of the usable .py files, sorted."""
    root = root or stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if not EXCLUDED_PARTS.intersection(path.relative_to(root).parts[:-1]) and not \
                relative.startswith("_sysconfigdata"):
            found.append(relative)
    return sorted(found)


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths."""
    files = corpus_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read_text(relative: str, root: Path | None = None) -> str:
    return ((root or stdlib_root()) / relative).read_text(encoding="utf-8", errors="replace")

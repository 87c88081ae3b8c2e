"""Prompt text for `bench prefix` and `bench chat`: windows of Python standard-library source (the
bundled model's domain, as bench serve's `code` dataset), chosen by a seeded generator, so one seed
gives the same windows on every run of the same interpreter."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from mtpserve.bench.serve_dataset import CHARS_PER_TOKEN

NUM_FILES = 40  # standard-library modules a corpus draws from


class CodeCorpus:
    def __init__(self, seed: int, num_files: int = NUM_FILES) -> None:
        self.rng = random.Random(seed)
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        chosen = self.rng.sample(files, min(num_files, len(files)))
        self.lines = [line for f in chosen for line in f.read_text(errors="replace").splitlines()]

    def window(self, num_tokens: float) -> str:
        """Whole lines from a random start (wrapping around) until about `num_tokens` tokens (at
        CHARS_PER_TOKEN characters a token)."""
        num_chars = round(num_tokens * CHARS_PER_TOKEN)
        start, out, size = self.rng.randrange(len(self.lines)), [], 0
        for line in self.lines[start:] + self.lines[:start]:
            out.append(line)
            size += len(line) + 1
            if size >= num_chars:
                break
        return "\n".join(out) + "\n"

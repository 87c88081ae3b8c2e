"""Write a model directory's `draft_vocab.json`: the N most frequent tokens of the training text.

Usage: python scripts/make_draft_vocab.py [--model daemon/default_model] --size 1024 [--out FILE]

MTP drafts are then the argmax over these tokens' LM-head rows only (daemon/model/draft_vocab.py):
a cheaper head per draft depth, the same output (verification is lossless), at most a little lower
acceptance. Tokens are counted over the training files of scripts/stdlib_corpus.py (held-out files
are not read), each file joined by EOS as in training; ties go to the lower id. EOS is always kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import read_text, split_files  # noqa: E402

from mtpserve.model.config import ModelConfig  # noqa: E402
from mtpserve.model.draft_vocab import DRAFT_VOCAB_FILE  # noqa: E402
from mtpserve.model.loader import DEFAULT_MODEL_DIR  # noqa: E402
from mtpserve.tokenizer import Tokenizer  # noqa: E402


def token_counts(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """[V] occurrences of each id over the training files (each followed by EOS)."""
    files = split_files()[0]
    encoded = tokenizer.encode_batch([read_text(name) for name in files], add_special_tokens=False)
    counts = np.zeros(vocab_size, np.int64)
    for ids in encoded:
        counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)
    if tokenizer.eos_token_id is not None:
        counts[tokenizer.eos_token_id] += len(encoded)
    return counts


def most_frequent(counts: np.ndarray, size: int, keep: list[int]) -> np.ndarray:
    """The `size` most frequent ids, most frequent first (stable: ties go to the lower id), with
    every id in `keep` included."""
    order = np.argsort(-counts, kind="stable")
    chosen = [int(i) for i in keep] + [int(i) for i in order if int(i) not in keep]
    return np.asarray(chosen[:size], np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--size", type=int, default=1024, help="tokens in the draft vocabulary")
    parser.add_argument("--out", type=Path, default=None, help=f"default: MODEL/{DRAFT_VOCAB_FILE}")
    args = parser.parse_args()
    vocab_size = ModelConfig.from_file(args.model / "config.json").vocab_size
    tokenizer = Tokenizer.from_model_dir(args.model)
    counts = token_counts(tokenizer, vocab_size)
    keep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = most_frequent(counts, args.size, keep)
    coverage = float(counts[ids].sum() / counts.sum())
    doc = {"token_ids": ids.tolist(), "size": int(ids.size), "vocab_size": vocab_size,
           "training_token_coverage": round(coverage, 6),
           "source": "scripts/make_draft_vocab.py: most frequent tokens of the training files"}
    out = args.out or args.model / DRAFT_VOCAB_FILE
    out.write_text(json.dumps(doc) + "\n")
    print(f"wrote {out}: {ids.size} of {vocab_size} tokens, {100 * coverage:.2f}% of training tokens")


if __name__ == "__main__":
    main()

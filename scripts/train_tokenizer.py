"""Train the bundled model's byte-level BPE tokenizer on the standard-library training files.

Usage: python scripts/train_tokenizer.py --out runs/default_model [--vocab-size 4096]
Writes tokenizer.json and the token streams (train.u16, heldout.u16) that training reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stdlib_corpus import read_text, split_files

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All files joined by EOS, as one uint16 token stream."""
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None, f"the tokenizer has no {EOS} token"
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = split_files()
    train_texts = [read_text(f) for f in train_files]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    tokenizer.save(str(args.out / "tokenizer.json"))
    train = encode_stream(tokenizer, train_texts)
    heldout = encode_stream(tokenizer, [read_text(f) for f in heldout_files])
    train.tofile(args.out / "train.u16")
    heldout.tofile(args.out / "heldout.u16")
    summary = {"train_files": len(train_files), "heldout_files": len(heldout_files),
               "train_tokens": int(train.size), "heldout_tokens": int(heldout.size),
               "train_chars": sum(map(len, train_texts)), "vocab_size": tokenizer.get_vocab_size()}
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

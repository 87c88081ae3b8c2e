"""Held-out perplexity of a model's main head and teacher-forced quality of its MTP layers.

Usage: python scripts/measure_perplexity.py [--model daemon/default_model] [--json out.json]

All held-out standard-library files (scripts/stdlib_corpus.py), joined by EOS, cut into
non-overlapping windows. Reports per head (main, then MTP depth 1..D) the mean cross-entropy and its
perplexity, and for each depth the fraction of positions where the depth's argmax equals the main
model's own argmax for the same token (teacher-forced agreement: how often a draft would be accepted
if every earlier token were the true text).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import read_text, split_files  # noqa: E402

from mtpserve.model.attention_context import DenseCausalContext  # noqa: E402
from mtpserve.model.loader import DEFAULT_MODEL_DIR, load_model  # noqa: E402
from mtpserve.tokenizer import Tokenizer  # noqa: E402


def heldout_stream(tokenizer: Tokenizer) -> np.ndarray:
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int), "the tokenizer has no EOS token"
    for name in split_files()[1]:
        ids += tokenizer.encode(read_text(name), add_special_tokens=False) + [eos]
    return np.asarray(ids, np.int64)


def window_stats(model, windows: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """windows [B, S+1+D] -> (summed CE per head [1+D], summed agreement per depth [D])."""
    b, depth = windows.shape[0], model.num_mtp_layers
    w = paddle.to_tensor(windows)
    ctx = DenseCausalContext(b, seq_len)
    positions = paddle.arange(seq_len, dtype="int64").tile([b])
    out = model.run(w[:, :seq_len].flatten(), positions, ctx)
    logits = [model.compute_logits(out.hidden_states)]
    prev = out.mtp_hidden
    for d in range(1, depth + 1):
        mtp = model.run_mtp(d - 1, w[:, d:seq_len + d].flatten(), prev, positions, ctx)
        logits.append(model.compute_logits(mtp.hidden_states))
        prev = mtp.mtp_hidden
    ce = [paddle.nn.functional.cross_entropy(lg, w[:, d + 1:seq_len + d + 1].reshape([-1, 1]), reduction="sum")
          for d, lg in enumerate(logits)]
    main = logits[0].argmax(-1).reshape([b, seq_len])  # main's prediction of token t+1
    agree = []
    for d in range(1, depth + 1):
        draft = logits[d].argmax(-1).reshape([b, seq_len])[:, : seq_len - d]  # predicts t+d+1
        agree.append(float((draft == main[:, d:]).astype("float32").sum()))
    return np.array([float(x) for x in ce]), np.array(agree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = load_model(args.model)
    tokens = heldout_stream(Tokenizer.from_model_dir(args.model))
    depth, s = model.num_mtp_layers, args.seq_len
    width = s + 1 + depth
    starts = np.arange(0, tokens.size - width, s)
    ce, agree = np.zeros(1 + depth), np.zeros(depth)
    with paddle.no_grad():
        for chunk in np.array_split(starts, max(1, -(-len(starts) // args.batch))):
            c, a = window_stats(model, np.stack([tokens[i:i + width] for i in chunk]), s)
            ce, agree = ce + c, agree + a
    n = len(starts) * s
    result = {"model": str(args.model), "heldout_tokens": int(tokens.size), "scored_tokens": int(n),
              "cross_entropy": (ce / n).round(4).tolist(),
              "perplexity": [round(math.exp(x / n), 3) for x in ce],
              "teacher_forced_agreement": [round(float(a / (len(starts) * (s - d - 1))), 4)
                                           for d, a in enumerate(agree)]}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Second phase for the bundled model: distil the MTP layers towards the main model's own predictions.

Usage (after scripts/train_default_model.py finished):
  OMP_NUM_THREADS=1 nice -n 10 nohup .venv/bin/python scripts/distill_mtp.py --data DIR \
      --init DIR/checkpoint --out DIR/distilled --steps N > DIR/distill.log 2>&1 &

The main model and the shared embedding are frozen. On training text, MTP depth d at position t is
trained towards the main model's next-token distribution at position t+d (soft cross-entropy), i.e.
towards what the verifier will accept, instead of towards the text itself. Acceptance is what a draft
layer is for; the main model's outputs, and so greedy decoding, are unchanged.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import paddle

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.checkpoint import save_checkpoint
from mtpserve.model.loader import load_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="directory with train.u16")
    p.add_argument("--init", type=Path, required=True, help="trained checkpoint directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=4321)
    return p.parse_args()


def distill_loss(model, windows: paddle.Tensor, seq_len: int) -> list[paddle.Tensor]:
    """windows [B, S + D] -> soft CE of each depth against the main model's distribution."""
    b, depth = windows.shape[0], model.num_mtp_layers
    ctx = DenseCausalContext(b, seq_len + depth)
    positions = paddle.arange(seq_len + depth, dtype="int64").tile([b])
    with paddle.no_grad():
        out = model.run(windows.flatten(), positions, ctx)  # main over S + D tokens
        target = paddle.nn.functional.softmax(model.compute_logits(out.hidden_states), axis=-1)
        target = target.reshape([b, seq_len + depth, -1])
    pos = paddle.arange(seq_len, dtype="int64").tile([b])
    dense = DenseCausalContext(b, seq_len)
    prev = out.mtp_hidden.reshape([b, seq_len + depth, -1])[:, :seq_len].reshape([b * seq_len, -1])
    losses = []
    for d in range(1, depth + 1):
        tokens = windows[:, d:seq_len + d].flatten()
        mtp = model.run_mtp(d - 1, tokens, prev, pos, dense)
        soft = target[:, d:seq_len + d].reshape([b * seq_len, -1])  # main's view of token t+d+1
        logits = model.compute_logits(mtp.hidden_states)
        losses.append(paddle.nn.functional.cross_entropy(logits, soft, soft_label=True).mean())
        prev = mtp.mtp_hidden
    return losses


def main() -> None:
    args = parse_args()
    paddle.seed(args.seed)
    train = np.fromfile(args.data / "train.u16", dtype=np.uint16)
    model = load_model(args.init)
    model.train()
    trainable = list(model.model.mtp_layers.parameters())
    for p in model.parameters():
        p.stop_gradient = True
    for p in trainable:
        p.stop_gradient = False
    schedule = paddle.optimizer.lr.CosineAnnealingDecay(args.lr, T_max=args.steps, eta_min=args.lr * 0.1)
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=trainable, weight_decay=0.0,
                                       beta2=0.95, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    width = args.seq_len + model.num_mtp_layers
    t0 = time.time()
    for step in range(1, args.steps + 1):
        rng = np.random.default_rng(args.seed * 1_000_003 + step)
        starts = rng.integers(0, train.size - width, size=args.batch)
        windows = paddle.to_tensor(np.stack([train[s:s + width] for s in starts]).astype(np.int64))
        parts = distill_loss(model, windows, args.seq_len)
        paddle.add_n(parts).backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        rate = step * args.batch * args.seq_len / (time.time() - t0)
        print(f"step {step}/{args.steps} soft_ce {' '.join(f'{float(x):.4f}' for x in parts)} "
              f"tok/s {rate:.0f} eta_min {(args.steps - step) * args.batch * args.seq_len / rate / 60:.1f}",
              flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(model, args.out)
            (args.out / "distill_state.json").write_text(json.dumps({"step": step, "elapsed_s": time.time() - t0}))
    print(f"done elapsed_s {time.time() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()

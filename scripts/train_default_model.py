"""Train the bundled default model: a small Qwen2-style decoder plus MTP layers, on stdlib sources.

Run `scripts/train_tokenizer.py --out DIR` first; then, in the background:
  OMP_NUM_THREADS=1 nice -n 10 nohup .venv/bin/python scripts/train_default_model.py --out DIR --steps N > DIR/train.log 2>&1 &
Every `--save-every` steps it writes DIR/checkpoint/ (config.json + model.safetensors in the final
layout, plus optimizer state and the step); rerunning the same command resumes from there.

Loss = CE(main, token t+1) + mtp_weight * sum over MTP depths d of CE(depth d, token t+1+d). MTP depth
1 at position t reads the main model's hidden state at t *before* the final norm (as MiMo and
DeepSeek-V3 do) and the embedding of token t+1; depth d>1 reads depth d-1's hidden state and token t+d.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import paddle

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.checkpoint import load_weights, save_checkpoint
from mtpserve.model.config import ModelConfig
from mtpserve.model.mimo_model import MiMoForCausalLM


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--mtp-layers", type=int, default=2)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                       num_nextn_predict_layers=args.mtp_layers, bos_token_id=0, eos_token_id=0)


def sample_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, width: int) -> np.ndarray:
    starts = rng.integers(0, tokens.size - width, size=batch)
    return np.stack([tokens[s:s + width] for s in starts]).astype(np.int64)  # [B, width]


def losses(model: MiMoForCausalLM, windows: paddle.Tensor, seq_len: int) -> list[paddle.Tensor]:
    """windows: [B, S + 1 + D] -> [main CE, depth-1 CE, ..., depth-D CE] (means over B*S)."""
    b = windows.shape[0]
    ctx = DenseCausalContext(b, seq_len)
    positions = paddle.arange(seq_len, dtype="int64").tile([b])  # [B*S]
    out = model.run(windows[:, :seq_len].flatten(), positions, ctx)
    result = [_cross_entropy(model, out.hidden_states, windows[:, 1:seq_len + 1])]
    prev = out.mtp_hidden
    for d in range(1, model.num_mtp_layers + 1):
        tokens = windows[:, d:seq_len + d].flatten()  # token t+d at position t
        mtp = model.run_mtp(d - 1, tokens, prev, positions, ctx)
        result.append(_cross_entropy(model, mtp.hidden_states, windows[:, d + 1:seq_len + d + 1]))
        prev = mtp.mtp_hidden
    return result


def _cross_entropy(model: MiMoForCausalLM, hidden: paddle.Tensor, targets: paddle.Tensor) -> paddle.Tensor:
    logits = model.compute_logits(hidden)  # [B*S, V]
    return paddle.nn.functional.cross_entropy(logits, targets.flatten().unsqueeze(-1)).mean()


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def evaluate(model: MiMoForCausalLM, tokens: np.ndarray, args: argparse.Namespace) -> list[float]:
    """Mean held-out CE per head over fixed, non-overlapping windows."""
    width = args.seq_len + 1 + args.mtp_layers
    starts = np.arange(0, tokens.size - width, width)[:64]
    totals = np.zeros(1 + args.mtp_layers)
    model.eval()
    with paddle.no_grad():
        for chunk in np.array_split(starts, max(1, len(starts) // args.batch)):
            windows = np.stack([tokens[s:s + width] for s in chunk]).astype(np.int64)
            totals += [float(x) for x in losses(model, paddle.to_tensor(windows), args.seq_len)]
    model.train()
    return list(totals / max(1, len(np.array_split(starts, max(1, len(starts) // args.batch)))))


def save_state(model, optimizer, step: int, ckpt: Path, log: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, ckpt)
    paddle.save(optimizer.state_dict(), str(ckpt / "optimizer.pdopt"))
    (ckpt / "state.json").write_text(json.dumps({"step": step, **log}))


def main() -> None:
    args = parse_args()
    paddle.seed(args.seed)
    train = np.fromfile(args.out / "train.u16", dtype=np.uint16)
    heldout = np.fromfile(args.out / "heldout.u16", dtype=np.uint16)
    vocab = json.loads((args.out / "corpus.json").read_text())["vocab_size"]
    config = model_config(args, vocab)
    model = MiMoForCausalLM(config)
    schedule = paddle.optimizer.lr.LambdaDecay(args.lr, lr_lambda(args.warmup, args.steps))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters(),
                                       weight_decay=0.1, beta2=0.95,
                                       apply_decay_param_fun=lambda name: name in {p.name for p in decay},
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    ckpt = args.out / "checkpoint"
    step = resume(model, optimizer, ckpt)
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    print(f"params={n_params} config={json.dumps(config.to_dict())} start_step={step}", flush=True)
    train_loop(model, optimizer, schedule, train, heldout, args, step, ckpt)


def resume(model, optimizer, ckpt: Path) -> int:
    if not (ckpt / "state.json").exists():
        return 0
    load_weights(model, ckpt)
    optimizer.set_state_dict(paddle.load(str(ckpt / "optimizer.pdopt")))
    step = json.loads((ckpt / "state.json").read_text())["step"]
    print(f"resumed from {ckpt} at step {step}", flush=True)
    return step


def train_loop(model, optimizer, schedule, train, heldout, args, step: int, ckpt: Path) -> None:
    width = args.seq_len + 1 + args.mtp_layers
    tokens_per_step = args.batch * args.seq_len
    t0, start_step, running = time.time(), step, None
    while step < args.steps:
        rng = np.random.default_rng(args.seed * 1_000_003 + step)
        windows = paddle.to_tensor(sample_windows(train, rng, args.batch, width))
        parts = losses(model, windows, args.seq_len)
        loss = parts[0] + args.mtp_weight * paddle.add_n(parts[1:]) if len(parts) > 1 else parts[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        step += 1
        values = np.array([float(p) for p in parts])
        running = values if running is None else 0.95 * running + 0.05 * values
        if step % args.log_every == 0:
            rate = (step - start_step) * tokens_per_step / (time.time() - t0)
            eta = (args.steps - step) * tokens_per_step / rate
            print(f"step {step}/{args.steps} loss_main {running[0]:.4f} loss_mtp "
                  f"{' '.join(f'{x:.4f}' for x in running[1:])} lr {schedule.get_lr():.2e} "
                  f"tok/s {rate:.0f} eta_min {eta / 60:.1f}", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            ce = evaluate(model, heldout, args)
            print(f"eval step {step} heldout_ce {' '.join(f'{x:.4f}' for x in ce)} "
                  f"heldout_ppl_main {math.exp(ce[0]):.3f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save_state(model, optimizer, step, ckpt, {"running_loss": running.tolist(),
                                                      "elapsed_s": time.time() - t0})
    print(f"done step {step} elapsed_s {time.time() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()

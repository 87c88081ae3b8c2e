"""Measure MTP draft acceptance of a model, greedily, on held-out standard-library files.

Usage:
  python scripts/measure_acceptance.py [--model daemon/default_model] [--k 2] [--json out.json]

Prompts are windows of held-out stdlib files (never trained on; see scripts/stdlib_corpus.py). Each
prompt is continued by greedy speculative decoding through the model's serving interface (paged KV
cache, mixed prefill/verify batches): every round the main model verifies the k drafts of the MTP
layers, accepts the longest matching prefix and adds its own bonus token. The script reports the
acceptance rate of each draft position and the mean accepted length (1 + accepted drafts per verify
step). With --check-greedy it also decodes without drafts and checks the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import read_text, split_files  # noqa: E402

from mtpserve.model.draft_vocab import read_draft_vocab_file  # noqa: E402
from mtpserve.model.forward_batch import ForwardBatch  # noqa: E402
from mtpserve.model.kv_cache import KVCache  # noqa: E402
from mtpserve.model.loader import DEFAULT_MODEL_DIR, load_model  # noqa: E402
from mtpserve.tokenizer import Tokenizer  # noqa: E402

BLOCK_SIZE = 16


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    blocks: list[int]
    drafts: list[int] = field(default_factory=list)
    hidden: list = field(default_factory=list)  # per depth 0..k: [positions 0..N-1, H] paddle rows
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def last(self) -> int:
        return len(self.tokens) - 1


def pack(windows: list[tuple[list[int], int, list[int], int]]) -> ForwardBatch:
    """windows: (token ids, first position, blocks, kv length after the step) per sequence."""
    ids, positions, slots, cu, kv_lens = [], [], [], [0], []
    for tokens, start, blocks, kv_len in windows:
        pos = np.arange(start, start + len(tokens))
        ids += tokens
        positions += pos.tolist()
        slots += (np.asarray(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).tolist()
        cu.append(len(ids))
        kv_lens.append(kv_len)
    width = max(len(w[2]) for w in windows)
    tables = np.array([w[2] + [-1] * (width - len(w[2])) for w in windows], np.int32)
    return ForwardBatch(paddle.to_tensor(np.array(ids, np.int64)), paddle.to_tensor(np.array(positions, np.int64)),
                        paddle.to_tensor(np.array(slots, np.int64)), paddle.to_tensor(np.array(cu, np.int32)),
                        paddle.to_tensor(np.array(kv_lens, np.int32)), paddle.to_tensor(tables),
                        max(len(w[0]) for w in windows))


def split_rows(x: paddle.Tensor, lengths: list[int]) -> list[paddle.Tensor]:
    return paddle.split(x, lengths, axis=0) if len(lengths) > 1 else [x]


def verify_round(model, seqs: list[Sequence], kv: KVCache, k: int, eos: int | None,
                 max_new: int) -> list[int]:
    """Main model over [last committed token] + drafts (the whole prompt on the first round).

    Returns, per sequence, the first position whose depth outputs must be recomputed this round.
    """
    starts = [0 if not s.hidden else s.last for s in seqs]
    windows = [(s.tokens[st:] + s.drafts, st, s.blocks, s.last + 1 + len(s.drafts)) for s, st in zip(seqs, starts)]
    out = model.forward(pack(windows), kv)
    greedy = model.compute_logits(out.hidden_states).argmax(-1).numpy()
    rows = split_rows(out.mtp_hidden, [len(w[0]) for w in windows])
    offset = 0
    for s, st, w, h in zip(seqs, starts, windows, rows):
        g = greedy[offset:offset + len(w[0])]
        offset += len(w[0])
        base = s.last - st  # index of the last committed token in the window
        a = 0
        while a < len(s.drafts) and s.drafts[a] == g[base + a]:
            a += 1
        if s.hidden:
            s.accepted.append(a)
        s.tokens += s.drafts[:a] + [int(g[base + a])]
        s.hidden = [_keep(s.hidden[0] if s.hidden else None, st, h[:base + a + 1])] + s.hidden[1:]
        new = s.tokens[s.prompt_len:]
        s.done = len(new) >= max_new or (eos is not None and eos in new)
    return starts


def _keep(old, start: int, rows: paddle.Tensor) -> paddle.Tensor:
    return rows if old is None or start == 0 else paddle.concat([old[:start], rows])


def draft_round(model, seqs: list[Sequence], starts: list[int], mtp_kv: KVCache, k: int) -> None:
    """Depth j = 1..k: positions from (old last - j + 1) to N-1, reading token t+j (drafts past N)."""
    for s in seqs:
        s.drafts = []
    for j in range(1, k + 1):
        first = [0 if st == 0 else max(0, st - j + 1) for st in starts]
        inputs = [[(s.tokens + s.drafts)[t + j] for t in range(f, s.last)] for s, f in zip(seqs, first)]
        batch = pack([(toks, f, s.blocks, s.last) for toks, f, s in zip(inputs, first, seqs)])
        prev = paddle.concat([s.hidden[j - 1][f:s.last] for s, f in zip(seqs, first)])
        out = model.mtp_forward(j - 1, batch, batch.input_ids, prev, mtp_kv)
        lengths = [len(t) for t in inputs]
        last_rows = paddle.to_tensor(np.cumsum(lengths) - 1)
        drafts = model.draft_token_ids(paddle.gather(out.hidden_states, last_rows)).numpy()
        for s, f, rows, d in zip(seqs, first, split_rows(out.mtp_hidden, lengths), drafts):
            s.drafts.append(int(d))
            old = s.hidden[j] if len(s.hidden) > j else None
            rows = rows if old is None or f == 0 else paddle.concat([old[:f], rows])
            s.hidden = s.hidden[:j] + [rows] + s.hidden[j + 1:]


def decode(model, prompts: list[list[int]], k: int, max_new: int, eos: int | None) -> list[Sequence]:
    c = model.config
    blocks_per_seq = -(-(max(map(len, prompts)) + max_new + k + 2) // BLOCK_SIZE)
    kv = KVCache.allocate(c.num_hidden_layers, blocks_per_seq * len(prompts), BLOCK_SIZE,
                          c.num_key_value_heads, c.head_dim)
    mtp_kv = KVCache.allocate(max(1, k), blocks_per_seq * len(prompts), BLOCK_SIZE,
                              c.num_key_value_heads, c.head_dim)
    seqs = [Sequence(list(p), len(p), list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i, p in enumerate(prompts)]
    while active := [s for s in seqs if not s.done]:
        starts = verify_round(model, active, kv, k, eos, max_new)
        running = [(s, st) for s, st in zip(active, starts) if not s.done]
        if k and running:
            draft_round(model, [s for s, _ in running], [st for _, st in running], mtp_kv, k)
    return seqs


def heldout_prompts(tokenizer: Tokenizer, prompt_len: int, per_file: int) -> list[list[int]]:
    prompts = []
    for name in split_files()[1]:
        ids = tokenizer.encode(read_text(name), add_special_tokens=False)
        if len(ids) < 2 * prompt_len:
            continue
        for i in range(per_file):
            start = (len(ids) - prompt_len) * i // per_file
            prompts.append(ids[start:start + prompt_len])
    return prompts


def summarize(seqs: list[Sequence], k: int) -> dict:
    counts = np.array([a for s in seqs for a in s.accepted])
    per_position = [float((counts >= i).mean()) for i in range(1, k + 1)]
    conditional = [float((counts >= i).sum() / max(1, (counts >= i - 1).sum())) for i in range(1, k + 1)]
    return {"verify_steps": int(counts.size), "mean_accepted_length": float(1 + counts.mean()),
            "acceptance_per_position": per_position, "conditional_acceptance_per_position": conditional,
            "accepted_histogram": np.bincount(counts, minlength=k + 1).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--per-file", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--check-greedy", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--full-draft-vocab", action="store_true",
                        help="ignore the model's draft_vocab.json: drafts over the full vocabulary")
    parser.add_argument("--draft-vocab", type=Path, default=None,
                        help="draft vocabulary file to use instead of the model's draft_vocab.json")
    args = parser.parse_args()
    model = load_model(args.model, draft_vocab=not args.full_draft_vocab)
    if args.draft_vocab is not None:
        model.set_draft_vocab(read_draft_vocab_file(args.draft_vocab, model.config.vocab_size))
    if args.k > model.num_mtp_layers:
        raise SystemExit(f"k={args.k} needs {args.k} MTP layers; the model has {model.num_mtp_layers}")
    tokenizer = Tokenizer.from_model_dir(args.model)
    prompts = heldout_prompts(tokenizer, args.prompt_len, args.per_file)
    t0 = time.time()
    with paddle.no_grad():
        seqs = [s for i in range(0, len(prompts), args.batch)
                for s in decode(model, prompts[i:i + args.batch], args.k, args.max_new, tokenizer.eos_token_id)]
        draft_size = model.draft_head.size if model.draft_head is not None else model.config.vocab_size
        result = {"model": str(args.model), "k": args.k, "draft_vocab_size": draft_size, "prompts": len(prompts),
                  "prompt_len": args.prompt_len, "max_new": args.max_new, **summarize(seqs, args.k), "elapsed_s": round(time.time() - t0, 1)}
        if args.check_greedy:
            t1 = time.time()
            plain = [s for i in range(0, len(prompts), args.batch)
                     for s in decode(model, prompts[i:i + args.batch], 0, args.max_new, tokenizer.eos_token_id)]
            result["elapsed_plain_greedy_s"] = round(time.time() - t1, 1)
            eos = tokenizer.eos_token_id
            result["identical_to_plain_greedy"] = all(_trim(a, args.max_new, eos) == _trim(b, args.max_new, eos)
                                                      for a, b in zip(seqs, plain))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _trim(s: Sequence, max_new: int, eos: int | None) -> list[int]:
    """The continuation as a server would emit it: at most max_new tokens, ending at EOS."""
    new = s.tokens[s.prompt_len:][:max_new]
    return new[:new.index(eos) + 1] if eos is not None and eos in new else new


if __name__ == "__main__":
    main()

"""One tensor-parallel rank: load a checkpoint sliced for this rank, run a paged forward, save logits.

Run by test_tensor_parallel.py under `python -m paddle.distributed.launch --nproc_per_node 2`.
argv: model_dir out_file
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fixtures import Window, pack  # noqa: E402

from mtpserve.model.checkpoint import load_weights  # noqa: E402
from mtpserve.model.config import ModelConfig  # noqa: E402
from mtpserve.model.kv_cache import KVCache  # noqa: E402
from mtpserve.model.mimo_model import MiMoForCausalLM  # noqa: E402
from mtpserve.model.parallel import TensorParallel  # noqa: E402


def run(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    """Main logits and MTP depth-1 logits of two requests, through the paged cache."""
    dist.init_parallel_env()
    tp = TensorParallel(rank=dist.get_rank(), size=dist.get_world_size())
    model = MiMoForCausalLM(ModelConfig.from_file(model_dir / "config.json"), tp)
    load_weights(model, model_dir)
    model.eval()
    c = model.config
    kv = KVCache.allocate(c.num_hidden_layers, 8, 4, c.num_key_value_heads // tp.size, c.head_dim)
    mtp_kv = KVCache.allocate(c.num_nextn_predict_layers, 8, 4, c.num_key_value_heads // tp.size, c.head_dim)
    batch = pack([Window(ids[0, :-1].tolist(), 0, [0, 1]), Window(ids[1, :-1].tolist(), 0, [2, 3])], 4, 2)
    with paddle.no_grad():
        out = model.forward(batch, kv)
        shifted = paddle.to_tensor(ids[:, 1:].reshape(-1))
        mtp = model.mtp_forward(0, batch, shifted, out.mtp_hidden, mtp_kv)
        return np.concatenate([model.compute_logits(out.hidden_states).numpy(),
                               model.compute_logits(mtp.hidden_states).numpy()])


if __name__ == "__main__":
    tokens = np.random.default_rng(0).integers(0, 90, (2, 8))
    logits = run(Path(sys.argv[1]), tokens)
    if dist.get_rank() == 0:
        np.save(sys.argv[2], logits)
        Path(sys.argv[2]).with_suffix(".world").write_text(str(dist.get_world_size()))

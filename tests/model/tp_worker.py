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

from mtpserve.model.deepseek_model import DeepseekV3ForCausalLM  # noqa: E402
from mtpserve.model.ernie_model import Ernie4_5_MoeForCausalLM  # noqa: E402
from mtpserve.model.loader import load_serving_model  # noqa: E402
from mtpserve.model.mimo_model import MiMoForCausalLM  # noqa: E402
from mtpserve.model.parallel import TensorParallel  # noqa: E402


def run(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    """Main logits and MTP depth-1 logits of two requests, through the paged cache (any model family)."""
    dist.init_parallel_env()
    tp = TensorParallel(rank=dist.get_rank(), size=dist.get_world_size())
    model = load_serving_model(model_dir, tp)
    assert isinstance(model, (MiMoForCausalLM, DeepseekV3ForCausalLM, Ernie4_5_MoeForCausalLM))
    kv = model.allocate_kv(model.config.num_hidden_layers, 8, 4)
    mtp_kv = model.allocate_kv(model.num_mtp_layers, 8, 4)
    batch = pack([Window(ids[0, :-1].tolist(), 0, [0, 1]), Window(ids[1, :-1].tolist(), 0, [2, 3])], 4, 2)
    with paddle.no_grad():
        out = model.forward(batch, kv)
        shifted = paddle.to_tensor(ids[:, 1:].reshape(-1))
        mtp = model.mtp_forward(0, batch, shifted, out.mtp_hidden, mtp_kv)
        return np.concatenate([model.compute_logits(out.hidden_states).numpy(),
                               model.mtp_logits(mtp.hidden_states).numpy()])


if __name__ == "__main__":
    tokens = np.random.default_rng(0).integers(0, 90, (2, 8))
    logits = run(Path(sys.argv[1]), tokens)
    if dist.get_rank() == 0:
        np.save(sys.argv[2], logits)
        Path(sys.argv[2]).with_suffix(".world").write_text(str(dist.get_world_size()))

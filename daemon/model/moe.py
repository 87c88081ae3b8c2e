"""DeepSeek-V3's mixture of experts: sigmoid router with a correction bias, group-limited top-k,
routed scaling, and always-on shared experts (checkpoint names under `model.layers.{i}.mlp`).

Routing of one token (float32), as the DeepSeek-V3 report and its config fields state:
  1. scores s = sigmoid(x @ gate.weight^T) [E];
  2. choice scores c = s + gate.e_score_correction_bias (the bias only selects, never weighs);
  3. the E experts form n_group groups; a group's score is the sum of its two best c; the topk_group
     best groups stay and the others' experts are excluded;
  4. the num_experts_per_tok best c among the kept experts are chosen;
  5. their weights are their s, divided by the weights' sum when norm_topk_prob, times
     routed_scaling_factor.
The output is sum_k w_k * expert_k(x) + shared_experts(x).

Dispatch reads the chosen ids back to the host once per layer (on a CPU host the "device" is the
execution thread itself, so this costs no stall) and runs each expert that has tokens on its rows.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from mtpserve.host_tensor import host_tensor
from mtpserve.model.decoder_layer import MLP
from mtpserve.model.deepseek_config import DeepseekV3Config
from mtpserve.model.parallel import SINGLE, TensorParallel, _weight


class Router(nn.Layer):
    """`mlp.gate`: weight [E, H] and the buffer-like e_score_correction_bias [E]."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.config = config
        self.weight = _weight(self, [config.n_routed_experts, config.hidden_size])
        self.e_score_correction_bias = self.create_parameter(
            shape=[config.n_routed_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))
        self.shard_axes = {"weight": None, "e_score_correction_bias": None}

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """x: [T, H] -> expert ids [T, K] int64, weights [T, K] float32."""
        cfg = self.config
        t, e = x.shape[0], cfg.n_routed_experts
        scores = nn.functional.sigmoid(paddle.matmul(x.astype("float32"), self.weight, transpose_y=True))  # [T, E]
        choice = scores + self.e_score_correction_bias
        grouped = choice.reshape([t, cfg.n_group, e // cfg.n_group])
        group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(axis=-1)  # [T, G]
        kept_groups = paddle.topk(group_scores, cfg.topk_group, axis=-1)[1]  # [T, topk_group]
        group_mask = paddle.put_along_axis(paddle.zeros_like(group_scores), kept_groups,
                                           paddle.ones([1], "float32"), axis=1)  # [T, G]
        expert_mask = group_mask.unsqueeze(-1).expand([t, cfg.n_group, e // cfg.n_group]).reshape([t, e])
        choice = paddle.where(expert_mask > 0, choice, paddle.full_like(choice, float("-inf")))
        ids = paddle.topk(choice, cfg.num_experts_per_tok, axis=-1)[1]  # [T, K]
        weights = paddle.take_along_axis(scores, ids, axis=1)  # [T, K]
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class MoE(nn.Layer):
    """Under tensor parallelism every rank holds a slice of every expert (gate/up by columns, down by
    rows), routes identically (the router is replicated and its input is identical on every rank), and
    the experts' partial sums are all-reduced once per layer (docs/models.md says why not expert-parallel)."""

    def __init__(self, config: DeepseekV3Config, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate = Router(config)
        inner = config.moe_intermediate_size
        self.experts = nn.LayerList([MLP(config, tp, inner, reduce_output=False) for _ in range(config.n_routed_experts)])
        shared = config.n_shared_experts
        self.shared_experts = MLP(config, tp, inner * shared, reduce_output=False) if shared else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """x: [T, H] -> [T, H]."""
        ids, weights = self.gate(x)
        routed = routed_sum(self.experts, x, ids, weights)
        return self.tp.all_reduce(routed + self.shared_experts(x) if self.shared_experts is not None else routed)


def routed_sum(experts: nn.LayerList, x: paddle.Tensor, ids: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t: x [T, H], ids/weights [T, K].

    Each expert with tokens runs once, on its rows only."""
    ids_cpu = ids.numpy()  # [T, K]
    routed = paddle.zeros_like(x)
    for expert in np.unique(ids_cpu):
        rows, slot = np.nonzero(ids_cpu == expert)  # tokens routed to `expert`, and at which k
        rows_dev = host_tensor(rows.astype(np.int64))
        w = paddle.gather_nd(weights, host_tensor(np.stack([rows, slot], axis=1).astype(np.int64)))  # [n]
        y = experts[int(expert)](paddle.gather(x, rows_dev)) * w.unsqueeze(-1)  # [n, H]
        routed = paddle.index_add(routed, rows_dev, 0, y)
    return routed

"""Tensor-parallel building blocks: column/row-parallel linears, vocab-parallel embedding and LM head.

Every weight keeps the Hugging Face layout `[out_features, in_features]`, so a checkpoint tensor is
sliced along one axis per rank and copied in without a transpose. Each layer records which axis of each
parameter is sharded (`shard_axes`), and the loader uses that to slice full tensors by rank. With
`tp_size == 1` no collective is ever called.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import paddle
import paddle.distributed as dist
from paddle import nn

from mtpserve.model import small_matmul

INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group (`group=None` means the default world group)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    plan_endpoint: str = ""  # "host:port" where rank 0 serves step plans (engine/tp_plan_channel.py)

    def split(self, n: int) -> int:
        if n % self.size:
            raise ValueError(f"dimension {n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.size == 1:
            return x
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x, group=self.group)
        return paddle.concat(parts, axis=-1)


SINGLE = TensorParallel()


class ServingWeight:
    """A weight's `[in, out]` copy, built by `freeze()` for eval mode, and on CPU hosts its panels.

    NOTE: Paddle's CPU matmul with `transpose_y=True` copies the whole weight into the transposed
    layout on every call; from a cold cache that makes a small-batch projection ~2.5x slower than a
    matmul on an `[in, out]` weight. Serving therefore keeps one transposed copy per projection (the
    checkpoint-layout parameter stays for loading, saving and training), at the cost of that memory.
    On CPU hosts every product uses the packed panels instead (model/small_matmul.py says why).
    """

    def __init__(self) -> None:
        self.t: paddle.Tensor | None = None
        self.panels: paddle.Tensor | None = None
        self.panel_dtype = "float32"  # NOTE: float16 only for draft weights (MiMoForCausalLM.set_draft_weight_dtype)

    def freeze(self, weight: paddle.Tensor) -> None:
        with paddle.no_grad():
            self.t = weight.t().contiguous()  # [in, out]
        self.panels = small_matmul.pack(self.t, self.panel_dtype)

    def thaw(self) -> None:
        self.t = self.panels = None

    def matmul(self, x: paddle.Tensor, weight: paddle.Tensor | None,
               bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """x [N, in] @ weight^T (+ bias), weight in checkpoint layout [out, in] -> [N, out].
        Frozen, `weight` is not read (None will do)."""
        if self.panels is not None:
            return small_matmul.matmul(x, self.panels, bias)
        y = paddle.matmul(x, self.t) if self.t is not None else paddle.matmul(x, weight, transpose_y=True)
        return y + bias if bias is not None else y


def _weight(layer: nn.Layer, shape: list[int]) -> paddle.Tensor:
    init = nn.initializer.Normal(mean=0.0, std=INIT_STD)
    return layer.create_parameter(shape=shape, dtype="float32", default_initializer=init)


def _bias(layer: nn.Layer, n: int) -> paddle.Tensor:
    return layer.create_parameter(shape=[n], dtype="float32", is_bias=True,
                                  default_initializer=nn.initializer.Constant(0.0))


class ColumnParallelLinear(nn.Layer):
    """y = x W^T + b with W's output rows split across ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.weight = _weight(self, [tp.split(out_features), in_features])  # [out/tp, in]
        self.bias = _bias(self, tp.split(out_features)) if bias else None
        self.shard_axes = {"weight": 0, "bias": 0}

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight, transpose_y=True)
        return y + self.bias if self.bias is not None else y


class RowParallelLinear(nn.Layer):
    """y = sum over ranks of x_r W_r^T, then + b: the input arrives split, the output is all-reduced.

    reduce=False leaves each rank's partial sum for the caller to add up (an MoE layer sums its experts'
    partials first and all-reduces once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 reduce: bool = True):
        super().__init__()
        if bias and not reduce:
            raise ValueError("a bias is added after the all-reduce: reduce=False takes no bias")
        self.tp = tp
        self.reduce = reduce
        self.weight = _weight(self, [out_features, tp.split(in_features)])  # [out, in/tp]
        self.bias = _bias(self, out_features) if bias else None
        self.shard_axes = {"weight": 1, "bias": None}
        self.serving = ServingWeight()

    def freeze(self) -> None:
        self.serving.freeze(self.weight)

    def thaw(self) -> None:
        self.serving.thaw()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = self.serving.matmul(x, self.weight)
        if not self.reduce:
            return y
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Layer):
    """Embedding whose vocabulary rows are split; ids outside this rank's range contribute zeros."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.rows = tp.split(vocab_size)
        self.start = tp.rank * self.rows
        self.weight = _weight(self, [self.rows, hidden_size])  # [V/tp, H]
        self.shard_axes = {"weight": 0}

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.lookup(ids, self.weight)

    def lookup(self, ids: paddle.Tensor, table: paddle.Tensor) -> paddle.Tensor:
        """Rows of `table` [V/tp, X], a per-vocabulary-row table split like the embedding -> [T, X]."""
        if self.tp.size == 1:
            return nn.functional.embedding(ids, table)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = nn.functional.embedding(paddle.where(inside, local, paddle.zeros_like(local)), table)
        out = out * inside.astype(out.dtype).unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Layer):
    """Logits over a vocabulary split by rows across ranks, gathered to the full vocabulary.

    When tied, it reads the embedding's weight instead of owning one.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.tied_to = [tied_to]  # a list so Paddle does not register the embedding a second time
        if tied_to is None:
            self.weight = _weight(self, [tp.split(vocab_size), hidden_size])  # [V/tp, H]
            self.shard_axes = {"weight": 0}
        self.serving = ServingWeight()

    def freeze(self) -> None:
        self.serving.freeze(self._weight())

    def thaw(self) -> None:
        self.serving.thaw()

    def _weight(self) -> paddle.Tensor:
        return self.tied_to[0].weight if self.tied_to[0] is not None else self.weight

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        logits = self.serving.matmul(hidden, self._weight())  # [N, V/tp]
        return self.tp.all_gather_last(logits)


class ReplicatedLinear(nn.Layer):
    """y = x W^T, the same full weight on every rank (for small projections not worth splitting)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _weight(self, [out_features, in_features])  # [out, in]
        self.shard_axes = {"weight": None}
        self.serving = ServingWeight()

    def freeze(self) -> None:
        self.serving.freeze(self.weight)

    def thaw(self) -> None:
        self.serving.thaw()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.serving.matmul(x, self.weight)

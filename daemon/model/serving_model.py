"""What the engine needs of a model: the contract every architecture's model class serves.

The engine (engine/model_runner.py, engine/mtp_proposer.py, engine/engine_factory.py) is typed against
this Protocol, not a model class, so each family (MiMoForCausalLM, DeepseekV3ForCausalLM) plugs in
without the engine knowing which it runs. model/__init__.py gives the semantics of each call.
"""

from __future__ import annotations

from typing import Protocol

import paddle

from mtpserve.model.attention_context import AttentionContext
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.mimo_model import DraftOutput, ModelOutput, MTPOutput, StepForward
from mtpserve.model.parallel import TensorParallel


class ServingConfig(Protocol):
    """The config fields the engine reads (both families' config classes have them)."""

    @property
    def architecture(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_id(self) -> int | None: ...


class ServingModel(Protocol):
    @property
    def config(self) -> ServingConfig: ...
    @property
    def tp(self) -> TensorParallel: ...
    @property
    def num_mtp_layers(self) -> int: ...

    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int, dtype: str = "float32") -> KVCache:
        """Paged KV storage for `num_layers` layers of this model's attention, this rank's share."""
        ...

    def kv_elements_per_token_layer(self) -> int:
        """Cache elements one token costs in one layer on this rank (K and V counted)."""
        ...

    def run(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext) -> ModelOutput: ...

    def run_mtp(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                ctx: AttentionContext, kv_layer: int | None = None,
                out_rows: paddle.Tensor | None = None) -> MTPOutput: ...

    def forward_step(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext,
                     logit_rows: paddle.Tensor, out_rows: paddle.Tensor | None = None) -> StepForward:
        """`run`, then the raw logits [N, V] of token rows logit_rows [N] (and their argmax, where it
        comes at no extra call). With out_rows [N'] (increasing token rows) only those rows' outputs are
        wanted: mtp_hidden is [N', H], logit_rows index into out_rows, and the model may skip work for
        the other rows (their KV is still written)."""
        ...

    def draft_depth(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                    ctx: AttentionContext, out_rows: paddle.Tensor | None = None,
                    draft_rows: paddle.Tensor | None = None) -> DraftOutput:
        """run_mtp(index, ...) with out_rows, and its greedy drafts [M] at output rows draft_rows (None:
        every output row): what draft_token_ids gives on those rows of its hidden_states."""
        ...

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor: ...

    def draft_token_ids(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """[N, H] outputs of MTP depth `index` -> [N] int64 greedy drafts."""
        ...

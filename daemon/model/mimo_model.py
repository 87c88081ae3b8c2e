"""The dense Qwen2-style decoder with MiMo MTP layers, in Hugging Face parameter names.

Parameter names match a MiMo checkpoint: `model.embed_tokens`, `model.layers.{i}.*`, `model.norm`,
`model.mtp_layers.{i}.*` and, when untied, `lm_head`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, cast

import numpy as np
import paddle
from paddle import nn

from mtpserve.model.attention_context import AttentionContext, PagedContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.decoder_layer import DecoderLayer, ServingModelLayer, serving_weights
from mtpserve.model.draft_vocab import DraftHead, check_token_ids
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.fused_layer import HeadPanels, FusedBlocks, serves_mtp_input
from mtpserve.model.kv_cache import KVCache
from mtpserve.model.mtp_layer import MTPLayer
from mtpserve.model.norm import RMSNorm
from mtpserve.model.parallel import (SINGLE, ParallelLMHead, ServingWeight, TensorParallel,
                                     VocabParallelEmbedding)
from mtpserve.model.rotary import RotaryEmbedding


class ModelOutput(NamedTuple):
    hidden_states: paddle.Tensor  # [T, H] after the final norm: feed to compute_logits
    mtp_hidden: paddle.Tensor  # [T, H] before the final norm: feed to the first MTP layer


class MTPOutput(NamedTuple):
    hidden_states: paddle.Tensor  # [T, H] after the layer's final_layernorm: feed to compute_logits
    mtp_hidden: paddle.Tensor  # [T, H] before it: feed to the next MTP depth


class StepForward(NamedTuple):
    """The main model's part of a step: what the MTP depths read, and the logits at the rows asked for."""

    mtp_hidden: paddle.Tensor  # [T, H]: feed to the first MTP depth
    logits: paddle.Tensor  # [N, V] fp32, raw
    greedy: paddle.Tensor | None  # [N] int64, the argmax of logits (first on ties); None: not computed


class LogitModel(Protocol):
    """What `compose_forward_step` needs of a model (every family has these)."""

    def run(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext) -> ModelOutput: ...

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor: ...


def compose_forward_step(model: LogitModel, input_ids: paddle.Tensor, positions: paddle.Tensor,
                         ctx: AttentionContext, logit_rows: paddle.Tensor,
                         out_rows: paddle.Tensor | None = None) -> StepForward:
    """The main model, then the rows wanted and the head, as separate calls."""
    out = model.run(input_ids, positions, ctx)
    hidden, mtp_hidden = out.hidden_states, out.mtp_hidden
    if out_rows is not None:
        hidden, mtp_hidden = paddle.gather(hidden, out_rows), paddle.gather(mtp_hidden, out_rows)
    return StepForward(mtp_hidden, model.compute_logits(paddle.gather(hidden, logit_rows)), None)


class DraftOutput(NamedTuple):
    mtp_hidden: paddle.Tensor  # [T or N, H]: feed to the next MTP depth
    draft_ids: paddle.Tensor  # [M] int64: the depth's greedy drafts at the rows asked for


class DraftingModel(Protocol):
    """What `compose_draft_depth` needs of a model (every family has these)."""

    def run_mtp(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                ctx: AttentionContext, kv_layer: int | None = None,
                out_rows: paddle.Tensor | None = None) -> MTPOutput: ...

    def draft_token_ids(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor: ...


def compose_draft_depth(model: DraftingModel, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor,
                        positions: paddle.Tensor, ctx: AttentionContext, out_rows: paddle.Tensor | None = None,
                        draft_rows: paddle.Tensor | None = None) -> DraftOutput:
    """A draft depth as separate calls: the MTP layer, the rows wanted, the head and its argmax."""
    out = model.run_mtp(index, token_ids, prev_hidden, positions, ctx, out_rows=out_rows)
    head_in = out.hidden_states if draft_rows is None else paddle.gather(out.hidden_states, draft_rows)
    return DraftOutput(out.mtp_hidden, model.draft_token_ids(head_in, index))


class ComposedStep:
    """`forward_step` and `draft_depth` as separate calls, for the families whose blocks are Paddle ops
    (the ServingModel contract; MiMo runs them in its block calls where the op serves)."""

    def forward_step(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext,
                     logit_rows: paddle.Tensor, out_rows: paddle.Tensor | None = None) -> StepForward:
        return compose_forward_step(cast(LogitModel, self), input_ids, positions, ctx, logit_rows, out_rows)

    def draft_depth(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                    ctx: AttentionContext, out_rows: paddle.Tensor | None = None,
                    draft_rows: paddle.Tensor | None = None) -> DraftOutput:
        return compose_draft_depth(cast(DraftingModel, self), index, token_ids, prev_hidden, positions, ctx,
                                   out_rows, draft_rows)


class MiMoBody(nn.Layer):
    """The `model.*` namespace of the checkpoint."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.LayerList([DecoderLayer(config, tp) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp_layers = nn.LayerList([MTPLayer(config, tp)
                                        for _ in range(config.num_nextn_predict_layers)])


class MiMoForCausalLM(ServingModelLayer):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = MiMoBody(config, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied_to=tied)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.draft_head: DraftHead | None = None  # None: drafts use the full vocabulary



    def set_draft_vocab(self, token_ids: np.ndarray | None) -> None:
        """Restrict MTP drafts to these full-vocabulary ids [N] (None: the full vocabulary). Output
        never changes (verification decides it), only how often drafts are accepted."""
        if token_ids is None:
            self.draft_head = None
            return
        token_ids = np.asarray(token_ids, dtype=np.int64)
        check_token_ids(token_ids, self.config.vocab_size)
        self.draft_head = DraftHead(token_ids, self.lm_head, self.tp)
        if not self.training:
            self.draft_head.freeze()

    def _serving_weights(self) -> list:
        tables = [_TokenTableOf(layer, self.model.embed_tokens) for layer in self.model.mtp_layers
                  if isinstance(layer, MTPLayer)]
        return serving_weights(self) + tables + ([self.draft_head] if self.draft_head is not None else [])

    def _draft_weights(self) -> list[ServingWeight]:
        """Every MTP layer's projections (its input stage's hidden half included) and the draft head."""
        groups = serving_weights(self.model.mtp_layers)
        found = [group.serving for group in groups if isinstance(getattr(group, "serving", None), ServingWeight)]
        found += [layer.tokens.hidden for layer in self.model.mtp_layers if isinstance(layer, MTPLayer)]
        return found + ([self.draft_head.serving] if self.draft_head is not None else [])

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.mtp_layers)

    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int, dtype: str = "float32") -> KVCache:
        """K and V per layer for this rank's KV heads."""
        kv_heads = self.config.num_key_value_heads // self.tp.size  # NOTE: each rank caches its own heads only
        return KVCache.allocate(num_layers, num_blocks, block_size, kv_heads, self.config.head_dim, dtype)

    def kv_elements_per_token_layer(self) -> int:
        return 2 * self.config.num_key_value_heads // self.tp.size * self.config.head_dim

    def forward(self, batch: ForwardBatch, kv: KVCache) -> ModelOutput:
        """Run the main model on a packed batch, writing and reading the paged KV cache."""
        return self.run(batch.input_ids, batch.positions, PagedContext(batch, kv))

    def mtp_forward(self, index: int, batch: ForwardBatch, token_ids_shifted: paddle.Tensor,
                    prev_hidden: paddle.Tensor, mtp_kv: KVCache, kv_layer: int | None = None) -> MTPOutput:
        """Run MTP layer `index % num_mtp_layers` on a packed batch with its own KV cache.

        token_ids_shifted: [T], for depth index+1 the token index+1 places after each position;
        prev_hidden: [T, H], the previous depth's `mtp_hidden` at the same positions. Positions and
        slots are the batch's. KV goes to `mtp_kv` layer `kv_layer` (default: the layer's index).
        """
        ctx = PagedContext(batch, mtp_kv)
        return self.run_mtp(index, token_ids_shifted, prev_hidden, batch.positions, ctx, kv_layer)

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """hidden_states: [N, H] (an output's `hidden_states` rows) -> fp32 logits [N, V]."""
        logits = self.lm_head(hidden_states)
        return logits if logits.dtype == paddle.float32 else logits.astype("float32")

    def mtp_logits(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """MTP outputs share the main head."""
        return self.compute_logits(hidden_states)

    def draft_token_ids(self, hidden_states: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """hidden_states: [N, H] MTP outputs -> [N] int64 greedy draft tokens (drafts are one-hot, so
        rejection sampling needs no draft probabilities). With a draft vocabulary, the argmax is over
        its tokens only (still full-vocabulary ids). Every depth shares the one head: `index` is unused."""
        if self.draft_head is not None:
            return self.draft_head(hidden_states)
        return paddle.argmax(self.compute_logits(hidden_states), axis=-1)

    def forward_step(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext,
                     logit_rows: paddle.Tensor, out_rows: paddle.Tensor | None = None) -> StepForward:
        """`run`, then the raw logits (and where the layer op serves, their argmax) of token rows
        logit_rows [N]. With out_rows [N'] (increasing token rows), only those rows' outputs are wanted:
        mtp_hidden is [N', H] and logit_rows index into out_rows.

        NOTE: where the layer op serves, the final norm and the LM head run inside the last block's call
        (as a draft depth's head does, draft_depth says why), and with out_rows the last block attends and
        runs its MLP for those rows alone: a prompt chunk no MTP depth reads needs its last position only."""
        head = self.lm_head.serving.panels
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        fused = None if head is None else FusedBlocks.of(ctx, self.rotary, first, self.tp.size)
        if head is None or fused is None:
            return compose_forward_step(self, input_ids, positions, ctx, logit_rows, out_rows)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            if i < last:
                x = fused.block(layer, x, i)
                continue
            out = fused.last_block(layer, x, i, self.model.norm.weight, HeadPanels(head, None, logit_rows), out_rows)
            return StepForward(out[1] if self.config.mtp_hidden_after_norm else out[0], out[3], out[2])
        raise ValueError("a model without layers")

    def draft_depth(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, positions: paddle.Tensor,
                    ctx: AttentionContext, out_rows: paddle.Tensor | None = None,
                    draft_rows: paddle.Tensor | None = None) -> DraftOutput:
        """MTP depth `index` and its drafts: run_mtp with out_rows, then the greedy draft at each output
        row in draft_rows ([M] indices into the output; None: every output row).

        NOTE: where the layer op serves, the head and its argmax run inside the depth's one call: from a
        cache the depth's weights just flushed, each further Paddle call costs ~50 us, more than its work."""
        layer = self.model.mtp_layers[index % self.num_mtp_layers]
        assert isinstance(layer, MTPLayer)
        head = self._draft_head_panels(draft_rows)
        fused = FusedBlocks.of(ctx, self.rotary, layer, self.tp.size) if head is not None else None
        if fused is None or not serves_mtp_input(layer):
            return compose_draft_depth(self, index, token_ids, prev_hidden, positions, ctx, out_rows, draft_rows)
        out = fused.mtp_depth(layer, token_ids, prev_hidden, index % self.num_mtp_layers, out_rows,
                              self.config.mtp_zero_position_zero, head)
        return DraftOutput(out[0], out[2])

    def _draft_head_panels(self, rows: paddle.Tensor | None) -> HeadPanels | None:
        """The head drafts argmax over, as the layer op reads it (None: no packed panels)."""
        if self.draft_head is not None:
            panels, ids = self.draft_head.serving.panels, self.draft_head.ids
        else:
            panels, ids = self.lm_head.serving.panels, None
        return None if panels is None else HeadPanels(panels, ids, rows)

    def run(self, input_ids: paddle.Tensor, positions: paddle.Tensor, ctx: AttentionContext) -> ModelOutput:
        """input_ids, positions: [T] -> ModelOutput; the attention context decides what each token sees."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        fused = FusedBlocks.of(ctx, self.rotary, first, self.tp.size)
        if fused is not None:  # NOTE: a CPU host: one op per block (model/fused_layer.py)
            for i, layer in enumerate(self.model.layers):
                assert isinstance(layer, DecoderLayer)
                x = fused.block(layer, x, i)
        else:
            cos_sin = self.rotary.cos_sin(positions)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos_sin, ctx, i)
        normed = self.model.norm(x)
        return ModelOutput(hidden_states=normed, mtp_hidden=normed if self.config.mtp_hidden_after_norm else x)

    def run_mtp(self, index: int, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor,
                positions: paddle.Tensor, ctx: AttentionContext, kv_layer: int | None = None,
                out_rows: paddle.Tensor | None = None) -> MTPOutput:
        """With out_rows [N], both outputs hold only those rows ([N, H]) and the layer's MLP runs on
        them alone (the last drafting depth needs one row per request; KV is written for all T)."""
        layer_index = index % self.num_mtp_layers
        layer = self.model.mtp_layers[layer_index]
        assert isinstance(layer, MTPLayer)
        kv_index = layer_index if kv_layer is None else kv_layer
        fused = FusedBlocks.of(ctx, self.rotary, layer, self.tp.size)
        if fused is not None and serves_mtp_input(layer):  # NOTE: a CPU host: the whole depth is one op
            out = fused.mtp_depth(layer, token_ids, prev_hidden, kv_index, out_rows,
                                  self.config.mtp_zero_position_zero)
            return MTPOutput(hidden_states=out[1], mtp_hidden=out[0])
        keep = (positions != 0).astype(prev_hidden.dtype).unsqueeze(-1) if self.config.mtp_zero_position_zero else None
        if fused is not None:
            x = fused.block(layer, layer.project_inputs(token_ids, self.model.embed_tokens, prev_hidden, keep),
                            kv_index, out_rows)
        else:
            x = layer(token_ids, self.model.embed_tokens, prev_hidden, self.rotary.cos_sin(positions), ctx,
                      kv_index, out_rows, keep)
        return MTPOutput(hidden_states=layer.final_layernorm(x), mtp_hidden=x)


class _TokenTableOf:
    """An MTP layer's token table as a serving weight: it is built from the embedding too."""

    def __init__(self, layer: MTPLayer, embedding: VocabParallelEmbedding):
        self.layer, self.embedding = layer, embedding

    def freeze(self) -> None:
        self.layer.tokens.freeze(self.layer, self.embedding)

    def thaw(self) -> None:
        self.layer.tokens.thaw()

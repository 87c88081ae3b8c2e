"""A whole decoder block as one op on CPU hosts: `mtp_decoder_layer` (ops_ext/decoder_layer.cc).

A block written as Paddle ops is ~25 calls from Python; on a small model on CPU, dispatching them costs
more than their arithmetic. Serving on a CPU host therefore runs each dense block (the main layers and
the MTP layers' blocks) as one call that reads the packed serving weights (model/small_matmul.py), the
rotary tables and the paged KV cache, and writes this step's K/V in place. It is the CPU counterpart of
capturing a step as a CUDA graph: GPU hosts keep the Paddle-op path (and their graphs).

The op serves when: Paddle runs on the CPU and the library has it; the model is in eval mode with its
weights packed; no tensor parallelism (the op has no all-reduce between attention and MLP); the
context is the paged cache in float32 or float16; the block is a Qwen2-style one (rotate-half RoPE, no o_proj
bias). Anything else keeps the Paddle-op path, which computes the same function.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Protocol

import paddle
from paddle import _C_ops

from mtpserve.model.attention_context import AttentionContext, PagedContext
from mtpserve.model.decoder_layer import MLP, Attention
from mtpserve.model.mtp_layer import MTPLayer
from mtpserve.model.norm import RMSNorm
from mtpserve.model.rotary import RotaryEmbedding
from mtpserve.ops import cpu_op_available

OP = "mtp_decoder_layer"


class DenseBlock(Protocol):
    """What the op reads of a block: the main decoder layers and the MTP layers both have these."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: MLP


def available() -> bool:
    return cpu_op_available(OP)


class FusedBlocks:
    """The per-forward inputs every block's call shares; `of()` builds one where the op serves."""

    def __init__(self, ctx: PagedContext, rotary: RotaryEmbedding):
        b = ctx.batch
        # NOTE: the batch's own slot mapping: the op skips slots of -1 (no scratch mapping needed)
        self._shared = (rotary.cos_table, rotary.signed_sin_table, b.positions, b.slot_mapping)
        self._tables = (b.block_tables, b.cu_seqlens_q, b.seq_lens_kv)
        self._key_starts = b.key_starts
        self._kv = ctx.kv

    @classmethod
    def of(cls, ctx: AttentionContext, rotary: RotaryEmbedding, first: DenseBlock,
           tp_size: int) -> FusedBlocks | None:
        """None unless the op serves this forward (module docstring); `first` stands for every block
        of the forward (a model's blocks share their shape and state)."""
        if not (isinstance(ctx, PagedContext) and ctx.in_place and tp_size == 1 and available()):
            return None
        return cls(ctx, rotary) if serves(first) else None

    def block(self, blk: DenseBlock, x: paddle.Tensor, layer: int,
              out_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        """x [T, H] -> the block's output [T, H] (or [N, H] for out_rows [N], increasing token indices:
        every token's K/V is written, and only those rows' queries attend and go through o_proj and the
        MLP)."""
        return self._call(blk, x, layer, out_rows, _NO_MTP_INPUT, _NO_HEAD, False)[0]

    def last_block(self, blk: DenseBlock, x: paddle.Tensor, layer: int, final_norm: paddle.Tensor,
                   head: HeadPanels, out_rows: paddle.Tensor | None = None) -> list[paddle.Tensor]:
        """A model's last block with its final norm and head in the same call: x [T, H] -> the op's
        outputs: [0] the block's output [T, H] (or [N, H] at out_rows, as `block`), [1] it normalised by
        final_norm, [2] the head's argmax ids [M] and [3] its logits [M, V'] at `head.rows` of [1]."""
        return self._call(blk, x, layer, out_rows, (None, None, None, None, final_norm), head, False)

    def mtp_depth(self, mtp: MTPLayer, token_ids: paddle.Tensor, prev_hidden: paddle.Tensor, layer: int,
                  out_rows: paddle.Tensor | None, zero_position_zero: bool,
                  head: HeadPanels | None = None) -> list[paddle.Tensor]:
        """An MTP layer in one call, its input stage included (see MTPLayer.forward): token_ids [T],
        prev_hidden [T, H] -> the op's outputs: [0] its hidden before final_layernorm, [1] after it (each
        [T or N, H]), and with `head`: [2] its drafts [M], the head's argmax ids at `head.rows` of [1],
        [3] their logits [M, V']."""
        tokens = mtp.tokens
        extra = (token_ids, tokens.table, mtp.hidden_layernorm.weight, tokens.hidden.panels,
                 mtp.final_layernorm.weight)
        return self._call(mtp, prev_hidden, layer, out_rows, extra, head or _NO_HEAD, zero_position_zero)

    def _call(self, blk: DenseBlock, x: paddle.Tensor, layer: int, out_rows: paddle.Tensor | None,
              mtp_input: tuple, head: tuple, zero_position_zero: bool) -> list[paddle.Tensor]:
        weights, eps, heads = _weights_of(blk)
        return _C_ops._run_custom_op(  # pyright: ignore[reportAttributeAccessIssue]
            OP, x, *weights, *self._shared, self._kv.k[layer], self._kv.v[layer], *self._tables, out_rows,
            *mtp_input, *head, self._key_starts, heads, eps, self._kv.block_size, zero_position_zero)


class HeadPanels(NamedTuple):
    """A head as the op reads it (the LM head after a model's last block, or a draft depth's): panels
    [V'/32, H, 32], the vocabulary id of each column ([V'] int64, None: the column itself), and the
    output rows it reads ([M] int64, None: all)."""

    panels: paddle.Tensor
    ids: paddle.Tensor | None
    rows: paddle.Tensor | None


_NO_MTP_INPUT = (None, None, None, None, None)
_NO_HEAD = (None, None, None)


def serves_mtp_input(mtp: MTPLayer) -> bool:
    """The MTP layer's input stage can run inside the op: its token table and hidden half are built
    (eval mode) and packed."""
    return mtp.tokens.table is not None and mtp.tokens.hidden.panels is not None


def serves(blk: DenseBlock) -> bool:
    """The block is in eval mode with packed weights and has the op's shape (module docstring)."""
    attn = blk.self_attn
    if blk.input_layernorm.training or attn.interleaved_rope or attn.o_proj.bias is not None:
        return False
    _, qkv, _, o, _, gate_up, down = _weights_of(blk)[0]
    return all(panels is not None for panels in (qkv, o, gate_up, down))


# NOTE: a block's op arguments, kept per block: reading them through Paddle's Layer.__getattr__ is ~10
# lookups a block, a few percent of a small model's step. The key includes the q/k/v panels' identity,
# which `eval()` replaces whenever it re-packs the weights, so a stale entry is never used.
_ARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_of(blk: DenseBlock) -> tuple[tuple, float, int]:
    """(weights in the op's input order, eps, query heads) of a block."""
    attn = blk.self_attn
    qkv = attn.qkv.serving.panels
    cached = _ARGS.get(blk)
    if cached is not None and cached[0] is qkv:
        return cached[1]
    mlp = blk.mlp
    weights = (blk.input_layernorm.weight, qkv, attn.qkv.bias, attn.o_proj.serving.panels,
               blk.post_attention_layernorm.weight, mlp.gate_up.serving.panels, mlp.down_proj.serving.panels)
    entry = (weights, blk.input_layernorm.eps, attn.num_heads)
    _ARGS[blk] = (qkv, entry)
    return entry

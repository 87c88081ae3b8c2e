"""What one model step reads: the flattened tokens of every request plus where their KV lives."""

from __future__ import annotations

import dataclasses

import paddle


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """A mixed batch of prefill chunks and decode/verify windows, packed without padding.

    Request b owns tokens `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of the flat arrays. Its KV cache covers
    positions `0 .. seq_lens_kv[b]-1` (this step's tokens included), stored in the blocks listed by
    `block_tables[b]`. A slot of -1 marks a padding or over-allocated token: its KV is not written and
    its output must be ignored.
    """

    input_ids: paddle.Tensor  # [T] int64
    positions: paddle.Tensor  # [T] int64
    slot_mapping: paddle.Tensor  # [T] int64, block_id * block_size + offset, or -1
    cu_seqlens_q: paddle.Tensor  # [B+1] int32
    seq_lens_kv: paddle.Tensor  # [B] int32
    block_tables: paddle.Tensor  # [B, max_blocks_per_seq] int32, -1 for unused entries
    # NOTE: a host int, known to the scheduler that built the batch; it sizes the padded query buffer
    # so the forward never reads a length back from the device.
    max_q_len: int
    # NOTE: [B] int32, a multiple of the block size, or None (0): request b's keys before it are not attended
    # to (an MTP depth's, which runs over a prompt's last positions only: engine/mtp_window.py)
    key_starts: paddle.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

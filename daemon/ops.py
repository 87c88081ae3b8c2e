"""The compiled C++ ops (ops_ext/), registered with Paddle once per process.

setup.py builds ops_ext/*.cc into mtpserve/_ops*.so; this module registers that library with Paddle and
exposes each op as a typed Python function. Only rank processes import it (it imports paddle).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import paddle
from paddle import _C_ops
from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

from mtpserve.config import IpcConfig
from mtpserve.host_tensor import StagedTensors
from mtpserve.ipc import wire
from mtpserve.ipc.output_channel import ChannelAddress


HostArray = paddle.Tensor | np.ndarray  # a host (CPU / pinned) tensor, or NumPy


class OpsNotBuiltError(RuntimeError):
    """The shared library is missing: the package was installed without building ops_ext/."""


@functools.cache
def registered_op_names() -> frozenset[str]:
    found = sorted(Path(__file__).parent.glob("_ops*.so"))
    if not found:
        raise OpsNotBuiltError("mtpserve/_ops*.so not found; run `make install` (or pip install -e .)")
    return frozenset(load_op_meta_info_and_register_op(str(found[0])))


@functools.cache
def cpu_op_available(name: str) -> bool:
    """`name` is built into this install and Paddle is a CPU-only build (the CPU kernels of a step,
    docs/architecture.md); registers the library on first use."""
    if paddle.device.is_compiled_with_cuda():
        return False
    try:
        return name in registered_op_names()
    except OpsNotBuiltError:
        return False


def run_op(name: str, *args):
    """Run a registered custom op by name (inputs first, then attributes, in the op's order)."""
    if name not in registered_op_names():
        raise KeyError(f"op {name!r} is not in the compiled library")
    # NOTE: _run_custom_op, Paddle's custom-op entry, is missing from Paddle's stubs.
    return _C_ops._run_custom_op(name, *args)  # pyright: ignore[reportAttributeAccessIssue]


def _run_one(name: str, *args) -> paddle.Tensor:
    """run_op for ops with a single output."""
    return run_op(name, *args)[0]


class SendStatus(NamedTuple):
    """What a send/flush op reports. frames_pending > 0: back-pressure, pause scheduling and flush."""

    frames_pending: int
    bytes_pending: int
    frames_sent: int  # since this process attached
    frames_deferred: int  # frames that could not go out at once, since attach

    @classmethod
    def of(cls, status: paddle.Tensor) -> "SendStatus":
        # NOTE: a host tensor written by a CPU op: reading it is no device sync.
        return cls(*status.numpy().tolist())


class StepLogprobs(NamedTuple):
    """Host tensors of one step's logprobs, indexed like token_ids (flat [N] or padded [B, T])."""

    logprob: HostArray  # [N] / [B, T] float32: the sampled token's logprob
    rank: HostArray  # [N] / [B, T] int32|int64: its rank (1 = most likely)
    topk_ids: HostArray | None  # [N, K_max] / [B, T, K_max] int32|int64; -1 pads; None when K is 0
    topk_logprobs: HostArray | None  # [N, K_max] / [B, T, K_max] float32


@dataclass(frozen=True)
class OutputSender:
    """Rank-side handle of an output channel: wraps the mtp_output_* ops with the channel's attributes.

    Build it on every rank; only the rank equal to send_rank packs and sends, the others get zeros.
    Inputs are host (CPU / pinned) paddle tensors or NumPy arrays; ids and counts may be int32 or
    int64. Request ids are int64 (the request channel's ids); rows with an id < 0 are skipped.
    """

    address: ChannelAddress
    rank: int
    vocab_size: int
    send_rank: int = 0
    max_pending_bytes: int = IpcConfig.max_pending_bytes  # NOTE: the configuration's default
    # NOTE: a frame's columns, reused frame to frame: the send op packs them before it returns. One
    # sender is used from one thread (the rank loop's).
    _staged: StagedTensors = field(default_factory=StagedTensors, repr=False, compare=False)

    def _address_attrs(self) -> tuple:
        a = self.address
        return (self.rank, self.send_rank, int(a.transport), a.queue_name, a.sysv_key, a.ring_name,
                a.max_msg_bytes, self.max_pending_bytes, a.chunked)

    def send_step(self, *, step_id: int, req_ids: HostArray, seq: HostArray,
                  num_tokens: HostArray, finish: HostArray, token_ids: HostArray,
                  logprobs: StepLogprobs | None = None, num_topk: int = 0,
                  kind: wire.Kind = wire.Kind.TARGET) -> paddle.Tensor:
        """Send one TARGET (or DRAFT) frame; returns status int64[4] (see SendStatus).

        req_ids [B] (rows < 0 are invalid slots and skipped) · seq [B] tokens already sent per request
        · num_tokens [B] · finish [B] wire.Finish · token_ids [N] flat or [B, T] padded.
        num_topk: the real top-k width to send (<= K_max, <= 20).
        """
        lp = self._columns(LOGPROB_COLUMNS, logprobs or (None, None, None, None))
        req_ids, seq, num_tokens, finish, token_ids = self._columns(
            ("req_ids", "seq", "num_tokens", "finish", "token_ids"), (req_ids, seq, num_tokens, finish, token_ids))
        return _run_one("mtp_output_send", req_ids, seq, num_tokens, finish, token_ids, *lp, None,
                         int(kind), step_id, num_topk if logprobs else 0, self.vocab_size,
                         self.address.instance_tag, *self._address_attrs())

    def send_first_token(self, *, step_id: int, req_ids: HostArray, seq: HostArray,
                         finish: HostArray, token_ids: HostArray,
                         logprobs: StepLogprobs | None = None, num_topk: int = 0,
                         draft_ids: HostArray | None = None) -> paddle.Tensor:
        """Send a FIRST_TOKEN frame from a prefill instance: token_ids [B], draft_ids [B, D]."""
        lp = self._columns(LOGPROB_COLUMNS, logprobs or (None, None, None, None))
        req_ids, seq, finish, token_ids, draft_ids = self._columns(
            ("req_ids", "seq", "finish", "token_ids", "draft_ids"), (req_ids, seq, finish, token_ids, draft_ids))
        return _run_one("mtp_output_send_first_token", req_ids, seq, finish, token_ids, *lp, draft_ids,
                         step_id, num_topk if logprobs else 0, self.vocab_size,
                         self.address.instance_tag, *self._address_attrs())

    def send_control(self, code: wire.ControlCode, message: str, step_id: int = 0) -> paddle.Tensor:
        return _run_one("mtp_output_control", _dummy(), int(code), message, step_id,
                         self.address.instance_tag, *self._address_attrs())

    def flush(self) -> paddle.Tensor:
        """Retry pending frames; returns the status."""
        return _run_one("mtp_output_flush", _dummy(), *self._address_attrs())

    def close(self) -> SendStatus:
        """Detach this process from the channel; the status tells how many frames never went out."""
        return SendStatus.of(_run_one("mtp_output_close", _dummy(), self.address.ring_name))

    def _columns(self, names: tuple[str, ...], arrays: tuple) -> tuple:
        """Host tensors for the op: tensors as they are, NumPy arrays staged, None stays None."""
        return tuple(a if a is None or isinstance(a, paddle.Tensor) else self._staged.stage(name, a)
                     for name, a in zip(names, arrays))


def pack_frame(*, kind: wire.Kind, step_id: int, req_ids, seq, num_tokens, finish, token_ids,
               logprobs: StepLogprobs | None = None, num_topk: int = 0, draft_ids=None,
               vocab_size: int, instance_tag: int = 0) -> paddle.Tensor:
    """The frame the send op would build, as uint8 bytes (frame_seq 0, unchunked): for tests."""
    lp = logprobs or (None, None, None, None)
    return _run_one("mtp_output_pack", req_ids, seq, num_tokens, finish, token_ids, *lp, draft_ids,
                     int(kind), step_id, num_topk if logprobs else 0, vocab_size, instance_tag)


LOGPROB_COLUMNS = ("token_logprobs", "token_ranks", "topk_ids", "topk_logprobs")


@functools.cache
def _dummy() -> paddle.Tensor:
    return paddle.zeros([1], dtype="int64")

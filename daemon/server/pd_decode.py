"""PD decode: a request with `kv_transfer_params` continues another instance's prefill; one without is
served as on a mixed instance.

The params come from another instance through the router, so everything the engine would trust is
checked here: token ids in the vocabulary, one block per `block_size` prompt tokens, a KV layout that
matches this engine's (same block size, buffer count and bytes per block: the same model and dtype), and a
key start at a block start within the prompt (the attention kernels refuse any other).
"""

from __future__ import annotations

import math
import time

from mtpserve.ipc.request_channel import EngineReady, KVLayout, RemotePrefill, SamplingParams
from mtpserve.server.pd_role import PARAM, RolePlan, ServingRole
from mtpserve.server.sampling import RequestLimits, check_prompt_ids
from mtpserve.server.schema import KVTransferParams, SamplingFields
from mtpserve.web.errors import ApiError, bad_request


class DecodeRole(ServingRole):
    name = "decode"

    def plan(self, req: SamplingFields, ready: EngineReady, limits: RequestLimits) -> RolePlan:
        self.refuse_fan_out(req)
        params = req.kv_transfer_params
        if params is None:
            return RolePlan()
        return DecodePlan(remote_prefill(params, ready, limits), params.prompt_token_ids)


class DecodePlan(RolePlan):
    def __init__(self, remote: RemotePrefill, prompt_ids: list[int]) -> None:
        # NOTE: the prefill instance's tokens, never re-tokenized (a chat template may not be stable).
        self.remote, self.prompt_ids = remote, prompt_ids

    def sampling(self, params: SamplingParams) -> SamplingParams:
        if params.max_tokens < 2:
            raise bad_request("With `kv_transfer_params` the maximum tokens must be at least 2 (the prefill "
                              "instance already generated the first).", "max_tokens")
        return params


def remote_prefill(params: KVTransferParams, ready: EngineReady, limits: RequestLimits) -> RemotePrefill:
    """1. token ids, 2. layout against this engine's, 3. blocks and key start against the prompt, 4. session
    and lease."""
    check_prompt_ids(params.prompt_token_ids, limits, f"{PARAM}.prompt_token_ids")
    _check_token_ids([params.first_token_id, *params.draft_token_ids], limits.vocab_size)
    _check_layout(params.kv_layout, ready.kv_layout)
    _check_blocks(params.block_ids, len(params.prompt_token_ids), params.kv_layout.block_size)
    _check_key_start(params.mtp_key_start, len(params.prompt_token_ids), params.kv_layout.block_size)
    _check_session(params.kv_session)
    if not math.isfinite(params.lease_expires_in):
        raise _invalid("`lease_expires_in` must be a finite number of seconds.", "lease_expires_in")
    return RemotePrefill(kv_session=params.kv_session, kv_layout=params.kv_layout, block_ids=params.block_ids,
                         first_token_id=params.first_token_id, draft_token_ids=params.draft_token_ids,
                         lease_deadline=time.time() + params.lease_expires_in, mtp_key_start=params.mtp_key_start)


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise _invalid(f"`first_token_id` and `draft_token_ids` must be in [0, {vocab_size}).", "first_token_id")


def _check_layout(theirs: KVLayout, ours: KVLayout | None) -> None:
    if ours is None:
        raise ApiError(503, "This engine reported no KV layout; it cannot take a remote prefill.",
                       code="unavailable")
    if theirs.block_size < 1 or len(theirs.buffer_addrs) != len(theirs.block_bytes) \
            or min(theirs.buffer_addrs, default=0) < 0:
        raise _invalid("`kv_layout` needs a positive block_size and one non-negative address and one size per buffer.",
                       "kv_layout")
    if theirs.block_size != ours.block_size or theirs.block_bytes != ours.block_bytes:
        raise _invalid(f"`kv_layout` (block_size {theirs.block_size}, {len(theirs.block_bytes)} buffers) does not "
                       f"match this instance's (block_size {ours.block_size}, {len(ours.block_bytes)} buffers, "
                       "same bytes per block): a different model or dtype.", "kv_layout")


def _check_blocks(block_ids: list[int], num_prompt_tokens: int, block_size: int) -> None:
    needed = -(-num_prompt_tokens // block_size)
    if len(block_ids) != needed or min(block_ids, default=0) < 0:
        raise _invalid(f"`block_ids` must be {needed} non-negative block ids for {num_prompt_tokens} prompt "
                       f"tokens (block_size {block_size}), got {len(block_ids)}.", "block_ids")


def _check_key_start(key_start: int | None, num_prompt_tokens: int, block_size: int) -> None:
    if key_start is not None and not (0 <= key_start < num_prompt_tokens and key_start % block_size == 0):
        raise _invalid(f"`mtp_key_start` must be a block start (a multiple of {block_size}) before the prompt's "
                       f"end ({num_prompt_tokens} tokens), got {key_start}.", "mtp_key_start")


def _check_session(session: str) -> None:
    host, _, port = session.rpartition(":")
    if not host or not port.isdigit():
        raise _invalid("`kv_session` must be `host:port`.", "kv_session")


def _invalid(message: str, field: str) -> ApiError:
    return bad_request(message, f"{PARAM}.{field}", "invalid_value")

"""The prefill role's connector: a request runs its first token here and its prompt KV stays in its
blocks, under a lease, until the decode instance has read it (ReleaseKV), the client leaves (abort) or
the lease ends.

Every entry of a step that emitted one token ends a handoff: it goes out as a FIRST_TOKEN frame with
its drafts. The KVHeld announcement of a step's holds is sent before that step's frames, so the HTTP
process knows the blocks by the time it answers with `kv_transfer_params`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from mtpserve import log
from mtpserve.engine.kv_connector import KVConnector, KVEndpoint, KVStats, RequestId
from mtpserve.engine.request import FinishReason, Request
from mtpserve.engine.step_emission import StepEmission


@dataclasses.dataclass(frozen=True)
class KVHold:
    """A finished request's KV kept in `block_ids` until released or `deadline`."""

    request_id: RequestId
    block_ids: tuple[int, ...]
    num_tokens: int  # positions with KV (the prompt)
    deadline: float  # time.monotonic()
    mtp_key_start: int = 0  # the first position whose MTP KV the depths wrote (Request.mtp_key_start)


class PrefillConnector(KVConnector):
    role = "prefill"
    drafts_leave = True

    def __init__(self, lease_s: float, announce: Callable[[KVHold], None],
                 endpoint: KVEndpoint | None = None) -> None:
        """`announce` tells the HTTP process about a hold (rank 0: a KVHeld message)."""
        self.lease_s, self.announce, self.endpoint = lease_s, announce, endpoint
        self.holds: dict[RequestId, KVHold] = {}
        self._new: list[KVHold] = []  # announced by the next `after_step`
        self.num_expired = 0
        self.logger = log.get_logger("mtpserve.pd")

    def on_finish(self, request: Request, reason: FinishReason) -> bool:
        # NOTE: a request that stopped at its first token (EOS, a stop id) has no continuation.
        if not request.hold_kv or reason is not FinishReason.LENGTH:
            return False
        hold = KVHold(request.request_id, tuple(request.block_ids), int(request.prompt_ids.shape[0]),
                      time.monotonic() + self.lease_s, request.mtp_key_start)
        self.holds[hold.request_id] = hold
        self._new.append(hold)
        return True

    def after_step(self, emission: StepEmission) -> StepEmission:
        for hold in self._new:
            self.announce(hold)
        self._new.clear()
        return emission._replace(handoff=emission.num_tokens == 1)

    def on_abort(self, request_id: RequestId) -> Request | None:
        self._free(request_id)  # NOTE: a client that left before the decode instance took it
        return None

    def release(self, request_ids: Sequence[RequestId]) -> None:
        for request_id in request_ids:
            self._free(request_id)

    def before_step(self) -> None:
        self.expire(time.monotonic())

    def expire(self, now: float) -> list[RequestId]:
        """Free every hold whose lease ended by `now`; returns their request ids."""
        expired = [rid for rid, hold in self.holds.items() if hold.deadline <= now]
        for request_id in expired:
            self._free(request_id)
        if expired:
            self.num_expired += len(expired)
            self.logger.warning("kv lease expired", request_ids=expired)
        return expired

    def _free(self, request_id: RequestId) -> bool:
        hold = self.holds.pop(request_id, None)
        if hold is None:
            return False
        self.scheduler.blocks.free(list(hold.block_ids))
        self._new = [h for h in self._new if h.request_id != request_id]
        return True

    def stats(self) -> KVStats:
        return KVStats(num_kv_held=len(self.holds), num_kv_leases_expired=self.num_expired)

"""PD prefill: every request runs its first token only; unless that token ends it, the answer ends with
the `kv_transfer_params` a decode instance continues from, and the engine holds the KV meanwhile.

The first token's frame (output path) and the engine's KVHeld (request channel) arrive in either
order; `handoff` waits for both. No params when the request ended with that token (EOS or a stop
token, a stop string, or the client asked for one token): the answer is then the final one, and the
stream releases whatever the engine may hold.
"""

from __future__ import annotations

import time

import msgspec

from mtpserve.ipc.request_channel import EngineReady, SamplingParams
from mtpserve.server.engine_stream import EngineStream
from mtpserve.server.pd_role import PARAM, RolePlan, ServingRole
from mtpserve.server.sampling import RequestLimits
from mtpserve.server.schema import SamplingFields
from mtpserve.server.tracker import HeldKV
from mtpserve.web.errors import bad_request


class PrefillRole(ServingRole):
    name = "prefill"

    def __init__(self, kv_wait_timeout: float) -> None:
        """kv_wait_timeout: seconds to wait for KVHeld after the first token (the lease is no longer)."""
        self.kv_wait_timeout = kv_wait_timeout

    def plan(self, req: SamplingFields, ready: EngineReady, limits: RequestLimits) -> RolePlan:
        self.refuse_fan_out(req)
        if req.kv_transfer_params is not None:
            raise bad_request(f"`{PARAM}` is only accepted by a decode instance (this one is prefill).", PARAM)
        return PrefillPlan(ready, self.kv_wait_timeout)


class PrefillPlan(RolePlan):
    def __init__(self, ready: EngineReady, kv_wait_timeout: float) -> None:
        self._ready, self._kv_wait_timeout = ready, kv_wait_timeout

    def check_num_prompts(self, num_prompts: int) -> None:
        if num_prompts > 1:
            raise bad_request("A prefill instance serves one prompt per request.", "prompt")

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """One token; the KV is held when more are to follow on a decode instance."""
        self.hold_kv = params.max_tokens > 1
        return msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    async def handoff(self, stream: EngineStream) -> dict[str, object] | None:
        """The params for the stream's one choice, or None when it does not continue elsewhere."""
        [choice] = stream.choices
        if not choice.continues:
            return None
        held = await stream.wait_held(choice.engine_id, self._kv_wait_timeout)
        return self._params(held, stream.prompts[0], choice.first_token_id, choice.draft_ids or [])

    def _params(self, held: HeldKV, prompt_ids: list[int], first_token_id: int | None,
                draft_ids: list[int]) -> dict[str, object]:
        lease_left = held.msg.lease_expires_in - (time.monotonic() - held.arrived)
        return {"transfer_id": held.msg.request_id, "kv_session": self._ready.kv_session,
                "kv_layout": msgspec.to_builtins(self._ready.kv_layout), "block_ids": held.msg.block_ids,
                "prompt_token_ids": prompt_ids, "first_token_id": first_token_id,
                "draft_token_ids": draft_ids, "mtp_key_start": held.msg.mtp_key_start,
                "lease_expires_in": max(lease_left, 0.0)}

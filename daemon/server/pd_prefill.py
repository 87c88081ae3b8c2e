"""PD prefill: after the first token, the `kv_transfer_params` a decode instance continues from.

The first token's frame (output path) and the engine's KVHeld (request channel) arrive in either
order; `Handoff.params` waits for both. No params when the request ended with that token (EOS or a
stop token, a stop string, or the client asked for one token): the answer is then the final one, and
the engine client releases whatever the engine may hold (engine_client.release).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from mtpserve.ipc.request_channel import EngineReady
from mtpserve.server.choice import ChoiceState
from mtpserve.server.engine_client import EngineClient
from mtpserve.web.errors import ApiError
from mtpserve.server.tracker import HeldKV, RequestStream


class Handoff:
    def __init__(self, ready: EngineReady, wait_timeout: float) -> None:
        """wait_timeout: seconds to wait for KVHeld after the first token (the lease is no longer)."""
        self._ready, self._wait_timeout = ready, wait_timeout

    async def params(self, engine: EngineClient, stream: RequestStream) -> dict | None:
        """The params for the stream's one choice, or None when it does not continue elsewhere."""
        [choice] = stream.choices
        if not choice.continues:
            return None
        held = await self._wait_held(engine, stream, choice.engine_id)
        return self._params(held, stream.prompts[0], choice)

    async def _wait_held(self, engine: EngineClient, stream: RequestStream, engine_id: int) -> HeldKV:
        try:
            async with asyncio.timeout(self._wait_timeout):
                while engine_id not in stream.held:
                    await engine.next_updates(stream)
        except TimeoutError:
            raise ApiError(500, "The engine did not report the prefilled KV blocks.", code="engine_error") from None
        return stream.held[engine_id]

    def _params(self, held: HeldKV, prompt_ids: list[int], choice: ChoiceState) -> dict:
        lease_left = held.msg.lease_expires_in - (time.monotonic() - held.arrived)
        return {"transfer_id": held.msg.request_id, "kv_session": self._ready.kv_session,
                "kv_layout": msgspec.to_builtins(self._ready.kv_layout), "block_ids": held.msg.block_ids,
                "prompt_token_ids": prompt_ids, "first_token_id": choice.first_token_id,
                "draft_token_ids": choice.draft_ids or [], "lease_expires_in": max(lease_left, 0.0)}

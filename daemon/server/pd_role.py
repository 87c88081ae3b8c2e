"""What PD role a generation request plays on this instance (docs/pd.md): the HTTP side's one seam.

The instance's role is chosen once at start (`serving_role`); per request, `ServingRole.plan` checks
the body against the role and returns a `RolePlan` whose hooks the routes and the response writer
call without knowing the role:
  1. `prompt_ids`: a prompt tokenized elsewhere (a decode continues the prefill's tokens), or None;
  2. `sampling(params)`: the engine's sampling (a prefill runs the first token only);
  3. `hold_kv` / `remote`: what the engine request carries;
  4. `handoff(stream)`: how the answer ends: None (usage and [DONE]), or the `kv_transfer_params` a
     decode instance continues from (prefill).
The mixed role's plan changes nothing; prefill: pd_prefill.py; decode: pd_decode.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtpserve.ipc.request_channel import EngineReady, RemotePrefill, SamplingParams
from mtpserve.server.sampling import RequestLimits
from mtpserve.server.schema import SamplingFields
from mtpserve.web.errors import bad_request

if TYPE_CHECKING:
    from mtpserve.server.engine_stream import EngineStream

PARAM = "kv_transfer_params"


class RolePlan:
    """A request on a mixed instance (or one a decode instance serves from scratch)."""

    hold_kv = False  # keep the KV after the last token for another instance
    remote: RemotePrefill | None = None  # continue another instance's prefill
    prompt_ids: list[int] | None = None  # with `remote`: the prompt as the prefill tokenized it

    def check_num_prompts(self, num_prompts: int) -> None:
        pass

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return params

    async def handoff(self, stream: EngineStream) -> dict[str, object] | None:
        return None


class ServingRole:
    """The mixed role: ordinary serving; `kv_transfer_params` is refused."""

    name = "mixed"

    def plan(self, req: SamplingFields, ready: EngineReady, limits: RequestLimits) -> RolePlan:
        if req.kv_transfer_params is not None:
            raise bad_request(f"`{PARAM}` is only accepted by a decode instance (this one is {self.name}).",
                              PARAM)
        return RolePlan()

    def refuse_fan_out(self, req: SamplingFields) -> None:
        """Prefill and decode serve one engine request per HTTP request: a transfer id names it."""
        if (req.n or 1) > 1:
            raise bad_request(f"`n` > 1 is not supported by a {self.name} instance.", "n", "invalid_value")

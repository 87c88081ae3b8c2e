"""What PD role a generation request plays on this instance (docs/pd.md), decided before tokenizing.

- mixed instance: ordinary serving; `kv_transfer_params` is refused.
- prefill instance: every request runs its first token only (max_tokens 1); the KV is held for a
  decode instance unless the client asked for one token (then the answer is the final one).
- decode instance: a request with `kv_transfer_params` continues another instance's prefill; one
  without is served as on a mixed instance.
Prefill and decode instances refuse `n > 1`, and a prefill several completions prompts: one engine
request per HTTP request is what a transfer id names (the router refuses `n > 1` too).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from mtpserve.ipc.request_channel import EngineReady, RemotePrefill, SamplingParams
from mtpserve.web.errors import bad_request
from mtpserve.server.pd_decode import PARAM, remote_prefill
from mtpserve.server.sampling import RequestLimits
from mtpserve.server.schema import SamplingFields

ROLES = ("mixed", "prefill", "decode")


class PdPlan(NamedTuple):
    role: str
    prefill: bool = False  # run the first token only (prefill instance)
    remote: RemotePrefill | None = None  # continue a remote prefill (decode instance)
    prompt_ids: list[int] | None = None  # with `remote`: the prompt as the prefill tokenized it

    def check_num_prompts(self, num_prompts: int) -> None:
        if self.prefill and num_prompts > 1:
            raise bad_request("A prefill instance serves one prompt per request.", "prompt")

    def sampling(self, params: SamplingParams) -> tuple[SamplingParams, bool]:
        """The engine's sampling and hold_kv: a prefill runs one token, holding the KV when more follow."""
        if self.remote is not None and params.max_tokens < 2:
            raise bad_request("With `kv_transfer_params` the maximum tokens must be at least 2 (the prefill "
                              "instance already generated the first).", "max_tokens")
        if not self.prefill:
            return params, False
        one = msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        return one, params.max_tokens > 1


def plan_pd(req: SamplingFields, role: str, ready: EngineReady, limits: RequestLimits) -> PdPlan:
    params = req.kv_transfer_params
    if role != "mixed" and (req.n or 1) > 1:
        raise bad_request(f"`n` > 1 is not supported by a {role} instance.", "n", "invalid_value")
    if params is not None and role != "decode":
        raise bad_request(f"`{PARAM}` is only accepted by a decode instance (this one is {role}).", PARAM)
    if role == "prefill":
        return PdPlan(role, prefill=True)
    if params is None:
        return PdPlan(role)
    return PdPlan(role, remote=remote_prefill(params, ready, limits), prompt_ids=params.prompt_token_ids)

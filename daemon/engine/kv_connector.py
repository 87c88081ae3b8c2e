"""The seam between the engine core and prefill/decode disaggregation (docs/pd.md).

The core and the scheduler call these hooks and know nothing of roles; one object per role:
  KVConnector       the mixed role: every hook does nothing (this class)
  PrefillConnector  kv_prefill.py: keeps a finished prompt's blocks for a decode instance, under a lease
  DecodeConnector   kv_decode.py: reads a prefilled prompt's KV into local blocks before it runs

Hooks, in the order one step calls them:
  1. `on_add(request)` at intake: True when the connector takes the request; it hands it to the
     scheduler later (`Scheduler.add`), e.g. once its KV has arrived.
  2. `on_abort(request_id)` before the scheduler is asked: the request, when the connector holds it.
  3. `before_step()` ahead of each launch, and while the rank is idle: leases, reads to start.
  4. `on_finish(request, reason)` from the scheduler: True when the connector takes ownership of the
     request's blocks (it frees them itself later).
  5. `after_step(emission)` once a step is applied, before its frames go out: announcements, and
     which entries end a handoff (`StepEmission.handoff`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict

from mtpserve.engine.request import FinishReason, Request, RequestId
from mtpserve.engine.step_emission import StepEmission
from mtpserve.ipc.request_channel import KVLayout

if TYPE_CHECKING:
    from mtpserve.engine.scheduler import Scheduler


class KVStats(TypedDict, total=False):
    """A role's counters, under their ipc.request_channel.EngineStats names."""

    num_kv_held: int
    num_kv_leases_expired: int
    num_kv_fetches: int
    kv_fetch_bytes: int
    kv_fetch_seconds: float
    num_kv_fallbacks: int


class KVEndpoint(Protocol):
    """This rank's side of the transfer engine (Mooncake): what others need to read its KV."""

    session: str  # "host:port"
    layout: KVLayout  # where the rank's paged KV buffers live

    def close(self) -> None: ...


class KVConnector:
    """The mixed role: nothing moves between instances."""

    role = "mixed"
    endpoint: KVEndpoint | None = None
    drafts_leave = False  # its requests' drafts open another instance's windows: always draft k

    def bind(self, scheduler: Scheduler) -> None:
        """Called once by the core: the scheduler whose blocks and queues the hooks work on."""
        self.scheduler = scheduler

    @property
    def session(self) -> str:
        """Where other instances reach this rank's KV ("host:port"); empty without transfers."""
        return "" if self.endpoint is None else self.endpoint.session

    @property
    def layout(self) -> KVLayout | None:
        return None if self.endpoint is None else self.endpoint.layout

    @property
    def num_pending(self) -> int:
        """Unfinished requests the connector holds that the scheduler does not know yet."""
        return 0

    def on_add(self, request: Request) -> bool:
        return False

    def on_abort(self, request_id: RequestId) -> Request | None:
        return None

    def release(self, request_ids: Sequence[RequestId]) -> None:
        """Blocks kept for other instances that they no longer need (ReleaseKV)."""

    def before_step(self) -> None:
        pass

    def on_finish(self, request: Request, reason: FinishReason) -> bool:
        return False

    def after_step(self, emission: StepEmission) -> StepEmission:
        return emission

    def stats(self) -> KVStats:
        return {}

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

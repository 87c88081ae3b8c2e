"""Shared by the speculation policy's tests: K and a greedy decode row."""

from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import ScheduledRow
from mtpserve.ipc.sampling_params import SamplingParams

K = 3  # --num-speculative-tokens of the tests


def decode_row(i: int) -> ScheduledRow:
    """A greedy request's decode row in slot i, with a window of K drafts."""
    request = Request(EngineRequest(i, (1, 2, 3), SamplingParams(temperature=0.0)), i, 0)
    return ScheduledRow(request, 0, i, False, K + 1, 0, True)

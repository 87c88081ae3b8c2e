"""Shared by the speculation policy's pricing tests: a synthetic device one row runs on, and a policy profiled on
it as the start-up profile does; rows of decode windows, and a device whose attention reads keys from memory."""

import numpy as np
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from mtpserve.ipc.sampling_params import SamplingParams
from spec_rows import K

# A device whose attention dots every query token with every key (ops_ext/paged_attention.cc), in ms:
# the target pass a fixed part, a part per token and a part per (query token, key) pair; each MTP depth
# the same over the same tokens.
TARGET_BASE, TARGET_TOKEN, TARGET_PAIR = 0.5, 0.1, 0.0005
DEPTH_BASE, DEPTH_PAIR = 0.15, 0.0001


def device_ms(window: int, kv: int, depth: int) -> tuple[float, float]:
    """(target, drafts) of one row's step: a window of `window` tokens after `kv` tokens of KV."""
    pairs = window * (kv + window)
    return TARGET_BASE + TARGET_TOKEN * window + TARGET_PAIR * pairs, depth * (DEPTH_BASE + DEPTH_PAIR * pairs)


def one_row(kv: int, window: int) -> SchedulePlan:
    request = Request(EngineRequest(0, (1, 2, 3), SamplingParams(temperature=0.0)), 0, 0)
    request.num_kv_tokens = kv
    return SchedulePlan((ScheduledRow(request, 0, 0, False, window, 0, True),), (), (), ())


def profiled(acceptance: float) -> Speculation:
    """A policy whose curves were profiled as the start-up profile does (every depth at a short and a long
    context, the loads as the engine describes its steps), on the device above, and whose request and
    instance accept `acceptance` at every depth."""
    spec = Speculation(K, adaptive=True, num_slots=4)
    for kv in (32, 384):
        for depth in range(K + 1):
            plan = one_row(kv, depth + 1)
            load = spec.shape(plan, np.array([depth]))
            target, drafts = device_ms(depth + 1, kv, depth)
            for _ in range(Curve.MIN_SAMPLES):
                spec.costs.observe(load, (target + drafts) * 1e-3, StepTiming(target * 1e-3, drafts * 1e-3))
    spec.costs.freeze()
    spec.instance.whole.tried[:] = spec.requests.tried[0] = 1000.0
    spec.instance.whole.accepted[:] = spec.requests.accepted[0] = 1000.0 * acceptance
    return spec


def rows_of(num_rows: int, kv: int, window: int) -> SchedulePlan:
    """`num_rows` greedy decode rows in slots 0.., each a window of `window` tokens after `kv` of KV."""
    rows = []
    for i in range(num_rows):
        request = Request(EngineRequest(i, (1, 2, 3), SamplingParams(temperature=0.0)), i, 0)
        request.num_kv_tokens = kv
        rows.append(ScheduledRow(request, 0, i, False, window, 0, True))
    return SchedulePlan(tuple(rows), (), (), ())


def memory_bound_ms(rows: int, kv: int, depth: int) -> tuple[float, float]:
    """(target, drafts) of a decode step on a device where attention reads each key from memory (0.3 us a
    key to the target pass, 0.08 to a depth) and dots it with each query (0.04 and 0.01 us a pair)."""
    window = depth + 1
    keys, pairs = rows * (kv + window), rows * window * (kv + window)
    target = 1.0 + 0.05 * rows * window + 0.3e-3 * keys + 0.04e-3 * pairs
    return target, depth * (0.3 + 0.02 * rows * window + 0.08e-3 * keys + 0.01e-3 * pairs)

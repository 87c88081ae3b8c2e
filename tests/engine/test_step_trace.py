"""The speculation policy's debugging aids: the step trace and the depth schedule (engine/step_trace.py)."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.spec_cost import StepLoad
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from mtpserve.engine.step_trace import COLUMNS, SCHEDULE_ENV, TRACE_ENV, DepthSchedule, StepTrace
from mtpserve.ipc.sampling_params import SamplingParams

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "step_trace.py"


def decode_rows(n: int, params: dict[int, SamplingParams] | None = None, admitted: bool = False) -> SchedulePlan:
    """n greedy decode rows in slots 0..n-1 (`params`: other parameters by slot); `admitted`: the step that
    admits them (the policy reads a request's cap and seed when it takes its slot)."""
    rows = []
    for i in range(n):
        request = Request(EngineRequest(i, (1, 2, 3), (params or {}).get(i, SamplingParams(temperature=0.0))), i, 0)
        request.slot = i
        rows.append(ScheduledRow(request, 0, i, False, 4, 0, True))
    inserts = tuple(row.request for row in rows) if admitted else ()
    return SchedulePlan(tuple(rows), inserts, (), ())


def test_a_schedule_cycles_through_its_blocks_and_rejects_what_it_cannot_read():
    schedule = DepthSchedule.parse("0x2,3x1,1x3")
    assert [schedule.next_depth() for _ in range(12)] == [0, 0, 3, 1, 1, 1] * 2
    for bad in ("2", "1x0", "-1x4", "ax2", ""):
        with pytest.raises(ValueError, match=SCHEDULE_ENV):
            DepthSchedule.parse(bad)


def test_a_schedule_pins_every_steps_depth_within_each_requests_cap(monkeypatch):
    monkeypatch.setenv(SCHEDULE_ENV, "1x2,3x2")
    spec = Speculation(3, adaptive=True, num_slots=4)
    capped = {1: SamplingParams(temperature=0.0, max_draft_tokens=2)}
    spec.choose(decode_rows(2, capped, admitted=True))  # NOTE: the schedule's first step, at depth 1
    assert [spec.choose(decode_rows(2, capped)).tolist() for _ in range(3)] == [[1, 1], [3, 2], [3, 2]]
    seeded = {**capped, 0: SamplingParams(temperature=1.0, seed=7)}  # a seeded sample keeps its cap
    spec.choose(decode_rows(2, seeded, admitted=True))
    assert [spec.choose(decode_rows(2, seeded)).tolist() for _ in range(3)] == [[3, 1], [3, 2], [3, 2]]
    monkeypatch.delenv(SCHEDULE_ENV)
    assert Speculation(3, adaptive=True, num_slots=4).schedule is None


def test_the_trace_writes_a_line_per_step_and_a_comment_per_decision_that_the_summary_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    trace = StepTrace.from_env()
    assert trace is not None
    spec = Speculation(3, adaptive=True, num_slots=64)
    spec.trace = trace
    for step in range(200):
        plan = decode_rows(64 if step < 100 else 1)
        drafts = spec.choose(plan)
        load = spec.shape(plan, drafts)
        prediction = spec.observe(load, 2e-3, StepTiming(1.5e-3, 0.4e-3))
        trace.record(load, 2e-3, StepTiming(1.5e-3, 0.4e-3), *prediction, emitted=len(plan.rows))
    trace.flush()
    lines = next(tmp_path.glob("trace.*")).read_text().splitlines()
    steps = [line.split() for line in lines if not line.startswith("#")]
    decisions = [line.split() for line in lines if line.startswith("#d")]
    assert len(steps) == 200 and all(len(fields) == len(COLUMNS) for fields in steps)
    assert decisions and all(len(fields) == 4 + 4 for fields in decisions)  # rows, depth, figures per depth
    assert all(len(figure.split("/")) == 5 for fields in decisions for figure in fields[4:])
    assert {int(fields[3]) for fields in steps} == {64, 1}  # the emitting rows column
    summary = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "trace"), "--gap", "100"],
                             capture_output=True, text=True, check=True).stdout
    assert "49+" in summary and "1-2 rows" in summary


def test_the_trace_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert StepTrace.from_env() is None
    out = io.StringIO()
    StepTrace(out).record(StepLoad(8, 4, 1, False, 4, 100, 50), 3e-3, None, 2e-3, 2.5e-3, 6)
    assert out.getvalue().split()[6:] == ["100", "50", "0", "3.000", "0.000", "0.000", "2.000", "2.500",
                                          "6"]

"""The engine core's speculation: what each row drafts next (policy), and what it learns from each step.

Per step, for the rows of the plan: `choose` gives each row the drafts it proposes this step for its
next window (the scheduler sizes that window from `Request.num_drafts`); `observe` takes the finished
step's period and the device thread's times (the step costs learn from them) and each verified window updates its
request's acceptance per depth (and the instance's, the prior of new requests). With `adaptive` off
every row drafts K (or its request's cap), as a fixed-k engine does.

A sampled request with a seed always drafts its cap: rejection sampling keeps the distribution whatever
the drafts, but which sample a seed gives depends on them, and a seed promises the same sample whatever
the load. Greedy and unseeded requests are adaptive.
"""

from __future__ import annotations

import functools

import numpy as np

from mtpserve.engine.request import Request
from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import Prediction, StepCosts, StepLoad
from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_hold import Hold, hold_length, same_load
from mtpserve.engine.spec_hope import Hopes
from mtpserve.engine.spec_learning import Acceptances
from mtpserve.engine.spec_load import PlanLoad, decode_loads, plan_load
from mtpserve.engine.spec_policy import depth_rates, expected_tokens, is_clear, pick_depth, row_drafts, step_tokens
from mtpserve.engine.spec_seek import SEEK_STEPS, depth_to_price, doubt_seconds
from mtpserve.engine.spec_stats import InstanceAcceptance, SlotAcceptance, first_doubt
from mtpserve.engine.spec_traffic import Traffic
from mtpserve.engine.step_plan import StepTiming
from mtpserve.engine.step_trace import DepthSchedule, StepTrace

SWITCH_MARGIN = 0.05


class Speculation:
    def __init__(self, max_drafts: int, adaptive: bool, num_slots: int) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive and max_drafts > 0
        self.acceptance = Acceptances(max_drafts, num_slots)  # each running request's, and the instance's
        self.costs = StepCosts()
        self.extra = ServingExtra()
        self.predicted_seconds = 0.0  # sums over observed steps, for /metrics
        self.measured_seconds = 0.0
        self._held: Hold | None = None  # the last decision, while it holds
        self._by_rows: dict[int, Hold] = {}  # the last decision at each count of emitting rows
        self._seeks: dict[int, Hold] = {}  # the last seek in each half octave of emitting rows (ServingExtra.bucket)
        self.hopes = Hopes()
        self.forced: int | None = None  # the start-up profile pins every row's drafts
        self.rows_by_drafts = np.zeros(max_drafts + 1, np.int64)  # rows that chose k, for /metrics
        self._depth = max_drafts  # the depth in use
        self.trace: StepTrace | None = None  # a debug trace of the policy's decisions (step_trace.py)
        self.schedule = DepthSchedule.from_env()  # a debug aid: every step's depth pinned by a schedule
        # NOTE: per slot, its request's cap and whether a seed pins its drafts to it, set when the request takes
        # the slot (as the device's slot state is): read from its Request per row and step, they cost ~0.5 us
        # a row, and at 64 streams the policy's host work was 3% of the engine's throughput
        self._slot_caps = np.full(num_slots, max_drafts, np.int64)
        self._slot_pinned = np.zeros(num_slots, bool)
        self.traffic = Traffic()
        self._steps = 0  # steps the policy chose drafts for
        self._decided_at = 0  # `_steps` at the last decision
        self._last: tuple[SchedulePlan, PlanLoad] | None = None  # the last plan `choose` read, for `shape`
        # NOTE: per slot, its request's drafts under the decision that holds (`_held_drafts`; -1 not yet read)
        self._slot_drafts = np.full(num_slots, -1, np.int64)
        self._slot_drafts_of: Hold | None = None

    @property
    def instance(self) -> InstanceAcceptance:
        return self.acceptance.instance

    @property
    def requests(self) -> SlotAcceptance:
        return self.acceptance.requests

    def choose(self, plan: SchedulePlan) -> np.ndarray:
        """[B] drafts each row proposes this step; sets each request's next window."""
        for request in plan.inserts:
            self._slot_caps[request.slot_id] = self._cap(request)
            self._slot_pinned[request.slot_id] = _is_seeded_sample(request)
            self._slot_drafts[request.slot_id] = -1
        # NOTE: only the policy reads the context (a fixed k would read every row's KV length for nothing)
        load = plan_load(plan, self.adaptive)
        self._last = plan, load
        slots = np.fromiter((row.slot for row in plan.rows), np.int64, len(plan.rows))
        caps = self._slot_caps[slots]
        if self.schedule is not None and self.forced is None:
            # NOTE: a seeded sample keeps its cap, as under the policy: its sample must not depend on the debug aid
            drafts = np.where(self._slot_pinned[slots], caps, np.minimum(caps, self.schedule.next_depth()))
        elif self.adaptive and self.forced is None:
            drafts = self._adaptive(plan, load, slots, caps)
        else:
            drafts = caps if self.forced is None else np.minimum(caps, self.forced)
        depth = int(drafts.max(initial=0))
        if depth:
            for row, k in zip(plan.rows, drafts.tolist()):
                request = row.request
                request.num_drafts = k
                # NOTE: not min(): a call a row, ~10 us a step at 64 rows
                if request.mtp_depth > depth and not row.before_key_start:
                    request.mtp_depth = depth
            self.rows_by_drafts += np.bincount(drafts, minlength=self.max_drafts + 1)
            return drafts
        if self.adaptive:
            self.acceptance.drafted_nothing()
        for row in plan.rows:  # NOTE: the load's usual step at 16-64 streams: the same, without the array's walk
            request = row.request
            request.num_drafts = 0
            if not row.before_key_start:
                request.mtp_depth = 0
        self.rows_by_drafts[0] += len(plan.rows)
        return drafts

    def forget_profile(self) -> None:
        """Keep the step costs, drop what was learnt of acceptance, of the traffic and of what serving adds
        to a step (after the start-up profile: its prompts are not clients', and its steps were timed
        against curves still learning).

        NOTE: the profile's steps had taught the extra of steps with a prompt chunk -6.4 ms at 16 rows,
        which a running mean of serving's steps would take ~500 steps to forget."""
        self.acceptance.forget()
        self.rows_by_drafts[:] = 0
        self.extra = ServingExtra()
        self.hopes = Hopes()
        self.traffic = Traffic()

    def shape(self, plan: SchedulePlan, drafts: np.ndarray) -> StepLoad:
        """What the cost model knows of the step `plan` launches with `drafts` (the plan `choose` read last, or
        any other)."""
        load = self._last[1] if self._last is not None and self._last[0] is plan else plan_load(plan, self.adaptive)
        return StepLoad(load.num_tokens, len(plan.rows), int(drafts.max(initial=0)), load.prefill_tokens > 0,
                        load.num_emitting, load.context, load.keys, load.prefix)

    def observe(self, load: StepLoad, seconds: float, timing: StepTiming | None) -> Prediction:
        """A finished step: its load, its period, the device thread's times. Returns what the model made
        of it before learning from it."""
        device = self.costs.device(load)
        # NOTE: as the policy prices them: a decode step never below its quiet time, a chunk step by its own mean
        serving = (self.extra.measured(load.num_emitting, True, load.depth) if load.has_prefill
                   else self.extra.seconds(load.num_emitting, depth=load.depth))
        prediction = Prediction(device, max(device + serving, 0.0))
        if seconds <= 0:
            return prediction
        self.predicted_seconds += prediction.period
        self.measured_seconds += seconds
        self.costs.observe(load, seconds, timing)
        if load.num_emitting:
            thread = None if timing is None else timing.target_seconds + timing.draft_seconds
            self.extra.observe(load.num_emitting, seconds, device, load.has_prefill, load.depth, thread)
        return prediction

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request: the prompt tokens it prefilled and the tokens it emitted."""
        self.traffic.observe_finished(prompt_tokens, output_tokens)

    def observe_windows(self, slots: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray,
                        complete: np.ndarray) -> None:
        """A step's verified windows [R]: their slots, drafts, drafts accepted, and the MTP depths their
        requests ran in every step (`Request.mtp_depth`)."""
        if self.adaptive and slots.size:
            self.acceptance.observe_windows(slots, num_drafts, num_accepted, complete)

    def _prefill_cost(self, decode: StepLoad, num_emitting: int) -> float:
        """Seconds a prompt token adds to a decode step like `decode` (`num_emitting` rows emit): a typical
        chunk's share of the difference between the step with it and without it, its depths included, as
        serving has measured the two kinds of step."""
        chunk = max(self.traffic.chunk_tokens, 1.0)
        mixed = decode._replace(num_tokens=decode.num_tokens + round(chunk), has_prefill=True,
                                context=decode.context + round(chunk), keys=decode.keys + round(chunk),
                                prefix=round(self.traffic.chunk_prefix))
        serving = self.extra.chunk_extra(num_emitting, decode.depth)
        return max(self.costs.device(mixed) + serving - self.costs.device(decode), 0.0) / chunk

    def _adaptive(self, plan: SchedulePlan, load: PlanLoad, slots: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """The policy's drafts for the plan's rows (their load, slots and caps [B]); while a decision holds and
        the step has the same rows as the last, the last step's drafts.

        NOTE: at a steady load a decision holds for a few steps (HOLD_STEPS): deciding costs ~150 us of
        Python and even reading the rows' estimates ~40 us, a few % of a batch-1 step on this host."""
        self._steps += 1
        prefill, num_emitting = load.prefill_tokens, load.num_emitting
        if prefill:
            self.traffic.observe_chunk(prefill, load.prefix)
        if plan.inserts:
            self._admit(plan.inserts)
        held = self._held
        if held is None or not same_load(held.num_emitting, num_emitting):
            held = self._resume(num_emitting)
        if prefill and held is not None and held.sought and held.steps and \
                same_load(held.num_emitting, num_emitting):
            return self._beside_seek(plan, slots, caps)
        if held is not None and held.steps and not held.depth and num_emitting and \
                same_load(held.num_emitting, num_emitting) and not self._slot_pinned[slots].any():
            # NOTE: the load's usual step at 64 streams: a decision for depth 0 holds, and every row drafts
            # nothing. Taken through the key and `_policy` below, the same answer cost ~60 us of Python a
            # step, which the device thread waits for (the GIL): with this path, adaptive at 64 streams in
            # one process (T = 1.5, drafting nothing) ran ~0.6% faster, paired over 8 rounds.
            held.steps -= 1
            return np.zeros(len(slots), np.int64)
        emits = np.fromiter((row.emits for row in plan.rows), bool, len(plan.rows))
        key = (slots.tobytes(), emits.tobytes())
        if held is not None and held.steps and held.key == key and not plan.inserts:
            held.steps -= 1
            return held.drafts
        drafts = self._policy(plan, slots, emits, caps, bool(prefill))
        if self._held is not None and not (prefill and self._held.sought):  # NOTE: a seek's are a decode step's
            self._held.key, self._held.drafts = key, drafts
        return drafts

    def _resume(self, num_emitting: int) -> Hold | None:
        """A seek in these rows' half octave that has steps left, else the last decision at exactly these rows,
        the one that holds again if it has steps left.

        NOTE: at four streams the rows that emit went 4, 3, 4 as requests ended and new ones began, and a
        decision at each return to 4 was one step in 12 (~200 us each): where nothing drafts (random words),
        the K=3 runner pinned to depth 0 ran 4% faster than adaptive in one process.

        NOTE: a seek, whenever the rows come back: cut short, its depth is left with a mean of a spell just begun
        and no settled one (spec_regime.Regime.settled), and is not sought again for STALE_STEPS. In the stepped
        load's first 64-stream phase, the first wave of requests to end took the rows to ~50 (another half
        octave) 35 steps into a seek of depth 1; depth 1 was then priced from depth 0's spell, 8.6 ms of serving
        against the ~5 its own steps had added, and depth 0 ran the next 123 steps (4,800 tok/s against depth
        1's 5,500)."""
        seek = self._seeks.get(ServingExtra.bucket(num_emitting))
        if seek is not None and seek.steps:
            self._held = seek
            return seek
        resumed = self._by_rows.get(num_emitting)
        # NOTE: within twice its length: a decision from before a long spell at other rows is not resumed
        if resumed is not None and resumed.steps and self._steps - resumed.at < 2 * resumed.length:
            self._held = resumed
        return self._held

    def _admit(self, inserts: tuple[Request, ...]) -> None:
        """New requests start from the instance's estimate, or a hopeful one from the first prior (spec_hope.py);
        a hope ends the decision that holds, unless it is a seek: a seek runs its depth for its price, not for
        the rows' estimates, and ended, it leaves the depth unpriced (`_resume`)."""
        doubt = first_doubt(self.instance.rates())
        hopeful = self.hopes.admit(len(inserts), doubt, self.max_drafts)
        self.requests.reset(np.array([request.slot_id for request in inserts], np.int64), hopeful=hopeful)
        if hopeful.any() and self._held is not None and doubt < self.max_drafts:
            if not self._held.sought:
                self._held.steps = 0  # NOTE: a hope is news: the held depth was decided without it
            for hold in self._by_rows.values():
                hold.steps = 0

    def _policy(self, plan: SchedulePlan, slots: np.ndarray, emits: np.ndarray, caps: np.ndarray,
                chunk: bool = False) -> np.ndarray:
        """One depth for the step from the rows that emit (spec_policy.py), then each emitting row's
        drafts (`chunk`: the step has a prompt chunk). A prefill chunk that does not emit yet drafts nothing,
        but the depths the step runs write its MTP KV: a prompt gets that KV exactly when drafting is in use
        at this load. A pinned request drafts its cap (its floor) in every step it is in, so its MTP KV, and
        so its drafts, never depend on its neighbours."""
        drafts = np.where(self._slot_pinned[slots], caps, 0)
        if not emits.any():
            return drafts
        caps_e, floors = caps[emits], drafts[emits]
        held = self._held
        if held is not None and held.steps and same_load(held.num_emitting, len(caps_e)):
            held.steps -= 1
            drafts[emits] = self._held_drafts(held, slots[emits], caps_e, floors)
            return drafts
        prior = self.instance.rates()
        rates = self.requests.rates(slots[emits], prior)
        loads = list(map(decode_loads(plan, emits, caps_e, floors), range(self.max_drafts + 1)))  # rows walked once
        gain = expected_tokens(rates)
        emitted = step_tokens(gain, caps_e, floors)  # a step's, by depth

        def prompts(depth: int) -> float:
            """The prompts' share of a step at this depth: each emitted token brings the traffic's prompt
            tokens per token emitted, and the depths run over those as well."""
            return emitted[depth] * self.traffic.prefill_per_token() * self._prefill_cost(loads[depth], len(caps_e))

        def extra(depth: int) -> float:
            return self.extra.priced(len(caps_e), depth, emitted.__getitem__)

        @functools.cache  # NOTE: each read two to four times a decision (rates, margins, trace)
        def period(depth: int) -> float:
            """The device time of a decode step of these rows at this depth, the prompts' share, and what
            serving adds to a step of these rows at this depth."""
            return self.costs.device(loads[depth]) + prompts(depth) + extra(depth)

        shallowest = int(floors.max(initial=0))
        per_second = depth_rates(emitted, shallowest, period)

        def doubt(depth: int) -> float:
            """What caution adds to a depth's price for the choice (and the trace)."""
            return doubt_seconds(self.extra, len(caps_e), depth, self._depth)

        cautious = depth_rates(emitted, shallowest, lambda d: period(d) + doubt(d))
        was, depth = self._depth, pick_depth(cautious, self._depth, SWITCH_MARGIN)
        self._depth = depth
        sought = depth_to_price(self.extra, per_second, depth, len(caps_e), period, extra, was)
        if self.trace is not None:
            self.trace.decision(len(caps_e), depth if sought is None else sought, range(self.max_drafts + 1),
                                (emitted.__getitem__, period, prompts, extra, doubt))
        if sought is not None:
            drafts[emits] = self._seek_price(len(caps_e), depth if chunk else sought, caps_e, floors, sought)
            return drafts
        step_rate = emitted[depth] / max(period(depth), 1e-9)
        # NOTE: what serving adds is per step: a window token costs its device seconds
        slot_cost = step_rate * self.costs.device_token_seconds(loads[depth])
        drafts[emits] = row_drafts(rates, depth, caps_e, floors, slot_cost)
        self._decided(held, depth, slots[emits], drafts[emits], floors, rates, prior,
                      is_clear(per_second, depth, SWITCH_MARGIN), slot_cost)
        return drafts

    def _decided(self, held: Hold | None, depth: int, slots: np.ndarray, drafts: np.ndarray, floors: np.ndarray,
                 rates: np.ndarray, prior: np.ndarray, clear: bool, slot_cost: float) -> None:
        """After a decision at `depth` (`held`: the last one) for the emitting rows (their slots, drafts, floors
        and estimates): the rows' estimates fade (`_fade`) and the decision holds (`_hold`), for no steps while a
        request hopes.

        NOTE: a decision that has a hopeful request draft the depth it hopes for rests on one window's worth of
        hope, and the next verdict is worth deciding on. Held for HOLD_STEPS, every hopeful request on random
        words drafted eight windows, all rejected, and each such step ran its MTP depth for every row: 2% of
        steps at four streams."""
        chosen = np.where(drafts > floors, drafts, 0)  # a pinned row's drafts are no hope
        hoping = self.requests.hoping(slots, chosen, prior)
        self._fade(slots, drafts, rates, prior)
        self._hold(held, depth, len(slots), clear, hoping, slot_cost)

    def _fade(self, slots: np.ndarray, drafts: np.ndarray, rates: np.ndarray, prior: np.ndarray) -> None:
        """After a decision, for the emitting rows (their slots, drafts, estimates): the requests it gave no drafts
        drift back to the instance's estimate, and so do the depths beyond a row's drafts where its estimate is
        below the instance's, by the steps since the last decision (spec_learning.py)."""
        self.acceptance.fade_idle(slots, drafts)
        steps, self._decided_at = self._steps - self._decided_at, self._steps
        self.acceptance.fade_doubted(slots, drafts, rates, prior, steps)

    def _hold(self, held: Hold | None, depth: int, num_emitting: int, clear: bool, hoping: bool,
              slot_cost: float) -> None:
        """Hold a new decision (`held`: the last one) for `hold_length` steps, none while a request hopes; a
        clear one that repeats the last decision at these very rows, others between, doubles it (`_resume`)."""
        length = hold_length(held, depth, num_emitting, clear)
        if clear:
            length = max(length, hold_length(self._by_rows.get(num_emitting), depth, num_emitting, clear))
        self._held = self._by_rows[num_emitting] = Hold(num_emitting, 0 if hoping else length - 1, depth,
                                                        slot_cost, length, at=self._steps)

    def _held_drafts(self, held: Hold, slots: np.ndarray, caps: np.ndarray, floors: np.ndarray) -> np.ndarray:
        """The emitting rows' drafts (slots, caps, floors: theirs) at a held decision's depth and slot cost: a
        request's as it was when it was first read under this decision, else from its estimate now.

        NOTE: read once a decision, as the drafts of a step with the same rows are. At 64 streams the rows
        change almost every step, and reading every row's estimate each step (~60 us of numpy calls on this
        host) was half of the policy's work a held step; the device thread waits for the GIL meanwhile."""
        if not held.depth:  # NOTE: at depth 0 every row drafts its floor, and needs no estimate
            return floors
        if self._slot_drafts_of is not held:
            self._slot_drafts_of = held
            self._slot_drafts[:] = -1
        drafts = self._slot_drafts[slots]
        unread = drafts < 0
        if unread.any():
            slots, caps, floors = slots[unread], caps[unread], floors[unread]
            drafts[unread] = self._slot_drafts[slots] = row_drafts(
                self.requests.rates(slots, self.instance.rates()), held.depth, caps, floors, held.slot_cost)
        return drafts

    def _seek_price(self, num_emitting: int, depth: int, caps: np.ndarray, floors: np.ndarray,
                    sought: int) -> np.ndarray:
        """The emitting rows' drafts (caps, floors: theirs) at `depth` as decode steps at `sought` start to be
        run to price it: in those steps every row drafts it (or its cap), as the rates that made it worth
        pricing assumed; `depth` is `sought`, or the depth in use in a step with a prompt chunk
        (`_beside_seek`). The depth in use stays what it was: going deeper is still decided with the margin,
        on the new price.

        NOTE: held with no slot cost, so the held steps keep every row's full window."""
        self.extra.seek(num_emitting, sought)
        steps = SEEK_STEPS - (depth == sought)  # NOTE: as many decode steps at `sought`
        self._held = self._seeks[ServingExtra.bucket(num_emitting)] = Hold(
            num_emitting, steps, sought, 0.0, SEEK_STEPS, at=self._steps, sought=True)
        return np.maximum(np.minimum(caps, depth), floors)

    def _beside_seek(self, plan: SchedulePlan, slots: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """A step with a prompt chunk while a seek holds: its rows draft as at the depth in use, and the seek
        keeps its steps for decode steps.

        NOTE: a seek prices decode steps (a step with a prompt chunk has means of its own), but its depth ran
        over every prompt chunk of its steps too: at 16 streams on code, 16-17 steps a ~22 s visit with a
        chunk at depth 1 or 2 took ~30 ms against ~20.5 at depth 0, ~0.7% of the visit."""
        emits = np.fromiter((row.emits for row in plan.rows), bool, len(plan.rows))
        drafts = np.where(self._slot_pinned[slots], caps, 0)
        drafts[emits] = np.maximum(np.minimum(caps[emits], self._depth), drafts[emits])
        return drafts

    def _cap(self, request: Request) -> int:
        cap = request.params.max_draft_tokens
        return self.max_drafts if cap is None else min(cap, self.max_drafts)


def _is_seeded_sample(request: Request) -> bool:
    params = request.params
    return params.seed is not None and params.temperature > 0

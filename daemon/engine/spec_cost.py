"""The step-time model the speculation policy plans with, measured on the machine it runs on.

What a step costs the engine's throughput is its period (engine_core._period: from the previous step's
finish to its own). Two layers:

1. The device's time for a step, as curves over what it computes (`StepCosts`):

       device = target(N) + A_target(K, C) + D * (depth(N) + A_depth(K, C))

   target(N): the device thread's time for everything but drafting (target pass over N tokens, LM head,
   verification, logprobs), one curve for decode-only steps and one for steps with a prefill chunk (a
   decode token is also a logit row, a prompt token is not, and on a small model the LM head costs as
   much as a layer); depth(N): one MTP depth over the same N tokens (a step with a prefill chunk has a
   curve per number of depths instead, `StepCosts` says why); K and C: the keys the step's attention
   reads and the (query token, key) pairs it dots, and A(K, C) what they cost the target pass and a depth
   (`Attention`); a prompt chunk's pairs over its prompt's earlier positions are priced apart (`StepCosts`).
   The device thread's times come from the step itself
   (`StepTiming`), taken where it already waits for the device, so timing adds no sync. A short profile
   at start-up (rank_setup.profile_steps), serving nobody yet, fills them at every depth, a few batch
   sizes and a short and a long context, and prompts alone at every depth (one in two chunks); then they
   are frozen.
2. What serving adds to it (`ServingExtra`, spec_extra.py): the period less the device time, measured by the rows
   that emit, apart for steps with a prefill chunk and without. The host loop, the HTTP process and any
   client share the cores with the device and add about as much to a step whatever depth it runs.

Each curve is a `Curve` (spec_curve.py), measured per cell and read between cells by interpolation. The frozen
curves can be kept on disk for the next start (`CostsState`, spec_profile.py).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from mtpserve.engine.spec_curve import Curve, CurveState, low_quantile
from mtpserve.engine.step_plan import StepTiming


class StepLoad(NamedTuple):
    """What a step computes, as the cost model sees it."""

    num_tokens: int  # the target pass's tokens (decode windows and prefill chunks)
    num_rows: int
    depth: int  # MTP depths the step ran
    has_prefill: bool
    num_emitting: int = 0  # rows that emit (decode windows, last prompt chunks)
    context: int = 0  # what attention reads: decode windows' (query, key) pairs, prompt chunks' positions
    keys: int = 0  # of it, the keys: decode rows' KV at their windows' ends, prompt chunks' positions
    prefix: int = 0  # prompt chunks' (query, key) pairs over their prompts' earlier positions: width x start


class Prediction(NamedTuple):
    """The cost model's figures for a finished step, before it learnt from it (seconds)."""

    device: float  # the device's time on a quiet host (the start-up profile's curves)
    period: float  # the period: that time plus what serving adds at its rows


# NOTE: CPU-sized guesses (seconds) used until a curve has samples: 2 ms + 0.2 ms a token for the target
# pass, 0.5 ms + 0.05 ms a token for a depth.
def _target_prior(n: float) -> float:
    return 2e-3 + 2e-4 * n


def _depth_prior(n: float) -> float:
    return 5e-4 + 5e-5 * n


class Attention(NamedTuple):
    """What attention costs a pass (seconds): per key read, per (query, key) pair."""

    per_key: float = 0.0
    per_pair: float = 0.0

    def __call__(self, load: StepLoad) -> float:
        return self.per_key * load.keys + self.per_pair * load.context


class CostsState(msgspec.Struct, frozen=True):
    """The frozen step-cost model (`StepCosts.state`): every curve and fitted slope, as the profile left them."""

    decode: CurveState
    mixed: CurveState
    mixed_alone: CurveState
    depth: CurveState
    mixed_drafts: dict[int, CurveState]  # by the step's number of depths
    target_attention: tuple[float, float]  # (per key, per pair) seconds
    depth_attention: tuple[float, float]
    prefix_target: float
    prefix_drafts: dict[int, float]  # by the step's number of depths


class StepCosts:
    """The device's time for a step, as curves over what it computes. A decode step:

        device = target(N) + A_target(K, C) + D * (depth(N) + A_depth(K, C)),

    a step with a prefill chunk:

        device = mixed(N) + A_target(K, C) + drafts_D(N) + D * A_depth(K, C) + (p_target + p_D) * P,

    with mixed_alone(N) for mixed(N) where no depth runs (D = 0),

    N the target pass's tokens, K and C the keys and (query, key) pairs its attention reads (`StepLoad`),
    A(K, C) = a * K + b * C what they cost a pass (`Attention`), D the depths, P the chunks' pairs over their
    prompts' earlier positions and p_target, p_D what one costs the target pass and the D depths
    (`_fit_prefix`).

    NOTE: attention grows with the rows' contexts, which N does not see: measured here at 16 rows,
    384-token prompts instead of 32 doubled a depth-0 step (2.2 -> 4.4 ms) and each depth's draft time
    (0.7 -> 1.5 ms), and curves over N alone, profiled at short contexts, charged a depth half of what it
    costs in serving. A window reads its row's keys once and its every token dots every key
    (spec_load.plan_load says what counting only one of the two did).

    NOTE: drafts_D, a curve per D, because a prompt's depths do not cost alike: the last depth runs its
    layer's MLP and head at the frontier only, the depths before it over every position (their hidden
    states feed the next). One 384-token prompt took 2.2 ms at one depth and 11.1 ms at three. Priced as
    D times a decode step's depth, a prompt token cost 8.5 us at depth 1 where serving's prompt chunks
    took 4.4 us (16 streams, code)."""

    def __init__(self) -> None:
        self.decode = Curve(_target_prior)  # target(N) of decode-only steps
        self.mixed = Curve(_target_prior)  # target(N) of steps with a prefill chunk and a depth
        # NOTE: and without one: the last block attends and runs its MLP for the logit rows alone
        # (model_runner._forward), ~20% less target time for a 256-320 token chunk of the bundled model.
        # One curve for both priced a depth's prompt chunks with depth 0's (20.4 ms profiled, 23.4
        # measured, 16 streams on code), and the policy ran depth 1 for 97% of rows where depth 0 served
        # 14% more.
        self.mixed_alone = Curve(lambda n: self.mixed(n))
        self.depth = Curve(_depth_prior)  # depth(N) of decode-only steps
        self._mixed_drafts: dict[int, Curve] = {}  # drafts_D(N) of steps with a prefill chunk, by D
        self.target_attention = Attention()  # A_target (nothing until profiled)
        self.depth_attention = Attention()  # A_depth
        self.prefix_target = 0.0  # P_target: seconds per pair of a prompt chunk over its prompt's earlier positions
        self.prefix_drafts: dict[int, float] = {}  # P_D: the same for a step's D depths, by D
        self._prefix_samples: list[tuple[StepLoad, float, float]] = []  # (load, target, drafts seconds) till frozen
        self.frozen = False

    def mixed_drafts(self, depths: int) -> Curve:
        """drafts_D: the draft time of a step with a prefill chunk at D depths (until it has samples,
        D decode depths over as many tokens)."""
        curve = self._mixed_drafts.get(depths)
        if curve is None:
            curve = self._mixed_drafts[depths] = Curve(lambda n: depths * self.depth(n))
        return curve

    def device(self, load: StepLoad) -> float:
        """The device thread's time for a step like `load`, as the curves have it."""
        attention = self.target_attention(load) + load.depth * self.depth_attention(load)
        if load.prefix:
            attention += load.prefix * (self.prefix_target + self.prefix_drafts.get(load.depth, 0.0))
        return self._target(load)(load.num_tokens) + attention + self._drafts(load)

    def _target(self, load: StepLoad) -> Curve:
        if not load.has_prefill:
            return self.decode
        return self.mixed if load.depth else self.mixed_alone

    def _drafts(self, load: StepLoad) -> float:
        """The depths' time for a step like `load`, less their attention."""
        if not load.depth:
            return 0.0
        if load.has_prefill:
            return self.mixed_drafts(load.depth)(load.num_tokens)
        return load.depth * self.depth(load.num_tokens)

    def device_token_seconds(self, load: StepLoad) -> float:
        """What one more target-pass token per row adds to the device time of a step like `load`, per
        token."""
        more = load._replace(num_tokens=load.num_tokens + load.num_rows)
        return max(self.device(more) - self.device(load), 0.0) / max(load.num_rows, 1)

    def freeze(self) -> None:
        """Keep the curves as they are (the start-up profile's, on a machine serving nobody): serving's
        own costs are measured apart (`ServingExtra`)."""
        target = self.target_attention = Attention(*self.decode.attention_slopes())
        depth = self.depth_attention = Attention(*self.depth.attention_slopes())
        for curve in (self.decode, self.mixed, self.mixed_alone):
            curve.settle(*target)
        self.depth.settle(*depth)
        for depths, curve in self._mixed_drafts.items():
            curve.settle(depths * depth.per_key, depths * depth.per_pair)
        self._fit_prefix()
        self.frozen = True

    def state(self) -> CostsState:
        """The frozen model, to be kept (spec_profile.py)."""
        assert self.frozen, "only the frozen model is kept"
        return CostsState(self.decode.state(), self.mixed.state(), self.mixed_alone.state(), self.depth.state(),
                          {depths: curve.state() for depths, curve in self._mixed_drafts.items()},
                          (self.target_attention.per_key, self.target_attention.per_pair),
                          (self.depth_attention.per_key, self.depth_attention.per_pair), self.prefix_target,
                          dict(self.prefix_drafts))

    def restore(self, state: CostsState) -> None:
        """Freeze the model as `state` has it, in place of a profile (whatever it had learnt is dropped)."""
        for curve, kept in ((self.decode, state.decode), (self.mixed, state.mixed),
                            (self.mixed_alone, state.mixed_alone), (self.depth, state.depth)):
            curve.restore(kept)
        self._mixed_drafts = {}
        for depths, kept in state.mixed_drafts.items():
            self.mixed_drafts(depths).restore(kept)
        self.target_attention = Attention(*state.target_attention)
        self.depth_attention = Attention(*state.depth_attention)
        self.prefix_target, self.prefix_drafts = state.prefix_target, dict(state.prefix_drafts)
        self._prefix_samples = []
        self.frozen = True

    def _fit_prefix(self) -> None:
        """P_target and each P_D from the profile's prompt chunks at an offset: what each took beyond the settled
        curves' price of the same chunk with no earlier positions, per prefix pair (a low quantile, as a cell
        keeps), never below 0; only chunks with at least as many prefix pairs as pairs within themselves, so
        that the offset is most of what they cost beyond the curves.

        NOTE: a chunk's queries dot every earlier position of its prompt, read from the cache, and the curves
        (of prompts prefilled whole) saw none of that. In one process at 4 rows of 1,024-token prompts (in
        chunks of 512, `max_prefill_chunk`), a chunk at offset 512 took 45-65 ms more than one at 0 (~75 ms), of it
        ~10 ms in a depth-2 step's drafts and none in a depth-1 step's (the last depth runs only at the
        frontier); the prompts' share was priced a third low, and the policy ran depth 2 where depth 1 served
        7% more (docs/benchmarks.md, the fifty-third session)."""
        targets: list[float] = []
        drafts: dict[int, list[float]] = {}
        for load, target, draft in self._prefix_samples:
            if 2 * load.prefix < load.num_tokens * load.num_tokens:
                continue
            alone = load._replace(prefix=0)
            beyond = target - self._target(alone)(alone.num_tokens) - self.target_attention(alone)
            targets.append(beyond / load.prefix)
            beyond = draft - self._drafts(alone) - alone.depth * self.depth_attention(alone)
            drafts.setdefault(load.depth, []).append(beyond / load.prefix)
        self.prefix_target = low_quantile(targets)
        self.prefix_drafts = {depth: low_quantile(rises) if depth else 0.0 for depth, rises in drafts.items()}
        self._prefix_samples = []

    def observe(self, load: StepLoad, seconds: float, timing: StepTiming | None) -> None:
        """A finished step: its load, its period, and the device thread's times (None: not measured, as
        with the synthetic runner; then the period less the depths' estimate is the target's)."""
        if self.frozen:
            return
        if load.prefix:  # NOTE: the curves are of chunks with no earlier positions; these price the offset
            drafts = self._drafts(load) if timing is None else timing.draft_seconds
            target_seconds = max(seconds - drafts, 0.0) if timing is None else timing.target_seconds
            self._prefix_samples.append((load, target_seconds, drafts))
            return
        target = self._target(load)
        if timing is None:
            target.observe(load.num_tokens, max(seconds - self._drafts(load), 0.0), load.context, load.keys)
            return
        target.observe(load.num_tokens, timing.target_seconds, load.context, load.keys)
        if not load.depth:
            return
        if load.has_prefill:
            self.mixed_drafts(load.depth).observe(load.num_tokens, timing.draft_seconds, load.context, load.keys)
        else:
            self.depth.observe(load.num_tokens, timing.draft_seconds / load.depth, load.context, load.keys)

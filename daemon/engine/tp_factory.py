"""Engine pieces of a tensor-parallel rank: rank 0's engine core around a LeaderRunner, a rank >= 1's
FollowerRunner. Same configuration sections as build_model_engine, and the same KV block count on every
rank (each rank computes it from the same configuration and its own share of the heads)."""

from __future__ import annotations

from collections.abc import Callable

from mtpserve.config import EngineConfig, SpeculativeConfig
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine, runner_config
from mtpserve.engine.step_plan import StepResult
from mtpserve.engine.tp_plan_channel import PlanChannel
from mtpserve.engine.tp_runner import FollowerRunner, LeaderRunner
from mtpserve.model.serving_model import ServingModel

ResultHook = Callable[[StepResult], None]  # tests: every step's results, on every rank


def build_leader_engine(model: ServingModel, channel: PlanChannel, engine: EngineConfig,
                        speculative: SpeculativeConfig, on_result: ResultHook | None = None) -> EngineCore:
    return build_model_engine(model, engine, speculative,
                              make_runner=lambda m, cfg: LeaderRunner(m, cfg, channel, on_result))


def build_follower_runner(model: ServingModel, channel: PlanChannel, engine: EngineConfig,
                          speculative: SpeculativeConfig, on_result: ResultHook | None = None) -> FollowerRunner:
    return FollowerRunner(model, runner_config(model, engine, speculative), channel, on_result)

"""Engine pieces of a tensor-parallel rank: rank 0's engine core around a LeaderRunner, a rank >= 1's
FollowerRunner. Same parameters as build_model_engine, and the same KV block count on every rank
(each rank computes it from the same configuration and its own share of the heads)."""

from __future__ import annotations

from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine, runner_config
from mtpserve.engine.tp_plan_channel import PlanChannel
from mtpserve.engine.tp_runner import FollowerRunner, LeaderRunner
from mtpserve.model.mimo_model import MiMoForCausalLM


def build_leader_engine(model: MiMoForCausalLM, channel: PlanChannel, *, on_result=None,
                        **engine_args) -> EngineCore:
    """`engine_args`: build_model_engine's keyword parameters."""
    return build_model_engine(model, **engine_args,
                              make_runner=lambda m, cfg: LeaderRunner(m, cfg, channel, on_result))


def build_follower_runner(model: MiMoForCausalLM, channel: PlanChannel, *, num_speculative_tokens: int,
                          max_num_seqs: int = 64, block_size: int = 16, num_kv_blocks: int = 0,
                          kv_cache_mb: int = 512, on_result=None, **_ignored) -> FollowerRunner:
    """`_ignored`: the scheduler's parameters, which only rank 0 uses (callers pass one dict to both)."""
    cfg = runner_config(model, num_speculative_tokens, max_num_seqs, block_size, num_kv_blocks, kv_cache_mb)
    return FollowerRunner(model, cfg, channel, on_result)

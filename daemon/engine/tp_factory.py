"""Engine pieces of a tensor-parallel rank: rank 0's engine core around a LeaderRunner, a rank >= 1's
FollowerRunner. Same parameters as build_model_engine, and the same KV block count on every rank
(each rank computes it from the same configuration and its own share of the heads)."""

from __future__ import annotations

from mtpserve.engine.engine_core import EngineConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, kv_blocks_for_budget
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.tp_plan_channel import PlanChannel
from mtpserve.engine.tp_runner import FollowerRunner, LeaderRunner
from mtpserve.model.mimo_model import MiMoForCausalLM


def build_leader_engine(model: MiMoForCausalLM, channel: PlanChannel, *, num_speculative_tokens: int,
                        max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                        max_prefill_chunk: int = 512, block_size: int = 16, num_kv_blocks: int = 0,
                        kv_cache_mb: int = 512, max_model_len: int = 0, enable_overlap: bool = True,
                        seed: int = 0, eos_token_ids: tuple[int, ...] = (), on_result=None) -> EngineCore:
    cfg = runner_config(model, num_speculative_tokens, max_num_seqs, block_size, num_kv_blocks, kv_cache_mb)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_prefill_chunk=max_prefill_chunk,
                            num_speculative_tokens=cfg.num_speculative_tokens, num_blocks=cfg.num_blocks,
                            block_size=block_size,
                            max_model_len=max_model_len or model.config.max_position_embeddings)
    eos = eos_token_ids or ((model.config.eos_token_id,) if model.config.eos_token_id is not None else ())
    return EngineCore(EngineConfig(sched, overlap=enable_overlap, eos_token_ids=eos, seed=seed),
                      LeaderRunner(model, cfg, channel, on_result))


def build_follower_runner(model: MiMoForCausalLM, channel: PlanChannel, *, num_speculative_tokens: int,
                          max_num_seqs: int = 64, block_size: int = 16, num_kv_blocks: int = 0,
                          kv_cache_mb: int = 512, on_result=None, **_ignored) -> FollowerRunner:
    """`_ignored`: the scheduler's parameters, which only rank 0 uses (callers pass one dict to both)."""
    cfg = runner_config(model, num_speculative_tokens, max_num_seqs, block_size, num_kv_blocks, kv_cache_mb)
    return FollowerRunner(model, cfg, channel, on_result)


def runner_config(model: MiMoForCausalLM, k: int, max_num_seqs: int, block_size: int, num_kv_blocks: int,
                  kv_cache_mb: int) -> ModelRunnerConfig:
    if k and model.num_mtp_layers == 0:
        k = 0  # NOTE: a plain Qwen2 checkpoint has nothing to draft with (as build_model_engine)
    blocks = num_kv_blocks or kv_blocks_for_budget(model, block_size, k, kv_cache_mb)
    return ModelRunnerConfig(max_num_seqs=max_num_seqs, num_blocks=blocks, block_size=block_size,
                             num_speculative_tokens=k)

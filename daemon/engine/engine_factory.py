"""Assemble an EngineCore around a loaded model from plain parameters (the caller maps its config).

Suggested mapping from the configuration tree: engine.max_num_seqs, engine.max_num_batched_tokens,
engine.max_prefill_chunk, engine.block_size, engine.num_kv_blocks (0: from engine.kv_cache_mb),
engine.max_model_len (0: the model's max_position_embeddings), engine.enable_overlap, engine.seed,
speculative.num_speculative_tokens; EOS ids from the model config and tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

from mtpserve.engine.engine_core import EngineConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner, kv_blocks_for_budget
from mtpserve.engine.runner import ModelRunner
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.mimo_model import MiMoForCausalLM

RunnerFactory = Callable[[MiMoForCausalLM, ModelRunnerConfig], ModelRunner]


def build_model_engine(model: MiMoForCausalLM, *, num_speculative_tokens: int, max_num_seqs: int = 64,
                       max_num_batched_tokens: int = 2048, max_prefill_chunk: int = 512,
                       block_size: int = 16, num_kv_blocks: int = 0, kv_cache_mb: int = 512,
                       max_model_len: int = 0, enable_overlap: bool = True, seed: int = 0,
                       eos_token_ids: tuple[int, ...] = (), kv_lease_s: float = 30.0,
                       make_runner: RunnerFactory = PaddleModelRunner) -> EngineCore:
    """`make_runner` builds the device side (the tensor-parallel leader passes its own)."""
    cfg = runner_config(model, num_speculative_tokens, max_num_seqs, block_size, num_kv_blocks, kv_cache_mb)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_prefill_chunk=max_prefill_chunk,
                            num_speculative_tokens=cfg.num_speculative_tokens, num_blocks=cfg.num_blocks,
                            block_size=block_size,
                            max_model_len=max_model_len or model.config.max_position_embeddings)
    eos = eos_token_ids or ((model.config.eos_token_id,) if model.config.eos_token_id is not None else ())
    return EngineCore(EngineConfig(sched, overlap=enable_overlap, eos_token_ids=eos, seed=seed,
                                   kv_lease_s=kv_lease_s),
                      make_runner(model, cfg))


def runner_config(model: MiMoForCausalLM, k: int, max_num_seqs: int, block_size: int, num_kv_blocks: int,
                  kv_cache_mb: int) -> ModelRunnerConfig:
    """The device side's shape; every tensor-parallel rank derives the same block count from it."""
    if k and model.num_mtp_layers == 0:
        k = 0  # NOTE: a plain Qwen2 checkpoint has nothing to draft with
    blocks = num_kv_blocks or kv_blocks_for_budget(model, block_size, k, kv_cache_mb)
    return ModelRunnerConfig(max_num_seqs=max_num_seqs, num_blocks=blocks, block_size=block_size,
                             num_speculative_tokens=k)

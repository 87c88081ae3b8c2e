"""Assemble an EngineCore around a loaded model from the configuration's own sections.

The `engine` and `speculative` sections of mtpserve.config are passed through as they are (their
defaults are declared once, in config/schema.py): the scheduler's limits, the KV cache's size, the
overlap switch and the seed come from `engine`, the draft length from `speculative`. EOS ids come
from the model config unless given.
"""

from __future__ import annotations

from collections.abc import Callable

from mtpserve.config import EngineConfig, SpeculativeConfig
from mtpserve.engine import prefix_cache
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.kv_connector import KVConnector
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner, kv_blocks_for_budget
from mtpserve.engine.runner import ModelRunner
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.serving_model import ServingModel

RunnerFactory = Callable[[ServingModel, ModelRunnerConfig], ModelRunner]


def build_model_engine(model: ServingModel, engine: EngineConfig = EngineConfig(),
                       speculative: SpeculativeConfig = SpeculativeConfig(), *,
                       eos_token_ids: tuple[int, ...] = (), connector: KVConnector | None = None,
                       make_runner: RunnerFactory = PaddleModelRunner) -> EngineCore:
    """`make_runner` builds the device side (the tensor-parallel leader passes its own)."""
    cfg = runner_config(model, engine, speculative)
    return EngineCore(core_config(model, engine, cfg, speculative, eos_token_ids), make_runner(model, cfg),
                      connector)


def core_config(model: ServingModel, engine: EngineConfig, runner: ModelRunnerConfig,
                speculative: SpeculativeConfig, eos_token_ids: tuple[int, ...] = ()) -> CoreConfig:
    sched = SchedulerConfig(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                            max_prefill_chunk=engine.max_prefill_chunk,
                            max_prefill_tokens_decoding=engine.max_prefill_tokens_decoding,
                            num_speculative_tokens=runner.num_speculative_tokens, num_blocks=runner.num_blocks,
                            block_size=engine.block_size,
                            max_model_len=engine.max_model_len or model.config.max_position_embeddings,
                            enable_prefix_caching=engine.enable_prefix_caching,
                            prompt_window=speculative.prompt_window if runner.num_speculative_tokens else 0,
                            cache_salt=prefix_cache.salt(engine.model, engine.dtype, runner.kv_dtype,
                                                         runner.block_size))
    eos = eos_token_ids or ((model.config.eos_token_id,) if model.config.eos_token_id is not None else ())
    return CoreConfig(sched, overlap=engine.enable_overlap, eos_token_ids=eos, seed=engine.seed,
                      adaptive_speculation=speculative.adaptive)


def runner_config(model: ServingModel, engine: EngineConfig, speculative: SpeculativeConfig) -> ModelRunnerConfig:
    """The device side's shape; every tensor-parallel rank derives the same block count from it."""
    k = speculative.num_speculative_tokens
    if k and model.num_mtp_layers == 0:
        k = 0  # NOTE: a plain Qwen2 checkpoint has nothing to draft with
    kv_dtype = kv_cache_dtype(engine)
    blocks = engine.num_kv_blocks or kv_blocks_for_budget(model, engine.block_size, k, engine.kv_cache_mb,
                                                          KV_DTYPE_BYTES[kv_dtype])
    return ModelRunnerConfig(max_num_seqs=engine.max_num_seqs, num_blocks=blocks, block_size=engine.block_size,
                             num_speculative_tokens=k, kv_dtype=kv_dtype)


KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_cache_dtype(engine: EngineConfig) -> str:
    """The KV cache's dtype: `kv_cache_dtype`, or the compute dtype for auto."""
    return engine.dtype if engine.kv_cache_dtype == "auto" else engine.kv_cache_dtype

"""Draft weights in float16 (`speculative.draft_weight_dtype`): the MTP layers and the draft head are read
at half the bytes, and the output stays exactly what the float32 main model decides: greedy decoding with
float16 drafts equals decoding without drafts, and the drafts stay about as good as float32 ones."""

import paddle
import pytest

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model import small_matmul
from test_model_runner import drafty_model, greedy_requests, prompts, run

pytestmark = pytest.mark.skipif(not small_matmul.available(), reason="float16 panels are the CPU kernels' own")

PACKED = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4)  # NOTE: fused blocks


def make_core(model, k):
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=16, num_speculative_tokens=k,
                            num_blocks=256, block_size=8)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=8, num_blocks=256, block_size=8,
                                                        num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, adaptive_speculation=False), runner)


@pytest.fixture(scope="module")
def models():
    # NOTE: at these widths a damping of 0.5 leaves ~40% of drafts rejected: acceptance can move both ways
    full, half = drafty_model(scale=0.5, **PACKED), drafty_model(scale=0.5, **PACKED)
    half.set_draft_weight_dtype("float16")
    return full, half


def test_only_the_draft_weights_are_float16(models):
    _, half = models
    mtp = half.model.mtp_layers[0]
    assert mtp.self_attn.qkv.serving.panels.dtype == paddle.float16
    assert mtp.mlp.down_proj.serving.panels.dtype == paddle.float16
    assert mtp.tokens.hidden.panels.dtype == paddle.float16
    assert half.model.layers[0].mlp.gate_up.serving.panels.dtype == paddle.float32
    assert half.lm_head.serving.panels is None or half.lm_head.serving.panels.dtype == paddle.float32


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_float16_drafts_is_the_output_without_drafts(models, k):
    full, half = models
    texts = prompts(10, seed=11)
    plain = run(make_core(full, 0), greedy_requests(texts, 20), batch=1)
    assert run(make_core(half, k), greedy_requests(texts, 20), batch=1) == plain
    assert run(make_core(half, k), greedy_requests(texts, 20), batch=4) == plain


def test_float16_drafts_are_accepted_about_as_often(models):
    full, half = models
    texts = prompts(12, seed=12)

    def acceptance_length(model):
        core = make_core(model, 2)
        run(core, greedy_requests(texts, 24), batch=4)
        return core.acceptance.mean_acceptance_length

    with_full, with_half = acceptance_length(full), acceptance_length(half)
    assert 1.5 < with_full < 2.8, "the drafty model must draft well, and not perfectly, for this to mean anything"
    assert with_half >= 0.95 * with_full

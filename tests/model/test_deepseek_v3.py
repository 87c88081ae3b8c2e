"""DeepSeek-V3 against transformers' own DeepseekV3ForCausalLM (float32, CPU) and against an independent
NumPy forward of the report (tests/model/deepseek_reference.py), on a tiny random checkpoint written in
the released layout (tests/model/deepseek_fixtures.py): logits, greedy generation, MTP draft logits,
lossless speculation, and the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from deepseek_fixtures import TINY_V3, drafty_tensors, write_checkpoint
from deepseek_reference import main_model, mtp_depths
from family_harness import generate, hf_greedy, make_core, paged_logits, sampled_tokens, two_sample_chi2_pvalue
from family_harness import prompts as family_prompts
from safetensors.numpy import save_file

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.deepseek_model import DeepseekV3ForCausalLM
from mtpserve.model.loader import load_serving_model
from mtpserve.model.safetensors_reader import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)  # NOTE: the reference is tiny; more threads only contend with Paddle's

VOCAB = TINY_V3["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    directory = tmp_path_factory.mktemp("deepseek_v3")
    return directory, write_checkpoint(directory)


@pytest.fixture(scope="module")
def model(checkpoint) -> DeepseekV3ForCausalLM:
    loaded = load_serving_model(checkpoint[0])
    assert isinstance(loaded, DeepseekV3ForCausalLM)
    return loaded


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # transformers read every main tensor
    assert {k.split(".")[2] for k in info["unexpected_keys"]} == {"3"}  # and left only the MTP layer
    return hf.eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    return family_prompts(n, VOCAB, seed)


def hf_logits(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def test_logits_match_transformers_on_20_prompts(model, hf_model):
    texts = prompts(20)
    worst = max(float(np.abs(ours - hf_logits(hf_model, t)).max()) for ours, t in zip(paged_logits(model, texts), texts))
    assert worst < 1e-4, worst


def test_logits_match_the_numpy_reference(model, checkpoint):
    tokens = prompts(1, seed=5)[0]
    ref, _ = main_model(checkpoint[1], TINY_V3, np.array(tokens))
    ours = paged_logits(model, [tokens])[0]
    assert np.abs(ours - ref).max() < 1e-4


def test_greedy_64_tokens_match_transformers_generate(model, hf_model):
    texts = prompts(20, seed=1)
    ours = generate(make_core(model, k=0), texts, 64)
    for i, t in enumerate(texts):
        assert ours[f"r{i}"] == hf_greedy(hf_model, torch, t, 64), i


@pytest.fixture(scope="module")
def drafty_model(tmp_path_factory) -> DeepseekV3ForCausalLM:
    directory = tmp_path_factory.mktemp("drafty")
    write_checkpoint(directory, tensors=drafty_tensors())
    loaded = load_serving_model(directory)
    assert isinstance(loaded, DeepseekV3ForCausalLM)
    return loaded


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_is_lossless_with_drafts_accepted(drafty_model, k):
    texts = prompts(8, seed=2)
    core = make_core(drafty_model, k=k)
    spec = generate(core, texts, 24)
    assert min(core.acceptance.per_position_rate()) > 0.5  # the accept path runs, not only rejection
    assert spec == generate(make_core(drafty_model, k=0), texts, 24)


def test_sampled_outputs_keep_their_distribution_with_mtp(drafty_model):
    """Tokens 2..4 of 1200 seeded samples at temperature 0.3 with k = 2 (rejection sampling of the drafts)
    follow the distribution of plain sampling (two-sample chi-square)."""
    prompt = [5, 17, 42, 99, 3, 150, 64]
    plain, _ = sampled_tokens(drafty_model, 0, prompt, 1200)
    spec, rates = sampled_tokens(drafty_model, 2, prompt, 1200)
    assert rates[0] > 0.3, rates
    for col in (1, 2, 3):
        assert two_sample_chi2_pvalue(plain[:, col], spec[:, col], VOCAB) > 1e-4
    assert (plain != spec).any()  # different random paths, same distribution


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_is_lossless(model, k):
    texts = prompts(8, seed=2)
    assert generate(make_core(model, k=k), texts, 24) == generate(make_core(model, k=0), texts, 24)


def test_mtp_draft_logits_match_the_numpy_reference_at_depths_1_to_3(model, checkpoint):
    tokens = prompts(1, seed=3)[0] + prompts(1, seed=4)[0]
    n = len(tokens)
    ref = mtp_depths(checkpoint[1], TINY_V3, np.array(tokens), k=3)
    ids = paddle.to_tensor(np.array(tokens, np.int64))
    prev = model.run(ids, paddle.arange(n, dtype="int64"), DenseCausalContext(1, n)).mtp_hidden
    for depth in range(1, 4):
        length = n - depth
        positions = paddle.arange(length, dtype="int64")
        out = model.run_mtp(depth - 1, ids[depth:], prev[:length], positions, DenseCausalContext(1, length))
        ours = model.mtp_logits(out.hidden_states, depth - 1).numpy()
        assert np.abs(ours - ref[depth - 1]).max() < 1e-4, depth
        prev = out.mtp_hidden


def test_the_mtp_module_reads_its_own_embedding_and_head(checkpoint, tmp_path):
    """The MTP layer's embed_tokens and shared_head.head are its own tensors, not model.embed_tokens/lm_head."""
    tensors = dict(checkpoint[1])
    rng = np.random.default_rng(9)
    for name in ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"):
        tensors[name] = (0.5 / 8 * rng.standard_normal(tensors[name].shape)).astype(np.float32)  # 8 = sqrt(H)
    write_checkpoint(tmp_path, tensors=tensors)
    model = load_serving_model(tmp_path)
    assert isinstance(model, DeepseekV3ForCausalLM)
    tokens = prompts(1, seed=6)[0]
    ref = mtp_depths(tensors, TINY_V3, np.array(tokens), k=1)[0]
    n = len(tokens)
    ids = paddle.to_tensor(np.array(tokens, np.int64))
    prev = model.run(ids, paddle.arange(n, dtype="int64"), DenseCausalContext(1, n)).mtp_hidden
    out = model.run_mtp(0, ids[1:], prev[:n - 1], paddle.arange(n - 1, dtype="int64"), DenseCausalContext(1, n - 1))
    assert np.abs(model.mtp_logits(out.hidden_states).numpy() - ref).max() < 1e-4


def _rewrite(directory: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))


def test_loader_names_a_missing_tensor(checkpoint, tmp_path):
    tensors = {k: v for k, v in checkpoint[1].items() if k != "model.layers.3.eh_proj.weight"}
    _rewrite(tmp_path, tensors, TINY_V3)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.3.eh_proj.weight"):
        load_serving_model(tmp_path)


def test_loader_names_an_unexpected_tensor(checkpoint, tmp_path):
    tensors = {**checkpoint[1], "model.layers.1.mlp.experts.8.up_proj.weight": np.zeros((24, 64), np.float32)}
    _rewrite(tmp_path, tensors, TINY_V3)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): model.layers.1.mlp.experts.8.up_proj"):
        load_serving_model(tmp_path)


@pytest.mark.parametrize(("change", "named"), [
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling.original_max_position_embeddings"),
])
def test_config_errors_name_the_field(checkpoint, tmp_path, change, named):
    config = {**TINY_V3, **change}
    config = {k: v for k, v in config.items() if v is not None}
    _rewrite(tmp_path, checkpoint[1], config)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_serving_model(tmp_path)


def test_preflight_accepts_the_architecture(checkpoint):
    from mtpserve.preflight import _model_config

    _model_config(checkpoint[0])  # raises StartupError on an unsupported architecture


def test_a_bfloat16_checkpoint_loads_and_matches_transformers(checkpoint, tmp_path):
    """Released checkpoints are bf16: each tensor is widened as it is read (memory-mapped, never the
    whole file in float32), and the float32 compute equals transformers' on the same bf16 weights."""
    from safetensors.torch import save_file as save_torch

    (tmp_path / "config.json").write_text(json.dumps({**TINY_V3, "torch_dtype": "bfloat16"}))
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in checkpoint[1].items()},
               str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_serving_model(tmp_path)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    texts = prompts(4, seed=8)
    worst = max(float(np.abs(ours - hf_logits(hf, t)).max()) for ours, t in zip(paged_logits(model, texts), texts))
    assert worst < 1e-4, worst
    original = load_serving_model(checkpoint[0])  # the float32 original differs: the rounding is real
    assert max(float(np.abs(a - b).max()) for a, b in zip(paged_logits(original, texts), paged_logits(model, texts))) > 1e-4


def test_the_real_models_mla_widths_through_the_paged_kernel(tmp_path):
    """DeepSeek-V3's own latent widths (kv_lora_rank 512 + rope 64 = 576-wide cache rows, nope 128, v 128):
    two-chunk paged logits through the CPU kernel equal one dense causal pass."""
    from mtpserve.model.attention_context import paged_op_serves

    config = {**TINY_V3, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
              "q_lora_rank": 96}
    write_checkpoint(tmp_path, config)
    model = load_serving_model(tmp_path)
    kv = model.allocate_kv(config["num_hidden_layers"], 4, 8)
    assert list(kv.k[0].shape) == [40, 1, 576] and kv.v[0] is kv.k[0]
    assert paged_op_serves(kv)  # the in-place kernel, not the Paddle-op fallback
    texts = prompts(3, seed=1)
    for tokens, paged in zip(texts, paged_logits(model, texts)):
        n = len(tokens)
        out = model.run(paddle.to_tensor(np.array(tokens, np.int64)), paddle.arange(n, dtype="int64"),
                        DenseCausalContext(1, n))
        assert np.abs(model.compute_logits(out.hidden_states).numpy() - paged).max() < 1e-4

"""ERNIE-4.5 MoE against transformers' own Ernie4_5_MoeForCausalLM (float32, CPU) and against an independent
NumPy forward (tests/model/ernie_reference.py), on a tiny random checkpoint written in the "-PT" release's
layout (tests/model/ernie_fixtures.py): logits, greedy generation, MTP draft logits, lossless
speculation, and the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from ernie_fixtures import TINY_ERNIE, drafty_tensors, write_checkpoint
from ernie_reference import main_model, mtp_depths
from family_harness import (generate, hf_greedy, make_core, paged_logits, prompts, sampled_tokens,
                            two_sample_chi2_pvalue)
from safetensors.numpy import save_file

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.ernie_model import Ernie4_5_MoeForCausalLM
from mtpserve.model.loader import load_serving_model
from mtpserve.model.safetensors_reader import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)  # NOTE: the reference is tiny; more threads only contend with Paddle's

VOCAB = TINY_ERNIE["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    directory = tmp_path_factory.mktemp("ernie")
    return directory, write_checkpoint(directory)


@pytest.fixture(scope="module")
def model(checkpoint) -> Ernie4_5_MoeForCausalLM:
    loaded = load_serving_model(checkpoint[0])
    assert isinstance(loaded, Ernie4_5_MoeForCausalLM)
    return loaded


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    hf, info = transformers.Ernie4_5_MoeForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # transformers read every main tensor
    return hf.eval()


def hf_logits(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def test_logits_match_transformers_on_20_prompts(model, hf_model):
    texts = prompts(20, VOCAB)
    worst = max(float(np.abs(ours - hf_logits(hf_model, t)).max()) for ours, t in zip(paged_logits(model, texts), texts))
    assert worst < 1e-4, worst


def test_logits_match_the_numpy_reference(model, checkpoint):
    tokens = prompts(1, VOCAB, seed=5)[0]
    ref, _ = main_model(checkpoint[1], TINY_ERNIE, np.array(tokens))
    assert np.abs(paged_logits(model, [tokens])[0] - ref).max() < 1e-4


def test_greedy_64_tokens_match_transformers_generate(model, hf_model):
    texts = prompts(20, VOCAB, seed=1)
    ours = generate(make_core(model, k=0), texts, 64)
    for i, t in enumerate(texts):
        assert ours[f"r{i}"] == hf_greedy(hf_model, torch, t, 64), i


@pytest.fixture(scope="module")
def drafty_model(tmp_path_factory) -> Ernie4_5_MoeForCausalLM:
    directory = tmp_path_factory.mktemp("drafty")
    write_checkpoint(directory, tensors=drafty_tensors())
    loaded = load_serving_model(directory)
    assert isinstance(loaded, Ernie4_5_MoeForCausalLM)
    return loaded


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_is_lossless_with_drafts_accepted(drafty_model, k):
    texts = prompts(8, VOCAB, seed=2)
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
    texts = prompts(8, VOCAB, seed=2)
    assert generate(make_core(model, k=k), texts, 24) == generate(make_core(model, k=0), texts, 24)


def test_mtp_draft_logits_match_the_numpy_reference_at_depths_1_to_3(model, checkpoint):
    tokens = prompts(1, VOCAB, seed=3)[0] + prompts(1, VOCAB, seed=4)[0]
    n = len(tokens)
    ref = mtp_depths(checkpoint[1], TINY_ERNIE, np.array(tokens), k=3)
    ids = paddle.to_tensor(np.array(tokens, np.int64))
    prev = model.run(ids, paddle.arange(n, dtype="int64"), DenseCausalContext(1, n)).mtp_hidden
    for depth in range(1, 4):
        length = n - depth
        out = model.run_mtp(depth - 1, ids[depth:], prev[:length], paddle.arange(length, dtype="int64"),
                            DenseCausalContext(1, length))
        assert np.abs(model.mtp_logits(out.hidden_states).numpy() - ref[depth - 1]).max() < 1e-4, depth
        prev = out.mtp_hidden


def _rewrite(directory: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))


def test_loader_names_a_missing_mtp_tensor(checkpoint, tmp_path):
    tensors = {k: v for k, v in checkpoint[1].items() if k != "model.mtp_linear_proj.0.weight"}
    _rewrite(tmp_path, tensors, TINY_ERNIE)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.mtp_linear_proj.0.weight"):
        load_serving_model(tmp_path)


def test_loader_names_an_unexpected_tensor(checkpoint, tmp_path):
    tensors = {**checkpoint[1], "model.mtp_block.0.mlp.experts.0.up_proj.weight": np.zeros((24, 64), np.float32)}
    _rewrite(tmp_path, tensors, TINY_ERNIE)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): model.mtp_block.0.mlp.experts.0.up_proj"):
        load_serving_model(tmp_path)


def paddle_release(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Paddle release's layout of "-PT" tensors (the facts in daemon/model/ernie_paddle.py, applied in
    the other direction): ernie.* names, [in, out] linears, fused [q|k|v] and [gate|up]."""
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        paddle_name = "ernie." + name[len("model."):] if name.startswith("model.") else name
        if name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # fused with their q_proj / gate_proj below
        if name.endswith("q_proj.weight"):
            stem = name[:-len("q_proj.weight")]
            fused = [tensors[stem + p].T for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")]
            out[paddle_name.replace("q_proj", "qkv_proj")] = np.ascontiguousarray(np.concatenate(fused, axis=1))
        elif name.endswith("gate_proj.weight"):
            stem = name[:-len("gate_proj.weight")]
            out[paddle_name.replace("gate_proj", "up_gate_proj")] = np.ascontiguousarray(np.concatenate(
                [w.T, tensors[stem + "up_proj.weight"].T], axis=1))
        elif w.ndim == 2 and not name.endswith(("embed_tokens.weight", "e_score_correction_bias")):
            out[paddle_name] = np.ascontiguousarray(w.T)
        else:
            out[paddle_name] = w
    return out


def test_the_paddle_release_layout_loads_as_the_same_model(model, checkpoint, tmp_path):
    tensors = paddle_release(checkpoint[1])
    assert "ernie.mtp_linear_proj.0.weight" in tensors and tensors["ernie.mtp_linear_proj.0.weight"].shape == (128, 64)
    assert "ernie.layers.1.mlp.experts.0.up_gate_proj.weight" in tensors and "lm_head.weight" in tensors
    _rewrite(tmp_path, tensors, TINY_ERNIE)
    paddle_model = load_serving_model(tmp_path)
    assert isinstance(paddle_model, Ernie4_5_MoeForCausalLM)
    for (name, a), b in zip(sorted(model.state_dict().items()), [v for _, v in sorted(paddle_model.state_dict().items())]):
        assert np.array_equal(a.numpy(), b.numpy()), name


def test_a_checkpoint_mixing_both_layouts_is_refused(checkpoint, tmp_path):
    tensors = {**checkpoint[1], "ernie.mtp_linear_proj.0.weight": np.zeros((128, 64), np.float32)}
    _rewrite(tmp_path, tensors, TINY_ERNIE)
    with pytest.raises(CheckpointError, match=r"mixes the Paddle .* ernie.mtp_linear_proj.0.weight"):
        load_serving_model(tmp_path)


@pytest.mark.parametrize(("change", "named"), [
    ({"moe_k": None}, "moe_k"),
    ({"use_bias": True}, "use_bias"),
    ({"moe_layer_start_index": [1, 1]}, "moe_layer_start_index"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling"),
])
def test_config_errors_name_the_field(checkpoint, tmp_path, change, named):
    config = {k: v for k, v in {**TINY_ERNIE, **change}.items() if v is not None}
    _rewrite(tmp_path, checkpoint[1], config)
    with pytest.raises(ValueError, match=named):
        load_serving_model(tmp_path)


def test_preflight_accepts_the_architecture(checkpoint):
    from mtpserve.preflight import _model_config

    _model_config(checkpoint[0])

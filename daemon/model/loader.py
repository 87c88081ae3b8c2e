"""Load a Hugging Face-style model directory into a ready Paddle model.

1. read `config.json` (fails on an unsupported `architectures` entry);
2. check that the tokenizer (if present) fits the model's vocabulary;
3. build the model for this tensor-parallel rank and copy the safetensors weights in;
4. restrict MTP drafts to `draft_vocab.json`'s tokens when the directory has one (optional);
5. switch to eval mode.
"""

from __future__ import annotations

from pathlib import Path

import paddle

from mtpserve.model.checkpoint import AnyModel, load_weights
from mtpserve.model.config import AnyModelConfig, ModelConfig, UnsupportedArchitectureError, model_config_from_file
from mtpserve.model.deepseek_model import DeepseekV3ForCausalLM
from mtpserve.model.draft_vocab import read_draft_vocab
from mtpserve.model.ernie_config import ErnieMoeConfig
from mtpserve.model.ernie_model import Ernie4_5_MoeForCausalLM
from mtpserve.model.mimo_model import MiMoForCausalLM
from mtpserve.model.serving_model import ServingModel
from mtpserve.model.parallel import SINGLE, TensorParallel
from mtpserve.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


def load_model(model_dir: str | Path, tp: TensorParallel = SINGLE,
               draft_vocab: bool = True) -> MiMoForCausalLM:
    """A MiMo/Qwen2 directory (what the tools that train or measure the bundled model read)."""
    model = load_serving_model(model_dir, tp, draft_vocab)
    if not isinstance(model, MiMoForCausalLM):
        raise UnsupportedArchitectureError(f"{model_dir}: a MiMo/Qwen2 checkpoint is needed here, "
                                           f"not {model.config.architecture}")
    return model


def load_serving_model(model_dir: str | Path, tp: TensorParallel = SINGLE,
                       draft_vocab: bool = True, draft_weight_dtype: str = "float32") -> ServingModel:
    """Any supported architecture (config.json's `architectures`). draft_vocab=False ignores the
    directory's draft_vocab.json (drafts over the full vocabulary; MiMo/Qwen2 only); draft_weight_dtype
    is the packed dtype of the weights that only draft (ServingModelLayer.set_draft_weight_dtype)."""
    model_dir = Path(model_dir)
    config = model_config_from_file(model_dir / "config.json")
    if (model_dir / "tokenizer.json").exists():
        Tokenizer.from_model_dir(model_dir).check_vocab(config.vocab_size)
    with paddle.no_grad():
        model = _model_class(config, tp)
        load_weights(model, model_dir)
        if draft_vocab and isinstance(model, MiMoForCausalLM):
            model.set_draft_vocab(read_draft_vocab(model_dir, config.vocab_size))
        model.set_draft_weight_dtype(draft_weight_dtype)
    model.eval()
    return model


def _model_class(config: AnyModelConfig, tp: TensorParallel) -> AnyModel:
    if isinstance(config, ModelConfig):
        return MiMoForCausalLM(config, tp)
    if isinstance(config, ErnieMoeConfig):
        return Ernie4_5_MoeForCausalLM(config, tp)
    return DeepseekV3ForCausalLM(config, tp)

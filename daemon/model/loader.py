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

from mtpserve.model.checkpoint import load_weights
from mtpserve.model.config import ModelConfig
from mtpserve.model.draft_vocab import read_draft_vocab
from mtpserve.model.mimo_model import MiMoForCausalLM
from mtpserve.model.parallel import SINGLE, TensorParallel
from mtpserve.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


def load_model(model_dir: str | Path, tp: TensorParallel = SINGLE,
               draft_vocab: bool = True) -> MiMoForCausalLM:
    """draft_vocab=False ignores the directory's draft_vocab.json (drafts over the full vocabulary)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    if (model_dir / "tokenizer.json").exists():
        Tokenizer.from_model_dir(model_dir).check_vocab(config.vocab_size)
    with paddle.no_grad():
        model = MiMoForCausalLM(config, tp)
        load_weights(model, model_dir)
        if draft_vocab:
            model.set_draft_vocab(read_draft_vocab(model_dir, config.vocab_size))
    model.eval()
    return model

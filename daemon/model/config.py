"""The model's hyper-parameters, read from a Hugging Face-style `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mtpserve.model import deepseek_config, ernie_config
from mtpserve.model.deepseek_config import DeepseekV3Config
from mtpserve.model.ernie_config import ErnieMoeConfig

# NOTE: MiMo checkpoints name themselves MiMoForCausalLM; a plain Qwen2 checkpoint is the same decoder
# with no MTP layers, so both load through one model class.
MIMO_ARCHITECTURES = ("MiMoForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ARCHITECTURES = (*MIMO_ARCHITECTURES, deepseek_config.ARCHITECTURE, ernie_config.ARCHITECTURE)


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture this model class cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = True
    num_nextn_predict_layers: int = 0
    # NOTE: MTP conventions, declared by the checkpoint (docs/models.md). The defaults are what the peers
    # do with real MiMo checkpoints (vLLM: the drafter reads the target's hidden before model.norm, and
    # the token embedding at position 0 is zeroed); the bundled model's config.json states its own.
    mtp_hidden_after_norm: bool = False
    mtp_zero_position_zero: bool = True
    architecture: str = "MiMoForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _single_architecture(raw)
        if architecture not in MIMO_ARCHITECTURES:
            raise UnsupportedArchitectureError(f"{architecture} is not a MiMo/Qwen2 checkpoint")
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in raw.items() if k in names}
        known["architecture"] = architecture
        known.setdefault("attention_bias", True)  # Qwen2 always carries q/k/v bias
        config = cls(**known)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["architectures"] = [out.pop("architecture")]
        out["model_type"] = "mimo" if self.architecture == "MiMoForCausalLM" else "qwen2"
        out["head_dim"] = self.head_dim
        return out

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers must be >= 0")


def _single_architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architectures {names!r} in config.json; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return names[0]


AnyModelConfig = ModelConfig | DeepseekV3Config | ErnieMoeConfig


def model_config_from_dict(raw: dict[str, Any]) -> AnyModelConfig:
    """The config class of the checkpoint's architecture (one `architectures` entry)."""
    architecture = _single_architecture(raw)
    if architecture == deepseek_config.ARCHITECTURE:
        return DeepseekV3Config.from_dict(raw)
    if architecture == ernie_config.ARCHITECTURE:
        return ErnieMoeConfig.from_dict(raw)
    return ModelConfig.from_dict(raw)


def model_config_from_file(path: Path) -> AnyModelConfig:
    return model_config_from_dict(json.loads(Path(path).read_text()))

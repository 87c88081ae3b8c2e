"""ERNIE-4.5 MoE's hyper-parameters (`Ernie4_5_MoeForCausalLM`), read from the Hugging Face ("-PT")
release's `config.json` under its field names (moe_num_experts, moe_k, moe_layer_start_index, ...)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mtpserve.model.deepseek_config import ConfigFieldError

ARCHITECTURE = "Ernie4_5_MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class ErnieMoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    moe_intermediate_size: int
    moe_num_experts: int
    moe_k: int
    moe_num_shared_experts: int = 0
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # -1: the last layer
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    head_dim_field: int | None = None  # config.json's `head_dim` when it states one
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = True
    use_bias: bool = False
    # NOTE: mtpserve's own fields, FastDeploy's conventions (Baidu's server for these checkpoints):
    # the MTP block reads the main model's hidden after model.norm, its output goes through model.norm
    # to the shared lm_head, and that normed output is the next depth's input; no position-0 zeroing.
    mtp_hidden_after_norm: bool = True
    mtp_zero_position_zero: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = ARCHITECTURE

    @property
    def head_dim(self) -> int:
        return self.head_dim_field or self.hidden_size // self.num_attention_heads

    @property
    def attention_bias(self) -> bool:
        return False

    def is_moe_layer(self, index: int) -> bool:
        """ERNIE's rule: MoE at layers start..end (inclusive) where (index + 1) % interval == 0."""
        end = self.num_hidden_layers - 1 if self.moe_layer_end_index == -1 else self.moe_layer_end_index
        return (index + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= index <= end

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ErnieMoeConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"architecture", "head_dim_field"}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name in names]
        missing = [n for n in required if raw.get(n) is None]
        if missing:
            raise ConfigFieldError(f"config.json lacks field(s) {', '.join(missing)} ({ARCHITECTURE})")
        for field in ("moe_layer_start_index", "moe_layer_end_index"):
            if isinstance(raw.get(field), list):
                raise ConfigFieldError(f"config.json field {field} is a list (a multimodal ERNIE); "
                                       f"{ARCHITECTURE} takes one index")
        if raw.get("rope_scaling"):
            raise ConfigFieldError(f"config.json field rope_scaling is not supported ({ARCHITECTURE}: plain rope)")
        known = {k: v for k, v in raw.items() if k in names and v is not None}
        if "rope_theta" not in known and isinstance(raw.get("rope_parameters"), dict):
            known["rope_theta"] = raw["rope_parameters"].get("rope_theta", cls.rope_theta)
        if isinstance(known.get("eos_token_id"), list):
            known["eos_token_id"] = known["eos_token_id"][0]
        config = cls(**known, head_dim_field=raw.get("head_dim"))
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["architectures"] = [out.pop("architecture")]
        out["model_type"] = "ernie4_5_moe"
        out["hidden_act"] = "silu"
        out["head_dim"] = out.pop("head_dim_field") or self.head_dim
        return out

    def validate(self) -> None:
        checks = [
            (not self.use_bias, "use_bias=true is not supported (the released ERNIE-4.5 MoE models have none)"),
            (self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads"),
            (self.head_dim % 2 == 0, "head_dim must be even"),
            (0 < self.moe_k <= self.moe_num_experts, "moe_k must be in 1..moe_num_experts"),
            (self.moe_layer_interval >= 1, "moe_layer_interval must be >= 1"),
            (self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigFieldError(f"config.json: {message}")

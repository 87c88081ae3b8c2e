"""DeepSeek-V3's hyper-parameters, read from its Hugging Face `config.json` under the real field names.

Only the fields the forward reads are kept; the rest of a real config.json (quantization_config,
auto_map, ...) is ignored. A field that changes the arithmetic and that this model does not implement
stops the load with a message naming it (`topk_method` other than "noaux_tc", `scoring_func` other
than "sigmoid", a rope type other than YaRN or none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ARCHITECTURE = "DeepseekV3ForCausalLM"


class ConfigFieldError(ValueError):
    """A config.json field is missing or has a value this model cannot run; the message names it."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """config.json's `rope_scaling` with `"type": "yarn"` (DeepSeek-V3: factor 40 over 4096 positions)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def mscale_of(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's attention factor, folded into cos/sin (1.0 for DeepSeek-V3: mscale == mscale_all_dim)."""
        if self.mscale and self.mscale_all_dim:
            return self.mscale_of(self.factor, self.mscale) / self.mscale_of(self.factor, self.mscale_all_dim)
        return self.mscale_of(self.factor, 1.0)

    @property
    def softmax_factor(self) -> float:
        """The factor on the softmax scale: mscale(factor, mscale_all_dim) squared (0 -> 1)."""
        m = self.mscale_of(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
        return m * m


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # NOTE: mtpserve's own fields, the MTP conventions of the peers that serve real checkpoints (vLLM,
    # SGLang); docs/models.md says why. Depth 1 reads the main model's hidden after its final norm
    # (what their target models return), and the token embedding at position 0 is zeroed (vLLM).
    mtp_hidden_after_norm: bool = True
    mtp_zero_position_zero: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = ARCHITECTURE

    # NOTE: the engine's KV sizing reads these two: MLA caches one "head" per token, the latent and the
    # rope key side by side (docs/models.md).
    @property
    def num_key_value_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        return scale * self.rope_scaling.softmax_factor if self.rope_scaling else scale

    def is_moe_layer(self, index: int) -> bool:
        """DeepSeek's rule: MoE from layer `first_k_dense_replace` on, every `moe_layer_freq`-th."""
        return index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV3Config:
        _check_methods(raw)
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "architecture"}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name in names]
        missing = [n for n in required if n not in raw]
        if missing:
            raise ConfigFieldError(f"config.json lacks field(s) {', '.join(missing)} ({ARCHITECTURE})")
        known = {k: v for k, v in raw.items() if k in names}
        if isinstance(known.get("eos_token_id"), list):
            known["eos_token_id"] = known["eos_token_id"][0]
        config = cls(**known, rope_scaling=_yarn(raw.get("rope_scaling")))
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["architectures"] = [out.pop("architecture")]
        out["model_type"] = "deepseek_v3"
        out["hidden_act"] = "silu"
        out["topk_method"], out["scoring_func"] = "noaux_tc", "sigmoid"
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        return out

    def validate(self) -> None:
        checks = [
            (self.n_routed_experts % self.n_group == 0, "n_routed_experts must be a multiple of n_group"),
            (0 < self.topk_group <= self.n_group, "topk_group must be in 1..n_group"),
            (self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group,
             "num_experts_per_tok must fit in the topk_group selected groups"),
            (self.n_routed_experts // self.n_group >= 2, "each expert group needs 2 experts (group score = top-2 sum)"),
            (self.moe_layer_freq >= 1, "moe_layer_freq must be >= 1"),
            (self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0"),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even"),
            (not self.attention_bias, "attention_bias=true is not supported (DeepSeek-V3 has none)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigFieldError(f"config.json: {message}")


def _check_methods(raw: dict[str, Any]) -> None:
    for field, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("hidden_act", "silu")):
        if raw.get(field, supported) != supported:
            raise ConfigFieldError(f"config.json field {field}={raw[field]!r} is not supported "
                                   f"({ARCHITECTURE} supports {supported!r})")


def _yarn(raw: dict[str, Any] | None) -> YarnScaling | None:
    if not raw:
        return None
    kind = raw.get("type", raw.get("rope_type"))
    if kind != "yarn":
        raise ConfigFieldError(f"config.json field rope_scaling.type={kind!r} is not supported "
                               f"({ARCHITECTURE} supports 'yarn' or no rope_scaling)")
    for field in ("factor", "original_max_position_embeddings"):
        if field not in raw:
            raise ConfigFieldError(f"config.json lacks field rope_scaling.{field}")
    names = {f.name for f in dataclasses.fields(YarnScaling)}
    return YarnScaling(**{k: v for k, v in raw.items() if k in names and v is not None})

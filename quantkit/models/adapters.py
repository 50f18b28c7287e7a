"""Architecture adapters: name every module by role so passes never match module-name strings.

Roles per decoder block: `input_norm`, `qkv` (q, k, v), `o`, `post_attn_norm`, `gate_up` (gate, up), `down`, and
the `attention` and `mlp` submodules; every supported block is pre-norm: x + attention(norm(x)), then h + mlp(norm(h)).
Model-level roles: `embed`, `final_norm`, `lm_head`. Linears of one role share their input, so calibration
statistics (Hessians, activation ranges) are collected once per role.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.errors import QuantkitError

ROLES = ("qkv", "o", "gate_up", "down")


class UnsupportedArchitectureError(QuantkitError):
    """The checkpoint's architecture has no adapter."""


@dataclass(frozen=True)
class ArchAdapter:
    """Where each role lives in one family of Llama-like Hugging Face checkpoints."""

    model_type: str
    modeling_module: str
    decoder_layer: str
    rotary_embedding: str
    layers_prefix: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    input_norm: str = "input_layernorm"
    attention: str = "self_attn"
    post_attn_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    linears: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",),
            "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",),
        }
    )

    def layer_prefix(self, index: int) -> str:
        return f"{self.layers_prefix}.{index}."

    def linear_names(self, roles: tuple[str, ...] | list[str] = ROLES) -> list[tuple[str, str]]:
        """(role, module name relative to the block) for the given roles, in execution order."""
        return [(role, name) for role in ROLES if role in roles for name in self.linears[role]]

    @property
    def q_proj(self) -> str:
        return self.linears["qkv"][0]

    @property
    def k_proj(self) -> str:
        return self.linears["qkv"][1]

    @property
    def v_proj(self) -> str:
        return self.linears["qkv"][2]

    @property
    def gate_proj(self) -> str:
        return self.linears["gate_up"][0]

    @property
    def up_proj(self) -> str:
        return self.linears["gate_up"][1]

    def head_dims(self, config) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of the model's attention: the config's head_dim where it gives one
        (heads x head_dim may exceed the hidden size, as in Mistral Nemo), else hidden size / heads."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads

    def kv_channels(self, config) -> torch.Tensor:
        """For each query-side channel (a q_proj row, an o_proj input column), the KV-side channel (k_proj or
        v_proj row) it pairs with: grouped-query attention gives query head h the KV head h // (heads / KV heads),
        channel for channel within the head."""
        heads, kv, d = self.head_dims(config)
        channel = torch.arange(heads * d)
        return (channel // d) // (heads // kv) * d + channel % d

    @property
    def kv_projections(self) -> tuple[str, str]:
        """(k_proj, v_proj): where a pre-RoPE KV cache simulation quantizes keys and values."""
        return self.k_proj, self.v_proj

    @property
    def o_proj(self) -> str:
        return self.linears["o"][0]

    @property
    def down_proj(self) -> str:
        return self.linears["down"][0]

    def role_of(self, linear_name: str) -> str:
        for role, names in self.linears.items():
            if linear_name in names:
                return role
        raise KeyError(linear_name)

    def _modeling(self):
        return importlib.import_module(self.modeling_module)

    def decoder_layer_class(self) -> Callable[..., nn.Module]:
        return getattr(self._modeling(), self.decoder_layer)

    def rotary_embedding_class(self) -> Callable[..., nn.Module]:
        return getattr(self._modeling(), self.rotary_embedding)


ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter(
        "llama", "transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRotaryEmbedding"
    ),
    "mistral": ArchAdapter(
        "mistral", "transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRotaryEmbedding"
    ),
    "qwen2": ArchAdapter(
        "qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RotaryEmbedding"
    ),
}


def adapter_for(model_type: str, architectures: list[str] | None = None) -> ArchAdapter:
    """The adapter for a config's `model_type`, or an error naming the supported ones."""
    if model_type not in ADAPTERS:
        arch = f" ({', '.join(architectures)})" if architectures else ""
        raise UnsupportedArchitectureError(
            f"unsupported architecture: model_type {model_type!r}{arch}; quantkit supports "
            f"{', '.join(sorted(ADAPTERS))} (Llama 2/3, Mistral, Qwen2 families)"
        )
    return ADAPTERS[model_type]

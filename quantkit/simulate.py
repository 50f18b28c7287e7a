"""Runtime quantization simulation: dynamic per-token activations on quantized linears, and per-head KV cache.

Activations: a forward pre-hook fake-quantizes each quantized linear's input per token (vLLM's dynamic
scaled_int8_quant). KV cache: a registered transformers attention function fake-quantizes post-RoPE keys and
values per (token, KV head) before SDPA, which is where a quantized cache would store them; the same function
lets calibration passes observe post-RoPE keys (SmoothAttention). Both are attached
to a whole model (eval) or a single block (calibration), so recipes like W4A8KV4 share one engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from quantkit.quantizers import fake_quantize_per_token

ATTENTION_NAME = "quantkit_kv_sim"


@dataclass(frozen=True)
class ActivationSim:
    bits: int = 8
    symmetric: bool = True


@dataclass(frozen=True)
class KVSim:
    bits: int = 4
    symmetric: bool = False


def fake_quantize_kv(x: torch.Tensor, sim: KVSim) -> torch.Tensor:
    """Per-(token, head) fake quantization of K or V states [B, H, T, D] over the head dimension.

    Asymmetric uses the true [min, max] of each vector (no widening to include 0), as KV4 schemes do.
    """
    if sim.symmetric:
        return fake_quantize_per_token(x, sim.bits, symmetric=True)
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    levels = (1 << sim.bits) - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - lo) / scale).clamp(0, levels)
    return (q * scale + lo).to(x.dtype)


def _kv_sim_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    observer = getattr(module, "_quantkit_observer", None)
    if observer is not None:  # calibration statistics on the unquantized post-RoPE keys and values
        observer(key, value)
    sim: KVSim | None = getattr(module, "_quantkit_kv_sim", None)
    if sim is not None:
        key = fake_quantize_kv(key, sim)
        value = fake_quantize_kv(value, sim)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _kv_sim_attention)


def _act_hook(sim: ActivationSim):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (fake_quantize_per_token(args[0], sim.bits, sim.symmetric), *args[1:])

    return hook


def attach(
    blocks: list[nn.Module],
    linear_names: list[str],
    config,
    activations: ActivationSim | None,
    kv: KVSim | None,
) -> list:
    """Attach activation and KV simulation to decoder blocks; returns hook handles (remove() to detach)."""
    handles = []
    if activations is not None:
        for block in blocks:
            for name in linear_names:
                handles.append(block.get_submodule(name).register_forward_pre_hook(_act_hook(activations)))
    if kv is not None:
        config._attn_implementation = ATTENTION_NAME
        for block in blocks:
            block.self_attn._quantkit_kv_sim = kv
    return handles

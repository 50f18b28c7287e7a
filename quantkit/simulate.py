"""Runtime quantization simulation: dynamic per-token activations on quantized linears, and per-head KV cache.

Activations: a forward pre-hook fake-quantizes each quantized linear's input per token (vLLM's dynamic
scaled_int8_quant). KV cache: a registered transformers attention function fake-quantizes post-RoPE keys and
values per (token, KV head) before SDPA, which is where a quantized cache would store them; the same function
lets calibration passes observe post-RoPE keys (SmoothAttention). Both are attached
to a whole model (eval) or a single block (calibration), so recipes like W4A8KV4 share one engine.

Atom's variants: activations quantized per (token, group) along the linear's column order (the weights' g_idx:
groups of `group_size`, and the last `outliers` columns in INT8, unclipped), with a clip ratio; and keys quantized
before RoPE (`pre_rope`, as Atom's cache stores them), by hooks on the k_proj and v_proj outputs.

QServe's per-channel kernel moves the weight zero point to its epilogue with the *unquantized* activations: it
computes X_hat (q s)^T - t_X szero with t_X = sum_k x (paper Eq. 13), not X_hat W^T. A linear deployed with a
scaled zero (`LinearRuntime.szero`) therefore gets (sum x_hat - sum x) * szero added to its output.
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
    group_size: int | None = None  # per (token, group) instead of per token (Atom)
    outliers: int = 0  # the last columns of the linear's order, INT8 (Atom)
    clip_ratio: float = 1.0


@dataclass(frozen=True)
class KVSim:
    bits: int = 4
    symmetric: bool = False
    pre_rope: bool = False  # quantize keys before RoPE (Atom) instead of after (QServe)


@dataclass(frozen=True)
class LinearRuntime:
    """What a deployed linear's kernel does beyond multiplying by its dequantized weight."""

    g_idx: torch.Tensor | None = None  # column -> group map: grouped activations follow it (Atom)
    szero: torch.Tensor | None = None  # [N]: QServe per channel, the zero point applied to the unquantized sum

    def to(self, device: torch.device | str) -> LinearRuntime:
        """The same facts with their tensors on `device`."""
        return LinearRuntime(*(None if t is None else t.to(device) for t in (self.g_idx, self.szero)))


def runtime_of(q) -> LinearRuntime | None:
    """The runtime facts of a deployed QuantizedLinear, or None when it is a plain weight."""
    szero = q.qparams.szero.reshape(-1) if q.spec.zero_form == "scaled" and q.qparams.szero is not None else None
    return None if q.g_idx is None and szero is None else LinearRuntime(q.g_idx, szero)


def deployed(q, dtype: torch.dtype) -> tuple[torch.Tensor, LinearRuntime | None]:
    """The weight an engine reconstructs from an unpacked QuantizedLinear, in the model dtype, and what its kernel
    does beyond that weight. Calibration, --resume and eval all deploy through here, so they agree bit for bit."""
    return q.dequantize().to(dtype), runtime_of(q)


def sims_for(recipe) -> tuple[ActivationSim | None, KVSim | None]:
    """The activation and KV simulation a recipe asks for."""
    a, kv = recipe.activations, recipe.kv_cache
    act = ActivationSim(a.bits, a.symmetric, a.group_size, a.outliers, a.clip_ratio) if a else None
    return act, (KVSim(kv.bits, kv.symmetric, kv.rope == "pre") if kv else None)


def fake_quantize_activation(x: torch.Tensor, sim: ActivationSim, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic fake quantization of a linear's input x [..., K]: per token, or (with `group_size`) per token and
    group along `g_idx` (natural order when None), the last group holding the `outliers` in INT8."""
    if sim.group_size is None and not sim.outliers:
        return fake_quantize_per_token(x, sim.bits, sim.symmetric, sim.clip_ratio)
    k = x.shape[-1]
    kn = k - sim.outliers
    gs = sim.group_size or kn
    if kn % gs:
        raise ValueError(f"activation groups of {gs} do not divide the {kn} normal columns of a width-{k} input")
    order = torch.arange(k, device=x.device) if g_idx is None else torch.argsort(g_idx.to(x.device), stable=True)
    xp = x[..., order]
    normal = fake_quantize_per_token(xp[..., :kn].unflatten(-1, (kn // gs, gs)), sim.bits, sim.symmetric,
                                     sim.clip_ratio).flatten(-2)
    parts = [normal]
    if sim.outliers:
        parts.append(fake_quantize_per_token(xp[..., kn:], 8, True))
    out = torch.empty_like(x)
    out[..., order] = torch.cat(parts, dim=-1)
    return out


def fake_quantize_kv(x: torch.Tensor, sim: KVSim) -> torch.Tensor:
    """Per-(token, head) fake quantization of K or V states [B, H, T, D] over the head dimension, as a cache stores
    them: a float16 scale and zero per vector (QServe's KV4, digest P8).

    Asymmetric: scale = (max - min) / (2^bits - 1) and the fractional zero -(2^bits - 1) min / (max - min) over the
    vector's true [min, max] (no widening to include 0), each rounded to float16 once; q = round(x / scale + zero)
    clamped to the codes, x_hat = (q - zero) scale in float32, then rounded to x's dtype. Symmetric: the float16
    scale max|x| / (2^(bits-1) - 1). A vector those float16 parameters cannot describe (constant, or a scale or
    zero beyond float16's range) is kept as it is, where a kernel would divide by zero or overflow.
    """
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    if sim.symmetric:
        qmax = (1 << (sim.bits - 1)) - 1
        scale = torch.maximum(hi, -lo).div_(qmax).half().float()
        q = (xf / scale).round_().clamp_(-qmax - 1, qmax)
        return torch.where((scale > 0) & scale.isfinite(), q * scale, xf).to(x.dtype)
    levels = (1 << sim.bits) - 1
    span = hi - lo
    scale = (span / levels).half().float()
    zero = (lo * -levels / span).half().float()
    ok = (scale > 0) & scale.isfinite() & zero.isfinite()
    q = (xf / scale).add_(zero).round_().clamp_(0, levels)
    return torch.where(ok, (q - zero).mul_(scale), xf).to(x.dtype)


def _kv_sim_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    observer = getattr(module, "_quantkit_observer", None)
    if observer is not None:  # calibration statistics on the unquantized post-RoPE keys and values
        observer(key, value)
    sim: KVSim | None = getattr(module, "_quantkit_kv_sim", None)
    if sim is not None and not sim.pre_rope:
        key = fake_quantize_kv(key, sim)
        value = fake_quantize_kv(value, sim)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _kv_sim_attention)


def _act_hook(sim: ActivationSim, runtime: LinearRuntime | None):
    g_idx = runtime.g_idx if runtime else None
    track = runtime is not None and runtime.szero is not None

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        xq = fake_quantize_activation(x, sim, g_idx)
        if track:  # the epilogue's zero term sees sum(x), the GEMM's sees sum(x_hat)
            module._quantkit_sum_gap = xq.float().sum(-1) - x.float().sum(-1)
        return (xq, *args[1:])

    return hook


def _zero_hook(szero: torch.Tensor):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        gap = module.__dict__.pop("_quantkit_sum_gap")
        return (out.float() + gap[..., None] * szero.to(out.device)).to(out.dtype)

    return hook


def _kv_hook(sim: KVSim, head_dim: int):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        heads = out.unflatten(-1, (out.shape[-1] // head_dim, head_dim))
        return fake_quantize_kv(heads, sim).flatten(-2)

    return hook


def attach(
    blocks: list[nn.Module],
    linear_names: list[str],
    config,
    activations: ActivationSim | None,
    kv: KVSim | None,
    runtime: list[dict[str, LinearRuntime]] | None = None,
    adapter=None,
) -> list:
    """Attach activation and KV simulation to decoder blocks; returns hook handles (remove() to detach).
    `runtime[i][name]` says how linear `name` of block i runs beyond its weight (grouped activations, QServe's
    epilogue zero point); `adapter` (the model's ArchAdapter) names the attention module and the k and v
    projections, which the KV simulation needs."""
    handles = []
    if activations is not None:
        for i, block in enumerate(blocks):
            for name in linear_names:
                info = runtime[i].get(name) if runtime else None
                module = block.get_submodule(name)
                handles.append(module.register_forward_pre_hook(_act_hook(activations, info)))
                if info is not None and info.szero is not None:
                    handles.append(module.register_forward_hook(_zero_hook(info.szero)))
    if kv is not None:
        if adapter is None:
            raise ValueError("KV simulation needs the model's adapter: its attention module and k and v projections")
        config._attn_implementation = ATTENTION_NAME
        for block in blocks:
            block.get_submodule(adapter.attention)._quantkit_kv_sim = kv
        if kv.pre_rope:
            head_dim = adapter.head_dims(config)[2]
            for block in blocks:
                for name in adapter.kv_projections:
                    handles.append(block.get_submodule(name).register_forward_hook(_kv_hook(kv, head_dim)))
    return handles

"""QServe W4A8 checkpoints, as loaded by OmniServe and SGLang (`quant_method: qoq`); see shared/formats.md.

Tensors per linear `<m>`, named relative to the module (`qweight`, not `weight.qweight`); a bias passes through
unchanged as `<m>.bias`. Codes are stored unsigned, q_u = q + 8 in 0..15 (q the signed code in [-8, 7]).

- Per channel (`group_size: -1`; 4-bit asymmetric, granularity "channel", zero_form "scaled"):
  `qweight` int8 [N, K/2]: q_u in QServe's compute-aware 32x32-tile order (`qserve_layout.pack_qweight`: nibbles
  pair output channels n and n+16 at the same k; never slice along K);
  `s1_scales` fp16 [N]: the channel scale s; `s1_szeros` fp16 [N]: the scaled zero fp16((z + 8) * s), both in
  natural channel order. Dequantization: w = q_u * s1_scales - s1_szeros.
- Progressive group (QoQ, `group_size: g`; 4-bit `progressive`, granularity "group"):
  `qweight` as above; `s1_scales` fp16 [N]: the level-1 scale s1 (natural order);
  `s2_scales` int8 [K/g, N]: the integer level-2 scale s2 (1..127); `s2_zeros` int8 [K/g, N]: -(z_u * s2) with the
  UINT4 zero z_u = z + 8. Both s2 tensors are group-major, and inside every 32-channel tile position p holds
  channel 8*(p % 4) + p // 4 (`qserve_layout.pack_group_params`). Dequantization:
  w = int8(q_u * s2 + s2_zeros) * s1, which `pack` guarantees never wraps: it refuses codes whose
  (q_u - z_u) * s2 leaves [-128, 127].

Requirements: fp16 models (QServe asserts it), N and K multiples of 32, K a multiple of g, natural group order
(no g_idx), protective range <= 119 (larger ones can push z_u * s2 past the 128 that int8 `s2_zeros` holds).
QServe's kernels take g = 128 only, and N and K multiples of 128; other group sizes and shapes are exported for
quantkit's kernels and simulation, and the manifest notes that no engine runs them.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from quantkit.formats.base import ExportError, Packer, stored_exactly
from quantkit.formats.qserve_layout import (
    TILE,
    pack_group_params,
    pack_qweight,
    unpack_group_params,
    unpack_qweight,
)
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

TENSORS = frozenset({"qweight", "s1_scales", "s1_szeros", "s2_scales", "s2_zeros"})
KERNEL_GROUP_SIZES = (-1, 128)
# OmniServe's and SGLang's QServe kernels launch N / CTA_N blocks with no bounds check and step K by CTA_K, both up
# to 128 (digest-qserve §6.19); quantkit's own kernels need only the 32x32 tiles
ENGINE_TILE = 128
OFFSET = 8  # signed 4-bit code + 8 = the UINT4 code QServe stores

Variant = Literal["channel", "group"]


def _describe(spec: QuantSpec) -> str:
    """The spec fields that decide whether QServe can store it."""
    return (f"bits={spec.bits}, symmetric={spec.symmetric}, granularity={spec.granularity}, "
            f"zero_form={spec.zero_form}, progressive={spec.progressive}, level2={spec.level2}")


def variant(spec: QuantSpec) -> Variant | None:
    """Which QServe weight variant stores `spec`: "channel", "group", or None when neither can."""
    if spec.bits != 4 or spec.symmetric:
        return None
    if spec.granularity == "channel" and spec.zero_form == "scaled" and not spec.progressive:
        return "channel"
    if spec.granularity == "group" and spec.progressive and spec.level2 == "qoq":
        return "group"
    return None


def _require_variant(spec: QuantSpec, where: str) -> Variant:
    """`variant(spec)`, or ExportError naming what qserve needs."""
    v = variant(spec)
    if v is None:
        raise ExportError(
            f"{where}: qserve stores 4-bit asymmetric weights either per channel with zero_form 'scaled' "
            f"(W4A8 per-channel) or progressive per group (QoQ g128); got {_describe(spec)}"
        )
    return v


def qserve_group_size(spec: QuantSpec) -> int:
    """The `group_size` QServe/SGLang name for `spec`: -1 per channel, else the level-2 group size."""
    return -1 if _require_variant(spec, "qserve") == "channel" else spec.group_size


class QServePacker(Packer):
    name = "qserve"
    quant_method = "qoq"
    writes_lm_head = True  # OmniServe's LlamaForCausalLM has an lm_head of its own and never ties it
    float16_only = "QServe asserts it"

    def __init__(self, recipe: Any, dtype: torch.dtype):
        super().__init__(recipe, dtype)
        self.engine_unfit: dict[str, tuple[int, int]] = {}  # linears whose [N, K] the engines' tiles do not divide

    def owns(self, key: str) -> bool:
        """QServe's per-linear tensors are module-level: qweight, s1_scales, s1_szeros, s2_scales, s2_zeros."""
        return key in TENSORS

    def check_recipe(self) -> None:
        """QServe (OmniServe and SGLang's qoq path) asserts fp16 models, builds every linear as a W4A8 one and
        quantizes its input per token to INT8."""
        self.require_fp16()
        self.require_all_targets("OmniServe and SGLang's qoq method")
        self.require_int8_token_activations("OmniServe and SGLang's qoq method")
        kv = self.recipe.kv_cache
        if kv is not None and (problems := [text for bad, text in (
                (kv.bits not in (4, 8), f"bits {kv.bits}"), (kv.symmetric, "symmetric ones"),
                (kv.rope != "post", "keys quantized before RoPE")) if bad]):
            raise ExportError(
                "qserve: OmniServe quantizes the KV cache per (token, head) to asymmetric 4 or 8 bits, keys after "
                "RoPE, and SGLang keeps it in floating point, so the recipe must simulate one of those (kv_cache: "
                f"{{bits: 4, symmetric: false}}, or none); it has {', '.join(problems)}; use --set "
                "export.format=quantkit for a simulation-only artifact"
            )

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """A QServe variant spec, N and K multiples of 32, and (per group) K a multiple of the group size; shapes
        that only quantkit's kernels take (N or K not a multiple of 128) are recorded for `notes`."""
        v = _require_variant(spec, module)
        n, k = shape
        if n % TILE or k % TILE:
            raise ExportError(
                f"{module}: shape [N={n}, K={k}] does not fit qserve's 32x32 weight tiles (N and K must be multiples "
                "of 32); use --set export.format=quantkit for a simulation-only artifact"
            )
        if v == "group" and spec.protective_range > 119:
            raise ExportError(
                f"{module}: qserve needs protective_range <= 119 (QoQ's value); with {spec.protective_range} the "
                "scaled zero z*s2 can exceed 128 and no longer fit the int8 s2_zeros"
            )
        if v == "group" and k % spec.group_size:
            raise ExportError(f"{module}: group size {spec.group_size} does not divide input width {k}")
        if n % ENGINE_TILE or k % ENGINE_TILE:
            self.engine_unfit[module] = (n, k)

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """`qweight` and `s1_scales` plus `s1_szeros` (per channel) or `s2_scales` / `s2_zeros` (progressive group)."""
        spec, qp = q.spec, q.qparams
        v = _require_variant(spec, "qserve")
        if q.g_idx is not None:
            raise ExportError("qserve cannot store permuted groups (g_idx): use act-order off or static groups")
        codes = q.codes.detach().cpu()
        n, k = codes.shape
        if n % TILE or k % TILE:
            raise ExportError(f"qserve needs N and K multiples of 32, got [{n}, {k}]; use --set export.format=quantkit "
                              "for a simulation-only artifact")
        codes_u = codes.to(torch.int32) + OFFSET
        if codes.numel() and (int(codes_u.min()) < 0 or int(codes_u.max()) > 15):
            raise ExportError("qserve stores 4-bit codes: the signed codes leave [-8, 7]")
        out = {"qweight": pack_qweight(codes_u)}
        if v == "channel":
            if qp.szero is None or qp.code_offset != OFFSET:
                raise ExportError("qserve per-channel export needs the scaled zero (szero) with code offset 8; the "
                                  "quantized linear lacks it")
            out["s1_scales"] = stored_exactly(qp.scale.reshape(n), torch.float16, "qserve", "s1_scales").contiguous()
            out["s1_szeros"] = stored_exactly(qp.szero.reshape(n), torch.float16, "qserve", "s1_szeros").contiguous()
            return out
        if qp.s1 is None or qp.s2 is None or qp.zero is None:
            raise ExportError("qserve progressive export needs s1, s2 and the zero; the quantized linear lacks them")
        g = qp.group_size
        if g <= 0 or k % g or tuple(qp.s2.shape) != (n, k // g) or tuple(qp.zero.shape) != (n, k // g):
            raise ExportError(f"qserve: level-2 params of shape {tuple(qp.s2.shape)} do not match [{n}, {k}] with "
                              f"group size {g}")
        s1 = qp.s1.detach().cpu().float()
        s2f = qp.s2.detach().cpu().float()
        if not torch.equal(s2f, torch.round(s2f)) or (s2f.numel() and (float(s2f.min()) < 1 or float(s2f.max()) > 127)):
            raise ExportError("qserve stores the level-2 scale s2 as an int8 integer in 1..127")
        if not torch.equal(qp.scale.detach().cpu().float(), s1 * s2f):
            raise ExportError("qserve progressive export: scale must equal s1 * s2 exactly")
        s2 = s2f.to(torch.int32)
        z_u = qp.zero.detach().cpu().to(torch.int32) + OFFSET
        grouped = codes_u.to(torch.int16).reshape(n, k // g, g)
        w8 = (grouped - z_u.to(torch.int16)[..., None]) * s2.to(torch.int16)[..., None]
        if w8.numel() and (int(w8.min()) < -128 or int(w8.max()) > 127):
            raise ExportError(
                f"qserve: (q - z) * s2 reaches {int(w8.min())}..{int(w8.max())}, outside INT8 [-128, 127]; the "
                "kernel's per-byte add would wrap (codes ignore the progressive code bounds)"
            )
        try:
            s2_scales, s2_zeros = pack_group_params(s2, z_u)
        except ValueError as exc:
            raise ExportError(f"qserve: {exc}") from None
        out["s1_scales"] = stored_exactly(s1.reshape(n), torch.float16, "qserve", "s1_scales").contiguous()
        out["s2_scales"] = s2_scales
        out["s2_zeros"] = s2_zeros
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`: signed codes and the full QParams (zero, code bounds, protect, code offset)."""
        v = _require_variant(spec, "qserve")
        qweight = tensors["qweight"]
        n, k = qweight.shape[0], qweight.shape[1] * 2
        codes = (unpack_qweight(qweight).to(torch.int16) - OFFSET).to(torch.int8)
        s1 = tensors["s1_scales"].float().reshape(n, 1)
        if v == "channel":
            szero = tensors["s1_szeros"].float().reshape(n, 1)
            zero_u = torch.round(szero / s1).clamp(0, 15)
            # the integer zero is not stored; recover it when it reproduces the stored scaled zero exactly
            exact = torch.equal((zero_u * s1).to(torch.float16).float(), szero)
            zero = (zero_u - OFFSET).to(torch.int32) if exact else None
            qp = QParams(scale=s1, zero=zero, group_size=k, szero=szero, code_offset=OFFSET)
            return QuantizedLinear(codes, qp, spec)
        g = spec.group_size
        s2, scaled_zero = unpack_group_params(tensors["s2_scales"], tensors["s2_zeros"])
        if tuple(s2.shape) != (n, k // g) or k % g:
            raise ExportError(f"qserve: s2 tensors of shape {tuple(tensors['s2_scales'].shape)} do not match "
                              f"[K/g, N] = [{k // g}, {n}] for group size {g}")
        if bool((s2 < 1).any()) or bool((scaled_zero % s2).any()):
            raise ExportError("qserve: s2_zeros is not a negated multiple of a positive s2")
        z_u = scaled_zero // s2
        code_lo = torch.clamp(z_u - 128 // s2, min=0) - OFFSET
        code_hi = torch.clamp(z_u + 127 // s2, max=15) - OFFSET
        s2f = s2.float()
        qp = QParams(
            scale=s1 * s2f, zero=(z_u - OFFSET).to(torch.int32), group_size=g, s1=s1, s2=s2f,
            code_lo=code_lo.to(torch.int32), code_hi=code_hi.to(torch.int32), protect=spec.protective_range,
        )
        return QuantizedLinear(codes, qp, spec)

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        """SGLang's `qoq` entry: one weight variant for every linear, named by its group size (-1 per channel)."""
        sizes = {qserve_group_size(s) for s in specs.values()}
        if len(sizes) != 1:
            raise ExportError(f"qserve checkpoints use one weight variant for every linear; got group sizes "
                              f"{sorted(sizes)} (-1 = per channel)")
        (size,) = sizes
        return {"quant_method": self.quant_method, "wbits": 4, "group_size": size}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        """Group sizes and shapes no engine's QServe kernel runs, and OmniServe's norm handling."""
        out = [f"group size {g}: no engine loads it (QServe kernels take -1 or 128); simulation only"
               for g in sorted({qserve_group_size(s) for s in specs.values()} - set(KERNEL_GROUP_SIZES))]
        if self.engine_unfit:
            shapes = ", ".join(f"[{n}, {k}]" for n, k in sorted(set(self.engine_unfit.values())))
            out.append(f"{len(self.engine_unfit)} linears have N or K not a multiple of {ENGINE_TILE} ([N, K] = "
                       f"{shapes}): OmniServe's and SGLang's QServe kernels cannot run them (no bounds checks); "
                       "quantkit's kernels (validate, bench) can")
        if self.recipe.kv_cache is None:
            out.append("kv cache: the recipe simulates none, as SGLang serves it; OmniServe quantizes it to 4 or 8 "
                       "bits at run time, which quantkit eval did not measure (kv_cache: {bits: 4} would)")
        if not self._norms_are_ones():
            out.append("OmniServe's W4A8 loader ignores every '*norm*' tensor (uses ones), and this recipe leaves "
                       "norm weights other than one (no fold_norms, or a smoothing of the q/k/v or gate/up input "
                       "after it): OmniServe would not serve it faithfully; SGLang loads norms")
        return out

    def _norms_are_ones(self) -> bool:
        """Whether every norm weight the checkpoint holds is one: fold_norms folded them into the linears, and no
        smoothing after it divided a norm again (smoothing the q/k/v or gate/up input does)."""
        folded = False
        for entry in (e for e in self.recipe.passes if e.enabled):
            if entry.name == "fold_norms":
                folded = True
            elif entry.name == "smooth" and {"qkv", "gate_up"} & set(entry.config.targets):
                folded = False
        return folded

"""compressed-tensors `pack-quantized` / `int-quantized` checkpoints (vLLM, SGLang, transformers).

Layout (see shared/formats.md): `weight_packed` int32 [N, ceil(K*b/32)] holds codes + 2^(b-1) as a dense
little-endian bit stream along K (for 4 bits: eight per word, low nibble first); `weight_scale` in the model
dtype [N, K/g] ([N, 1] per channel); `weight_zero_point` (asymmetric only) is packed the same way along N,
[ceil(N*b/32), K/g]; `weight_shape` int64 [2]. 8-bit weights with quantized activations (W8A8)
use `int-quantized`: `weight` int8 [N, K] plus scale (and an unpacked int8 zero point if asymmetric); 8-bit
weights alone (W8A16) are `pack-quantized`, four codes a word, as vLLM and SGLang read them (their config parser
asserts that an `int-quantized` model quantizes its activations). Linears the recipe does not target are listed in
`ignore`, as engines require of every linear that no config group targets.
Act-order GPTQ is expressible only with static groups (`actorder: weight`): compressed-tensors 0.20 removed
the dynamic `group` ordering and its `weight_g_idx`, so no current engine would load it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quantkit.formats.base import ExportError, Packer, stored_exactly
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

ROLE_PATTERNS = {
    "qkv": r"re:.*self_attn\.(q|k|v)_proj$",
    "o": r"re:.*self_attn\.o_proj$",
    "gate_up": r"re:.*mlp\.(gate|up)_proj$",
    "down": r"re:.*mlp\.down_proj$",
}


_CHUNK = 1 << 20  # codes per slice: the bit arithmetic works in uint64, 8 bytes per code


def _row_slices(rows: int, cols: int) -> list[slice]:
    step = max(1, _CHUNK // max(cols, 1))
    return [slice(r, r + step) for r in range(0, rows, step)] or [slice(0, 0)]


def pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed codes [R, C] (int8, in [-2^(b-1), 2^(b-1)-1]) densely into int32 words along `dim`.

    Works through slices of rows, so packing a 5632 x 2048 matrix never holds more than a few MB of uint64."""
    if codes.dtype != torch.int8 or codes.ndim != 2:
        raise ValueError("pack_int32 takes a 2-D int8 tensor of codes")
    c = codes.numpy()
    if dim == 0:
        c = c.T
    out = np.concatenate([_pack_rows(c[s], bits) for s in _row_slices(*c.shape)])
    if dim == 0:
        out = out.T
    return torch.from_numpy(np.ascontiguousarray(out))


def _pack_rows(c: np.ndarray, bits: int) -> np.ndarray:
    u = c.astype(np.int64) + (1 << (bits - 1))
    if u.min(initial=0) < 0 or u.max(initial=0) >= (1 << bits):
        raise ValueError(f"codes out of range for {bits} bits")
    rows, cols = u.shape
    padded = -(-cols // 32) * 32
    u = np.pad(u, ((0, 0), (0, padded - cols))).reshape(rows, padded // 32, 32).astype(np.uint64)
    words = np.zeros((rows, padded // 32, bits), dtype=np.uint64)
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        words[:, :, word] |= (u[:, :, j] << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:
            words[:, :, word + 1] |= u[:, :, j] >> np.uint64(32 - shift)
    return words.reshape(rows, -1)[:, : -(-cols * bits // 32)].astype(np.uint32).view(np.int32)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: signed int8 codes with `length` elements along `dim`."""
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError("unpack_int32 takes a 2-D int32 tensor")
    w = packed.numpy().view(np.uint32)
    if dim == 0:
        w = w.T
    if w.shape[1] != -(-length * bits // 32):
        raise ValueError(f"{w.shape[1]} packed words cannot hold exactly {length} {bits}-bit values")
    codes = np.concatenate([_unpack_rows(w[s], bits, length) for s in _row_slices(w.shape[0], length)])
    if dim == 0:
        codes = codes.T
    return torch.from_numpy(np.ascontiguousarray(codes))


def _unpack_rows(w: np.ndarray, bits: int, length: int) -> np.ndarray:
    w = w.astype(np.uint64)
    rows, n_words = w.shape
    blocks = -(-length // 32)
    w = np.pad(w, ((0, 0), (0, blocks * bits - n_words))).reshape(rows, blocks, bits)
    mask = np.uint64((1 << bits) - 1)
    u = np.zeros((rows, blocks, 32), dtype=np.uint64)
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        v = w[:, :, word] >> np.uint64(shift)
        if shift + bits > 32:
            v |= w[:, :, word + 1] << np.uint64(32 - shift)
        u[:, :, j] = v & mask
    return (u.reshape(rows, -1)[:, :length].astype(np.int64) - (1 << (bits - 1))).astype(np.int8)


class CompressedTensorsPacker(Packer):
    name = "compressed-tensors"
    quant_method = "compressed-tensors"

    def check_recipe(self) -> None:
        act = self.recipe.activations
        if act is not None and (act.group_size is not None or act.outliers or act.clip_ratio != 1.0):
            raise ExportError("compressed-tensors records activations as dynamic per-token scales of max|x|; the "
                              "recipe's activation groups, outliers or clip_ratio would be evaluated here and not "
                              "computed by the engine: use --set export.format=quantkit for a simulation-only artifact")
        gptq = self.recipe.enabled_pass("gptq")
        if gptq is not None and gptq.dynamic_groups and self.recipe.weights.granularity == "group":
            raise ExportError(
                "compressed-tensors cannot store act-order GPTQ with dynamic groups (g_idx; removed in "
                "compressed-tensors 0.20 and unread by current engines): set passes.gptq.static_groups=true"
            )

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        if spec.progressive or spec.zero_form == "scaled":
            variant = "progressive (two-level) quantization" if spec.progressive else "the scaled zero form"
            raise ExportError(
                f"{module}: compressed-tensors cannot express {variant} (its weights dequantize as "
                "(q - zero) * scale); use --set export.format=qserve, or export.format=quantkit for a "
                "simulation-only artifact"
            )
        if spec.codebook:
            raise ExportError(f"{module}: compressed-tensors cannot express lookup-table (codebook) weights; use "
                              "--set export.format=anyprec")
        if spec.outliers or spec.row_block > 1:
            raise ExportError(
                f"{module}: compressed-tensors cannot express Atom's INT8 outlier columns (weights.outliers) or its "
                "scales shared by row blocks (weights.row_block); use --set export.format=atom, or "
                "export.format=quantkit for a simulation-only artifact"
            )
        if spec.requant_int8:
            raise ExportError(
                f"{module}: compressed-tensors cannot express QQQ's per-group INT8 re-expression (requant_int8); "
                "use --set export.format=qqq"
            )
        if spec.granularity == "group" and shape[1] % spec.group_size:
            raise ExportError(f"{module}: group size {spec.group_size} does not divide input width {shape[1]}")

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        spec, qp = q.spec, q.qparams
        n, k = q.codes.shape
        scale = stored_exactly(qp.scale, self.dtype, "compressed-tensors", "weight_scale")
        if spec.granularity == "tensor":
            scale = scale.reshape(1)
        out: dict[str, torch.Tensor] = {"weight_scale": scale.contiguous()}
        if self._int_quantized(spec):
            out["weight"] = q.codes.contiguous()
            if qp.zero is not None:
                out["weight_zero_point"] = qp.zero.to(torch.int8).reshape(scale.shape).contiguous()
        else:
            out["weight_packed"] = pack_int32(q.codes, spec.bits, dim=1)
            out["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if qp.zero is not None:
                zero = qp.zero.to(torch.int8).reshape(-1, qp.zero.shape[-1])
                out["weight_zero_point"] = pack_int32(zero, spec.bits, dim=0)
        if q.g_idx is not None:
            raise ExportError("compressed-tensors export cannot store permuted groups (g_idx)")
        return out

    def _int_quantized(self, spec: QuantSpec) -> bool:
        """Whether `spec`'s weights are stored unpacked as int8 (`int-quantized`): 8-bit weights of a recipe that
        quantizes activations. Engines take `int-quantized` for W8A8 only; W8A16 is `pack-quantized`."""
        return spec.bits == 8 and self.recipe.activations is not None

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        scale = tensors["weight_scale"].float()
        scale = scale.reshape(1, 1) if scale.ndim == 1 else scale
        if "weight" in tensors:
            codes = tensors["weight"]
            k = codes.shape[1]
            zero = None if spec.symmetric else tensors["weight_zero_point"].to(torch.int32).reshape(scale.shape)
        else:
            k = int(tensors["weight_shape"][1])
            codes = unpack_int32(tensors["weight_packed"], spec.bits, k, dim=1)
            zero = None if spec.symmetric else unpack_int32(tensors["weight_zero_point"], spec.bits, scale.shape[0],
                                                            dim=0).to(torch.int32)
        return QuantizedLinear(codes, QParams(scale, zero, spec.columns_per_group(k)), spec)

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        """Where vLLM and SGLang do not both run a scheme of this artifact, who does (the README's "Who loads it",
        from their compressed-tensors scheme dispatch); and the KV cache quantization the format cannot hold."""
        out = [f"export format compressed-tensors, {scheme}: {who}"
               for scheme, who in dict.fromkeys(self._scheme_support(spec) for spec in specs.values()) if who]
        if self.recipe.kv_cache is not None:
            out.append("export format compressed-tensors: the recipe's KV cache quantization is simulated by quantkit "
                       "eval, not exported (kv_cache_scheme: null); set the engine's KV cache dtype yourself")
        return out

    def _scheme_support(self, spec: QuantSpec) -> tuple[str, str]:
        """(the scheme, which engines run it) for one spec; "" where vLLM and SGLang both do."""
        act = self.recipe.activations
        scheme = f"W{spec.bits}A{act.bits if act else 16}, {'' if spec.symmetric else 'a'}symmetric weights"
        scheme += f" per {spec.granularity}"
        if act is not None and act.bits != 8:
            return scheme, "vLLM's and SGLang's integer schemes take INT8 activations only: no engine runs it"
        if act is not None and spec.bits == 8:
            fits = spec.symmetric and spec.granularity in ("channel", "tensor")
            if fits and not act.symmetric:
                return scheme + ", asymmetric activations", (
                    "vLLM's W8A8 INT8 scheme runs it (a per-token zero point); SGLang's quantizes activations "
                    "symmetrically (per_token_quant_int8), so it would not compute these numbers")
            return scheme, "" if fits else ("vLLM's and SGLang's W8A8 INT8 schemes take symmetric weights per "
                                            "channel or tensor: neither runs it")
        if act is not None:
            return scheme, ("only newer vLLM runs it (WNA8Int); SGLang has no W4A8 scheme" if spec.symmetric
                            and spec.bits == 4 else "vLLM's WNA8Int takes symmetric 4-bit weights and SGLang has no "
                            "W4A8 scheme: neither runs it")
        if spec.granularity == "tensor":
            return scheme, "vLLM's WNA16 and SGLang take weights per channel or group: neither runs it"
        if spec.bits not in (4, 8):
            return scheme, ("only vLLM's newer WNAM schemes run it (WNA16 and SGLang take 4 and 8 bits), with "
                            "compressed-tensors' dense packing (its PR #732)")
        if not spec.symmetric:
            return scheme, ("vLLM runs it with zero-point support (vllm-project/vllm#14211); SGLang's stock "
                            "dispatcher refuses it, and transformers (5.24) cannot load asymmetric pack-quantized "
                            "weights")
        return scheme, ""

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        recipe = self.recipe
        by_spec: dict[QuantSpec, list[str]] = {}
        for role, spec in specs.items():
            by_spec.setdefault(spec, []).append(role)
        formats = {"int-quantized" if self._int_quantized(s) else "pack-quantized" for s in by_spec}
        if len(formats) > 1:
            raise ExportError("compressed-tensors export cannot mix 8-bit and packed sub-8-bit weights")
        (format_name,) = formats
        act = None
        if recipe.activations is not None:
            act = {
                "num_bits": recipe.activations.bits, "type": "int", "symmetric": recipe.activations.symmetric,
                "strategy": "token", "dynamic": True, "observer": None,
            }
        gptq = recipe.enabled_pass("gptq")
        actorder = "weight" if gptq is not None and gptq.act_order else None
        groups = {}
        single = len(by_spec) == 1 and set(specs) == set(ROLE_PATTERNS)
        for i, (spec, roles) in enumerate(by_spec.items()):
            weights = {
                "num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric,
                "strategy": spec.granularity, "group_size": spec.group_size if spec.granularity == "group" else None,
                "dynamic": False, "observer": "minmax",
                "actorder": actorder if spec.granularity == "group" else None,
            }
            groups[f"group_{i}"] = {
                "targets": ["Linear"] if single else [ROLE_PATTERNS[r] for r in roles],
                "weights": weights,
                "input_activations": act,
                "output_activations": None,
                "format": format_name,
            }
        return {
            "quant_method": self.quant_method,
            "format": format_name,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": ["lm_head", *(ROLE_PATTERNS[r] for r in ROLE_PATTERNS if r not in specs)],
            "kv_cache_scheme": None,
        }

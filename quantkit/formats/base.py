"""The packer interface every export format implements."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from quantkit.errors import QuantkitError, dtype_name
from quantkit.quantizers import QuantizedLinear, QuantSpec

# the linear roles of a decoder block, as `quantkit.models.adapters.ROLES` names them (formats sit below models, so
# they name them again; a test holds the two equal)
ROLES = ("qkv", "o", "gate_up", "down")


class ExportError(QuantkitError):
    """The quantized model cannot be expressed in the requested format."""


def stored_exactly(t: torch.Tensor, dtype: torch.dtype, fmt: str, what: str) -> torch.Tensor:
    """`t` on the CPU as `dtype`, or an ExportError where that cast would change a value: a format stores the
    quantizer's scales as they are, never rounded into other weights than the ones quantkit measured."""
    src = t.detach().cpu()
    out = src.to(dtype)
    if not torch.equal(out.float(), src.float()):
        raise ExportError(f"{fmt} stores {what} in {dtype_name(dtype)}, but the quantizer's values are not "
                          f"{dtype_name(dtype)} values (quantize with {dtype_name(dtype)} scales)")
    return out


class Packer:
    """Pack quantized linears into a format's tensors (and back), and write its config entry.

    `pack` returns tensors named relative to the linear's module (`weight_packed` is stored as
    `<module>.weight_packed`). Code that collects one linear's tensors from a shard must select them with
    `owns(key)` on the module-relative key, not by a `weight` prefix: formats such as QServe store module-level
    names (`<module>.qweight`, `<module>.s1_scales`, ...). Everything a packer does not own (a `bias`, norms)
    passes through unchanged. `notes(specs)` lists caveats about the artifact for the manifest (e.g. "no engine
    loads it").
    """

    name: ClassVar[str]
    # config.json's quantization_config.quant_method, which engines dispatch on
    quant_method: ClassVar[str]
    # the engines build an lm_head of their own and never tie it to the embedding (OmniServe): a tied model's
    # artifact carries a copy of the embedding as lm_head.weight
    writes_lm_head: ClassVar[bool] = False
    # why the format's engines take float16 models only ("" where they take the checkpoint's dtype): `quantize
    # --dtype auto` then converts a bfloat16 or float32 checkpoint to float16
    float16_only: ClassVar[str] = ""

    def __init__(self, recipe: Any, dtype: torch.dtype):
        self.recipe = recipe
        self.dtype = dtype

    def owns(self, key: str) -> bool:
        """Whether the module-relative tensor name `key` (e.g. `weight_packed`) is one this packer's `pack` writes."""
        return key.startswith("weight")

    def pop_parts(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        """Remove the packed tensors of `module` from `tensors` (keys relative to the block or model) and return
        them keyed relative to the module, as `pack` wrote them: what is left in `tensors` is the rest of the block."""
        prefix = module + "."
        keys = [k for k in tensors if k.startswith(prefix) and self.owns(k[len(prefix):])]
        return {k[len(prefix):]: tensors.pop(k) for k in keys}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        """Caveats about the exported artifact for the manifest; `specs` maps linear role names to their spec."""
        return []

    def check_recipe(self) -> None:
        """Raise ExportError if the recipe asks for something this format cannot express."""

    def require_all_targets(self, engines: str) -> None:
        """Raise ExportError unless the recipe quantizes every linear role: `engines` (who loads the format) build
        every linear of a block as a quantized one, with no list of linears to leave in floating point."""
        if left := [role for role in ROLES if role not in self.recipe.targets]:
            raise ExportError(f"{self.name}: {engines} quantize every linear of a block, but the recipe leaves "
                              f"{', '.join(left)} unquantized (targets: {', '.join(self.recipe.targets)}); target "
                              "every role, or use --set export.format=quantkit for a simulation-only artifact")

    def require_int8_token_activations(self, engines: str) -> None:
        """Raise ExportError unless the recipe simulates what `engines` compute at run time: every linear's input
        quantized per token to symmetric INT8 with scale max|x| / 127, nothing else."""
        act = self.recipe.activations
        if act is None:
            problems = ["no activation quantization"]
        else:
            problems = [text for bad, text in (
                (act.bits != 8, f"bits {act.bits}"), (not act.symmetric, "asymmetric ones"),
                (act.group_size is not None, f"groups of {act.group_size}"),
                (act.outliers != 0, f"{act.outliers} INT8 outliers"),
                (act.clip_ratio != 1.0, f"clip_ratio {act.clip_ratio}"),
            ) if bad]
        if problems:
            raise ExportError(f"{self.name} is a W4A8 format: {engines} quantize activations per token to symmetric "
                              "INT8 (max|x| / 127), so the recipe must simulate exactly that (activations: {bits: 8, "
                              f"symmetric: true}}); it has {', '.join(problems)}")

    def require_fp16(self) -> None:
        """Raise ExportError unless the artifact is float16, where the format's engines take nothing else."""
        if self.float16_only and self.dtype != torch.float16:
            raise ExportError(f"{self.name} checkpoints must be float16 ({self.float16_only}); --dtype asks for "
                              f"{dtype_name(self.dtype)} (--dtype auto or float16 reads the checkpoint "
                              "as float16)")

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """Raise ExportError if `module` of `shape` cannot be stored with `spec`."""

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """Tensors for one linear, named relative to the module (e.g. `weight_packed`)."""
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`."""
        raise NotImplementedError

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        """The `quantization_config` entry of config.json; `specs` maps linear role names to their spec."""
        raise NotImplementedError

    def config_entries(self, specs: dict[str, QuantSpec], layers_prefix: str,
                       linears: dict[str, tuple[str, ...]]) -> dict[str, Any]:
        """Top-level config.json entries beside `quantization_config` that the format's loader reads. `layers_prefix`
        is where the decoder blocks sit (`model.layers`), `linears` maps each quantized role to its modules' names
        within a block (`self_attn.q_proj`, ...)."""
        return {}

"""`quantkit validate`'s check of one packed linear: its kernel's bit-exact CPU emulation against the reference
dequantization, and the CUDA kernels (on the GPU, or their lane code in the warp simulator) against the emulation.

The CLI renders the rows; this module decides what each row says, so that the check runs without a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quantkit import kernels
from quantkit.emulate import check_against_reference, check_anyprec, check_atom, emulate, emulate_atom
from quantkit.eval.loading import PackedLinear
from quantkit.recipe import Recipe

# What a format's exact part is ("int32" sums, or Any-Precision's "codes": its lookup GEMV has no integer sums), as
# a column name and in words.
EXACT_PART: dict[str, tuple[str, str]] = {
    "anyprec": ("codes", "the codes the emulation decodes from the bitplanes equal the reference unpack's at every "
                         "width the artifact serves"),
    "atom": ("int32", "the emulation's int32 sums of every group (outliers included) equal the reference integer "
                      "products"),
}
DEFAULT_EXACT_PART = ("int32", "the emulation's int32 sums equal the reference integer product")


def exact_part(fmt: str) -> tuple[str, str]:
    """The column name and description of format `fmt`'s exact part."""
    return EXACT_PART.get(fmt, DEFAULT_EXACT_PART)


@dataclass
class LinearCheck:
    """The verdict on one packed linear."""

    layer: int
    name: str
    exact: bool  # the emulation's exact part equals the reference's
    errors: tuple[float, float]  # max |y - y_ref| / max |y_ref| of the fp16 outputs: Gaussian, and with outliers
    kernel_same: bool | None  # the kernels' output equals the emulation's; None where none ran
    stopped: str = ""  # the warp simulator's message where it stopped a kernel (a bug in its source)
    paths: list[str] = field(default_factory=list)  # the kernel paths that ran (kernels.path_labels)

    def problems(self, fmt: str, tolerance: float) -> list[str]:
        """What fails, in words ("int32", "error above 0.004", "kernel: ..."); empty where the linear passes."""
        return [what for what, good in ((exact_part(fmt)[0], self.exact),
                                        (f"error above {tolerance:g}", all(e <= tolerance for e in self.errors)),
                                        ("kernel" + (f": {self.stopped}" if self.stopped else ""),
                                         self.kernel_same is not False)) if not good]


def validation_inputs(rng: np.random.Generator, tokens: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian activations [tokens, k], and the same with a few channels (k / 64, at least one) 30x larger."""
    plain = rng.standard_normal((tokens, k)).astype(np.float32)
    heavy = plain.copy()
    heavy[:, rng.choice(k, size=max(1, k // 64), replace=False)] *= 30
    return plain, heavy


def check_linear(fmt: str, linear: PackedLinear, recipe: Recipe, rng: np.random.Generator, tokens: int,
                 device: str | None) -> LinearCheck:
    """Check `linear` of a `fmt` artifact made with `recipe` on `tokens` rows of `validation_inputs`: its emulation
    against the reference, and on `device` ("cuda", "cpu" for the warp simulator, None for no kernel) its kernels
    against the emulation. Atom's emulation quantizes the activations as the recipe says; the others take them as
    INT8 inputs of the emulated GEMM."""
    q = linear.q
    weight = q.dequantize()
    n, k = weight.shape
    paths = kernels.path_labels(fmt, n, k, device, tokens) if device else []
    inputs = validation_inputs(rng, tokens, k)
    act = recipe.activations
    bits, clip = (act.bits, act.clip_ratio) if fmt == "atom" and act else (4, 1.0)
    if fmt == "atom":
        checks = [check_atom(emulate_atom(linear.parts, x, bits, clip), q, x, bits, clip) for x in inputs]
    elif fmt == "anyprec":  # every width the artifact serves
        checks = [check_anyprec(linear.parts, q, x) for x in inputs]
    else:
        checks = [check_against_reference(emulate(fmt, linear.parts, x), weight, x) for x in inputs]
    same, stopped = None, ""
    if device:
        try:
            same = all(kernels.matches_emulation(fmt, linear.parts, x, device, bits, clip) for x in inputs)
        except kernels.SimulatorFailure as exc:  # this linear fails; the rest still run
            same, stopped = False, str(exc)
    return LinearCheck(linear.layer, linear.name, all(c.exact for c in checks),
                       (checks[0].rel_error, checks[1].rel_error), same, stopped, paths)


__all__ = ["LinearCheck", "check_linear", "exact_part", "validation_inputs"]

"""Packers: turn quantized linears into the exact tensors an engine loads, and back (reference unpack)."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionPacker
from quantkit.formats.atom import AtomPacker
from quantkit.formats.base import Packer
from quantkit.formats.compressed_tensors import CompressedTensorsPacker
from quantkit.formats.liquidquant import LiquidQuantPacker
from quantkit.formats.native import NativePacker
from quantkit.formats.qqq import QQQPacker
from quantkit.formats.qserve import QServePacker

PACKERS: dict[str, type[Packer]] = {
    packer.name: packer
    for packer in (CompressedTensorsPacker, QServePacker, LiquidQuantPacker, QQQPacker, AnyPrecisionPacker,
                   AtomPacker, NativePacker)
}


def get_packer(name: str) -> type[Packer]:
    if name not in PACKERS:
        raise QuantkitError(f"unknown export format {name!r}; known formats: {', '.join(sorted(PACKERS))}")
    return PACKERS[name]


__all__ = ["PACKERS", "Packer", "get_packer"]

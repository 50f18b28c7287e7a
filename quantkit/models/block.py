"""Build one decoder block from its tensors with transformers' own layer class, and run it on cached inputs."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.source import ModelSource


def build_block(source: ModelSource, index: int, tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Decoder layer `index` in float32 with the checkpoint's weights (or `tensors`, block-relative names)."""
    cls = source.adapter.decoder_layer_class()
    with torch.device("meta"):
        block = cls(source.config, layer_idx=index)
    state = tensors if tensors is not None else source.layer_tensors(index)
    block.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    return block.eval()


class BlockRunner:
    """Runs decoder blocks over a calibration cache [n, L, H] in chunks, with shared RoPE tables and mask."""

    def __init__(self, source: ModelSource, seq_len: int, batch_size: int = 8, device: str = "cpu"):
        config = source.config
        from quantkit.simulate import ATTENTION_NAME

        config._attn_implementation = ATTENTION_NAME  # SDPA, plus KV simulation and observers when attached
        self.batch_size = batch_size
        self.device = torch.device(device)
        rotary = source.adapter.rotary_embedding_class()(config)
        positions = torch.arange(seq_len).unsqueeze(0)
        probe = torch.zeros(1, seq_len, 1)
        self.position_embeddings = tuple(t.to(self.device) for t in rotary(probe, positions))
        window = getattr(config, "sliding_window", None)
        self.mask = None
        if window is not None and getattr(config, "use_sliding_window", True) and seq_len > window:
            i = torch.arange(seq_len)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            self.mask = allowed[None, None].to(self.device)

    @torch.no_grad()
    def run(self, block: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Block outputs for every sequence of `x`, written into `out` (allocated like `x` when omitted).

        The cache stays where it is (CPU); each chunk runs on the runner's device.
        """
        out = torch.empty_like(x) if out is None else out
        cos, sin = self.position_embeddings
        for start in range(0, x.shape[0], self.batch_size):
            chunk = x[start:start + self.batch_size].to(self.device, torch.float32)
            y = block(chunk, attention_mask=self.mask, position_embeddings=(cos, sin))
            y = y[0] if isinstance(y, tuple) else y
            out[start:start + self.batch_size] = y.to(out.device, out.dtype)
        return out

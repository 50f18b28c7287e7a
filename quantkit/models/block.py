"""Build one decoder block from its tensors with transformers' own layer class, and run it on cached inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantkit.models.adapters import ArchAdapter
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
    """Runs decoder blocks over a calibration cache [n, L, H] in chunks, with shared RoPE tables and masks."""

    def __init__(self, source: ModelSource, seq_len: int, batch_size: int = 8, device: str = "cpu"):
        config = source.config
        from quantkit.simulate import ATTENTION_NAME

        config._attn_implementation = ATTENTION_NAME  # SDPA, plus KV simulation and observers when attached
        self.adapter = source.adapter
        self.batch_size = batch_size
        self.device = torch.device(device)
        rotary = source.adapter.rotary_embedding_class()(config)
        positions = torch.arange(seq_len).unsqueeze(0)
        probe = torch.zeros(1, seq_len, 1)
        self.position_embeddings = tuple(t.to(self.device) for t in rotary(probe, positions))
        # a sliding-window mask for the layers that slide (Mistral: every layer; Qwen2: those its config's
        # layer_types name, from max_window_layers on), where the window is shorter than the sequences; the other
        # layers are causal (None: SDPA's own causal mask)
        window = getattr(config, "sliding_window", None)
        self._sliding_mask = None
        if window is not None and getattr(config, "use_sliding_window", True) and seq_len > window:
            i = torch.arange(seq_len)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            self._sliding_mask = allowed[None, None].to(self.device)
        self._layer_types = getattr(config, "layer_types", None)

    def mask(self, block: nn.Module) -> torch.Tensor | None:
        """The attention mask of `block`'s layer: the sliding window's where that layer slides, else None."""
        if self._sliding_mask is None or self._layer_types is None:
            return self._sliding_mask
        index = block.get_submodule(self.adapter.attention).layer_idx
        return self._sliding_mask if self._layer_types[index] == "sliding_attention" else None

    @torch.no_grad()
    def run(self, block: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Block outputs for every sequence of `x`, written into `out` (allocated like `x` when omitted).

        The cache stays where it is (CPU); each chunk runs on the runner's device.
        """
        out = torch.empty_like(x) if out is None else out
        mask = self.mask(block)
        return self._chunks(x, out, lambda chunk: block(chunk, attention_mask=mask,
                                                        position_embeddings=self.position_embeddings))

    def call_attention(self, block: nn.Module, adapter: ArchAdapter, x: torch.Tensor) -> object:
        """The block's attention module on one chunk `x` (on the runner's device), through its input norm, called
        exactly as the decoder layer calls it."""
        attn = block.get_submodule(adapter.attention)
        return attn(hidden_states=block.get_submodule(adapter.input_norm)(x), attention_mask=self.mask(block),
                    position_ids=None, use_cache=False, position_embeddings=self.position_embeddings)

    @torch.no_grad()
    def run_attention(self, block: nn.Module, adapter: ArchAdapter, x: torch.Tensor) -> torch.Tensor:
        """The attention module's outputs (o_proj included, before the residual add) for every sequence of `x`,
        float32 on x's device: what QoQ's q/k clipping compares (digest-qserve P6c)."""
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return self._chunks(x, out, lambda chunk: self.call_attention(block, adapter, chunk))

    def slices(self, n: int) -> list[slice]:
        """The runner's chunks of a cache of `n` sequences, `batch_size` sequences each."""
        return [slice(s, s + self.batch_size) for s in range(0, n, self.batch_size)]

    def load(self, x: torch.Tensor, s: slice) -> torch.Tensor:
        """Chunk `s` of the cache `x`, float32 on the runner's device."""
        return x[s].to(self.device, torch.float32)

    def _chunks(self, x: torch.Tensor, out: torch.Tensor, fn: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """`fn` on `x` a chunk at a time (`load`), its output (or the first element of a tuple) written into
        `out`."""
        for s in self.slices(x.shape[0]):
            y = fn(self.load(x, s))
            y = y[0] if isinstance(y, tuple) else y
            out[s] = y.to(out.device, out.dtype)
        return out


class _Captured(Exception):
    def __init__(self, value: torch.Tensor):
        self.value = value


def _input_of(module: nn.Module, call: Callable[[], object]) -> torch.Tensor:
    """The input `module` receives (before any other pre-hook) when `call()` runs; the rest of the call is skipped."""

    def hook(mod: nn.Module, args: tuple) -> None:
        raise _Captured(args[0])

    handle = module.register_forward_pre_hook(hook, prepend=True)
    try:
        call()
    except _Captured as captured:
        return captured.value
    finally:
        handle.remove()
    raise RuntimeError(f"{type(module).__name__} was not called")


@torch.no_grad()
def run_by_role(
    runner: BlockRunner, block: nn.Module, adapter: ArchAdapter, x: torch.Tensor, out: torch.Tensor,
    role_input: Callable[[str, torch.Tensor], None], role_done: Callable[[str], None],
) -> torch.Tensor:
    """`runner.run(block, x, out=out)`, paused at each role's input so the role can be quantized first.

    For each role in execution order (qkv, o, gate_up, down): every chunk's input of that role goes to
    `role_input(role, input)`, then `role_done(role)` may rewrite the role's linears before the block goes on
    (GPTQ's true-sequential mode). The module calls and chunks are those of `BlockRunner.run`, so `out` is
    bit-identical to running the finished block. Holds float32 buffers of the whole cache on its device,
    two at a time: the attention output and the mid-block residual, then the residual and the MLP hidden state
    ((H + max(H, I)) / H times `x`).
    `out` may be `x`.
    """
    norm1 = block.get_submodule(adapter.input_norm)
    norm2, mlp = block.get_submodule(adapter.post_attn_norm), block.get_submodule(adapter.mlp)
    o_proj, down = block.get_submodule(adapter.o_proj), block.get_submodule(adapter.down_proj)
    chunks, load = runner.slices(x.shape[0]), runner.load

    def attention(s: slice) -> object:
        return runner.call_attention(block, adapter, load(x, s))

    def stored(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.empty(*x.shape[:-1], width, dtype=torch.float32, device=x.device) if t is None else t

    for s in chunks:
        role_input("qkv", norm1(load(x, s)))
    role_done("qkv")
    attn_out = None
    for s in chunks:
        a = _input_of(o_proj, lambda s=s: attention(s))
        role_input("o", a)
        attn_out = stored(attn_out, a.shape[-1])
        attn_out[s] = a.to(x.device)
    role_done("o")
    mid = stored(None, x.shape[-1])
    for s in chunks:
        h = load(x, s) + o_proj(load(attn_out, s))
        mid[s] = h.to(x.device)
        role_input("gate_up", norm2(h))
    del attn_out
    role_done("gate_up")
    hidden = None
    for s in chunks:
        d = _input_of(down, lambda s=s: mlp(norm2(load(mid, s))))
        role_input("down", d)
        hidden = stored(hidden, d.shape[-1])
        hidden[s] = d.to(x.device)
    role_done("down")
    for s in chunks:
        out[s] = (load(mid, s) + down(load(hidden, s))).to(out.device, out.dtype)
    return out

"""Diagonal Fisher information of every linear weight, layer-streamed: SqueezeLLM's sensitivity F_ii =
sum over calibration sequences d of (dL_d / dw_i)^2, with L_d the sequence's mean next-token cross-entropy.

The square is taken per sequence, before summing (squaring the summed gradient is the common bug). The model is
never held whole:
1. forward, one block at a time, saving each block's input (the model dtype, one safetensors file per layer);
2. the head (final norm, lm_head, loss) on the last block's output gives dL_d/dh per sequence;
3. backward, from the last block to the first: each block is rebuilt, run again on its saved input with autograd,
   and given the incoming gradient, one sequence at a time, which yields that sequence's weight gradients (squared
   into F) and the gradient for the block below.
Bounds: RAM holds one block with its gradients plus two float32 tensors of the calibration set's size, the
hidden states and their gradients (2 n L H x 4 bytes: 0.2 GB for 100 x 512 tokens at H = 576, 1.7 GB at
H = 4096, 3.4 GB at H = 8192). Disk holds every block's input once while it runs (layers x n L H x the dtype's
bytes: 13 GB for a 7B model with 32 layers, 67 GB for a 70B model with 80, at 100 x 512 tokens in 16 bits) and
the result, F in bfloat16 (float32's range: squared gradients underflow fp16), as large as the 16-bit linears.
Compute is about three forward passes of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.models.block import BlockRunner, build_block
from quantkit.models.source import ModelSource


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it (in float32 here)."""
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def diagonal_fisher(
    source: ModelSource, windows: torch.Tensor, names: list[str], work_dir: Path,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Path]:
    """F for the block-relative linears `names` of every layer, from token windows [n, L]; returns one
    safetensors file per layer under `work_dir` ({name: F [N, K] bfloat16}). Intermediate activations are kept
    under `work_dir` too and removed when done."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config = source.config
    n, length = windows.shape
    runner = BlockRunner(source, length, batch_size=1)
    edges = source.edges()
    x = edges.embed.float()[windows]  # [n, L, H]
    layers = source.num_layers
    saved = [work_dir / f"input-{i:05d}.safetensors" for i in range(layers)]
    for i in range(layers):
        save_file({"x": x.to(source.dtype).contiguous()}, str(saved[i]))
        x.copy_(x.to(source.dtype).float())  # the backward pass restarts from the stored (rounded) input
        runner.run(build_block(source, i), x, out=x)
        if progress:
            progress("forward", i + 1, layers)

    eps = getattr(config, "rms_norm_eps", 1e-6)
    norm, head = edges.final_norm.float(), edges.lm_head.float()
    grad = torch.empty_like(x)
    for d in range(n):
        with torch.enable_grad():
            h = x[d].clone().requires_grad_(True)
            logits = rms_norm(h, norm, eps) @ head.T
            loss = torch.nn.functional.cross_entropy(logits[:-1], windows[d, 1:])
            (grad[d],) = torch.autograd.grad(loss, h)
    del x

    outputs = []
    for i in reversed(range(layers)):
        block = build_block(source, i)
        params = {name: block.get_submodule(name).weight for name in names}
        block.requires_grad_(False)
        for w in params.values():
            w.requires_grad_(True)
        fisher = {name: torch.zeros_like(w) for name, w in params.items()}
        with safe_open(str(saved[i]), "pt") as f:
            inputs = f.get_tensor("x")
        for d in range(n):
            with torch.enable_grad():
                xd = inputs[d:d + 1].float().requires_grad_(True)
                y = block(xd, attention_mask=runner.mask(block), position_embeddings=runner.position_embeddings)
                y = y[0] if isinstance(y, tuple) else y
                grads = torch.autograd.grad(y, [xd, *params.values()], grad_outputs=grad[d:d + 1])
            grad[d] = grads[0][0]
            for name, g in zip(params, grads[1:], strict=True):
                fisher[name].add_(g.square())
        path = work_dir / f"fisher-{i:05d}.safetensors"
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in fisher.items()}, str(path))
        saved[i].unlink()
        outputs.append(path)
        if progress:
            progress("backward", layers - i, layers)
    return outputs[::-1]


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

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.calib import token_sha256
from quantkit.files import atomic_write, lock_owner, take_lock
from quantkit.models.block import BlockRunner, build_block
from quantkit.models.source import ModelSource, content_digest, default_cache_dir


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
    if progress:  # each phase's clock starts with its first layer, not after it
        progress("forward", 0, layers)
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
    if progress:
        progress("backward", 0, layers)
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


FISHER_OWNER = "owner.json"  # in a Fisher computation's temp dir, locked while a run writes it (its pid and host)


def cached_diagonal_fisher(source: ModelSource, tokens: torch.Tensor, names: list[str],
                           progress: Callable[[str, int, int], None] | None = None) -> list[Path]:
    """`diagonal_fisher`'s per-layer files of the named linears, cached under $QUANTKIT_CACHE/fisher by the
    checkpoint files' contents, the token windows and the linears, so a resumed run or another width of the same
    model reuses them, wherever the checkpoint lives and whatever its files' mtimes. They are computed in a
    directory of this run's own and renamed into place when complete, so runs that compute the same ones at once
    do not mix their files. `progress(phase, done, total)` as diagonal_fisher's, and ("cached", 1, 1) on a hit."""
    files = [*sorted(source.path.glob("*.safetensors")), *source.path.glob("config.json")]  # the forward reads it
    identity = [*(f"{f.name}:{content_digest(f)}" for f in files),
                token_sha256(tokens), *names,  # the windows' shape too: [2, 16] and [4, 8] are other sequences
                *([f"read as {source.dtype}"] if source.converts else [])]
    key = hashlib.sha256("|".join(identity).encode()).hexdigest()[:16]
    directory = default_cache_dir() / "fisher" / key
    done = directory / "complete.json"
    paths = [directory / f"fisher-{i:05d}.safetensors" for i in range(source.num_layers)]

    def complete() -> bool:
        return done.is_file() and all(p.is_file() for p in paths)

    if complete():
        if progress is not None:
            progress("cached", 1, 1)
        return paths
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(".*.tmp"):  # what killed runs left; a live run's is locked by it
        if (stale / FISHER_OWNER).is_file() and lock_owner(stale / FISHER_OWNER) is None:
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=directory.parent))
    owner = take_lock(work / FISHER_OWNER)  # a directory of its own: no one else holds it
    try:
        diagonal_fisher(source, tokens, names, work, progress=progress)
        atomic_write(work / done.name, json.dumps({"model": source.origin, "identity": identity}))
        (work / FISHER_OWNER).unlink()
        if directory.exists() and not complete():  # a partial one: of a run that wrote in place, or a file lost
            shutil.rmtree(directory, ignore_errors=True)
        try:
            work.rename(directory)
        except OSError:  # another run put its complete copy there first: the same numbers
            if not complete():
                raise
    finally:
        if owner is not None:
            os.close(owner)
        shutil.rmtree(work, ignore_errors=True)
    return paths

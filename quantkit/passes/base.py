"""What a calibration pass sees and produces: one decoder block, its calibration statistics, its results."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from quantkit.models.adapters import ArchAdapter
from quantkit.models.block import BlockRunner
from quantkit.models.source import ModelEdges
from quantkit.quantizers import QuantizedLinear, QuantSpec
from quantkit.simulate import ActivationSim, KVSim, fake_quantize_activation


class _KVObserved(Exception):
    """Raised by `LayerWork.observe_kv`'s observer to end a chunk's attention once its keys are seen."""


@dataclass
class LayerWork:
    """One decoder block under calibration: the modules, per-linear specs, statistics, results and notes.

    Passes that need activations run the block on its calibration inputs through `forward`; Hessians are
    collected lazily on first use (after every transform pass has run), so they always match the weights.
    """

    index: int
    block: nn.Module
    linears: dict[str, str]  # block-relative linear name -> role
    specs: dict[str, QuantSpec]
    scale_dtype: torch.dtype = torch.float16
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # role -> H = 2/n * X^T X (float32)
    results: dict[str, QuantizedLinear] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    clip: dict[str, torch.Tensor | float] = field(default_factory=dict)  # linear -> clip ratio(s) [N, G]
    fisher: dict[str, torch.Tensor] = field(default_factory=dict)  # linear -> diagonal Fisher [N, K] (squeezellm)
    column_order: dict[str, torch.Tensor] = field(default_factory=dict)  # role -> the quantizer's column order (Atom)
    inputs: torch.Tensor | None = None  # calibration inputs of the block [n, L, H] (the CPU cache)
    # what runs the block over its inputs, names its modules by role and configures it: set by the pipeline, left
    # unset by tests of a pass that needs none of them
    runner: BlockRunner | None = None
    adapter: ArchAdapter | None = None
    config: PretrainedConfig | None = None  # the model's transformers config
    act_bits: int | None = None  # runtime activation quantization the recipe simulates (per token)
    kv: KVSim | None = None  # the KV cache quantization the recipe simulates
    sink_weight: float | None = None  # recipe calibration.sink_weight / token_cap: see token_weights
    token_cap: float | None = None
    hessian_sim: ActivationSim | None = None  # Hessians of the inputs as it quantizes them (Atom), or None

    def weight(self, name: str) -> torch.Tensor:
        return self.block.get_submodule(name).weight

    def module(self, name: str) -> nn.Linear:
        return self.block.get_submodule(name)

    def names(self, role: str) -> list[str]:
        """The block's linears of `role` (all of them, quantized or not)."""
        return list(self.adapter.linears[role])

    def group_order(self, role: str) -> torch.Tensor | None:
        """The column order a weight quantizer forms `role`'s groups along: the outlier_order pass's, else for Atom's
        outliers the natural order (its INT8 group is the last columns, as the README says), else None (the
        quantizer's own: GPTQ's act-order, for one)."""
        order = self.column_order.get(role)
        members = [name for name, r in self.linears.items() if r == role and name in self.specs]
        if order is None and any(self.specs[name].outliers for name in members):
            weight = self.weight(members[0])
            order = torch.arange(weight.shape[1], device=weight.device)
        return order

    def head_dims(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of the block's attention."""
        return self.adapter.head_dims(self.config)

    def kv_channels(self) -> torch.Tensor:
        """For each query-side channel of the block's attention, the KV-side channel it pairs with (GQA)."""
        return self.adapter.kv_channels(self.config)

    def hessian(self, name: str) -> torch.Tensor:
        role = self.linears[name]
        if role not in self.hessians:
            self.collect_hessians()
        return self.hessians[role]

    def forward(
        self,
        pre_hooks: dict[str, Callable[[torch.Tensor], None]] | None = None,
        samples: int | None = None,
        attention_observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run the block on its first `samples` calibration sequences (all by default), calling each
        `pre_hooks[name](x)` with the input of that submodule and `attention_observer(key, value)` with the
        post-RoPE key/value states [B, H_kv, T, D]; returns the block outputs."""
        x = self.inputs if samples is None else self.inputs[:samples]
        handles = []
        for name, fn in (pre_hooks or {}).items():
            handles.append(self.block.get_submodule(name).register_forward_pre_hook(
                lambda module, args, fn=fn: fn(args[0])))
        try:
            with self._observed(attention_observer):
                return self.runner.run(self.block, x)
        finally:
            for h in handles:
                h.remove()

    def attention_output(self, samples: int | None = None) -> torch.Tensor:
        """The attention module's outputs (o_proj included) on the first `samples` calibration sequences."""
        x = self.inputs if samples is None else self.inputs[:samples]
        return self.runner.run_attention(self.block, self.adapter, x)

    @torch.no_grad()
    def observe_kv(self, observer: Callable[[torch.Tensor, torch.Tensor], None], samples: int | None = None) -> None:
        """`observer(key, value)` with the post-RoPE key/value states [B, H_kv, T, D] of the first `samples`
        calibration sequences, each chunk's attention module stopped right there: key statistics (SmoothAttention)
        for the cost of the projections and RoPE, without the attention scores, o_proj or the MLP."""
        x = self.inputs if samples is None else self.inputs[:samples]

        def observe_and_stop(key: torch.Tensor, value: torch.Tensor) -> None:
            observer(key, value)
            raise _KVObserved

        with self._observed(observe_and_stop):
            for s in self.runner.slices(x.shape[0]):
                try:
                    self.runner.call_attention(self.block, self.adapter, self.runner.load(x, s))
                except _KVObserved:
                    continue
                raise RuntimeError(f"the attention function of layer {self.index} never saw the keys")

    @contextmanager
    def _observed(self, observer: Callable[[torch.Tensor, torch.Tensor], None] | None) -> Iterator[None]:
        """The block's attention function calls `observer(key, value)` while the context lasts."""
        attn = self.block.get_submodule(self.adapter.attention)
        previous = getattr(attn, "_quantkit_observer", None)
        attn._quantkit_observer = observer
        try:
            yield
        finally:
            attn._quantkit_observer = previous

    def input_absmax(self, names: list[str], samples: int | None = None) -> dict[str, torch.Tensor]:
        """max |x| per input channel of each named submodule over the calibration tokens."""
        stats: dict[str, torch.Tensor] = {}

        def hook(name: str) -> Callable[[torch.Tensor], None]:
            def fn(x: torch.Tensor) -> None:
                m = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
                stats[name] = m if name not in stats else torch.maximum(stats[name], m)
            return fn

        self.forward({n: hook(n) for n in names}, samples)
        return stats

    def collect_hessians(self) -> torch.Tensor:
        """H = 2/n X^T X of the first linear of each quantized role, in one pass over the calibration inputs,
        tokens weighted as `token_weights` says; returns the block outputs of that pass."""
        firsts: dict[str, str] = {}
        for name, role in self.linears.items():
            firsts.setdefault(role, name)
        acc = self.hessian_accumulator()
        out = self.forward({name: (lambda x, role=role: acc.add(role, x)) for role, name in firsts.items()})
        self.hessians.update(acc.finish())
        return out

    def hessian_accumulator(self) -> HessianAccumulator:
        """An accumulator with this recipe's token weighting and (calibration.hessian_inputs: quantized) its
        activation quantization of each role's input."""
        return HessianAccumulator(self.sink_weight, self.token_cap,
                                  self.quantized_input if self.hessian_sim is not None else None)

    def quantized_input(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """`x` as the runtime quantizes the input of `role`'s linears: per token, or per token and group along the
        role's column order (Atom's groups and outliers), as the deployed simulation will."""
        order = self.column_order.get(role)
        position = None
        if order is not None:  # the simulation groups columns by argsort(g_idx): positions in the order do that
            position = torch.empty_like(order)
            position[order] = torch.arange(order.numel(), device=order.device)
        return fake_quantize_activation(x, self.hessian_sim, position)


class HessianAccumulator:
    """Accumulates H = 2/n sum_t w_t x_t x_t^T per role from input chunks [B, L, K] (float32), each chunk first
    passed through `transform(role, x)` when one is given (quantized Hessian inputs)."""

    def __init__(self, sink_weight: float | None = None, token_cap: float | None = None,
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        self.sink_weight, self.token_cap, self.transform = sink_weight, token_cap, transform
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, role: str, x: torch.Tensor) -> None:
        x = (self.transform(role, x) if self.transform is not None else x).float()
        flat = x.reshape(-1, x.shape[-1])
        if role not in self.sums:
            self.sums[role] = torch.zeros(x.shape[-1], x.shape[-1], device=x.device)
            self.counts[role] = 0
        add_gram_(self.sums[role], flat)
        if self.sink_weight is not None or self.token_cap is not None:
            # reweighting touches few tokens: add (w - 1) x x^T for those instead of scaling a copy of X
            extra = token_weights(x, self.sink_weight, self.token_cap).reshape(-1) - 1.0
            few = extra.nonzero().squeeze(1)
            self.sums[role].addmm_(flat[few].T * extra[few], flat[few])
        self.counts[role] += flat.shape[0]

    def finish(self) -> dict[str, torch.Tensor]:
        """The Hessians by role (the accumulator is emptied)."""
        out = {role: h.mul_(2.0 / self.counts[role]) for role, h in self.sums.items()}
        self.sums, self.counts = {}, {}
        return out


def add_gram_(h: torch.Tensor, x: torch.Tensor, blocks: int = 3) -> None:
    """h += x^T x for x [n, K], computing each off-diagonal block once (symmetry): 3/4 of the GEMM work at 2
    blocks, 2/3 at 3. Small widths take one GEMM."""
    k = x.shape[1]
    if k < 384:
        h.addmm_(x.T, x)
        return
    edges = [k * i // blocks for i in range(blocks + 1)]
    for i in range(blocks):
        a = x[:, edges[i]:edges[i + 1]]
        for j in range(i, blocks):
            block = a.T @ x[:, edges[j]:edges[j + 1]]
            h[edges[i]:edges[i + 1], edges[j]:edges[j + 1]] += block
            if j != i:
                h[edges[j]:edges[j + 1], edges[i]:edges[i + 1]] += block.T


def token_weights(x: torch.Tensor, sink_weight: float | None, token_cap: float | None) -> torch.Tensor:
    """Per-token weights [B, L] for Hessians of inputs x [B, L, K], in units of the median token's energy |x|^2.

    Each sequence's first token (the attention sink every later token reads) is given the weight of
    `sink_weight` median tokens, whatever its own size; any other token weighs at most `token_cap` of them.
    Plain GPTQ (both None) lets a sink with massive activations own the Hessian of the layer that produces
    it, and elsewhere leaves the sink's rare input directions to absorb the error of everyone else.
    """
    energy = torch.linalg.vector_norm(x, dim=-1).square()  # |x|^2 without an x-sized temporary
    median = energy.median()
    safe = torch.where(energy > 0, energy, torch.ones_like(energy))  # a zero token keeps weight 1 (it adds nothing)
    weights = torch.ones_like(energy)
    if token_cap is not None:
        weights = torch.where(energy > token_cap * median, token_cap * median / safe, weights)
    if sink_weight is not None:
        weights[:, 0] = torch.where(energy[:, 0] > 0, sink_weight * median / safe[:, 0], 1.0)
    return weights


OUTPUT_ROLES = ("o", "down")  # block output modules: the roles whose input channels reordering permutes


def check_output_targets(targets: list[str]) -> None:
    """Raise ValueError unless every target is a block output role."""
    if any(t not in OUTPUT_ROLES for t in targets):
        raise ValueError(f"targets must be among {', '.join(map(repr, OUTPUT_ROLES))}, got {targets}")


class Pass:
    """A calibration step registered by name; `run` transforms or quantizes one block in place.

    Transform passes (`transforms = True`) must leave the FP model's function unchanged; they may also rewrite
    the model-level tensors in `prepare`, which runs once before the first block. `requires` names passes
    that must come earlier in the recipe.
    """

    name: ClassVar[str]
    Config: ClassVar[type]
    quantizes: ClassVar[bool] = False  # produces the block's quantized weights
    transforms: ClassVar[bool] = False  # rewrites weights, function-preserving in FP
    needs_hessian: ClassVar[bool] = False
    needs_fisher: ClassVar[bool] = False  # the engine computes each linear's diagonal Fisher first (quantkit.fisher)
    reads_activations: ClassVar[bool] = True  # false: the pass never looks at calibration data
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        self.config = config

    def prepare(self, edges: ModelEdges, config: PretrainedConfig) -> None:
        """Rewrite the model-level tensors (embeddings, final norm, lm_head) before any block runs."""

    def run(self, work: LayerWork) -> None:
        """Transform the block, or (quantizers) quantize all its target linears."""
        if not self.quantizes:  # pragma: no cover - interface
            raise NotImplementedError
        self.quantize(work, list(work.specs))

    def quantize(self, work: LayerWork, names: list[str]) -> None:  # pragma: no cover - interface
        """Quantizers: put the named linears' results into `work.results`, reading only their own statistics, so
        the engine may quantize a block role by role."""
        raise NotImplementedError

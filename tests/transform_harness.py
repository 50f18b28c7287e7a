"""Run transform passes over a whole checkpoint exactly as the streaming engine does, and rebuild the model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from quantkit.models.block import BlockRunner, build_block
from quantkit.models.source import open_model
from quantkit.passes import LayerWork, get_pass
from quantkit.quantizers import QuantSpec


def transformed_model(
    model_dir: Path, passes: list[tuple[str, dict]], tokens: torch.Tensor, spec: QuantSpec | None = None,
    act_bits: int | None = 8, metrics: list[dict] | None = None,
) -> torch.nn.Module:
    """The float32 model after `passes` (name, config kwargs), calibrated block by block on `tokens` [n, L], with
    every linear planned for `spec` (default: 4-bit asymmetric groups of 32); each block's metrics are appended
    to `metrics`."""
    spec = spec or QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32)
    source = open_model(model_dir)
    instances = [get_pass(name)(get_pass(name).Config(**kwargs)) for name, kwargs in passes]
    edges = source.edges()
    for p in instances:
        p.prepare(edges, source.config)
    runner = BlockRunner(source, tokens.shape[1], batch_size=4)
    adapter = source.adapter
    x = edges.embed[tokens].float()
    state: dict[str, torch.Tensor] = {}
    for i in range(source.num_layers):
        block = build_block(source, i)
        linears = {n: r for r, n in adapter.linear_names()}
        work = LayerWork(index=i, block=block, linears=linears, specs=dict.fromkeys(linears, spec),
                         inputs=x, runner=runner, adapter=adapter, config=source.config, act_bits=act_bits)
        for p in instances:
            p.run(work)
        if metrics is not None:
            metrics.append(work.metrics)
        x = runner.run(block, x)
        state.update({adapter.layer_prefix(i) + k: v for k, v in block.state_dict().items()})
    state[adapter.embed + ".weight"] = edges.embed.float()
    state[adapter.final_norm + ".weight"] = edges.final_norm.float()
    state[adapter.lm_head + ".weight"] = edges.lm_head.float()
    config = source.config
    config.tie_word_embeddings = False
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def original_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logits.float()

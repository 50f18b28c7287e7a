"""True-sequential calibration: a block run role by role, quantizing each role before the next one sees it."""

from __future__ import annotations

import pytest
import torch

from quantkit import simulate
from quantkit.models.block import BlockRunner, build_block, run_by_role
from quantkit.models.source import open_model
from quantkit.passes import LayerWork
from quantkit.quantizers import QuantSpec, fake_quantize
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

SPECS = {
    "llama": SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1),
    "qwen2": SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1, model_type="qwen2"),
}


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("simulated", [False, True], ids=["w4", "w4a8kv4"])
def test_role_by_role_equals_running_the_finished_block(tmp_path, arch, simulated):
    """Outputs bit-identical to a plain run of the block as finished (what --resume replays), and each role saw
    exactly the inputs it sees in that block: those produced by the quantized roles before it."""
    source = open_model(write_synthetic_llama(tmp_path / arch, SPECS[arch]))
    adapter = source.adapter
    runner = BlockRunner(source, 16, batch_size=2)  # 3 sequences: chunks of 2 and 1
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))
    block = build_block(source, 0)
    act = simulate.ActivationSim(8) if simulated else None
    kv = simulate.KVSim(4) if simulated else None
    simulate.attach([block], [], source.config, None, kv)
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32)
    names = {role: list(adapter.linears[role]) for role in adapter.linears}
    seen: dict[str, list[torch.Tensor]] = {role: [] for role in names}
    order: list[str] = []

    def role_done(role: str) -> None:
        order.append(role)
        for name in names[role]:
            module = block.get_submodule(name)
            module.weight.data = fake_quantize(module.weight.data, spec).half().float()
        simulate.attach([block], names[role], source.config, act, None)

    out = run_by_role(runner, block, adapter, x.clone(), torch.empty_like(x),
                      lambda role, t: seen[role].append(t.clone()), role_done)
    assert order == ["qkv", "o", "gate_up", "down"]

    replay: dict[str, list[torch.Tensor]] = {role: [] for role in names}
    hooks = [block.get_submodule(n[0]).register_forward_pre_hook(
        lambda m, args, r=r: replay[r].append(args[0].clone()), prepend=True) for r, n in names.items()]
    expected = runner.run(block, x)
    for h in hooks:
        h.remove()
    assert torch.equal(out, expected)
    for role in names:
        assert torch.equal(torch.cat(seen[role]), torch.cat(replay[role])), role
    unquantized = runner.run(build_block(source, 0), x)
    assert not torch.equal(out, unquantized)  # the roles really were quantized along the way


def test_in_place_output(tmp_path):
    """`out` may be the cache itself (the pipeline overwrites it with the next block's inputs)."""
    source = open_model(write_synthetic_llama(tmp_path / "m", SPECS["llama"]))
    runner = BlockRunner(source, 16, batch_size=2)
    x = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(1))
    block = build_block(source, 0)
    expected = runner.run(block, x)
    run_by_role(runner, block, source.adapter, x, x, lambda role, t: None, lambda role: None)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_attention_module_alone_equals_its_part_of_the_block(tmp_path, arch):
    """`run_attention` (QoQ's q/k clipping objective) gives bit for bit what the attention module returns inside
    a run of the whole block, KV simulation included."""
    source = open_model(write_synthetic_llama(tmp_path / arch, SPECS[arch]))
    runner = BlockRunner(source, 16, batch_size=2)
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(1))
    block = build_block(source, 0)
    simulate.attach([block], [], source.config, None, simulate.KVSim(4))
    inside: list[torch.Tensor] = []
    attn = block.get_submodule(source.adapter.attention)
    handle = attn.register_forward_hook(lambda m, args, out: inside.append(out[0].clone()))
    runner.run(block, x)
    handle.remove()
    alone = runner.run_attention(block, source.adapter, x)
    assert torch.equal(alone, torch.cat(inside))


def test_observe_kv_sees_the_same_keys_without_the_rest_of_the_block(tmp_path):
    """SmoothAttention reads max|K| through `LayerWork.observe_kv` (each chunk stopped at its attention function):
    the observer gets bit for bit the keys and values a whole-block `forward` shows it, chunk by chunk, and is
    detached after."""
    source = open_model(write_synthetic_llama(tmp_path / "m", SPECS["llama"]))
    linears = {n: r for r, n in source.adapter.linear_names()}
    work = LayerWork(index=0, block=build_block(source, 0), linears=linears, specs={},
                     runner=BlockRunner(source, 16, batch_size=2),
                     inputs=torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(2)),
                     adapter=source.adapter, config=source.config)
    seen: dict[str, list[torch.Tensor]] = {"block": [], "stopped": []}
    work.forward(attention_observer=lambda k, v: seen["block"].append(torch.cat([k, v])))
    work.observe_kv(lambda k, v: seen["stopped"].append(torch.cat([k, v])))
    assert len(seen["block"]) == len(seen["stopped"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["block"], seen["stopped"], strict=True))
    assert getattr(work.block.get_submodule(source.adapter.attention), "_quantkit_observer", None) is None
    work.observe_kv(lambda k, v: seen["stopped"].append(k), samples=1)
    assert len(seen["stopped"]) == 3 and seen["stopped"][-1].shape[0] == 1

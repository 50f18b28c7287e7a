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
    # heads x head_dim = 2 x hidden, as in Mistral Nemo: o_proj's inputs are wider than the block's
    "mistral-head-dim": SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       model_type="mistral", head_dim=32),
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
    simulate.attach([block], [], source.config, None, kv, adapter=source.adapter)
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
    simulate.attach([block], [], source.config, None, simulate.KVSim(4), adapter=source.adapter)
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


def test_role_by_role_and_attention_alone_keep_a_sliding_window(tmp_path):
    """On a model whose attention slides (Mistral, window 6 on sequences of 16), the role-by-role run and the
    attention module run alone (QoQ's clipping objective) mask each query to its window as the whole block does:
    the outputs equal a plain run of the block, and the window really changes them."""
    import json

    path = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                 num_hidden_layers=1, model_type="mistral"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
    source = open_model(path)
    runner = BlockRunner(source, 16, batch_size=2)
    assert runner.mask(build_block(source, 0)) is not None
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(3))
    block = build_block(source, 0)
    expected = runner.run(block, x)
    out = run_by_role(runner, block, source.adapter, x, torch.empty_like(x), lambda role, t: None,
                      lambda role: None)
    assert torch.equal(out, expected)
    inside: list[torch.Tensor] = []
    attn = block.get_submodule(source.adapter.attention)
    handle = attn.register_forward_hook(lambda m, args, out: inside.append(out[0].clone()))
    runner.run(block, x)
    handle.remove()
    assert torch.equal(runner.run_attention(block, source.adapter, x), torch.cat(inside))
    unwindowed = BlockRunner(source, 16, batch_size=2)
    unwindowed._sliding_mask = None
    assert not torch.equal(unwindowed.run(block, x), expected)


def test_a_bfloat16_cache_runs_in_float32(tmp_path):
    """With engine.cache_dtype bfloat16 the cache between blocks is bfloat16, but each chunk runs the float32
    block in float32: a run (and the role-by-role run) gives the float32 run on the upcast cache, rounded once into
    the bfloat16 output, and the attention alone gives float32 outputs, as its docstring says."""
    source = open_model(write_synthetic_llama(tmp_path / "m", SPECS["llama"]))
    runner = BlockRunner(source, 16, batch_size=2)
    block = build_block(source, 0)
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    expected = runner.run(block, x.float())
    out = runner.run(block, x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))
    by_role = run_by_role(runner, block, source.adapter, x, torch.empty_like(x), lambda role, t: None,
                          lambda role: None)
    assert torch.equal(by_role, out)
    alone = runner.run_attention(block, source.adapter, x)
    assert alone.dtype == torch.float32
    assert torch.equal(alone, runner.run_attention(block, source.adapter, x.float()))


def test_a_role_input_is_taken_before_the_linears_other_pre_hooks(tmp_path):
    """The inputs run_by_role hands a role are those its linear receives before any pre-hook of its own (an
    activation simulation attached earlier, say, which would hand GPTQ quantized inputs in place of the block's
    own): with a pre-hook that doubles o_proj's and down_proj's inputs, the roles still get what a plain run of the
    block shows a hook placed first."""
    source = open_model(write_synthetic_llama(tmp_path / "m", SPECS["llama"]))
    adapter = source.adapter
    runner = BlockRunner(source, 16, batch_size=2)
    block = build_block(source, 0)
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(5))
    names = {"o": adapter.o_proj, "down": adapter.down_proj}
    for name in names.values():
        block.get_submodule(name).register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    replay: dict[str, list[torch.Tensor]] = {role: [] for role in names}
    handles = [block.get_submodule(name).register_forward_pre_hook(
        lambda m, args, r=role: replay[r].append(args[0].clone()), prepend=True) for role, name in names.items()]
    runner.run(block, x)
    for h in handles:
        h.remove()
    seen: dict[str, list[torch.Tensor]] = {role: [] for role in names}
    run_by_role(runner, block, adapter, x, torch.empty_like(x),
                lambda role, t: seen[role].append(t.clone()) if role in seen else None, lambda role: None)
    for role in names:
        assert torch.equal(torch.cat(seen[role]), torch.cat(replay[role])), role

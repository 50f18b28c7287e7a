"""Atom: groups along a column order, INT8 outlier columns, row-paired scales, and GPTQ along the order."""

from __future__ import annotations

import pytest
import torch

from quantkit.passes.gptq import GPTQConfig, factor_hessian, gptq_with_factor
from quantkit.quantizers import QuantSpec, compute_qparams, dequantize, ordered_quantize, quantize

ATOM = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32, clip_ratio=0.85, outliers=16,
                 row_block=2)


def _problem(n: int = 8, k: int = 80, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(256, k, generator=g) * torch.linspace(0.1, 3.0, k)[torch.randperm(k, generator=g)]
    order = torch.argsort(x.square().sum(0))  # ascending square-sum: the outliers last
    return w, x, order


def test_spec_validation():
    with pytest.raises(ValueError, match="Atom"):
        QuantSpec(bits=4, symmetric=False, outliers=128)
    with pytest.raises(ValueError, match="row_block"):
        QuantSpec(bits=4, row_block=0)


def test_row_block_shares_one_scale_per_row_pair():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.1], [3.0, 0.2, -0.1, 0.3], [0.5, 0.5, 0.5, -7.5], [0.1, 0.1, 0.1, 0.1]])
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=2, row_block=2)
    qp = compute_qparams(w, spec, torch.float32)
    expect = torch.tensor([[3.0, 0.5], [3.0, 0.5], [0.5, 7.5], [0.5, 7.5]]) / 7.5  # max over each row pair
    assert torch.equal(qp.scale, expect)
    with pytest.raises(ValueError, match="row_block"):
        compute_qparams(w[:3], spec)


def test_ordered_quantize_groups_follow_the_order_and_outliers_are_int8():
    w, _, order = _problem()
    codes, qp, g_idx = ordered_quantize(w, ATOM, order, torch.float32)
    assert qp.scale.shape == (8, 3)  # (80 - 16) / 32 = 2 normal groups, then the outlier group
    assert g_idx[order].tolist() == [0] * 32 + [1] * 32 + [2] * 16
    # the same numbers as quantizing the reordered matrix block by block
    wp = w[:, order]
    normal = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32, clip_ratio=0.85, row_block=2)
    qn = compute_qparams(wp[:, :64], normal, torch.float32)
    assert torch.equal(codes[:, order][:, :64], quantize(wp[:, :64], qn, normal))
    qo = compute_qparams(wp[:, 64:], QuantSpec(bits=8, symmetric=True, granularity="channel"), torch.float32)
    assert torch.equal(qp.scale[:, 2:], qo.scale)
    assert codes[:, order[64:]].abs().max() > 7  # the outliers use the INT8 range
    assert codes[:, order[:64]].min() >= -8 and codes[:, order[:64]].max() <= 7
    assert torch.equal(qp.scale[0::2, :2], qp.scale[1::2, :2])  # normal groups: row pairs share the scale
    deq = dequantize(codes, qp, g_idx)
    assert float((deq - w).abs()[:, order[64:]].max()) < float(qo.scale.max())  # INT8: error below one step


def test_gptq_along_an_identity_order_equals_plain_dynamic_groups():
    w, x, _ = _problem()
    h = 2 * x.T @ x / x.shape[0]
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16)
    config = GPTQConfig(act_order=False, static_groups=False)
    plain, _ = gptq_with_factor(w, factor_hessian(h, config), spec, config, torch.float32)
    ordered, _ = gptq_with_factor(w, factor_hessian(h, config, order=torch.arange(80)), spec, config, torch.float32)
    assert torch.equal(plain.codes, ordered.codes) and torch.equal(plain.qparams.scale, ordered.qparams.scale)


def test_gptq_with_outliers_beats_round_to_nearest_on_the_layer_output():
    w, x, order = _problem(n=16, k=80)
    h = 2 * x.T @ x / x.shape[0]
    config = GPTQConfig(act_order=False, static_groups=False)
    result, _ = gptq_with_factor(w, factor_hessian(h, config, order=order), ATOM, config, torch.float32)
    assert result.g_idx is not None and result.g_idx[order].tolist() == [0] * 32 + [1] * 32 + [2] * 16
    assert result.qparams.scale.shape == (16, 3)
    assert result.codes[:, order[64:]].abs().max() > 7
    rtn_codes, rtn_qp, rtn_g = ordered_quantize(w, ATOM, order, torch.float32)

    def output_error(deq: torch.Tensor) -> float:
        return float(((x @ (deq - w).T) ** 2).sum())

    assert output_error(result.dequantize()) < output_error(dequantize(rtn_codes, rtn_qp, rtn_g))


def test_grouped_activation_quantization_follows_the_weights_order():
    from quantkit.quantizers import fake_quantize_per_token
    from quantkit.simulate import ActivationSim, fake_quantize_activation

    _, x, order = _problem(k=80)
    g_idx = torch.empty(80, dtype=torch.long)
    g_idx[order] = torch.cat([torch.arange(64) // 32, torch.full((16,), 2)])
    sim = ActivationSim(bits=4, group_size=32, outliers=16, clip_ratio=0.9)
    got = fake_quantize_activation(x, sim, g_idx)
    xp = x[:, order]
    want = torch.cat([fake_quantize_per_token(xp[:, :32], 4, True, 0.9), fake_quantize_per_token(xp[:, 32:64], 4, True,
                      0.9), fake_quantize_per_token(xp[:, 64:], 8, True)], dim=1)
    assert torch.equal(got[:, order], want)
    plain = ActivationSim(bits=8)
    assert torch.equal(fake_quantize_activation(x, plain, g_idx), fake_quantize_per_token(x, 8))
    with pytest.raises(ValueError, match="do not divide"):
        fake_quantize_activation(x, ActivationSim(bits=4, group_size=48, outliers=16))


def test_pre_rope_kv_quantizes_the_projection_outputs_per_head(tmp_path):
    from quantkit import simulate
    from quantkit.models.block import build_block
    from quantkit.models.source import open_model
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    source = open_model(write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                              num_hidden_layers=1)))
    block = build_block(source, 0)
    sim = simulate.KVSim(bits=4, pre_rope=True)
    seen: dict[str, torch.Tensor] = {}
    k_proj = block.get_submodule(source.adapter.k_proj)
    probe = k_proj.register_forward_hook(lambda m, a, out: seen.setdefault("k", out))
    handles = simulate.attach([block], [], source.config, None, sim, adapter=source.adapter)
    x = torch.randn(1, 5, 128)
    quantized = k_proj(x)  # the attached hook runs after the probe: probe saw the raw output
    heads = seen["k"].unflatten(-1, (2, 32))
    assert torch.equal(quantized, simulate.fake_quantize_kv(heads, sim).flatten(-2))
    assert len(torch.unique(quantized[0, 0, :32])) <= 16  # one head of one token: 16 levels
    for h in [*handles, probe]:
        h.remove()
    with pytest.raises(ValueError, match="needs the model's adapter"):
        simulate.attach([block], [], source.config, None, sim)


def test_eval_description_names_each_part_of_the_activation_simulation():
    """eval's description of the simulated activations names the groups and the outliers each on its own: a
    recipe with activation groups and no outliers, or outliers over whole tokens, reads as what it simulates, not
    as plain per-token quantization."""
    from quantkit import simulate
    from quantkit.eval.loading import _describe_act

    assert _describe_act(None) == ""
    assert _describe_act(simulate.ActivationSim(8)) == "A8 per-token"
    assert _describe_act(simulate.ActivationSim(4, group_size=128)) == "A4 per-token groups of 128"
    assert _describe_act(simulate.ActivationSim(4, outliers=64)) == "A4 per-token + 64 INT8 outliers"
    assert (_describe_act(simulate.ActivationSim(4, group_size=128, outliers=128))
            == "A4 per-token groups of 128 + 128 INT8 outliers")


def test_atom_recipe_end_to_end(tmp_path, calib_txt):
    """atom-w4a4 on a synthetic Llama (width 256: 128 normal columns and 128 outliers): the artifact records each
    linear's order as g_idx with the largest-input channels in the INT8 group, and eval simulates W4A4 with the
    same grouping and a pre-RoPE KV4 cache."""
    from helpers import cli_ok
    from safetensors.torch import load_file

    from quantkit.eval.loading import load_for_eval
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                  num_hidden_layers=2))
    out = tmp_path / "sim"
    args = ["--recipe", "atom-w4a4", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    cli_ok("quantize", model, "-o", out, *args, "--set", "export.format=quantkit")
    cli_ok("quantize", model, "-o", tmp_path / "atom", *args)
    shard = load_file(str(sorted(out.glob("model-*.safetensors"))[0]))
    g_idx = shard["model.layers.0.mlp.down_proj.weight_g_idx"]
    scale = shard["model.layers.0.mlp.down_proj.weight_scale"]
    codes = shard["model.layers.0.mlp.down_proj.weight_codes"]
    assert scale.shape == (256, 4) and torch.bincount(g_idx).tolist() == [128, 128, 128, 128]
    assert codes[:, g_idx == 3].abs().max() > 7 and codes[:, g_idx < 3].abs().max() <= 8
    assert torch.equal(scale[0::2, :3], scale[1::2, :3])  # row pairs share the INT4 group scales
    loaded = load_for_eval(out)
    assert "A4 per-token groups of 128 + 128 INT8 outliers" in loaded.description
    assert "KV4 per-head pre-RoPE" in loaded.description
    # the atom layout deploys exactly the simulation artifact's weights
    atom = load_for_eval(tmp_path / "atom").model
    for (name, pa), (_, pb) in zip(atom.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    packed = load_file(str(sorted((tmp_path / "atom").glob("model-*.safetensors"))[0]))
    assert packed["model.layers.0.mlp.down_proj.weight_int4"].shape == (256, 192)
    assert packed["model.layers.0.mlp.down_proj.scale_int4"].shape == (3, 1024)
    # the recipe's GPTQ minimizes against Hessians of the quantized inputs: float ones give other codes
    cli_ok("quantize", model, "-o", tmp_path / "float-h", *args, "--set", "export.format=quantkit",
           "--set", "calibration.hessian_inputs=float")
    other = load_file(str(sorted((tmp_path / "float-h").glob("model-*.safetensors"))[0]))
    assert not torch.equal(other["model.layers.0.mlp.down_proj.weight_codes"], codes)


def test_atom_on_stories260k_per_channel_fallback(stories260k, tinystories_txt, tmp_path):
    """Width 64 cannot set 128 outliers apart: a clear error; the per-channel fallback with 16 outliers runs."""
    from helpers import cli, cli_ok

    args = ["--recipe", "atom-w4a4", "--calib", tinystories_txt, "--num-samples", "4", "--seq-len", "64"]
    result = cli("quantize", stories260k, "-o", tmp_path / "x", *args)
    assert result.exit_code != 0 and "outliers=128" in result.output
    fallback = ["--set", "weights.granularity=channel", "--set", "weights.outliers=16", "--set",
                "activations.outliers=16", "--set", "activations.group_size=null", "--set", "export.format=quantkit"]
    cli_ok("quantize", stories260k, "-o", tmp_path / "pc", *args, *fallback)


def test_scale_layout_by_hand_and_round_trip():
    """Rows 0..15 of a tile fill its 64 slots: row r at (r % 8) 8 + (r // 8) % 2, four copies at stride 2."""
    import numpy as np

    from quantkit.formats.atom import gather_scales, scale_slots, scatter_scales

    slots = scale_slots(32)
    assert slots[0].tolist() == [0, 2, 4, 6] and slots[8].tolist() == [1, 3, 5, 7]
    assert slots[1].tolist() == [8, 10, 12, 14] and slots[16].tolist() == [64, 66, 68, 70]
    assert sorted(slots.reshape(-1).tolist()) == list(range(128))
    s = np.arange(32, dtype=np.float16)
    assert np.array_equal(gather_scales(scatter_scales(s)), s)


def test_atom_packer_round_trip_and_refusals():
    from quantkit.formats.atom import AtomPacker
    from quantkit.formats.base import ExportError
    from quantkit.quantizers import QuantizedLinear
    from quantkit.recipe import load_recipe

    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=128, clip_ratio=0.85, outliers=128,
                     row_block=2)
    w, _, order = _problem(n=32, k=384)
    codes, qp, g_idx = ordered_quantize(w, spec, order)
    q = QuantizedLinear(codes, qp, spec, g_idx)
    packer = AtomPacker(load_recipe("atom-w4a4"), torch.float16)
    packed = packer.pack(q)
    assert packed["weight_int4"].dtype == torch.uint8 and packed["weight_int4"].shape == (32, 128)
    assert packed["weight_int8"].shape == (32, 128) and packed["scale_int8"].shape == (128,)
    back = packer.unpack(packed, spec)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert torch.equal(back.g_idx, g_idx) and torch.equal(back.codes, codes)
    # hand check: the first byte holds reordered columns 0 (low nibble) and 1 (high nibble) of row 0
    first = packed["reorder_index"][:2].long()
    byte = int(packed["weight_int4"][0, 0])
    assert [byte & 0xF, byte >> 4] == [int(c) & 0xF for c in codes[0, first]]
    with pytest.raises(ExportError, match="multiple of 16"):
        packer.check("mlp.down_proj", spec, (40, 384))
    with pytest.raises(ExportError, match="groups of 128"):
        packer.check("mlp.down_proj", QuantSpec(bits=4, symmetric=True, group_size=64, outliers=128), (32, 384))
    corrupt = dict(packed, scale_int8=packed["scale_int8"].clone())
    corrupt["scale_int8"][2] += 1
    with pytest.raises(ExportError, match="corrupt"):
        packer.unpack(corrupt, spec)
    # the index is int16, as punica-atom's LinearInt4 stores it; a repeated column is refused, not scattered
    assert packed["reorder_index"].dtype == torch.int16
    assert torch.equal(packer.unpack(dict(packed, reorder_index=packed["reorder_index"].long()), spec).codes, codes)
    repeated = packed["reorder_index"].clone()
    repeated[1] = repeated[0]
    with pytest.raises(ExportError, match="not a permutation"):
        packer.unpack(dict(packed, reorder_index=repeated), spec)
    with pytest.raises(ExportError, match="int16 reorder_index"):
        packer.check("mlp.down_proj", spec, (32, 32768 + 128))
    packer.check("mlp.down_proj", spec, (32, 32768))  # indices 0 .. 32767 fit


def _atom_linear():
    from quantkit.quantizers import QuantizedLinear

    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=128, outliers=128, row_block=2)
    w, _, order = _problem(n=32, k=384)
    codes, qp, g_idx = ordered_quantize(w, spec, order)
    return QuantizedLinear(codes, qp, spec, g_idx)


def test_atom_packer_refuses_what_its_layout_cannot_hold():
    """An INT4 code outside [-8, 7], a scale fp16 cannot hold, column groups other than 128 + 128 outliers, and
    K = 128 (outliers only, no INT4 group) are refused, not written wrong."""
    from quantkit.formats.atom import AtomPacker
    from quantkit.formats.base import ExportError
    from quantkit.quantizers import QuantizedLinear
    from quantkit.recipe import load_recipe

    packer = AtomPacker(load_recipe("atom-w4a4"), torch.float16)
    q = _atom_linear()
    packer.pack(q)
    normal_col = int(torch.nonzero(q.g_idx == 0)[0])
    for bad in (8, -9):
        codes = q.codes.clone()
        codes[0, normal_col] = bad
        with pytest.raises(ExportError, match=r"outside \[-8, 7\]"):
            packer.pack(QuantizedLinear(codes, q.qparams, q.spec, q.g_idx))
    scale = q.qparams.scale.clone()
    scale[0, 0] = 0.1  # not an fp16 value
    with pytest.raises(ExportError, match="not float16 values"):
        packer.pack(QuantizedLinear(q.codes, q.qparams.map(lambda f, t: scale if f == "scale" else t), q.spec, q.g_idx))
    g_idx = q.g_idx.clone()
    g_idx[normal_col] = 1  # groups of 127 and 129
    with pytest.raises(ExportError, match="groups of 128"):
        packer.pack(QuantizedLinear(q.codes, q.qparams, q.spec, g_idx))
    with pytest.raises(ExportError, match="positive multiple"):
        packer.check("mlp.down_proj", q.spec, (32, 128))


def test_emulation_quantizes_activations_exactly_as_eval_simulates_them():
    """The kernel emulation's activation codes times scales equal, bit for bit, what eval's simulation feeds the
    model (per token and group of 128 at clip 0.9, one float32 order: max * clip / 7; INT8 outliers), so validate
    checks the activations eval scores."""
    import numpy as np

    from quantkit.emulate import emulate_atom
    from quantkit.formats.atom import AtomPacker
    from quantkit.recipe import load_recipe
    from quantkit.simulate import ActivationSim, fake_quantize_activation

    q = _atom_linear()
    tensors = AtomPacker(load_recipe("atom-w4a4"), torch.float16).pack(q)
    _, x, _ = _problem(n=32, k=384, seed=1)
    x = x[:16].float()
    emulated = emulate_atom(tensors, x.numpy(), bits=4, clip_ratio=0.9)
    groups = np.repeat(np.arange(emulated.s_x.shape[1]), 128)
    x_hat = np.empty_like(emulated.x_codes, dtype=np.float32)
    x_hat[:, emulated.order] = emulated.x_codes * emulated.s_x[:, groups]
    sim = ActivationSim(bits=4, group_size=128, outliers=128, clip_ratio=0.9)
    simulated = fake_quantize_activation(x, sim, q.g_idx).numpy()
    assert np.array_equal(x_hat, simulated)


def test_outlier_order_sorts_each_roles_input_channels_by_square_sum(tmp_path):
    """outlier_order: each role's column order lists its input channels by ascending sum of x^2 over every
    calibration token (all chunks), so the largest come last as the INT8 outliers; the square-sums are
    recomputed here from plain hooks on the block's first linear of each role."""
    from quantkit.models.block import BlockRunner, build_block
    from quantkit.models.source import open_model
    from quantkit.passes import LayerWork
    from quantkit.passes.outliers import OutlierOrder, OutlierOrderConfig
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    source = open_model(write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                             num_hidden_layers=1)))
    linears = {n: r for r, n in source.adapter.linear_names()}
    inputs = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(6)) * torch.rand(
        64, generator=torch.Generator().manual_seed(7))  # uneven channels
    work = LayerWork(index=0, block=build_block(source, 0), linears=linears, specs={}, inputs=inputs,
                     runner=BlockRunner(source, 16, batch_size=2), adapter=source.adapter, config=source.config)
    firsts: dict[str, str] = {}
    for name, role in linears.items():
        firsts.setdefault(role, name)
    seen: dict[str, list[torch.Tensor]] = {r: [] for r in firsts}
    work.forward({n: (lambda x, r=r: seen[r].append(x.detach().reshape(-1, x.shape[-1]).double()))
                  for r, n in firsts.items()})
    OutlierOrder(OutlierOrderConfig()).run(work)
    assert sorted(work.column_order) == sorted(firsts)
    for role, xs in seen.items():
        s = torch.cat(xs).square().sum(dim=0)
        order = work.column_order[role]
        assert sorted(order.tolist()) == list(range(s.numel()))
        along = s[order]
        assert (along[1:] >= along[:-1] * (1 - 1e-6)).all(), role


def test_atom_tensors_have_linearint4_dtypes_shapes_and_config():
    """LinearInt4's buffers (atom.py docstring, after punica-atom): reorder_index int16 [K], weight_int4 uint8
    [N, (K - 128) / 2], weight_int8 int8 [N, 128] holding the outlier columns' codes, scale_int4 fp16 [G, 4N] and
    scale_int8 fp16 [4N]; row 9 of a tile sits at (9 % 8) 8 + (9 // 8) % 2 = 9 and its copies at 11, 13, 15."""
    from quantkit.formats.atom import AtomPacker
    from quantkit.recipe import load_recipe

    q = _atom_linear()  # N = 32, K = 384: two INT4 groups and 128 outliers
    packer = AtomPacker(load_recipe("atom-w4a4"), torch.float16)
    t = packer.pack(q)
    expected = {"reorder_index": (torch.int16, (384,)), "weight_int4": (torch.uint8, (32, 128)),
                "weight_int8": (torch.int8, (32, 128)), "scale_int4": (torch.float16, (2, 128)),
                "scale_int8": (torch.float16, (128,))}
    assert {name: (v.dtype, tuple(v.shape)) for name, v in t.items()} == expected
    outlier_cols = torch.nonzero(q.g_idx == 2).flatten()
    assert torch.equal(t["reorder_index"][256:].long(), outlier_cols)
    assert torch.equal(t["weight_int8"], q.codes[:, outlier_cols])
    scale = q.qparams.scale
    for slot in (9, 11, 13, 15):
        assert float(t["scale_int4"][1, slot]) == float(scale[9, 1])
        assert float(t["scale_int8"][slot]) == float(scale[9, 2])
    config = packer.quantization_config({"down": q.spec})
    assert {k: v for k, v in config.items() if k != "note"} == {
        "quant_method": "atom", "wbits": 4, "group_size": 128, "outliers": 128, "outlier_bits": 8}


def test_activation_sim_clips_per_token_and_keeps_outliers_without_groups():
    """Per token with a clip ratio (no groups): INT8 at clip 0.5 on [254, 100, -254, 0.5] has s = 1, so 254 and -254
    saturate at 127 and -128. Outliers without groups (group_size None): the normal columns [7, 3.4, -1, 2.5] are
    one INT4 group, s = 7 / 7 = 1 -> [7, 3, -1, 2]; the last two columns [127, 0.6] are INT8 over themselves,
    s = 127 / 127 = 1 -> [127, 1] (quantizing all six together at INT4 would give s = 127 / 7)."""
    from quantkit.simulate import ActivationSim, fake_quantize_activation

    clipped = fake_quantize_activation(torch.tensor([[254.0, 100.0, -254.0, 0.5]]), ActivationSim(8, clip_ratio=0.5))
    assert clipped.tolist() == [[127.0, 100.0, -128.0, 0.0]]
    x = torch.tensor([[7.0, 3.4, -1.0, 2.5, 127.0, 0.6]])
    got = fake_quantize_activation(x, ActivationSim(bits=4, outliers=2))
    assert got.tolist() == [[7.0, 3.0, -1.0, 2.0, 127.0, 1.0]]


def test_recipes_simulate_what_the_papers_run():
    """The eval simulation each recipe asks for, against the digests: Atom quantizes activations symmetric INT4 per
    (token, group of 128) at clip 0.9 with 128 INT8 outlier channels, and the KV cache asymmetric INT4 per head with
    keys before RoPE; QoQ per-token symmetric INT8 (no clip) and KV4 asymmetric after RoPE. An asymmetric
    activation setting reaches the simulation too."""
    from quantkit.recipe import load_recipe
    from quantkit.simulate import ActivationSim, KVSim, sims_for

    assert sims_for(load_recipe("atom-w4a4")) == (ActivationSim(4, True, 128, 128, 0.9), KVSim(4, False, True))
    assert sims_for(load_recipe("qoq")) == (ActivationSim(8, True, None, 0, 1.0), KVSim(4, False, False))
    act, kv = sims_for(load_recipe("rtn-w8a8", ["activations.symmetric=false"]))
    assert act == ActivationSim(8, False) and kv is None


def test_pre_rope_kv_splits_heads_by_the_configs_head_dim(tmp_path):
    """A model whose head_dim (64) is not hidden_size / heads (32): the pre-RoPE hook quantizes each KV head's 64
    channels as one vector, not 32-channel halves."""
    from quantkit import simulate
    from quantkit.models.block import build_block
    from quantkit.models.source import open_model
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    source = open_model(write_synthetic_llama(tmp_path / "m", SyntheticLlama(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        model_type="mistral", head_dim=64)))
    block = build_block(source, 0)
    sim = simulate.KVSim(bits=4, pre_rope=True)
    k_proj = block.get_submodule(source.adapter.k_proj)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    raw = k_proj(x).detach()
    assert raw.shape[-1] == 128
    handles = simulate.attach([block], [], source.config, None, sim, adapter=source.adapter)
    quantized = k_proj(x).detach()
    for h in handles:
        h.remove()
    assert torch.equal(quantized, simulate.fake_quantize_kv(raw.unflatten(-1, (2, 64)), sim).flatten(-2))


def test_atom_check_compares_every_groups_int32_sums():
    """check_atom is exact only if every group's partial sums equal the reference codes' products: one sum off by
    one in the first INT4 group, or in the INT8 outlier group, is a mismatch."""
    import numpy as np

    from quantkit.emulate import check_atom, emulate_atom
    from quantkit.formats.atom import AtomPacker
    from quantkit.recipe import load_recipe

    q = _atom_linear()
    tensors = AtomPacker(load_recipe("atom-w4a4"), torch.float16).pack(q)
    _, x, _ = _problem(n=32, k=384, seed=2)
    x = x[:4].float().numpy()
    assert check_atom(emulate_atom(tensors, x, 4, 0.9), q, x, 4, 0.9).exact
    for group in (0, -1):
        emulation = emulate_atom(tensors, x, 4, 0.9)
        emulation.partials = np.array(emulation.partials)
        emulation.partials[group, 0, 0] += 1
        assert not check_atom(emulation, q, x, 4, 0.9).exact, group


def test_gptq_along_the_natural_order_keeps_the_outlier_groups_g_idx() -> None:
    """GPTQ's natural-order Atom groups keep g_idx (the outlier group is not group_size wide), so it dequantizes."""
    # Groups of 32, then the 16 INT8 outlier columns: g_idx equals k // 32, but scales [N, 3] of groups of 32 do not
    # cover K = 80 without it. With a diagonal Hessian (no error moves) the result is exactly round-to-nearest's.
    w, _, _ = _problem()
    h = torch.diag(torch.rand(80, generator=torch.Generator().manual_seed(1)) + 0.5)
    config = GPTQConfig(act_order=False, static_groups=False)
    result, _ = gptq_with_factor(w, factor_hessian(h, config), ATOM, config, torch.float32)
    codes, qp, g_idx = ordered_quantize(w, ATOM, torch.arange(80), torch.float32)
    assert result.g_idx is not None and result.g_idx.tolist() == [0] * 32 + [1] * 32 + [2] * 16
    assert torch.equal(result.codes, codes) and torch.equal(result.qparams.scale, qp.scale)
    assert torch.equal(result.dequantize(), dequantize(codes, qp, g_idx))


def test_gptq_pass_without_an_outlier_order_keeps_the_natural_order() -> None:
    """Without outlier_order, the GPTQ pass takes INT8 outliers from the last natural columns, also in act-order."""
    # As RTN and the README say; act-order would visit the most active columns first and leave the least active, last
    # visited, for the INT8 group. The natural outlier columns here carry the largest inputs.
    from torch import nn

    from quantkit.passes import LayerWork
    from quantkit.passes.gptq import GPTQ

    w, x, _ = _problem()
    x[:, 64:] *= 10
    h = 2 * x.T @ x / x.shape[0]
    block = nn.ModuleDict({"lin": nn.Linear(80, 8, bias=False)})
    block["lin"].weight.data = w.clone()
    config = GPTQConfig(act_order=True, static_groups=False)
    work = LayerWork(index=0, block=block, linears={"lin": "down"}, specs={"lin": ATOM}, scale_dtype=torch.float32,
                     hessians={"down": h.clone()})
    GPTQ(config).run(work)
    got = work.results["lin"]
    expected, _ = gptq_with_factor(w, factor_hessian(h, config, order=torch.arange(80)), ATOM, config, torch.float32)
    assert got.g_idx.tolist() == [0] * 32 + [1] * 32 + [2] * 16
    assert torch.equal(got.codes, expected.codes) and torch.equal(got.qparams.scale, expected.qparams.scale)
    assert got.codes[:, 64:].abs().max() > 7  # INT8 codes on the large columns

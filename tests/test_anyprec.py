"""Any-Precision: bitplane layout, SqueezeLLM seed clustering and incremental upscaling (prefix codes)."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from quantkit.formats.anyprec_layout import column_map, lut_dequantize, pack_planes, unpack_planes
from quantkit.nonuniform import (
    SortedRows,
    _draw,
    _kmeanspp_starts,
    any_precision,
    codes_from_borders,
    kmeans_rows,
    split_clusters,
)


@pytest.mark.parametrize("k", [32, 576, 1024, 1536, 2144, 4096])
def test_column_map_is_a_permutation(k):
    assert sorted(column_map(k).reshape(-1).tolist()) == list(range(k))


def test_column_map_matches_packbits_with_the_warp_byte_permutation():
    """The authors' construction for full chunks: np.packbits along the row (big-endian bytes), then within each
    128-byte warp span byte b goes to thread b % 32 at little-endian byte slot (b // 32) XOR 3."""
    k = 2048
    codes = np.random.default_rng(0).integers(0, 2, (3, k))
    plane = pack_planes(codes, 1)[0].view(np.uint32)
    packed = np.packbits(codes.astype(np.uint8), axis=1)  # [3, K/8]
    expect = np.zeros((3, k // 32, 4), dtype=np.uint8)
    for b in range(k // 8):
        chunk, within = divmod(b, 128)
        expect[:, 32 * chunk + within % 32, (within // 32) ^ 3] = packed[:, b]
    assert np.array_equal(plane, expect.view("<u4")[..., 0])


def test_tail_chunk_by_hand():
    """K = 1056: one full chunk and a 32-column tail worked by one thread, whose byte j holds columns
    1024 + 8 j .. + 7 (W/4 = 8 apart)."""
    cmap = column_map(1056)
    assert cmap[32].tolist() == list(range(1024, 1056))
    assert cmap[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 256]


@pytest.mark.parametrize(("n", "k"), [(4, 576), (3, 1536), (2, 2144)])
def test_planes_round_trip_and_prefixes(n, k):
    codes = np.random.default_rng(k).integers(0, 256, (n, k))
    planes = pack_planes(codes, 8)
    assert planes.dtype == np.int32 and planes.shape == (8, n, k // 32)
    for bits in range(1, 9):
        assert np.array_equal(unpack_planes(planes, bits), codes >> (8 - bits))
        assert np.array_equal(unpack_planes(planes[:bits], bits), codes >> (8 - bits))  # only the first b planes


def test_pack_planes_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_planes(np.zeros((2, 40), dtype=np.int64), 3)
    with pytest.raises(ValueError, match=r"\[0, 7\]"):
        pack_planes(np.full((2, 32), 8), 3)


def _row_problem(n: int = 6, k: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    f = torch.rand(n, k, generator=g) ** 4  # uneven sensitivities
    return w, f


def _weighted_error(w: torch.Tensor, f: torch.Tensor, codes: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    return (f * (w - torch.gather(lut, 1, codes)) ** 2).sum(dim=1)


def test_seed_kmeans_is_a_weighted_lloyd_fixed_point():
    """Every centroid is the sensitivity-weighted mean of its members, every weight is nearest its centroid, and
    the LUT is ascending."""
    w, f = _row_problem()
    rows = SortedRows.build(w, f)
    centroids, borders = kmeans_rows(rows, 8)
    codes = codes_from_borders(rows, borders)
    assert (centroids[:, 1:] >= centroids[:, :-1]).all()
    for r in range(w.shape[0]):
        for j in range(8):
            members = codes[r] == j
            if members.any():
                mean = (f[r, members].double() * w[r, members].double()).sum() / f[r, members].double().sum()
                assert float(centroids[r, j]) == pytest.approx(float(mean), rel=1e-9, abs=1e-12)
        nearest = (w[r, :, None].double() - centroids[r]).abs().argmin(dim=1)
        assert torch.equal((w[r, :, None].double() - centroids[r]).abs().gather(1, nearest[:, None]),
                           (w[r, :, None].double() - centroids[r]).abs().gather(1, codes[r, :, None]))


def test_seed_restarts_keep_the_least_cost_per_row_and_repeat():
    """k-means++ restarts never leave a row worse than the quantile start, improve rows with heavy-tailed
    sensitivities (as Fisher information is), and the same call gives the same clustering."""
    w, _ = _row_problem(n=32, k=256)
    f = torch.exp(3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    rows = SortedRows.build(w, f)
    quantile = rows.cost(*reversed(kmeans_rows(rows, 8, restarts=0)))
    centroids, borders = kmeans_rows(rows, 8)
    best = rows.cost(borders, centroids)
    assert (best <= quantile).all() and float(best.sum()) < 0.95 * float(quantile.sum())
    assert (centroids[:, 1:] >= centroids[:, :-1]).all()
    again = kmeans_rows(rows, 8)
    assert torch.equal(again[0], centroids) and torch.equal(again[1], borders)
    # the cost is the weighted squared error of the codes it describes
    codes = codes_from_borders(rows, borders)
    direct = _weighted_error(w.double(), f.double(), codes, centroids)
    assert torch.allclose(best, direct, rtol=1e-9)


def test_kmeanspp_draw_follows_the_weights_and_never_picks_a_zero():
    """The inverse-CDF draw behind k-means++: indices with zero weight (leading, inner, a zero tail) are never
    drawn, a single positive entry always is, and frequencies follow the weights."""
    rows = [[0.0, 1.0, 0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0], [1e-300, 0.0, 0.0, 0.0, 0.0, 0.0]]
    p = torch.tensor(rows, dtype=torch.float64).repeat(20000, 1)
    picks = _draw(p.cumsum(dim=1), torch.Generator().manual_seed(0)).reshape(20000, 3)
    assert set(picks[:, 0].tolist()) == {1, 3}
    assert (picks[:, 1] == 5).all() and (picks[:, 2] == 0).all()
    share = float((picks[:, 0] == 3).double().mean())
    assert abs(share - 0.75) < 0.01  # 20000 draws: the standard error is 0.003


def test_best_split_is_the_exhaustive_optimum():
    """For each cluster the split equals a brute-force search over all split points of the sorted members."""
    w, f = _row_problem(n=3, k=64)
    rows = SortedRows.build(w, f)
    centroids, borders = kmeans_rows(rows, 4)
    _, child = split_clusters(rows, borders, centroids)
    x, g = rows.values, torch.gather(f.double(), 1, rows.order)
    for r in range(3):
        for j in range(4):
            lo, hi = int(borders[r, j]), int(borders[r, j + 1])

            def cost(m: int, r: int = r, lo: int = lo, hi: int = hi) -> float:
                total = 0.0
                for a, b in ((lo, m), (m, hi)):
                    if b > a:
                        c = (g[r, a:b] * x[r, a:b]).sum() / g[r, a:b].sum()
                        total += float((g[r, a:b] * (x[r, a:b] - c) ** 2).sum())
                return total

            best = min(range(lo + 1, hi + 1), key=cost)
            assert int(child[r, 2 * j]) == lo
            assert cost(int(child[r, 2 * j + 1])) == pytest.approx(cost(best), rel=1e-9, abs=1e-15)


def test_any_precision_prefix_property_and_monotone_error():
    """Parent codes prefix every width's codes, each LUT is ascending, the parent LUT is kept, and the weighted
    error falls with every bit."""
    w, f = _row_problem()
    codes, luts = any_precision(w, f, seed_bits=3, parent_bits=8)
    assert sorted(luts) == [3, 4, 5, 6, 7, 8] and codes.max() < 256
    errors = []
    for bits, lut in luts.items():
        c = codes >> (8 - bits)
        assert lut.shape == (w.shape[0], 1 << bits) and (lut[:, 1:] >= lut[:, :-1]).all()
        errors.append(_weighted_error(w.double(), f.double(), c, lut.double()))
    for a, b in itertools.pairwise(errors):
        assert (b <= a * (1 + 1e-6)).all()
    assert (errors[-1] < errors[0] / 100).all()
    # the packed artifact reproduces every width's weights exactly
    planes = pack_planes(codes.numpy(), 8)
    for bits, lut in luts.items():
        deq = lut_dequantize(unpack_planes(planes, bits), lut.numpy())
        assert np.array_equal(deq, torch.gather(lut, 1, codes >> (8 - bits)).numpy())


def test_zero_weights_and_zero_sensitivity_rows():
    """Exact zeros get no sensitivity; a row with none left is clustered unweighted; a constant row survives."""
    w = torch.tensor([[0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0] * 4, [1.5] * 32])
    f = torch.tensor([[1.0] * 32, [0.0] * 32])
    codes, luts = any_precision(w, f, seed_bits=2, parent_bits=4)
    assert torch.isfinite(luts[4]).all()
    assert torch.equal(torch.gather(luts[4], 1, codes)[1], w[1])


def _codebook_result(n: int = 8, k: int = 64):
    from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

    w, f = _row_problem(n, k)
    codes, luts = any_precision(w, f, 3, 8)
    spec = QuantSpec(bits=8, granularity="channel", codebook=True, min_bits=3)
    lut = torch.cat([luts[b].half().float() for b in range(3, 9)], dim=1)
    qp = QParams(scale=None, zero=None, group_size=k, lut=lut, code_offset=128)
    return QuantizedLinear((codes - 128).to(torch.int8), qp, spec), codes, luts


def test_codebook_spec_validation():
    from quantkit.quantizers import QuantSpec

    with pytest.raises(ValueError, match="granularity=channel"):
        QuantSpec(bits=4, granularity="group", codebook=True)
    with pytest.raises(ValueError, match="min_bits"):
        QuantSpec(bits=4, granularity="channel", codebook=True, min_bits=5)
    with pytest.raises(ValueError, match="min_bits"):
        QuantSpec(bits=4, granularity="channel", min_bits=3)


def test_at_bits_reads_the_prefix_and_its_table():
    q, codes, luts = _codebook_result()
    assert torch.equal(q.dequantize(), torch.gather(luts[8].half().float(), 1, codes))
    for bits in range(3, 9):
        narrow = q.at_bits(bits)
        assert narrow.spec.bits == bits
        assert torch.equal(narrow.dequantize(), torch.gather(luts[bits].half().float(), 1, codes >> (8 - bits)))
    with pytest.raises(ValueError, match="3..8"):
        q.at_bits(2)


def test_anyprec_packer_round_trip():
    from quantkit.formats.anyprec import AnyPrecisionPacker
    from quantkit.formats.base import ExportError
    from quantkit.recipe import load_recipe

    q, _, _ = _codebook_result()
    packer = AnyPrecisionPacker(load_recipe("anyprec-3to8"), torch.float16)
    packed = packer.pack(q)
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (8, 8, 2)
    assert sorted(k for k in packed if k.startswith("lut")) == [f"lut{b}" for b in range(3, 9)]
    assert packed["lut3"].dtype == torch.float16 and packed["lut3"].shape == (8, 8)
    back = packer.unpack(packed, q.spec)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.qparams.lut, q.qparams.lut)
    for bits in range(3, 9):
        assert torch.equal(back.at_bits(bits).dequantize(), q.at_bits(bits).dequantize())
    with pytest.raises(ExportError, match="multiple of 32"):
        packer.check("mlp.down_proj", q.spec, (64, 172))


def test_anyprec_end_to_end_serves_every_width(tmp_path, calib_txt, monkeypatch):
    """anyprec-3to8 on a synthetic Llama: the anyprec artifact and the quantkit simulation artifact of the same
    run give identical weights at every width, narrower widths differ, and a width outside 3..8 is refused."""
    from helpers import cli, cli_ok, wikitext_rows

    from quantkit.eval.loading import load_for_eval
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=2))
    args = ["--recipe", "anyprec-3to8", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    cli_ok("quantize", model, "-o", tmp_path / "ap", *args)
    cli_ok("quantize", model, "-o", tmp_path / "sim", *args, "--set", "export.format=quantkit")
    assert not (tmp_path / "ap" / "fisher").exists()
    weights = {}
    for bits in (3, 5, 8):
        a = load_for_eval(tmp_path / "ap", dtype=torch.float16, bits=bits)
        b = load_for_eval(tmp_path / "sim", dtype=torch.float16, bits=bits)
        assert f"read at {bits} bits" in a.description
        wa = a.model.model.layers[1].mlp.down_proj.weight.detach()
        assert torch.equal(wa, b.model.model.layers[1].mlp.down_proj.weight)
        weights[bits] = wa
    assert not torch.equal(weights[3], weights[8])
    fp = load_for_eval(model, dtype=torch.float16).model.model.layers[1].mlp.down_proj.weight.detach()
    errors = [float((weights[b].float() - fp.float()).pow(2).mean()) for b in (3, 5, 8)]
    assert errors[0] > errors[1] > errors[2]
    result = cli("eval", tmp_path / "ap", "--bits", "2", "--limit", "1", "--data-dir", wikitext_rows(tmp_path / "d"))
    assert result.exit_code != 0 and "widths 3..8" in result.output
    validated = " ".join(cli_ok("validate", tmp_path / "ap").output.split())
    assert "every packed linear matches" in validated  # every width, emulated
    # its exact column is the decoded codes (a lookup GEMV has no int32 sums to compare)
    assert "codes: the codes the emulation decodes from the bitplanes" in validated and "int32" not in validated


class _AuthorsLinear(torch.nn.Module):
    """The buffers any-precision-llm's `AnyPrecisionLinear` registers (qweight [max bits, N, K/32] int32, lut{b}
    [N, 2^b] fp16, an fp16 bias), with a CPU dequantization in place of its CUDA extension."""

    def __init__(self, k: int, n: int, supported_bits: list[int], bias: bool):
        super().__init__()
        self.register_buffer("qweight", torch.empty((max(supported_bits), n, k // 32), dtype=torch.int32))
        for b in supported_bits:
            self.register_buffer(f"lut{b}", torch.empty((n, 2**b), dtype=torch.float16))
        self.register_buffer("bias", torch.empty(n, dtype=torch.float16) if bias else None)

    def weight_at(self, bits: int) -> torch.Tensor:
        codes = unpack_planes(self.qweight.numpy(), bits)
        return torch.from_numpy(lut_dequantize(codes, getattr(self, f"lut{bits}").numpy()))


@pytest.mark.filterwarnings("ignore:The following device_map keys")  # the loader maps state_dict keys, not modules
def test_anyprec_artifact_loads_the_way_the_authors_loader_does(tmp_path, calib_txt, monkeypatch):
    """A restatement of any-precision-llm's `AnyPrecisionForCausalLM.from_quantized`: AutoConfig, an empty model
    from the config, the `anyprec.arch_config` linears of every block swapped for `AnyPrecisionLinear`'s buffers,
    then accelerate's `load_checkpoint_and_dispatch`. Every buffer and parameter is filled from the artifact, and
    the weights it serves at each width are the ones `quantkit eval --bits` uses; the untargeted down_proj loads
    as a plain linear."""
    pytest.importorskip("accelerate", reason="accelerate (the [eval] extra) drives the authors' loader")
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from helpers import cli_ok
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.eval.loading import load_for_eval
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=2, model_type="qwen2",
                                                                  attention_bias=True))
    out = tmp_path / "ap"
    cli_ok("quantize", model, "-o", out, "--recipe", "anyprec-3to8", "--calib", calib_txt, "--num-samples", "4",
           "--seq-len", "64", "--set", "targets=[qkv, o, gate_up]")

    config = AutoConfig.from_pretrained(out)
    entry = config.anyprec
    assert entry["group_count"] == 1  # as the authors' pack writes it
    assert entry["arch_config"] == {"model_name": "model", "layers_name": "layers", "module_names": [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj"]}
    supported = list(range(entry["seed_precision"], entry["parent_precision"] + 1))
    assert supported == [3, 4, 5, 6, 7, 8]
    with init_empty_weights():
        lm = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float16)
    blocks = getattr(getattr(lm, entry["arch_config"]["model_name"]), entry["arch_config"]["layers_name"])
    for block in blocks:
        for name in entry["arch_config"]["module_names"]:
            parent, _, leaf = name.rpartition(".")
            old = block.get_submodule(name)
            block.get_submodule(parent).register_module(
                leaf, _AuthorsLinear(old.in_features, old.out_features, supported, old.bias is not None))
    lm.tie_weights()
    load_checkpoint_and_dispatch(lm, checkpoint=str(out), device_map={k: "cpu" for k in lm.state_dict()},
                                 no_split_module_classes=[type(blocks[0]).__name__], dtype=torch.float16)

    from safetensors.torch import load_file

    stored = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    loaded = lm.state_dict()
    assert set(loaded) == set(stored)
    for key, tensor in loaded.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, stored[key]), key
    for bits in (3, 8):
        reference = load_for_eval(out, dtype=torch.float16, bits=bits).model.model.layers[1]
        for name in entry["arch_config"]["module_names"]:
            served = blocks[1].get_submodule(name).weight_at(bits)
            assert torch.equal(served, reference.get_submodule(name).weight.detach()), (bits, name)
    assert isinstance(blocks[1].mlp.down_proj, torch.nn.Linear)
    assert torch.equal(blocks[1].mlp.down_proj.weight, reference.mlp.down_proj.weight.detach())


def test_fisher_cache_follows_the_checkpoint_bytes(tmp_path, calib_txt, monkeypatch):
    """A copy of the checkpoint elsewhere, with new mtimes, reuses the Fisher computed for the original (its
    cache is keyed by content); a checkpoint with other weights computes its own."""
    from helpers import cli, cli_ok  # cli lets exceptions through

    import quantkit.fisher
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    config = SyntheticLlama(hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    model = write_synthetic_llama(tmp_path / "m", config)
    args = ["--recipe", "anyprec-3to8", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    cli_ok("quantize", model, "-o", tmp_path / "a", *args)
    copy = shutil.copytree(model, tmp_path / "copy", copy_function=shutil.copyfile)  # new mtimes

    def no_recompute(*_, **__):
        raise AssertionError("Fisher recomputed")

    monkeypatch.setattr(quantkit.fisher, "diagonal_fisher", no_recompute)
    cli_ok("quantize", copy, "-o", tmp_path / "b", *args)
    other = write_synthetic_llama(tmp_path / "other", config, seed=1)
    with pytest.raises(AssertionError, match="Fisher recomputed"):
        cli("quantize", other, "-o", tmp_path / "c", *args)


def test_fisher_cache_is_written_whole_even_when_runs_race(tmp_path, calib_txt, monkeypatch):
    """The Fisher files are computed in a directory of the run's own and renamed into place: a partial directory
    in place (a run that wrote there and was cut off) is replaced, and a run that finds another's complete copy
    already in place when it finishes uses it, where two runs sharing the key deleted each other's files."""
    import shutil

    from helpers import cli_ok

    import quantkit.fisher
    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=2))
    args = ["--recipe", "anyprec-3to8", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    cli_ok("quantize", model, "-o", tmp_path / "a", *args)
    (cached,) = (tmp_path / "cache" / "fisher").iterdir()
    (cached / "complete.json").unlink()  # cut off in place
    (cached / "fisher-00001.safetensors").unlink()
    cli_ok("quantize", model, "-o", tmp_path / "b", *args)
    assert sorted(p.name for p in cached.iterdir()) == ["complete.json", "fisher-00000.safetensors",
                                                        "fisher-00001.safetensors"]
    real = quantkit.fisher.diagonal_fisher

    def raced(source, tokens, names, work_dir, progress=None):  # another run completes the same key meanwhile
        paths = real(source, tokens, names, work_dir, progress)
        final = work_dir.parent / work_dir.name.split(".")[1]
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(work_dir, final)
        (final / "complete.json").write_text("{}")
        return paths

    shutil.rmtree(cached)
    monkeypatch.setattr(quantkit.fisher, "diagonal_fisher", raced)
    cli_ok("quantize", model, "-o", tmp_path / "c", *args)
    assert [p.name for p in (tmp_path / "cache" / "fisher").iterdir()] == [cached.name]  # no leftover of its own
    a, c = (json.loads((tmp_path / d / "quantkit_manifest.json").read_text())["files"] for d in ("a", "c"))
    assert {k: v["sha256"] for k, v in a.items() if "model-0" in k} == {
        k: v["sha256"] for k, v in c.items() if "model-0" in k}


def test_anyprec_on_a_bfloat16_checkpoint(tmp_path, calib_txt, monkeypatch):
    """Llama 3 and Mistral ship bfloat16, and the authors' loader builds float16 models only (the tables are fp16
    in any case): the checkpoint is read as float16, a weight past float16's range is named before any table could
    hold an inf, every width exports and the kernel check passes; --dtype bfloat16 is refused."""
    from helpers import cli, cli_ok, set_weight

    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=1, dtype="bfloat16"))
    args = ["--recipe", "anyprec-3to8", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    refused = cli("quantize", model, "-o", tmp_path / "no", *args, "--dtype", "bfloat16")
    assert refused.exit_code == 2 and "anyprec checkpoints must be float16" in refused.output
    cli_ok("quantize", model, "-o", tmp_path / "ap", *args)
    assert json.loads((tmp_path / "ap" / "config.json").read_text())["torch_dtype"] == "float16"
    assert "every packed linear matches" in cli_ok("validate", tmp_path / "ap").output
    set_weight(model, "model.layers.0.mlp.down_proj.weight", 70000.0, at=(0, 0))
    past = cli("quantize", model, "-o", tmp_path / "inf", *args)
    assert past.exit_code == 2 and "'model.layers.0.mlp.down_proj.weight' holds 70144, past float16's range" in (
        " ".join(past.output.split()))


def test_anyprec_on_stories260k(stories260k, tinystories_txt, tmp_path, monkeypatch):
    """stories260K's down_proj (K = 172) does not fit the bitplanes: the export says so, the simulation artifact
    quantizes and evaluates at 3 bits."""
    from helpers import cli, cli_ok

    from quantkit.eval.loading import load_for_eval

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    args = ["--recipe", "anyprec-3to8", "--calib", tinystories_txt, "--num-samples", "4", "--seq-len", "64"]
    result = cli("quantize", stories260k, "-o", tmp_path / "x", *args)
    assert result.exit_code != 0 and "172" in result.output and "export.format=quantkit" in result.output
    cli_ok("quantize", stories260k, "-o", tmp_path / "sim", *args, "--set", "export.format=quantkit")
    assert "read at 3 bits" in load_for_eval(tmp_path / "sim", bits=3).description


def test_a_killed_fisher_computation_leaves_nothing_behind(tmp_path, calib_txt, monkeypatch):
    """A run killed in the Fisher pass leaves its temp directory in the cache (per-layer inputs and Fisher files):
    the next computation deletes those whose process has ended, and leaves a live run's alone."""
    import socket
    import subprocess
    import sys

    from helpers import cli_ok

    from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=1))
    fisher = tmp_path / "cache" / "fisher"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stale, live = fisher / ".0123456789abcdef.x1.tmp", fisher / ".0123456789abcdef.x2.tmp"
    for path, pid in ((stale, dead.pid), (live, running.pid)):
        path.mkdir(parents=True)
        (path / "owner.json").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
        (path / "inputs-00000.safetensors").write_bytes(b"x" * 1000)
    (fisher / ".unstamped.tmp").mkdir()  # not a run's (no stamp): left alone
    try:
        cli_ok("quantize", model, "-o", tmp_path / "a", "--recipe", "anyprec-3to8", "--calib", calib_txt,
               "--num-samples", "4", "--seq-len", "64")
    finally:
        running.kill()
        running.wait()
    names = sorted(p.name for p in fisher.iterdir())
    assert stale.name not in names and live.name in names and ".unstamped.tmp" in names


def test_anyprec_packer_refuses_infinite_centroids_and_missing_planes():
    """An infinite centroid passes the fp16 round trip (inf == inf) but is no table entry: refused, as is one that
    float16 would round. An artifact missing its last plane reads as 7-bit codes, which an 8-bit spec must refuse
    rather than unpack."""
    from quantkit.formats.anyprec import AnyPrecisionPacker
    from quantkit.formats.base import ExportError
    from quantkit.quantizers import QuantizedLinear
    from quantkit.recipe import load_recipe

    q, _, _ = _codebook_result()
    packer = AnyPrecisionPacker(load_recipe("anyprec-3to8"), torch.float16)
    lut = q.qparams.lut.clone()
    lut[0, -1] = float("inf")
    infinite = QuantizedLinear(q.codes, q.qparams.map(lambda f, t: lut if f == "lut" else t), q.spec)
    with pytest.raises(ExportError, match="finite"):
        packer.pack(infinite)
    lut[0, -1] = 1 + 2**-12  # between two float16 values: stored, it would be another centroid
    inexact = QuantizedLinear(q.codes, q.qparams.map(lambda f, t: lut if f == "lut" else t), q.spec)
    with pytest.raises(ExportError, match="lut8 in float16, but the quantizer's values are not float16 values"):
        packer.pack(inexact)
    packed = packer.pack(q)
    with pytest.raises(ExportError, match="7 planes"):
        packer.unpack(dict(packed, qweight=packed["qweight"][:7]), q.spec)


def test_exact_zero_weights_get_no_sensitivity_by_hand():
    """Weights equal to 0 (pruned, or never trained) weigh nothing in the clustering, whatever their Fisher
    value, as the authors' code does: row [0, 1, 2, 0] with sensitivities [5, 1, 3, 5] sorts to [0, 0, 1, 2] with
    weights [0, 0, 1, 3], so the prefix sums of f are [0, 0, 0, 1, 4], and one cluster sits at the weighted mean
    of the non-zero weights, (1 + 6) / 4."""
    rows = SortedRows.build(torch.tensor([[0.0, 1.0, 2.0, 0.0]]), torch.tensor([[5.0, 1.0, 3.0, 5.0]]))
    assert rows.values.tolist() == [[0.0, 0.0, 1.0, 2.0]]
    assert rows.f.tolist() == [[0.0, 0.0, 0.0, 1.0, 4.0]]
    assert rows.fw.tolist() == [[0.0, 0.0, 0.0, 1.0, 7.0]]
    centroids, _ = kmeans_rows(rows, 1, restarts=0)
    assert centroids.tolist() == [[1.75]]


def test_seed_starts_from_the_weighted_quantile_midpoints_by_hand():
    """The quantile start of k clusters takes the values at the weighted quantiles (j + 1/2) / k. Row 1..8 with
    sensitivities [1] * 7 + [9] (total 16), two clusters: targets 4 and 12 pick the values 4 and 8; one Lloyd
    step splits at their midpoint 6, giving centroids mean(1..6) = 3.5 and (7 + 9 x 8) / 10 = 7.9."""
    w = torch.arange(1.0, 9.0)[None]
    f = torch.tensor([[1.0] * 7 + [9.0]])
    centroids, borders = kmeans_rows(SortedRows.build(w, f), 2, max_iter=1, restarts=0)
    assert borders.tolist() == [[0, 6, 8]]
    assert centroids[0].tolist() == pytest.approx([3.5, 7.9])


def test_kmeanspp_never_draws_a_value_twice_while_others_are_left():
    """k-means++ draws each next centroid with probability f x D^2, D the distance to the NEAREST centroid drawn so
    far, so a value already drawn has probability 0: a row of k distinct values with k clusters always starts at
    exactly those k values (checked on 500 rows, i.e. 500 independent draws of each step)."""
    w = torch.tensor([[-1.0, 0.5, 2.0, 3.0, 7.0]]).repeat(500, 1)
    rows = SortedRows.build(w, torch.ones_like(w))
    starts = _kmeanspp_starts(rows, 5, torch.Generator().manual_seed(0))
    assert torch.equal(starts, rows.values)


def test_kmeanspp_draws_only_values_with_sensitivity() -> None:
    """Each k-means++ draw has probability f x D^2, so exact zeros (f = 0) are never drawn, however far they lie."""
    # Rows [0, 0, 0, 0, 1, 2, 3, 4] with unit sensitivities: the four starts are always 1..4 (500 rows: 500
    # independent draws of each step); unweighted D^2 draws would pick a zero now and then.
    w = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(500, 1)
    rows = SortedRows.build(w, torch.ones_like(w))
    starts = _kmeanspp_starts(rows, 4, torch.Generator().manual_seed(0))
    assert torch.equal(starts, torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64).repeat(500, 1))


def test_interval_without_sensitivity_takes_its_plain_mean() -> None:
    """A cluster whose members all have sensitivity 0 takes their plain mean; an empty one keeps its given value."""
    # Row [1, 2, 10, 11] with f = [0, 0, 1, 3] cut at 2 and 4: (1 + 2) / 2 = 1.5, (10 + 33) / 4 = 10.75, then empty.
    rows = SortedRows.build(torch.tensor([[1.0, 2.0, 10.0, 11.0]]), torch.tensor([[0.0, 0.0, 1.0, 3.0]]))
    previous = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    assert rows.means(torch.tensor([[0, 2, 4, 4]]), previous).tolist() == [[1.5, 10.75, -3.0]]


def test_squeezellm_pass_clusters_with_the_engines_fisher() -> None:
    """The squeezellm pass gives any_precision's codes and fp16 tables for the linear's Fisher, not unweighted ones."""
    # Tables are stored narrowest first; the unweighted clustering differs, so the check is not vacuous.
    from torch import nn

    from quantkit.passes import LayerWork
    from quantkit.passes.squeezellm import SqueezeLLM, SqueezeLLMConfig
    from quantkit.quantizers import QuantSpec, lut_width

    w, f = _row_problem(n=4, k=64, seed=3)
    f = torch.exp(4 * torch.randn(w.shape, generator=torch.Generator().manual_seed(4)))  # heavy-tailed, as Fisher is
    block = nn.ModuleDict({"lin": nn.Linear(64, 4, bias=False)})
    block["lin"].weight.data = w.clone()
    spec = QuantSpec(bits=4, granularity="channel", codebook=True, min_bits=2)
    work = LayerWork(index=0, block=block, linears={"lin": "down"}, specs={"lin": spec}, fisher={"lin": f})
    SqueezeLLM(SqueezeLLMConfig()).run(work)
    got = work.results["lin"]
    codes, luts = any_precision(w, f, 2, 4)
    assert torch.equal(got.codes.long() + 8, codes)
    for bits in (2, 3, 4):
        assert torch.equal(lut_width(got.qparams.lut, spec, bits), luts[bits].half().float()), bits
    unweighted, _ = any_precision(w, torch.ones_like(f), 2, 4)
    assert not torch.equal(codes, unweighted)


def test_quantile_start_takes_the_value_where_the_weight_reaches_the_target() -> None:
    """The quantile start takes the first sorted value whose running weight reaches (j + 1/2) / k, not the next one."""
    # Row 1..8, unit weights, two clusters: targets 2 and 6 pick the values 2 and 6 (not 3 and 7); one Lloyd step
    # splits at their midpoint 4, giving centroids 2.5 and 6.5.
    w = torch.arange(1.0, 9.0)[None]
    centroids, borders = kmeans_rows(SortedRows.build(w, torch.ones_like(w)), 2, max_iter=1, restarts=0)
    assert borders.tolist() == [[0, 4, 8]]
    assert centroids.tolist() == [[2.5, 6.5]]


def test_a_width_below_two_is_refused_up_front():
    """The quantizer serves widths 2..8: `weights.min_bits=1` is refused with the recipe, where it had written an
    artifact that validate and `eval --bits 1` then failed on with a traceback; `--bits 1` is out of the option's
    range."""
    from helpers import cli

    from quantkit.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"min_bits needs codebook weights and 2 <= min_bits <= bits, got 1"):
        load_recipe("anyprec-3to8", ["weights.min_bits=1"])
    assert load_recipe("anyprec-3to8", ["weights.min_bits=2"]).weights.min_bits == 2
    result = cli("eval", "nowhere", "--bits", "1")
    assert result.exit_code == 2 and "--bits" in result.output and "2<=x<=8" in result.output

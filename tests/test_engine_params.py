"""Engine-loaded formats: every quantized linear of a real artifact holds exactly the parameters the engine creates.

For each format an engine loads (qserve: SGLang's `qoq` method and OmniServe's W4A8 linear; qqq: vLLM's `qqq` method
and GPTQModel's QQQ linear; compressed-tensors: vLLM's and SGLang's WNA16 and W8A8-INT8 schemes), the engine's
parameter creation for one linear (its `create_weights`, or the module's registered buffers) is restated below as a
small function of N, K and the group size the engine reads from `config.json`, with the file and commit it was read
at. The engines themselves are not run (none installs here). Each test quantizes a tiny synthetic Llama with the real
recipe and checks, for every quantized linear of every layer, that the tensor names under the module are exactly the
parameters the engine fills from the checkpoint, with identical shapes and dtypes, and that `quantization_config`
holds what the engine's config parser reads.

What "exactly" means at load: vLLM and SGLang load a checkpoint tensor into a parameter by asserting equal shapes and
`param.data.copy_(tensor)`, so a missing tensor stays uninitialised, an extra one is a KeyError in the model's
`load_weights`, a shape difference is an assertion, and a dtype difference is converted silently (for integer packs
that would reinterpret the bits). Hence names and shapes must match, integer dtypes must match, and a floating dtype
that differs is reported apart (`cast`): the tests name where that happens.

Parameters an engine fills itself are marked `loaded=False` (vLLM's QQQ `workspace`, a zeroed lock buffer; the empty
per-channel `s_group` placeholder of vLLM and GPTQModel, which QQQ's own exporter strips before saving) and must be
absent from the artifact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cli_ok

from quantkit.artifact import read_safetensors
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

FAST = ["--num-samples", "4", "--seq-len", "64"]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEARS = tuple(f"self_attn.{m}" for m in ATTN) + tuple(f"mlp.{m}" for m in MLP)
NORMS = ("input_layernorm", "post_attention_layernorm")
# the shards vLLM/SGLang fuse into one layer (qkv_proj, gate_up_proj): they must share one scheme
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))

LLAMA = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)  # GQA: k/v have N = 128
QWEN2_BIAS = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, model_type="qwen2", attention_bias=True)
LLAMA_BF16 = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, dtype="bfloat16")
MODELS = {"llama": LLAMA, "qwen2-bias": QWEN2_BIAS, "llama-bf16": LLAMA_BF16}


@dataclass(frozen=True)
class Param:
    shape: tuple[int, ...]
    dtype: torch.dtype
    loaded: bool = True  # False: the engine fills it itself, so the checkpoint must not carry it


def geometry(spec: SyntheticLlama) -> dict[str, tuple[int, int]]:
    """[N, K] of every linear of a block, from the model config (what the engine builds), not from the artifact."""
    h, i = spec.hidden_size, spec.intermediate_size
    kv = spec.num_key_value_heads * (h // spec.num_attention_heads)
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def has_bias(spec: SyntheticLlama, linear: str) -> bool:
    return spec.attention_bias and linear in FUSED[0]


# ------------------------------------------------------------------------------------------ engine restatements
# Each function takes one (unfused) linear's N and K. The engines build q/k/v and gate/up as one fused layer whose
# parameters are these concatenated along the parameter's output dim (the weight loader slices the shard out), so
# the per-checkpoint-module shapes are the ones below with N the module's own width (TP size 1).


def sglang_qoq_params(n: int, k: int, group_size: int) -> dict[str, Param]:
    """SGLang python/sglang/srt/layers/quantization/qoq.py @ 0ad10073f3cdd10db9b7c0a99d9d3d78ce76adc4,
    QoQLinearMethod.create_weights (pack_factor 8 // 4 = 2)."""
    assert n % 32 == 0 and k % 2 == 0, "create_weights raises ValueError"
    assert group_size == -1 or k % group_size == 0, "create_weights raises ValueError"
    params = {"qweight": Param((n, k // 2), torch.int8), "s1_scales": Param((n,), torch.float16)}
    if group_size == -1:
        params["s1_szeros"] = Param((n,), torch.float16)
    else:
        params["s2_scales"] = Param((k // group_size, n), torch.int8)
        params["s2_zeros"] = Param((k // group_size, n), torch.int8)
    return params


def omniserve_w4a8_buffers(n: int, k: int, group_size: int, bias: bool) -> dict[str, Param]:
    """OmniServe omniserve/modeling/layers/quantized_linear/w4a8_linear.py, W4A8OF16LinearDynamicInputScale.__init__
    (registered buffers), read at mit-han-lab/qserve @ 5b44fe6164020f6e40bdc2d4d430491a91b1a814 (OmniServe's
    predecessor, qserve/modeling/...) and the OmniServe copy shwgao/omniserve @ cb646fe8647af0fd2150c884aae211475a5e9d15
    (identical buffers). The group size comes from OmniServe's --group-size flag, not from config.json."""
    g = k if group_size == -1 else group_size
    assert k % g == 0 and n % 8 == 0, "__init__ asserts"
    params = {"qweight": Param((n, k // 2), torch.int8), "s1_scales": Param((n,), torch.float16)}
    if group_size == -1:
        params["s1_szeros"] = Param((n,), torch.float16)
    else:
        params["s2_scales"] = Param((k // g, n), torch.int8)
        params["s2_zeros"] = Param((k // g, n), torch.int8)
    if bias:
        params["bias"] = Param((n,), torch.float16)
    return params


def vllm_qqq_params(n: int, k: int, group_size: int, params_dtype: torch.dtype) -> dict[str, Param]:
    """vLLM vllm/model_executor/layers/quantization/qqq.py @ 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f (the method as
    it stood until its removal, vLLM <= 0.10.1), QQQLinearMethod.create_weights: tile 16, pack_factor 32 // 4 = 8,
    min_n_threads 64, min_k_threads 128, max_parallel 16, perm_len 1024."""
    assert params_dtype == torch.float16, "create_weights raises: params dtype must be float16"
    assert n % 64 == 0 and n % 8 == 0 and k % 128 == 0 and n % (1024 // 16**2) == 0, "create_weights raises"
    assert group_size == -1 or k % group_size == 0, "create_weights raises"
    return {
        "B": Param((k // 16, n * 16 // 8), torch.int32),
        "s_channel": Param((1, n), torch.float32),
        # per channel an empty fp16 placeholder, which the kernel expects empty
        "s_group": (Param((0,), torch.float16, loaded=False) if group_size == -1
                    else Param((k // group_size, n), torch.float16)),
        "workspace": Param((n // 64 * 16,), torch.int32, loaded=False),  # zeros: the kernel's locks
    }


def gptqmodel_qqq_buffers(n: int, k: int, group_size: int, bias: bool) -> dict[str, Param]:
    """GPTQModel gptqmodel/nn_modules/qlinear/qqq.py @ 011c00a66e1e9dad6e1e251c8678eb0b59795465, QQQQuantLinear.__init__
    (the same buffers as HandH1998/QQQ QQQ/gptq/qlinear/qlinear_marlin.py @ 0ceba7c701094eea7b0005553a6d67cbbfa60d42).
    Persistent buffers only; `workspace` and `reduce_buffer` are registered persistent=False."""
    g = k if group_size == -1 else group_size
    params = {
        "B": Param((k // 16, n * 16 // 8), torch.int32),
        "s_channel": Param((1, n), torch.float32),
        "s_group": Param((0,), torch.float16, loaded=False) if g == k else Param((k // g, n), torch.float16),
    }
    if bias:
        params["bias"] = Param((n,), torch.float16)
    return params


def linear_bias(n: int, params_dtype: torch.dtype) -> dict[str, Param]:
    """vLLM/SGLang layers/linear.py: a LinearBase built with bias=True registers `bias` [N] in params_dtype itself,
    next to whatever the quant method creates (Qwen2's q/k/v)."""
    return {"bias": Param((n,), params_dtype)}


def unquantized_params(n: int, k: int, params_dtype: torch.dtype) -> dict[str, Param]:
    """vLLM/SGLang layers/linear.py, UnquantizedLinearMethod.create_weights: `weight` [N, K] in params_dtype (a layer
    that compressed-tensors' `ignore` names)."""
    return {"weight": Param((n, k), params_dtype)}


def wna16_params(n: int, k: int, bits: int, group_size: int, symmetric: bool, has_g_idx: bool,
                 params_dtype: torch.dtype) -> dict[str, Param]:
    """compressed-tensors WNA16: vLLM .../compressed_tensors/schemes/compressed_tensors_wNa16.py
    @ 519b90d4648d4455d32d0fc10b4734ba2ba324e1 (symmetric), and the zero points as SGLang's port
    python/sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py
    @ b4ea46ff7ae6a4e0da370929cb87a7f50f35d544 creates them (vLLM after vllm-project/vllm#14211 alike).
    CompressedTensorsWNA16.create_weights at TP 1 (scales partitioned or not, the width is K // group)."""
    assert bits in (4, 8), "WNA16 takes 4 and 8 bits"
    pack = 32 // bits
    g = k if group_size == -1 else group_size
    params = {
        "weight_packed": Param((n, k // pack), torch.int32),
        "weight_scale": Param((n, k // g), params_dtype),
        "weight_shape": Param((2,), torch.int64),
    }
    if not symmetric:
        params["weight_zero_point"] = Param((n // pack, k // g), torch.int32)
    if has_g_idx:
        params["weight_g_idx"] = Param((k,), torch.int32)
    return params


def w8a8_int8_params(n: int, k: int, strategy: str, static_input: bool) -> dict[str, Param]:
    """compressed-tensors W8A8 INT8: vLLM .../compressed_tensors/schemes/compressed_tensors_w8a8_int8.py
    @ c45614b5d83bd38e3cec1966637e11ad8c9c1aca, CompressedTensorsW8A8Int8.create_weights; SGLang's scheme inherits
    W8A8Int8LinearMethod.create_weights (python/sglang/srt/layers/quantization/w8a8_int8.py
    @ 4f6eed533c0d42b0dda1ee0900bf4affd24789e6), per channel the same two parameters."""
    params = {"weight": Param((n, k), torch.int8)}
    if strategy == "channel":
        params["weight_scale"] = Param((n, 1), torch.float32)
    else:
        params["weight_scale"] = Param((1,), torch.float32)  # len(output_partition_sizes) for one shard
    if static_input:
        params["input_scale"] = Param((1,), torch.float32)
    return params


# ------------------------------------------------------------------------------------------ config restatements


def _get_from_keys(config: dict[str, Any], key: str) -> Any:
    """QuantizationConfig.get_from_keys (vLLM and SGLang base_config.py): a missing key is a ValueError."""
    if key not in config:
        raise ValueError(f"Cannot find any of ['{key}'] in the model's quantization config.")
    return config[key]


def sglang_qoq_config(config: dict[str, Any]) -> int:
    """SGLang qoq.py (commit above): quant_method `qoq` selects QoQConfig; from_config reads `wbits` and
    `group_size`; __init__ takes wbits in [4], group_size in [-1, 128]; get_supported_act_dtypes is [float16]."""
    qc = config["quantization_config"]
    assert qc["quant_method"].lower() == "qoq"
    wbits, group_size = _get_from_keys(qc, "wbits"), _get_from_keys(qc, "group_size")
    assert wbits in (4,) and group_size in (-1, 128), (wbits, group_size)
    assert config["torch_dtype"] == "float16", "QoQ runs float16 activations only"
    return group_size


def vllm_qqq_config(config: dict[str, Any]) -> int:
    """vLLM qqq.py (commit above): quant_method `qqq`; QQQConfig.from_config reads `wbits` and `group_size`;
    __init__ takes weight_bits in [4], group_size in [-1, 128], is_sym True (not read); the model dtype must be
    float16 (create_weights)."""
    qc = config["quantization_config"]
    assert qc["quant_method"].lower() == "qqq"
    wbits, group_size = _get_from_keys(qc, "wbits"), _get_from_keys(qc, "group_size")
    assert wbits in (4,) and group_size in (-1, 128), (wbits, group_size)
    assert config["torch_dtype"] == "float16"
    return group_size


def gptqmodel_qqq_config(config: dict[str, Any]) -> int:
    """GPTQModel gptqmodel/quantization/config.py @ 007b793087646a7d9507be4e4c4411f65a274c67,
    QuantizeConfig.from_quant_config on config.json's quantization_config: `quant_method` qqq picks the QQQ config
    (whose format is forced to `qqq`), the QQQ-compat synonym `wbits` -> `bits`, `group_size` read as is; the QQQ
    linear takes bits [4] and group sizes [-1, 128] (SUPPORTS_BITS, SUPPORTS_GROUP_SIZE in qqq.py above)."""
    qc = {k.lower(): v for k, v in config["quantization_config"].items()}
    assert qc["quant_method"].lower() == "qqq"
    bits = qc.get("bits", qc.get("wbits"))
    assert bits == 4 and qc["group_size"] in (-1, 128), qc
    return qc["group_size"]


def _ct_matches(target: str, name: str) -> bool:
    """compressed-tensors target matching as vLLM's compressed_tensors/utils.py does it: a `re:` target is a regex
    matched at the start of the layer name, `Linear` matches any linear layer class, anything else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def vllm_ct_scheme(qc: dict[str, Any], layer: str) -> tuple[str, dict[str, Any]] | None:
    """vLLM vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py
    @ be696453ee1bf3b7a2f652cc457b340d5a20c88c: from_config (`ignore`, `format`, `config_groups` -> targets,
    weights and input_activations validated as compressed-tensors QuantizationArgs, per-group `format`), then
    get_scheme (ignored layers are unquantized; otherwise the matching target's scheme) and _get_scheme_from_parts for
    the int schemes quantkit writes: WNA16 (weights only, channel/group, static, pack-quantized, 4 or 8 bits) and
    W8A8 INT8 (8-bit weights tensor/channel symmetric static, 8-bit dynamic per-token input, an activation format).
    None: the layer is ignored. A layer no target matches, or no scheme fits, raises (as vLLM does)."""
    from compressed_tensors.quantization import QuantizationArgs

    if any(_ct_matches(t, layer) for t in qc.get("ignore", [])):
        return None
    quant_format = qc.get("format")
    groups = [g for g in qc.get("config_groups", {}).values() if any(_ct_matches(t, layer) for t in g["targets"])]
    if not groups:
        raise ValueError(f"{layer}: no compressed-tensors target matches")
    group = groups[0]
    weights = QuantizationArgs.model_validate(group["weights"])
    fmt = group.get("format") or quant_format
    act_format = fmt in ("int-quantized", "float-quantized", "naive-quantized")
    raw_inputs = group.get("input_activations")
    inputs = QuantizationArgs.model_validate(raw_inputs) if raw_inputs else None
    wna16 = (inputs is None and weights.strategy in ("channel", "group") and not weights.dynamic
             and fmt == "pack-quantized" and weights.num_bits in (4, 8))
    if wna16:
        return "WNA16", {"bits": weights.num_bits, "group_size": weights.group_size or -1,
                         "symmetric": weights.symmetric, "has_g_idx": weights.actorder == "group"}
    w8a8_dynamic = (act_format and inputs is not None and weights.type == inputs.type == "int"
                    and weights.num_bits == inputs.num_bits == 8 and weights.strategy in ("tensor", "channel")
                    and inputs.strategy == "token" and not weights.dynamic and inputs.dynamic and weights.symmetric)
    if w8a8_dynamic:
        return "W8A8Int8", {"strategy": weights.strategy, "static_input": False}
    raise NotImplementedError(f"{layer}: no compressed-tensors compatible scheme was found")


# ------------------------------------------------------------------------------------------ artifact and comparison


def read_artifact(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        tensors.update(read_safetensors(out / shard))
    assert set(tensors) == set(index), "the index and the shards disagree"
    return tensors


def layer_modules(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The tensors under every module of every decoder layer, keyed (layer, 'self_attn.q_proj'), named relative to it.
    Every tensor under model.layers.* must belong to a linear or a norm (anything else the engine would not take)."""
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    pattern = re.compile(r"model\.layers\.(\d+)\.(.+)\.([^.]+)$")
    for name, t in tensors.items():
        if not name.startswith("model.layers."):
            continue
        m = pattern.match(name)
        assert m, name
        layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
        assert module in LINEARS or module in NORMS, f"{name}: not under a linear or norm of the block"
        modules.setdefault((layer, module), {})[leaf] = t
    assert {layer for layer, _ in modules} == set(range(num_layers))
    return modules


def compare(where: str, tensors: dict[str, torch.Tensor], params: dict[str, Param]) -> tuple[list[str], set[str]]:
    """(errors, cast). errors: names the engine lacks or would leave unfilled, shape differences, integer dtype
    differences, and floating dtypes the loader's copy_ would round. cast: tensors of another floating dtype that
    copy_ converts exactly into the parameter (a wider float)."""
    errors: list[str] = []
    cast: set[str] = set()
    loaded = {name for name, p in params.items() if p.loaded}
    if set(tensors) != loaded:
        errors.append(f"{where}: tensors {sorted(tensors)} != engine parameters from the checkpoint {sorted(loaded)}")
    for name in sorted(set(tensors) & loaded):
        t, p = tensors[name], params[name]
        if tuple(t.shape) != p.shape:
            errors.append(f"{where}.{name}: shape {tuple(t.shape)} != engine {p.shape}")
        if t.dtype != p.dtype:
            exact = (t.dtype.is_floating_point and p.dtype.is_floating_point
                     and torch.finfo(p.dtype).bits > torch.finfo(t.dtype).bits
                     and torch.finfo(p.dtype).max >= torch.finfo(t.dtype).max
                     and torch.equal(t.to(p.dtype).to(t.dtype), t))
            if exact:
                cast.add(name)
            else:
                errors.append(f"{where}.{name}: dtype {t.dtype} != engine {p.dtype}")
    return errors, cast


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, calib_txt):
    """build(model, recipe, *--set overrides) -> (artifact path, model spec), each built once per module."""
    root = tmp_path_factory.mktemp("engine-params")
    models: dict[str, Path] = {}
    built: dict[tuple[str, ...], Path] = {}

    def build(model: str, recipe: str, *overrides: str) -> tuple[Path, SyntheticLlama]:
        if model not in models:
            models[model] = write_synthetic_llama(root / model, MODELS[model])
        key = (model, recipe, *overrides)
        if key not in built:
            out = root / f"out{len(built)}"
            sets = [a for o in overrides for a in ("--set", o)]
            cli_ok("quantize", models[model], "--recipe", recipe, "-o", out, "--calib", calib_txt, *FAST, *sets)
            built[key] = out
        return built[key], MODELS[model]

    return build


def _config(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text())


def _dtype(config: dict[str, Any]) -> torch.dtype:
    """The engines' params_dtype with dtype="auto": config.json's torch_dtype (float16 and bfloat16 stay as is)."""
    return getattr(torch, config["torch_dtype"])


# ------------------------------------------------------------------------------------------ qserve


@pytest.mark.parametrize(("model", "recipe", "group_size"), [
    ("llama", "qoq", -1), ("llama", "qoq-g128", 128), ("qwen2-bias", "qoq", -1), ("qwen2-bias", "qoq-g128", 128)])
def test_qserve_artifact_is_sglang_qoq_parameters(artifact, model, recipe, group_size):
    """SGLang's qoq method: config.json's wbits/group_size choose QoQLinearMethod's parameters; every linear of every
    layer holds exactly those (plus the layer's own fp16 bias on Qwen2's q/k/v), nothing else."""
    out, spec = artifact(model, recipe)
    config = _config(out)
    assert sglang_qoq_config(config) == group_size
    dtype = _dtype(config)
    modules = layer_modules(read_artifact(out), spec.num_hidden_layers)
    errors: list[str] = []
    for layer in range(spec.num_hidden_layers):
        for linear, (n, k) in geometry(spec).items():
            params = sglang_qoq_params(n, k, group_size)
            if has_bias(spec, linear):
                params |= linear_bias(n, dtype)
            errs, cast = compare(f"model.layers.{layer}.{linear}", modules[layer, linear], params)
            errors += errs + [f"{layer}.{linear}.{c}: dtype cast on load" for c in cast]
    assert errors == []


@pytest.mark.parametrize(("recipe", "group_size"), [("qoq", -1), ("qoq-g128", 128)])
def test_qserve_artifact_is_omniserve_w4a8_buffers(artifact, recipe, group_size):
    """OmniServe's W4A8 linear: with --group-size set to the recipe's (-1 or 128), every linear's tensors are exactly
    the module's buffers (Llama-shaped model: no biases, which is what OmniServe's W4A8 Llama builds)."""
    out, spec = artifact("llama", recipe)
    assert _config(out)["quantization_config"]["group_size"] == group_size  # what a user passes as --group-size
    modules = layer_modules(read_artifact(out), spec.num_hidden_layers)
    errors: list[str] = []
    for layer in range(spec.num_hidden_layers):
        for linear, (n, k) in geometry(spec).items():
            errs, cast = compare(f"model.layers.{layer}.{linear}", modules[layer, linear],
                                 omniserve_w4a8_buffers(n, k, group_size, bias=False))
            errors += errs + [f"{layer}.{linear}.{c}: dtype cast on load" for c in cast]
    assert errors == []


# ------------------------------------------------------------------------------------------ qqq


@pytest.mark.parametrize(("model", "recipe", "group_size"), [
    ("llama", "qqq", -1), ("llama", "qqq-g128", 128), ("qwen2-bias", "qqq", -1)])
def test_qqq_artifact_is_vllm_and_gptqmodel_parameters(artifact, model, recipe, group_size):
    """vLLM's qqq method (<= 0.10.1) and GPTQModel's QQQ linear: both config parsers read the same group size, and
    every linear's tensors are exactly the parameters both fill from the checkpoint (per channel, no `s_group`: both
    keep their empty placeholder; never vLLM's zeroed `workspace`)."""
    out, spec = artifact(model, recipe)
    config = _config(out)
    assert vllm_qqq_config(config) == gptqmodel_qqq_config(config) == group_size
    dtype = _dtype(config)
    modules = layer_modules(read_artifact(out), spec.num_hidden_layers)
    errors: list[str] = []
    for layer in range(spec.num_hidden_layers):
        for linear, (n, k) in geometry(spec).items():
            bias = has_bias(spec, linear)
            vllm = vllm_qqq_params(n, k, group_size, dtype) | (linear_bias(n, dtype) if bias else {})
            gptqmodel = gptqmodel_qqq_buffers(n, k, group_size, bias)
            for engine, params in (("vLLM", vllm), ("GPTQModel", gptqmodel)):
                errs, cast = compare(f"{engine}: model.layers.{layer}.{linear}", modules[layer, linear], params)
                errors += errs + [f"{engine}: {layer}.{linear}.{c}: dtype cast on load" for c in cast]
    assert errors == []


# ------------------------------------------------------------------------------------------ compressed-tensors


CT_CASES = {
    # id: (model, recipe, overrides, {linear role: expected scheme (None: ignored)})
    "gptq-w4a16-g128": ("llama", "gptq-w4a16-g128", (), "WNA16"),
    "gptq-w4a16-channel": ("llama", "gptq-w4a16", (), "WNA16"),
    "rtn-w4a16-g128-asym": ("llama", "rtn-w4a16-g128", ("weights.symmetric=false",), "WNA16"),
    "rtn-w4a16-g128-bf16": ("llama-bf16", "rtn-w4a16-g128", (), "WNA16"),
    "rtn-w4a16-g128-qwen2-bias": ("qwen2-bias", "rtn-w4a16-g128", (), "WNA16"),
    "rtn-w4a16-g128-attention-only": ("llama", "rtn-w4a16-g128", ("targets=[qkv, o]",), "WNA16"),
    "rtn-w8a16": ("llama", "rtn-w8a8", ("activations=null",), "WNA16"),
    "rtn-w8a8": ("llama", "rtn-w8a8", (), "W8A8Int8"),
}
# where the artifact's floating dtype differs from the engine's parameter but the loader converts it exactly (W8A8's
# weight_scale: quantkit writes the model dtype, as for every other scheme; vLLM's and SGLang's W8A8 INT8 schemes
# create it float32 [N, 1], and copy_ widens every fp16 value exactly)
CT_CASTS = {"rtn-w8a8": {"weight_scale"}}


def _ct_expected(qc: dict[str, Any], spec: SyntheticLlama, linear: str, dtype: torch.dtype, layer: int):
    n, k = geometry(spec)[linear]
    scheme = vllm_ct_scheme(qc, f"model.layers.{layer}.{linear}")
    if scheme is None:
        params = unquantized_params(n, k, dtype)
    elif scheme[0] == "WNA16":
        params = wna16_params(n, k, params_dtype=dtype, **scheme[1])
    else:
        params = w8a8_int8_params(n, k, **scheme[1])
    if has_bias(spec, linear):
        params |= linear_bias(n, dtype)
    return scheme and scheme[0], params


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_artifact_is_engine_scheme_parameters(artifact, case):
    """vLLM's compressed-tensors config parser picks, for every linear, the scheme quantkit means (or the unquantized
    method for what `ignore` names; fused shards agree), and the linear's tensors are exactly that scheme's
    create_weights parameters for the engine's params_dtype (config.json's torch_dtype)."""
    pytest.importorskip("compressed_tensors")
    model, recipe, overrides, want = CT_CASES[case]
    out, spec = artifact(model, recipe, *overrides)
    config = _config(out)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert {"format", "config_groups", "ignore"} <= set(qc)
    assert qc.get("sparsity_config") is None and qc.get("transform_config") is None
    dtype = _dtype(config)
    modules = layer_modules(read_artifact(out), spec.num_hidden_layers)
    errors: list[str] = []
    casts: set[str] = set()
    for layer in range(spec.num_hidden_layers):
        schemes = {}
        for linear in LINEARS:
            schemes[linear], params = _ct_expected(qc, spec, linear, dtype, layer)
            errs, cast = compare(f"model.layers.{layer}.{linear}", modules[layer, linear], params)
            errors += errs
            casts |= cast
        for shards in FUSED:  # vLLM refuses a fused layer whose shards resolve to different schemes
            assert len({schemes[s] for s in shards}) == 1, (layer, shards, schemes)
        quantized = {linear for linear, s in schemes.items() if s is not None}
        expected = set(LINEARS) if "targets=[qkv, o]" not in overrides else {f"self_attn.{m}" for m in ATTN}
        assert quantized == expected
        assert {schemes[linear] for linear in quantized} == {want}
    assert errors == []
    assert casts == CT_CASTS.get(case, set())


# ------------------------------------------------------------------------------------------ the restatements


def test_restated_parsers_refuse_what_the_engines_refuse():
    """The config restatements raise where the engines do, so a passing test above is not a parser that accepts all."""
    base = {"torch_dtype": "float16"}
    with pytest.raises(ValueError, match="wbits"):
        sglang_qoq_config(base | {"quantization_config": {"quant_method": "qoq", "group_size": 128}})
    with pytest.raises(AssertionError):
        sglang_qoq_config(base | {"quantization_config": {"quant_method": "qoq", "wbits": 4, "group_size": 64}})
    with pytest.raises(AssertionError):
        vllm_qqq_config({"torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "qqq", "wbits": 4, "group_size": 128}})
    with pytest.raises(AssertionError):
        vllm_qqq_params(96, 256, -1, torch.float16)  # N not a multiple of 64
    pytest.importorskip("compressed_tensors")
    qc = {"format": "pack-quantized", "ignore": [], "config_groups": {"group_0": {
        "targets": [r"re:.*self_attn\.(q|k|v)_proj$"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
    assert vllm_ct_scheme(qc, "model.layers.0.self_attn.k_proj")[0] == "WNA16"
    with pytest.raises(ValueError, match="no compressed-tensors target"):
        vllm_ct_scheme(qc, "model.layers.0.mlp.down_proj")
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 3  # only vLLM's newer WNAM schemes take 3 bits
    with pytest.raises(NotImplementedError):
        vllm_ct_scheme(qc, "model.layers.0.self_attn.q_proj")
    wrong = {"qweight": torch.zeros(64, 64, dtype=torch.uint8), "s1_scales": torch.zeros(64, dtype=torch.float16),
             "s1_szeros": torch.zeros(64, dtype=torch.float16), "extra": torch.zeros(1)}
    errors, _ = compare("m", wrong, sglang_qoq_params(64, 256, -1))
    assert len(errors) == 3  # the extra name, qweight's shape and its dtype

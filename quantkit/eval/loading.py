"""Load a model for evaluation: an FP checkpoint as-is, or a quantkit artifact dequantized exactly as an
engine would reconstruct it, with the activation and KV-cache simulation its recipe records."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit import simulate
from quantkit.artifact import (
    MANIFEST,
    RECIPE,
    ArtifactError,
    artifact_config,
    artifact_dtype,
    json_object,
    load_manifest,
    read_artifact_json,
    read_safetensors,
)
from quantkit.errors import QuantkitError, dtype_name, some
from quantkit.formats import PACKERS, get_packer
from quantkit.formats.base import ExportError
from quantkit.models.adapters import adapter_for
from quantkit.models.source import load_tokenizer, open_model, weight_map_problem
from quantkit.quantizers import QuantizedLinear, QuantSpec
from quantkit.recipe import Recipe, parse_recipe


@dataclass
class EvalModel:
    model: torch.nn.Module
    tokenizer: Any
    description: str
    recipe: Recipe | None = None


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def load_for_eval(path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                  bits: int | None = None, device: str | torch.device = "cpu") -> EvalModel:
    """The model at `path` ready for eval in `dtype` (float32 by default: CPU kernels, and exact upcasts) on
    `device` (read on the CPU, then moved); `bits` reads an Any-Precision artifact at that width."""
    if is_artifact(path):
        return _load_artifact(Path(path), dtype, bits, torch.device(device))
    if bits is not None:
        raise QuantkitError(f"--bits applies to Any-Precision artifacts; {path} is not a quantkit artifact")
    config, _ = json_object(Path(path) / "config.json")
    _check_transformers_loads(Path(path), _quant_method(config or {}))
    source = open_model(path, trust_remote_code=trust_remote_code)  # an FP checkpoint's tensors checked here
    model, info = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                       output_loading_info=True)
    if missing := sorted(info["missing_keys"]):  # a quantized one's: transformers fills them at random and goes on
        raise QuantkitError(f"{path}: the checkpoint lacks tensor(s) {some(missing)}, which would be evaluated as "
                            "random values")
    tokenizer = load_tokenizer(source.path, trust_remote_code, source.origin)
    method = _quant_method(model.config)
    kind = (f"{method} checkpoint, dequantized by transformers" if method else
            "GGUF, dequantized by transformers" if source.origin.endswith(".gguf") else "unquantized")
    return EvalModel(model.to(device).eval(), tokenizer,
                     f"{source.origin} ({kind}, stored in {dtype_name(source.checkpoint_dtype)})")


def _check_transformers_loads(path: Path, method: str | None) -> None:
    """Refuse a checkpoint of a quantization method transformers does not know: it would load the model with its
    quantized linears missing, filled at random, after printing its load report."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    if method is None or method in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return
    if fmt := next((name for name, packer in PACKERS.items() if packer.quant_method == method), None):
        raise ArtifactError(f"{path} is a quantkit artifact (export format {fmt}) without its {MANIFEST}; copy the "
                            "artifact again, or quantize again")
    raise QuantkitError(f"{path}: quantization method {method!r} (config.json's quantization_config), which "
                        "transformers cannot load and quantkit did not write")


def _describe_act(act: simulate.ActivationSim | None) -> str:
    """e.g. "A8 per-token", or "A4 per-token groups of 128 + 128 INT8 outliers" (Atom)."""
    if act is None:
        return ""
    if act.group_size is None and not act.outliers:
        return f"A{act.bits} per-token"
    groups = f" groups of {act.group_size}" if act.group_size else ""
    return f"A{act.bits} per-token{groups}" + (f" + {act.outliers} INT8 outliers" if act.outliers else "")


def _quant_method(config: Any) -> str | None:
    """The `quant_method` of a config's quantization_config (a transformers config or config.json's dict; the
    quantization_config itself a dict or a config object), if any."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def artifact_recipe(path: Path) -> Recipe:
    """The resolved recipe an artifact was made with."""
    try:
        content = yaml.safe_load((path / RECIPE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ArtifactError(f"{path / RECIPE}: cannot read it ({exc}); the artifact is damaged (copy it again, or "
                            "quantize again)") from None
    return parse_recipe(content, where=RECIPE)


def _weight_map(path: Path) -> dict[str, str]:
    """Where each tensor of artifact `path` is: its shard index's weight map."""
    weight_map = read_artifact_json(path, "model.safetensors.index.json", ("weight_map",))["weight_map"]
    if problem := weight_map_problem(path, weight_map):
        raise ArtifactError(f"{path}: {problem}; the artifact is damaged (copy it again, or quantize again)")
    return weight_map


def unpack_linear(path: Path, packer: Any, parts: dict[str, torch.Tensor], spec: QuantSpec, layer: int,
                  name: str, kernel_judges: bool = False) -> QuantizedLinear:
    """The packer's exact unpack of one linear's stored tensors, or an ArtifactError naming the linear and what
    its tensors lack or hold that the manifest's spec cannot read, or that its packer would not have written.
    `kernel_judges` (validate): values the packer refuses to write, such as a LiquidQuant lane its kernel overflows,
    are returned for the caller's kernel check to fail, rather than refused."""
    where, again = f"{path}: layer {layer} {name}", "copy the artifact again, or quantize again"
    try:
        q = packer.unpack(dict(parts), spec)
    except KeyError as e:  # a tensor the layout needs is not in the shards
        raise ArtifactError(f"{where} lacks its {e.args[0]} tensor; {again}") from None
    except (ValueError, RuntimeError, TypeError, IndexError) as e:  # shapes or dtypes the spec does not fit
        # (the layouts raise TypeError for a tensor of another dtype, e.g. QServe's qweight as int16; indexing a
        # shape tensor cut short raises IndexError)
        raise ArtifactError(f"{where}: its tensors do not fit the manifest's {spec.bits}-bit spec ({e}); "
                            f"{again}") from None
    if problem := q.shape_problem():
        raise ArtifactError(f"{where}: {problem}; {again}")
    try:
        written = packer.pack(q)
    except ExportError as e:
        if kernel_judges:
            return q
        raise ArtifactError(f"{where}: it holds values that the {packer.name} packer does not write ({e}); "
                            f"{again}") from None
    except (ValueError, RuntimeError, TypeError, IndexError) as e:
        raise ArtifactError(f"{where}: its tensors do not fit the manifest's {spec.bits}-bit spec ({e}); "
                            f"{again}") from None
    if problem := _not_as_written(parts, written):
        raise ArtifactError(f"{where}: {problem}, not what the {packer.name} packer writes for the values they hold; "
                            f"{again}")
    return q


def _not_as_written(stored: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> str:
    """How a linear's stored tensors differ from what its packer writes for the values they unpack to, or "". The
    layouts are exact both ways, so any difference (a dtype, a shape, a padding bit, a tensor that the unpack read
    past) is damage that reading alone would take for values."""
    if extra := sorted(set(stored) - set(written)):
        return f"it holds tensor(s) {', '.join(extra)} that its layout does not have"
    if lacking := sorted(set(written) - set(stored)):
        return f"it lacks tensor(s) {', '.join(lacking)} of its layout"
    for key, w in written.items():
        t = stored[key]
        if t.dtype != w.dtype or t.shape != w.shape:
            return (f"its {key} is {dtype_name(t.dtype)} {list(t.shape)} where the layout has "
                    f"{dtype_name(w.dtype)} {list(w.shape)}")
        if not torch.equal(_bits(t), _bits(w)):
            return f"its {key} holds bits the layout does not write for them"
    return ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, so that comparing them tells -0 from +0 and a NaN from itself."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t


def artifact_specs(path: Path, manifest: dict, recipe: Recipe) -> dict[str, QuantSpec]:
    """The weight spec of each quantized role, from an artifact's manifest, which must be what its saved recipe
    makes: the roles it targets, each quantized as its weights section says (or per channel, where
    `weights.indivisible: per_channel` met a group size that does not divide). Anything else is an edited or mixed
    artifact, whose tensors would be read with arithmetic they were not written in."""
    damaged = "; the artifact is damaged (copy it again, or quantize again)"
    weights = manifest["weights"]
    if set(weights) != set(recipe.targets):
        raise ArtifactError(f"{path}: the manifest quantizes roles {', '.join(weights) or 'none'} where its recipe "
                            f"targets {', '.join(recipe.targets)}{damaged}")
    fields = {f.name for f in dataclasses.fields(QuantSpec)}
    made = (recipe.weights.spec(), recipe.weights.spec("channel"))
    specs = {}
    for role, w in weights.items():
        if unknown := sorted(set(w) - fields):
            raise ArtifactError(f"{path}: the manifest's weights.{role} has unknown field(s) {', '.join(unknown)}"
                                f"{damaged}")
        try:
            spec = QuantSpec(**{**w, "group_size": w.get("group_size") or 128})
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: the manifest's weights.{role} is not a weight spec ({e}){damaged}") from None
        if spec not in made:
            raise ArtifactError(f"{path}: the manifest's weights.{role} ({w}) is not what its recipe "
                                f"{recipe.name!r} quantizes with{damaged}")
        specs[role] = spec
    return specs


@dataclass
class PackedLinear:
    """One quantized linear of an artifact: where it is, its stored tensors and the packer's exact unpack."""

    layer: int
    name: str
    role: str
    parts: dict[str, torch.Tensor]
    q: QuantizedLinear


def packed_linears(path: Path, layers: Iterable[int] | None = None, kernel_judges: bool = False
                   ) -> Iterator[PackedLinear]:
    """The packed linears of artifact `path`, layer by layer (all layers, or those in `layers`), read one
    layer's shards at a time; `kernel_judges` as for `unpack_linear`."""
    manifest = load_manifest(path)
    recipe = artifact_recipe(path)
    config = artifact_config(path, manifest)
    packer = get_packer(manifest["format"])(recipe, artifact_dtype(config))
    adapter = adapter_for(config["model_type"])
    specs = artifact_specs(path, manifest, recipe)
    weight_map = _weight_map(path)
    count = config["num_hidden_layers"]
    layers = range(count) if layers is None else list(layers)
    if past := [i for i in layers if not 0 <= i < count]:
        raise ArtifactError(f"{path} has layers 0..{count - 1}, not {', '.join(map(str, past))}")
    for i in layers:
        prefix = adapter.layer_prefix(i)
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted({f for key, f in weight_map.items() if key.startswith(prefix)}):
            tensors.update({k[len(prefix):]: v for k, v in read_safetensors(path / shard).items()
                            if k.startswith(prefix)})
        for role, name in adapter.linear_names(list(specs)):
            parts = packer.pop_parts(tensors, name)
            q = unpack_linear(path, packer, parts, specs[role], i, name, kernel_judges)
            yield PackedLinear(i, name, role, parts, q)


def _load_artifact(path: Path, dtype: torch.dtype, bits: int | None, device: torch.device) -> EvalModel:
    manifest = load_manifest(path)
    recipe = artifact_recipe(path)
    config_data = artifact_config(path, manifest)
    config_data.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_data)
    model_dtype = artifact_dtype(config_data)
    adapter = adapter_for(config.model_type)
    packer = get_packer(manifest["format"])(recipe, model_dtype)
    specs = artifact_specs(path, manifest, recipe)
    for role, spec in specs.items():
        low = spec.min_bits or spec.bits
        if bits is not None and not (low <= bits <= spec.bits if spec.codebook else bits == spec.bits):
            served = f"widths {low}..{spec.bits}" if spec.codebook else f"only its {spec.bits} bits"
            raise QuantkitError(f"--bits {bits}: {path} ({role}) serves {served}")
    quantized = {}
    for i in range(config.num_hidden_layers):
        for role, name in adapter.linear_names(list(specs)):
            quantized[f"{adapter.layer_prefix(i)}{name}"] = (i, name, role)
    runtime: list[dict[str, simulate.LinearRuntime]] = [{} for _ in range(config.num_hidden_layers)]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_weight_map(path).values())):
        tensors = read_safetensors(path / shard)
        for module, (i, name, role) in quantized.items():
            parts = packer.pop_parts(tensors, module)
            if parts:
                q = unpack_linear(path, packer, parts, specs[role], i, name)
                q = q.at_bits(bits) if bits is not None and q.spec.codebook else q
                state[f"{module}.weight"], info = simulate.deployed(q, model_dtype)
                if info is not None:  # read by the hooks at every forward: kept where they run
                    runtime[i][name] = info.to(device)
        state.update(tensors)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    expected = model.state_dict()
    if unplaced := sorted(set(state) - set(expected)):
        raise ArtifactError(f"{path}: the artifact holds tensor(s) {some(unplaced)}, which its config.json's model has "
                            "no place for; copy the artifact again, or quantize again")
    if wrong := [f"{key} is {list(state[key].shape)} where config.json makes it {list(t.shape)}"
                 for key, t in expected.items() if key in state and state[key].shape != t.shape]:  # the model's order
        raise ArtifactError(f"{path}: the tensors and config.json disagree: {some(wrong)}; copy the artifact again, "
                            "or quantize again")
    missing = set(expected) - set(state)
    head, embed = adapter.lm_head + ".weight", adapter.embed + ".weight"
    # as transformers reads a config that ties: a stored head of other values than the embeddings is not tied to them
    tied = getattr(config, "tie_word_embeddings", False) and (
        head not in state or (embed in state and torch.equal(state[head], state[embed])))
    if tied:
        missing.discard(head)
    if missing:
        raise ArtifactError(f"{path}: the artifact lacks tensor(s) {some(sorted(missing))}; copy the artifact again, "
                            "or quantize again")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _rebuild_buffers(model)
    model.to(device)
    act, kv = simulate.sims_for(recipe)
    linear_names = [name for _, name in adapter.linear_names(list(specs))]
    blocks = list(model.get_submodule(adapter.layers_prefix))
    simulate.attach(blocks, linear_names, model.config, act, kv, runtime=runtime,
                    adapter=adapter)
    tokenizer = load_tokenizer(path)
    sim = ", ".join(s for s in (_describe_act(act), f"KV{kv.bits} per-head{' pre-RoPE' if kv.pre_rope else ''}"
                                if kv else "") if s)
    width = f", read at {bits} bits" if bits is not None else ""
    desc = f"{path} ({manifest['recipe']}, {manifest['format']}{width}{'; simulating ' + sim if sim else ''})"
    return EvalModel(model.eval(), tokenizer, desc, recipe)


def _rebuild_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers (RoPE inv_freq) were created on meta; recompute them on the CPU."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and module.inv_freq.is_meta:
            fresh = type(module)(model.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf)

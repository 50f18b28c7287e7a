"""Recipes: validated YAML naming the weight/activation/KV formats, calibration data, ordered passes and packer.

`load_recipe(name_or_path, overrides)` applies `--set key.path=value` overrides to the raw YAML, then
validates every field (unknown or ill-typed fields are errors naming the field and the allowed ones). The
resolved recipe (`to_yaml`) is what gets saved next to the output, so a run can be reproduced exactly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from quantkit.config import ConfigError, build, to_dict
from quantkit.errors import QuantkitError
from quantkit.models.adapters import ROLES
from quantkit.passes import PASSES, get_pass
from quantkit.quantizers import QuantSpec
from quantkit.resources import data_path


class RecipeError(QuantkitError):
    """A recipe cannot be found, parsed or validated."""


@dataclass(frozen=True)
class WeightConfig:
    bits: int = 4
    symmetric: bool = True
    granularity: Literal["tensor", "channel", "group"] = "group"
    group_size: int = 128
    clip_ratio: float = 1.0
    # layers whose input width the group size does not divide: "error", or quantize them per channel
    indivisible: Literal["error", "per_channel"] = "error"
    zero_form: Literal["integer", "scaled"] = "integer"  # "scaled": fp16 scale*zero (QServe per-channel)
    progressive: bool = False  # QoQ two-level: INT8 per channel, then integer group scales (QServe g128)
    protective_range: int = 119  # level-1 INT8 clamp of progressive quantization
    level2: Literal["qoq", "lqq"] = "qoq"  # progressive group form: QoQ's zero point, or LiquidQuant's offset
    outliers: int = 0  # Atom: the last columns of each linear's order (outlier_order pass) INT8 per row
    row_block: int = 1  # Atom: output rows sharing one group scale (2)
    narrow_range: bool = False  # symmetric codes in [-(2^(b-1) - 1), 2^(b-1) - 1], scale amax / qmax (QQQ)
    requant_int8: bool = False  # QQQ per group: group scales as fp16 ratios over a per-channel INT8 scale
    codebook: bool = False  # per-row lookup tables (SqueezeLLM / Any-Precision; the squeezellm quantizer)
    min_bits: int | None = None  # codebook: also serve every width from min_bits up to bits (Any-Precision)

    def spec(self, granularity: str | None = None) -> QuantSpec:
        """The QuantSpec at `granularity` (the recipe's by default); group-only forms drop out per channel."""
        granularity = granularity or self.granularity
        grouped = granularity == "group"
        progressive = self.progressive and grouped
        return QuantSpec(self.bits, self.symmetric, granularity, self.group_size, self.clip_ratio,
                         zero_form=self.zero_form, progressive=progressive,
                         protective_range=self.protective_range, level2=self.level2 if progressive else "qoq",
                         narrow_range=self.narrow_range, requant_int8=self.requant_int8 and grouped,
                         codebook=self.codebook, min_bits=self.min_bits, outliers=self.outliers,
                         row_block=self.row_block)

    def __post_init__(self) -> None:
        self.spec()  # range checks live in QuantSpec


@dataclass(frozen=True)
class ActivationConfig:
    """Dynamic per-token activation quantization of every quantized linear's input."""

    bits: int = 8
    symmetric: bool = True
    granularity: Literal["token"] = "token"
    group_size: int | None = None  # per (token, group of this many input channels) instead of per token (Atom)
    outliers: int = 0  # the last channels of each linear's order stay INT8 (Atom; must match weights.outliers)
    clip_ratio: float = 1.0  # symmetric: scale = clip_ratio * max|x| / qmax

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"activation bits must be in 2..8, got {self.bits}")
        if (self.group_size is not None and self.group_size <= 0) or self.outliers < 0:
            raise ValueError("activation group_size must be positive (or null) and outliers >= 0")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"activation clip_ratio must be in (0, 1], got {self.clip_ratio}")


@dataclass(frozen=True)
class KVCacheConfig:
    """Dynamic per-(token, KV head) quantization of keys (after RoPE, or before it with `rope: pre`) and of values."""

    bits: int = 4
    symmetric: bool = False
    granularity: Literal["head"] = "head"
    rope: Literal["post", "pre"] = "post"  # quantize keys after RoPE (QServe) or before it (Atom)

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"kv_cache bits must be in 2..8, got {self.bits}")


@dataclass(frozen=True)
class CalibrationConfig:
    dataset: str = "pileval"  # a named set in calib/ or a file path
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0
    sampling: Literal["random", "first"] = "random"
    text_field: str = "text"
    # Hessian token weights (passes/base.py token_weights): the first token of each sequence counts as
    # `sink_weight` median-size tokens, any other token at most `token_cap` of them; null = plain GPTQ
    sink_weight: float | None = None
    token_cap: float | None = None
    # what the Hessians see: each linear's float input, or its input as the activation simulation quantizes it
    # (Atom inserts its activation quantizers before GPTQ, so H = 2/n X^ T X^)
    hessian_inputs: Literal["float", "quantized"] = "float"

    def __post_init__(self) -> None:
        if self.num_samples <= 0 or self.seq_len <= 1:
            raise ValueError("num_samples must be positive and seq_len at least 2")
        for name in ("sink_weight", "token_cap"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be positive and finite (in median tokens) or null, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 8  # calibration sequences per block forward
    propagate: Literal["quantized", "float"] = "quantized"  # what the next block sees (GPTQ's sequential mode)
    simulate_activations: bool = True  # apply activation/KV simulation when propagating quantized outputs
    cache_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # quantize a block's roles in turn (q/k/v, o, gate/up, down), each calibrated with the earlier ones quantized,
    # in one block forward; false: every Hessian from the unquantized block, then a second forward to propagate
    true_sequential: bool = True
    error_samples: int | None = 4  # calibration sequences the per-layer output error is measured on (null: all)

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.error_samples is not None and self.error_samples <= 0:
            raise ValueError(f"error_samples must be positive or null, got {self.error_samples}")


@dataclass(frozen=True)
class ExportConfig:
    format: str = "compressed-tensors"


@dataclass(frozen=True)
class PassEntry:
    name: str
    config: Any
    enabled: bool = True  # `--set passes.NAME.enabled=false` switches a step off (ablations)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    targets: list[str] = field(default_factory=lambda: list(ROLES))
    weights: WeightConfig = field(default_factory=WeightConfig)
    activations: ActivationConfig | None = None
    kv_cache: KVCacheConfig | None = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    passes: list[PassEntry] = field(default_factory=list)
    engine: EngineConfig = field(default_factory=EngineConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def enabled_pass(self, name: str) -> Any | None:
        """The config of pass `name` where the recipe runs it (listed and enabled), else None."""
        return enabled_pass(self.passes, name)


def enabled_pass(passes: list[PassEntry], name: str) -> Any | None:
    """The config of the enabled pass `name` among `passes`, or None."""
    return next((p.config for p in passes if p.name == name and p.enabled), None)


_SECTIONS = {
    "weights": WeightConfig,
    "activations": ActivationConfig,
    "kv_cache": KVCacheConfig,
    "calibration": CalibrationConfig,
    "engine": EngineConfig,
    "export": ExportConfig,
}
_TOP = ("name", "description", "targets", *_SECTIONS, "passes")


def parse_recipe(raw: Any, where: str = "recipe") -> Recipe:
    """Validate plain YAML data into a Recipe."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level")
    unknown = sorted(set(raw) - set(_TOP))
    if unknown:
        raise RecipeError(f"{where}: unknown field {', '.join(map(repr, unknown))}; allowed: {', '.join(_TOP)}")
    try:
        values: dict[str, Any] = {}
        for key, cls in _SECTIONS.items():
            if key in raw:
                values[key] = None if raw[key] is None and key in ("activations", "kv_cache") else build(
                    cls, raw[key], f"{where}.{key}"
                )
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{where}.name: a recipe needs a non-empty string name")
        description = raw.get("description", "")
        if not isinstance(description, str):
            raise RecipeError(f"{where}.description: expected a string")
        targets = raw.get("targets", list(ROLES))
        if not isinstance(targets, list) or any(t not in ROLES for t in targets) or not targets:
            raise RecipeError(f"{where}.targets: expected a non-empty list of roles from {', '.join(ROLES)}")
        entries = raw.get("passes") or []
        if not isinstance(entries, list):
            raise RecipeError(f"{where}.passes: expected a list of passes, each a mapping with a 'name' (one of "
                              f"{', '.join(sorted(PASSES))}), got {type(entries).__name__} {entries!r}")
        passes = [_parse_pass(p, f"{where}.passes[{i}]") for i, p in enumerate(entries)]
    except ConfigError as exc:
        raise RecipeError(str(exc)) from None
    _check_order(passes, where)
    weights, acts = values.get("weights", WeightConfig()), values.get("activations")
    if acts is not None and (acts.outliers or weights.outliers) and acts.outliers != weights.outliers:
        raise RecipeError(f"{where}: activations.outliers ({acts.outliers}) must equal weights.outliers "
                          f"({weights.outliers}): both split the same channels")
    calibration = values.get("calibration", CalibrationConfig())
    if calibration.hessian_inputs == "quantized" and acts is None:
        raise RecipeError(f"{where}.calibration.hessian_inputs: 'quantized' needs an `activations` section to say "
                          "how the inputs are quantized")
    quantizers = [p.name for p in passes if get_pass(p.name).quantizes]
    if len(quantizers) != 1 or not get_pass(passes[-1].name).quantizes:
        raise RecipeError(
            f"{where}.passes: the last pass must be the one weight quantizer "
            f"({', '.join(n for n, c in sorted(PASSES.items()) if c.quantizes)}); got {[p.name for p in passes]}"
        )
    _check_clip(passes, weights, where)
    if passes[-1].name == "squeezellm" and not weights.codebook:
        raise RecipeError(f"{where}: squeezellm quantizes to a lookup table per output channel: set weights.codebook: "
                          "true (per channel), as the anyprec-3to8 and squeezellm-w3 recipes do")
    return Recipe(name=name, description=description, targets=targets, passes=passes, **values)


def _check_clip(passes: list[PassEntry], weights: WeightConfig, where: str) -> None:
    """The clipping search's ratios are per (row, column group) in the weight's own column order, and only RTN and
    GPTQ take them: refuse the recipes whose quantizer would form other groups, or none, and so ignore them."""
    if enabled_pass(passes, "clip") is None:
        return
    quantizer = passes[-1]
    why = ""
    if quantizer.name not in ("rtn", "gptq"):
        why = f"{quantizer.name} takes no clip ratios"
    elif weights.outliers or enabled_pass(passes, "outlier_order") is not None:
        why = "Atom's quantizer forms its groups along the outlier order (weights.clip_ratio clips them)"
    elif quantizer.name == "gptq" and weights.granularity == "group" and quantizer.config.dynamic_groups:
        why = ("GPTQ with act-order and dynamic groups forms its groups along the activation order; set "
               "passes.gptq.static_groups=true or passes.gptq.act_order=false")
    if why:
        raise RecipeError(f"{where}.passes: clip searches ratios for the weight's own column groups, but {why}")


def _check_order(passes: list[PassEntry], where: str) -> None:
    """Each enabled pass's prerequisites come before it, and every transform precedes every other step."""
    seen: list[str] = []
    for p in passes:
        cls = get_pass(p.name)
        if p.enabled:
            for required in cls.requires:
                if required not in seen:
                    raise RecipeError(f"{where}.passes: {p.name} needs {required} before it (enabled); "
                                      f"the order is {[q.name for q in passes]}")
            if cls.transforms and any(not get_pass(q).transforms for q in seen):
                raise RecipeError(f"{where}.passes: transform {p.name} must come before "
                                  f"{[q for q in seen if not get_pass(q).transforms]}, which read the weights")
            seen.append(p.name)
    if len(set(seen)) != len(seen):
        raise RecipeError(f"{where}.passes: a pass appears twice: {seen}")


def _parse_pass(entry: Any, where: str) -> PassEntry:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise RecipeError(f"{where}: each pass is a mapping with a 'name' (one of {', '.join(sorted(PASSES))})")
    name = entry["name"]
    if name not in PASSES:
        raise RecipeError(f"{where}: unknown pass {name!r}; known passes: {', '.join(sorted(PASSES))}")
    params = {k: v for k, v in entry.items() if k not in ("name", "enabled")}
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise RecipeError(f"{where} ({name}).enabled: expected true or false, got {enabled!r}")
    if not enabled and PASSES[name].quantizes:
        raise RecipeError(f"{where} ({name}): the weight quantizer cannot be disabled")
    return PassEntry(name, build(PASSES[name].Config, params, f"{where} ({name})"), enabled)


def recipe_to_dict(recipe: Recipe) -> dict:
    data = to_dict(recipe)
    data["passes"] = [{"name": p.name, **({} if p.enabled else {"enabled": False}), **to_dict(p.config)}
                      for p in recipe.passes]
    return data


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)


def bundled_recipes() -> dict[str, Path]:
    """Name -> path of every recipe shipped in recipes/."""
    return {p.stem: p for p in sorted(data_path("recipes").glob("*.yaml"))}


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `key.path=value` (value parsed as YAML) to raw recipe data; passes are addressed by name or index."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected key.path=value")
    key, _, text = assignment.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"--set {assignment!r}: empty key")
    if path[0] == "targets" and len(path) > 1:  # a list of roles, not a section (only passes are addressed inside)
        raise RecipeError(f"--set {key.strip()}: targets is a list of roles; set it whole, e.g. targets=[qkv,o,down]")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None  # a SafeLoader
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set {assignment!r}: value is not valid YAML ({_yaml_problem(exc)})") from None
    node: Any = raw
    for i, part in enumerate(path[:-1]):
        here = ".".join(path[: i + 1])
        if isinstance(node, list):
            node = _list_item(node, part, here)
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise RecipeError(f"--set {key}: {here} is not a section")
    last = path[-1]
    if isinstance(node, list):
        raise RecipeError(f"--set {key}: set a field of a pass, e.g. passes.gptq.damp=0.05")
    if not isinstance(node, dict):
        raise RecipeError(f"--set {key}: {'.'.join(path[:-1])} is not a section")
    node[last] = value


def _list_item(items: list, part: str, here: str) -> Any:
    if part.isdigit() and int(part) < len(items):
        return items[int(part)]
    for item in items:
        if isinstance(item, dict) and item.get("name") == part:
            return item
    names = [item.get("name") for item in items if isinstance(item, dict)]
    raise RecipeError(f"--set: no pass {part!r} at {here}; the recipe's passes are {names}")


def load_recipe(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a bundled recipe by name, or a YAML file by path, then apply `--set` overrides and validate."""
    path = Path(name_or_path)
    bundled = bundled_recipes()
    # A file wins over a bundled name, a bundled name over anything else there (an output directory named after
    # its recipe, say).
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise RecipeError(f"recipe file {path} {'is a directory' if path.is_dir() else 'not found'}")
    if not path.is_file():
        if str(name_or_path) not in bundled:
            what = f"{path} is not a file, and there is no" if path.exists() else "unknown recipe"
            raise RecipeError(f"{what} {str(name_or_path)!r}; bundled recipes: {', '.join(bundled)}")
        path = bundled[str(name_or_path)]
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping")

    def edited(kept: tuple[str, ...]) -> dict:
        recipe = copy.deepcopy(raw)
        for assignment in kept:
            apply_override(recipe, assignment)
        return recipe

    overridden = edited(tuple(overrides))  # a --set path the recipe lacks fails here, before any field check
    try:
        return parse_recipe(overridden, where=path.name)
    except (ConfigError, RecipeError) as exc:
        # the overrides by what they set: --num-samples and --seq-len arrive here as calibration.* ones too
        if not (culprits := blame_overrides(tuple(overrides), lambda kept: parse_recipe(edited(kept), path.name))):
            raise
        raise RecipeError(f"{exc} {culprits}") from None


def blame_overrides(overrides: tuple[str, ...], attempt: Callable[[tuple[str, ...]], object]) -> str:
    """"(with the override(s) ...)" naming the overrides that made `attempt(overrides)` fail, when the recipe without
    them passes (`attempt` refuses by raising a QuantkitError): those whose removal alone makes the error go, or all
    of them when no single one does; "" where the recipe alone is refused too."""

    def refused(kept: tuple[str, ...]) -> bool:
        try:
            attempt(kept)
        except QuantkitError:
            return True
        return False

    if not overrides or refused(()):
        return ""
    named = [o for i, o in enumerate(overrides) if not refused(overrides[:i] + overrides[i + 1:])] or overrides
    return f"(with the override{'s' if len(named) > 1 else ''} {', '.join(named)})"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: what, and where ("duplicate key 'weights' at line 3, column 1"), without the
    excerpt of the text it quotes on lines of their own."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, so a
    recipe's `bits: 4` above a stray `bits: 8` would quantize to 8 bits)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

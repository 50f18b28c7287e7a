"""Recipe loading, validation errors that name the field, and --set overrides."""

from pathlib import Path

import pytest
import yaml

from quantkit.recipe import RecipeError, bundled_recipes, load_recipe, parse_recipe, to_yaml


def test_bundled_recipes_all_validate():
    names = set(bundled_recipes())
    assert {"rtn-w4a16-g128", "gptq-w4a16-g128", "gptq-w4a16", "rtn-w8a8"} <= names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.description


def test_round_trip_through_yaml():
    recipe = load_recipe("gptq-w4a16-g128")
    assert parse_recipe(yaml.safe_load(to_yaml(recipe))) == recipe


def test_unknown_recipe_lists_known():
    with pytest.raises(RecipeError, match="unknown recipe 'nope'.*gptq-w4a16-g128"):
        load_recipe("nope")


def test_typo_names_field_and_allowed(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nweights: {bits: 4, grup_size: 64}\npasses: [{name: rtn}]\n")
    with pytest.raises(RecipeError, match=r"r\.yaml\.weights: unknown field 'grup_size'; allowed: .*group_size"):
        load_recipe(path)


def test_ill_typed_field(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nweights: {bits: four}\npasses: [{name: rtn}]\n")
    with pytest.raises(RecipeError, match=r"weights\.bits: expected an integer, got 'four'"):
        load_recipe(path)


def test_out_of_range_bits(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nweights: {bits: 12}\npasses: [{name: rtn}]\n")
    with pytest.raises(RecipeError, match="bits must be in 2..8"):
        load_recipe(path)


def test_unknown_pass_and_pass_field(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\npasses: [{name: gptqq}]\n")
    with pytest.raises(RecipeError, match="unknown pass 'gptqq'; known passes: .*gptq, .*rtn"):
        load_recipe(path)
    path.write_text("name: x\npasses: [{name: gptq, dampp: 0.1}]\n")
    with pytest.raises(RecipeError, match=r"passes\[0\] \(gptq\): unknown field 'dampp'; allowed: .*damp"):
        load_recipe(path)


def test_needs_exactly_one_final_quantizer(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\npasses: [{name: rtn}, {name: gptq}]\n")
    with pytest.raises(RecipeError, match="last pass must be the one weight quantizer"):
        load_recipe(path)


def test_set_overrides_are_resolved_and_saved():
    recipe = load_recipe("gptq-w4a16-g128", ["weights.group_size=64", "passes.gptq.damp=0.05",
                                             "passes.0.act_order=false", "activations.bits=8"])
    assert recipe.weights.group_size == 64
    assert recipe.passes[0].config.damp == 0.05 and recipe.passes[0].config.act_order is False
    assert recipe.activations.bits == 8
    saved = yaml.safe_load(to_yaml(recipe))
    assert saved["weights"]["group_size"] == 64 and saved["passes"][0]["damp"] == 0.05


def test_set_errors():
    with pytest.raises(RecipeError, match="expected key.path=value"):
        load_recipe("rtn-w8a8", ["weights.bits"])
    with pytest.raises(RecipeError, match="unknown field 'nope'"):
        load_recipe("rtn-w8a8", ["weights.nope=1"])
    with pytest.raises(RecipeError, match="no pass 'gptq'"):
        load_recipe("rtn-w8a8", ["passes.gptq.damp=1"])


@pytest.mark.parametrize("value", [".inf", "0", "-3", ".nan"])
def test_token_weights_must_be_positive_and_finite(value):
    match = "expected a finite number" if value in (".inf", ".nan") else "sink_weight must be positive and finite"
    with pytest.raises(RecipeError, match=match):
        load_recipe("gptq-w4a16-g128", [f"calibration.sink_weight={value}"])


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML would keep the last `weights` silently: the first, the one a reader sees, would not be used."""
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nweights: {bits: 4}\nweights: {bits: 8}\npasses: [{name: rtn}]\n")
    with pytest.raises(RecipeError, match="r.yaml: not valid YAML \\(duplicate key 'weights' at line 3, column 1\\)"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="value is not valid YAML \\(duplicate key 'bits'"):
        load_recipe("rtn-w8a8", ["weights={bits: 4, bits: 8}"])


def test_errors_that_a_set_value_made_say_so():
    """A bundled recipe made invalid by --set names the --set, not only the recipe file's field; a pass that takes no
    fields says so rather than listing nothing."""
    with pytest.raises(RecipeError, match=r"bits must be in 2\.\.8, got 99 \(with the override weights\.bits=99\)$"):
        load_recipe("rtn-w8a8", ["calibration.seed=3", "weights.bits=99", "calibration.num_samples=4"])
    with pytest.raises(RecipeError, match=r"\(rtn\): unknown field 'foo'; it takes none \(with the override passes"):
        load_recipe("rtn-w8a8", ["passes.rtn.foo=1"])
    # no single value is to blame when each would fail alone: all are named
    with pytest.raises(RecipeError, match=r"\(with the overrides weights\.outliers=64, activations\.outliers=32\)$"):
        load_recipe("atom-w4a4", ["weights.outliers=64", "activations.outliers=32"])


@pytest.mark.parametrize(("recipe", "passes", "why"), [
    ("anyprec-3to8", "[{name: clip}, {name: squeezellm}]", "squeezellm takes no clip ratios"),
    ("atom-w4a4", "[{name: outlier_order}, {name: clip}, {name: gptq}]", "Atom's quantizer forms its groups along"),
    ("gptq-w4a16-g128", "[{name: clip}, {name: gptq, act_order: true, static_groups: false}]",
     "GPTQ with act-order and dynamic groups"),
])
def test_clip_is_refused_where_the_quantizer_would_ignore_its_ratios(recipe, passes, why):
    """The clipping search's ratios are per column group in the weight's order: a quantizer that forms other groups
    (or none) would have ignored them silently."""
    with pytest.raises(RecipeError, match=f"clip searches ratios for the weight's own column groups, but {why}"):
        load_recipe(recipe, [f"passes={passes}"])
    # the groups GPTQ forms without act-order, or statically, are the weight's own
    for gptq in ("{name: gptq, act_order: false, static_groups: false}", "{name: gptq, static_groups: true}"):
        load_recipe("gptq-w4a16-g128", [f"passes=[{{name: clip}}, {gptq}]"])


@pytest.mark.parametrize(("recipe", "override", "match"), [
    ("qoq", "passes.smooth_attention.samples=0", "samples must be at least 1"),
    ("qoq", "passes.clip.attention_samples=0", "attention_samples must be at least 1"),
    ("gptq-w4a16-g128", "passes.gptq.damp=.inf", "expected a finite number, got inf"),
    ("gptq-w4a16-g128", "weights.clip_ratio=.nan", "expected a finite number, got nan"),
    ("anyprec-3to8", "weights={bits: 4, granularity: channel}", "squeezellm quantizes to a lookup table"),
])
def test_values_a_pass_cannot_run_with_are_refused_up_front(recipe, override, match):
    """Each of these reached the run: an IndexError (no samples), a silent no-op (no q/k clip samples), a damping
    loop that never ends (inf), a ValueError after the Fisher pass (squeezellm on plain weights)."""
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe, [override])


@pytest.mark.parametrize(("text", "match"), [
    ("name: x\nweight: {bits: 4}\npasses: [{name: rtn}]\n", r"r\.yaml: unknown field 'weight'; allowed: name, "),
    ("name: ''\npasses: [{name: rtn}]\n", r"r\.yaml\.name: a recipe needs a non-empty string name"),
    ("name: x\ndescription: [a, b]\npasses: [{name: rtn}]\n", r"r\.yaml\.description: expected a string"),
    ("name: x\ntargets: []\npasses: [{name: rtn}]\n", r"r\.yaml\.targets: expected a non-empty list of roles"),
    ("name: x\ntargets: [qkv, mlp]\npasses: [{name: rtn}]\n", r"r\.yaml\.targets: expected a non-empty list of roles"),
    ("name: x\ncalibration: {hessian_inputs: quantized}\npasses: [{name: gptq}]\n",
     r"hessian_inputs: 'quantized' needs an `activations` section"),
    ("name: x\npasses: [{name: rtn}, {name: clip}]\n", "the last pass must be the one weight quantizer"),
    ("name: x\npasses: [{name: smooth}, {name: smooth}, {name: rtn}]\n", "a pass appears twice"),
    ("name: x\npasses: [{name: rotate}, {name: rtn}]\n", "rotate needs fold_norms before it"),
    ("name: x\npasses: [{name: fold_norms, enabled: false}, {name: rotate}, {name: rtn}]\n",
     "rotate needs fold_norms before it"),
    ("name: x\npasses: [{name: clip}, {name: smooth}, {name: rtn}]\n", "transform smooth must come before"),
    ("name: x\npasses: [{name: smooth, enabled: 'no'}, {name: rtn}]\n", r"\(smooth\)\.enabled: expected true or false"),
    ("name: x\npasses: [{name: rtn, enabled: false}]\n", r"\(rtn\): the weight quantizer cannot be disabled"),
])
def test_recipes_that_would_run_otherwise_than_written_are_refused(tmp_path, text, match):
    """Each of these would run, silently, something other than what the file says (a misspelt section ignored, no
    layer quantized, an empty name saved, a quantizer followed by a step that reads weights it has already replaced,
    a pass run twice or without its prerequisite, a rotation through norms never folded, a quoted 'no' read as
    enabled, a disabled quantizer), so it is refused naming the field."""
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=match):
        load_recipe(path)


def test_a_disabled_pass_needs_no_prerequisite_and_null_sections_are_off(tmp_path):
    """A step switched off (an ablation) is not checked for its prerequisites, and `activations: null` or
    `kv_cache: null` switch those simulations off (what `--set kv_cache=null` writes)."""
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nactivations: null\nkv_cache: null\n"
                    "passes: [{name: rotate, enabled: false}, {name: rtn}]\n")
    recipe = load_recipe(path)
    assert recipe.activations is None and recipe.kv_cache is None
    assert [(p.name, p.enabled) for p in recipe.passes] == [("rotate", False), ("rtn", True)]
    assert load_recipe("qoq", ["kv_cache=null"]).kv_cache is None


def test_a_missing_recipe_file_is_named_not_taken_for_a_bundled_name(tmp_path, monkeypatch):
    """A path ending in .yaml that is not there is named as a missing file (a typo in the path, a file not yet
    written), even when its stem names a bundled recipe, not as an unknown recipe name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"recipe file rtn-w8a8\.yaml not found"):
        load_recipe("rtn-w8a8.yaml")


@pytest.mark.parametrize("value", ["3", "true", "gptq", "{name: gptq}"])
def test_passes_that_are_not_a_list_are_refused_naming_the_field(value: str) -> None:
    """`passes` given as a scalar or a mapping (a --set or an indentation slip) is a clear error naming the field: an
    int or bool crashed with a TypeError traceback, and a string or mapping was iterated into "passes[0]" errors."""
    with pytest.raises(RecipeError, match=r"gptq-w4a16\.yaml\.passes: expected a list of passes, each a mapping "):
        load_recipe("gptq-w4a16", [f"passes={value}"])


@pytest.mark.parametrize(("override", "match"), [
    ("calibration.seed=true", "calibration.seed: expected an integer, got True"),
    ("passes.gptq.damp=true", r"\(gptq\)\.damp: expected a number, got True"),
    ("weights.symmetric=1", "weights.symmetric: expected true or false, got 1"),
    ("calibration.text_field=5", "calibration.text_field: expected a string, got 5"),
])
def test_a_value_of_another_yaml_type_is_refused(override: str, match: str) -> None:
    """YAML's true is not the integer 1 nor the number 1.0, 1 is not true, and 5 is not the text "5": each is
    refused naming the field, where Python's bool-is-int (or no check at all) would have run something else."""
    with pytest.raises(RecipeError, match=match):
        load_recipe("gptq-w4a16-g128", [override])


@pytest.mark.parametrize("written", ["1e-2", "1.0e-2", "10e-3", "1.0E-2", "+1e-2"])
def test_a_number_in_exponent_form_is_a_number(tmp_path, written: str) -> None:
    """1e-2 is text to PyYAML's YAML 1.1 (it wants a dot and an exponent sign) but a number to YAML 1.2 and to anyone
    writing it: a number field takes it, from --set and from a recipe file alike, and the saved recipe holds the
    number. A quoted number in another form stays text, and refused."""
    assert load_recipe("gptq-w4a16-g128", [f"passes.gptq.damp={written}"]).passes[0].config.damp == 0.01
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"name: mine\nweights: {{bits: 4}}\npasses:\n  - {{name: gptq, damp: {written}}}\n")
    assert "damp: 0.01" in to_yaml(load_recipe(recipe))
    with pytest.raises(RecipeError, match=r"damp: expected a number, got '0\.01'"):
        load_recipe("gptq-w4a16-g128", ["passes.gptq.damp='0.01'"])


@pytest.mark.parametrize("recipe", ["rtn-w4a16-g128", "qoq"])
def test_an_item_of_targets_is_refused_naming_how_to_set_it(recipe: str) -> None:
    """`--set targets.0=down` had made targets a mapping ("expected a non-empty list of roles") or said to set a
    field of a pass: targets is a list, set whole."""
    with pytest.raises(RecipeError, match=r"--set targets\.0: targets is a list of roles; set it whole, e\.g\. "
                                          r"targets=\[qkv,o,down\]"):
        load_recipe(recipe, ["targets.0=down"])
    assert load_recipe(recipe, ["targets=[down]"]).targets == ["down"]


def test_passes_are_numbered_from_zero_and_a_number_past_the_last_is_named() -> None:
    """`--set passes.N.field` addresses the pass at index N (qqq: 0 smooth, 1 gptq), and an index past the last pass
    is an error naming the recipe's passes, not an IndexError."""
    recipe = load_recipe("qqq", ["passes.1.damp=0.05"])
    assert [p.name for p in recipe.passes] == ["smooth", "gptq"] and recipe.passes[1].config.damp == 0.05
    with pytest.raises(RecipeError, match=r"no pass '1' at passes\.1; the recipe's passes are \['gptq'\]"):
        load_recipe("gptq-w4a16-g128", ["passes.1.damp=0.05"])


@pytest.mark.parametrize(("recipe", "override", "match"), [
    ("gptq-w4a16-g128", "calibration.seq_len=1", "seq_len at least 2"),
    ("gptq-w4a16-g128", "engine.error_samples=0", "error_samples must be positive or null, got 0"),
    ("rtn-w8a8", "activations.clip_ratio=1.5", r"activation clip_ratio must be in \(0, 1\], got 1.5"),
])
def test_values_out_of_their_range_are_refused(recipe: str, override: str, match: str) -> None:
    """A one-token window (no token but the attention sink to measure), zero error samples (which would read as
    "all") and an activation clip ratio above 1 (widening the range) are refused where --set gives them."""
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe, [override])


def test_set_fills_a_section_the_recipe_file_leaves_null(tmp_path: Path) -> None:
    """`--set activations.bits=8` adds the section to a recipe that says `activations: null`, as to one without the
    key (README: "this adds the section when the recipe has none")."""
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nactivations: null\npasses: [{name: rtn}]\n")
    assert load_recipe(path, ["activations.bits=8"]).activations.bits == 8


def test_enabled_pass_gives_a_listed_and_enabled_pass_config_only():
    """qoq-g128 lists clip and gptq: their configs; a pass it does not list, or one switched off, gives None. GPTQ's
    groups are dynamic only with act-order and without static groups."""
    recipe = load_recipe("qoq-g128")
    assert recipe.enabled_pass("clip") is not None and recipe.enabled_pass("squeezellm") is None
    assert recipe.enabled_pass("gptq").block_size == 128
    off = load_recipe("qoq-g128", overrides=["passes.clip.enabled=false"])
    assert off.enabled_pass("clip") is None
    gptq = recipe.enabled_pass("gptq")
    assert [type(gptq)(act_order=a, static_groups=s).dynamic_groups
            for a, s in ((True, False), (True, True), (False, False))] == [True, False, False]

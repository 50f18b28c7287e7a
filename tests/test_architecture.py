"""The package's import graph: no cycles (lazy imports inside functions included), and the layers of
shared/STYLE.md's stack import only downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"


def _imports() -> dict[str, set[str]]:
    """Module -> the quantkit modules it imports anywhere in its body (a package's own submodules excluded)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quantkit"):
                # `from quantkit.passes import register` names the package; `from quantkit.passes import gptq` a module
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("quantkit")]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and not (path.name == "__init__.py"
                                                                  and target.startswith(name + ".")):
                    deps.add(target)
                    break
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _imports()
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            module = stack.pop()
            assert module != start, f"{start} imports itself back through {sorted(graph[start])}"
            if module not in seen:
                seen.add(module)
                stack.extend(graph[module])


# each layer may import those to its right only (kernels and models are floors of their own); eval reads artifacts
# and may not reach into the engine that writes them
LAYERS = ["quantkit.cli", "quantkit.pipeline", "quantkit.eval", "quantkit.passes", "quantkit.quantizers"]
FLOORS = {"quantkit.models": {"quantkit.errors", "quantkit.files", "quantkit.simulate", "quantkit.quantizers"},
          "quantkit.formats": {"quantkit.errors", "quantkit.quantizers"},
          "quantkit.quantizers": {"quantkit.errors"}}


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_floors_import_nothing_above_them(floor):
    graph = _imports()
    for module, deps in graph.items():
        if module == floor or module.startswith(floor + "."):
            above = {d for d in deps if not d.startswith(floor) and d not in FLOORS[floor]}
            assert not above, f"{module} imports {sorted(above)} from above its layer"


def test_nothing_imports_the_cli_or_the_pipeline_from_below():
    graph = _imports()
    for module, deps in graph.items():
        for i, layer in enumerate(LAYERS):
            if module == layer or module.startswith(layer + "."):
                upper = {d for d in deps for up in LAYERS[:i] if d == up or d.startswith(up + ".")}
                assert not upper, f"{module} imports {sorted(upper)} from a layer above it"


def test_formats_name_the_roles_the_adapters_do():
    """The formats layer names the block's linear roles itself (it may not import models): the same roles."""
    from quantkit.formats.base import ROLES as FORMAT_ROLES
    from quantkit.formats.compressed_tensors import ROLE_PATTERNS
    from quantkit.models.adapters import ROLES

    assert FORMAT_ROLES == ROLES and tuple(ROLE_PATTERNS) == ROLES

"""The import directions of jitattn's modules: arrows run one way, from the spec down to the launch.

Every module has a layer (the table below). A module may import only modules of a *lower* layer
(module-level and function-level imports alike: a lazy import is still an arrow), and never a private
(``_``-prefixed) name of another module. A new module must be placed in the table; a back-arrow fails
with the pair that broke the order. ARCHITECTURE.md walks the same layers top to bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jitattn"

# Lowest first. Same layer: no arrows either way.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("trace", "cuda_driver", "_version", "archs", "constants", "utility_module"),  # no jitattn imports
    ("settings", "variant"),                        # env vars; hooks and the structural mask (the visibility rule)
    ("spec",),                                      # the frozen description; canonical JSON; key
    ("dtypes", "render", "models"),                 # torch dtype tables; templates -> source; configs -> specs
    ("checks", "build", "merge_module", "append_kv_module"),  # input checks; nvcc; the merge_state / append_kv modules
    ("modules", "planning"),                        # the module protocol; plan / run (metadata -> packed Params)
    ("commands",),                                  # the warm-up command lines errors name
    ("cache",),                                     # the content-addressed store
    ("reference", "runtime"),                       # the oracle; load + launch (never the oracle)
    ("merge",),                                     # merge_state
    ("kv_write",),                                  # append_kv (its kernel packs Params as merge's does)
    ("cascade",),                                   # shared prefixes
    ("backends.base",),
    ("backends.common",),
    ("backends.reference", "backends.sdpa", "backends.flashinfer", "backends.jit"),
    ("backends.flex",),
    ("backends",),
    ("selector",),
    ("ops",),
    ("jitattn",),                                   # the package's __init__: the public re-exports
    ("integrations", "integrations.transformers", "testing"),
    ("cache_admin", "doctor"),
    ("bench.cases",),                               # the catalogue (no torch)
    ("bench.report",),
    ("bench.harness",),
    ("bench.anchors", "bench.warm_load"),
    ("bench.compile_figures", "bench.host", "bench.generate"),
    ("bench.mla",),                                 # the MLA decode rows (uses host's plan/run call)
    ("bench.run",),
    ("bench",),
    ("cli",),
    ("__main__", "bench.__main__"),
)
TOP = "jitattn"  # the package's __init__


def module_name(path: Path, package: Path) -> str:
    """``jitattn/backends/flex.py`` -> ``backends.flex``; a package's ``__init__`` is the package name."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or TOP


def layer_of(module: str) -> int | None:
    """The layer of ``module``; a submodule of a listed package (``bench.cases``) takes its package's."""
    probe = module
    while probe:
        for rank, names in enumerate(LAYERS):
            if probe in names:
                return rank
        probe = probe.rpartition(".")[0]
    return None


def imports(source: str, module: str, known: set[str]) -> list[tuple[str, str | None]]:
    """Every jitattn module ``source`` imports, with the imported name when it is a ``from`` import.

    ``from jitattn import x`` counts as an import of module ``x`` when ``x`` is a module, else of the
    package. Relative imports are resolved against ``module``.
    """
    found: list[tuple[str, str | None]] = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name.removeprefix("jitattn.") if a.name != "jitattn" else TOP, None)
                      for a in node.names if a.name == "jitattn" or a.name.startswith("jitattn.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level] if module != TOP else []
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "jitattn" or (node.module or "").startswith("jitattn."):
                target = node.module.removeprefix("jitattn").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in known:
                    found.append((sub, None))
                else:
                    found.append((target or TOP, alias.name))
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, no import at run time)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def violations(sources: dict[str, str]) -> list[str]:
    """Back-arrows (the package's ``__init__`` included), private cross-module names, unplaced modules."""
    known = set(sources)
    bad: list[str] = []
    for module, source in sorted(sources.items()):
        rank = layer_of(module)
        if rank is None:
            bad.append(f"{module}: not in tests/test_layering.py's LAYERS; place it in the layer it belongs to")
            continue
        for target, name in imports(source, module, known):
            if target == module or target.startswith(module + "."):
                continue  # a package importing its own submodules
            if name is not None and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{module} imports the private name {target}.{name}: make it public or keep it inside")
            other = layer_of(target)
            if other is None:
                bad.append(f"{module} imports {target}, which is not in LAYERS")
            elif other >= rank:
                bad.append(f"{module} (layer {rank}) imports {target} (layer {other}): an arrow upwards or sideways")
    return bad


def package_sources(package: Path = PACKAGE) -> dict[str, str]:
    return {module_name(p, package): p.read_text() for p in sorted(package.rglob("*.py"))}


def test_imports_run_one_way():
    bad = violations(package_sources())
    assert not bad, "import directions broken:\n  " + "\n  ".join(bad)


def test_every_module_is_placed():
    unplaced = [m for m in package_sources() if layer_of(m) is None]
    assert not unplaced


@pytest.mark.parametrize("planted, target, line", [
    ("spec", "runtime", "from jitattn.runtime import load_kernel"),                 # a back-arrow
    ("runtime", "reference", "from jitattn.reference import paged_attention"),      # sideways: the oracle
    ("cache", "jitattn", "from jitattn import __version__"),                        # the package from inside
])
def test_a_planted_back_arrow_fails(planted, target, line):
    sources = package_sources()
    assert not any(v.startswith(f"{planted} (layer") and f"imports {target} (layer" in v
                   for v in violations(sources))
    sources[planted] += f"\ndef _planted():\n    {line}\n"  # a lazy import is an arrow too
    assert any(v.startswith(f"{planted} (layer") and f"imports {target} (layer" in v for v in violations(sources))


def test_a_private_cross_module_import_fails():
    sources = package_sources()
    sources["cascade"] += "\nfrom jitattn.checks import _private_helper\n"
    assert any("private name checks._private_helper" in line for line in violations(sources))

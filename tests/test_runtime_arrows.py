"""The runtime's imports run one way (CPU, from the source text): no reference oracle under the runtime,
no private name taken from another module, kernel constants read from the templates, not re-typed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import jitattn
from jitattn.constants import template_constant

PKG = Path(jitattn.__file__).parent


def _imports(name: str) -> list[tuple[str, str]]:
    """(module, imported name) of every ``from jitattn... import`` in ``jitattn/<name>.py``."""
    tree = ast.parse((PKG / f"{name}.py").read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jitattn"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("jitattn")]
    return out


@pytest.mark.parametrize("name", ["runtime", "planning", "checks", "dtypes", "constants", "cascade", "merge"])
def test_no_private_name_crosses_a_module(name):
    private = [(m, n) for m, n in _imports(name) if n.startswith("_") and m != "jitattn"]
    assert private == [], f"jitattn/{name}.py imports private names {private}"


@pytest.mark.parametrize("name", ["runtime", "planning", "checks", "dtypes", "constants"])
def test_the_launch_path_does_not_import_the_reference(name):
    found = [(m, n) for m, n in _imports(name) if m == "jitattn.reference" or (m, n) == ("jitattn", "reference")]
    assert found == [], f"jitattn/{name}.py imports the reference oracle: {found}"


def test_the_bottom_modules_import_only_the_spec_layer():
    assert _imports("constants") == []
    assert {m for m, _ in _imports("dtypes")} <= {"jitattn.spec", "jitattn.variant"}


def test_max_splits_is_the_templates_constant():
    from jitattn import runtime

    assert runtime.MAX_SPLITS == template_constant("kMaxSplits")
    assert "= 64" not in (PKG / "spec.py").read_text().split("def decode_block_problem", 1)[-1].split("\ndef ", 1)[0]


def test_template_constant_names_what_it_did_not_find():
    with pytest.raises(LookupError, match=r"template constant kNoSuchThing: expected one `constexpr int kNoSuchThing"):
        template_constant("kNoSuchThing")

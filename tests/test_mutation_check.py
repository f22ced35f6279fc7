"""tools/mutation_check.py's table stays current: each planted text occurs once in today's tree and
each named test exists (the mutation runs themselves take a minute: run the tool)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "tools" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


mutation_check = _load_tool()


def test_every_planted_text_occurs_once_in_the_tree():
    assert mutation_check.stale_rows(mutation_check.MUTATIONS, REPO) == []
    names = [m.name for m in mutation_check.MUTATIONS]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("m", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_every_named_test_exists(m):
    assert m.original != m.mutated
    for target in mutation_check._selection(m):
        path, _, name = target.partition("::")
        assert (REPO / path).is_file(), target
        if name:
            assert f"def {name}(" in (REPO / path).read_text(), target

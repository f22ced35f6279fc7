"""Kernel constants the host needs, read from the CUDA templates' text (never re-typed in Python).

A bottom module: it imports nothing of jitattn, so :mod:`jitattn.spec` may use it. The templates
declare each such constant on one line of the form ``constexpr int kName = <integer>;``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path


def _template_dirs() -> tuple[Path, ...]:
    """Where the headers are: ``jitattn/templates`` in an installed wheel, ``templates/`` in a checkout."""
    here = Path(__file__).resolve().parent
    return here / "templates", here.parent / "templates"


@lru_cache(maxsize=None)
def template_constant(name: str) -> int:
    """The value of ``constexpr int <name> = <integer>;`` in the template headers (``*.cuh``).

    Raises:
        LookupError: no header declares it, or two declare different values (with the files).
    """
    pattern = re.compile(rf"^\s*(?:static\s+)?constexpr\s+int\s+{re.escape(name)}\s*=\s*(-?\d+)\s*;", re.M)
    found: dict[str, int] = {}
    dirs = [d for d in _template_dirs() if d.is_dir()]
    for directory in dirs[:1]:  # the wheel's copy wins over a checkout's, as in jitattn.render.template_dir
        for path in sorted(directory.glob("*.cuh")):
            for match in pattern.finditer(path.read_text()):
                found[path.name] = int(match.group(1))
    values = set(found.values())
    if len(values) != 1:
        where = ", ".join(f"{f}: {v}" for f, v in found.items()) or f"no header in {dirs[:1] or _template_dirs()}"
        raise LookupError(f"template constant {name}: expected one `constexpr int {name} = <integer>;` in the "
                          f"template headers, found {where}")
    return values.pop()

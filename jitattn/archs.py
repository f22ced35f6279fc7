"""The target archs jitattn builds, and which of them run on a device: a bottom module (no imports
from jitattn), read by the settings, the build, the backends and the runtime.
"""

from __future__ import annotations

import re

#: Arch name -> the ``-gencode`` value that builds its cubin. ``a`` archs use arch-specific features.
ARCHS: dict[str, str] = {
    "sm_80": "arch=compute_80,code=sm_80",
    "sm_86": "arch=compute_86,code=sm_86",
    "sm_89": "arch=compute_89,code=sm_89",
    "sm_90": "arch=compute_90,code=sm_90",
    "sm_90a": "arch=compute_90a,code=sm_90a",
    "sm_100a": "arch=compute_100a,code=sm_100a",
    "sm_120": "arch=compute_120,code=sm_120",
}

#: The oldest compute capability the kernels support (cp.async, bf16 tensor cores: Ampere).
MIN_ARCH = "sm_80"


def normalize_arch(value: str, *, field: str = "arch") -> str:
    """``"90a"``, ``"sm90a"``, ``"9.0a"`` or ``"sm_90a"`` -> ``"sm_90a"``.

    Raises:
        ValueError: not an arch name, an arch below :data:`MIN_ARCH` (said so), or one jitattn does
            not build; the message names ``field`` and the archs it builds.
    """
    raw = str(value).strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)\.?(\d)?([a-z]?)", raw)
    name = None
    if m:
        major_minor = m.group(1) + (m.group(2) or "")
        if len(major_minor) == 1:
            major_minor += "0"
        name = f"sm_{major_minor}{m.group(3)}"
        if int(major_minor) < int(MIN_ARCH[3:]):
            raise ValueError(f"{field}={value!r}: {name} is below {MIN_ARCH}, which jitattn needs; "
                             f"expected one of {sorted(ARCHS)}")
    if name not in ARCHS:
        raise ValueError(f"{field}={value!r}: unknown target arch; expected one of {sorted(ARCHS)}")
    return name


def archs_for_capability(major: int, minor: int) -> list[str]:
    """Archs whose cubins run on a device of this compute capability, best first.

    A cubin runs on devices of the same major version and an equal or higher minor; ``a`` archs
    run only on exactly their own capability.
    """
    exact = f"sm_{major}{minor}"
    out = [a for a in (exact + "a", exact) if a in ARCHS]
    for name in sorted(ARCHS, reverse=True):
        if name.endswith("a") or name in out:
            continue
        num = int(name[3:])
        if num // 10 == major and num % 10 <= minor:
            out.append(name)
    return out

"""What the small fixed utility modules (``merge_state``, ``append_kv``) share: their JSON, key and name.

A utility module is a frozen dataclass of dtype names (no spec): one compiled module per value of
its fields. :class:`UtilityModule` gives such a dataclass the JSON side of the module protocol
(:class:`jitattn.modules.KernelModule`): ``to_json`` / ``canonical_json`` / ``from_json``, the
content ``key`` and a readable ``name``. The subclass sets :attr:`KIND` and writes ``describe`` and
``render``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar

#: Short dtype names used in module names.
SHORT_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}


class UtilityModule:
    """Mixin for a frozen dataclass whose fields are dtype names; ``KIND`` names it in its JSON."""

    KIND: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace: the text the cache key hashes and ``jitattn warmup --spec`` takes."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> Any:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: not this kind's JSON, a missing required field or an unknown one (or the
                dataclass's own ValueError for a bad dtype).
        """
        if isinstance(data, str):
            data = json.loads(data)
        data = dict(data)
        if data.pop("kind", None) != cls.KIND:
            raise ValueError(f"{cls.__name__}.from_json: expected \"kind\": \"{cls.KIND}\", got {data!r}")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        if set(data) - {f.name for f in fields} or any(name not in data for name in required):
            allowed = ("exactly the field " if len(fields) == 1 else "the fields ") + " and ".join(
                repr(f.name) for f in fields)
            raise ValueError(f"{cls.__name__}.from_json: expected {allowed}, got {sorted(data)}")
        return cls(**data)

    @property
    def key(self) -> str:
        """Content hash of the canonical JSON (hex sha256, first 16 chars)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """Readable, filesystem-safe name: the kind, each dtype short, the key's first 8 characters
        (``merge_state_bf16_1a2b3c4d``, ``append_kv_bf16_fp8_5e6f7a8b``)."""
        values = [SHORT_DTYPES[v] for v in dataclasses.asdict(self).values()]  # type: ignore[call-overload]
        return "_".join([self.KIND, *values, self.key[:8]])

"""Attention variants: the functors a kernel is specialised with.

A variant is what turns plain softmax attention into the attention a model needs. The built-in
features of :class:`~jitattn.spec.AttentionSpec` (soft-cap, ALiBi, sinks, windows, causal) are
fixed functors rendered by the templates; a :class:`Variant` adds user functors written as CUDA
expressions, plus the extra kernel parameters they read.

Order in which the kernels apply them to one (query, key) pair; ``s`` is the scaled logit::

    s = sm_scale * dot(q, k)                     # natural units
    s = cap * tanh(s / cap)                      # if logits_soft_cap > 0
    s = s + alibi_slopes[qo_head] * (kv_idx - qo_idx)   # if alibi
    s = logits_transform(s, ...)                 # if the variant has one
    visible = causal/window bounds and logits_mask(...)  # masked pairs get probability 0

CUDA functor contract (one C++ expression, evaluated per (query, key) pair in fp32):

- ``logits_transform``: an expression of type ``float``; it may use ``logits`` (float, natural
  units, after soft-cap and ALiBi), ``batch``, ``qo_head``, ``kv_head``, ``qo_idx``, ``kv_idx``,
  ``qo_len``, ``kv_len`` (int; ``qo_idx`` and ``kv_idx`` are absolute positions in the sequence,
  queries at ``kv_len - qo_len ... kv_len - 1``) and every declared :class:`Param` by name.
- ``logits_mask``: an expression convertible to ``bool``, true where the pair is visible; the same
  names except ``logits``.

Tensor parameters arrive as ``const T* __restrict__`` pointers to contiguous memory (index them
yourself, e.g. ``bias[qo_head]``); scalar parameters as ``float`` or ``int``.

Example::

    Variant(
        name="per_head_bias",
        logits_transform="logits + bias[qo_head] * (float)(kv_idx - qo_idx)",
        params=(Param("bias", "float32", ("num_qo_heads",)),),
        reference_transform=lambda s, b, h, qi, ki, p: s + p["bias"][h] * (ki - qi),
    )

``reference_transform(logits, batch, qo_head, qo_idx, kv_idx, params)`` and
``reference_mask(batch, qo_head, qo_idx, kv_idx, params)`` are the same functors written in torch
for :mod:`jitattn.reference`: ``logits`` is float32 ``(num_qo_heads, qo_len, kv_len)``,
``qo_head`` is ``(num_qo_heads, 1, 1)``, ``qo_idx`` ``(1, qo_len, 1)``, ``kv_idx`` ``(1, 1, kv_len)``
(int64), ``batch`` an int and ``params`` a dict of the call's parameter tensors. They are not part
of the kernel key.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Callable

#: Dtypes a parameter may have, with their CUDA spelling.
PARAM_DTYPES: dict[str, str] = {
    "float32": "float",
    "int32": "int",
    "int64": "long long",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
}
#: Scalar parameters are passed by value; only these dtypes are allowed for them.
SCALAR_DTYPES = ("float32", "int32")
#: Names a shape dimension may use besides a positive int; checked against the call's tensors.
SYMBOLIC_DIMS = ("batch", "num_qo_heads", "num_kv_heads", "total_q", "*")
#: Names the functor expressions see; a parameter may not shadow them.
FUNCTOR_NAMES = ("logits", "batch", "qo_head", "kv_head", "qo_idx", "kv_idx", "qo_len", "kv_len")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CUDA_RESERVED = {"float", "int", "double", "bool", "char", "long", "short", "unsigned", "signed",
                  "void", "auto", "const", "return", "if", "else", "for", "while", "do", "switch",
                  "case", "default", "break", "continue", "struct", "class", "template", "params"}


@dataclass(frozen=True)
class Param:
    """An extra kernel parameter a variant's functors read.

    Args:
        name: a C identifier; the functors use it by this name, the call passes it as
            ``params={name: value}``.
        dtype: one of :data:`PARAM_DTYPES`; scalars (``shape == ()``) take float32 or int32.
        shape: ``()`` for a scalar, else the tensor's shape: positive ints or the symbols in
            :data:`SYMBOLIC_DIMS` (checked against the call), ``"*"`` for any size.

    Raises:
        ValueError: a bad name, dtype or shape, with the field and what is allowed.
    """

    name: str
    dtype: str = "float32"
    shape: tuple[int | str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _IDENT.match(self.name):
            raise ValueError(f"Param.name={self.name!r}: expected a C identifier ([A-Za-z_][A-Za-z0-9_]*)")
        if self.name in FUNCTOR_NAMES or self.name in _CUDA_RESERVED or keyword.iskeyword(self.name):
            raise ValueError(
                f"Param.name={self.name!r}: reserved (functor variables are {FUNCTOR_NAMES}); pick another name")
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"Param({self.name!r}).dtype={self.dtype!r}: expected one of {tuple(PARAM_DTYPES)}")
        object.__setattr__(self, "shape", tuple(self.shape))
        for dim in self.shape:
            ok = (isinstance(dim, int) and not isinstance(dim, bool) and dim > 0) or dim in SYMBOLIC_DIMS
            if not ok:
                raise ValueError(
                    f"Param({self.name!r}).shape={self.shape!r}: each dim must be a positive int or one of "
                    f"{SYMBOLIC_DIMS}")
        if self.is_scalar and self.dtype not in SCALAR_DTYPES:
            raise ValueError(
                f"Param({self.name!r}).dtype={self.dtype!r}: a scalar (shape=()) must be one of {SCALAR_DTYPES}")

    @property
    def is_scalar(self) -> bool:
        return self.shape == ()

    @property
    def cuda_type(self) -> str:
        """The kernel argument's C++ type: ``float`` / ``int`` or ``const T* __restrict__``."""
        base = PARAM_DTYPES[self.dtype]
        return base if self.is_scalar else f"const {base}* __restrict__"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Variant:
    """User functors injected into the kernels, as CUDA expressions (contract in the module doc).

    Args:
        name: a C identifier naming the variant in kernel names and logs.
        logits_transform: C++ float expression replacing the logit, or None.
        logits_mask: C++ bool expression, true where a (query, key) pair is visible, or None.
        params: the extra parameters the expressions read.
        reference_transform, reference_mask: the same functors in torch, for the reference
            implementation (signatures in the module doc). Not part of the kernel key.

    Raises:
        ValueError: bad name, empty expression, duplicate parameter names, or an expression
            that uses a name it may not (checked loosely: unknown identifiers are left to nvcc).
    """

    name: str
    logits_transform: str | None = None
    logits_mask: str | None = None
    params: tuple[Param, ...] = ()
    reference_transform: Callable[..., Any] | None = field(default=None, compare=False, hash=False, repr=False)
    reference_mask: Callable[..., Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _IDENT.match(self.name):
            raise ValueError(f"Variant.name={self.name!r}: expected a C identifier ([A-Za-z_][A-Za-z0-9_]*)")
        object.__setattr__(self, "params", tuple(self.params))
        for p in self.params:
            if not isinstance(p, Param):
                raise ValueError(f"Variant({self.name!r}).params: expected Param objects, got {p!r}")
        names = [p.name for p in self.params]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Variant({self.name!r}).params: duplicate names {dupes}")
        for fname in ("logits_transform", "logits_mask"):
            code = getattr(self, fname)
            if code is None:
                continue
            if not isinstance(code, str) or not code.strip():
                raise ValueError(f"Variant({self.name!r}).{fname}={code!r}: expected a non-empty C++ expression or None")
            if ";" in code or "{" in code:
                raise ValueError(
                    f"Variant({self.name!r}).{fname}: expected one C++ expression, got statements "
                    f"({code.strip()[:60]!r}); use the ternary operator or a helper in the expression")
        if self.logits_mask is not None and re.search(r"\blogits\b", self.logits_mask):
            raise ValueError(f"Variant({self.name!r}).logits_mask uses 'logits'; a mask sees positions only")

    @property
    def has_transform(self) -> bool:
        return self.logits_transform is not None

    @property
    def has_mask(self) -> bool:
        return self.logits_mask is not None

    def to_json(self) -> dict[str, Any]:
        """Canonical form: everything that changes the kernel, nothing that does not."""
        return {
            "name": self.name,
            "logits_transform": self.logits_transform,
            "logits_mask": self.logits_mask,
            "params": [p.to_json() for p in self.params],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Variant":
        params = tuple(Param(p["name"], p["dtype"], tuple(p["shape"])) for p in data.get("params", ()))
        return cls(name=data["name"], logits_transform=data.get("logits_transform"),
                   logits_mask=data.get("logits_mask"), params=params)


def alibi_slopes(num_heads: int) -> list[float]:
    """The standard ALiBi head slopes (Press et al. 2022, "Train Short, Test Long", section 3).

    For ``n`` a power of two the slopes are the geometric sequence ``2 ** (-8 * (h + 1) / n)``,
    ``h = 0 .. n-1``. Otherwise the slopes of the closest smaller power of two ``m`` come first,
    followed by every other slope of the ``2m`` sequence (the paper's reference code; BLOOM uses it).

    Raises:
        ValueError: ``num_heads`` is not a positive int.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads={num_heads!r}: expected a positive int")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    closest = 1 << (num_heads.bit_length() - 1)
    slopes = geometric(closest)
    if closest < num_heads:
        slopes += geometric(2 * closest)[0::2][: num_heads - closest]
    return slopes

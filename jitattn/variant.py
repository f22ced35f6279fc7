"""Attention variants: the functors a kernel is specialised with.

A variant is what turns plain softmax attention into the attention a model needs. Each hook is
either a **Python function**, traced once into a CUDA expression (:mod:`jitattn.trace`) and called
as-is on torch tensors by :mod:`jitattn.reference` (so the same function is both the kernel code and
the reference semantics), or a **CUDA expression string** (then the torch version, if you want a
reference, is ``reference_transform`` / ``reference_mask``).

Hooks and their exact signatures (all optional; every declared hook is called by both the prefill
and the decode kernels)::

    logits_transform(score, batch, qo_head, qo_idx, kv_idx, params) -> score
    logits_mask(batch, qo_head, qo_idx, kv_idx, params) -> bool       # True: the pair is visible
    query_transform(x, x_rot, batch, qo_head, qo_idx, dim, params) -> x
    key_transform(x, x_rot, batch, kv_head, kv_idx, dim, params) -> x
    output_transform(out, batch, qo_head, qo_idx, dim, params) -> out

- ``score`` is the scaled logit ``sm_scale * q.k`` after the built-in soft-cap and ALiBi;
  ``qo_idx`` / ``kv_idx`` are absolute positions in the sequence (queries sit at
  ``kv_len - qo_len ... kv_len - 1``); ``batch`` is the sequence index; heads are global indices.
- ``x`` is one element (dimension ``dim``) of the query or key vector before the dot product and
  ``x_rot`` the element ``rotate_half`` puts there (``-x[dim + D/2]`` for ``dim < D/2``, else
  ``x[dim - D/2]``), so rotary embedding is ``x * cos + x_rot * sin``.
- ``out`` is one element of the normalised output, before it is stored.
- ``params`` holds the declared :class:`Param` values: ``params.name`` (or ``params["name"]``); tensors
  are indexed with integer values, e.g. ``params.slopes[qo_head]``.
- ``softmax=False`` makes the variant a weighted sum without softmax: the transformed score is the
  weight of its value (sigmoid attention: ``torch.sigmoid(score + params.bias)``), masked pairs weigh 0,
  and there is no lse.

When traced, arguments are symbolic; on the reference path they are broadcastable torch tensors:
``score`` float32 ``(num_qo_heads, qo_len, kv_len)``, ``qo_head`` ``(num_qo_heads, 1, 1)``, ``qo_idx``
``(1, qo_len, 1)``, ``kv_idx`` ``(1, 1, kv_len)``; for the vector hooks ``x`` is ``(len, heads, D)``,
the head ``(1, heads, 1)``, the position ``(len, 1, 1)`` and ``dim`` ``(1, 1, D)``; ``batch`` is an int.

Example (a per-head distance bias, FlexAttention's score_mod in jitattn)::

    def distance_bias(score, batch, qo_head, qo_idx, kv_idx, params):
        return score - params.slope[qo_head] * torch.abs(qo_idx - kv_idx)

    spec = AttentionSpec(32, 8, 128, variant=Variant(
        "distance_bias", logits_transform=distance_bias,
        params=(Param("slope", "float32", ("num_qo_heads",)),)))

Order in which the kernels apply the pieces to one (query, key) pair::

    s = sm_scale * dot(query_transform(q), key_transform(k))   # natural units
    s = cap * tanh(s / cap)                      # if logits_soft_cap > 0      (built-in functor)
    s = s + alibi_slopes[qo_head] * (kv_idx - qo_idx)   # if alibi       (built-in functor)
    s = logits_transform(s, ...)
    visible = causal/window bounds and logits_mask(...)  # hidden pairs get probability 0
    out = output_transform(softmax-weighted sum of v)

CUDA-string hooks are one C++ expression over the same names (``logits`` for the score, plus
``kv_head``, ``qo_len``, ``kv_len``), the declared parameters by name (tensors as raw
``const T*``: unchecked reads) and, for the vector hooks, ``x``, ``x_rot``, ``dim``.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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


#: Hook name -> (C type of the result, names a CUDA-string hook may not use).
HOOKS: dict[str, str] = {
    "logits_transform": "float",
    "logits_mask": "bool",
    "query_transform": "float",
    "key_transform": "float",
    "output_transform": "float",
}


#: C expressions of the symbolic parameter dims the rendered Spec struct knows.
_DIM_CONSTANTS = {"num_qo_heads": "Spec::kNumQoHeads", "num_kv_heads": "Spec::kNumKvHeads"}


def param_symbols(params: tuple[Param, ...]) -> dict[str, Any]:
    """Traced stand-ins of the parameters: scalars as Syms, tensors as SymTensors."""
    from jitattn.trace import Sym, SymTensor

    values: dict[str, Any] = {}
    for p in params:
        if p.is_scalar:
            values[p.name] = Sym(f"params.{p.name}", "int" if p.dtype == "int32" else "float")
        else:
            ctype = "int" if p.dtype in ("int32", "int64") else "float"
            dims = tuple(str(d) if isinstance(d, int) else _DIM_CONSTANTS.get(d) for d in p.shape)
            values[p.name] = SymTensor(p.name, ctype, dims)
    return values


def hook_arguments(hook: str, params: Mapping[str, Any]) -> tuple:
    """The traced arguments of one hook: symbols named like the kernel's variables."""
    from jitattn.trace import ParamView, Sym

    view = ParamView(params)
    i = lambda name: Sym(name, "int")  # noqa: E731
    return {
        "logits_transform": (Sym("logits", "float"), i("batch"), i("qo_head"), i("qo_idx"), i("kv_idx"), view),
        "logits_mask": (i("batch"), i("qo_head"), i("qo_idx"), i("kv_idx"), view),
        "query_transform": (Sym("x", "float"), Sym("x_rot", "float"), i("batch"), i("qo_head"), i("qo_idx"),
                            i("dim"), view),
        "key_transform": (Sym("x", "float"), Sym("x_rot", "float"), i("batch"), i("kv_head"), i("kv_idx"),
                          i("dim"), view),
        "output_transform": (Sym("out", "float"), i("batch"), i("qo_head"), i("qo_idx"), i("dim"), view),
    }[hook]


def trace_hook(hook: str, fn: Callable[..., Any], params: tuple[Param, ...] | Mapping[str, Any]) -> str:
    """The CUDA expression of a Python hook (see :mod:`jitattn.trace`).

    ``params``: the declared parameters, or ready symbols (built-in functors read built-in arguments).

    Raises:
        jitattn.trace.TraceError: with the function, the source line and what to write instead.
    """
    from jitattn.trace import trace

    symbols = param_symbols(params) if isinstance(params, tuple) else params
    return trace(fn, hook_arguments(hook, symbols), hook=hook, returns=HOOKS[hook]).expr


@dataclass(frozen=True, eq=False)
class Variant:
    """User hooks injected into the kernels (contract and signatures in the module doc).

    Args:
        name: a C identifier naming the variant in kernel names and logs.
        logits_transform, logits_mask: Python functions (traced) or CUDA expression strings, or None.
        params: the extra parameters the hooks read; they become kernel arguments and keyword
            arguments of the call (``params={name: value}``).
        query_transform, key_transform, output_transform: Python functions or CUDA strings, or None.
        softmax: False for a weighted sum without softmax (the transformed score is the weight).
        reference_transform, reference_mask: torch versions of CUDA-string hooks, for the reference.
            Python hooks are their own reference. Not part of the kernel key.
        head_dim: the query/key head dim the hooks are written for (:func:`rotary_embedding` sets it), or
            None (any): a spec whose ``head_dim_qk`` differs refuses the variant. Not part of the kernel key,
            nor of the JSON form: a variant read back by ``from_json`` has None, so the check holds for
            variants built in Python (a key, hence a compiled kernel, is the same either way).

    Equality and hashing follow :meth:`to_json`: two variants are equal when they render the same
    kernels.

    Raises:
        ValueError: a bad name, an empty or multi-statement expression, duplicate parameter names, a
            head_dim that is not a positive int.
        jitattn.trace.TraceError: a Python hook that cannot be traced (function, source line, fix).
    """

    name: str
    logits_transform: str | Callable[..., Any] | None = None
    logits_mask: str | Callable[..., Any] | None = None
    params: tuple[Param, ...] = ()
    reference_transform: Callable[..., Any] | None = field(default=None, repr=False)
    reference_mask: Callable[..., Any] | None = field(default=None, repr=False)
    query_transform: str | Callable[..., Any] | None = None
    key_transform: str | Callable[..., Any] | None = None
    output_transform: str | Callable[..., Any] | None = None
    softmax: bool = True
    head_dim: int | None = None
    cuda: dict[str, str] = field(init=False, repr=False)

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
        if not isinstance(self.softmax, bool):
            raise ValueError(f"Variant({self.name!r}).softmax={self.softmax!r}: expected True or False")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or self.head_dim < 1):
            raise ValueError(f"Variant({self.name!r}).head_dim={self.head_dim!r}: expected a positive int or None")
        if not self.softmax and self.logits_transform is None:
            raise ValueError(f"Variant({self.name!r}): softmax=False needs a logits_transform that gives each "
                             f"value's weight (e.g. torch.sigmoid(score))")
        cuda = {}
        for hook in HOOKS:
            value = getattr(self, hook)
            if value is None:
                continue
            if callable(value):
                cuda[hook] = trace_hook(hook, value, self.params)
            else:
                cuda[hook] = self._check_string(hook, value)
        object.__setattr__(self, "cuda", cuda)

    def _check_string(self, hook: str, code: Any) -> str:
        if not isinstance(code, str) or not code.strip():
            raise ValueError(f"Variant({self.name!r}).{hook}={code!r}: expected a non-empty C++ expression (or a "
                             f"Python function to trace) or None")
        if ";" in code or "{" in code:
            raise ValueError(
                f"Variant({self.name!r}).{hook}: expected one C++ expression, got statements "
                f"({code.strip()[:60]!r}); use the ternary operator or a helper in the expression")
        if hook == "logits_mask" and re.search(r"\blogits\b", code):
            raise ValueError(f"Variant({self.name!r}).logits_mask uses 'logits'; a mask sees positions only")
        return code

    @property
    def has_transform(self) -> bool:
        return "logits_transform" in self.cuda

    @property
    def has_mask(self) -> bool:
        return "logits_mask" in self.cuda

    def reference(self, hook: str) -> Callable[..., Any] | None:
        """The torch implementation of a hook: the Python hook itself, else its reference_* function."""
        value = getattr(self, hook)
        if callable(value):
            return value
        return {"logits_transform": self.reference_transform, "logits_mask": self.reference_mask}.get(hook)

    def to_json(self) -> dict[str, Any]:
        """Canonical form: everything that changes the kernel (traced hooks as their CUDA), nothing else."""
        data: dict[str, Any] = {"name": self.name, "params": [p.to_json() for p in self.params]}
        for hook in HOOKS:
            data[hook] = self.cuda.get(hook)
        if not self.softmax:
            data["softmax"] = False
        return data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Variant) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Variant":
        """Inverse of :meth:`to_json`, hooks as CUDA strings (no torch reference)."""
        params = tuple(Param(p["name"], p["dtype"], tuple(p["shape"])) for p in data.get("params", ()))
        hooks = {hook: data.get(hook) for hook in HOOKS}
        return cls(name=data["name"], params=params, softmax=data.get("softmax", True), **hooks)


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


# ---- built-in features as functors --------------------------------------------------------------
# The spec's soft-cap, ALiBi and causal/window bounds are written once, here, as hook functions:
# the renderer traces them into the kernels (soft-cap and ALiBi run before the user's transform,
# the bounds form the element mask of boundary tiles; whole tiles outside the bounds are still
# skipped from the spec's numbers) and the reference calls them on tensors.

def soft_cap_transform(cap: float) -> Callable[..., Any]:
    """``score -> cap * tanh(score / cap)`` (Gemma-2's attn_logit_softcapping)."""
    from jitattn.trace import tanh

    inv_cap = 1.0 / cap  # a multiply per logit: an IEEE division cost Gemma-2 decode 17% on the H200

    def soft_cap(score, batch, qo_head, qo_idx, kv_idx, params):
        return cap * tanh(score * inv_cap)

    return soft_cap


def alibi_transform(score, batch, qo_head, qo_idx, kv_idx, params):
    """ALiBi: ``score + alibi_slopes[qo_head] * (kv_idx - qo_idx)`` (Press et al. 2022, section 3)."""
    return score + params.alibi_slopes[qo_head] * (kv_idx - qo_idx)


def structural_mask(causal: bool, window_left: int, window_right: int) -> Callable[..., Any] | None:
    """The causal / window bounds of a spec as one mask hook (None when nothing is hidden)."""
    if not causal and window_left < 0 and window_right < 0:
        return None

    def bounds(batch, qo_head, qo_idx, kv_idx, params):
        ok = None
        for cond in ((kv_idx <= qo_idx) if causal else None,
                     (qo_idx - kv_idx <= window_left) if window_left >= 0 else None,
                     (kv_idx - qo_idx <= window_right) if window_right >= 0 else None):
            if cond is not None:
                ok = cond if ok is None else ok & cond
        return ok

    return bounds


def visible_key_range(causal: bool, window_left: int, window_right: int, first_pos: int, last_pos: int,
                      kv_len: int) -> tuple[int, int]:
    """The keys that queries at positions ``first_pos..last_pos`` can see: an inclusive ``(lo, hi)``.

    The closed form of :func:`structural_mask` over one sequence of ``kv_len`` keys (a query at ``p``
    sees ``j`` when ``j <= p`` if causal, ``p - j <= window_left``, ``j - p <= window_right``); for one
    query pass ``first_pos == last_pos``. Empty when ``hi < lo``. Used to count what a kernel reads
    and the (query, key) pairs it computes; ``tests/test_variant.py`` holds it to the mask.
    """
    lo = max(0, first_pos - window_left) if window_left >= 0 else 0
    if causal:
        hi = min(kv_len - 1, last_pos)
    elif window_right >= 0:
        hi = min(kv_len - 1, last_pos + window_right)
    else:
        hi = kv_len - 1
    return lo, hi


def builtin_transforms(spec: Any) -> list[tuple[str, Callable[..., Any]]]:
    """The spec's built-in logits transforms, in the order the kernels apply them."""
    out: list[tuple[str, Callable[..., Any]]] = []
    if spec.logits_soft_cap > 0:
        out.append(("soft_cap", soft_cap_transform(spec.logits_soft_cap)))
    if spec.alibi:
        out.append(("alibi", alibi_transform))
    return out


def builtin_symbols() -> dict[str, Any]:
    """Traced stand-ins of the built-in arguments the built-in functors read."""
    from jitattn.trace import SymTensor

    return {"alibi_slopes": SymTensor("alibi_slopes", "float", ("Spec::kNumQoHeads",), checked=False)}


# ---- a library of variants -----------------------------------------------------------------------
# Each is a few lines of Python: the kernels run the traced CUDA, the reference runs the function.

def document_mask() -> Variant:
    """Packed documents (block-diagonal attention): a query sees keys of its own document only.

    Params: ``doc`` int32 ``(batch * doc_stride,)``: the document id of every position of every
    sequence, row-major; ``doc_stride`` int: positions per sequence in ``doc``. Combine with
    ``causal=True`` for causal document masking (tiles outside the causal bound are still skipped).
    """
    def same_document(batch, qo_head, qo_idx, kv_idx, params):
        row = batch * params.doc_stride
        return params.doc[row + qo_idx] == params.doc[row + kv_idx]

    return Variant("document_mask", logits_mask=same_document,
                   params=(Param("doc", "int32", ("*",)), Param("doc_stride", "int32")))


def prefix_lm_mask() -> Variant:
    """Prefix-LM (Raffel et al. 2020, T5, section 3.2.1): bidirectional inside each sequence's prefix,
    causal after it. Params: ``prefix_len`` int32 ``(batch,)``. Use with ``causal=False`` (the mask
    holds the causal part; a causal spec would skip the prefix keys right of a query)."""
    def prefix_lm(batch, qo_head, qo_idx, kv_idx, params):
        return (kv_idx <= qo_idx) | (kv_idx < params.prefix_len[batch])

    return Variant("prefix_lm", logits_mask=prefix_lm, params=(Param("prefix_len", "int32", ("batch",)),))


def relative_position_bias(num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False) -> Variant:
    """T5's bucketed relative-position bias (Raffel et al. 2020, section 2.1; the bucketing of
    transformers' ``T5Attention._relative_position_bucket``): ``score + table[bucket(q - k), qo_head]``.

    Params: ``table`` float32 ``(num_buckets, num_qo_heads)``.
    """
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    span = num_buckets // 2 if bidirectional else num_buckets

    def bucket(n):  # n = qo_idx - kv_idx
        from jitattn.trace import Sym

        where = _where
        offset = where(n < 0, span, 0) if bidirectional else 0
        n = abs(n) if bidirectional else where(n > 0, n, 0)
        nf = n.float() if isinstance(n, Sym) else n.float()
        large = exact + (_log(_clamp_min(nf, 1.0) / exact) / math.log(max_distance / exact)
                         * (span - exact)).to(_int32())
        large = where(large < span - 1, large, span - 1)
        return offset + where(n < exact, n, large)

    def t5_bias(score, batch, qo_head, qo_idx, kv_idx, params):
        return score + params.table[bucket(qo_idx - kv_idx), qo_head]

    return Variant(f"t5_bias_{num_buckets}_{max_distance}_{'bi' if bidirectional else 'uni'}",
                   logits_transform=t5_bias, params=(Param("table", "float32", (num_buckets, "num_qo_heads")),))


def sigmoid_attention() -> Variant:
    """Sigmoid attention (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
    Self-Attention", section 3): ``out = sum_j sigmoid(s_j + bias) v_j``, no softmax, no lse.
    Params: ``bias`` float (the paper uses ``-log(seq_len)``)."""
    def sigmoid_weight(score, batch, qo_head, qo_idx, kv_idx, params):
        return _sigmoid(score + params.bias)

    return Variant("sigmoid", logits_transform=sigmoid_weight, params=(Param("bias", "float32"),), softmax=False)


def rotary_embedding(head_dim: int, theta: float = 10000.0) -> Variant:
    """Rotary position embedding on q and k inside the kernel (Su et al. 2021, RoFormer, section 3.4,
    in the rotate_half form of GPT-NeoX / Llama): ``x * cos(p w_i) + rotate_half(x) * sin(p w_i)``,
    ``w_i = theta ** (-2 i / head_dim)``, ``i = dim % (head_dim / 2)``. The cache holds raw keys.

    It rotates every dim of the head (``x_rot`` pairs ``dim`` with ``dim +- head_dim / 2`` of the whole
    row), so ``head_dim`` is the spec's ``head_dim_qk``, which refuses another: partial rotary (a rotary dim
    below the head dim, GPT-NeoX's ``rotary_pct``) is not supported.

    Raises:
        ValueError: ``head_dim`` is not a positive even int.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rotary_embedding(head_dim={head_dim!r}): expected a positive even int (the spec's "
                         f"head_dim_qk)")
    half = head_dim // 2

    def rope(x, x_rot, batch, head, pos, dim, params):
        freq = theta ** (-((dim % half).float() * 2.0) / head_dim)
        angle = pos.float() * freq
        return x * _cos(angle) + x_rot * _sin(angle)

    return Variant(f"rope_{head_dim}_{theta:g}".replace(".", "p"), query_transform=rope, key_transform=rope,
                   head_dim=head_dim)


# Math for the library functors: the same call on traced values and on torch tensors.
def _where(cond, a, b):
    from jitattn.trace import Sym

    if any(isinstance(v, Sym) for v in (cond, a, b)):
        from jitattn.trace import apply_torch

        return apply_torch("where", (cond, a, b), {})
    import torch

    return torch.where(cond, a, b)


def _unary(name: str, x):
    from jitattn.trace import Sym, apply_torch

    return apply_torch(name, (x,), {}) if isinstance(x, Sym) else getattr(x, name)()


def _log(x): return _unary("log", x)
def _sin(x): return _unary("sin", x)
def _cos(x): return _unary("cos", x)
def _sigmoid(x): return _unary("sigmoid", x)


def _clamp_min(x, lo: float):
    from jitattn.trace import Sym

    return x.clamp(min=lo) if isinstance(x, Sym) else x.clamp(min=lo)


def _int32():
    """The int32 dtype for ``.to()``: torch's when torch is importable, else its name (the tracer takes either)."""
    try:
        import torch

        return torch.int32
    except ImportError:
        return "torch.int32"

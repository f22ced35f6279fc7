"""Tracing: a Python functor called on symbolic values becomes one CUDA expression.

The same function called on torch tensors is the reference semantics (:mod:`jitattn.reference`), so
a variant is written once. A traced value (:class:`Sym`) carries a C++ expression and its C type
(``int``, ``float`` or ``bool``); Python operators and torch functions on it build bigger
expressions. torch functions reach :meth:`Sym.__torch_function__` (torch's override protocol for
non-tensor types), so users write ``torch.where`` / ``torch.tanh`` exactly as in FlexAttention.

Supported: ``+ - * / // % **``, unary ``-`` and ``abs()``, comparisons, ``& | ^ ~`` on bools,
``torch.where``, ``torch.minimum/maximum/clamp``, ``torch.abs/exp/exp2/log/log2/log1p/tanh/sigmoid/
sqrt/rsqrt/sin/cos/floor/ceil/pow``, ``.to(dtype)`` / ``.float()`` / ``.int()`` / ``.long()``,
Python int/float/bool constants, and reads of parameter tensors indexed by integer values
(``slopes[qo_head]``, ``table[bucket, qo_head]``, ``doc[qo_idx]``). ``//`` and ``%`` follow
Python's (and torch's) floor semantics, not C's truncation.

Unsupported constructs raise :class:`TraceError` naming the function, the source line and what to
write instead (:func:`trace` adds the location).
"""

from __future__ import annotations

import inspect
import linecache
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# No torch import here: a build box traces the built-in functors (soft-cap, ALiBi, windows) without
# torch. torch functions reach Sym through __torch_function__ and are dispatched by name.

C_TYPES = ("bool", "int", "float")


class TraceError(TypeError):
    """A functor used something the tracer cannot turn into CUDA."""


def _literal(value: Any) -> "Sym":
    if isinstance(value, Sym):
        return value
    if isinstance(value, bool):
        return Sym("true" if value else "false", "bool")
    if isinstance(value, int):
        if not -(2 ** 31) <= value < 2 ** 31:
            raise TraceError(f"integer constant {value} does not fit in a 32-bit int")
        return Sym(str(value), "int")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            text = {"inf": "__int_as_float(0x7f800000)", "-inf": "__int_as_float(0xff800000)"}.get(
                str(value), "__int_as_float(0x7fc00000)")
            return Sym(text, "float")
        return Sym(f"{value:.9e}f", "float")
    if type(value).__module__.startswith("torch"):
        raise TraceError("a torch tensor reached the functor; read parameter tensors through `params` "
                         "(declared with Param) so they become kernel arguments")
    raise TraceError(f"cannot use a {type(value).__name__} ({value!r}) in a traced functor; use numbers, the "
                     f"functor's arguments, params, and torch functions")


def _promote(*types: str) -> str:
    """Arithmetic result type: float if any float, else int (bools count as ints)."""
    return "float" if "float" in types else "int"


def _as(sym: "Sym", ctype: str) -> str:
    """The expression of ``sym`` converted to ``ctype`` (explicit, so C++ never guesses)."""
    if sym.ctype == ctype:
        return sym.expr
    return f"static_cast<{ctype}>({sym.expr})"


#: torch function / method name -> CUDA function of one float.
#: The accurate CUDA functions (not the __expf-style intrinsics): a bucket computed with log() must
#: land in the same bucket as torch's, or a bias table read differs from the reference.
_UNARY_FLOAT = {
    "exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "log1p": "log1pf",
    "tanh": "jitattn::fast_tanh", "sqrt": "sqrtf", "rsqrt": "rsqrtf", "sin": "sinf", "cos": "cosf",
    "floor": "floorf", "ceil": "ceilf", "sigmoid": "jitattn::sigmoid",
}
_CAST = {"torch.float32": "float", "torch.float16": "float", "torch.bfloat16": "float", "torch.int32": "int",
         "torch.int64": "int", "torch.bool": "bool"}
_CAST_METHODS = {"float": "float", "int": "int", "long": "int", "bool": "bool"}


def _binary(build: Callable[..., "Sym"], arg: str) -> tuple[Callable[..., "Sym"], Callable[..., "Sym"]]:
    """The two methods of one binary operator (``__add__``, ``__radd__``): ``build(self, other, arg,
    reverse)`` with the traced value on the left, then on the right."""
    def forward(self: "Sym", other: Any) -> "Sym":
        return build(self, other, arg, False)

    def reflected(self: "Sym", other: Any) -> "Sym":
        return build(self, other, arg, True)

    return forward, reflected


class Sym:
    """A traced scalar: a C++ expression ``expr`` of C type ``ctype`` (``int``, ``float`` or ``bool``)."""

    __slots__ = ("expr", "ctype")

    def __init__(self, expr: str, ctype: str):
        if ctype not in C_TYPES:
            raise ValueError(f"ctype={ctype!r}: expected one of {C_TYPES}")
        self.expr, self.ctype = expr, ctype

    def __repr__(self) -> str:
        return f"Sym({self.expr!r}, {self.ctype})"

    # ---- arithmetic ---------------------------------------------------------------------------------
    def _operands(self, other: Any, reverse: bool) -> tuple["Sym", "Sym"]:
        """(left, right) of a binary operator: ``self`` on the left, or on the right for ``__radd__`` & co."""
        b = _literal(other)
        return (b, self) if reverse else (self, b)

    def _arith(self, other: Any, op: str, reverse: bool = False) -> "Sym":
        """``(a op b)`` in the promoted type."""
        a, b = self._operands(other, reverse)
        t = _promote(a.ctype, b.ctype)
        return Sym(f"({_as(a, t)} {op} {_as(b, t)})", t)

    def _call(self, other: Any, fn: str, reverse: bool = False) -> "Sym":
        """``fn(a, b)`` in the promoted type (``jitattn::floor_div`` / ``floor_mod``: Python's floor semantics)."""
        a, b = self._operands(other, reverse)
        t = _promote(a.ctype, b.ctype)
        return Sym(f"{fn}({_as(a, t)}, {_as(b, t)})", t)

    def _float_op(self, other: Any, form: str, reverse: bool = False) -> "Sym":
        """``form`` (``"({} / {})"``, ``"powf({}, {})"``) on both operands as floats: true division and powers
        are float whatever the operands, as in Python."""
        a, b = self._operands(other, reverse)
        return Sym(form.format(_as(a, "float"), _as(b, "float")), "float")

    __add__, __radd__ = _binary(_arith, "+")
    __sub__, __rsub__ = _binary(_arith, "-")
    __mul__, __rmul__ = _binary(_arith, "*")
    __truediv__, __rtruediv__ = _binary(_float_op, "({} / {})")
    __floordiv__, __rfloordiv__ = _binary(_call, "jitattn::floor_div")
    __mod__, __rmod__ = _binary(_call, "jitattn::floor_mod")
    __pow__, __rpow__ = _binary(_float_op, "powf({}, {})")

    def __neg__(self) -> "Sym":
        t = _promote(self.ctype)
        return Sym(f"(-{_as(self, t)})", t)

    def __pos__(self) -> "Sym":
        return self

    def __abs__(self) -> "Sym":
        return Sym(f"fabsf({self.expr})", "float") if self.ctype == "float" else Sym(f"abs({_as(self, 'int')})", "int")

    # ---- comparisons and logic ----------------------------------------------------------------------
    def _cmp(self, other: Any, op: str) -> "Sym":
        b = _literal(other)
        t = _promote(self.ctype, b.ctype)
        return Sym(f"({_as(self, t)} {op} {_as(b, t)})", "bool")

    def __lt__(self, o): return self._cmp(o, "<")
    def __le__(self, o): return self._cmp(o, "<=")
    def __gt__(self, o): return self._cmp(o, ">")
    def __ge__(self, o): return self._cmp(o, ">=")
    def __eq__(self, o): return self._cmp(o, "==")  # type: ignore[override]
    def __ne__(self, o): return self._cmp(o, "!=")  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]

    def _logic(self, other: Any, op: str, reverse: bool = False) -> "Sym":
        a, b = self._operands(other, reverse)
        if a.ctype != "bool" or b.ctype != "bool":
            raise TraceError(f"`{op.strip()}` needs two booleans (masks); for integers use arithmetic")
        return Sym(f"({a.expr} {op} {b.expr})", "bool")

    __and__, __rand__ = _binary(_logic, "&&")
    __or__, __ror__ = _binary(_logic, "||")
    __xor__, __rxor__ = _binary(_logic, "!=")

    def __invert__(self) -> "Sym":
        if self.ctype != "bool":
            raise TraceError("`~` is supported on booleans (masks) only")
        return Sym(f"(!{self.expr})", "bool")

    # ---- what Python cannot trace -----------------------------------------------------------------
    def __bool__(self):
        raise TraceError("Python `if`, `and`, `or`, `not` or a chained comparison on a traced value; write "
                         "torch.where(cond, a, b) for a choice and `&`, `|`, `~` for masks")

    def __float__(self):
        raise TraceError("a traced value was converted to a Python float (math.* functions do this); use the "
                         "torch function instead, e.g. torch.exp(x) rather than math.exp(x)")

    def __int__(self):
        raise TraceError("a traced value was converted to a Python int; use x.to(torch.int32) or x // 1")

    def __index__(self):
        raise TraceError("a traced value was used as a Python index or range bound; index parameter tensors "
                         "through `params` instead")

    def __iter__(self):
        raise TraceError("a traced value is a scalar; it cannot be iterated")

    # ---- tensor-like methods -------------------------------------------------------------------------
    def to(self, dtype: Any) -> "Sym":
        ctype = _CAST.get(str(dtype))
        if ctype is None:
            raise TraceError(f".to({dtype}): supported dtypes are float32, int32/int64 and bool")
        return Sym(_as(self, ctype), ctype)

    def float(self): return Sym(_as(self, "float"), "float")
    def int(self): return Sym(_as(self, "int"), "int")
    def long(self): return Sym(_as(self, "int"), "int")
    def bool(self): return Sym(_as(self, "bool"), "bool")

    def clamp(self, min: Any = None, max: Any = None) -> "Sym":  # noqa: A002 (torch's names)
        return _clamp(self, min, max)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)  # protocol probes (copy, numpy, pickling) must see a plain miss
        if name in _UNARY_FLOAT or name == "abs":
            return lambda: apply_torch(name, (self,), {})
        raise TraceError(f"traced values have no attribute {name!r}; supported methods: "
                         f"{sorted(_UNARY_FLOAT) + ['abs', 'to', 'float', 'int', 'long', 'bool', 'clamp']}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return apply_torch(getattr(func, "__name__", repr(func)), args, kwargs or {})


def _clamp(x: Any, lo: Any, hi: Any) -> Sym:
    out = _literal(x)
    if lo is not None:
        out = _binary_minmax(out, lo, "max")
    if hi is not None:
        out = _binary_minmax(out, hi, "min")
    return out


def _binary_minmax(a: Any, b: Any, which: str) -> Sym:
    a, b = _literal(a), _literal(b)
    t = _promote(a.ctype, b.ctype)
    fn = {"float": {"min": "fminf", "max": "fmaxf"}, "int": {"min": "min", "max": "max"}}[t][which]
    return Sym(f"{fn}({_as(a, t)}, {_as(b, t)})", t)


def apply_torch(name: str, args: tuple, kwargs: Mapping[str, Any]) -> Sym:
    """A torch function (or tensor method) named ``name`` applied to traced values."""
    if kwargs and name not in ("clamp", "where"):
        raise TraceError(f"torch.{name}: keyword arguments are not supported in traced functors")
    if name in _UNARY_FLOAT:
        (x,) = args
        return Sym(f"{_UNARY_FLOAT[name]}({_as(_literal(x), 'float')})", "float")
    if name == "abs":
        return abs(_literal(args[0]))
    if name == "where":
        cond, a, b = (list(args) + [kwargs.get("input"), kwargs.get("other")])[:3]
        cond, a, b = _literal(cond), _literal(a), _literal(b)
        if cond.ctype != "bool":
            raise TraceError("torch.where: the condition must be a boolean (a comparison or a mask)")
        t = "bool" if a.ctype == b.ctype == "bool" else _promote(a.ctype, b.ctype)
        return Sym(f"({cond.expr} ? {_as(a, t)} : {_as(b, t)})", t)
    if name in ("minimum", "min", "maximum", "max") and len(args) == 2:
        return _binary_minmax(args[0], args[1], "min" if name.startswith("min") else "max")
    if name == "clamp":
        return _clamp(args[0], kwargs.get("min", args[1] if len(args) > 1 else None),
                      kwargs.get("max", args[2] if len(args) > 2 else None))
    if name == "pow":
        return _literal(args[0]) ** args[1]
    if name == "to" and len(args) == 2:
        return _literal(args[0]).to(args[1])
    if name in _CAST_METHODS and len(args) == 1:
        x = _literal(args[0])
        return Sym(_as(x, _CAST_METHODS[name]), _CAST_METHODS[name])
    supported = sorted(f"torch.{f}" for f in _UNARY_FLOAT) + [
        "torch.abs", "torch.where", "torch.minimum", "torch.maximum", "torch.clamp", "torch.pow"]
    raise TraceError(f"{name} is not supported in traced functors; supported: {', '.join(supported)}")


# Math that works on traced values and on torch tensors alike, for functors that must trace
# without torch installed (the built-in soft-cap, ALiBi and window functors in jitattn/variant.py).
def tanh(x: Any) -> Any:
    return apply_torch("tanh", (x,), {}) if isinstance(x, Sym) else x.tanh()


class SymTensor:
    """A parameter tensor inside a traced functor: indexing it with integer values reads the kernel argument.

    ``dims`` are C expressions of the sizes (``"4"``, ``"Spec::kNumQoHeads"``) or None when only known
    at call time; a multi-dimensional read needs every dim but the first. Reads are bounds-checked
    in the kernel (``jitattn::read_param``): an index outside the tensor reads element 0 and marks
    the row, whose output then becomes NaN (never an out-of-bounds read). ``checked=False`` is for
    built-in arguments whose indices are in range by construction (ALiBi slopes by query head).
    """

    def __init__(self, name: str, ctype: str, dims: tuple[str | None, ...], checked: bool = True):
        self.name, self.ctype, self.dims, self.checked = name, ctype, dims, checked

    def __getitem__(self, index: Any) -> Sym:
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) != len(self.dims):
            raise TraceError(f"params.{self.name} has {len(self.dims)} dims; indexed with {len(idx)}")
        flat: Sym | None = None
        for d, i in enumerate(idx):
            s = _literal(i)
            if s.ctype != "int":
                raise TraceError(f"params.{self.name}[...]: index {d} is a {s.ctype}; tensors are read with integer "
                                 f"indices (use .to(torch.int32) or // to make one)")
            if flat is None:
                flat = s
            else:
                size = self.dims[d]
                if size is None:
                    raise TraceError(f"params.{self.name}: dim {d} must have a fixed size (an int, num_qo_heads or "
                                     f"num_kv_heads) to index a multi-dimensional tensor")
                flat = Sym(f"({flat.expr} * {size} + {s.expr})", "int")
        if not self.checked:
            return Sym(f"static_cast<{self.ctype}>(params.{self.name}[{flat.expr}])", self.ctype)
        return Sym(f"jitattn::read_param(params.{self.name}, {flat.expr}, params.{self.name}__numel, oob)", self.ctype)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TraceError(f"params.{self.name}.{name}: a parameter tensor can only be indexed inside a functor")


class ParamView(Mapping):
    """The ``params`` argument of a functor: ``params.name`` or ``params["name"]``, in both modes."""

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        return self._get(name, AttributeError)

    def __getitem__(self, name: str) -> Any:
        return self._get(name, KeyError)

    def _get(self, name: str, error: type[LookupError] | type[AttributeError]) -> Any:
        """The parameter ``name``, or ``error`` (AttributeError for ``params.name``) naming the declared ones."""
        try:
            return self._values[name]
        except KeyError:
            raise error(f"params has no {name!r}; declared: {sorted(self._values)} "
                        f"(declare it in Variant(params=(Param({name!r}, ...),)))") from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True)
class Traced:
    """A traced functor: its CUDA expression and the C type of the result."""

    expr: str
    ctype: str


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    return f"{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno})"


def _failing_line(fn: Callable, tb) -> str:
    code = getattr(fn, "__code__", None)
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None or code is None:
        return _where(fn)
    text = linecache.getline(code.co_filename, line).strip()
    return f"{fn.__qualname__} at {code.co_filename}:{line}" + (f" `{text}`" if text else "")


def trace(fn: Callable, args: tuple, *, hook: str, returns: str) -> Traced:
    """Call ``fn(*args)`` on symbolic values and return its CUDA expression.

    Args:
        hook: the hook's name, for messages (``"logits_transform"``...).
        returns: ``"float"`` (a value) or ``"bool"`` (a mask).

    Raises:
        TraceError: wrong number of arguments, an unsupported construct (with the function, its source
            line and what to write instead), a parameter the variant does not declare, or a result of
            the wrong kind.
    """
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        raise TraceError(f"{hook} {_where(fn)}: takes the wrong arguments ({exc}); the hook is called as "
                         f"{hook}{HOOK_SIGNATURES[hook]}") from None
    except ValueError:
        pass  # builtins without a signature: let the call decide
    try:
        out = fn(*args)
    except TraceError as exc:
        raise TraceError(f"{hook} {_failing_line(fn, sys.exc_info()[2])}: {exc}") from None
    except (AttributeError, KeyError) as exc:  # an undeclared params name, a torch function that does not exist
        message = exc.args[0] if exc.args else type(exc).__name__
        raise TraceError(f"{hook} {_failing_line(fn, sys.exc_info()[2])}: {message}") from None
    try:
        result = _literal(out)
    except TraceError as exc:
        raise TraceError(f"{hook} {_where(fn)} returned {type(out).__name__}: {exc}") from None
    if returns == "bool" and result.ctype != "bool":
        raise TraceError(f"{hook} {_where(fn)} must return a boolean (a comparison or a mask), got a {result.ctype}")
    if returns == "float" and result.ctype == "bool":
        raise TraceError(f"{hook} {_where(fn)} must return a number, got a boolean; to mask, use logits_mask")
    return Traced(_as(result, returns), returns)


#: The documented call signature of each hook (also in jitattn/variant.py's docstring).
HOOK_SIGNATURES = {
    "logits_transform": "(score, batch, qo_head, qo_idx, kv_idx, params) -> score",
    "logits_mask": "(batch, qo_head, qo_idx, kv_idx, params) -> bool",
    "query_transform": "(x, x_rot, batch, qo_head, qo_idx, dim, params) -> x",
    "key_transform": "(x, x_rot, batch, kv_head, kv_idx, dim, params) -> x",
    "output_transform": "(out, batch, qo_head, qo_idx, dim, params) -> out",
}

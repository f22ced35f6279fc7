"""The append_kv utility module: what it is, how it renders, how its arguments are laid out.

:func:`jitattn.append_kv` writes new tokens' K and V into a paged cache. Its CUDA kernel needs no
spec, only the element types: the dtype of the new K/V (``float16`` / ``bfloat16``) and the cache's
(the same, or ``float8_e4m3fn``), so it is one small fixed module per pair (``templates/append_kv.cu.j2``;
the layout, page size, head count, head dim and every stride are launch arguments, so NHD, HND and
the engines' ``(k_cache, v_cache)`` pairs share it). :class:`AppendKvModule` satisfies the module
protocol (:class:`jitattn.modules.KernelModule`; its row in :data:`jitattn.modules.KINDS`), so it is
rendered, compiled, cached by content, found under ``JITATTN_DISABLE_JIT=1``, built by ``jitattn
warmup`` (``--model`` adds the module of each model's K/V and cache dtypes; ``--spec`` takes its
JSON, ``{"kind":"append_kv","dtype":"bfloat16","kv_dtype":"float8_e4m3fn"}``) and shipped by
``jitattn cache export``, as the ``merge_state`` module is.

This module imports neither torch nor jinja2 at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jitattn.render import CTYPES, Field, RenderedSource, render_fixed, stride_fields, typed_fields
from jitattn.spec import canonical_dtype
from jitattn.utility_module import UtilityModule

#: The dtype of the new K and V rows.
SRC_DTYPES = ("float16", "bfloat16")
#: The ``kind`` of the module's canonical JSON.
KIND = "append_kv"
TEMPLATE_NAME = "append_kv.cu.j2"
KERNEL_NAMES = {"append_kv": "jitattn_append_kv", "geometry": "jitattn_append_kv_geometry"}
#: Threads per block (one block per token).
THREADS = 128
#: Geometry values the host reads from the cubin, in order.
GEOMETRY = ("threads", "params_size", "vec_elems")
#: e4m3's largest finite magnitude: FP8 writes saturate to +-E4M3_MAX.
E4M3_MAX = 448.0

#: The ``Params`` struct. Strides are in elements; ``{s}`` is the source type, ``{c}`` the cache's.
FIELDS: tuple[Field, ...] = (
    Field("k", "ptr", "const {s}*", "new keys (num_tokens, num_kv_heads, head_dim)"),
    Field("v", "ptr", "const {s}*", "new values (num_tokens, num_kv_heads, head_dim)"),
    Field("k_cache", "ptr", "{c}*", "K of page 0, slot 0, head 0"),
    Field("v_cache", "ptr", "{c}*", "V of page 0, slot 0, head 0"),
    Field("slot_mapping", "ptr", "const long long*", "(num_tokens,): page * page_size + offset, -1 skips"),
    *stride_fields("k", "token", "head"),
    *stride_fields("v", "token", "head"),
    *stride_fields("k_cache", "page", "slot", "head"),
    *stride_fields("v_cache", "page", "slot", "head"),
    Field("num_slots", "i64", "long long", "num_pages * page_size: slots at or past it are skipped"),
    Field("num_tokens", "i32", "int"),
    Field("num_heads", "i32", "int"),
    Field("head_dim", "i32", "int", "a multiple of vec_elems (16-byte stores), or FP8's of 8 (8-byte stores)"),
    Field("page_size", "i32", "int"),
    Field("k_inv_scale", "f32", "float", "float32(1 / k_scale): an FP8 cache holds K * k_inv_scale, saturated"),
    Field("v_inv_scale", "f32", "float", "float32(1 / v_scale)"),
)


def normalize_dtype(value: Any, field: str, allowed: tuple[str, ...]) -> str:
    """``"bf16"``, ``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; ValueError if not in ``allowed``."""
    name = canonical_dtype(value)
    if name not in allowed:
        raise ValueError(f"{field}={value!r}: append_kv takes {field} in {allowed} (or the matching torch dtype)")
    return name


@dataclass(frozen=True)
class AppendKvModule(UtilityModule):
    """The compiled append_kv kernel for new K/V of ``dtype`` written into a cache of ``kv_dtype``
    (``dtype`` itself, the default, or ``"float8_e4m3fn"``).

    Raises:
        ValueError: a dtype outside :data:`SRC_DTYPES`, or a ``kv_dtype`` that is neither ``dtype``
            nor ``float8_e4m3fn``.
    """

    KIND = KIND  # the "kind" of its JSON (a class attribute, not a dataclass field)

    dtype: str
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        src = normalize_dtype(self.dtype, "dtype", SRC_DTYPES)
        dst = normalize_dtype(self.kv_dtype or src, "kv_dtype", (src, "float8_e4m3fn"))
        object.__setattr__(self, "dtype", src)
        object.__setattr__(self, "kv_dtype", dst)

    # ---- the module protocol (jitattn.modules.KernelModule): JSON, key and name from UtilityModule ----
    def describe(self) -> str:
        return f"append_kv utility module, {self.dtype} K/V into a {self.kv_dtype} cache"

    # ---- rendering ----------------------------------------------------------------------------------
    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "float8_e4m3fn"

    @property
    def fields(self) -> tuple[Field, ...]:
        """The ``Params`` members with this module's element types, 8-byte members first."""
        return typed_fields(FIELDS, s=CTYPES[self.dtype], c="unsigned char" if self.fp8 else CTYPES[self.kv_dtype])

    @property
    def vec_elems(self) -> int:
        """Elements per thread step: one 16-byte store into the cache (16 FP8 or 8 16-bit values; an FP8 cache
        whose head_dim is a multiple of 8 only takes 8-byte stores of 8)."""
        return 16 if self.fp8 else 8

    def render(self) -> RenderedSource:
        """The CUDA source (``templates/append_kv.cu.j2``).

        Raises:
            FileNotFoundError: the templates are missing.
        """
        return render_fixed(TEMPLATE_NAME, self.fields, KERNEL_NAMES, module=self, src=CTYPES[self.dtype], fp8=self.fp8,
                            threads=THREADS, vec_elems=self.vec_elems, e4m3_max=E4M3_MAX)

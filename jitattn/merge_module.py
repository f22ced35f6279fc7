"""The merge_state utility module: what it is, how it renders, how its arguments are laid out.

The attention kernels are one module per :class:`~jitattn.spec.AttentionSpec`. ``merge_state``
(:mod:`jitattn.merge`) needs no spec, only the element type of the attention output, so it is one
small fixed module per dtype (``templates/merge.cu.j2``; head_dim, head count, strides and the
number of states are launch arguments). :class:`MergeModule` satisfies the module protocol the
cache and the build use for a spec (:class:`jitattn.modules.KernelModule`: ``canonical_json``,
``name``, ``describe``; its row in :data:`jitattn.modules.KINDS` reads its JSON and renders it), so it
goes through the very same pipeline: rendered, compiled by nvcc through ninja, stored in the
content-addressed cache (keyed by its canonical JSON, the rendered source, every template and
header, nvcc, arch, flags and version), found under ``JITATTN_DISABLE_JIT=1``, built by
``jitattn warmup`` (``--model`` adds the module of each model's output dtype; ``--spec`` takes its
JSON, ``{"kind":"merge_state","dtype":"bfloat16"}``) and shipped by ``jitattn cache export``.

This module imports neither torch nor jinja2 at import time, so a build box without torch can
warm the cache with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jitattn.render import CTYPES, Field, RenderedSource, render_fixed, stride_fields, typed_fields
from jitattn.spec import canonical_dtype
from jitattn.utility_module import UtilityModule

#: Element types of the attention output the module is built for.
MERGE_DTYPES = ("float16", "bfloat16", "float32")
#: The ``kind`` of a merge module's canonical JSON (an AttentionSpec's JSON has no ``kind``).
KIND = "merge_state"
TEMPLATE_NAME = "merge.cu.j2"
#: Kernel entry points of the module.
KERNEL_NAMES = {
    "merge_state": "jitattn_merge_state",  # two states: a, b -> out
    "merge_states": "jitattn_merge_states",  # num_states states stacked along dim 1 of a -> out
    "geometry": "jitattn_merge_geometry",
}
#: Threads per block (kThreads in templates/merge.cu.j2).
THREADS = 128
#: Geometry values the host reads from the cubin, in order.
GEOMETRY = ("threads", "params_size", "vec_elems")

#: The ``Params`` struct of the merge kernels. Strides are in elements; ``{t}`` is the element type.
FIELDS: tuple[Field, ...] = (
    Field("v_a", "ptr", "const {t}*", "state a values (seq, [num_states,] num_heads, head_dim)"),
    Field("s_a", "ptr", "const float*", "state a lse (seq, [num_states,] num_heads), natural log"),
    Field("v_b", "ptr", "const {t}*", "state b values (merge_state only)"),
    Field("s_b", "ptr", "const float*", "state b lse (merge_state only)"),
    Field("v_out", "ptr", "{t}*", "merged values (seq, num_heads, head_dim); may be v_a (in place)"),
    Field("s_out", "ptr", "float*", "merged lse (seq, num_heads); may be s_a (in place)"),
    Field("mask", "ptr", "const unsigned char*", "bool (seq,): rows to merge, or null for all"),
    *stride_fields("v_a", "seq", "state", "head", docs={"state": "merge_states only"}),
    *stride_fields("s_a", "seq", "state", "head", docs={"state": "merge_states only"}),
    *(f for t in ("v_b", "s_b", "v_out", "s_out") for f in stride_fields(t, "seq", "head")),
    Field("mask_stride", "i64", "long long"),
    Field("num_rows", "i32", "int", "seq"),
    Field("num_heads", "i32", "int"),
    Field("head_dim", "i32", "int"),
    Field("num_states", "i32", "int", "merge_states only (2 for merge_state)"),
    Field("group_threads", "i32", "int", "threads per (row, head): a power of two <= 32"),
    Field("vectorized", "i32", "int", "1: every value row is 16-byte aligned, head_dim a multiple of 16 bytes"),
)


def normalize_merge_dtype(value: Any, field: str = "dtype") -> str:
    """``"bf16"``, ``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; ValueError if not a merge dtype."""
    name = canonical_dtype(value)
    if name not in MERGE_DTYPES:
        raise ValueError(f"{field}={value!r}: merge_state takes values of dtype {MERGE_DTYPES} "
                         f"(or the matching torch dtype)")
    return name


@dataclass(frozen=True)
class MergeModule(UtilityModule):
    """The compiled merge kernels for one element type (``float16``, ``bfloat16`` or ``float32``).

    Hashable and comparable; stands where the cache, the build and ``jitattn warmup`` take an
    :class:`~jitattn.spec.AttentionSpec`.

    Raises:
        ValueError: ``dtype`` is not one of :data:`MERGE_DTYPES`.
    """

    KIND = KIND  # the "kind" of its JSON (a class attribute, not a dataclass field)

    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_merge_dtype(self.dtype))

    # ---- the module protocol (jitattn.modules.KernelModule): JSON, key and name from UtilityModule ----
    def describe(self) -> str:
        return f"merge_state utility module, {self.dtype} values, fp32 lse"

    # ---- rendering ----------------------------------------------------------------------------------
    @property
    def fields(self) -> tuple[Field, ...]:
        """The ``Params`` members with this dtype's element type, 8-byte members first."""
        return typed_fields(FIELDS, t=CTYPES[self.dtype])

    def render(self) -> RenderedSource:
        """The CUDA source of this module (``templates/merge.cu.j2``), as :func:`jitattn.render.render`
        renders a spec.

        Raises:
            FileNotFoundError: the templates are missing.
        """
        return render_fixed(TEMPLATE_NAME, self.fields, KERNEL_NAMES, module=self, dtype=CTYPES[self.dtype],
                            threads=THREADS)

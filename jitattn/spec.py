"""AttentionSpec: the frozen, validated description of one attention variant.

One spec drives everything downstream: the rendered CUDA source, the kernel names, the cache key
and the selector's decisions are all derived from it, never hand-built.

Conventions (also in README.md):

- Positions: sequence ``b`` brings ``qo_len`` queries and reads ``kv_len = seq_lens[b]`` keys (new
  tokens included; ragged inputs: ``kv_len = kv_start_loc[b + 1] - kv_start_loc[b]``); its queries
  sit at positions ``kv_len - qo_len ... kv_len - 1``.
- Visibility of key ``j`` to a query at position ``p``: ``j <= p`` if ``causal``;
  ``p - j <= window_left`` if ``window_left >= 0``; ``j - p <= window_right`` if
  ``window_right >= 0`` (non-causal only). A Hugging Face ``sliding_window = W`` (``p - j < W``)
  is ``window_left = W - 1``.
- ``sm_scale`` defaults to ``head_dim_qk ** -0.5``; soft-cap is ``cap * tanh(s / cap)`` on the
  scaled logit; ALiBi adds ``slope_h * (j - p)``; sinks add ``exp(sink_h)`` to the softmax
  denominator only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

from jitattn.constants import template_constant
from jitattn.variant import Variant

#: Query / output dtypes the kernels take.
QO_DTYPES = ("float16", "bfloat16")
#: KV-cache dtypes the kernels take.
KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
KV_LAYOUTS = ("NHD", "HND")
#: Where K/V come from: the paged KV cache, contiguous varlen ("ragged") K and V tensors, or the paged
#: latent cache of multi-head latent attention (MLA: one row per token, V a prefix of K).
KV_STORAGES = ("paged", "ragged", "latent")
#: Where each query's position comes from: the sequence's last qo_len positions, or a per-token tensor.
QUERY_POSITIONS = ("implicit", "explicit")
# Every live spec by its canonical text: the torch custom op (jitattn/ops.py) passes the text and
# finds the object, with its variant's torch functors, here.
_LIVE_SPECS: "weakref.WeakValueDictionary[str, AttentionSpec]" = weakref.WeakValueDictionary()
#: Head dims the templates are built for: multiples of HEAD_DIM_STEP in this range (the MMA tiles pad a
#: multiple of 8 to 16 in shared memory and registers). A latent spec keeps multiples of 16 from 32.
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 8, 256, 8
LATENT_HEAD_DIM_MIN, LATENT_HEAD_DIM_STEP = 32, 16
PAGE_SIZE_MAX = 1024
#: sm_scale is rendered as a float32 constant: float32's normal range (past it: inf, or 0 / denormal).
SM_SCALE_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)
#: The soft-cap renders as ``cap`` and ``1 / cap``, both float32 constants: caps whose reciprocal is normal too.
SOFT_CAP_RANGE = (1.1754943508222875e-38, 8.507059173023462e37)
#: window_left / window_right are int constants the kernels add to int32 positions (visible_kv_range's
#: ``qo_hi + window_right + 1``, the prefill's tile skips, decode_mma's ``ceil_div(window_left + 1, 64)``):
#: this bound keeps those sums inside int32 for sequences of up to 2**30 tokens. A longer window hides
#: nothing a shorter one would not; -1 is no window.
WINDOW_MAX = 2 ** 30 - 1
#: The largest GQA group a paged spec takes at any head dim: the CUDA-core decode (templates/decode.cuh) serves
#: groups above decode_mma's 16, and no group above this has run on a GPU (its block caps 16-bit KV at head
#: dims from 64 here anyway).
PAGED_MAX_GROUP = 128
#: Latent (MLA) specs: head dims multiples of 16 up to this (DeepSeek-V2/V3, Kimi-K2: 576 / 512), at most
#: this many query heads (the whole group shares the one latent row: 128 at TP 1 for DeepSeek-V3).
LATENT_HEAD_DIM_MAX, LATENT_MAX_QO_HEADS = 1024, 128
#: The MLA decode kernel (templates/mla_decode.cuh) takes latent head dims that are multiples of this (each warp's
#: quarter of the output dims is whole pairs of n-tiles, the latent rows whole groups of 8 swizzled chunks).
LATENT_KERNEL_DIM_STEP = 64

_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32",
}


def canonical_dtype(value: Any) -> str | None:
    """The canonical name of a dtype given as a string or a torch dtype (``"bf16"`` -> ``"bfloat16"``), or None.

    The one alias table of jitattn: specs and the utility modules (merge_state, append_kv) read it.
    """
    return _DTYPE_ALIASES.get(str(value))


def normalize_dtype(value: Any, *, field: str, allowed: tuple[str, ...]) -> str:
    """Map a dtype given as a string or a torch dtype to its canonical name, or raise ValueError."""
    name = canonical_dtype(value)
    if name is None or name not in allowed:
        raise ValueError(f"{field}={value!r}: expected one of {allowed} (or the matching torch dtype)")
    return name


def _check_int(field: str, value: Any, lo: int, hi: int | None = None, extra: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}={value!r}: expected an int{extra}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{field}={value!r}: expected an int {bound}{extra}")
    return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def kv_copy_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes per copy of a K/V row in the kernels (``kv_copy_bytes`` in templates/kv_load.cuh): 16, or 8 for an
    FP8 row of a head dim that is a multiple of 8 only (72 bytes: whole 8-byte chunks). The cache's pages and
    rows need that alignment."""
    return 8 if kv_dtype == "float8_e4m3fn" and head_dim % 16 else 16


def decode_block_problem(head_dim: int, kv_dtype: str, group_size: int) -> str | None:
    """Why the CUDA-core decode kernel of a paged spec cannot be built for this GQA group, or None.

    Mirrors ``DecodeTraits`` (``kBdx * kBdy * kBdz`` threads: at most 1024, whole warps) and
    ``decode_finish``'s scratch assertion (the split-KV merge's ``group * (kMaxSplits + 2) + 1`` floats
    in the ``kBdz * slots * (head_dim + 2) + slots`` of the merge scratch) of templates/decode.cuh, so
    that such a spec is refused at construction instead of failing in nvcc (tests/test_spec.py compiles
    the largest accepted groups; each of these limits first bites at groups of 61 to 129 heads).
    """
    vec = kv_copy_bytes(head_dim, kv_dtype) // (1 if kv_dtype == "float8_e4m3fn" else 2)  # elements per load
    bdx = 1
    while bdx < head_dim // vec:  # next power of two of the chunks per row
        bdx *= 2
    heads_per_thread = _ceil_div(group_size, _ceil_div(group_size, max(1, 32 // vec)))
    bdy = _ceil_div(group_size, heads_per_thread)
    warp_multiple = 32 // math.gcd(bdx * bdy, 32)
    bdz = _ceil_div(_ceil_div(128, bdx * bdy), warp_multiple) * warp_multiple
    threads = bdx * bdy * bdz
    if threads > 1024 or threads % 32:
        return f"needs a decode block of {threads} threads (at most 1024, whole warps)"
    slots = bdy * heads_per_thread
    max_splits = template_constant("kMaxSplits")
    if bdz * slots * (head_dim + 2) + slots < group_size * (max_splits + 2) + 1:
        return "needs more split-KV merge scratch than its decode block has"
    return None


@functools.lru_cache(maxsize=None)
def largest_decode_group(head_dim: int, kv_dtype: str) -> int:
    """The largest GQA group a paged spec takes at this head dim and KV dtype: the decode block builds for
    every group up to it (:func:`decode_block_problem`), and it is at most :data:`PAGED_MAX_GROUP`.

    60 to 128. 16-bit KV: 128 at head dims from 64, 124 at 8 / 16 / 32, 60 at 24 / 40 / 48 / 56. FP8: 64 at
    the multiples of 16 from 16 but 48 (62), 128 at the multiples of 8 only from 72, 124 at 8, 60 at 24 / 40
    / 56. A few larger groups fit the block again (e.g. 133 to 136 at head dim 128): they are refused with
    the rest, so that the accepted groups are the one range up to this number.
    """
    return next((g - 1 for g in range(1, PAGED_MAX_GROUP + 1) if decode_block_problem(head_dim, kv_dtype, g)),
                PAGED_MAX_GROUP)


def latent_kernel_problem(spec: "AttentionSpec") -> str | None:
    """Why the MLA decode kernel (templates/mla_decode.cuh) cannot serve the latent spec ``spec`` at all (the
    sdpa and reference backends serve it), or None (it can, or ``spec`` is not latent): head dims not multiples
    of :data:`LATENT_KERNEL_DIM_STEP`. (It reads 16-bit and FP8 e4m3 caches.)

    The jit backend's reason, load_kernel's refusal and warm-up's note all give this text.
    """
    if not spec.latent:
        return None
    for name in ("head_dim_qk", "head_dim_vo"):
        value = getattr(spec, name)
        if value % LATENT_KERNEL_DIM_STEP:
            return (f"{name}={value}: the MLA decode kernel takes latent head dims that are multiples of "
                    f"{LATENT_KERNEL_DIM_STEP} (576 / 512 for DeepSeek); the sdpa and reference backends serve "
                    f"this one")
    return None


def _check_float(field: str, value: Any, *, positive: bool, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field}={value!r}: expected a finite number")
    value = float(value)
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{field}={value!r}: expected a number {'>= 0' if allow_zero else '> 0'}")
    return value


@dataclass(frozen=True)
class AttentionSpec:
    """One attention variant: what the kernels are specialised on.

    Args:
        num_qo_heads: query/output heads (``H_qo``).
        num_kv_heads: key/value heads (``H_kv``); must divide ``num_qo_heads`` (GQA group size
            ``H_qo / H_kv``); 1 for a latent spec. A paged spec takes every group up to
            :func:`largest_decode_group` (where the decode kernel's block first stops fitting, at most 128):
            60 to 128 heads by head dim and KV dtype (128 for 16-bit KV at head dims from 64, 64 for FP8 at
            head dims that are multiples of 16 from 64); any larger group is refused. Ragged specs take any.
        head_dim_qk: query/key head dim, a multiple of 8 in [8, 256] (a multiple of 16 in [32, 1024] for a
            latent spec).
        head_dim_vo: value/output head dim, a multiple of 8 in [8, 256] (a multiple of 16 in [32, 1024],
            below ``head_dim_qk``, for a latent spec); defaults to ``head_dim_qk``.
            The paged cache stores K and V in one tensor, so a paged spec needs it equal to
            ``head_dim_qk``; a ragged spec may differ (e.g. 192/128, DeepSeek-style MLA prefill).
        q_dtype: ``"float16"`` or ``"bfloat16"`` (torch dtypes accepted).
        kv_dtype: KV-cache dtype; defaults to ``q_dtype``; either ``q_dtype`` or ``"float8_e4m3fn"``
            (FP8 cache: per-tensor ``k_scale`` / ``v_scale`` at call time, dequantised in registers).
        o_dtype: output dtype; defaults to ``q_dtype``.
        kv_layout: ``"NHD"`` (cache ``(num_pages, 2, page_size, H_kv, D)``) or ``"HND"``
            (``(num_pages, 2, H_kv, page_size, D)``). Ragged K/V are token-major
            ``(total_kv, H_kv, D)``: a ragged spec takes ``"NHD"`` only.
        page_size: tokens per KV page, in [1, 1024]; None (the default) means 16 for a paged spec.
            Ragged K/V have no pages: a ragged spec keeps ``page_size=None`` (an int is an error).
        causal: key ``j`` visible to the query at position ``p`` only if ``j <= p``.
        window_left: ``-1`` (none) or in ``[0, 2**30 - 1]`` (:data:`WINDOW_MAX`): visible only if
            ``p - j <= window_left``.
        window_right: ``-1`` (none) or in ``[0, 2**30 - 1]``: visible only if ``j - p <= window_right``;
            non-causal specs only.
        logits_soft_cap: ``0`` (off) or ``cap`` in ``[1.2e-38, 8.5e37]`` (:data:`SOFT_CAP_RANGE`):
            ``s -> cap * tanh(s / cap)``.
        sm_scale: softmax scale on ``q.k``; defaults to ``head_dim_qk ** -0.5`` (a latent spec needs it given).
        alibi: add ``alibi_slopes[h] * (j - p)`` (slopes passed at call time, float32 ``(H_qo,)``;
            the standard geometric slopes when omitted). Press et al. 2022, "Train Short, Test
            Long", section 3.
        sinks: per-head sink logits (float32 ``(H_qo,)``, passed at call time) join the softmax
            denominator only (gpt-oss; Xiao et al. 2024, "Efficient Streaming Language Models
            with Attention Sinks").
        variant: user functors and their parameters (:class:`~jitattn.variant.Variant`), or None.
        kv_storage: ``"paged"`` (default: the paged KV cache, :func:`jitattn.paged_attention`) or
            ``"ragged"`` (contiguous varlen K ``(total_kv, H_kv, head_dim_qk)`` and V ``(total_kv,
            H_kv, head_dim_vo)`` with ``kv_start_loc``, :func:`jitattn.ragged_attention`; FlashInfer's
            BatchPrefillWithRaggedKVCache, flash_attn_varlen). Ragged specs run the tensor-core
            prefill kernel for every row (no decode kernel is built) and take 16-bit K/V only. Or
            ``"latent"``: the MLA latent cache (below).
        query_positions: ``"implicit"`` (default: the queries of a sequence are its last ``qo_len``
            positions, ``kv_len - qo_len + i``) or ``"explicit"``: each query token's position in its
            sequence's key frame comes from an int32 ``query_positions`` tensor at call time, with the
            ``functor_batch`` each token's hooks see and a per-sequence ``position_offset`` added to the
            positions the hooks see (paged specs only; only the prefill kernel is built). Cascade
            attention (:mod:`jitattn.cascade`) runs its passes through such a spec; few users need it
            directly.

    Latent attention (``kv_storage="latent"``; multi-head latent attention, MLA: DeepSeek-V2/V3,
    Kimi-K2, decode in the absorbed form of FlashMLA, FlashInfer's MLA kernels and vLLM): the cache is
    one tensor ``(num_pages, page_size, head_dim_qk)`` of ``kv_dtype`` (vLLM's MLA layout); each row is
    ``c_kv`` (``head_dim_vo`` = ``kv_lora_rank`` values) then ``k_pe`` (``head_dim_qk - head_dim_vo`` =
    ``qk_rope_head_dim``), K is the whole row and V its first ``head_dim_vo`` values. q is
    ``(total_q, num_qo_heads, head_dim_qk)`` (``[q_nope @ W_UK, q_pe]`` per head), out
    ``(total_q, num_qo_heads, head_dim_vo)`` (before ``W_UV``). Such a spec has ``num_kv_heads=1`` and
    ``num_qo_heads`` in [1, 128] (the group is every head of the rank); head dims multiples of 16 in
    [32, 1024] with ``head_dim_vo < head_dim_qk`` (576 / 512 for DeepSeek); ``kv_layout="NHD"``; page sizes
    1..1024; ``kv_dtype`` = ``q_dtype`` or FP8 e4m3 (one per-tensor ``k_scale`` at call time, which
    dequantises V too: ``v_scale`` stays 1.0); ``sm_scale`` given explicitly (MLA's is
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, not ``head_dim_qk ** -0.5``); ``causal=True``
    and no window, soft-cap, ALiBi, sinks, variant or explicit positions. Any number of queries per
    sequence (speculative / MTP decode brings 1..8), at its last positions. Its module holds one kernel, the
    MLA decode (templates/mla_decode.cuh: 16-bit and FP8 caches, head dims multiples of 64), served by the jit
    backend; the ``sdpa`` and ``reference`` backends serve the latent specs it cannot
    (:func:`latent_kernel_problem`).

    Raises:
        ValueError: at construction, naming the field, the value and what is allowed.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int | None = None
    q_dtype: str = "bfloat16"
    kv_dtype: str | None = None
    o_dtype: str | None = None
    kv_layout: str = "NHD"
    page_size: int | None = None
    causal: bool = True
    window_left: int = -1
    window_right: int = -1
    logits_soft_cap: float = 0.0
    sm_scale: float | None = None
    alibi: bool = False
    sinks: bool = False
    variant: Variant | None = None
    kv_storage: str = "paged"
    query_positions: str = "implicit"

    def __post_init__(self) -> None:
        _set = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        _check_int("num_qo_heads", self.num_qo_heads, 1, 1024)
        _check_int("num_kv_heads", self.num_kv_heads, 1, 1024)
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads={self.num_qo_heads}, num_kv_heads={self.num_kv_heads}: num_kv_heads must divide "
                f"num_qo_heads (GQA groups of equal size)")
        if self.kv_storage not in KV_STORAGES:
            raise ValueError(f"kv_storage={self.kv_storage!r}: expected one of {KV_STORAGES}")
        latent = self.kv_storage == "latent"
        lo, hi, step = ((LATENT_HEAD_DIM_MIN, LATENT_HEAD_DIM_MAX, LATENT_HEAD_DIM_STEP) if latent
                        else (HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP))
        for name in ("head_dim_qk", "head_dim_vo"):
            value = self.head_dim_qk if name == "head_dim_vo" and self.head_dim_vo is None else getattr(self, name)
            _check_int(name, value, lo, hi, extra=f", a multiple of {step}")
            if value % step:
                raise ValueError(f"{name}={value}: expected a multiple of {step} in [{lo}, {hi}]")
            _set(name, value)
        if self.kv_storage == "latent":
            self._check_latent()
        ragged = self.kv_storage == "ragged"
        if self.query_positions not in QUERY_POSITIONS:
            raise ValueError(f"query_positions={self.query_positions!r}: expected one of {QUERY_POSITIONS}")
        if self.query_positions == "explicit" and ragged:
            raise ValueError("query_positions='explicit' with kv_storage='ragged': explicit query positions are "
                             "for the paged cache only (cascade attention's passes)")
        if self.head_dim_vo != self.head_dim_qk and self.kv_storage == "paged":
            raise ValueError(
                f"head_dim_vo={self.head_dim_vo}, head_dim_qk={self.head_dim_qk}: the paged KV cache holds K and V "
                f"in one tensor, so they must be equal (kv_storage='ragged' takes separate K and V)")
        _set("q_dtype", normalize_dtype(self.q_dtype, field="q_dtype", allowed=QO_DTYPES))
        _set("kv_dtype", normalize_dtype(self.kv_dtype or self.q_dtype, field="kv_dtype", allowed=KV_DTYPES))
        _set("o_dtype", normalize_dtype(self.o_dtype or self.q_dtype, field="o_dtype", allowed=QO_DTYPES))
        if self.kv_dtype not in (self.q_dtype, "float8_e4m3fn"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: must equal q_dtype={self.q_dtype!r} or be 'float8_e4m3fn'")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}: expected one of {KV_LAYOUTS}")
        if ragged:
            if self.kv_layout != "NHD":
                raise ValueError(f"kv_layout={self.kv_layout!r} with kv_storage='ragged': ragged K/V are token-major "
                                 f"(total_kv, num_kv_heads, head_dim), so the layout must be 'NHD'")
            if self.page_size is not None:
                raise ValueError(f"page_size={self.page_size!r} with kv_storage='ragged': ragged K/V have no pages; "
                                 f"leave page_size unset (None)")
            if self.kv_dtype == "float8_e4m3fn":
                raise ValueError("kv_dtype='float8_e4m3fn' with kv_storage='ragged': FP8 K/V are supported for the "
                                 "paged cache only; ragged K/V take kv_dtype == q_dtype")
        else:
            _set("page_size", 16 if self.page_size is None else self.page_size)
            _check_int("page_size", self.page_size, 1, PAGE_SIZE_MAX)
            if not self.latent:
                self._check_decode_group()
        for name in ("causal", "alibi", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")
        for name in ("window_left", "window_right"):
            _check_int(name, getattr(self, name), -1, WINDOW_MAX, extra=" (-1: no window; a window as long as every "
                       "sequence hides nothing, so -1 serves for longer ones too)")
        if self.causal and self.window_right != -1:
            raise ValueError(
                f"window_right={self.window_right}: a causal spec sees no key right of the query; use "
                f"window_right=-1 or causal=False")
        _set("logits_soft_cap", _check_float("logits_soft_cap", self.logits_soft_cap, positive=True, allow_zero=True))
        if self.logits_soft_cap and not SOFT_CAP_RANGE[0] <= self.logits_soft_cap <= SOFT_CAP_RANGE[1]:
            raise ValueError(f"logits_soft_cap={self.logits_soft_cap!r}: expected 0 (off) or a cap in "
                             f"[{SOFT_CAP_RANGE[0]:g}, {SOFT_CAP_RANGE[1]:g}] (the kernels hold cap and 1 / cap as "
                             f"float32 constants)")
        scale = self.head_dim_qk ** -0.5 if self.sm_scale is None else self.sm_scale
        _set("sm_scale", _check_float("sm_scale", scale, positive=True))
        if not SM_SCALE_RANGE[0] <= self.sm_scale <= SM_SCALE_RANGE[1]:  # the kernels bake it in as a float32
            raise ValueError(f"sm_scale={self.sm_scale!r}: expected a positive number a float32 holds, in "
                             f"[{SM_SCALE_RANGE[0]:g}, {SM_SCALE_RANGE[1]:g}]")
        if self.variant is not None and not isinstance(self.variant, Variant):
            raise ValueError(f"variant={self.variant!r}: expected a jitattn.Variant or None")
        if self.variant is not None and self.variant.head_dim not in (None, self.head_dim_qk):
            raise ValueError(f"variant {self.variant.name!r} with head_dim_qk={self.head_dim_qk}: the variant is made "
                             f"for head dim {self.variant.head_dim} (Variant.head_dim); build it for "
                             f"{self.head_dim_qk} (e.g. rotary_embedding({self.head_dim_qk}): it rotates the whole "
                             f"head, partial rotary is not supported)")
        if self.variant is not None and not self.variant.softmax and self.sinks:
            raise ValueError(f"sinks=True with variant {self.variant.name!r} (softmax=False): sinks join a softmax "
                             f"denominator; a variant without softmax has none")
        # The canonical text, computed once: torch.compile reads it as a plain str attribute (the op
        # wrapper in jitattn/ops.py never hands the spec object itself to the compiler).
        _set("_canonical_text", self.canonical_json())
        _LIVE_SPECS[self._canonical_text] = self

    def _check_decode_group(self) -> None:
        """Refuse a paged spec whose GQA group is above :func:`largest_decode_group` (ValueError naming the
        heads, the group, the limit there and why)."""
        largest = largest_decode_group(self.head_dim_qk, self.kv_dtype)
        if self.group_size <= largest:
            return
        first = largest + 1
        problem = decode_block_problem(self.head_dim_qk, self.kv_dtype, self.group_size)
        first_problem = decode_block_problem(self.head_dim_qk, self.kv_dtype, first)
        if problem:
            why = f"this one {problem}"
        elif first_problem:
            why = f"a group of {first} {first_problem}; larger ones that fit the block again are refused too"
        else:
            why = f"no group above {PAGED_MAX_GROUP} has run on a GPU"
        raise ValueError(
            f"num_qo_heads={self.num_qo_heads}, num_kv_heads={self.num_kv_heads}: a GQA group of {self.group_size} "
            f"query heads at head_dim {self.head_dim_qk} with kv_dtype={self.kv_dtype!r} is too large: a paged spec "
            f"there takes every group of up to {largest} heads ({why}; ragged specs have no decode kernel and no "
            f"such limit)")

    def _check_latent(self) -> None:
        """What a latent (MLA) spec must be: one KV head, V a proper prefix of the row, causal, an
        explicit ``sm_scale``, none of the other features (ValueError naming the field otherwise)."""
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} with kv_storage='latent': the latent cache holds one "
                             f"row per token shared by every query head, so num_kv_heads must be 1")
        _check_int("num_qo_heads", self.num_qo_heads, 1, LATENT_MAX_QO_HEADS,
                   extra=" with kv_storage='latent' (heads per tensor-parallel rank)")
        if self.head_dim_vo >= self.head_dim_qk:
            raise ValueError(f"head_dim_vo={self.head_dim_vo}, head_dim_qk={self.head_dim_qk} with "
                             f"kv_storage='latent': a latent row is c_kv (head_dim_vo = kv_lora_rank values) then "
                             f"k_pe (head_dim_qk - head_dim_vo = qk_rope_head_dim values), so head_dim_vo must be < "
                             f"head_dim_qk (e.g. 512 / 576)")
        if self.kv_layout != "NHD":
            raise ValueError(f"kv_layout={self.kv_layout!r} with kv_storage='latent': the latent cache (num_pages, "
                             f"page_size, head_dim_qk) has no head dim to order; leave kv_layout 'NHD'")
        if self.sm_scale is None:
            raise ValueError("sm_scale=None with kv_storage='latent': give it explicitly; the default "
                             "head_dim_qk ** -0.5 would use the absorbed row's 576, whereas MLA scales by "
                             "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 (times mscale ** 2 under YaRN; "
                             "jitattn.models computes it)")
        unsupported = {"causal": (self.causal, True), "window_left": (self.window_left, -1),
                       "window_right": (self.window_right, -1), "logits_soft_cap": (self.logits_soft_cap, 0),
                       "alibi": (self.alibi, False), "sinks": (self.sinks, False), "variant": (self.variant, None),
                       "query_positions": (self.query_positions, "implicit")}
        for name, (value, allowed) in unsupported.items():
            if value != allowed or type(value) is not type(allowed) and name != "logits_soft_cap":
                raise ValueError(f"{name}={value!r} with kv_storage='latent': latent (MLA decode) specs take "
                                 f"{name}={allowed!r} only (causal attention of each sequence's last queries, "
                                 f"plain softmax, no window, soft-cap, ALiBi, sinks, variant or explicit positions)")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def ragged(self) -> bool:
        """True for contiguous varlen K/V (``kv_storage == "ragged"``), False for the paged cache."""
        return self.kv_storage == "ragged"

    @property
    def latent(self) -> bool:
        """True for the latent (MLA) cache (``kv_storage == "latent"``): its module holds the MLA decode kernel."""
        return self.kv_storage == "latent"

    @property
    def has_decode(self) -> bool:
        """Whether the spec's module holds the paged decode kernel (and a prefill kernel): not for ragged K/V nor
        explicit query positions (their prefill kernel serves every row), nor latent specs (their module holds the
        MLA decode kernel alone, which serves every row)."""
        return self.kv_storage == "paged" and not self.explicit_positions

    @property
    def explicit_positions(self) -> bool:
        """True when each query's position is given at call time (``query_positions == "explicit"``)."""
        return self.query_positions == "explicit"

    @property
    def params(self) -> tuple:
        """The variant's extra parameters (empty without a variant)."""
        return self.variant.params if self.variant else ()

    def to_json(self) -> dict[str, Any]:
        """Every field, defaults filled in (``query_positions`` only when explicit); the variant as its canonical dict."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if data["query_positions"] == "implicit":  # added later: absent at its default, so older keys hold
            del data["query_positions"]
        data["variant"] = self.variant.to_json() if self.variant else None
        return data

    @property
    def canonical_text(self) -> str:
        """:meth:`canonical_json`, computed once at construction (a plain ``str`` attribute)."""
        return self._canonical_text

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace, floats in Python's round-trip repr: equal specs, equal text."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> "AttentionSpec":
        """Inverse of :meth:`to_json` (accepts the dict or its JSON text).

        Raises:
            ValueError: text that is not JSON, JSON that is not an object, unknown or missing fields,
                or a field value :class:`AttentionSpec` refuses.
        """
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ValueError(f"AttentionSpec.from_json: not valid JSON ({exc})") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"AttentionSpec.from_json: expected a JSON object of spec fields, got "
                             f"{type(data).__name__} {data!r:.80}")
        data = dict(data)
        if data.get("variant") is not None:
            data["variant"] = Variant.from_json(data["variant"])
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"AttentionSpec.from_json: unknown fields {sorted(unknown)}")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"AttentionSpec.from_json: missing required fields {missing}")
        return cls(**data)

    @property
    def key(self) -> str:
        """Stable content hash of the canonical JSON (hex sha256, first 16 chars)."""
        return hashlib.sha256(self._canonical_text.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """Readable, filesystem-safe name; unique together with :attr:`key`."""
        dims = f"d{self.head_dim_qk}" + (f"v{self.head_dim_vo}" if self.head_dim_vo != self.head_dim_qk else "")
        storage = ["ragged"] if self.ragged else ["latent" if self.latent else self.kv_layout.lower(),
                                                  f"p{self.page_size}"]
        parts = [f"h{self.num_qo_heads}x{self.num_kv_heads}", dims,
                 {"float16": "f16", "bfloat16": "bf16"}[self.q_dtype], *storage]
        if self.kv_dtype == "float8_e4m3fn":
            parts.insert(3, "kvf8")
        parts += [token for token, _ in self._features()]
        return "_".join(parts) + "_" + self.key[:8]

    def _features(self) -> list[tuple[str, str]]:
        """The features beyond plain attention it has, in a fixed order: (token in :attr:`name`, words in
        :meth:`describe`)."""
        window = [f"{side}={getattr(self, side)}" for side in ("window_left", "window_right")
                  if getattr(self, side) >= 0]
        variant = self.variant.name if self.variant else ""
        table = [
            (self.causal, "causal", "causal"),
            (window, f"w{self.window_left}_{self.window_right}", ", ".join(window)),
            (self.logits_soft_cap, f"cap{self.logits_soft_cap:g}", f"soft_cap={self.logits_soft_cap:g}"),
            (self.alibi, "alibi", "alibi"),
            (self.sinks, "sinks", "sinks"),
            (self.variant, variant, f"variant={variant}"),
            (self.explicit_positions, "qpos", "explicit query positions"),
        ]
        return [(token, words) for present, token, words in table if present]

    def replace(self, **changes: Any) -> "AttentionSpec":
        """A copy with some fields changed (validated again).

        Fields that hold their derived default keep following what they derive from unless named:
        ``replace(head_dim_qk=64)`` also moves ``head_dim_vo`` and a default ``sm_scale`` to 64, and
        ``replace(q_dtype="float16")`` moves a default ``kv_dtype`` / ``o_dtype`` with it; a page size
        of 16 (the paged default) follows ``kv_storage`` (``replace(kv_storage="ragged")`` drops it).
        """
        derived = {
            "head_dim_vo": self.head_dim_vo == self.head_dim_qk,
            "sm_scale": self.sm_scale == self.head_dim_qk ** -0.5,
            "kv_dtype": self.kv_dtype == self.q_dtype,
            "o_dtype": self.o_dtype == self.q_dtype,
            "page_size": self.page_size in (None, 16),  # paged default; ragged has none
        }
        follow = {name: None for name, is_default in derived.items() if is_default and name not in changes}
        return dataclasses.replace(self, **{**follow, **changes})

    def describe(self) -> str:
        """One line for tables and logs."""
        feats = [words for _, words in self._features()]
        dims = f"{self.head_dim_qk}" + (f"/{self.head_dim_vo}" if self.head_dim_vo != self.head_dim_qk else "")
        cache = "latent (MLA)" if self.latent else self.kv_layout
        storage = "ragged K/V" if self.ragged else f"{cache} p{self.page_size}"
        dtypes = self.q_dtype + (f" (KV {self.kv_dtype})" if self.kv_dtype != self.q_dtype else "")
        return (f"{self.num_qo_heads}/{self.num_kv_heads} heads, hd {dims}, {dtypes}, "
                f"{storage}, scale {self.sm_scale:.4g}" + (", " + ", ".join(feats) if feats else ""))


def live_spec(text: str) -> AttentionSpec | None:
    """The live :class:`AttentionSpec` whose canonical JSON is ``text``, or None (weakly held)."""
    return _LIVE_SPECS.get(text)

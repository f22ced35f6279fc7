"""The anchors: torch SDPA, FlexAttention and FlashInfer on the same inputs as jitattn, built on jitattn.backends.

Each anchor is timed the way it is fastest, not the way :mod:`jitattn.backends` serves a paged
call, so the table compares jitattn with each library at its best:

- SDPA (flash and cuDNN backends): :func:`jitattn.backends.sdpa.dense_attention_fn` on K/V gathered out
  of the pages once, before timing (the backend's paged call gathers per call).
- Flex: ``flex_attention`` compiled once per case on the same dense K/V, with the block mask built
  once; its ``mask_mod`` is the spec's structural bounds and its ``score_mod`` the spec's built-in
  transforms (soft-cap, ALiBi), the same functors the kernels trace (:mod:`jitattn.variant`).
- FlashInfer: its paged wrappers on the same paged cache, planned once and ``run`` timed, as an
  engine calls them per layer; the page table from :func:`jitattn.backends.flashinfer.page_metadata`.
  The decode and attention-sink wrappers the backend does not use are chosen here.

An anchor that cannot express a case raises :class:`~jitattn.bench.harness.Skip` with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from jitattn.backends.flashinfer import flashinfer_import_error, page_metadata
from jitattn.backends.sdpa import dense_attention_fn
from jitattn.bench.cases import BenchCase
from jitattn.bench.harness import Runner, Skip
from jitattn.reference import default_alibi_slopes, torch_dtype
from jitattn.spec import AttentionSpec
from jitattn.testing import PagedBatch, visible_pairs
from jitattn.variant import builtin_transforms, structural_mask


@dataclass
class Contiguous:
    """The batch as dense (B, H, N, D) tensors, for anchors that take no paged cache (equal lengths only)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) output -> (B * N, H, D), the paged row order."""
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b * n, h, d)


def to_contiguous(batch: PagedBatch) -> Contiguous | None:
    """Dense copies of q, K and V (None unless every sequence has the same q_len and kv_len)."""
    from jitattn.reference import gather_kv

    if len(set(batch.q_lens)) != 1 or len(set(batch.kv_lens)) != 1:
        return None
    b, ql = len(batch.q_lens), batch.q_lens[0]
    q = batch.q.view(b, ql, batch.spec.num_qo_heads, -1).transpose(1, 2)
    ks, vs = zip(*(gather_kv(batch.spec, batch.kv_cache, batch.block_table, i, batch.kv_lens[i]) for i in range(b)))
    k = torch.stack(ks).transpose(1, 2).contiguous()  # (B, H_kv, L, D)
    v = torch.stack(vs).transpose(1, 2).contiguous()
    return Contiguous(q.contiguous(), k, v)


def needs_dense(case: BenchCase, anchors: tuple[str, ...]) -> bool:
    """Whether an anchor that takes dense tensors (SDPA, Flex) will run: only then copy K/V out of the pages."""
    return (("sdpa" in anchors and plain_attention_problem(case) is None)
            or ("flex" in anchors and flex_problem(case.spec) is None))


# ---- SDPA -------------------------------------------------------------------------------------
def window_masks_nothing(case: BenchCase) -> bool:
    """True when the spec's window hides no (query, key) pair of this case (e.g. window 4096 over 4096 keys)."""
    s = case.spec
    plain = s.replace(window_left=-1, window_right=-1)
    return all(visible_pairs(s, q, k) == visible_pairs(plain, q, k) for q, k in set(zip(case.q_lens, case.kv_lens)))


def plain_attention_problem(case: BenchCase) -> str | None:
    """Why torch SDPA's flash/cuDNN backends cannot run the case (None when they can).

    A window that hides nothing in this case (Mistral's 4096 over 4096 keys) does not count.
    """
    s = case.spec
    has_window = (s.window_left >= 0 or s.window_right >= 0) and not window_masks_nothing(case)
    extras = [name for name, on in (("window", has_window), ("soft-cap", bool(s.logits_soft_cap)),
                                    ("ALiBi", s.alibi), ("sinks", s.sinks),
                                    ("custom variant", s.variant is not None),
                                    (f"{s.kv_dtype} KV cache", s.kv_dtype != s.q_dtype)) if on]
    return f"SDPA flash/cuDNN take no {', '.join(extras)}" if extras else None


def sdpa_runners(case: BenchCase, dense: Contiguous | None) -> dict[str, Runner]:
    """torch SDPA's flash and cuDNN backends (plain causal/full attention only).

    Raises:
        Skip: the spec has a window, soft-cap, ALiBi, sinks or a custom variant, or unequal lengths,
            or a causal chunk of queries after cached keys (SDPA's is_causal is top-left aligned; the
            explicit mask that aligns it would take SDPA off these backends).
    """
    from torch.nn.attention import SDPBackend

    problem = plain_attention_problem(case) or (None if dense is not None else "unequal sequence lengths")
    if problem:
        raise Skip(problem)
    if case.spec.causal and case.q_lens[0] not in (1, case.kv_lens[0]):
        raise Skip("SDPA's causal mask is top-left aligned; this case has q_len < kv_len")
    spec = case.spec.replace(window_left=-1, window_right=-1)  # a window that hides nothing (checked above)

    def make(backend) -> Runner:
        fn = dense_attention_fn(spec, sdp_backend=backend)
        return Runner(lambda: fn(dense.q, dense.k, dense.v), dense.rows)

    return {"sdpa-flash": make(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": make(SDPBackend.CUDNN_ATTENTION)}


# ---- FlexAttention ----------------------------------------------------------------------------
def flex_mask_mod(spec: AttentionSpec, q_offset: int) -> Callable | None:
    """The spec's structural mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Flex numbers queries from 0; query ``q_idx`` sits at position ``q_idx + q_offset``
    (``q_offset = kv_len - q_len``: a decode query is at ``kv_len - 1``). The bounds are
    :func:`jitattn.variant.structural_mask`, the rule the kernels trace. None when nothing is masked.
    """
    bounds = structural_mask(spec.causal, spec.window_left, spec.window_right)
    if bounds is None:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        return bounds(b, h, q_idx + q_offset, kv_idx, None)

    return mask_mod


def flex_score_mod(spec: AttentionSpec, q_offset: int, alibi_slopes: torch.Tensor | None = None) -> Callable | None:
    """Soft-cap and ALiBi as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``; None when neither.

    Flex's ``score`` is already ``scale * q.k`` (``scale=spec.sm_scale``), the spec's ``s``; the mod
    applies the spec's built-in transforms (:func:`jitattn.variant.builtin_transforms`: soft-cap, then
    ALiBi) at query position ``q_idx + q_offset``. ``alibi_slopes``: float32 ``(num_qo_heads,)``,
    required when ``spec.alibi``.

    Raises:
        ValueError: ``spec.alibi`` without ``alibi_slopes``.
    """
    transforms = [fn for _, fn in builtin_transforms(spec)]
    if not transforms:
        return None
    if spec.alibi and alibi_slopes is None:
        raise ValueError("alibi_slopes: the spec has ALiBi, so a float32 (num_qo_heads,) tensor is required")
    params = SimpleNamespace(alibi_slopes=alibi_slopes)  # what alibi_transform reads; traceable by dynamo

    def score_mod(score, b, h, q_idx, kv_idx):
        for fn in transforms:
            score = fn(score, b, h, q_idx + q_offset, kv_idx, params)
        return score

    return score_mod


def flex_problem(spec: AttentionSpec) -> str | None:
    """Why the spec has no score_mod/mask_mod form here (None when it has)."""
    if spec.sinks:
        return "sinks (a per-head logit in the softmax denominator only) have no score_mod/mask_mod form"
    if spec.variant is not None:
        return f"custom variant {spec.variant.name!r}: no Flex translation of its functors"
    if spec.kv_dtype != spec.q_dtype:
        return f"{spec.kv_dtype} KV cache: the dense Flex inputs would need dequantising first"
    return None


def flex_call(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, *,
              compiled: bool = True) -> Callable[[], torch.Tensor]:
    """A closure running FlexAttention on dense q ``(B, H_qo, N, D)``, k/v ``(B, H_kv, L, D)``.

    Builds the block mask once (only when the case masks some pair) and, with ``compiled``,
    wraps ``flex_attention`` in ``torch.compile(fullgraph=True, dynamic=False)`` so a graph break
    raises instead of falling back to the unfused path (which materialises every score).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n, kv_len = q.shape[2], k.shape[2]
    slopes = default_alibi_slopes(spec, q.device) if spec.alibi else None
    score_mod = flex_score_mod(spec, q_offset, slopes)
    mask_mod = flex_mask_mod(spec, q_offset) if visible_pairs(spec, n, kv_len) < n * kv_len else None
    block_mask = create_block_mask(mask_mod, None, None, n, kv_len, device=q.device) if mask_mod else None
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compiled else flex_attention
    gqa = spec.group_size > 1
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=spec.sm_scale, enable_gqa=gqa)


def flex_runner(case: BenchCase, dense: Contiguous | None) -> Runner:
    """FlexAttention, compiled for this case after a dynamo reset; the note has the first-call seconds.

    Raises:
        Skip: sinks, a custom variant, an FP8 cache, or unequal lengths; FlexAttention not importable.
    """
    import torch._dynamo

    from jitattn.backends.flex import flex_import_error

    problem = (flex_problem(case.spec) or (None if dense is not None else "unequal sequence lengths")
               or flex_import_error())
    if problem:
        raise Skip(problem)
    torch._dynamo.reset()  # one compile per case; never hit the recompile limit and fall back to eager
    call = flex_call(case.spec, dense.q, dense.k, dense.v, case.kv_lens[0] - case.q_lens[0])
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return Runner(call, dense.rows, note=f"compile+1st call {time.perf_counter() - t0:.1f} s")


# ---- FlashInfer -------------------------------------------------------------------------------
FLASHINFER_WORKSPACE_BYTES = 256 << 20


def import_flashinfer() -> Any:
    """The flashinfer module (:func:`jitattn.backends.flashinfer.flashinfer_import_error` tries it once).

    Raises:
        Skip: ``import flashinfer`` failed (the message is the import error).
    """
    error = flashinfer_import_error()
    if error:
        raise Skip(f"import flashinfer failed: {error}")
    import flashinfer

    return flashinfer


def flashinfer_problem(spec: AttentionSpec) -> str | None:
    """Why FlashInfer's paged wrappers cannot run ``spec`` (None when they can)."""
    if spec.variant is not None:
        return f"custom variant {spec.variant.name!r}: not translated to FlashInfer's JIT variants"
    if spec.window_right >= 0:
        return "window_right: FlashInfer's fa2/fa3 wrappers take a left window only"
    if spec.sinks and (spec.logits_soft_cap or spec.alibi):
        return "sinks with soft-cap or ALiBi: FlashInfer's attention-sink variant has neither"
    return None


def _flashinfer_plain(fi: Any, case: BenchCase, batch: PagedBatch, workspace: torch.Tensor,
                      pages: tuple[torch.Tensor, ...]) -> tuple[Any, tuple]:
    """A planned BatchDecode (fa2; tensor cores for GQA groups > 4, vLLM's rule) or BatchPrefill
    (FlashInfer picks fa3 on Hopper, else fa2) paged wrapper, and the extra run() arguments (none)."""
    s, dtype, kv_dtype = case.spec, torch_dtype(case.spec.q_dtype), torch_dtype(case.spec.kv_dtype)
    kw = dict(pos_encoding_mode="ALIBI" if s.alibi else "NONE", window_left=s.window_left,
              logits_soft_cap=s.logits_soft_cap or None, sm_scale=s.sm_scale, q_data_type=dtype, kv_data_type=kv_dtype)
    heads = (s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.page_size)
    if case.is_decode:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, s.kv_layout, use_tensor_cores=s.group_size > 4,
                                                        backend="fa2")
        wrapper.plan(*pages, *heads, **kw)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, s.kv_layout)
        wrapper.plan(batch.query_start_loc, *pages, *heads, causal=s.causal, **kw)
    return wrapper, ()


def _flashinfer_sinks(fi: Any, case: BenchCase, batch: PagedBatch, workspace: torch.Tensor,
                      pages: tuple[torch.Tensor, ...]) -> tuple[Any, tuple]:
    """FlashInfer's attention-sink JIT variant (gpt-oss): planned wrapper, run() extras ``(sinks, sm_scale)``.

    Raises:
        Skip: this FlashInfer has no attention-sink wrapper.
    """
    s, dtype, kv_dtype = case.spec, torch_dtype(case.spec.q_dtype), torch_dtype(case.spec.kv_dtype)
    name = "BatchDecodeWithAttentionSinkWrapper" if case.is_decode else "BatchAttentionWithAttentionSinkWrapper"
    cls = getattr(fi, name, None)
    if cls is None:
        raise Skip(f"flashinfer {getattr(fi, '__version__', '?')} has no {name} (sinks)")
    wrapper = cls(workspace, s.kv_layout, q_data_type=dtype, kv_data_type=kv_dtype, head_dim_qk=s.head_dim_qk,
                  head_dim_vo=s.head_dim_vo, window_left=s.window_left)
    kw = dict(window_left=s.window_left, sm_scale=s.sm_scale, q_data_type=dtype, kv_data_type=kv_dtype)
    heads = (s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.page_size)
    if case.is_decode:
        wrapper.plan(*pages, *heads, **kw)
    else:
        wrapper.plan(batch.query_start_loc, *pages, *heads, causal=s.causal, **kw)
    return wrapper, (batch.sinks, s.sm_scale)


def flashinfer_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """FlashInfer's paged wrappers on the same paged cache: plan once, time ``run`` (as an engine does per step).

    Plain specs use BatchDecode/BatchPrefillWithPagedKVCacheWrapper, specs with sinks the
    attention-sink variant. The first plan may JIT-compile a module: the note has the seconds of
    plan + first call, and FlashInfer's choice of backend.

    Raises:
        Skip: flashinfer does not import, or the spec has a custom variant / a right window /
            sinks with soft-cap or ALiBi.
    """
    fi = import_flashinfer()
    problem = flashinfer_problem(case.spec)
    if problem:
        raise Skip(problem)
    pages = page_metadata(case.spec, batch.block_table, batch.seq_lens)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=batch.q.device)
    t0 = time.perf_counter()
    wrapper, extra = (_flashinfer_sinks if case.spec.sinks else _flashinfer_plain)(fi, case, batch, workspace, pages)
    scales = batch.scales  # FP8: k_scale, v_scale (empty for a 16-bit cache)
    call = lambda: wrapper.run(batch.q, batch.kv_cache, *extra, **scales)  # noqa: E731
    call()
    torch.cuda.synchronize()
    backend = getattr(wrapper, "_backend", "?")
    return Runner(call, note=f"{backend}, plan+1st call {time.perf_counter() - t0:.1f} s")


def anchor_builders(case: BenchCase, batch: PagedBatch, dense: Contiguous | None
                    ) -> dict[str, Callable[[], Runner | dict[str, Runner]]]:
    """Each anchor family's builder for one case (called by :func:`jitattn.bench.harness.build_runners`)."""
    return {"sdpa": lambda: sdpa_runners(case, dense), "flex": lambda: flex_runner(case, dense),
            "flashinfer": lambda: flashinfer_runner(case, batch)}

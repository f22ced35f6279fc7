"""The reference: every spec feature in plain torch, over the same paged or ragged inputs as the kernels.

It is the oracle of every kernel test and the fallback backend on any device. It favours clarity
over speed: one sequence at a time, fp32 (or fp64) arithmetic, query rows in chunks so that the
score matrix stays under ``max_score_bytes``.

Semantics (identical to the kernels'; see :mod:`jitattn.spec` and :mod:`jitattn.variant`):
``s = sm_scale * query_transform(q) . key_transform(k)``; soft-cap; ALiBi ``slope_h * (j - p)``; the
variant's logits transform; then masking (causal, windows, the variant's mask); softmax whose
denominator also holds ``exp(sink_h)`` when the spec has sinks (or, for a variant without softmax,
the weighted sum); the output transform. The built-in features and the Python hooks are the very
functions the kernels are traced from. ``lse = log(sum_j exp(s_j) [+ exp(sink_h)])`` in natural
log. A row that sees no key gets output 0 and lse ``-inf`` (``sink_h`` with sinks), never NaN.

A latent (MLA) spec goes through :func:`paged_attention` too: its cache's rows are K and their first
``head_dim_vo`` values V (:func:`gather_kv`, :func:`gather_latent`), dequantised by ``k_scale``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from jitattn.checks import (check_flag, check_metadata_values, check_paged_call, check_position_values,
                            check_positions, check_ragged_call, check_ragged_metadata_values, check_scales, check_spec)
from jitattn.dtypes import default_alibi_slopes, torch_dtype  # noqa: F401 (torch_dtype: also re-exported)
from jitattn.spec import AttentionSpec
from jitattn.trace import ParamView
from jitattn.variant import builtin_transforms, structural_mask


def kv_pages(kv_cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """The pages ``ids`` (int64, any shape ``S``) of a cache given as one tensor or a ``(k_cache, v_cache)``
    pair, as one tensor ``(*S, 2, ...)`` in the single-tensor layout (a copy)."""
    if isinstance(kv_cache, (tuple, list)):
        return torch.stack((kv_cache[0][ids], kv_cache[1][ids]), ids.dim())
    return kv_cache[ids]


def gather_kv(spec: AttentionSpec, kv_cache: Any, block_table: torch.Tensor, b: int,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s keys and values from the paged cache (one tensor or a ``(k_cache, v_cache)``
    pair), each ``(kv_len, num_kv_heads, head_dim)``; a latent spec's K rows ``(kv_len, 1, head_dim_qk)`` and
    V their first ``head_dim_vo`` values (views of :func:`gather_latent`)."""
    if spec.latent:
        rows = gather_latent(spec, kv_cache, block_table, b, kv_len)[:, None]  # (L, 1, head_dim_qk)
        return rows, rows[..., :spec.head_dim_vo]
    num_pages = -(-kv_len // spec.page_size)
    pages = kv_pages(kv_cache, block_table[b, :num_pages].long())  # (n, 2, P, H, D) or (n, 2, H, P, D)
    if spec.kv_layout == "HND":
        pages = pages.transpose(2, 3)  # (n, 2, P, H, D)
    k = pages[:, 0].reshape(-1, spec.num_kv_heads, spec.head_dim_qk)[:kv_len]
    v = pages[:, 1].reshape(-1, spec.num_kv_heads, spec.head_dim_vo)[:kv_len]
    return k, v


def gather_latent(spec: AttentionSpec, latent_cache: torch.Tensor, block_table: torch.Tensor, b: int,
                  kv_len: int) -> torch.Tensor:
    """Sequence ``b``'s latent rows ``(kv_len, head_dim_qk)`` (c_kv then k_pe; a copy, in the cache's dtype)
    from a latent cache ``(num_pages, page_size, head_dim_qk)``."""
    pages = latent_cache[block_table[b, :-(-kv_len // spec.page_size)].long()]  # (n, P, D)
    return pages.reshape(-1, spec.head_dim_qk)[:kv_len]


def visible(spec: AttentionSpec, qo_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """Structural visibility (causal, windows): bool ``(len(qo_pos), len(kv_pos))``.

    The same functor the kernels trace (:func:`jitattn.variant.structural_mask`)."""
    bounds = structural_mask(spec.causal, spec.window_left, spec.window_right)
    if bounds is None:
        return torch.ones(len(qo_pos), len(kv_pos), dtype=torch.bool, device=qo_pos.device)
    return bounds(0, 0, qo_pos[:, None], kv_pos[None, :], ParamView({})).to(torch.bool)


def _hook(spec: AttentionSpec, hook: str):
    """The torch implementation of a variant hook, or None; NotImplementedError if it has none."""
    variant = spec.variant
    if variant is None or hook not in variant.cuda:
        return None
    fn = variant.reference(hook)
    if fn is None:
        raise NotImplementedError(f"variant {variant.name!r} has a {hook} given as CUDA but no torch reference "
                                  f"(reference_transform / reference_mask, or write the hook in Python)")
    return fn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The vector whose element ``dim`` is ``-x[dim + D/2]`` (first half) or ``x[dim - D/2]`` (second)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _transform_vectors(fn, x: torch.Tensor, b: int, pos: torch.Tensor, params: ParamView) -> torch.Tensor:
    """Apply a query/key hook to ``x`` ``(len, heads, D)`` at positions ``pos`` ``(len,)``."""
    heads = torch.arange(x.shape[1], device=x.device)[None, :, None]
    dim = torch.arange(x.shape[2], device=x.device)[None, None, :]
    return fn(x, _rotate_half(x), b, heads, pos[:, None, None], dim, params).to(x.dtype).expand_as(x)


def _scores(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, b: int, qo_pos: torch.Tensor,
            kv_pos: torch.Tensor, params: ParamView) -> torch.Tensor:
    """Transformed logits with hidden pairs at -inf (softmax) or 0 (weights): ``(num_qo_heads, rows, kv_len)``."""
    s = torch.einsum("qhd,khd->hqk", q, k) * spec.sm_scale  # (H, rows, L)
    head = torch.arange(spec.num_qo_heads, device=q.device)[:, None, None]
    qi, ki = qo_pos[None, :, None], kv_pos[None, None, :]
    transforms = [fn for _, fn in builtin_transforms(spec)] + [f for f in [_hook(spec, "logits_transform")] if f]
    for fn in transforms:
        s = fn(s, b, head, qi, ki, params).to(s.dtype).expand_as(s)
    mask = visible(spec, qo_pos, kv_pos)[None]
    user_mask = _hook(spec, "logits_mask")
    if user_mask is not None:
        mask = mask & user_mask(b, head, qi, ki, params).to(torch.bool)
    softmax = spec.variant is None or spec.variant.softmax
    return s.masked_fill(~mask, float("-inf") if softmax else 0.0)


def _softmax_out(s: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over keys (with sink logits in the denominator) times V: out ``(rows, H, D)``, lse ``(rows, H)``."""
    m = s.amax(dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))  # (H, rows); no key: -inf
    if sinks is not None:
        m = torch.maximum(m, sinks[:, None].to(s.dtype))
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])  # exp(-inf) = 0 for hidden keys
    denom = p.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sinks[:, None].to(s.dtype) - m_safe)
    out = torch.einsum("hqk,khd->qhd", p, v) / torch.where(denom > 0, denom, torch.ones_like(denom)).T[..., None]
    lse = torch.where(denom > 0, torch.log(denom) + m_safe, torch.full_like(denom, float("-inf")))
    return out, lse.T


def paged_attention(
    spec: AttentionSpec,
    q: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    return_lse: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_positions: torch.Tensor | None = None,
    functor_batch: torch.Tensor | None = None,
    position_offset: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    max_score_bytes: int = 1 << 30,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch of sequences over a paged KV cache, in plain torch.

    Args:
        spec: the variant (``kv_storage="paged"``, or ``"latent"``: MLA).
        q: ``(total_q, num_qo_heads, head_dim_qk)``, queries of all sequences back to back.
        kv_cache: NHD ``(num_pages, 2, page_size, num_kv_heads, head_dim)`` or HND
            ``(num_pages, 2, num_kv_heads, page_size, head_dim)``; index 0 of dim 1 is K, 1 is V.
            Or a ``(k_cache, v_cache)`` pair, each NHD ``(num_pages, page_size, num_kv_heads, head_dim)``
            or HND ``(num_pages, num_kv_heads, page_size, head_dim)`` (the engines' separate caches).
            A latent spec (MLA, ``kv_storage="latent"``) reads one tensor ``(num_pages, page_size,
            head_dim_qk)``: K is each row (c_kv then k_pe), V its first ``head_dim_vo`` values; its
            single KV head serves every query head.
        block_table: int ``(batch, max_pages_per_seq)``, page ids of each sequence in order.
        seq_lens: int ``(batch,)``, KV length of each sequence (new tokens included).
        query_start_loc: int ``(batch + 1,)``, cumulative query counts; sequence ``b``'s
            queries are rows ``query_start_loc[b] : query_start_loc[b + 1]`` of ``q``, at
            positions ``seq_lens[b] - qo_len ... seq_lens[b] - 1``.
        sinks: float32 ``(num_qo_heads,)``, required when ``spec.sinks``.
        alibi_slopes: float32 ``(num_qo_heads,)``; defaults to the standard slopes when ``spec.alibi``.
        params: the variant's parameter tensors by name.
        return_lse: also return the natural-log lse, float32 ``(total_q, num_qo_heads)``.
        k_scale, v_scale: an FP8 cache holds ``K / k_scale`` and ``V / v_scale`` (per-tensor scales);
            1.0 for a 16-bit cache. A latent cache takes ``k_scale`` only (it dequantises V too).
        query_positions, functor_batch, position_offset: int32, required by (and only by) a spec with
            ``query_positions="explicit"``: query token ``t`` sits at position ``query_positions[t]``
            (any order; negative: before the first key; also past the last key) in its sequence's key frame, and the masks use
            that; the hooks see batch ``functor_batch[t]`` (key hooks: that of the sequence's first
            token) and every position plus ``position_offset[b]`` (sequence ``b``). Shapes
            ``(total_q,)``, ``(total_q,)``, ``(batch,)``. A sequence may then bring more queries than keys.
        compute_dtype: float32 (default) or float64 arithmetic.
        max_score_bytes: query rows are processed in chunks so one score matrix stays under this.

    Returns:
        ``out`` ``(total_q, num_qo_heads, head_dim_vo)`` in ``spec.o_dtype``, and ``lse`` if asked.

    Every input is checked first, as the kernels check theirs with ``validate=True``
    (:func:`jitattn.checks.check_paged_call`, :func:`jitattn.checks.check_metadata_values`): the
    reference reads the metadata on the host anyway, so a bad batch is an error, never a wrong answer.

    Raises:
        ValueError: a ragged spec; a tensor whose type, dtype (the spec's: ``q_dtype``, ``kv_dtype``,
            int32 metadata, float32 sinks / slopes), number of dims, size or device does not match;
            missing or unexpected sinks / params; ``query_start_loc`` not starting at 0, not ending
            at ``total_q`` or decreasing; a negative ``seq_lens`` entry, one with fewer keys than
            queries or more than its ``block_table`` row holds; a page id outside ``[0, num_pages)``;
            a ``k_scale`` / ``v_scale`` that is not a positive finite float, or not 1.0 for a 16-bit
            cache (only an FP8 cache is scaled); ``return_lse`` with a
            softmax-free variant; a ``functor_batch`` entry < 0 or past a parameter indexed by batch.
        NotImplementedError: a variant functor without its torch reference.
    """
    check_spec(spec, "reference.paged_attention(spec, q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
    if spec.ragged:
        raise ValueError("spec.kv_storage='ragged': use reference.ragged_attention(spec, q, k, v, query_start_loc, "
                         "kv_start_loc) for a ragged spec")
    call = check_paged_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, sinks=sinks,
                            alibi_slopes=alibi_slopes, params=params)
    check_positions(spec, query_positions, functor_batch, position_offset, total_q=call.total_q, batch=call.batch,
                    device=q.device)
    check_metadata_values(spec, seq_lens, query_start_loc, block_table, call.num_pages, call.total_q)
    explicit = None
    if spec.explicit_positions:
        check_position_values(functor_batch, spec, params)
        explicit = (query_positions.tolist(), functor_batch.tolist(), position_offset.tolist())
    k_scale, v_scale = check_scales(spec, k_scale, v_scale)
    return _attention(spec, q, query_start_loc, seq_lens.tolist(),
                      lambda b, kv_len: gather_kv(spec, kv_cache, block_table, b, kv_len), "seq_lens[{b}]={n}",
                      sinks=sinks, alibi_slopes=alibi_slopes, params=params, return_lse=return_lse, k_scale=k_scale,
                      v_scale=v_scale, compute_dtype=compute_dtype, max_score_bytes=max_score_bytes,
                      explicit=explicit)


def ragged_attention(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    max_score_bytes: int = 1 << 30,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch of sequences over contiguous varlen ("ragged") K/V, in plain torch.

    The layout of FlashInfer's BatchPrefillWithRaggedKVCache and flash_attn_varlen_func: every
    sequence's keys and values back to back, with cumulative offsets. Semantics are those of
    :func:`paged_attention`: sequence ``b``'s queries are the last ``q_len`` of its ``kv_len`` keys.

    Args:
        spec: the variant (``kv_storage="ragged"``; ``head_dim_vo`` may differ from ``head_dim_qk``).
        q: ``(total_q, num_qo_heads, head_dim_qk)``, queries of all sequences back to back.
        k: ``(total_kv, num_kv_heads, head_dim_qk)``, keys of all sequences back to back.
        v: ``(total_kv, num_kv_heads, head_dim_vo)``, values, rows as ``k``.
        query_start_loc: int ``(batch + 1,)``: sequence ``b``'s queries are rows
            ``query_start_loc[b] : query_start_loc[b + 1]`` of ``q``.
        kv_start_loc: int ``(batch + 1,)``: its keys and values are rows
            ``kv_start_loc[b] : kv_start_loc[b + 1]`` of ``k`` / ``v``, at positions ``0 ... kv_len - 1``;
            its queries sit at positions ``kv_len - q_len ... kv_len - 1`` (``q_len <= kv_len``).
        sinks, alibi_slopes, params, return_lse, compute_dtype, max_score_bytes: as :func:`paged_attention`.

    Returns:
        ``out`` ``(total_q, num_qo_heads, head_dim_vo)`` in ``spec.o_dtype``, and the natural-log
        ``lse`` float32 ``(total_q, num_qo_heads)`` if asked. Rows that see no key: 0 and ``-inf``.

    Every input is checked first (:func:`jitattn.checks.check_ragged_call`,
    :func:`jitattn.checks.check_ragged_metadata_values`), so a bad batch is an error, never a wrong answer.

    Raises:
        ValueError: a paged spec; a tensor whose type, dtype, number of dims, size or device does
            not match the spec; missing or unexpected sinks / params; ``query_start_loc`` /
            ``kv_start_loc`` not starting at 0, not ending at the rows of q / k, or decreasing; a
            sequence with more queries than keys; ``return_lse`` with a softmax-free variant.
        NotImplementedError: a variant functor without its torch reference.
    """
    check_spec(spec, "reference.ragged_attention(spec, q, k, v, query_start_loc, kv_start_loc, ...)")
    if not spec.ragged:
        raise ValueError(f"spec.kv_storage={spec.kv_storage!r}: ragged_attention needs a spec with "
                         f"kv_storage='ragged' (use paged_attention for the paged cache)")
    call = check_ragged_call(spec, q, k, v, query_start_loc, kv_start_loc, sinks=sinks, alibi_slopes=alibi_slopes,
                             params=params)
    check_ragged_metadata_values(query_start_loc, kv_start_loc, call.total_q, call.total_kv)
    ksl = kv_start_loc.tolist()
    lens = [ksl[b + 1] - ksl[b] for b in range(len(ksl) - 1)]
    return _attention(spec, q, query_start_loc, lens,
                      lambda b, kv_len: (k[ksl[b]:ksl[b] + kv_len], v[ksl[b]:ksl[b] + kv_len]),
                      "kv_start_loc[{b1}] - kv_start_loc[{b}]={n}", sinks=sinks, alibi_slopes=alibi_slopes,
                      params=params, return_lse=return_lse, compute_dtype=compute_dtype,
                      max_score_bytes=max_score_bytes)


def _attention(spec: AttentionSpec, q: torch.Tensor, query_start_loc: torch.Tensor, lens: list[int], fetch_kv,
               len_name: str, *, sinks, alibi_slopes, params, return_lse: bool, k_scale: float = 1.0,
               v_scale: float = 1.0, compute_dtype: torch.dtype, max_score_bytes: int,
               explicit: tuple[list[int], list[int], list[int]] | None = None):
    """The reference core: ``fetch_kv(b, kv_len)`` gives sequence ``b``'s K ``(kv_len, H_kv, head_dim_qk)``
    and V ``(kv_len, H_kv, head_dim_vo)``; ``explicit`` the host lists (query positions, functor batch,
    position offset) of explicit positions; everything else as :func:`paged_attention`.

    Every position below is the one the hooks see; the masks and ALiBi depend only on differences of
    positions, so adding an explicit sequence's offset to the query and key positions alike leaves them
    as they are in the key frame."""
    if spec.sinks and sinks is None:
        raise ValueError("sinks: the spec has sinks=True, so a float32 (num_qo_heads,) tensor is required")
    softmax = spec.variant is None or spec.variant.softmax
    if check_flag("return_lse", return_lse) and not softmax:
        raise ValueError(f"return_lse=True: variant {spec.variant.name!r} has no softmax, so there is no lse")
    if spec.alibi and alibi_slopes is None:
        alibi_slopes = default_alibi_slopes(spec, q.device)
    values = dict(params or {})
    if spec.alibi:
        values["alibi_slopes"] = alibi_slopes.to(compute_dtype)
    view = ParamView(values)
    q_hook, k_hook, out_hook = (_hook(spec, h) for h in ("query_transform", "key_transform", "output_transform"))
    total_q = q.shape[0]
    out = torch.zeros(total_q, spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype), device=q.device)
    lse = torch.full((total_q, spec.num_qo_heads), float("-inf"), dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    sink_c = sinks.to(compute_dtype) if spec.sinks else None
    for b, kv_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 - q0 > kv_len and explicit is None:
            raise ValueError(f"sequence {b}: {q1 - q0} queries but {len_name.format(b=b, b1=b + 1, n=kv_len)}; "
                             f"the queries are the last tokens of the keys (the KV length counts new tokens too)")
        if q1 == q0:
            continue
        k, v = fetch_kv(b, kv_len)
        offset = explicit[2][b] if explicit else 0
        kv_pos = torch.arange(offset, offset + kv_len, device=q.device)
        k = k.to(compute_dtype) * k_scale
        if k_hook is not None:
            k = _transform_vectors(k_hook, k, explicit[1][q0] if explicit else b, kv_pos, view)
        k = k.repeat_interleave(spec.group_size, dim=1)  # (L, Hq, D)
        v = (v.to(compute_dtype) * v_scale).repeat_interleave(spec.group_size, dim=1)
        rows = max(1, max_score_bytes // max(1, 8 * spec.num_qo_heads * max(kv_len, 1)))
        for r0, r1, hb in _row_chunks(q0, q1, rows, explicit[1] if explicit else None, b):
            if explicit:
                qo_pos = torch.tensor(explicit[0][r0:r1], device=q.device, dtype=torch.int64) + offset
            else:
                qo_pos = torch.arange(kv_len - (q1 - r0), kv_len - (q1 - r1), device=q.device)
            qc = q[r0:r1].to(compute_dtype)
            if q_hook is not None:
                qc = _transform_vectors(q_hook, qc, hb, qo_pos, view)
            s = _scores(spec, qc, k, hb, qo_pos, kv_pos, view)
            if softmax:
                o, l = _softmax_out(s, v, sink_c)
                lse[r0:r1] = l.float()
            else:
                o = torch.einsum("hqk,khd->qhd", s, v)
            if out_hook is not None:
                heads = torch.arange(spec.num_qo_heads, device=q.device)[None, :, None]
                dim = torch.arange(spec.head_dim_vo, device=q.device)[None, None, :]
                o = out_hook(o, hb, heads, qo_pos[:, None, None], dim, view).to(o.dtype).expand_as(o)
            out[r0:r1] = o.to(out.dtype)
    return (out, lse) if return_lse else out


def _row_chunks(q0: int, q1: int, rows: int, hook_batch: list[int] | None, b: int):
    """(r0, r1, batch the hooks see) for rows [q0, q1) in chunks of at most ``rows``: runs of one
    ``hook_batch`` value with explicit positions (the hooks take one batch index per call), else ``b``."""
    start = q0
    while start < q1:
        end = min(q1, start + rows)
        hb = b
        if hook_batch is not None:
            hb = hook_batch[start]
            end = next((i for i in range(start + 1, end) if hook_batch[i] != hb), end)
        yield start, end, hb
        start = end

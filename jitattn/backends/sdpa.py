"""``sdpa``: torch's ``scaled_dot_product_attention`` (FlashAttention / cuDNN / memory-efficient / math).

Serves plain attention only: causal or bidirectional, any GQA group, no window, no soft-cap, no
sinks, no ALiBi, no custom functors (SDPA takes none of these; a dense mask could express windows,
but it would take SDPA off its flash path and cost O(q x kv) memory, so this backend does not).

Cost of the paged input: SDPA takes dense K/V, so each call gathers every sequence's pages into a
contiguous copy (one extra read and write of the KV the batch touches) and makes one SDPA call per
sequence, reading ``seq_lens`` / ``query_start_loc`` on the host (a device sync; not capturable in
a CUDA graph). Causal masks are bottom-right aligned as jitattn's convention needs: a sequence
whose queries are all its keys uses ``is_causal=True``; a single query sees every key (no mask);
a chunk of queries after cached keys passes an explicit boolean mask.
SDPA does not return the log-sum-exp, so ``return_lse=True`` is refused. Ragged specs are served
the same way, one SDPA call per sequence on slices of k / v (no gather); SDPA takes a value head dim
that differs from the query/key one (head_dim_vo != head_dim_qk) on its math and memory-efficient paths.

Latent (MLA) specs are served too, bf16/fp16 or FP8 caches: each sequence's latent rows are gathered
from the pages (``(kv_len, head_dim_qk)``, K; V is their first ``head_dim_vo`` values) and, the one
KV head being shared by every query head, the ``q_len x num_qo_heads`` query rows go to SDPA as one
head's queries (no copy of K per head). An FP8 row is exact in the query dtype, so its ``k_scale`` is
folded into the softmax scale and the output rather than multiplied into a copy of the rows.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

from jitattn.backends.base import Backend, DeviceInfo, PagedAttentionFn, dtype_reasons, unsupported_reasons
from jitattn.spec import KV_DTYPES, AttentionSpec

if TYPE_CHECKING:  # torch loads in build(): the reasons serve `jitattn select` on a box without torch
    import torch


class SdpaBackend(Backend):
    name = "sdpa"
    priority = 40
    supports_lse = False
    supports_latent = True
    description = "torch scaled_dot_product_attention over gathered K/V (plain causal/bidirectional)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        n = self.name
        out = unsupported_reasons(n, spec, window="torch SDPA has no window; a dense mask would take it off its "
                                                  "flash path",
                                  logits_soft_cap="torch SDPA has no soft-cap",
                                  sinks="torch SDPA has no sink term in the softmax denominator",
                                  alibi="torch SDPA takes no per-head position bias",
                                  variant="torch SDPA takes no score or mask functions")
        return out + (dtype_reasons(n, spec, kv=KV_DTYPES) if spec.latent else dtype_reasons(n, spec))

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        from jitattn.backends.common import check_call, check_flags, finish, new_out
        from jitattn.checks import check_scales
        from jitattn.reference import gather_kv, gather_latent

        if spec.ragged:
            return _ragged_fn(spec)

        def sdpa_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *, out=None,
                                 return_lse: bool = False, max_query_len: int | None = None, validate: bool = True,
                                 **kwargs: Any):
            check_flags(return_lse, validate)
            _refuse_lse(return_lse)
            # It reads the metadata on the host anyway, so it always checks the values (validate is moot).
            check_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, {**kwargs, "out": out}, values=True)
            k_scale = check_scales(spec, kwargs.get("k_scale", 1.0), kwargs.get("v_scale", 1.0))[0]
            result = new_out(spec, q, None)
            qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
            for b, kv_len in enumerate(lens):
                q0, q1 = qsl[b], qsl[b + 1]
                if q1 - q0 > kv_len:
                    raise ValueError(f"sequence {b}: {q1 - q0} queries but seq_lens[{b}]={kv_len}; "
                                     f"seq_lens counts new tokens too")
                if q1 > q0 and spec.latent:
                    result[q0:q1] = _one_latent_sequence(spec, q[q0:q1], gather_latent(spec, kv_cache, block_table, b,
                                                                                      kv_len), k_scale)
                elif q1 > q0:
                    result[q0:q1] = _one_sequence(spec, q[q0:q1], *gather_kv(spec, kv_cache, block_table, b, kv_len))
            return finish(result, None, out, False)

        return sdpa_paged_attention


def _ragged_fn(spec: AttentionSpec) -> PagedAttentionFn:
    from jitattn.backends.common import check_flags, check_ragged, finish, new_out

    def sdpa_ragged_attention(q, k, v, query_start_loc, kv_start_loc, *, out=None, return_lse: bool = False,
                              max_query_len: int | None = None, validate: bool = True, **kwargs: Any):
        check_flags(return_lse, validate)
        _refuse_lse(return_lse)
        check_ragged(spec, q, k, v, query_start_loc, kv_start_loc, {**kwargs, "out": out}, values=True)
        result = new_out(spec, q, None)
        qsl, ksl = query_start_loc.tolist(), kv_start_loc.tolist()
        for b in range(len(qsl) - 1):
            q0, q1, k0, k1 = qsl[b], qsl[b + 1], ksl[b], ksl[b + 1]
            if q1 - q0 > k1 - k0:
                raise ValueError(f"sequence {b}: {q1 - q0} queries but {k1 - k0} keys; q_len <= kv_len")
            if q1 > q0:
                result[q0:q1] = _one_sequence(spec, q[q0:q1], k[k0:k1], v[k0:k1])
        return finish(result, None, out, False)

    return sdpa_ragged_attention


def _refuse_lse(return_lse: bool) -> None:  # after check_flags: a bool
    if return_lse:
        raise NotImplementedError("sdpa: cannot return the lse (torch SDPA does not expose it); "
                                  "select a backend with need_lse=True")


def _one_sequence(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA for one sequence: q ``(n, H_qo, D)``, k ``(L, H_kv, D)``, v ``(L, H_kv, Dv)`` -> ``(n, H_qo, Dv)``."""
    import torch
    import torch.nn.functional as F

    n, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, n, D), (H_kv, L, D)
    if spec.group_size > 1:
        kh = kh.repeat_interleave(spec.group_size, dim=0)  # (H_qo, L, D)
        vh = vh.repeat_interleave(spec.group_size, dim=0)
    mask, is_causal = _causal_mask(spec, n, kv_len, q.device)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=spec.sm_scale)
    return o.transpose(0, 1)  # (n, H, D)


def _one_latent_sequence(spec: AttentionSpec, q: torch.Tensor, rows: torch.Tensor, k_scale: float) -> torch.Tensor:
    """SDPA for one sequence of a latent spec: q ``(n, H, head_dim_qk)``, its latent rows ``(L, head_dim_qk)``
    -> ``(n, H, head_dim_vo)``. The ``n * H`` query rows are one head's (all heads share the row)."""
    import torch
    import torch.nn.functional as F

    n, heads, kv_len = q.shape[0], q.shape[1], rows.shape[0]
    k = rows.to(q.dtype)[None, None]  # (1, 1, L, Dqk); an FP8 value is exact in 16 bits
    qh = q.reshape(1, 1, n * heads, spec.head_dim_qk)  # row i * H + h: query i of head h
    mask = None
    if n > 1:  # bottom-right causal: query i (at kv_len - n + i) sees keys j <= kv_len - n + i, on each of its H rows
        pos = torch.arange(kv_len - n, kv_len, device=q.device).repeat_interleave(heads)[:, None]  # (n * H, 1)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos  # (n * H, L)
    o = F.scaled_dot_product_attention(qh, k, k[..., :spec.head_dim_vo], attn_mask=mask,
                                       scale=spec.sm_scale * k_scale)  # (1, 1, n * H, Dvo)
    o = o.reshape(n, heads, spec.head_dim_vo)
    return o if k_scale == 1.0 else (o.float() * k_scale).to(q.dtype)


def _causal_mask(spec: AttentionSpec, n: int, kv_len: int, device: torch.device
                 ) -> tuple[torch.Tensor | None, bool]:
    """``(attn_mask, is_causal)`` for ``n`` queries at the last positions of ``kv_len`` keys (bottom-right).

    SDPA's ``is_causal`` is top-left aligned, right only when the queries are all the keys; a single
    query sees every key (no mask); a chunk after cached keys needs a boolean ``(n, kv_len)`` mask.
    """
    import torch

    if not spec.causal or n == 1:
        return None, False
    if n == kv_len:
        return None, True
    rows = torch.arange(kv_len - n, kv_len, device=device)[:, None]  # queries at kv_len - n ... kv_len - 1
    return torch.arange(kv_len, device=device)[None, :] <= rows, False  # (n, L)


def dense_attention_fn(spec: AttentionSpec, *, sdp_backend: Any = None
                       ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """SDPA on dense sequences of equal lengths, as the spec asks: ``fn(q, k, v) -> out``, the dense
    form of a paged batch. The spec is checked here, once; a call only launches.

    ``fn`` takes q ``(B, H_qo, N, head_dim_qk)`` (every sequence's ``N`` queries at its last
    positions), k / v ``(B, H_kv, L, head_dim_qk / head_dim_vo)`` in q's dtype (GQA through
    ``enable_gqa``: K/V are not copied per query head) and returns ``(B, H_qo, N, head_dim_vo)`` in
    q's dtype. Causal masks are bottom-right aligned (:func:`_causal_mask`); an explicit mask
    (``1 < N < L``) takes SDPA off its flash and cuDNN paths.

    Args:
        sdp_backend: a ``torch.nn.attention.SDPBackend`` to pin for every call (``FLASH_ATTENTION``,
            ``CUDNN_ATTENTION``), or None for torch's choice.

    Raises:
        ValueError: a spec feature SDPA has no form for (window, soft-cap, sinks, ALiBi, a variant,
            an FP8 cache), with the reasons.
    """
    reasons = SdpaBackend().spec_reasons(spec, DeviceInfo("cpu", "cpu"), "mixed")
    if reasons:
        raise ValueError("; ".join(reasons))
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gqa = spec.group_size > 1
    pin = (lambda: sdpa_kernel(sdp_backend)) if sdp_backend is not None else contextlib.nullcontext

    def sdpa_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask, is_causal = _causal_mask(spec, q.shape[2], k.shape[2], q.device)
        with pin():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=spec.sm_scale,
                                                  enable_gqa=gqa)

    return sdpa_dense_attention

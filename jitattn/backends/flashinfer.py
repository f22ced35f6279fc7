"""``flashinfer``: FlashInfer's batch prefill kernel over the paged cache, when ``import flashinfer`` works.

Checked against FlashInfer's documented Python API, 0.2.x through 0.6 (docs.flashinfer.ai,
``flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper``: ``plan(qo_indptr, paged_kv_indptr,
paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
causal=, window_left=, logits_soft_cap=, sm_scale=, q_data_type=, kv_data_type=)`` then
``run(q, paged_kv_cache, return_lse=)``). Its cache tensor is jitattn's: NHD ``(pages, 2,
page_size, H_kv, D)`` or HND ``(pages, 2, H_kv, page_size, D)``, and its ``(k_cache, v_cache)`` tuple
form is jitattn's pair (passed through as a tuple); its causal mask is bottom-right
aligned and ``window_left`` is inclusive, as in jitattn; its lse is base 2 (converted here).

Served: fp16/bf16, head dims 64, 128 and 256 (the set FlashInfer's FA2 kernels are built and
documented for; vLLM's FlashInfer backend lists the same), causal or not, ``window_left``,
soft-cap, any GQA group, compute capability 8.0 and newer. Refused: ``window_right`` (FlashInfer
has only a left window), sinks (only FlashInfer's newer TensorRT-LLM paths take them, not this
wrapper), ALiBi (this adapter does not pass slopes), custom functors (FlashInfer's JIT variants
use their own C++ contract; jitattn does not translate to it), FP8 KV (FlashInfer has FP8 paths;
this adapter does not pass the scales).

Each call re-plans on the host (metadata copied to the CPU: a device sync), so it is not
CUDA-graph capturable through this adapter. Not tested on the device yet: FlashInfer is not
installed there.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from jitattn.backends.base import (Backend, DeviceInfo, PagedAttentionFn, cuda_reasons, dtype_reasons,
                                   unsupported_reasons)
from jitattn.spec import AttentionSpec

if TYPE_CHECKING:  # torch loads in build(): the reasons serve `jitattn select` on a box without torch
    import torch

HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20


@functools.lru_cache(maxsize=None)
def flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails (None when it works). Tried once per process."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # an install broken in any way is "not available", with its message
        return f"{type(exc).__name__}: {exc}"
    return None


class FlashInferBackend(Backend):
    name = "flashinfer"
    priority = 80
    description = "FlashInfer batch prefill over the paged cache (hd 64/128/256, window, soft-cap)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        n = self.name
        err = flashinfer_import_error()
        if err:
            return [f"{n}: not installed (import flashinfer failed: {err})"]
        out = cuda_reasons(n, device, min_capability=(8, 0))
        out += unsupported_reasons(n, spec, ragged="it wraps BatchPrefillWithPagedKVCacheWrapper; the ragged "
                                                   "wrapper is not wired in")
        if spec.head_dim_qk not in HEAD_DIMS:
            out.append(f"{n}: head_dim={spec.head_dim_qk} not supported (FlashInfer's kernels take "
                       f"{', '.join(map(str, HEAD_DIMS))})")
        out += unsupported_reasons(n, spec, window_right="FlashInfer has only window_left",
                                   sinks="BatchPrefillWithPagedKVCacheWrapper has no sink term")
        if spec.alibi:  # the adapter's gap, not FlashInfer's
            out.append(f"{n}: ALiBi not supported by this adapter (it does not pass slopes to FlashInfer)")
        out += unsupported_reasons(n, spec, variant="FlashInfer's JIT variants use their own C++ contract")
        return out + dtype_reasons(n, spec)

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        import flashinfer
        import torch

        from jitattn.backends.common import check_call, check_flags, finish
        from jitattn.dtypes import torch_dtype

        dev = device.torch_device()
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, spec.kv_layout)
        dtype = torch_dtype(spec.q_dtype)

        def flashinfer_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *, out=None,
                                       return_lse: bool = False, max_query_len: int | None = None,
                                       validate: bool = False, **kwargs: Any):
            check_flags(return_lse, validate)
            check_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, {**kwargs, "out": out},
                       values=validate)
            indptr, indices, last_len = page_metadata(spec, block_table, seq_lens)
            wrapper.plan(query_start_loc, indptr, indices, last_len, spec.num_qo_heads, spec.num_kv_heads,
                         spec.head_dim_qk, spec.page_size, causal=spec.causal, window_left=spec.window_left,
                         logits_soft_cap=spec.logits_soft_cap or None, sm_scale=spec.sm_scale,
                         q_data_type=dtype, kv_data_type=dtype)
            paged_kv = tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else kv_cache
            o, lse = wrapper.run(q, paged_kv, return_lse=True)
            return finish(o.to(torch_dtype(spec.o_dtype)), lse * math.log(2.0), out, return_lse)

        return flashinfer_paged_attention


def page_metadata(spec: AttentionSpec, block_table: torch.Tensor, seq_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table of jitattn's block table, int32 on its device (a device sync).

    Returns ``kv_indptr (batch+1,)``, ``kv_indices (used pages,)`` (sequence ``b``'s first
    ``ceil(seq_lens[b] / page_size)`` block-table entries, in order) and ``last_page_len (batch,)``
    (``(seq_lens[b] - 1) % page_size + 1``; 0 for an empty sequence): the ``plan()`` arguments of
    FlashInfer's paged wrappers.
    """
    import torch

    lens = seq_lens.long()
    pages = (lens + spec.page_size - 1) // spec.page_size  # (B,)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_table.shape[1], device=lens.device)[None, :]
    indices = block_table[cols < pages[:, None]].to(torch.int32)  # row-major: each sequence's pages in order
    last = torch.where(pages > 0, lens - (pages - 1) * spec.page_size, torch.zeros_like(lens)).to(torch.int32)
    return indptr, indices, last

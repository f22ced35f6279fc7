"""The KV caches serving engines keep, each built from one jitattn cache tensor holding the same values.

Shared by tests/test_kv_layouts.py (CPU) and tests/test_gpu_kv_layouts.py: every layout is what the
engine allocates, then viewed as jitattn's ``(k_cache, v_cache)`` pair, with no copy at the call.
"""

from __future__ import annotations

from typing import Any

import torch

from jitattn.spec import AttentionSpec

#: Layouts for any page size; "sglang_token_pool" needs page_size=1 (a token pool is pages of one token).
LAYOUTS = ("single", "pair_views", "vllm_flash_attn", "separate_caches")
ALL_LAYOUTS = LAYOUTS + ("sglang_token_pool",)


def engine_kv(spec: AttentionSpec, kv_cache: torch.Tensor, layout: str) -> Any:
    """``kv_cache`` (the spec's single-tensor layout) as ``layout`` keeps it, with the same values:

    - ``single``: the tensor itself;
    - ``pair_views``: ``(kv[:, 0], kv[:, 1])``, views of the tensor (vLLM FlashInfer / Triton backends);
    - ``vllm_flash_attn``: a new ``(2, num_pages, ...)`` tensor, passed as ``(kv[0], kv[1])``;
    - ``separate_caches``: two separately allocated caches (transformers continuous batching);
    - ``sglang_token_pool``: two ``(num_tokens, H_kv, D)`` pools, unsqueezed at the page dim (page_size 1).
    """
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    if layout == "single":
        return kv_cache
    if layout == "pair_views":
        return k, v
    if layout == "vllm_flash_attn":
        both = torch.stack((k, v)).contiguous()  # (2, num_pages, page_size, H_kv, D) for NHD
        return both[0], both[1]
    if layout == "separate_caches":
        return k.contiguous(), v.contiguous()
    if layout == "sglang_token_pool":
        if spec.page_size != 1:
            raise ValueError(f"sglang_token_pool: needs page_size=1, got {spec.page_size}")
        page_dim = 1 if spec.kv_layout == "NHD" else 2
        pools = [t.squeeze(page_dim).contiguous() for t in (k, v)]  # (num_tokens, H_kv, D)
        return pools[0].unsqueeze(page_dim), pools[1].unsqueeze(page_dim)
    raise ValueError(f"layout: {layout!r} is not one of {ALL_LAYOUTS}")

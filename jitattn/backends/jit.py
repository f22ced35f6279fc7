"""``jit``: jitattn's own kernels, rendered for the spec, compiled by nvcc, cached, launched through the driver API.

Serves every spec feature (soft-cap, windows, sinks, ALiBi, every variant hook, GQA of any group
size, head dims 32..256 in steps of 16, NHD/HND, any page size, every KV dtype the spec takes, ragged
K/V with head_dim_qk != head_dim_vo) on CUDA devices whose compute
capability runs one of the archs jitattn builds (:func:`jitattn.build.archs_for_capability`:
today 8.0 and newer). Launches are CUDA-graph capturable and return the lse.

Building may compile (seconds per spec) unless the cache is warm; under ``JITATTN_DISABLE_JIT=1``
a missing kernel is an error naming the warm-up command (:class:`jitattn.cache.MissingKernelError`),
never a silent switch to another backend.
"""

from __future__ import annotations

from typing import Any

from jitattn.backends.base import Backend, DeviceInfo, PagedAttentionFn, cuda_reasons, dtype_reasons
from jitattn.build import ARCHS, archs_for_capability
from jitattn.spec import KV_DTYPES, AttentionSpec


class JitBackend(Backend):
    name = "jit"
    priority = 100
    graph_safe = True
    supports_lse = True
    supports_explicit_positions = True
    description = "jitattn's specialised CUDA kernels (every spec feature; sm_80 and newer)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        out = cuda_reasons(self.name, device)
        if not out and not archs_for_capability(*device.capability):  # type: ignore[misc]
            cap = f"{device.capability[0]}.{device.capability[1]}"  # type: ignore[index]
            out.append(f"{self.name}: no build target runs on compute capability {cap} ({device.name}); "
                       f"jitattn builds {', '.join(ARCHS)}")
        return out + dtype_reasons(self.name, spec, kv=KV_DTYPES)

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        from jitattn.checks import check_scales
        from jitattn.runtime import load_kernel

        kernel = load_kernel(spec, device.torch_device())
        if spec.ragged:
            def jit_ragged_attention(q, k, v, query_start_loc, kv_start_loc, **kwargs: Any):
                return kernel.ragged_attention(q, k, v, query_start_loc, kv_start_loc, **kwargs)

            return jit_ragged_attention

        def jit_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, **kwargs: Any):
            check_scales(spec, kwargs.get("k_scale", 1.0), kwargs.get("v_scale", 1.0))
            return kernel.paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, **kwargs)

        return jit_paged_attention

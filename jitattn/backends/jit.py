"""``jit``: jitattn's own kernels, rendered for the spec, compiled by nvcc, cached, launched through the driver API.

Serves every spec feature (soft-cap, windows, sinks, ALiBi, every variant hook, GQA of any group
size, head dims 8..256 in steps of 8, NHD/HND, any page size, every KV dtype the spec takes, ragged
K/V with head_dim_qk != head_dim_vo, latent MLA decode (16-bit or FP8 caches; latent head dims multiples of 64:
:func:`jitattn.spec.latent_kernel_problem`)) on
CUDA devices whose compute capability runs one of the archs jitattn builds (:func:`jitattn.build.archs_for_capability`:
today 8.0 and newer). Launches are CUDA-graph capturable and return the lse.

Building may compile (seconds per spec) unless the cache is warm. Under ``JITATTN_DISABLE_JIT=1``
the reasons look in the cache: a kernel that no cache layer holds for an arch the device runs is a
reason (with the warm-up command that fills it), so the selector passes jit over up front rather
than choosing it for a first call that would fail; a missing kernel at build time is an error
naming the warm-up command (:class:`jitattn.cache.MissingKernelError`), never a silent switch.
"""

from __future__ import annotations

from typing import Any

from jitattn import settings
from jitattn.archs import ARCHS, archs_for_capability
from jitattn.backends.base import Backend, DeviceInfo, PagedAttentionFn, cuda_reasons, dtype_reasons
from jitattn.spec import KV_DTYPES, AttentionSpec, latent_kernel_problem


class JitBackend(Backend):
    name = "jit"
    priority = 100
    graph_safe = True
    supports_lse = True
    supports_explicit_positions = True
    supports_latent = True  # the MLA decode kernel: its limits are latent_kernel_problem's
    description = "jitattn's specialised CUDA kernels (every spec feature; sm_80 and newer)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        out = cuda_reasons(self.name, device)
        if not out and not archs_for_capability(*device.capability):  # type: ignore[misc]
            cap = f"{device.capability[0]}.{device.capability[1]}"  # type: ignore[index]
            out.append(f"{self.name}: no build target runs on compute capability {cap} ({device.name}); "
                       f"jitattn builds {', '.join(ARCHS)}")
        out += dtype_reasons(self.name, spec, kv=KV_DTYPES)
        problem = latent_kernel_problem(spec)
        if problem:
            out.append(f"{self.name}: {problem}")
        if not out and settings.disable_jit():
            out += self.missing_kernel_reasons(spec, device)
        return out

    def missing_kernel_reasons(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Under ``JITATTN_DISABLE_JIT=1``: a reason when no cache layer holds ``spec``'s kernel for
        an arch ``device`` runs (the build would raise MissingKernelError), naming the command that
        fills it; nothing when one does. Never compiles."""
        from jitattn.cache import KernelCache
        from jitattn.commands import warmup_command

        archs = archs_for_capability(*device.capability)  # type: ignore[misc]
        cache = KernelCache()
        if any(cache.find(spec, arch) is not None for arch in archs):
            return []
        return [f"{self.name}: missing kernel: {spec.name} is not cached for {' or '.join(archs)} "
                f"(looked in {', '.join(map(str, cache.roots))}) and JITATTN_DISABLE_JIT=1 forbids compiling it; "
                f"fill it with: {warmup_command(spec, archs[0])}"]

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

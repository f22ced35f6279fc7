"""``reference``: :func:`jitattn.reference.paged_attention` (ragged specs: ``ragged_attention``), plain torch on any device.

Always serves: every feature (every variant hook, softmax-free variants), every device torch runs
on. It is slow (one sequence at a time, fp32 score matrices, host reads of the metadata), so the
selector takes it last, and it cannot be captured in a CUDA graph. A variant hook given only as a
CUDA string needs its torch version (``reference_transform`` / ``reference_mask``); one without it
is refused here rather than failing at call time.
"""

from __future__ import annotations

from typing import Any

from jitattn.backends.base import Backend, DeviceInfo, PagedAttentionFn
from jitattn.spec import AttentionSpec


def missing_torch_functors(spec: AttentionSpec) -> list[str]:
    """The variant's hooks given only as CUDA strings, without a torch counterpart (``reference_*``).

    Python hooks are their own torch version; a CUDA-string ``logits_transform`` / ``logits_mask``
    needs ``reference_transform`` / ``reference_mask``; other CUDA-string hooks have no torch form.
    """
    v = spec.variant
    if v is None:
        return []
    return [f"{hook} (CUDA only, no torch version)" for hook in v.cuda if v.reference(hook) is None]


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    supports_latent = True
    description = "jitattn.reference in torch eager (any device, every feature, slow)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        missing = missing_torch_functors(spec)
        if missing:
            return [f"{self.name}: variant {spec.variant.name!r} has {' and '.join(missing)}; "  # type: ignore[union-attr]
                    f"torch backends need the functors in torch"]
        return []  # every dtype the spec takes: the reference defines the semantics

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        from jitattn import reference  # torch: loaded here, so the reasons serve a box without it
        from jitattn.backends.common import check_call, check_flags, check_ragged, finish

        if spec.ragged:
            def reference_ragged_attention(q, k, v, query_start_loc, kv_start_loc, *, out=None,
                                           return_lse: bool = False, max_query_len: int | None = None,
                                           validate: bool = True, **kwargs: Any):
                check_flags(return_lse, validate)
                check_ragged(spec, q, k, v, query_start_loc, kv_start_loc, {**kwargs, "out": out})
                res = reference.ragged_attention(spec, q, k, v, query_start_loc, kv_start_loc, return_lse=True,
                                                 **kwargs)
                return finish(res[0], res[1], out, return_lse)

            return reference_ragged_attention

        def reference_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *, out=None,
                                      return_lse: bool = False, max_query_len: int | None = None,
                                      validate: bool = True, **kwargs: Any):
            check_flags(return_lse, validate)
            check_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, {**kwargs, "out": out})
            res = reference.paged_attention(spec, q, kv_cache, block_table, seq_lens, query_start_loc,
                                            return_lse=True, **kwargs)
            return finish(res[0], res[1], out, return_lse)

        return reference_paged_attention

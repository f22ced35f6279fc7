"""``flex``: torch FlexAttention (``torch.nn.attention.flex_attention``) on CUDA devices.

Serves what a ``score_mod`` / ``mask_mod`` pair can express: causal, windows on both sides,
soft-cap, ALiBi, and a variant's ``logits_transform`` / ``logits_mask`` in torch (Python hooks, or
``reference_transform`` / ``reference_mask`` for CUDA strings; under FlexAttention their index
arguments arrive as 0-d tensors, ``batch`` included). Not sinks (FlexAttention's softmax has no
sink term in the denominator), not the query/key/output hooks, not softmax-free variants. Selected on
CUDA only: on the CPU FlexAttention runs unfused without torch.compile (the callable still works
there, which is how the CPU tests check it).

How the paged input is fed: the whole batch is one FlexAttention sequence (B=1). Queries are the
``total_q`` rows as given; keys are every page slot of every block_table row (``batch x
max_pages_per_seq x page_size``, slots past ``seq_lens[b]`` zeroed), and the mask keeps each query
to its own sequence's valid keys. So each call gathers the block table's pages into a contiguous
copy (including the unused tail of each row) and builds a block mask over the
``total_q x batch * max_pages * page_size`` grid; both cost more than the attention itself for
small decode batches. The returned lse is FlexAttention's, natural log.

Any GQA group size (``num_qo_heads // num_kv_heads``) is served. FlexAttention's decode kernel
(inductor's ``flex_decoding``, taken for fewer than 128 query rows, so for most decode batches fed
as above) packs each group into one program and raises for a group that is not a power of two;
torch's dispatch (``_use_flex_decoding``, read in torch 2.13) sends such a group to the main
kernel instead, one program per query head, so none fails there. Torch releases without that
check raised "Number of shared query heads sharing the same KV head must be power of 2" at
compile time (pytorch/pytorch#151359); tests/test_gpu_integrations.py runs such groups on the GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from jitattn.backends.base import (Backend, DeviceInfo, PagedAttentionFn, cuda_reasons, dtype_reasons,
                                   unsupported_reasons)
from jitattn.backends.reference import missing_torch_functors
from jitattn.spec import AttentionSpec
from jitattn.trace import ParamView
from jitattn.variant import structural_mask

if TYPE_CHECKING:  # torch loads in build(): the reasons serve `jitattn select` on a box without torch
    import torch


@functools.lru_cache(maxsize=None)
def flex_import_error() -> str | None:
    """Why ``torch.nn.attention.flex_attention`` cannot be imported (None when it can)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class FlexBackend(Backend):
    name = "flex"
    priority = 60
    description = "torch FlexAttention (windows, soft-cap, ALiBi, torch functors; no sinks)"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        n = self.name
        out = []
        err = flex_import_error()
        if err:
            out.append(f"{n}: torch.nn.attention.flex_attention unavailable ({err}); needs torch >= 2.5")
        out += cuda_reasons(n, device, min_capability=(8, 0))  # what its Triton kernels are tuned and tested for
        out += unsupported_reasons(n, spec, sinks="FlexAttention's softmax has no sink term in the denominator",
                                   ragged="it feeds FlexAttention from the paged cache")
        out += _variant_reasons(n, spec)
        out += _head_dim_reasons(n, spec, device)
        return out + dtype_reasons(n, spec)

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask

        from jitattn.backends.common import check_call, check_flags, finish, query_positions
        from jitattn.dtypes import default_alibi_slopes, torch_dtype

        core = _flex_core(spec)
        if device.type == "cuda":
            # unfused otherwise: a full score matrix per call. dynamic=False: torch 2.11 turned the soft-cap
            # float captured by score_mod into a SymFloat that flex_attention rejects (H200, 2026-11-29).
            core = torch.compile(core, dynamic=False)

        def flex_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *, out=None,
                                 return_lse: bool = False, max_query_len: int | None = None, sinks=None,
                                 alibi_slopes=None, params=None, k_scale: float = 1.0, v_scale: float = 1.0,
                                 validate: bool = False):
            check_flags(return_lse, validate)
            check_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc,
                       {"sinks": sinks, "alibi_slopes": alibi_slopes, "params": params, "out": out,
                        "k_scale": k_scale, "v_scale": v_scale}, values=validate)
            if spec.alibi and alibi_slopes is None:
                alibi_slopes = default_alibi_slopes(spec, q.device)
            total_q = q.shape[0]
            if total_q == 0:
                empty = torch.empty(0, spec.num_qo_heads, dtype=torch.float32, device=q.device)
                return finish(q.new_empty(0, spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype)),
                              empty, out, return_lse)
            k, v, kv_seq, kv_pos, valid = _dense_kv(spec, kv_cache, block_table, seq_lens)
            q_seq, q_pos = query_positions(seq_lens, query_start_loc, total_q)
            mask_mod = _mask_mod(spec, q_seq, q_pos, kv_seq, kv_pos, valid, dict(params or {}))
            block_mask = create_block_mask(mask_mod, 1, None, total_q, k.shape[2], device=q.device)
            o, lse = core(q.transpose(0, 1)[None], k, v, block_mask, q_seq, q_pos, kv_seq, kv_pos, valid,
                          alibi_slopes, ParamView(dict(params or {})))
            result = o[0].transpose(0, 1).to(torch_dtype(spec.o_dtype)).contiguous()  # (total_q, H, D)
            return finish(result, lse[0].transpose(0, 1).float().contiguous(), out, return_lse)

        return flex_paged_attention


#: The smallest head dim torch inductor's CUDA FlexAttention lowering compiles (tl.dot needs K >= 16);
#: other dims are padded to the next power of two in the kernel.
FLEX_CUDA_HEAD_DIM_MIN = 16


def _head_dim_reasons(n: str, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
    """Head dims the compiled (CUDA) FlexAttention kernel refuses: inductor raises NotImplementedError below 16."""
    if device.type != "cuda":
        return []
    return [f"{n}: {name}={value} not supported (torch's compiled FlexAttention needs head dims >= "
            f"{FLEX_CUDA_HEAD_DIM_MIN})" for name in ("head_dim_qk", "head_dim_vo")
            if (value := getattr(spec, name)) < FLEX_CUDA_HEAD_DIM_MIN]


def _variant_reasons(n: str, spec: AttentionSpec) -> list[str]:
    """FlexAttention takes a score_mod and a mask_mod, written in torch, inside a softmax."""
    v = spec.variant
    if v is None:
        return []
    out = []
    vector_hooks = [h for h in ("query_transform", "key_transform", "output_transform") if h in v.cuda]
    if vector_hooks:
        out.append(f"{n}: variant {v.name!r} has {', '.join(vector_hooks)} (FlexAttention has only score_mod "
                   f"and mask_mod)")
    if not v.softmax:
        out.append(f"{n}: variant {v.name!r} has softmax=False (FlexAttention always normalises with a softmax)")
    missing = [m for m in missing_torch_functors(spec) if m.startswith(("logits_transform", "logits_mask"))]
    if missing:
        out.append(f"{n}: variant {v.name!r} has {' and '.join(missing)}; FlexAttention needs the functors in torch")
    return out


def _dense_kv(spec: AttentionSpec, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """Every block_table slot's K and V as one sequence ``(1, H_kv, batch*max_pages*page_size, D)``, with each
    slot's sequence, position and validity (``position < seq_lens[seq]``; invalid slots zeroed)."""
    import torch

    batch, max_pages = block_table.shape
    from jitattn.checks import kv_num_pages
    from jitattn.reference import kv_pages

    ids = block_table.long().clamp(0, kv_num_pages(kv_cache) - 1)  # unused entries may hold anything
    pages = kv_pages(kv_cache, ids)  # (B, M, 2, P, H, D) or (B, M, 2, H, P, D)
    if spec.kv_layout == "HND":
        pages = pages.transpose(3, 4)
    slots = max_pages * spec.page_size
    k = pages[:, :, 0].reshape(batch * slots, spec.num_kv_heads, spec.head_dim_qk)
    v = pages[:, :, 1].reshape(batch * slots, spec.num_kv_heads, spec.head_dim_vo)
    kv_seq = torch.arange(batch, device=pages.device).repeat_interleave(slots)
    kv_pos = torch.arange(slots, device=pages.device).repeat(batch)
    valid = kv_pos < seq_lens.long()[kv_seq]
    k = torch.where(valid[:, None, None], k, 0)  # unused slots may hold NaN; 0 * NaN would leak
    v = torch.where(valid[:, None, None], v, 0)
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None], kv_seq, kv_pos, valid


def _mask_mod(spec: AttentionSpec, q_seq, q_pos, kv_seq, kv_pos, valid, params: dict[str, Any]):
    """Visibility: same sequence, a valid slot, causal/window bounds, then the variant's torch mask."""
    import torch

    user_mask = spec.variant.reference("logits_mask") if spec.variant is not None else None
    bounds = structural_mask(spec.causal, spec.window_left, spec.window_right)
    view = ParamView(params)

    def mask_mod(b, h, qi, ki):
        ok = (q_seq[qi] == kv_seq[ki]) & valid[ki]
        if bounds is not None:
            ok = ok & bounds(q_seq[qi], h, q_pos[qi], kv_pos[ki], view)
        if user_mask is not None:  # evaluated for every pair: keep its indices inside the query's sequence
            kv = torch.where(ok, kv_pos[ki], 0)
            ok = ok & user_mask(q_seq[qi], h, q_pos[qi], kv, view).to(torch.bool)
        return ok

    return mask_mod


def _flex_core(spec: AttentionSpec):
    """FlexAttention with the spec's score_mod (soft-cap, ALiBi, variant transform, in the reference's order)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    transform = spec.variant.reference("logits_transform") if spec.variant is not None else None
    cap = spec.logits_soft_cap

    def core(q, k, v, block_mask, q_seq, q_pos, kv_seq, kv_pos, valid, slopes, view):
        def score_mod(score, b, h, qi, ki):
            if cap > 0:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score + slopes[h] * (kv_pos[ki] - q_pos[qi]).to(score.dtype)
            if transform is not None:  # also evaluated on hidden pairs: keep kv_idx inside the query's sequence
                kv = torch.where((kv_seq[ki] == q_seq[qi]) & valid[ki], kv_pos[ki], 0)
                score = transform(score, q_seq[qi], h, q_pos[qi], kv, view).to(score.dtype)
            return score

        needs_mod = cap > 0 or slopes is not None or transform is not None
        return _flex_with_lse(flex_attention, q, k, v, score_mod if needs_mod else None, block_mask, spec.sm_scale)

    return core


def _flex_with_lse(flex_attention, q, k, v, score_mod, block_mask, scale):
    """``(out, lse)`` through ``return_aux`` (torch >= 2.9) or the older ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True,
                              return_lse=True)
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse

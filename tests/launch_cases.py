"""Batches whose kernel launches tests/test_plan_launches.py compares with the golden record.

Each case builds its tensors deterministically on the CPU from the spec and the lengths alone (their
values do not matter: only shapes, strides and the metadata reach the launches). The same module feeds
tests/golden/make_launch_golden.py, which records the launches of the one-call path as it was before
plan/run, and the test, which records those of today's code: both sides see the very same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable

import torch

from jitattn.spec import AttentionSpec
from jitattn.variant import document_mask, sigmoid_attention

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass
class Case:
    """One call: ``tensors`` by argument name (positional ones and the optional tensor arguments),
    the variant's ``params`` and the other keyword arguments."""

    spec: AttentionSpec
    kind: str                      # "paged" or "ragged"
    tensors: dict[str, torch.Tensor]
    kwargs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def positional(self) -> tuple[str, ...]:
        return ("q", "kv_cache", "block_table", "seq_lens", "query_start_loc") if self.kind == "paged" else \
            ("q", "k", "v", "query_start_loc", "kv_start_loc")

    def call(self, fn: Callable[..., Any]) -> Any:
        """``fn(*positional, **optional tensors, params=..., **kwargs)``, the one-call signature."""
        extra = {k: v for k, v in self.tensors.items() if k not in self.positional}
        params = {"params": dict(self.params)} if self.params else {}
        return fn(*(self.tensors[n] for n in self.positional), **extra, **params, **self.kwargs)


def _paged(spec: AttentionSpec, q_lens: list[int], kv_lens: list[int], *, pages_per_seq: int | None = None,
           q_row_stride: int | None = None, page_stride: int = 1) -> dict[str, torch.Tensor]:
    """q, kv_cache, block_table, seq_lens, query_start_loc; pages handed out in order, 3 spare."""
    page = spec.page_size
    need = [-(-n // page) for n in kv_lens]
    width = max(pages_per_seq or 0, max(need), 1)
    num_pages = sum(need) + 3
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    total_q, h, d = sum(q_lens), spec.num_qo_heads, spec.head_dim_qk
    dt = _DTYPES[spec.q_dtype]
    if q_row_stride is None:
        q = torch.zeros(total_q, h, d, dtype=dt)
    else:  # rows of a wider projection output (a fused QKV)
        q = torch.zeros(total_q, q_row_stride, dtype=dt)[:, : h * d].view(total_q, h, d)
    inner = (2, page, spec.num_kv_heads, d) if spec.kv_layout == "NHD" else (2, spec.num_kv_heads, page, d)
    kv = torch.zeros(num_pages * page_stride, *inner, dtype=torch.float16).to(_DTYPES[spec.kv_dtype])
    kv = kv[::page_stride]  # page_stride > 1: pages of a larger pool, strided
    return {"q": q, "kv_cache": kv, "block_table": table, "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32)}


def _ragged(spec: AttentionSpec, q_lens: list[int], kv_lens: list[int]) -> dict[str, torch.Tensor]:
    dt = _DTYPES[spec.q_dtype]
    return {"q": torch.zeros(sum(q_lens), spec.num_qo_heads, spec.head_dim_qk, dtype=dt),
            "k": torch.zeros(sum(kv_lens), spec.num_kv_heads, spec.head_dim_qk, dtype=dt),
            "v": torch.zeros(sum(kv_lens), spec.num_kv_heads, spec.head_dim_vo, dtype=dt),
            "query_start_loc": torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32),
            "kv_start_loc": torch.tensor([0, *accumulate(kv_lens)], dtype=torch.int32)}


def cases() -> dict[str, Case]:
    """Every case by name (fresh tensors on each call)."""
    base = AttentionSpec(32, 8, 128)
    small = AttentionSpec(8, 2, 64)
    out: dict[str, Case] = {}
    out["decode_probe"] = Case(base, "paged", _paged(base, [1], [512]))
    out["decode_batch_hint"] = Case(base, "paged", _paged(base, [1] * 4, [30, 100, 7, 64]),
                                    {"max_query_len": 1})
    out["decode_batch_lse"] = Case(base, "paged", _paged(base, [1] * 3, [30, 100, 7]), {"return_lse": True})
    alibi = AttentionSpec(8, 2, 64, alibi=True)
    out["mixed_alibi_default"] = Case(alibi, "paged", _paged(alibi, [1, 5, 1], [30, 40, 17]), {"return_lse": True})
    mixed_out = _paged(small, [1, 5, 1], [30, 40, 17])
    mixed_out["out"] = torch.zeros(7, 8, 64, dtype=torch.bfloat16)
    out["mixed_out_hint"] = Case(small, "paged", mixed_out, {"max_query_len": 5})
    out["prefill_only"] = Case(small, "paged", _paged(small, [4, 6], [10, 20]))
    out["split_kv_decode"] = Case(base, "paged", _paged(base, [1, 1], [8000, 20000], pages_per_seq=1280),
                                  {"max_query_len": 1})
    out["split_kv_mixed"] = Case(base, "paged", _paged(base, [1, 7, 1], [4000, 4000, 100], pages_per_seq=512),
                                 {"return_lse": True})
    sliding = AttentionSpec(16, 8, 256, window_left=4095, logits_soft_cap=50.0, q_dtype="float16")
    out["sliding_window"] = Case(sliding, "paged", _paged(sliding, [1, 1, 1], [9000, 100, 5000], pages_per_seq=600))
    hnd = AttentionSpec(8, 2, 128, kv_layout="HND", page_size=32, causal=False)
    out["hnd_strided"] = Case(hnd, "paged", _paged(hnd, [1, 3], [70, 90], q_row_stride=3 * 8 * 128, page_stride=2))
    fp8 = AttentionSpec(8, 2, 128, kv_dtype="float8_e4m3fn")
    out["fp8_scales"] = Case(fp8, "paged", _paged(fp8, [1, 3], [40, 64]), {"k_scale": 0.5, "v_scale": 2.0})
    sinks = AttentionSpec(64, 8, 64, sinks=True, window_left=127)
    t = _paged(sinks, [1, 4, 1], [300, 20, 129], pages_per_seq=64)
    t["sinks"] = torch.zeros(64, dtype=torch.float32)
    out["sinks_window"] = Case(sinks, "paged", t)
    t = _paged(alibi, [2, 1], [9, 33])
    t["alibi_slopes"] = torch.ones(8, dtype=torch.float32)
    out["alibi_given"] = Case(alibi, "paged", t, {"return_lse": True})
    doc = AttentionSpec(8, 2, 64, variant=document_mask())
    t = _paged(doc, [1, 6], [50, 60])
    out["params"] = Case(doc, "paged", t, params={"doc": torch.zeros(2 * 64, dtype=torch.int32), "doc_stride": 64})
    explicit = AttentionSpec(8, 2, 64, query_positions="explicit")
    t = _paged(explicit, [2, 3, 1], [20, 30, 40])
    t.update(query_positions=torch.arange(6, dtype=torch.int32), functor_batch=torch.tensor([0, 0, 1, 1, 1, 2],
             dtype=torch.int32), position_offset=torch.tensor([0, 5, 9], dtype=torch.int32))
    out["explicit_positions"] = Case(explicit, "paged", t, {"return_lse": True})
    out["empty"] = Case(small, "paged", _paged(small, [0, 0], [5, 9]))
    ragged = AttentionSpec(8, 2, 64, head_dim_vo=32, kv_storage="ragged")
    out["ragged"] = Case(ragged, "ragged", _ragged(ragged, [1, 9], [20, 37]), {"return_lse": True})
    sig = AttentionSpec(8, 2, 64, kv_storage="ragged", variant=sigmoid_attention(), causal=False)
    out["ragged_params"] = Case(sig, "ragged", _ragged(sig, [3, 4, 1], [3, 40, 2]), params={"bias": -2.0})
    ragged_sinks = AttentionSpec(8, 4, 128, kv_storage="ragged", sinks=True)
    t = _ragged(ragged_sinks, [5], [5])
    t["sinks"] = torch.zeros(8, dtype=torch.float32)
    out["ragged_sinks"] = Case(ragged_sinks, "ragged", t)
    return out


#: The geometry of the fake module both sides launch from (values chosen distinct, so a swapped field shows).
GEOMETRY = {"decode_threads": 128, "decode_smem": 4096, "decode_tile_keys": 64, "prefill_threads": 384,
            "prefill_smem": 73728, "prefill_block_m": 128, "prefill_block_n": 64}
NUM_SMS, DECODE_BLOCKS_PER_SM = 132, 2
STREAM = 7  # the raw handle of the caller's (fake) stream


def pointer_names(case: Case, result: Any, extra: dict[str, torch.Tensor]) -> dict[int, str]:
    """data_ptr -> name for every tensor a pointer field may hold: the case's, the results, ``extra``."""
    names = {t.data_ptr(): n for n, t in case.tensors.items()}
    names.update({t.data_ptr(): f"params[{n}]" for n, t in case.params.items() if isinstance(t, torch.Tensor)})
    res = result if isinstance(result, tuple) else (result,)
    names[res[0].data_ptr()] = "out"
    if len(res) > 1:
        names[res[1].data_ptr()] = "lse"
    names.update({t.data_ptr(): n for n, t in extra.items() if t is not None})
    return names


def symbolic(fields: dict[str, Any], ptr_fields: set[str], names: dict[int, str]) -> dict[str, Any]:
    """``fields`` with each non-null pointer replaced by the name of its tensor ("scratch" if none)."""
    return {k: (names.get(v, "scratch") if k in ptr_fields and v else v) for k, v in fields.items()}

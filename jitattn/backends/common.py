"""Helpers the torch-level backends (reference, sdpa, flex) share: output handling and metadata."""

from __future__ import annotations

from typing import Any

import torch

from jitattn.checks import (check_flag, check_metadata_values, check_paged_call, check_ragged_call,
                            check_ragged_metadata_values, check_scales)
from jitattn.dtypes import torch_dtype
from jitattn.spec import AttentionSpec


def new_out(spec: AttentionSpec, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` if given, else a zeroed ``(total_q, num_qo_heads, head_dim_vo)`` tensor in ``spec.o_dtype``."""
    if out is not None:
        return out
    return torch.zeros(q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                       device=q.device)


def check_flags(return_lse: Any, validate: Any) -> None:
    """A backend callable's two boolean options, refused before any work unless True or False
    (:func:`jitattn.checks.check_flag`, as the jit kernel does).

    Raises:
        ValueError: naming the argument and the value.
    """
    check_flag("return_lse", return_lse)
    check_flag("validate", validate)


def finish(result: torch.Tensor, lse: torch.Tensor | None, out: torch.Tensor | None,
           return_lse: bool) -> Any:
    """Copy ``result`` into ``out`` when the caller gave one; return ``out`` (and lse) per the contract
    (``return_lse`` was checked up front by :func:`check_flags`)."""
    if out is not None and out is not result:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


# The keyword arguments of the paged / ragged attention call (besides out, return_lse, max_query_len,
# validate, which every backend callable names itself): jitattn.reference.paged_attention's.
CALL_KEYWORDS = ("sinks", "alibi_slopes", "params", "k_scale", "v_scale")


def check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword the attention call does not take (a misspelled ``sink=`` is never ignored).

    Raises:
        TypeError: names the keyword and the ones allowed.
    """
    unknown = sorted(set(kwargs) - set(CALL_KEYWORDS) - {"out"})
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; the attention call takes "
                        f"{', '.join(CALL_KEYWORDS)}, out, return_lse, max_query_len, validate")


def check_call(spec: AttentionSpec, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, kwargs: dict[str, Any], *,
               values: bool = False) -> None:
    """The shared call-time checks (:func:`jitattn.checks.check_paged_call`), host-only, no sync.

    ``values=True`` also checks the metadata values (:func:`jitattn.checks.check_metadata_values`:
    query_start_loc bounds and order, seq_lens against the block table, page ids in range), a device
    sync: backends that read the metadata on the host anyway always pass it, the others on ``validate=True``.
    """
    check_keywords(kwargs)
    call = check_paged_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, sinks=kwargs.get("sinks"),
                            alibi_slopes=kwargs.get("alibi_slopes"), params=kwargs.get("params"),
                            out=kwargs.get("out"))
    check_scales(spec, kwargs.get("k_scale", 1.0), kwargs.get("v_scale", 1.0))
    if values:
        check_metadata_values(spec, seq_lens, query_start_loc, block_table, call.num_pages, call.total_q)


def check_ragged(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 query_start_loc: torch.Tensor, kv_start_loc: torch.Tensor, kwargs: dict[str, Any], *,
                 values: bool = False) -> None:
    """The shared checks of a ragged call (:func:`jitattn.checks.check_ragged_call`), host-only, no sync;
    ``values=True`` adds :func:`jitattn.checks.check_ragged_metadata_values` (a device sync)."""
    check_keywords(kwargs)
    call = check_ragged_call(spec, q, k, v, query_start_loc, kv_start_loc, sinks=kwargs.get("sinks"),
                             alibi_slopes=kwargs.get("alibi_slopes"), params=kwargs.get("params"),
                             out=kwargs.get("out"))
    if values:
        check_ragged_metadata_values(query_start_loc, kv_start_loc, call.total_q, call.total_kv)


def query_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, total_q: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its sequence index and its position, int64 ``(total_q,)`` each, on the device.

    Sequence ``b``'s queries sit at positions ``seq_lens[b] - qo_len ... seq_lens[b] - 1``.
    """
    rows = torch.arange(total_q, device=query_start_loc.device)
    seq = torch.searchsorted(query_start_loc[1:].long(), rows, right=True)  # (total_q,)
    start = query_start_loc.long()[seq]
    qo_len = query_start_loc.long()[seq + 1] - start
    pos = seq_lens.long()[seq] - qo_len + (rows - start)
    return seq, pos

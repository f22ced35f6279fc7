"""Independent oracles of the ready-made variants (jitattn.variant), in plain torch.

The variant library's Python functions are both the kernels' source (traced into CUDA) and the
reference's semantics, so the reference cannot catch a bug in them. These oracles are written again
from each variant's definition (the paper or the docstring), with Python loops over query rows and
explicit index arithmetic, never calling jitattn.variant or jitattn.reference: the KV gather walks the
block table itself, the T5 bucket is the formula of Raffel et al. 2020 on Python ints, RoPE rotates
pairs (i, i + D/2) by explicit indices. tests/test_variant_oracles.py compares them with the reference
on the CPU, tests/test_gpu_variant_oracles.py with the kernels.

Every oracle computes in float64 and returns float64 tensors; the positions are the implicit ones
(sequence ``b``'s queries are its last ``q_len`` keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# ---- the variants' own definitions, one (query, key) pair or one sequence at a time ---------------


def t5_bucket(relative: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's relative-position bucket of ``relative = qo_pos - kv_pos`` (Raffel et al. 2020, section 2.1,
    the bucketing of Mesh TensorFlow's ``_relative_position_bucket``).

    Causal (unidirectional): a key after the query (``relative < 0``) shares bucket 0 with distance 0.
    Bidirectional: half the buckets for keys before the query, the other half (offset by
    ``num_buckets / 2``) for keys after it. Within a half of ``B`` buckets, distances below ``B / 2`` get
    a bucket each; larger ones share buckets whose width grows logarithmically up to ``max_distance``;
    everything beyond lands in the last bucket (``B - 1``).
    """
    buckets, offset, distance = num_buckets, 0, relative
    if bidirectional:
        buckets = num_buckets // 2
        if relative < 0:
            offset = buckets
        distance = abs(relative)
    elif distance < 0:
        distance = 0
    exact = buckets // 2
    if distance < exact:
        return offset + distance
    # log-spaced: distance exact maps to bucket exact, distance max_distance to bucket buckets
    large = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (buckets - exact))
    return offset + min(large, buckets - 1)


def document_mask_rows(doc: torch.Tensor, doc_stride: int, b: int, qo_pos: list[int], kv_len: int) -> torch.Tensor:
    """bool ``(len(qo_pos), kv_len)``: query at position p sees key j iff both are in the same document;
    sequence ``b``'s ids are ``doc[b * doc_stride : (b + 1) * doc_stride]`` (one per position)."""
    ids = doc.cpu().tolist()
    seq = ids[b * doc_stride:(b + 1) * doc_stride]
    return torch.tensor([[seq[p] == seq[j] for j in range(kv_len)] for p in qo_pos],
                        dtype=torch.bool).reshape(len(qo_pos), kv_len)


def prefix_lm_rows(prefix_len: int, qo_pos: list[int], kv_len: int) -> torch.Tensor:
    """bool ``(len(qo_pos), kv_len)``: every key of the prefix (``j < prefix_len``) is visible, and after
    it the keys up to the query (causal); Raffel et al. 2020, section 3.2.1."""
    return torch.tensor([[j < prefix_len or j <= p for j in range(kv_len)] for p in qo_pos],
                        dtype=torch.bool).reshape(len(qo_pos), kv_len)


def t5_bias_rows(table: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool,
                 qo_pos: list[int], kv_len: int) -> torch.Tensor:
    """float64 ``(num_qo_heads, len(qo_pos), kv_len)``: ``table[bucket(p - j), h]`` for every pair."""
    buckets = torch.tensor([[t5_bucket(p - j, num_buckets, max_distance, bidirectional) for j in range(kv_len)]
                            for p in qo_pos], dtype=torch.long).reshape(len(qo_pos), kv_len)
    return table.double().cpu()[buckets].permute(2, 0, 1)  # (rows, kv_len, H) -> (H, rows, kv_len)


def rope_rotate(x: torch.Tensor, positions: list[int], theta: float = 10000.0) -> torch.Tensor:
    """RoPE (Su et al. 2021, section 3.4) in the rotate-half pairing of GPT-NeoX / Llama: element ``i`` and
    ``i + D/2`` of the vector at position ``p`` are rotated by the angle ``p * theta ** (-2 i / D)``.

    ``x`` ``(len(positions), heads, D)``; returns float64 of the same shape."""
    x = x.double().cpu()
    out = torch.empty_like(x)
    d = x.shape[-1]
    half = d // 2
    for i in range(half):
        angle = torch.tensor([p * theta ** (-2.0 * i / d) for p in positions], dtype=torch.float64)[:, None]
        c, s = angle.cos(), angle.sin()  # (len, 1): one angle per position, every head alike
        a, b = x[:, :, i], x[:, :, i + half]
        out[:, :, i] = a * c - b * s
        out[:, :, i + half] = b * c + a * s
    return out


# ---- attention over one batch, with a variant's pieces plugged in --------------------------------
@dataclass
class Pieces:
    """What a variant changes, as callables of the sequence index ``b``, its query positions and its
    key count (every one optional): ``mask`` bool ``(rows, kv_len)``, ``bias`` float64
    ``(H, rows, kv_len)`` added to the scaled logits, ``sigmoid_bias`` (a float: weights
    ``sigmoid(s + bias)`` instead of softmax), ``rope_theta`` (rotate q and k)."""

    mask: Callable[[int, list[int], int], torch.Tensor] | None = None
    bias: Callable[[int, list[int], int], torch.Tensor] | None = None
    sigmoid_bias: float | None = None
    rope_theta: float | None = None


def gather_sequence(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, kv_len: int, page_size: int,
                    layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s K and V, ``(kv_len, H_kv, D)`` float64 each, token by token through the block table."""
    cache = kv_cache.cpu()
    table = block_table.cpu().tolist()
    ks, vs = [], []
    for t in range(kv_len):
        page, slot = table[b][t // page_size], t % page_size
        row = cache[page, :, slot] if layout == "NHD" else cache[page, :, :, slot]  # (2, H_kv, D)
        ks.append(row[0].float().double())  # through float32: FP8 converts to it
        vs.append(row[1].float().double())
    return torch.stack(ks), torch.stack(vs)


def structural_rows(qo_pos: list[int], kv_len: int, causal: bool, window_left: int, window_right: int
                    ) -> torch.Tensor:
    """bool ``(rows, kv_len)``: key j visible from position p when j <= p (causal), p - j <= window_left
    and j - p <= window_right (each where set, i.e. >= 0)."""
    return torch.tensor([[(not causal or j <= p) and (window_left < 0 or p - j <= window_left)
                          and (window_right < 0 or j - p <= window_right) for j in range(kv_len)]
                         for p in qo_pos], dtype=torch.bool).reshape(len(qo_pos), kv_len)


def attention(spec, batch, pieces: Pieces) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's attention with the variant's pieces: ``out`` float64 ``(total_q, H, head_dim_vo)`` and
    (softmax) the natural-log ``lse`` float64 ``(total_q, H)``, on the CPU; a row that sees no key is 0
    with lse ``-inf``. ``spec``: an AttentionSpec (heads, scale, causal, windows, page size, layout);
    ``batch``: a jitattn.testing.PagedBatch; an FP8 cache is dequantised with the batch's ``k_scale`` /
    ``v_scale``, a soft-cap is ``cap * tanh(s / cap)`` before the pieces' bias (no sinks or ALiBi)."""
    if spec.sinks or spec.alibi:
        raise ValueError("oracles.attention: sinks and ALiBi are not modelled here (tests/test_reference.py has them)")
    h, group = spec.num_qo_heads, spec.num_qo_heads // spec.num_kv_heads
    q_all = batch.q.double().cpu()
    kv_cache, block_table = batch.kv_cache.cpu(), batch.block_table.cpu()  # once: a device cache is copied
    out = torch.zeros(q_all.shape[0], h, spec.head_dim_vo, dtype=torch.float64)
    lse = torch.full((q_all.shape[0], h), float("-inf"), dtype=torch.float64)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        rows = slice(start, start + q_len)
        start += q_len
        if q_len == 0:
            continue
        qo_pos = list(range(kv_len - q_len, kv_len))
        k, v = gather_sequence(kv_cache, block_table, b, kv_len, spec.page_size, spec.kv_layout)
        k, v = k * batch.scales.get("k_scale", 1.0), v * batch.scales.get("v_scale", 1.0)
        q = q_all[rows]
        if pieces.rope_theta is not None:
            q, k = rope_rotate(q, qo_pos, pieces.rope_theta), rope_rotate(k, list(range(kv_len)), pieces.rope_theta)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # query head i reads i // group
        s = torch.einsum("qhd,khd->hqk", q, k) * spec.sm_scale  # (H, rows, kv_len)
        if spec.logits_soft_cap > 0:
            s = spec.logits_soft_cap * torch.tanh(s / spec.logits_soft_cap)
        if pieces.bias is not None:
            s = s + pieces.bias(b, qo_pos, kv_len)
        allowed = structural_rows(qo_pos, kv_len, spec.causal, spec.window_left, spec.window_right)
        if pieces.mask is not None:
            allowed = allowed & pieces.mask(b, qo_pos, kv_len)
        allowed = allowed[None].expand_as(s)
        if pieces.sigmoid_bias is not None:
            w = torch.where(allowed, torch.sigmoid(s + pieces.sigmoid_bias), torch.zeros_like(s))
            out[rows] = torch.einsum("hqk,khd->qhd", w, v)
            continue
        s = s.masked_fill(~allowed, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))  # hidden keys: exp(-inf) = 0
        denom = p.sum(-1)  # (H, rows)
        out[rows] = torch.einsum("hqk,khd->qhd", p, v) / torch.where(denom > 0, denom, 1.0).T[..., None]
        lse[rows] = torch.where(denom > 0, denom.log() + m[..., 0], float("-inf")).T
    return out, (None if pieces.sigmoid_bias is not None else lse)


# ---- the pieces of each ready-made variant, from the parameters a call passes ---------------------
def document_pieces(params: dict) -> Pieces:
    doc, stride = params["doc"], int(params["doc_stride"])
    return Pieces(mask=lambda b, qo_pos, kv_len: document_mask_rows(doc, stride, b, qo_pos, kv_len))


def prefix_lm_pieces(params: dict) -> Pieces:
    prefix = params["prefix_len"].cpu().tolist()
    return Pieces(mask=lambda b, qo_pos, kv_len: prefix_lm_rows(prefix[b], qo_pos, kv_len))


def t5_pieces(params: dict, num_buckets: int, max_distance: int, bidirectional: bool) -> Pieces:
    table = params["table"]
    return Pieces(bias=lambda b, qo_pos, kv_len: t5_bias_rows(table, num_buckets, max_distance, bidirectional,
                                                              qo_pos, kv_len))


def sigmoid_pieces(params: dict) -> Pieces:
    return Pieces(sigmoid_bias=float(params["bias"]))


def rope_pieces(theta: float = 10000.0) -> Pieces:
    return Pieces(rope_theta=theta)


# ---- the cases both tests run ---------------------------------------------------------------------
@dataclass
class OracleCase:
    """A spec with one ready-made variant, a batch shape, the call's parameters (``params(device, seed)``)
    and the oracle's pieces for them (``pieces(params)``)."""

    name: str
    spec: object
    q_lens: list[int]
    kv_lens: list[int]
    params: Callable[[str, int], dict]
    pieces: Callable[[dict], Pieces]


def _document_ids(kv_lens: list[int], stride: int, seed: int, rate: float) -> torch.Tensor:
    """int32 ``(batch * stride,)``: each sequence's own run of document ids (a new document starts at a
    position with probability ``rate``), so that reading another sequence's ids changes the mask."""
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(len(kv_lens) * stride, generator=g) < rate).int()
    return torch.cumsum(starts, 0).to(torch.int32)


def oracle_cases(q_lens: list[int], kv_lens: list[int], head_dim: int = 64) -> list[OracleCase]:
    """Every ready-made variant, on a batch of ``q_lens[b]`` queries against ``kv_lens[b]`` keys:
    causal and not, GQA groups 1 and 4, T5 buckets of two sizes and both directions (lengths past
    ``max_distance`` reach the log buckets and the last one), RoPE at two thetas."""
    from jitattn import AttentionSpec
    from jitattn.variant import (document_mask, prefix_lm_mask, relative_position_bias, rotary_embedding,
                                 sigmoid_attention)

    stride = max(kv_lens) + 3  # not the longest sequence: a stride read as a length shows

    def spec(variant, causal=True, heads=(8, 2), **kw):
        return AttentionSpec(heads[0], heads[1], head_dim, causal=causal, variant=variant, **kw)

    def doc_params(rate):
        return lambda device, seed: {"doc": _document_ids(kv_lens, stride, seed, rate).to(device),
                                     "doc_stride": stride}

    def prefix_params(device, seed):  # 0, inside the queries' span, past it and the whole sequence
        values = [[0, max(1, n // 3), n - 1, n][(b + seed) % 4] for b, n in enumerate(kv_lens)]
        return {"prefix_len": torch.tensor(values, dtype=torch.int32, device=device)}

    def table_params(buckets, heads=8):
        def make(device, seed):
            return {"table": torch.randn(buckets, heads, generator=torch.Generator().manual_seed(seed)).to(device)}
        return make

    cases = [
        OracleCase("document-causal", spec(document_mask()), q_lens, kv_lens, doc_params(0.05), document_pieces),
        OracleCase("document-noncausal-gqa1", spec(document_mask(), causal=False, heads=(4, 4)), q_lens, kv_lens,
                   doc_params(0.02), document_pieces),
        OracleCase("prefix-lm", spec(prefix_lm_mask(), causal=False), q_lens, kv_lens, prefix_params,
                   prefix_lm_pieces),
        OracleCase("sigmoid-causal", spec(sigmoid_attention()), q_lens, kv_lens,
                   lambda device, seed: {"bias": -2.5}, sigmoid_pieces),
        OracleCase("sigmoid-noncausal-window", spec(sigmoid_attention(), causal=False, window_left=50,
                                                    window_right=9), q_lens, kv_lens,
                   lambda device, seed: {"bias": -4.0}, sigmoid_pieces),
        OracleCase("rope-10000", spec(rotary_embedding(head_dim)), q_lens, kv_lens,
                   lambda device, seed: {}, lambda p: rope_pieces(10000.0)),
        OracleCase("rope-500000-gqa1", spec(rotary_embedding(head_dim, 500000.0), heads=(4, 4)), q_lens, kv_lens,
                   lambda device, seed: {}, lambda p: rope_pieces(500000.0)),
    ]
    for buckets, distance, bidirectional in ((32, 128, True), (32, 128, False), (16, 40, True), (20, 64, False)):
        cases.append(OracleCase(
            f"t5-{buckets}-{distance}-{'bi' if bidirectional else 'uni'}",
            spec(relative_position_bias(buckets, distance, bidirectional), causal=not bidirectional),
            q_lens, kv_lens, table_params(buckets),
            lambda p, n=buckets, d=distance, bi=bidirectional: t5_pieces(p, n, d, bi)))
    return cases

"""The reference (jitattn.reference.paged_attention), the oracle of every kernel test, checked against
torch SDPA and against computations written out by hand, over paged inputs.

The tests read K/V out of the paged cache token by token (:func:`dense_kv`), independently of the
reference's page-wise gather, and compute in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from jitattn import AttentionSpec, Variant, reference
from jitattn.testing import make_paged_kv, random_paged_batch, relative_error, visible_keys, visible_pairs
from tests.gpu_cases import DOC_MASK, HIDE_HEAD, REL_BIAS

TOL = {"float16": 2e-3, "bfloat16": 1.2e-2}  # output rounding to the spec's dtype, norm-wise


def dense_kv(spec: AttentionSpec, kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, kv_len: int):
    """Sequence ``b``'s K and V, ``(kv_len, num_kv_heads, head_dim)`` each, read one token at a time."""
    cache = kv_cache if spec.kv_layout == "NHD" else kv_cache.transpose(2, 3)  # (pages, 2, P, H, D)
    tok = torch.arange(kv_len)
    pages = block_table[b, tok // spec.page_size].long()
    slots = tok % spec.page_size
    return cache[pages, 0, slots], cache[pages, 1, slots]


def per_sequence(batch):
    """Yield (b, rows slice, q (Lq, Hq, D), k, v (L, Hq, D) float64 with GQA expanded, qo_pos, kv_pos)."""
    spec = batch.spec
    qsl = batch.query_start_loc.tolist()
    for b, kv_len in enumerate(batch.kv_lens):
        r0, r1 = qsl[b], qsl[b + 1]
        if r0 == r1:
            continue
        k, v = dense_kv(spec, batch.kv_cache, batch.block_table, b, kv_len)
        k = k.double().repeat_interleave(spec.group_size, dim=1)
        v = v.double().repeat_interleave(spec.group_size, dim=1)
        qo_pos = torch.arange(kv_len - (r1 - r0), kv_len)
        yield b, slice(r0, r1), batch.q[r0:r1].double(), k, v, qo_pos, torch.arange(kv_len)


def manual(batch, *, allowed=None, bias=None, transform=None, sinks=None):
    """Attention written out: logits, transform, bias, mask, softmax (with a sink logit), weighted V.

    ``allowed(b, qo_pos, kv_pos)`` -> bool (Lq, L) or (H, Lq, L); ``bias(b, qo_pos, kv_pos)`` -> (H, Lq, L).
    Returns float64 out (total_q, H, D) and lse (total_q, H).
    """
    spec = batch.spec
    out = torch.zeros(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch.float64)
    lse = torch.full((batch.q.shape[0], spec.num_qo_heads), -math.inf, dtype=torch.float64)
    for b, rows, q, k, v, qo_pos, kv_pos in per_sequence(batch):
        s = torch.einsum("qhd,khd->hqk", q, k) * spec.sm_scale
        if transform is not None:
            s = transform(s)
        if bias is not None:
            s = s + bias(b, qo_pos, kv_pos)
        if allowed is not None:
            s = s.masked_fill(~allowed(b, qo_pos, kv_pos).expand_as(s), -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
            v_ext = torch.cat([v, torch.zeros(1, *v.shape[1:], dtype=v.dtype)])
        else:
            v_ext = v
        l = torch.logsumexp(s, dim=-1)  # (H, Lq)
        p = torch.exp(s - l[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", p, v_ext)
        lse[rows] = l.T
    return out, lse


def sdpa(batch, allowed, bias=None):
    """torch SDPA (CPU, float64) per sequence, with an explicit boolean or additive mask."""
    spec = batch.spec
    out = torch.zeros(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch.float64)
    for b, rows, q, k, v, qo_pos, kv_pos in per_sequence(batch):
        mask = allowed(qo_pos, kv_pos)
        if bias is not None:
            mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf) + bias(qo_pos, kv_pos)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=spec.sm_scale)  # (1, H, Lq, D)
        out[rows] = o[0].transpose(0, 1)
    return out


def causal(qo_pos, kv_pos):
    return kv_pos[None, :] <= qo_pos[:, None]


def run_ref(batch, **kw):
    return reference.paged_attention(batch.spec, *batch.args(), **batch.kwargs(), return_lse=True,
                                     compute_dtype=torch.float64, **kw)


def assert_close(spec, out, lse, want_out, want_lse):
    assert out.dtype == getattr(torch, spec.o_dtype)
    assert not torch.isnan(out).any()
    assert relative_error(out, want_out) < TOL[spec.o_dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite].double(), want_lse[finite], rtol=1e-6, atol=1e-5)


Q_LENS, KV_LENS = [1, 5, 16, 0, 33], [1, 40, 16, 9, 100]


# ---- against torch SDPA ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 7])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_matches_sdpa(layout, page_size, heads, is_causal):
    spec = AttentionSpec(*heads, 64, q_dtype="float16", kv_layout=layout, page_size=page_size, causal=is_causal)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=page_size)
    out, lse = run_ref(batch)
    allowed = causal if is_causal else (lambda qp, kp: torch.ones(len(qp), len(kp), dtype=torch.bool))
    want_out, want_lse = manual(batch, allowed=lambda b, qp, kp: allowed(qp, kp))
    assert relative_error(want_out, sdpa(batch, allowed)) < 1e-12  # the hand-written path is SDPA's
    assert_close(spec, out, lse, want_out, want_lse)


def test_full_prefill_matches_sdpa_is_causal():
    spec = AttentionSpec(8, 2, 128, q_dtype="float16")
    batch = random_paged_batch(spec, [50], [50], seed=3)
    q, k, v = next(per_sequence(batch))[2:5]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=spec.sm_scale).transpose(0, 1)
    assert relative_error(run_ref(batch)[0], want) < TOL["float16"]


def test_float32_compute_agrees_with_float64():
    spec = AttentionSpec(8, 2, 64, q_dtype="float16", page_size=7)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=11)
    o64, l64 = run_ref(batch)
    o32, l32 = reference.paged_attention(spec, *batch.args(), return_lse=True)
    assert relative_error(o32, o64) < 1e-3
    torch.testing.assert_close(l32, l64, rtol=1e-5, atol=1e-5)


def test_row_chunking_does_not_change_results():
    spec = AttentionSpec(4, 2, 64, q_dtype="float16")
    batch = random_paged_batch(spec, [40, 3], [100, 3], seed=5)
    whole = run_ref(batch)
    chunked = run_ref(batch, max_score_bytes=4 * 8 * 100 * 3)  # 3 rows per chunk
    assert torch.equal(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1])


# ---- windows, soft-cap, ALiBi, sinks -------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(window_left=0), dict(window_left=10), dict(window_left=10, causal=False),
                                dict(causal=False, window_left=5, window_right=3),
                                dict(causal=False, window_right=0)],
                         ids=["left0", "left10", "left10-full", "left5-right3", "right0"])
def test_windows_match_an_explicit_mask(kw):
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", page_size=7, **kw)
    wl, wr = spec.window_left, spec.window_right

    def allowed(qp, kp):
        d = qp[:, None] - kp[None, :]  # p - j
        ok = torch.ones_like(d, dtype=torch.bool)
        if spec.causal:
            ok &= d >= 0
        if wl >= 0:
            ok &= d <= wl
        if wr >= 0:
            ok &= -d <= wr
        return ok

    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=2)
    out, lse = run_ref(batch)
    want_out, want_lse = manual(batch, allowed=lambda b, qp, kp: allowed(qp, kp))
    assert relative_error(want_out, sdpa(batch, allowed)) < 1e-12
    assert_close(spec, out, lse, want_out, want_lse)
    pairs = sum(int(allowed(torch.arange(kl - ql, kl), torch.arange(kl)).sum()) for ql, kl in zip(Q_LENS, KV_LENS))
    assert pairs == sum(visible_pairs(spec, ql, kl) for ql, kl in zip(Q_LENS, KV_LENS))


def test_hf_sliding_window_mapping():
    """HF sliding_window=W lets a query at i see j with i - j < W: window_left = W - 1 sees exactly W keys."""
    W = 4
    spec = AttentionSpec(2, 2, 64, q_dtype="float16", window_left=W - 1)
    assert visible_keys(spec, 1, 100) == W
    hf = lambda qp, kp: (kp[None, :] <= qp[:, None]) & (qp[:, None] - kp[None, :] < W)  # noqa: E731
    batch = random_paged_batch(spec, [30], [30], seed=1)
    out, lse = run_ref(batch)
    assert relative_error(out, sdpa(batch, hf)) < TOL["float16"]


def test_soft_cap_matches_manual():
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", logits_soft_cap=5.0, window_left=20)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=4, scale=2.0)  # large logits: the cap matters
    out, lse = run_ref(batch)
    want = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp) & (qp[:, None] - kp[None, :] <= 20),
                  transform=lambda s: 5.0 * torch.tanh(s / 5.0))
    assert_close(spec, out, lse, *want)
    uncapped = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp) & (qp[:, None] - kp[None, :] <= 20))
    assert relative_error(out, uncapped[0]) > 0.05  # the test can tell the difference


@pytest.mark.parametrize("given", [True, False], ids=["slopes-given", "default-slopes"])
def test_alibi_matches_manual_bias(given):
    spec = AttentionSpec(12, 12, 64, q_dtype="float16", alibi=True, page_size=7)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=6)
    slopes = torch.linspace(0.05, 0.9, 12) if given else torch.tensor(
        [2 ** (-8 * (h + 1) / 8) for h in range(8)] + [2 ** (-8 * (2 * h + 1) / 16) for h in range(4)])
    if given:
        batch.alibi_slopes = slopes
    out, lse = run_ref(batch)

    def bias(b, qp, kp):
        return slopes.double()[:, None, None] * (kp[None, None, :] - qp[None, :, None]).double()

    want = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp), bias=bias)
    assert_close(spec, out, lse, *want)
    via_sdpa = sdpa(batch, causal, bias=lambda qp, kp: bias(0, qp, kp)[:, :, :])
    assert relative_error(want[0], via_sdpa) < 1e-12


def test_sinks_match_softmax_with_an_extra_logit():
    spec = AttentionSpec(8, 2, 64, q_dtype="float16", sinks=True, window_left=15)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=8)
    batch.sinks = torch.linspace(-2.0, 6.0, 8)  # large sinks take most of the mass
    out, lse = run_ref(batch)
    want = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp) & (qp[:, None] - kp[None, :] <= 15),
                  sinks=batch.sinks)
    assert_close(spec, out, lse, *want)
    # Output rows shrink by the sink's share: the last head's weights sum to well under 1.
    no_sink = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp) & (qp[:, None] - kp[None, :] <= 15))
    assert out[:, -1].double().norm() < 0.5 * no_sink[0][:, -1].norm()


# ---- rows that see no key ----------------------------------------------------------------------
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_rows_that_see_no_key_give_zero_and_neg_inf_lse(with_sinks):
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", variant=HIDE_HEAD, sinks=with_sinks)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=9, params={"hidden": 2})
    out, lse = run_ref(batch)
    assert torch.all(out[:, 2] == 0) and not torch.isnan(out).any()
    if with_sinks:  # only the sink is left: lse is the sink logit, the output still 0
        torch.testing.assert_close(lse[:, 2], batch.sinks[2].expand(lse.shape[0]))
    else:
        assert torch.all(torch.isneginf(lse[:, 2]))
    others = [0, 1, 3]
    assert torch.all(torch.isfinite(lse[:, others]))
    want = manual(batch, allowed=lambda b, qp, kp: causal(qp, kp)[None] & (torch.arange(4) != 2)[:, None, None],
                  sinks=batch.sinks)
    assert_close(spec, out, lse, *want)


def test_zero_query_sequences_and_unused_cache_slots():
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", page_size=16)
    batch = random_paged_batch(spec, [0, 3, 0], [20, 17, 5], seed=10)
    assert torch.isnan(batch.kv_cache).any()  # unused slots are NaN: reading them would show
    out, lse = run_ref(batch)
    assert out.shape == (3, 4, 64) and not torch.isnan(out).any() and torch.isfinite(lse).all()


# ---- custom variants (the same CUDA-string variants the GPU tests run: tests/gpu_cases.py) -------


def test_custom_transform_reference_functor():
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", variant=REL_BIAS)
    bias_h = torch.tensor([-0.2, 0.0, 0.1, 0.3])
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, seed=12, params={"bias": bias_h, "max_dist": 8.0})
    out, lse = run_ref(batch)

    def bias(b, qp, kp):
        return bias_h.double()[:, None, None] * torch.clamp((qp[:, None] - kp[None, :]).double(), max=8.0)[None]

    assert_close(spec, out, lse, *manual(batch, allowed=lambda b, qp, kp: causal(qp, kp), bias=bias))


def test_custom_mask_reference_functor():
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", variant=DOC_MASK, causal=False)
    doc = torch.tensor([0] * 10 + [1] * 25 + [2] * 80, dtype=torch.int32)
    batch = random_paged_batch(spec, [12, 30], [20, 100], seed=13, params={"doc": doc})
    out, lse = run_ref(batch)
    want = manual(batch, allowed=lambda b, qp, kp: doc[qp][:, None] == doc[kp][None, :])
    assert_close(spec, out, lse, *want)


def test_variant_without_reference_functor_is_not_silently_ignored():
    v = Variant("no_ref", logits_transform="logits * 2.0f")
    spec = AttentionSpec(4, 2, 64, q_dtype="float16", variant=v)
    batch = random_paged_batch(spec, [2], [4])
    with pytest.raises(NotImplementedError, match="no_ref.*reference_transform"):
        run_ref(batch)


# ---- input errors and the paged layout ---------------------------------------------------------
def test_missing_sinks_and_too_many_queries_raise():
    spec = AttentionSpec(4, 2, 64, sinks=True)
    batch = random_paged_batch(spec, [2], [4])
    with pytest.raises(ValueError, match=r"sinks: spec.sinks=True, so a float32 \(4,\) tensor is required"):
        reference.paged_attention(spec, *batch.args())
    plain = AttentionSpec(4, 2, 64)
    b2 = random_paged_batch(plain, [2], [4])
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=1 but the sequence brings 2 queries"):
        reference.paged_attention(plain, b2.q, b2.kv_cache, b2.block_table, torch.tensor([1], dtype=torch.int32),
                                  b2.query_start_loc)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_make_paged_kv_round_trip(layout):
    spec = AttentionSpec(4, 2, 64, kv_layout=layout, page_size=7)
    lens = [1, 7, 8, 30]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(sum(lens), 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens), 2, 64, generator=g).to(torch.bfloat16)
    cache, table = make_paged_kv(k, v, lens, spec, generator=g, extra_pages=2)
    assert tuple(cache.shape[1:]) == ((2, 7, 2, 64) if layout == "NHD" else (2, 2, 7, 64))
    assert table.dtype == torch.int32 and table.shape == (4, 5)
    start = 0
    for b, n in enumerate(lens):
        dk, dv = dense_kv(spec, cache, table, b, n)
        assert torch.equal(dk, k[start:start + n]) and torch.equal(dv, v[start:start + n])
        rk, rv = reference.gather_kv(spec, cache, table, b, n)
        assert torch.equal(rk, dk) and torch.equal(rv, dv)
        start += n
    used = {int(p) for b, n in enumerate(lens) for p in table[b, : -(-n // 7)]}
    assert len(used) == sum(-(-n // 7) for n in lens)  # no page shared between sequences


# ---- the error metric the kernel tests use -------------------------------------------------------
def test_relative_error_is_the_norm_ratio():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.tensor([3.0, 5.0]), ref) == pytest.approx(1 / 5)
    assert relative_error(torch.tensor([1.0, 0.0]), torch.zeros(2)) == 1.0  # a zero ref: the absolute error
    with pytest.raises(ValueError, match=r"out has shape \(2,\), ref \(3,\)"):
        relative_error(ref, torch.zeros(3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("side", ["out", "ref", "both"])
def test_relative_error_fails_on_nan_or_inf_on_either_side(bad, side):
    good = torch.randn(4, 3, dtype=torch.bfloat16)
    poisoned = good.clone()
    poisoned[1, 2] = bad
    out, ref = (poisoned if side in ("out", "both") else good), (poisoned if side in ("ref", "both") else good)
    assert relative_error(out, ref) == float("inf")
    if side != "both":  # not at the same place on both sides: still a failure when matches are allowed
        assert relative_error(out, ref, matching_nonfinite=True) == float("inf")
    assert relative_error(torch.full((4, 3), bad), torch.full((4, 3), bad)) == float("inf")


def test_relative_error_allows_matching_nonfinite_only_when_asked():
    ref = torch.randn(5, 2, dtype=torch.float64)
    ref[1] = float("nan")
    ref[3, 0] = float("-inf")
    out = ref.clone()
    out[0, 0] += 0.5
    want = 0.5 / torch.linalg.vector_norm(ref[torch.isfinite(ref)]).item()
    assert relative_error(out, ref) == float("inf")
    assert relative_error(out, ref, matching_nonfinite=True) == pytest.approx(want)
    flipped = out.clone()
    flipped[3, 0] = float("inf")  # -inf against +inf is not a match
    assert relative_error(flipped, ref, matching_nonfinite=True) == float("inf")
    as_nan = out.clone()
    as_nan[3, 0] = float("nan")  # NaN against -inf is not a match either
    assert relative_error(as_nan, ref, matching_nonfinite=True) == float("inf")
    assert relative_error(torch.full((3,), float("nan")), torch.zeros(3)) == float("inf")

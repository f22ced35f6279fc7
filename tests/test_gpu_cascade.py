"""Cascade attention on the GPU (``pytest -m gpu``; skipped without CUDA): jitattn.cascade with the jit
kernels against the fp32 reference on the un-split batch (the same requests, each with its whole key
sequence), for every feature the split preserves, a prefix that ends mid-page and a suffix of length 0.
Fresh inputs per run (the ``seed`` fixture, recorded); every output is written through ``out=``, poisoned
with NaN before the launch, so an element no level writes fails."""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference, variant
from jitattn.cascade import cascade_attention, plan_cascade
from jitattn.reference import torch_dtype
from jitattn.testing import random_cascade_batch, relative_error
from tests.conftest import GPU_TOL, precompile, replay_on_new_q

pytestmark = pytest.mark.gpu
ROPE = variant.rotary_embedding(128)
PREFIX_LM = variant.prefix_lm_mask()

CASES = {  # name: (spec, prefix_lens, group_sizes, suffix_lens, q_lens)
    "decode-hd128-mid-page-empty-suffix": (AttentionSpec(32, 8, 128), [1000], [5], [100, 0, 37, 1, 250], [1] * 5),
    "decode-two-prefixes-page1": (AttentionSpec(32, 8, 128, page_size=1), [300, 77], [3, 2], [5, 0, 9, 40, 2], [1] * 5),
    "append-hd128-queries-into-the-prefix": (AttentionSpec(32, 8, 128), [999], [3], [20, 0, 3], [17, 5, 9]),
    "gemma2-window-across-boundary": (AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=511,
                                                    sm_scale=256 ** -0.5), [700], [4], [300, 2, 0, 600], [1, 3, 1, 1]),
    "gpt-oss-sinks-window": (AttentionSpec(64, 8, 64, window_left=127, sinks=True), [513], [4], [60, 0, 200, 7],
                             [1, 1, 2, 1]),
    "alibi-hd64-hnd": (AttentionSpec(16, 4, 64, alibi=True, kv_layout="HND", page_size=64), [1100], [3],
                       [0, 90, 333], [1, 4, 1]),
    "rope-hooks": (AttentionSpec(32, 8, 128, variant=ROPE), [800], [3], [30, 0, 61], [1, 2, 1]),
    "prefix-lm-params-by-request": (AttentionSpec(16, 4, 128, causal=False, variant=PREFIX_LM), [257], [3],
                                    [10, 3, 0], [2, 1, 1]),
    "fp8-hd128": (AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn"), [1000], [4], [64, 0, 5, 300], [1] * 4),
    # FP8 rows of 8-byte chunks: the tensor-core decode at page 1 (pages of 216 bytes), prefill rows at 88 over HND
    "fp8-hd72-page1": (AttentionSpec(12, 3, 72, kv_dtype="float8_e4m3fn", page_size=1), [1000], [4], [64, 0, 5, 300],
                       [1] * 4),
    "fp8-hd88-group2-hnd-append": (AttentionSpec(8, 4, 88, kv_dtype="float8_e4m3fn", kv_layout="HND"), [999], [3],
                                   [20, 0, 3], [17, 5, 9]),
    "batch-129-decode": (AttentionSpec(32, 8, 128), [2048], [129], [(7 * i) % 300 for i in range(129)], [1] * 129),
}


def _poisoned(spec, q):
    """The ``out=`` of a cascade call, ``(total_q, num_qo_heads, head_dim_vo)``, NaN before the launch."""
    return torch.full((q.shape[0], spec.num_qo_heads, spec.head_dim_vo), float("nan"),
                      dtype=torch_dtype(spec.o_dtype), device=q.device)


def _params(spec, n):
    if spec.variant is PREFIX_LM:
        return {"prefix_len": torch.tensor([100, 300, 5][:n], dtype=torch.int32, device="cuda")}
    return {}


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    specs = [c[0] for c in CASES.values()]
    precompile(specs + [s.replace(query_positions="explicit") for s in specs], session_cache_dir)


@pytest.mark.parametrize("chunks", [None, [1, 1], [5, 1]], ids=["auto-chunks", "1-chunk", "5-chunks"])
@pytest.mark.parametrize("name", list(CASES))
def test_cascade_against_the_unsplit_reference(name, chunks, session_cache, record, seed):
    spec, pre, groups, suf, ql = CASES[name]
    cb = random_cascade_batch(spec, pre, groups, suf, ql, device="cuda", seed=seed, params=_params(spec, len(suf)))
    p = cb.plain
    want, want_lse = reference.paged_attention(spec, *p.args(), **p.kwargs(), return_lse=True)
    out = _poisoned(spec, cb.q)
    got, lse = cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, **p.kwargs(), return_lse=True,
                                 use_cascade=True, chunks=chunks, validate=True, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()  # written in place
    err = relative_error(got, want)
    finite = torch.isfinite(want_lse)
    lse_err = float((lse[finite] - want_lse[finite]).abs().max()) if finite.any() else 0.0
    record(rel_err=err, lse_max_abs_err=lse_err, states=None if chunks is None else sum(chunks))
    assert not torch.isnan(got).any()
    assert err < GPU_TOL[spec.q_dtype], err
    assert lse_err < 2e-2 and torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


def test_planned_cascade_replays_in_a_cuda_graph(session_cache, record, seed):
    """plan once, capture the call (writing ``out=`` in place), replay on new queries: equals the
    reference for those queries (replay_on_new_q poisons ``out`` with NaN before the replay)."""
    spec, pre, groups, suf, ql = CASES["decode-hd128-mid-page-empty-suffix"]
    cb = random_cascade_batch(spec, pre, groups, suf, ql, device="cuda", seed=seed)
    plan = plan_cascade(spec, cb.levels, cb.q.shape[0], num_sms=132)
    out = _poisoned(spec, cb.q)
    call = lambda: cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, plan=plan, out=out)  # noqa: E731
    call()
    replay_on_new_q(call, cb.q, out, seed)
    want = reference.paged_attention(spec, cb.q, *cb.plain.args()[1:])
    err = relative_error(out, want)
    record(rel_err=err)
    assert err < GPU_TOL[spec.q_dtype], err


def test_auto_rule_and_plain_path_agree(session_cache, record, seed):
    """A page-aligned prefix: use_cascade None (the rule), True and False give the same rows."""
    spec = AttentionSpec(32, 8, 128)
    cb = random_cascade_batch(spec, [4096], [16], [64] * 16, [1] * 16, device="cuda", seed=seed)
    outs = [cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, use_cascade=u, out=_poisoned(spec, cb.q))
            for u in (None, True, False)]
    want = reference.paged_attention(spec, *cb.plain.args())
    errs = [relative_error(o, want) for o in outs]
    record(rel_err=max(errs))
    assert max(errs) < GPU_TOL[spec.q_dtype], errs


def test_minus_inf_sinks_on_rows_that_see_no_key(session_cache, record, seed):
    """A sink of -inf is no sink: a row that sees no key then gets output 0 and lse -inf, as the reference
    says, never NaN (the cascade's levels run with -inf sinks; the kernel's finalize took exp2(-inf + inf))."""
    spec = AttentionSpec(64, 8, 64, window_left=127, sinks=True, query_positions="explicit")
    batch = random_cascade_batch(spec.replace(query_positions="implicit"), [300], [2], [3, 0], [1, 1],
                                 device="cuda", seed=seed).plain
    # row 0 at position 1000 sees nothing of its 303 keys (window 127); row 1 at 299 sees keys 172..299
    pos = torch.tensor([1000, 299], dtype=torch.int32, device="cuda")
    kw = dict(sinks=torch.full((64,), -float("inf"), device="cuda"), return_lse=True, query_positions=pos,
              functor_batch=torch.zeros(2, dtype=torch.int32, device="cuda"),
              position_offset=torch.zeros(2, dtype=torch.int32, device="cuda"))
    from jitattn.runtime import load_kernel
    out, lse = load_kernel(spec).paged_attention(*batch.args(), **kw, out=_poisoned(spec, batch.q))
    want, want_lse = reference.paged_attention(spec, *batch.args(), **kw)
    torch.cuda.synchronize()
    err = relative_error(out, want)
    record(rel_err=err)
    assert not torch.isnan(out).any() and torch.equal(out[0].float(), torch.zeros_like(out[0].float()))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(want_lse[0]).all()
    assert err < GPU_TOL[spec.q_dtype], err

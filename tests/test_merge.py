"""merge_state / merge_state_in_place / merge_states on the CPU (the torch path), and the CUDA
utility module compiled by nvcc through the cache (it must build here: nvcc is on this machine).

The oracle: attention over a key set split into disjoint ranges, each range run through
``jitattn.reference`` with ``return_lse=True`` (a ``logits_mask`` variant keeps keys in
``[lo[b], hi[b])``), merged, against the reference over all keys.
"""

from __future__ import annotations

import json

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, Param, Variant, reference
from jitattn.cache import KernelCache, MissingKernelError
from jitattn.cli import parse_spec_arg
from jitattn.merge import merge_state, merge_state_in_place, merge_states
from jitattn.merge_module import KERNEL_NAMES, MERGE_DTYPES, MergeModule
from jitattn.testing import random_paged_batch, relative_error

INF = float("inf")


def key_range(batch, qo_head, qo_idx, kv_idx, params):
    """Keys ``lo[batch] <= kv_idx < hi[batch]`` only: one part of a split key set."""
    return (kv_idx >= params.lo[batch]) & (kv_idx < params.hi[batch])


KEY_RANGE = Variant("key_range", logits_mask=key_range,
                    params=(Param("lo", "int32", ("batch",)), Param("hi", "int32", ("batch",))))

#: (spec, q_lens, kv_lens). The first: sequences 2 and 3 bring about as many queries as keys, so their
#: early rows see no key of the second half (lse -inf there); the last: the window hides the first half
#: from late rows.
SPECS = [
    (AttentionSpec(8, 2, 64, q_dtype="bfloat16", causal=True), [3, 1, 6, 8], [40, 17, 6, 9]),
    (AttentionSpec(4, 4, 96, q_dtype="float16", causal=False, logits_soft_cap=30.0), [5, 1], [23, 11]),
    (AttentionSpec(6, 2, 128, q_dtype="float16", causal=True, window_left=7, alibi=True), [9, 4], [31, 4]),
]
IDS = ["bf16-causal-d64", "f16-softcap-d96", "f16-window-alibi-d128"]


def _part(spec, q_lens, kv_lens, lo, hi, seed=0):
    """(out, lse) of the reference over keys [lo[b], hi[b]) of the same random batch."""
    ranged = spec.replace(variant=KEY_RANGE)
    params = {"lo": torch.tensor(lo, dtype=torch.int32), "hi": torch.tensor(hi, dtype=torch.int32)}
    batch = random_paged_batch(ranged, q_lens, kv_lens, seed=seed, params=params)
    return reference.paged_attention(ranged, *batch.args(), **batch.kwargs(), return_lse=True)


def _full(spec, q_lens, kv_lens, seed=0):
    batch = random_paged_batch(spec, q_lens, kv_lens, seed=seed)
    return reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)


def _tol(dtype: torch.dtype) -> float:
    # The parts are rounded to the output dtype before the merge, the full reference once.
    return {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


# ---- against the reference over the union ------------------------------------------------------
@pytest.mark.parametrize("spec,q_lens,kv_lens", SPECS, ids=IDS)
def test_merge_of_two_key_halves_is_attention_over_all_keys(spec, q_lens, kv_lens):
    split = [kl // 2 for kl in kv_lens]
    v_a, s_a = _part(spec, q_lens, kv_lens, [0] * len(kv_lens), split)
    v_b, s_b = _part(spec, q_lens, kv_lens, split, kv_lens)
    want_v, want_s = _full(spec, q_lens, kv_lens)
    if spec is SPECS[0][0]:
        assert torch.isneginf(s_b).any()  # rows that see nothing of the second half
    if spec is SPECS[2][0]:
        assert torch.isneginf(s_a).any()  # rows whose window sees nothing of the first half
    v, s = merge_state(v_a, s_a, v_b, s_b)
    assert v.dtype == v_a.dtype and v.shape == v_a.shape and s.dtype == torch.float32 and s.shape == s_a.shape
    assert relative_error(v, want_v) < _tol(v.dtype)
    assert torch.equal(torch.isneginf(s), torch.isneginf(want_s))
    assert torch.allclose(s, want_s, rtol=1e-5, atol=1e-5)
    for empty, other_v, other_s in ((torch.isneginf(s_b), v_a, s_a), (torch.isneginf(s_a), v_b, s_b)):
        assert torch.equal(v[empty], other_v[empty]) and torch.equal(s[empty], other_s[empty])  # exactly
    # the merge is symmetric
    v2, s2 = merge_state(v_b, s_b, v_a, s_a)
    assert torch.allclose(v2.float(), v.float(), rtol=1e-2, atol=1e-3) and torch.allclose(s2, s)


@pytest.mark.parametrize("spec,q_lens,kv_lens", SPECS, ids=IDS)
def test_merge_states_of_four_key_ranges_is_attention_over_all_keys(spec, q_lens, kv_lens):
    cuts = [[0, kl // 3, kl // 3, (2 * kl) // 3, kl] for kl in kv_lens]  # the second range is empty
    parts = [_part(spec, q_lens, kv_lens, [c[i] for c in cuts], [c[i + 1] for c in cuts]) for i in range(4)]
    v = torch.stack([p[0] for p in parts], dim=1)  # (seq, 4, heads, dim)
    s = torch.stack([p[1] for p in parts], dim=1)
    assert torch.isneginf(s[:, 1]).all()
    want_v, want_s = _full(spec, q_lens, kv_lens)
    out_v, out_s = merge_states(v, s)
    assert out_v.dtype == v.dtype and out_v.shape == want_v.shape and out_s.shape == want_s.shape
    assert relative_error(out_v, want_v) < _tol(v.dtype)
    assert torch.allclose(out_s, want_s, rtol=1e-5, atol=1e-5)
    # pairwise, in place, in order: the same state
    acc_v, acc_s = parts[0][0].clone(), parts[0][1].clone()
    for pv, ps in parts[1:]:
        merge_state_in_place(acc_v, acc_s, pv, ps)
    assert relative_error(acc_v, out_v) < _tol(v.dtype) and torch.allclose(acc_s, out_s, rtol=1e-5, atol=1e-5)


def _dense_state(q, k, v, keys):
    """float64 attention of q (n, h, d) over keys[idx] of k, v (L, h, d): (out, lse)."""
    scores = torch.einsum("nhd,lhd->hnl", q, k[keys])
    lse = torch.logsumexp(scores, dim=-1)  # (h, n)
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v[keys])
    return out, lse.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [1, 13, 64, 256])
def test_merge_matches_float64_attention_for_every_dtype_and_head_dim(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    n, h, L = 7, 3, 50
    q, k, vv = (torch.randn(x, h, head_dim, generator=g, dtype=torch.float64) for x in (n, L, L))
    perm = torch.randperm(L, generator=g)
    a_keys, b_keys = perm[:17], perm[17:]
    (va, sa), (vb, sb) = _dense_state(q, k, vv, a_keys), _dense_state(q, k, vv, b_keys)
    want_v, want_s = _dense_state(q, k, vv, perm)
    v, s = merge_state(va.to(dtype), sa.float(), vb.to(dtype), sb.float())
    assert v.dtype == dtype
    assert relative_error(v, want_v) < {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(s.double(), want_s, rtol=1e-6, atol=1e-6)


# ---- the -inf rules ------------------------------------------------------------------------------
def _pair(dtype=torch.bfloat16, seq=6, heads=4, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    v_a, v_b = (torch.randn(seq, heads, dim, generator=g).to(dtype) for _ in range(2))
    s_a, s_b = (torch.randn(seq, heads, generator=g) * 3 for _ in range(2))
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_neg_inf_rules(dtype):
    v_a, s_a, v_b, s_b = _pair(dtype)
    s_a[0, :] = s_b[0, :] = -INF  # row 0: both empty
    v_a[0], v_b[0] = float("nan"), 7.0  # whatever an empty state holds never leaks
    s_b[1, 2] = -INF  # (1, 2): b empty -> exactly a
    v_b[1, 2] = float("nan")
    s_a[2, 1] = -INF  # (2, 1): a empty -> exactly b
    v_a[2, 1] = float("inf")
    v, s = merge_state(v_a, s_a, v_b, s_b)
    assert torch.all(v[0] == 0) and torch.all(torch.isneginf(s[0]))
    assert torch.equal(v[1, 2], v_a[1, 2]) and s[1, 2] == s_a[1, 2]
    assert torch.equal(v[2, 1], v_b[2, 1]) and s[2, 1] == s_b[2, 1]
    others = torch.ones(6, 4, dtype=torch.bool)
    others[0], others[1, 2], others[2, 1] = False, False, False
    assert torch.isfinite(v[others]).all() and torch.isfinite(s[others]).all()
    # logaddexp of the lse, and the weights of the values, elsewhere
    assert torch.allclose(s[others], torch.logaddexp(s_a, s_b)[others], rtol=1e-6, atol=1e-6)
    w_a = torch.exp(s_a - torch.logaddexp(s_a, s_b))[..., None]
    want = v_a.float() * w_a + v_b.float() * (1 - w_a)
    assert torch.allclose(v.float()[others], want[others], rtol=1e-2, atol=1e-2)


def test_nan_lse_gives_nan_not_the_other_state():
    v_a, s_a, v_b, s_b = _pair()
    s_b[3, 0] = float("nan")
    v, s = merge_state(v_a, s_a, v_b, s_b)
    assert torch.isnan(s[3, 0]) and torch.isnan(v[3, 0]).all()
    assert not torch.isnan(s[4]).any() and not torch.isnan(v[4]).any()


def test_merge_states_rules_and_sizes():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(5, 3, 2, 32, generator=g).half()
    s = torch.randn(5, 3, 2, generator=g)
    s[0] = -INF  # all states of row 0 empty
    v[0] = float("nan")
    s[1, :2] = -INF  # only state 2 of row 1 alive: that state exactly
    v[1, :2] = float("nan")
    out_v, out_s = merge_states(v, s)
    assert torch.all(out_v[0] == 0) and torch.isneginf(out_s[0]).all()
    assert torch.equal(out_v[1], v[1, 2]) and torch.equal(out_s[1], s[1, 2])
    assert torch.allclose(out_s[2:], torch.logsumexp(s[2:], dim=1))
    one_v, one_s = merge_states(v[:, :1], s[:, :1])  # one state: itself
    assert torch.equal(one_v[2:], v[2:, 0]) and torch.equal(one_s, s[:, 0])
    zero_v, zero_s = merge_states(v[:, :0], s[:, :0])  # no state: the empty state
    assert zero_v.shape == (5, 2, 32) and zero_v.dtype == torch.float16 and torch.all(zero_v == 0)
    assert zero_s.shape == (5, 2) and torch.isneginf(zero_s).all()
    empty_v, empty_s = merge_states(v[:0], s[:0])
    assert empty_v.shape == (0, 2, 32) and empty_s.shape == (0, 2)


def test_strided_inputs_give_the_same_result():
    v_a, s_a, v_b, s_b = _pair(torch.float32, seq=5, heads=3, dim=16)
    big = torch.randn(5, 8, 16)
    big[:, 1:4] = v_a  # heads 1..3 of a wider tensor: non-contiguous rows
    s_t = s_a.T.contiguous().T  # column-major lse
    v, s = merge_state(big[:, 1:4], s_t, v_b, s_b)
    v_ref, s_ref = merge_state(v_a, s_a, v_b, s_b)
    assert torch.equal(v, v_ref) and torch.equal(s, s_ref)


# ---- in place ------------------------------------------------------------------------------------
def test_in_place_merges_only_masked_rows_and_leaves_the_others_bitwise():
    v_a, s_a, v_b, s_b = _pair(torch.bfloat16)
    want_v, want_s = merge_state(v_a, s_a, v_b, s_b)
    mask = torch.tensor([True, False, True, True, False, False])
    v, s = v_a.clone(), s_a.clone()
    assert merge_state_in_place(v, s, v_b, s_b, mask) is None
    assert torch.equal(v[mask], want_v[mask]) and torch.equal(s[mask], want_s[mask])
    assert torch.equal(v[~mask], v_a[~mask]) and torch.equal(s[~mask], s_a[~mask])
    v, s = v_a.clone(), s_a.clone()
    merge_state_in_place(v, s, v_b, s_b)  # no mask: every row
    assert torch.equal(v, want_v) and torch.equal(s, want_s)
    v, s = v_a.clone(), s_a.clone()
    merge_state_in_place(v, s, v_b, s_b, torch.zeros(6, dtype=torch.bool))
    assert torch.equal(v, v_a) and torch.equal(s, s_a)


def test_in_place_into_an_empty_state_copies_the_other():
    v_a, s_a, v_b, s_b = _pair(torch.float16)
    v = torch.full_like(v_a, float("nan"))  # an accumulator that has seen no key yet
    s = torch.full_like(s_a, -INF)
    merge_state_in_place(v, s, v_b, s_b)
    assert torch.equal(v, v_b) and torch.equal(s, s_b)


# ---- torch.compile ---------------------------------------------------------------------------------
def test_torch_path_traces_in_one_graph():
    v_a, s_a, v_b, s_b = _pair(torch.bfloat16)
    s_b[1, 2] = -INF
    s_a[0] = s_b[0] = -INF
    v, s = merge_state(v_a, s_a, v_b, s_b)
    got_v, got_s = torch.compile(merge_state, fullgraph=True, backend="aot_eager")(v_a, s_a, v_b, s_b)
    assert torch.equal(got_v, v) and torch.equal(got_s, s)
    stacked = torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1)
    got_v, got_s = torch.compile(merge_states, fullgraph=True, backend="aot_eager")(*stacked)
    assert torch.allclose(got_v.float(), v.float(), atol=1e-2) and torch.allclose(got_s, s)

    def step(v, s, v_o, s_o, mask):
        merge_state_in_place(v, s, v_o, s_o, mask)
        return v, s

    mask = torch.tensor([True, True, False, True, False, True])
    ev, es = v_a.clone(), s_a.clone()
    merge_state_in_place(ev, es, v_b, s_b, mask)
    cv, cs = v_a.clone(), s_a.clone()
    torch.compile(step, fullgraph=True, backend="aot_eager")(cv, cs, v_b, s_b, mask)
    assert torch.equal(cv, ev) and torch.equal(cs, es)


def test_public_exports():
    assert jitattn.merge_state is merge_state and jitattn.merge_states is merge_states
    assert jitattn.merge_state_in_place is merge_state_in_place
    assert {"merge_state", "merge_state_in_place", "merge_states"} <= set(jitattn.__all__)


# ---- bad input -----------------------------------------------------------------------------------
def _call_pair(**over):
    v_a, s_a, v_b, s_b = _pair(torch.bfloat16, seq=4, heads=2, dim=16)
    args = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b, **over}
    return merge_state(args["v_a"], args["s_a"], args["v_b"], args["s_b"], **args.get("kw", {}))


@pytest.mark.parametrize("over,message", [
    ({"v_a": torch.zeros(4, 2)}, r"v_a: expected 3 dims \(seq, num_heads, head_dim\), got shape \(4, 2\)"),
    ({"v_a": torch.zeros(4, 2, 16, dtype=torch.float64)}, r"v_a: dtype torch.float64 not supported"),
    ({"v_b": torch.zeros(4, 2, 16)}, r"v_b: dtype torch.float32 differs from v_a's torch.bfloat16"),
    ({"v_b": torch.zeros(4, 3, 16, dtype=torch.bfloat16)}, r"v_b: shape \(4, 3, 16\) differs from v_a's \(4, 2, 16\)"),
    ({"s_a": torch.zeros(4, 2, dtype=torch.float16)}, r"s_a: lse must be torch.float32"),
    ({"s_b": torch.zeros(4, 3)}, r"s_b: expected shape \(4, 2\) \(seq, num_heads\), got \(4, 3\)"),
    ({"s_b": torch.zeros(4, 2, device="meta")}, r"s_b: on meta, but the values are on cpu"),
    ({"v_a": torch.zeros(4, 16, 2, dtype=torch.bfloat16).transpose(1, 2)}, r"v_a: the last \(head_dim\) dimension "
                                                                            r"must be contiguous"),
    ({"s_a": [[0.0, 0.0]] * 4}, r"s_a: expected a torch.Tensor, got list"),
    ({"kw": {"impl": "triton"}}, r"impl='triton': expected one of \('auto', 'torch', 'cuda'\)"),
    ({"kw": {"impl": "cuda"}}, r"impl='cuda': the tensors are on cpu; the CUDA kernel needs CUDA tensors"),
])
def test_merge_state_rejects_bad_input(over, message):
    with pytest.raises(ValueError, match=message):
        _call_pair(**over)


def test_in_place_and_many_reject_bad_input():
    v_a, s_a, v_b, s_b = _pair(torch.float16, seq=4, heads=2, dim=16)
    with pytest.raises(ValueError, match=r"mask: dtype torch.int64; expected torch.bool"):
        merge_state_in_place(v_a, s_a, v_b, s_b, torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected shape \(4,\) \(seq,\), got \(4, 1\)"):
        merge_state_in_place(v_a, s_a, v_b, s_b, torch.ones(4, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"v: a broadcast view"):
        merge_state_in_place(v_a[:1].expand(4, 2, 16), s_a, v_b, s_b)
    with pytest.raises(ValueError, match=r"s_other: expected shape \(4, 2\)"):
        merge_state_in_place(v_a, s_a, v_b, s_b.T)
    with pytest.raises(ValueError, match=r"v: expected 4 dims \(seq, num_states, num_heads, head_dim\)"):
        merge_states(v_a, s_a)
    with pytest.raises(ValueError, match=r"s: expected shape \(4, 3, 2\) \(seq, num_states, num_heads\), got \(4, 2\)"):
        merge_states(torch.zeros(4, 3, 2, 16, dtype=torch.float16), s_a)


# ---- the host side of a launch (CPU tensors: only addresses and strides are read) -----------------
def test_launch_fields_pick_vector_loads_group_size_and_strides():
    from jitattn.merge import launch_fields, params_packer

    for dtype in MERGE_DTYPES:
        packer, order = params_packer(MergeModule(dtype))
        assert packer.size == MergeModule(dtype).render().params_size
        assert f"sizeof(MergeParams) == {packer.size}" in MergeModule(dtype).render().text
        assert sorted(order) == sorted(f.name for f in MergeModule(dtype).fields)

    def fields(v_a, v_b, vec, kernel="merge_state", n=2):
        s = torch.zeros(v_a.shape[:-1])
        out_v = torch.empty(v_a.shape[0], v_a.shape[-2], v_a.shape[-1], dtype=v_a.dtype)
        out_s = torch.empty(out_v.shape[:2])
        return launch_fields(kernel, vec, v_a=v_a, s_a=s, v_b=v_b, s_b=None if v_b is None else s, v_out=out_v,
                             s_out=out_s, mask=None, num_states=n)

    v = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    f, blocks = fields(v, v.clone(), 8)
    assert f["vectorized"] == 1 and f["group_threads"] == 16 and blocks == 100 * 8 * 16 // 128
    assert (f["v_a_stride_seq"], f["v_a_stride_head"], f["head_dim"], f["num_states"]) == (1024, 128, 128, 2)
    f, _ = fields(torch.zeros(10, 4, 256), torch.zeros(10, 4, 256), 4)  # fp32 d256: 64 chunks, a full warp
    assert f["group_threads"] == 32 and f["vectorized"] == 1
    f, blocks = fields(torch.zeros(7, 3, 3, dtype=torch.float16), torch.zeros(7, 3, 3, dtype=torch.float16), 8)
    assert f["group_threads"] == 1 and f["vectorized"] == 0 and blocks == 1  # tail only: element-wise
    flat = torch.zeros(100 * 8 * 128 + 1, dtype=torch.bfloat16)
    f, _ = fields(flat[1:].view(100, 8, 128), v, 8)  # 2 bytes off a 16-byte boundary
    assert f["vectorized"] == 0
    wide = torch.zeros(100, 11, 128, dtype=torch.bfloat16)[:, 2:10]  # a head slice: aligned, other strides
    f, _ = fields(wide, v, 8)
    assert f["vectorized"] == 1 and (f["v_a_stride_seq"], f["v_a_stride_head"]) == (11 * 128, 128)
    many = torch.zeros(5, 3, 4, 64, dtype=torch.float16)
    f, _ = fields(many, None, 8, "merge_states", 3)
    assert (f["v_a_stride_state"], f["v_a_stride_head"], f["s_a_stride_state"], f["v_b"]) == (256, 64, 4, 0)


# ---- the CUDA utility module: rendered, compiled by nvcc, cached -----------------------------------
def test_module_description_round_trips_and_is_a_warmup_spec():
    m = MergeModule("bf16")
    assert m.dtype == "bfloat16" and m == MergeModule(torch.bfloat16) and hash(m) == hash(MergeModule("bfloat16"))
    assert json.loads(m.canonical_json()) == {"dtype": "bfloat16", "kind": "merge_state"}
    assert MergeModule.from_json(m.canonical_json()) == m
    assert m.name.startswith("merge_state_bf16_") and m.name != MergeModule("float16").name
    assert parse_spec_arg(m.canonical_json()) == [m]
    with pytest.raises(ValueError, match=r"dtype='int8': merge_state takes values of dtype"):
        MergeModule("int8")
    with pytest.raises(ValueError, match=r"expected exactly the field 'dtype'"):
        MergeModule.from_json({"kind": "merge_state", "dtype": "float16", "head_dim": 64})
    text = m.render().text
    assert "using MergeT = __nv_bfloat16;" in text
    assert all(f"{name}(const __grid_constant__" in text for k, name in KERNEL_NAMES.items() if k != "geometry")


@pytest.mark.slow
def test_nvcc_builds_the_merge_module_for_every_dtype_and_arch(tmp_path):
    cache = KernelCache(root=tmp_path / "c", layers=())
    for dtype in MERGE_DTYPES:
        module = MergeModule(dtype)
        for arch in ("sm_80", "sm_90a"):
            entry, built = cache.get_or_build(module, arch)
            assert built and entry.cubin.read_bytes()[:4] == b"\x7fELF"
            assert entry.spec == module and entry.manifest["name"] == module.name
            assert "0 bytes spill stores" in entry.manifest["compiler_log"]
            for name in (KERNEL_NAMES["merge_state"], KERNEL_NAMES["merge_states"]):
                assert name.encode() in entry.cubin.read_bytes()
            again, built_again = KernelCache(root=tmp_path / "c", layers=()).get_or_build(module, arch)
            assert not built_again and again.key == entry.key


@pytest.mark.slow
def test_disable_jit_miss_names_the_warmup_command_and_warmup_builds_it(tmp_path, monkeypatch):
    from tests.test_cli import jitattn as run_cli

    module = MergeModule("float16")
    root = tmp_path / "c"
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    with pytest.raises(MissingKernelError) as info:
        KernelCache(root=root, layers=()).get_or_build(module, "sm_90a")
    assert module.name in str(info.value)
    command = next(ln.strip() for ln in str(info.value).splitlines() if ln.strip().startswith("jitattn warmup"))
    import shlex

    proc = run_cli(*shlex.split(command)[1:], cache=root)
    assert proc.returncode == 0, proc.stderr
    assert next(ln for ln in proc.stdout.splitlines() if ln.startswith("compiled ")).startswith("compiled 1, cached 0")
    entry, built = KernelCache(root=root, layers=()).get_or_build(module, "sm_90a")  # still DISABLE_JIT=1
    assert not built and entry.spec == module

"""The CUDA merge_state kernel against the torch path, on the GPU (``pytest -m gpu``; skipped without CUDA).

Both run on the same CUDA tensors; the torch path (:mod:`jitattn.merge`) is itself checked against
the reference on the CPU (tests/test_merge.py). The same fp32 arithmetic, so the kernel must agree
to about one unit in the last place of the output dtype, and exactly on the -inf rules. Inputs are
fresh per run: drawn from the session seed (tests/conftest.py, recorded with every result line).
"""

from __future__ import annotations

import os

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.merge import load_merge_kernel, merge_state, merge_state_in_place, merge_states
from jitattn.merge_module import MERGE_DTYPES, MergeModule
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import SESSION_SEED, precompile
from tests.test_merge import KEY_RANGE

pytestmark = pytest.mark.gpu
SEED = SESSION_SEED
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [64, 80, 96, 128, 192, 256]
INF = float("inf")
#: kernel vs torch path: the output rounding (one ulp of the dtype) plus fp32 summation order.
RTOL = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7, torch.float32: 2e-6}


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    precompile([MergeModule(d) for d in MERGE_DTYPES], session_cache_dir)


def _states(seq, heads, dim, dtype, n=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(SEED + seed)
    v = [torch.randn(seq, heads, dim, generator=g, device="cuda").to(dtype) for _ in range(n)]
    s = [torch.randn(seq, heads, generator=g, device="cuda") * 4 for _ in range(n)]
    return v, s


def _poke_inf(v, s):
    """Row 0: every state empty (values NaN: never read). Row 1, head 0: only state 0 alive. NaN lse at row 2."""
    for vi, si in zip(v, s):
        si[0] = -INF
        vi[0] = float("nan")
    for vi, si in zip(v[1:], s[1:]):
        si[1, 0] = -INF
        vi[1, 0] = float("nan")
    s[-1][2, 0] = float("nan")


def _assert_same(got, want, dtype, record=None):
    gv, gs = got
    wv, ws = want
    assert gv.dtype == wv.dtype and gv.shape == wv.shape and gs.shape == ws.shape
    assert torch.equal(torch.isnan(gv), torch.isnan(wv)) and torch.equal(torch.isnan(gs), torch.isnan(ws))
    assert torch.equal(torch.isneginf(gs), torch.isneginf(ws))
    fin = ~torch.isnan(wv)
    diff = (gv.float() - wv.float()).abs()[fin]
    bound = (RTOL[dtype] * wv.float().abs() + 1e-6)[fin]
    if record is not None:
        record(max_abs=diff.max().item() if diff.numel() else 0.0)
    assert torch.all(diff <= bound), f"max |diff| {diff.max().item():.3e}"
    fs = torch.isfinite(ws)
    torch.testing.assert_close(gs[fs], ws[fs], rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_kernel_matches_torch_path(dtype, head_dim, session_cache, record):
    (v_a, v_b), (s_a, s_b) = _states(1031, 8, head_dim, dtype, seed=head_dim)
    _poke_inf([v_a, v_b], [s_a, s_b])
    got = merge_state(v_a, s_a, v_b, s_b, impl="cuda")
    torch.cuda.synchronize()
    want = merge_state(v_a, s_a, v_b, s_b, impl="torch")
    record(arch=load_merge_kernel(dtype).entry.arch)
    _assert_same(got, want, dtype, record)
    v, s = got
    assert torch.all(v[0] == 0) and torch.isneginf(s[0]).all()  # both empty
    assert torch.equal(v[1, 0], v_a[1, 0]) and s[1, 0] == s_a[1, 0]  # one empty: the other, exactly
    assert torch.isnan(s[2, 0]) and torch.isnan(v[2, 0]).all()  # a NaN lse is not dropped
    auto = merge_state(v_a, s_a, v_b, s_b)  # "auto" takes the kernel for CUDA tensors
    assert torch.equal(auto[0].nan_to_num(), v.nan_to_num()) and torch.equal(auto[1].nan_to_num(), s.nan_to_num())


@pytest.mark.parametrize("num_states", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_states_kernel_matches_torch_path(dtype, num_states, session_cache, record):
    vs, ss = _states(517, 4, 128, dtype, n=num_states, seed=num_states)
    if num_states > 1:
        _poke_inf(vs, ss)
    v, s = torch.stack(vs, 1), torch.stack(ss, 1)
    got = merge_states(v, s, impl="cuda")
    torch.cuda.synchronize()
    _assert_same(got, merge_states(v, s, impl="torch"), dtype, record)
    if num_states == 1:
        assert torch.equal(got[0], vs[0]) and torch.equal(got[1], ss[0])
    zero = merge_states(v[:, :0], s[:, :0], impl="cuda")
    assert torch.all(zero[0] == 0) and torch.isneginf(zero[1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_with_mask_matches_torch_path_and_leaves_other_rows(dtype, session_cache):
    (v_a, v_b), (s_a, s_b) = _states(2049, 16, 128, dtype, seed=11)
    _poke_inf([v_a, v_b], [s_a, s_b])
    mask = torch.rand(2049, device="cuda", generator=torch.Generator(device="cuda").manual_seed(SEED)) < 0.5
    kv, ks = v_a.clone(), s_a.clone()
    merge_state_in_place(kv, ks, v_b, s_b, mask, impl="cuda")
    tv, ts = v_a.clone(), s_a.clone()
    merge_state_in_place(tv, ts, v_b, s_b, mask, impl="torch")
    torch.cuda.synchronize()
    _assert_same((kv, ks), (tv, ts), dtype)
    keep = ~mask
    assert torch.equal(kv[keep].nan_to_num(), v_a[keep].nan_to_num()) and torch.equal(ks[keep].nan_to_num(),
                                                                                      s_a[keep].nan_to_num())
    nv, ns = v_a.clone(), s_a.clone()
    merge_state_in_place(nv, ns, v_b, s_b, impl="cuda")  # no mask: every row, in place (s_out is s_a)
    _assert_same((nv, ns), merge_state(v_a, s_a, v_b, s_b, impl="torch"), dtype)


@pytest.mark.parametrize("layout", ["head-slice", "lse-transposed", "misaligned", "odd-head-dim", "tiny-head-dim"])
def test_strided_and_unaligned_inputs(layout, session_cache):
    dtype = torch.bfloat16
    seq, heads, dim = 300, 6, 128
    (v_a, v_b), (s_a, s_b) = _states(seq, heads, dim, dtype, seed=5)
    if layout == "head-slice":  # rows of a wider tensor (vectorised path, strides not the shape's)
        wide = torch.randn(seq, heads + 3, dim, device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(SEED)).to(dtype)
        wide[:, 2:2 + heads] = v_a
        v_a = wide[:, 2:2 + heads]
    elif layout == "lse-transposed":
        s_a = s_a.T.contiguous().T
    elif layout == "misaligned":  # 2 bytes off a 16-byte boundary: the element-wise path
        flat = torch.empty(seq * heads * dim + 1, dtype=dtype, device="cuda")
        v_a = flat[1:].view(seq, heads, dim).copy_(v_a)
        assert v_a.data_ptr() % 16 != 0
    elif layout == "odd-head-dim":  # head_dim not a multiple of 8: the element-wise path, tail included
        (v_a, v_b), (s_a, s_b) = _states(seq, heads, 72 + 3, dtype, seed=6)
    else:
        (v_a, v_b), (s_a, s_b) = _states(seq, heads, 3, dtype, seed=7)
    got = merge_state(v_a, s_a, v_b, s_b, impl="cuda")
    _assert_same(got, merge_state(v_a, s_a, v_b, s_b, impl="torch"), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_merged_reference_halves_are_attention_over_all_keys(dtype, session_cache, record):
    """Cascade-style: the reference over two key ranges on the GPU, merged by the kernel, vs all keys."""
    spec = AttentionSpec(8, 2, 128, q_dtype=dtype, causal=True)
    q_lens, kv_lens = [3, 1, 9, 16], [300, 77, 9, 16]
    ranged = spec.replace(variant=KEY_RANGE)
    split = [kl // 3 for kl in kv_lens]
    parts = []
    for lo, hi in (([0] * 4, split), (split, kv_lens)):
        params = {"lo": torch.tensor(lo, dtype=torch.int32, device="cuda"),
                  "hi": torch.tensor(hi, dtype=torch.int32, device="cuda")}
        b = random_paged_batch(ranged, q_lens, kv_lens, device="cuda", seed=SEED, params=params)
        parts.append(reference.paged_attention(ranged, *b.args(), **b.kwargs(), return_lse=True))
    b = random_paged_batch(spec, q_lens, kv_lens, device="cuda", seed=SEED)
    want_v, want_s = reference.paged_attention(spec, *b.args(), **b.kwargs(), return_lse=True)
    v, s = merge_state(*parts[0], *parts[1], impl="cuda")
    err = relative_error(v, want_v)
    record(rel_err=err)
    assert err < {"bfloat16": 1.5e-2, "float16": 2e-3}[dtype]
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)


def test_cuda_graph_capture_and_replay(session_cache):
    (v_a, v_b), (s_a, s_b) = _states(256, 8, 128, torch.bfloat16, seed=9)
    merge_state(v_a, s_a, v_b, s_b, impl="cuda")  # load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the launch goes to the capture stream (torch's current stream)
        out_v, out_s = merge_state(v_a, s_a, v_b, s_b, impl="cuda")
    v_a.copy_(torch.randn(v_a.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(SEED + 1))
              .to(v_a.dtype))
    s_b.fill_(-INF)  # replay on new inputs: every row is state a now
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_v, v_a) and torch.equal(out_s, s_a)


_SERVE = """
import sys, torch, jitattn
torch.manual_seed(int(sys.argv[1]))
v, s = torch.randn(33, 4, 128, device="cuda", dtype=torch.bfloat16), torch.randn(33, 4, device="cuda")
out_v, out_s = jitattn.merge_state(v, s, v, s)
torch.cuda.synchronize()
assert torch.equal(out_v, v) and torch.allclose(out_s, s + 0.6931471805599453), (out_v, out_s)
from jitattn.merge import load_merge_kernel
print(load_merge_kernel(torch.bfloat16).entry.arch)
"""


def test_a_serving_process_under_disable_jit_loads_the_cached_module(session_cache):
    """A fresh process with JITATTN_DISABLE_JIT=1 finds the module warm-up (precompile) built."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "JITATTN_DISABLE_JIT": "1", "JITATTN_CACHE_DIR": str(session_cache),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _SERVE, str(SEED)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("sm_")


def test_torch_compile_traces_the_torch_path_on_cuda(session_cache):
    (v_a, v_b), (s_a, s_b) = _states(64, 4, 64, torch.float16, seed=13)
    got = torch.compile(merge_state, fullgraph=True, backend="aot_eager")(v_a, s_a, v_b, s_b)
    _assert_same(got, merge_state(v_a, s_a, v_b, s_b, impl="cuda"), torch.float16)


def test_kernel_is_faster_than_the_torch_path(session_cache, record):
    (v_a, v_b), (s_a, s_b) = _states(16384, 32, 128, torch.bfloat16, seed=17)

    def timed(impl):
        for _ in range(3):
            merge_state(v_a, s_a, v_b, s_b, impl=impl)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            merge_state(v_a, s_a, v_b, s_b, impl=impl)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20 * 1e-3

    kernel, torch_path = timed("cuda"), timed("torch")
    nbytes = 3 * v_a.numel() * v_a.element_size() + 3 * s_a.numel() * 4
    record(kernel_us=kernel * 1e6, torch_us=torch_path * 1e6, kernel_tb_s=nbytes / kernel / 1e12)
    assert kernel < torch_path

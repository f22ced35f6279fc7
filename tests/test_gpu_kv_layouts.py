"""The engines' KV caches on the GPU kernels (issue 19, items 1 and 4): every layout of tests/kv_layouts.py,
bf16 and FP8, NHD and HND, a mixed prefill + decode batch (split-KV decode included), through the
one-call path and plan/run, against the fp32 reference of the single tensor (``pytest -m gpu``). FP8 at
hd 72 too, one KV head: pages of 72 bytes at page 1 (8-byte aligned only: rows of 8-byte chunks).

Outputs start NaN, so a row the kernel does not write fails; tolerances as tests/test_gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.spec import AttentionSpec
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, precompile
from tests.kv_layouts import ALL_LAYOUTS, engine_kv

pytestmark = pytest.mark.gpu

# one-query decode rows (one long enough to split), prefill rows, a row with a partial last page
Q_LENS, KV_LENS = [1, 1, 7, 1, 33, 2], [3000, 5, 129, 64, 33, 17]


def _spec(kv_layout: str, kv_dtype: str, page_size: int, head_dim: int = 128) -> AttentionSpec:
    heads = (32, 8) if head_dim == 128 else (4, 1)  # hd72: one KV head (group 4, the tensor-core decode)
    return AttentionSpec(*heads, head_dim, q_dtype="bfloat16", kv_dtype=kv_dtype, kv_layout=kv_layout,
                         page_size=page_size, causal=True)


DTYPE_DIMS = [("bfloat16", 128), ("float8_e4m3fn", 128), ("float8_e4m3fn", 72)]


def _cases():
    for kv_layout in ("NHD", "HND"):
        for kv_dtype, hd in DTYPE_DIMS:
            for layout in ALL_LAYOUTS:
                yield pytest.param(kv_layout, kv_dtype, layout, hd, id=f"{kv_layout}-{kv_dtype}-hd{hd}-{layout}")


SPECS = [_spec(lo, dt, ps, hd) for lo in ("NHD", "HND") for dt, hd in DTYPE_DIMS for ps in (1, 16)]


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    precompile(SPECS, session_cache_dir)


def _nan_out(batch):
    spec = batch.spec
    return torch.full((batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo), float("nan"), dtype=batch.q.dtype,
                      device=batch.q.device)


@pytest.mark.parametrize("kv_layout,kv_dtype,layout,head_dim", list(_cases()))
def test_every_engine_layout_matches_the_reference(kv_layout, kv_dtype, layout, head_dim, session_cache, record, seed):
    spec = _spec(kv_layout, kv_dtype, 1 if layout == "sglang_token_pool" else 16, head_dim)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, device="cuda", seed=seed)
    want, want_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    kv = engine_kv(spec, batch.kv_cache, layout)
    rest = batch.args()[2:]

    one_call = jitattn.paged_attention(spec, batch.q, kv, *rest, **batch.kwargs(), out=_nan_out(batch),
                                       return_lse=True, validate=True)
    plan = jitattn.plan(spec, *rest)
    planned = jitattn.run(batch.q, kv, plan, out=_nan_out(batch), return_lse=True, **batch.scales)
    torch.cuda.synchronize()
    for how, (out, lse) in (("one-call", one_call), ("plan/run", planned)):
        err = relative_error(out, want)
        lse_err = (lse - want_lse).abs().max().item()
        record(**{f"{how}_rel_err": err, f"{how}_lse_err": lse_err})
        assert not torch.isnan(out).any(), f"{how}: NaN in output (a row left unwritten)"
        assert err < GPU_TOL[spec.q_dtype], f"{how}: relative error {err:.3e}"
        assert lse_err < 2e-2, f"{how}: lse error {lse_err:.3e}"


def test_a_pair_and_its_single_tensor_give_the_same_bits(session_cache, seed):
    """Same values, same kernel, only the V address differs: the outputs must be identical."""
    spec = _spec("NHD", "bfloat16", 16)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, device="cuda", seed=seed)
    single = jitattn.paged_attention(spec, *batch.args())
    pair = jitattn.paged_attention(spec, batch.q, engine_kv(spec, batch.kv_cache, "vllm_flash_attn"),
                                   *batch.args()[2:])
    assert torch.equal(single, pair)

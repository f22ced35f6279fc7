"""FP8 (e4m3) KV cache: spec, checks, the reference's dequantisation, the kernels' compile."""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.cache import KernelCache
from jitattn.checks import check_paged_call, check_scales
from jitattn.testing import random_paged_batch

SPEC = AttentionSpec(8, 2, 64, kv_dtype="fp8")


def test_spec_takes_fp8_kv_with_16_bit_queries():
    assert SPEC.kv_dtype == "float8_e4m3fn" and SPEC.q_dtype == "bfloat16" and "kvf8" in SPEC.name
    assert AttentionSpec(8, 2, 64, q_dtype="float16", kv_dtype=torch.float8_e4m3fn).kv_dtype == "float8_e4m3fn"
    assert SPEC.key != SPEC.replace(kv_dtype="bfloat16").key


def test_reference_dequantises_with_the_scales():
    batch = random_paged_batch(SPEC, [1, 7], [33, 20], seed=3)
    assert batch.kv_cache.dtype == torch.float8_e4m3fn and set(batch.scales) == {"k_scale", "v_scale"}
    plain = SPEC.replace(kv_dtype="bfloat16")
    dequant = batch.kv_cache.float()
    dequant[:, 0] *= batch.scales["k_scale"]
    dequant[:, 1] *= batch.scales["v_scale"]
    want = reference.paged_attention(plain, batch.q, dequant.to(torch.bfloat16), batch.block_table, batch.seq_lens,
                                     batch.query_start_loc)
    got = reference.paged_attention(SPEC, *batch.args(), **batch.kwargs())
    assert (got.float() - want.float()).abs().max() < 2e-2  # the bf16 round trip of the dequantised cache


def test_checks_want_the_fp8_cache_dtype():
    batch = random_paged_batch(SPEC, [1], [10])
    check_paged_call(SPEC, *batch.args())
    with pytest.raises(ValueError, match=r"kv_cache: expected dtype torch.float8_e4m3fn, got torch.bfloat16"):
        check_paged_call(SPEC, batch.q, batch.kv_cache.float().to(torch.bfloat16), *batch.args()[2:])


# 1e40 and 10**400 overflow the float32 the kernels read; 1e-50 rounds to 0 there
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), torch.tensor(1.0), True,
                                 1e40, pytest.param(10 ** 400, id="10**400"), 1e-50])
def test_scales_must_be_positive_python_floats(bad):
    # check_scales is what every callable runs (JitKernel.paged_attention since f55bb99, which removed
    # runtime._scale that this test imported: the module failed to collect).
    with pytest.raises(ValueError, match="k_scale=.*positive finite Python float"):
        check_scales(SPEC, bad, 1.0)
    with pytest.raises(ValueError, match="v_scale=.*positive finite Python float"):
        check_scales(SPEC, 1.0, bad)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fp8_kernels_compile(arch, tmp_path):
    for spec in (AttentionSpec(32, 8, 128, kv_dtype="fp8"),
                 AttentionSpec(64, 8, 64, kv_dtype="fp8", sinks=True, window_left=127, kv_layout="HND")):
        entry, built = KernelCache(root=tmp_path, layers=()).get_or_build(spec, arch)
        assert built and entry.cubin.stat().st_size > 10_000

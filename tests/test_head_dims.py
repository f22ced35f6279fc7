"""Head dims that are multiples of 8 (8 .. 256): the spec's rule, the jit backend serving them, the torch
backends serving them too, and nvcc compiling their padded-tile kernels for sm_80 and sm_90a (slow), over
16-bit caches and FP8 ones (an FP8 row of 72 bytes is whole 8-byte chunks: the kernels copy it 8 bytes at a
time, kv_copy_bytes, and the page checks want that alignment).

The kernels' numbers at these dims: tests/test_gpu_head_dims.py (GPU).
"""

from __future__ import annotations

import re

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, reference, runtime, settings
from jitattn.backends import DeviceInfo, get_backend
from jitattn.cache import verify_entry
from jitattn.checks import check_kv_cache_layout
from jitattn.doctor import no_kernel_note
from jitattn.render import KERNEL_NAMES, render
from jitattn.selector import select
from jitattn.spec import kv_copy_bytes
from jitattn.testing import random_paged_batch, relative_error
from jitattn.variant import rotary_embedding
from tests.conftest import build_in_parallel, built
from tests.test_cache import compile_calls, fake_nvcc
from tests.test_cli import jitattn as run_cli

CPU = DeviceInfo.parse("cpu")
H100 = DeviceInfo.parse("h100")
HD72 = AttentionSpec(32, 8, 72)


# ---- the spec ---------------------------------------------------------------------------------------
def test_every_multiple_of_8_is_a_spec_and_others_name_the_rule():
    for d in range(8, 257, 8):
        assert AttentionSpec(8, 2, d).head_dim_qk == d
        assert AttentionSpec(8, 2, 64, d, kv_storage="ragged").head_dim_vo == d
    for d in (4, 12, 68, 252, 264):
        with pytest.raises(ValueError, match=rf"head_dim_qk={d}: expected ") as info:
            AttentionSpec(8, 2, d)
        assert "a multiple of 8" in str(info.value) and "[8, 256]" in str(info.value)
    with pytest.raises(ValueError, match=r"head_dim_vo=68: expected a multiple of 8 in \[8, 256\]"):
        AttentionSpec(8, 2, 64, 68, kv_storage="ragged")
    with pytest.raises(ValueError, match=r"head_dim_qk=584: expected a multiple of 16 in \[32, 1024\]"):
        AttentionSpec(16, 1, 584, 512, kv_storage="latent", sm_scale=0.1)  # latent keeps its rule


def test_fp8_cache_takes_every_multiple_of_8():
    for d in range(8, 257, 8):
        spec = AttentionSpec(8, 2, d, kv_dtype="fp8")
        assert spec.head_dim_qk == d and get_backend("jit").spec_reasons(spec, H100, "mixed") == [], d
        assert kv_copy_bytes(d, "float8_e4m3fn") == (16 if d % 16 == 0 else 8)
        assert kv_copy_bytes(d, "bfloat16") == 16
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fn' with kv_storage='ragged': FP8 K/V are supported "
                                         r"for the paged cache only"):
        AttentionSpec(8, 2, 72, kv_dtype="fp8", kv_storage="ragged")


def test_fp8_cache_takes_every_multiple_of_8():
    """FP8 rows of 8-byte chunks (head dims that are multiples of 8 only) and key transforms over FP8 at head dims
    that are not multiples of 32 are specs like any other (their GPU tests passed on 2026-12-06: GPU_TESTS.md)."""
    for d in (8, 72, 88, 248):
        assert AttentionSpec(8, 2, d, kv_dtype="fp8").head_dim_qk == d
    assert AttentionSpec(8, 2, 80, kv_dtype="fp8", variant=rotary_embedding(80)).head_dim_qk == 80
    assert "JITATTN_UNVERIFIED_FP8_PADDED" not in settings.VARIABLES


def _pool_pair(head_dim: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 token pool of one KV head as a (k_cache, v_cache) pair (page_size 1: pages of head_dim bytes),
    starting ``offset`` bytes into its buffer."""
    buf = torch.zeros(offset + 2 * 5 * head_dim, dtype=torch.uint8)
    both = buf[offset:].view(torch.float8_e4m3fn).view(2, 5, 1, 1, head_dim)
    return both[0], both[1]


def test_fp8_rows_of_8_byte_chunks_take_8_byte_aligned_pages():
    """Pages of 72 bytes (V of such a pool 8 bytes off a 16-byte boundary) pass the cache checks at 72; a
    16-byte row keeps the 16-byte rule, and 4 bytes off is refused at 72, each naming the alignment."""
    hd72, hd80 = (AttentionSpec(4, 1, d, kv_dtype="fp8", page_size=1) for d in (72, 80))
    k, v = _pool_pair(72, 0)
    assert k.stride(0) == 72 and v.data_ptr() % 16 == 8
    check_kv_cache_layout(hd72, (k, v))
    check_kv_cache_layout(hd72, torch.zeros(3, 2, 1, 1, 72, dtype=torch.float8_e4m3fn))  # V 72 bytes after K
    with pytest.raises(ValueError, match=r"kv_cache \(k_cache\): pages must start 8-byte aligned \(stride\(0\)=72 "
                                         r"elements, data_ptr % 8 = 4\)"):
        check_kv_cache_layout(hd72, _pool_pair(72, 4))
    with pytest.raises(ValueError, match=r"kv_cache \(k_cache\): pages must start 16-byte aligned .* data_ptr % 16 = 8"):
        check_kv_cache_layout(hd80, _pool_pair(80, 8))


# ---- serving ------------------------------------------------------------------------------------------
def test_jit_serves_every_multiple_of_8():
    for d in range(8, 257, 8):
        spec = AttentionSpec(8, 2, d)
        assert get_backend("jit").spec_reasons(spec, H100, "mixed") == [], d
        assert select(spec, H100, "mixed").backend.name == "jit", d
    assert get_backend("jit").spec_reasons(AttentionSpec(8, 2, 128, 88, kv_storage="ragged"), H100, "prefill") == []
    for name in ("sdpa", "flex", "reference"):  # none refuses a head dim that is a multiple of 8
        assert not [r for r in get_backend(name).spec_reasons(HD72, H100, "mixed") if "head_dim" in r], name


def test_load_kernel_goes_on_to_build(monkeypatch):
    built = []
    monkeypatch.setattr(runtime, "cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "JitKernel", lambda spec, dev: built.append((spec, dev)) or "kernel")
    assert jitattn.load_kernel(AttentionSpec(8, 8, 88), "cuda") == "kernel"
    assert built == [(AttentionSpec(8, 8, 88), torch.device("cuda", 0))]


def test_warmup_builds_padded_dims(tmp_path):
    assert no_kernel_note(HD72, "sm_90a") is None
    nvcc, log = fake_nvcc(tmp_path, "no-compile")
    proc = run_cli("warmup", "--spec", HD72.canonical_json(), "--arch", "sm_80", cache=tmp_path / "c",
                   env={"JITATTN_NVCC": str(nvcc)})
    assert "1 specs x 1 archs (sm_80)" in proc.stderr, proc.stdout + proc.stderr
    assert len(compile_calls(log)) == 1  # hd72 reaches nvcc (the refusing fake fails it)


HD8 = AttentionSpec(4, 4, 8, causal=False)


# ---- the torch backends at a padded dim, on the CPU ---------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("spec, backend", [
    pytest.param(spec, backend, id=f"{name}-{backend}")
    for name, spec in [("hd72-gqa4", HD72), ("hd8-noncausal", HD8),
                       ("hd88-fp16", AttentionSpec(8, 2, 88, q_dtype="float16"))]
    for backend in ("sdpa", "flex") if not (backend == "flex" and spec is HD8)])  # flex: below 16, next test
def test_torch_backends_match_reference_at_padded_dims(spec, backend):
    batch = random_paged_batch(spec, [5, 1, 0, 17], [9, 30, 4, 17], seed=5)
    want = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    got = get_backend(backend).build(spec, CPU)(*batch.args(), **batch.kwargs())
    assert got.shape == (23, spec.num_qo_heads, spec.head_dim_vo)
    assert relative_error(got, want) < 1e-2


def test_flex_refuses_hd8_before_compiling():
    # torch inductor's CUDA FlexAttention lowering raises NotImplementedError below 16
    with pytest.raises(ValueError, match=r"flex: head_dim_qk=8 not supported \(torch's compiled FlexAttention needs "
                                         r"head dims >= 16\)"):
        get_backend("flex").build(HD8, H100)


# ---- nvcc: the padded-tile kernels compile for sm_80 and sm_90a --------------------------------------
ARCHS = ("sm_80", "sm_90a")
COMPILED = {
    **{f"paged-hd{d}": AttentionSpec(32, 8, d) for d in (8, 24, 40, 72, 88, 136, 248)},
    "paged-hd16-fp8": AttentionSpec(32, 8, 16, kv_dtype="fp8"),
    # FP8 rows of 8-byte chunks: the tensor-core decode (group 4, the FP8 32-key tiles), the CUDA-core decode
    # (group 2, HND, page 1), its whole-window mode, and hd 8
    "paged-hd72-fp8": AttentionSpec(32, 8, 72, kv_dtype="fp8"),
    "paged-hd88-fp8-group2-hnd-page1": AttentionSpec(8, 4, 88, kv_dtype="fp8", kv_layout="HND", page_size=1),
    "paged-hd40-fp8-group8-window127-sinks": AttentionSpec(64, 8, 40, kv_dtype="fp8", window_left=127, sinks=True),
    "paged-hd8-fp8-noncausal": AttentionSpec(4, 4, 8, kv_dtype="fp8", causal=False),
    "paged-hd72-group1-fp16-softcap-sinks-hnd": AttentionSpec(8, 8, 72, q_dtype="float16", logits_soft_cap=30.0,
                                                              sinks=True, kv_layout="HND", page_size=7),
    "paged-hd88-rotary-window": AttentionSpec(16, 2, 88, variant=rotary_embedding(88), window_left=63),
    "paged-hd40-alibi-noncausal-group16": AttentionSpec(16, 1, 40, alibi=True, causal=False),
    # the tensor-core decode's whole-window mode on padded rows; hd 8's group 16, which its merge scratch
    # cannot hold (decode_mma_merge_fits), on the CUDA-core decode
    "paged-hd72-group8-window127-sinks": AttentionSpec(64, 8, 72, window_left=127, sinks=True),
    "paged-hd8-group16": AttentionSpec(16, 1, 8),
    "ragged-hd72x88-softcap": AttentionSpec(16, 4, 72, 88, kv_storage="ragged", logits_soft_cap=30.0),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return build_in_parallel(tmp_path_factory.mktemp("head-dims"), [(s, a) for s in COMPILED.values() for a in ARCHS])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_padded_head_dim_compiles(compiled, name, arch):
    spec = COMPILED[name]
    result = built(compiled, spec, arch)
    assert verify_entry(result.path) is None
    assert result.cubin.read_bytes()[:4] == b"\x7fELF"
    log = result.manifest["compiler_log"]
    kernels = ("prefill",) if spec.ragged else ("decode", "prefill")
    for kernel in kernels:
        assert f"Compiling entry function '{KERNEL_NAMES[kernel]}' for '{arch}'" in log, kernel
    prefill = log[log.index(f"'{KERNEL_NAMES['prefill']}'"):].split("Compiling entry function")[0]
    dims = (spec.head_dim_qk, spec.head_dim_vo)
    if arch == "sm_90a" and spec.kv_dtype == spec.q_dtype and all(d >= 32 for d in dims):
        # the wgmma prefill (tiles padded to 16) syncs on named barriers 1 and 2 besides 0; the mma.sync
        # prefill on 0 only. It spills as the multiple of 16 it pads to: three consumer warpgroups (paged
        # hd80 / hd96) spill 16 / 28 bytes at 160 registers; ragged specs keep two warpgroups and none
        assert "used 3 barriers" in prefill, log
        spill = int(re.search(r"(\d+) bytes spill stores", prefill).group(1))
        assert spill == 0 if spec.ragged else spill <= 32, log
    else:
        assert "spill stores" in prefill and not re.search(r"[1-9]\d* bytes spill stores", prefill), log
    if spec.kv_dtype == "float8_e4m3fn":  # the FP8 decodes spill nothing either
        decode = log[log.index(f"'{KERNEL_NAMES['decode']}'"):].split("Compiling entry function")[0]
        assert not re.search(r"[1-9]\d* bytes spill stores", decode), log


def test_padded_and_multiple_of_16_specs_render_no_switch():
    # the kernel paths follow from the spec's head dims inside the templates (PrefillSm90Traits,
    # DecodeMmaTraits): the rendered source defines nothing before common.cuh, padded or not
    for spec in (HD72, AttentionSpec(16, 4, 72, 88, kv_storage="ragged"), AttentionSpec(32, 8, 128)):
        head = render(spec).text.split('#include "common.cuh"')[0]
        assert all(line.startswith("//") for line in head.strip().splitlines()), (spec.name, head)

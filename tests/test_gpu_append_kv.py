"""append_kv's CUDA kernel against its torch path on the GPU (issue 19, items 2 and 4; ``pytest -m gpu``):
NHD, HND and pairs, bf16 / fp16 and FP8 caches (saturation included), -1 slots, strided K/V from a fused
projection, a decode step's batch (64 tokens, 8 KV heads, hd128), FP8 rows of 72 / 88 bytes (8-byte stores;
one KV head and pages of one slot: V 8 bytes off a 16-byte boundary). The two must agree bit for bit, and
the slots nobody writes must keep their sentinel."""

from __future__ import annotations

import pytest
import torch

from jitattn.kv_write import append_kv, kernel_reasons

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
SENTINEL = 3.0  # what every slot holds before the append: a slot written by mistake changes it


def _cache(form, layout, dtype, pages, page, heads, dim):
    shape = (pages, 2, page, heads, dim) if layout == "NHD" else (pages, 2, heads, page, dim)
    full = torch.full(shape, SENTINEL, dtype=dtype, device="cuda")
    if form == "single":
        return full
    if form == "vllm_flash_attn":
        both = torch.full((2, *shape[:1], *shape[2:]), SENTINEL, dtype=dtype, device="cuda")
        return both[0], both[1]
    return full[:, 0].contiguous(), full[:, 1].contiguous()


def _bits(cache):
    ts = [cache] if isinstance(cache, torch.Tensor) else list(cache)
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in ts]


@pytest.mark.parametrize("form", ["single", "vllm_flash_attn", "separate"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("src,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             (torch.bfloat16, FP8), (torch.float16, FP8)])
@pytest.mark.parametrize("tokens,heads,dim,page", [(64, 8, 128, 16), (37, 2, 64, 1), (300, 4, 256, 32), (37, 1, 72, 1),
                                                    (64, 3, 88, 16)])
def test_kernel_equals_the_torch_path(form, layout, src, cache_dtype, tokens, heads, dim, page, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-tokens // page) * 2 + 1
    qkv = torch.randn(tokens, 3 * heads, dim, generator=g, device="cuda").mul_(60).to(src)  # saturates FP8 at 1/8
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]  # strided: a fused projection's K and V
    slots = torch.randperm(pages * page, generator=g, device="cuda")[:tokens]
    slots[::7] = -1
    scales = {"k_scale": 0.125, "v_scale": 0.3} if cache_dtype == FP8 else {}
    got = _cache(form, layout, cache_dtype, pages, page, heads, dim)
    want = _cache(form, layout, cache_dtype, pages, page, heads, dim)
    kc = got[:, 0] if isinstance(got, torch.Tensor) else got[0]
    assert kernel_reasons(k, v, kc, kc) == []
    append_kv(k, v, got, slots, kv_layout=layout, impl="cuda", **scales)
    append_kv(k, v, want, slots, kv_layout=layout, impl="torch", **scales)
    torch.cuda.synchronize()
    for a, b in zip(_bits(got), _bits(want)):
        assert torch.equal(a, b)
    untouched = torch.ones(pages * page, dtype=torch.bool, device="cuda")
    untouched[slots[slots >= 0]] = False
    first = (got if isinstance(got, torch.Tensor) else got[0])
    k_pages = first[:, 0] if isinstance(got, torch.Tensor) else first
    rows = (k_pages if layout == "NHD" else k_pages.transpose(1, 2)).reshape(pages * page, -1)
    assert torch.all(rows[untouched].float() == SENTINEL)


def test_all_padding_writes_nothing(seed):
    cache = _cache("single", "NHD", torch.bfloat16, 4, 16, 8, 128)
    k = torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16)
    append_kv(k, k, cache, torch.full((5,), -1, dtype=torch.int64, device="cuda"), impl="cuda")
    assert torch.all(cache.float() == SENTINEL)


@pytest.mark.parametrize("form", ["single", "vllm_flash_attn", "separate"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype,dim", [(torch.bfloat16, 128), (FP8, 128), (FP8, 72)])
def test_memoised_layout_launches_equal_the_torch_path(monkeypatch, form, layout, cache_dtype, dim, seed):
    """A layout's later calls take the memo (no full checks): new K/V, another cache of the layout, another
    token count; each still equals the torch path bit for bit."""
    from jitattn import kv_write

    monkeypatch.setattr(kv_write, "_LAUNCHES", {})
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, page, pages = 8, 16, 9
    scales = {"k_scale": 0.125, "v_scale": 0.3} if cache_dtype == FP8 else {}
    full_checks = []
    for step, tokens in enumerate((64, 64, 37)):
        qkv = torch.randn(tokens, 3 * heads, dim, generator=g, device="cuda").mul_(60).to(torch.bfloat16)
        k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
        slots = torch.randperm(pages * page, generator=g, device="cuda")[:tokens]
        slots[::5] = -1
        got = _cache(form, layout, cache_dtype, pages, page, heads, dim)
        want = _cache(form, layout, cache_dtype, pages, page, heads, dim)
        if step == 1:  # the layout is memoised by now: the full checks must not run again
            real = kv_write.check_append
            monkeypatch.setattr(kv_write, "check_append", lambda *a: full_checks.append(a) or real(*a))
        append_kv(k, v, got, slots, kv_layout=layout, impl="cuda", **scales)
        append_kv(k, v, want, slots, kv_layout=layout, impl="torch", **scales)
        torch.cuda.synchronize()
        for a, b in zip(_bits(got), _bits(want)):
            assert torch.equal(a, b), (step, tokens)
    assert len(kv_write._LAUNCHES) == 1
    assert len(full_checks) == 2  # the two torch-path calls only

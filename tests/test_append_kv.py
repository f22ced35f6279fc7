"""append_kv (issue 19, item 2) on the CPU: the torch path against plain per-token indexing (NHD, HND,
pairs, -1 slots, FP8 scaling and saturation), the argument errors, the module description, and the
CUDA module compiled by nvcc (slow)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import jitattn
from jitattn.append_kv_module import KERNEL_NAMES, AppendKvModule
from jitattn.cache import KernelCache
from jitattn import kv_write
from jitattn.cli import collect_targets, parse_spec_arg
from jitattn.kv_write import append_kv, kernel_reasons, launch_fields

H, D, PAGE, PAGES = 2, 32, 4, 5
FP8 = torch.float8_e4m3fn


def _cache(layout: str, dtype: torch.dtype, form: str):
    """A NaN-free cache holding a known pattern, as one tensor or a pair."""
    shape = (PAGES, 2, PAGE, H, D) if layout == "NHD" else (PAGES, 2, H, PAGE, D)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).remainder(7).sub(3).reshape(shape).to(dtype)
    if form == "single":
        return full
    if form == "views":
        return full[:, 0], full[:, 1]
    return full[:, 0].contiguous(), full[:, 1].contiguous()


def _kv_views(cache, layout):
    k, v = (cache[:, 0], cache[:, 1]) if isinstance(cache, torch.Tensor) else cache
    return k, v


def _expected(cache, layout, k, v, slots, k_scale=1.0, v_scale=1.0):
    """Per token, plain indexing: the token's (page, offset) row of each head."""
    kc, vc = (t.clone() for t in _kv_views(cache, layout))
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, off = divmod(slot, PAGE)
        for dst, src, scale in ((kc, k, k_scale), (vc, v, v_scale)):
            row = src[t].float() * (1.0 / scale) if dst.dtype == FP8 else src[t]
            if dst.dtype == FP8:
                row = row.clamp(-448, 448)
            if layout == "NHD":
                dst[page, off] = row.to(dst.dtype)
            else:
                dst[page, :, off] = row.to(dst.dtype)
    return kc, vc


def _same(a, b):
    assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)


@pytest.mark.parametrize("form", ["single", "views", "separate"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_torch_path_equals_plain_indexing(form, layout, cache_dtype):
    g = torch.Generator().manual_seed(1)
    n = 6
    k = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    k[0, 0, 0], k[3, 1, 2] = 1e4, float("-inf")  # past e4m3's range either way: saturated
    slots = torch.tensor([0, 5, -1, 19, 8, -1], dtype=torch.int64)  # page 0, 1, skip, last slot, page 2
    scales = {"k_scale": 2.0 ** -7, "v_scale": 0.5} if cache_dtype == FP8 else {}  # k * 128 saturates often
    cache = _cache(layout, cache_dtype, form)
    want = _expected(cache, layout, k, v, slots, **scales)
    append_kv(k, v, cache, slots, kv_layout=layout, impl="torch", **scales)
    got = _kv_views(cache, layout)
    _same(got[0], want[0])
    _same(got[1], want[1])
    if cache_dtype == FP8:
        assert got[0].float().abs().max() == 448 and got[0].float().min() == -448  # saturated, not NaN
        assert not torch.isnan(got[0].float()).any()


def test_public_name_and_auto_on_cpu_uses_torch():
    cache = _cache("NHD", torch.float16, "single")
    k = torch.ones(1, H, D, dtype=torch.float16)
    jitattn.append_kv(k, -k, cache, torch.tensor([7]))
    assert torch.equal(cache[1, 0, 3], k[0]) and torch.equal(cache[1, 1, 3], -k[0])


def test_strided_k_v_from_a_fused_projection():
    qkv = torch.randn(3, 4 * H, D).to(torch.bfloat16)  # (tokens, q heads + k + v heads, D)
    k, v = qkv[:, 2 * H:3 * H], qkv[:, 3 * H:]
    cache = _cache("HND", torch.bfloat16, "separate")
    slots = torch.tensor([1, 2, 3])
    want = _expected(cache, "HND", k, v, slots)
    append_kv(k, v, cache, slots, kv_layout="HND")
    _same(cache[0], want[0])
    _same(cache[1], want[1])


def _errors():
    k = torch.zeros(2, H, D, dtype=torch.bfloat16)
    c = _cache("NHD", torch.bfloat16, "single")
    s = torch.tensor([0, 1])
    yield dict(k=k.float()), "k: dtype torch.float32 not supported"
    yield dict(v=k[:1]), "v: shape .* must equal k's"
    yield dict(k=k[0], v=k[0]), "k: expected 3 dims"
    yield dict(kv_cache=c[:, :1]), "kv_cache: expected a NHD tensor"
    yield dict(kv_cache=(c[:, 0],)), "a pair is \\(k_cache, v_cache\\)"
    yield dict(kv_cache=c.half()), "kv_cache: dtype torch.float16; a cache for torch.bfloat16"
    yield dict(kv_cache=c[..., :16]), "kv_cache: 2 heads of dim 16"
    yield dict(kv_cache=c[:1].expand(PAGES, *c.shape[1:])), r"kv_cache \(k_cache\): stride 0 in a dim of size > 1"
    yield dict(slot_mapping=s.int()), "slot_mapping: expected an int64"
    yield dict(slot_mapping=s[:1]), "slot_mapping: 1 slots for 2 tokens"
    yield dict(slot_mapping=torch.tensor([0, PAGES * PAGE])), "slot_mapping: values in \\[0, 20\\]; allowed: -1"
    yield dict(slot_mapping=torch.tensor([-2, 0])), "allowed: -1 \\(skip\\)"
    yield dict(k_scale=0.5), "k_scale=0.5: only an FP8"
    yield dict(kv_cache=c.to(FP8), v_scale=-1.0), r"v_scale=-1\.0: expected a positive finite Python float"
    yield dict(kv_cache=c.to(FP8), k_scale=torch.tensor(1.0)), r"k_scale=tensor\(1\.\): expected a positive finite Python float \(a tensor would need a sync\)"
    yield dict(kv_layout="THD"), "kv_layout='THD'"
    yield dict(impl="triton"), "impl='triton'"
    yield dict(impl="cuda"), "impl='cuda': the kernel cannot take these tensors: the tensors are on cpu"


@pytest.mark.parametrize("case", list(_errors()), ids=lambda c: c[1][:40])
def test_argument_errors_name_the_argument(case):
    over, match = case
    k = torch.zeros(2, H, D, dtype=torch.bfloat16)
    args = dict(k=k, v=k, kv_cache=_cache("NHD", torch.bfloat16, "single"), slot_mapping=torch.tensor([0, 1]))
    args.update(over)
    before = args["kv_cache"].clone() if isinstance(args["kv_cache"], torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        append_kv(args.pop("k"), args.pop("v"), args.pop("kv_cache") if before is None else args["kv_cache"],
                  args.pop("slot_mapping"), **{k2: v2 for k2, v2 in args.items() if k2 != "kv_cache"})
    if before is not None:
        _same(args["kv_cache"], before)  # nothing written


def test_the_kernel_takes_aligned_rows_only_and_packs_the_strides():
    k = torch.zeros(3, H, D, dtype=torch.bfloat16)
    cache = _cache("HND", FP8, "single")
    kc, vc = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    assert kernel_reasons(k, k, kc, vc) == ["the tensors are on cpu; the kernel needs CUDA tensors"]
    odd = torch.zeros(3, H, 20, dtype=torch.bfloat16)
    assert any("head_dim=20 is not a multiple of 8 (one 8-byte store of the cache)" in r
               for r in kernel_reasons(odd, odd, kc[..., :20], vc[..., :20]))
    eights = torch.zeros(3, H, 24, dtype=torch.bfloat16)  # FP8 rows of 24 bytes: 8-byte stores
    assert kernel_reasons(eights, eights, kc[..., :24], vc[..., :24]) == [
        "the tensors are on cpu; the kernel needs CUDA tensors"]
    f = launch_fields(k, k, kc, vc, torch.zeros(3, dtype=torch.int64), 0.5, 1.0)
    assert (f["k_cache_stride_page"], f["k_cache_stride_slot"], f["k_cache_stride_head"]) == (2 * H * PAGE * D, D,
                                                                                              PAGE * D)
    assert f["v_cache"] - f["k_cache"] == H * PAGE * D and f["num_slots"] == PAGES * PAGE
    assert f["k_inv_scale"] == 2.0 and f["v_inv_scale"] == 1.0


# ---- the CUDA module --------------------------------------------------------------------------------
def test_module_description_round_trips_and_is_a_warmup_spec():
    m = AppendKvModule("bf16", "fp8")
    assert m == AppendKvModule(torch.bfloat16, torch.float8_e4m3fn) and AppendKvModule("bf16").kv_dtype == "bfloat16"
    assert json.loads(m.canonical_json()) == {"dtype": "bfloat16", "kind": "append_kv", "kv_dtype": "float8_e4m3fn"}
    assert AppendKvModule.from_json(m.canonical_json()) == m and parse_spec_arg(m.canonical_json()) == [m]
    assert m.name.startswith("append_kv_bf16_fp8_")
    with pytest.raises(ValueError, match="kv_dtype='float16': append_kv takes kv_dtype in \\('bfloat16'"):
        AppendKvModule("bfloat16", "float16")
    text = m.render().text
    assert f"{KERNEL_NAMES['append_kv']}(const __grid_constant__" in text and "__NV_SATFINITE" in text
    assert "__NV_SATFINITE" not in AppendKvModule("float16").render().text  # a 16-bit cache is a copy


def test_model_warmup_and_export_collect_the_append_kv_module(tmp_path):
    config = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    targets = collect_targets([path], [], dtype=None, page_size=16, kv_layout="NHD", kv_dtype="float8_e4m3fn")
    modules = [t.spec for t in targets]
    assert AppendKvModule("bfloat16", "float8_e4m3fn") in modules
    assert [t.sources for t in targets if t.spec == AppendKvModule("bfloat16", "float8_e4m3fn")] == [["config/append_kv"]]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_builds_the_append_kv_module(tmp_path, arch):
    """One compile per arch: the FP8 module (the conversion path; the 16-bit one is a plain copy)."""
    cache = KernelCache(root=tmp_path / "c", layers=())
    module = AppendKvModule("bfloat16", "float8_e4m3fn")
    entry, built = cache.get_or_build(module, arch)
    assert built and entry.cubin.read_bytes()[:4] == b"\x7fELF"
    assert KERNEL_NAMES["append_kv"].encode() in entry.cubin.read_bytes()
    assert "0 bytes spill stores" in entry.manifest["compiler_log"]


@pytest.mark.parametrize("scales", [dict(v_scale=1e-45), dict(k_scale=1e-39), dict(k_scale=3.5e38), dict(k_scale=1e300)],
                         ids=["v-inverse-overflows", "k-inverse-overflows", "k-past-float32", "k-far-past-float32"])
def test_fp8_scales_float32_cannot_hold_are_refused_before_any_write(scales):
    """A scale past float32's range, or one whose float32 inverse (what the write multiplies by) is, is a
    ValueError naming it, raised before K is written (it was an OverflowError after K's write)."""
    k = torch.randn(2, 1, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    name = next(iter(scales))
    with pytest.raises(ValueError, match=rf"{name}="):
        jitattn.append_kv(k, k.clone(), cache, torch.tensor([0, 1]), **scales)
    assert not cache.float().any()
    c_kv, k_pe = torch.randn(2, 32, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16)
    latent = torch.zeros(2, 4, 48, dtype=torch.float8_e4m3fn)
    if name == "k_scale":
        with pytest.raises(ValueError, match=r"k_scale="):
            jitattn.append_latent_kv(c_kv, k_pe, latent, torch.tensor([0, 1]), k_scale=scales["k_scale"])
        assert not latent.float().any()


# ---- append_latent_kv against the latent spec ------------------------------------------------------
LATENT = jitattn.AttentionSpec(16, 1, 576, 512, kv_storage="latent", sm_scale=0.1, page_size=4)


@pytest.mark.parametrize("c_kv_width, k_pe_width, cache_kw, spec, match", [
    (448, 128, {}, LATENT, r"c_kv: width 448, but the spec's kv_lora_rank \(head_dim_vo\) is 512"),
    (512, 32, {}, LATENT.replace(head_dim_qk=544), None),  # the spec's own split: accepted
    (512, 64, {"page_size": 8}, LATENT, r"latent_cache: page size 8 \(dim 1\), but the spec's page_size is 4"),
    (512, 64, {"dtype": FP8}, LATENT, r"latent_cache: dtype torch.float8_e4m3fn, but the spec's kv_dtype is bfloat16"),
    (512, 64, {}, LATENT.replace(q_dtype="float16"), r"c_kv: dtype torch.bfloat16, but the spec's q_dtype is float16"),
    (512, 64, {}, jitattn.AttentionSpec(8, 2, 64), r"spec: expected the latent AttentionSpec \(kv_storage='latent'\)"),
], ids=["split-448-128", "own-split", "page-size", "cache-dtype", "q-dtype", "not-latent"])
def test_append_latent_kv_checks_each_part_against_the_spec(c_kv_width, k_pe_width, cache_kw, spec, match):
    """The cache's last dim only checks the sum of the widths: a 448 / 128 split fills a 576-wide row
    as well as 512 / 64 does. With ``spec`` each part is checked, naming the field, before any write."""
    c_kv = torch.randn(3, c_kv_width, dtype=torch.bfloat16)
    k_pe = torch.randn(3, k_pe_width, dtype=torch.bfloat16)
    cache = torch.zeros(4, cache_kw.get("page_size", 4), c_kv_width + k_pe_width,
                        dtype=cache_kw.get("dtype", torch.bfloat16))
    slots = torch.tensor([0, 5, 9])
    if match is None:
        jitattn.append_latent_kv(c_kv, k_pe, cache, slots, spec=spec)
        assert torch.equal(cache.view(-1, cache.shape[-1])[slots], torch.cat([c_kv, k_pe], 1))
        return
    with pytest.raises(ValueError, match=match):
        jitattn.append_latent_kv(c_kv, k_pe, cache, slots, spec=spec)
    assert not cache.float().any()
    jitattn.append_latent_kv(c_kv, k_pe, cache, slots)  # without the spec the split is the caller's


# ---- the kernel path's per-layout memo, on the CPU ----------------------------------------------------
class _Recorder:
    """A launcher that keeps each launch's grid and Params bytes instead of running it."""

    def __init__(self):
        self.launches = []

    def launch(self, kernel, grid, block, smem, params, stream):
        assert type(params) is bytes  # what CudaDriver.launch_kernel's ctypes.create_string_buffer takes
        assert (kernel, block, smem, stream) == ("append_kv", 128, 0, 7)
        self.launches.append((grid, params))


@pytest.fixture
def fake_cuda(monkeypatch):
    """append_kv's kernel path on CPU tensors: the kernel's CPU refusal dropped, the loader returning a
    kernel whose launches are recorded, and an empty memo (restored after the test)."""
    recorder = _Recorder()
    kernels = {}

    def load(dtype, kv_dtype, device=None):
        module = AppendKvModule(str(dtype), str(kv_dtype))
        if module not in kernels:
            kernels[module] = kv_write.AppendKvKernel.from_module(module, recorder, device=torch.device("cpu"),
                                                                 stream_handle=lambda: 7)
        return kernels[module]

    reasons = kv_write.kernel_reasons
    monkeypatch.setattr(kv_write, "kernel_reasons", lambda *a: [r for r in reasons(*a) if "needs CUDA" not in r])
    monkeypatch.setattr(kv_write, "load_append_kv_kernel", load)
    monkeypatch.setattr(kv_write, "_LAUNCHES", {})
    return recorder


def _slow_bytes(k, v, cache, slots, layout, k_scale=1.0, v_scale=1.0):
    """The Params bytes of the full path, packed as before the memo: launch_fields + merge's params_packer."""
    from jitattn.merge import params_packer

    kc, vc = (cache[:, 0], cache[:, 1]) if isinstance(cache, torch.Tensor) else cache
    if layout == "HND":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    module = AppendKvModule(str(k.dtype).removeprefix("torch."), str(kc.dtype).removeprefix("torch."))
    packer, order = params_packer(module)
    fields = launch_fields(k, v, kc, vc, slots.contiguous(), k_scale, v_scale)
    return packer.pack(*(fields[n] for n in order))


def _layout(form, layout, dtype, pages=PAGES):
    shape = (pages, 2, PAGE, H, D) if layout == "NHD" else (pages, 2, H, PAGE, D)
    if form == "single":
        return torch.zeros(shape, dtype=dtype)
    if form == "vllm_flash_attn":  # (2, num_blocks, ...): K is [0], V is [1]
        both = torch.zeros(2, shape[0], *shape[2:], dtype=dtype)
        return both[0], both[1]
    return torch.zeros(shape[0], *shape[2:], dtype=dtype), torch.zeros(shape[0], *shape[2:], dtype=dtype)


def _rows(n, strided):
    if strided:  # a fused projection's K and V: token stride 3 * H * D
        qkv = torch.randn(n, 3 * H, D).to(torch.bfloat16)
        return qkv[:, H:2 * H], qkv[:, 2 * H:]
    return torch.randn(n, H, D).to(torch.bfloat16), torch.randn(n, H, D).to(torch.bfloat16)


@pytest.mark.parametrize("form, layout, cache_dtype, strided", [
    ("single", "NHD", torch.bfloat16, False), ("single", "HND", torch.bfloat16, False),
    ("separate", "NHD", torch.bfloat16, False), ("vllm_flash_attn", "HND", torch.bfloat16, True),
    ("single", "NHD", FP8, False), ("separate", "HND", FP8, True), ("single", "NHD", torch.bfloat16, True),
], ids=["nhd", "hnd", "pair-nhd", "vllm-pair-hnd-strided", "fp8", "fp8-pair-hnd-strided", "nhd-strided"])
def test_memoised_launches_pack_the_bytes_of_the_full_path(fake_cuda, monkeypatch, form, layout, cache_dtype, strided):
    """Each layout's first call runs the full checks and memoises; the later ones (new tensors of the layout,
    another cache of its shape, 1 to 5 tokens) skip them and patch the pointers and the token count into
    the memoised bytes: every launch's bytes must equal the full path's."""
    scales = {"k_scale": 0.5, "v_scale": 3.0} if cache_dtype == FP8 else {}
    calls = []
    for n, slot_list in ((3, [0, 7, 19]), (5, [1, -1, 4, 12, 8]), (1, [2]), (3, [3, 5, 6]), (1, [11])):
        k, v = _rows(n, strided)
        cache = _layout(form, layout, cache_dtype)  # a new cache of the same layout each call
        calls.append((k, v, cache, torch.tensor(slot_list)))
    kv_write.append_kv(*calls[0], kv_layout=layout, **scales)  # memoises the layout of > 1 token
    kv_write.append_kv(*calls[2], kv_layout=layout, **scales)  # and of 1 token (its dim-0 stride is unchecked)
    assert len(kv_write._LAUNCHES) == 2
    monkeypatch.setattr(kv_write, "check_append", lambda *a: pytest.fail("a memoised layout ran the full checks"))
    for call in calls[1:]:
        kv_write.append_kv(*call, kv_layout=layout, **scales)
    assert len(kv_write._LAUNCHES) == 2
    order = [calls[0], calls[2], *calls[1:]]
    assert [grid for grid, _ in fake_cuda.launches] == [(c[0].shape[0], 1, 1) for c in order]
    for (_, got), call in zip(fake_cuda.launches, order):
        assert got == _slow_bytes(*call, layout, **scales)


def test_a_cache_of_another_shape_or_strides_gets_its_own_memo_entry(fake_cuda):
    small, big = _layout("single", "NHD", torch.bfloat16), _layout("single", "NHD", torch.bfloat16, pages=PAGES + 3)
    every_other = _layout("single", "NHD", torch.bfloat16, pages=2 * PAGES)[::2]  # small's shape, twice its page stride
    slots = torch.tensor([0, 19])
    for cache in (small, big, every_other, small, big, every_other, big):
        k, v = _rows(2, False)
        kv_write.append_kv(k, v, cache, slots)
        assert fake_cuda.launches[-1][1] == _slow_bytes(k, v, cache, slots, "NHD")
    assert len(kv_write._LAUNCHES) == 3


def test_a_non_contiguous_slot_mapping_is_copied_on_the_memoised_path(fake_cuda, monkeypatch):
    cache = _layout("single", "NHD", torch.bfloat16)
    k, v = _rows(3, False)
    wide = torch.tensor([[0, 9], [4, 9], [8, 9]])[:, 0]  # stride 2
    kv_write.append_kv(k, v, cache, wide)
    contiguous = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a: contiguous.append(t.data_ptr()) or real(t, *a))
    kv_write.append_kv(k, v, cache, wide)
    assert contiguous == [wide.data_ptr()]
    ptr = kv_write.StructLayout(AppendKvModule("bfloat16").fields).placed["slot_mapping"][1]
    assert all(b[ptr:ptr + 8] != wide.data_ptr().to_bytes(8, "little") for _, b in fake_cuda.launches)


def test_a_misaligned_call_of_a_memoised_layout_takes_the_full_path(fake_cuda):
    """Same shapes and strides, K 8 bytes off a 16-byte boundary: the kernel cannot take it, so "auto" writes
    with torch (nothing launched) and "cuda" raises the full path's error."""
    cache = _layout("single", "NHD", torch.bfloat16)
    k, v = _rows(2, False)
    slots = torch.tensor([0, 5])
    kv_write.append_kv(k, v, cache, slots)
    buf = torch.randn(2 * H * D + 4).to(torch.bfloat16)
    odd = buf[4:].view(2, H, D)  # 4 bf16 = 8 bytes in
    assert odd.stride() == k.stride() and odd.data_ptr() % 16 == 8
    kv_write.append_kv(odd, v, cache, slots)
    assert len(fake_cuda.launches) == 1 and torch.equal(cache[0, 0, 0], odd[0]) and torch.equal(cache[1, 1, 1], v[1])
    with pytest.raises(ValueError, match="impl='cuda': the kernel cannot take these tensors: k: rows are not 16-byte"):
        kv_write.append_kv(odd, v, cache, slots, impl="cuda")
    assert len(fake_cuda.launches) == 1


@pytest.mark.parametrize("case", [c for c in _errors() if "tensors are on cpu" not in c[1]], ids=lambda c: c[1][:40])
def test_argument_errors_are_the_same_with_the_layout_memoised(fake_cuda, case):
    """Every error of test_argument_errors_name_the_argument, raised before any launch or write, after the
    valid call of the same layout has been memoised (impl='cuda' on CPU tensors is not an error here)."""
    k = torch.zeros(2, H, D, dtype=torch.bfloat16)
    base = dict(k=k, v=k, kv_cache=_cache("NHD", torch.bfloat16, "single"), slot_mapping=torch.tensor([0, 1]))
    kv_write.append_kv(*base.values())
    kv_write.append_kv(*base.values(), impl="cuda")
    assert len(kv_write._LAUNCHES) == 2 and len(fake_cuda.launches) == 2
    over, match = case
    args = {**base, **over}
    positional = [args.pop(n) for n in ("k", "v", "kv_cache", "slot_mapping")]
    cache = positional[2]
    before = cache.clone() if isinstance(cache, torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        kv_write.append_kv(*positional, **args)
    assert len(fake_cuda.launches) == 2
    if before is not None:
        _same(cache, before)  # nothing written


def test_scales_of_another_type_never_reuse_a_memoised_layout(fake_cuda):
    """A bool is refused though ``True == 1.0``; an int is a Python number check_scale takes."""
    cache = _cache("NHD", FP8, "single")
    k = torch.ones(2, H, D, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    kv_write.append_kv(k, k, cache, slots, k_scale=1.0)
    with pytest.raises(ValueError, match=r"k_scale=True: expected a positive finite Python float"):
        kv_write.append_kv(k, k, cache, slots, k_scale=True)
    kv_write.append_kv(k, k, cache, slots, k_scale=2)
    assert len(fake_cuda.launches) == 2 and fake_cuda.launches[1][1] == _slow_bytes(k, k, cache, slots, "NHD", 2.0)
    with pytest.raises(ValueError, match=r"kv_layout=\['NHD'\]"):
        kv_write.append_kv(k, k, cache, slots, kv_layout=["NHD"])  # unhashable: no memo lookup, the same error


def test_the_memo_holds_no_tensor_and_is_bounded(fake_cuda):
    cache = _layout("separate", "HND", torch.bfloat16)
    k, v = _rows(2, True)
    kv_write.append_kv(k, v, cache, torch.tensor([0, 3]), kv_layout="HND")
    refs = [weakref.ref(t) for t in (*cache, k, v)]
    del cache, k, v
    gc.collect()
    assert len(kv_write._LAUNCHES) == 1 and all(r() is None for r in refs)
    first = next(iter(kv_write._LAUNCHES))
    for pages in range(1, kv_write.MEMO_SIZE + 4):  # a cache of each size: a layout each
        k, v = _rows(1, False)
        kv_write.append_kv(k, v, _layout("single", "NHD", torch.bfloat16, pages=pages), torch.tensor([0]))
    assert len(kv_write._LAUNCHES) == kv_write.MEMO_SIZE and first not in kv_write._LAUNCHES
    kv_write.clear_launch_memo()
    assert not kv_write._LAUNCHES


def test_fp8_rows_of_8_byte_chunks_take_the_kernel_on_8_byte_aligned_caches(fake_cuda):
    """An FP8 cache of head_dim 72 (rows of 72 bytes, whole 8-byte chunks) takes the kernel's 8-byte stores: a
    cache of one KV head and pages of one slot, whose V starts 72 bytes after K (8 bytes off a 16-byte
    boundary), launches and is memoised; a cache 4 bytes off is refused by name."""
    cache = torch.zeros(5, 2, 1, 1, 72, dtype=FP8)
    k, v = (torch.randn(3, 1, 72).to(torch.bfloat16) for _ in range(2))
    assert cache[:, 1].data_ptr() % 16 == 8
    slots, again = torch.tensor([0, 3, 4]), torch.tensor([4, 1, 2])
    kv_write.append_kv(k, v, cache, slots, k_scale=0.5)
    kv_write.append_kv(k, v, cache, again, k_scale=0.5)
    assert len(fake_cuda.launches) == 2 and len(kv_write._LAUNCHES) == 1
    assert fake_cuda.launches[1][1] == _slow_bytes(k, v, cache, again, "NHD", k_scale=0.5)
    shifted = torch.zeros(cache.numel() + 4, dtype=torch.uint8)[4:].view(FP8).view(cache.shape)
    with pytest.raises(ValueError, match="k_cache: rows are not 8-byte aligned"):
        kv_write.append_kv(k, v, shifted, slots, k_scale=0.5, impl="cuda")
    assert len(fake_cuda.launches) == 2

"""The MLA decode kernel (templates/mla_decode.cuh) on the CPU: it renders, compiles through the cache for sm_80
and sm_90a without spilling, the jit backend serves latent specs with it (sdpa those whose head dims it does not
take), and plan / run launch it with the grid, split factor and scratch the kernel reads. The kernel's results
are checked on the GPU (tests/test_gpu_mla.py)."""

from __future__ import annotations

import re
import struct

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, runtime
from jitattn.cache import verify_entry
from jitattn.planning import LATENT_MAX_QUERY_SLOTS, LATENT_TILE_ROWS
from jitattn.render import KERNEL_NAMES, render
from jitattn.selector import select
from jitattn.spec import latent_kernel_problem
from jitattn.testing import random_paged_batch
from tests import launch_cases as lc
from tests.conftest import build_in_parallel, built
from tests.test_plan_launches import Recorder, fake_kernel

SCALE = 0.1352337788608801  # DeepSeek-V3's


def latent(heads: int = 16, page_size: int = 64, q_dtype: str = "bfloat16", **kw) -> AttentionSpec:
    return AttentionSpec(heads, 1, 576, 512, kv_storage="latent", page_size=page_size, q_dtype=q_dtype,
                         sm_scale=SCALE, **kw)


# ---- render and compile -------------------------------------------------------------------------------
def test_a_latent_spec_renders_the_mla_decode_kernel_alone():
    text = render(latent()).text
    assert "#include \"mla_decode.cuh\"" in text and "jitattn::mla_decode_kernel<jitattn::Spec>(params)" in text
    assert KERNEL_NAMES["prefill"] not in text and "prefill.cuh" not in text
    assert "static constexpr int kNumQoHeads = 16;" in text and "static constexpr int kHeadDimQK = 576;" in text
    paged = render(AttentionSpec(32, 8, 128)).text
    assert "mla_decode" not in paged and KERNEL_NAMES["prefill"] in paged


def _check_cubin(entry, arch: str) -> None:
    assert verify_entry(entry.path) is None
    data = entry.cubin.read_bytes()
    elf_arch = (struct.unpack_from("<I", data, 48)[0] >> 8) & 0xFF  # e_flags' SM number
    assert data[:4] == b"\x7fELF" and elf_arch == int(re.sub(r"\D", "", arch))
    log = entry.manifest["compiler_log"]
    assert f"Compiling entry function '{KERNEL_NAMES['decode']}' for '{arch}'" in log
    assert KERNEL_NAMES["prefill"] not in log
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log)
    assert not re.search(r"[1-9]\d* bytes spill", log)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """The DeepSeek-V3 TP 8 decode spec (16 heads, pages of 64) for both archs, in one temporary cache."""
    return build_in_parallel(tmp_path_factory.mktemp("mla-compile"), [(latent(), a) for a in ("sm_80", "sm_90a")])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_mla_decode_kernel_compiles_through_the_cache_without_spills(compiled, arch):
    _check_cubin(built(compiled, latent(), arch), arch)


SLOW_SPECS = {"h1-p1-f16": latent(1, 1, "float16"), "h128-p16": latent(128, 16), "h20-p64": latent(20, 64),
              "h64-p1": latent(64, 1), "h16-p64-fp8": latent(16, 64, kv_dtype="float8_e4m3fn"),
              "h128-p1-f16-fp8": latent(128, 1, "float16", kv_dtype="float8_e4m3fn")}


@pytest.fixture(scope="module")
def compiled_more(tmp_path_factory) -> dict:
    work = [(s, a) for s in SLOW_SPECS.values() for a in ("sm_80", "sm_90a")]
    return build_in_parallel(tmp_path_factory.mktemp("mla-compile-more"), work)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name", sorted(SLOW_SPECS))
def test_the_group_sizes_and_page_sizes_of_the_gpu_suite_compile(compiled_more, name, arch):
    _check_cubin(built(compiled_more, SLOW_SPECS[name], arch), arch)


# ---- serving -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_the_jit_backend_serves_latent_specs_on_sm_90_and_sm_80(q_dtype, kv_dtype):
    spec = latent(16, 64, q_dtype, kv_dtype=kv_dtype)
    assert latent_kernel_problem(spec) is None
    for device in ("h100", "sm_90", "a100", "sm_80"):
        sel = select(spec, device)
        assert sel.name == "jit", device
        assert not [r for rej in sel.passed_over if rej.backend == "jit" for r in rej.reasons], device
        assert select(spec, device, need_lse=True).name == "jit", device
    for heads in (1, 20, 128):
        assert select(latent(heads, 1, q_dtype, kv_dtype=kv_dtype), "h100").name == "jit", heads


def test_an_fp8_latent_spec_renders_the_fp8_kernel():
    text = render(latent(16, 64, kv_dtype="float8_e4m3fn")).text
    assert "using DTypeKV = __nv_fp8_e4m3;" in text and "mla_decode_kernel" in text


@pytest.mark.parametrize("kw, problem", [
    (dict(head_dim_qk=288, head_dim_vo=256), "head_dim_qk=288: the MLA decode kernel takes latent head dims that "
                                             "are multiples of 64 (576 / 512 for DeepSeek); the sdpa and reference "
                                             "backends serve this one"),
    (dict(head_dim_qk=576, head_dim_vo=496), "head_dim_vo=496: the MLA decode kernel takes latent head dims"),
])
def test_what_the_kernel_cannot_serve_stays_with_sdpa_with_its_reason(kw, problem, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("reached the device / compile step")

    monkeypatch.setattr(runtime, "JitKernel", boom)  # the refusal comes before any device or compile work
    monkeypatch.setattr(runtime, "cuda_device", boom)
    spec = AttentionSpec(16, 1, kv_storage="latent", sm_scale=SCALE, **{"head_dim_qk": 576, "head_dim_vo": 512, **kw})
    assert latent_kernel_problem(spec).startswith(problem)
    for device in ("h100", "sm_80"):
        sel = select(spec, device)
        assert sel.name == "sdpa", device
        assert any(r.startswith(f"jit: {problem}") for rej in sel.passed_over for r in rej.reasons), device
    with pytest.raises(ValueError, match=re.escape(problem)):
        jitattn.load_kernel(spec, "cuda")
    batch = random_paged_batch(spec, [1], [10], device="cpu")
    with pytest.raises(ValueError, match=re.escape(problem)):
        jitattn.plan(spec, batch.block_table, batch.seq_lens, batch.query_start_loc)
    assert latent_kernel_problem(AttentionSpec(16, 1, 128)) is None and latent_kernel_problem(latent()) is None
    assert latent_kernel_problem(latent(kv_dtype="float8_e4m3fn")) is None


class _Built(Exception):
    """Raised by the stand-in kernel: the call got as far as building the spec's kernel."""


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_load_kernel_and_plan_go_on_to_build_a_latent_spec(kv_dtype, monkeypatch):
    spec = latent(kv_dtype=kv_dtype)
    built = []

    def build(s, dev):
        built.append((s, dev))
        raise _Built

    monkeypatch.setattr(runtime, "_KERNELS", runtime.LoadedOnce())  # the stand-in stays out of the process's kernels
    monkeypatch.setattr(runtime, "cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "JitKernel", build)
    with pytest.raises(_Built):
        jitattn.load_kernel(spec, "cuda")
    batch = random_paged_batch(spec, [1], [10], device="cpu")
    with pytest.raises(_Built):
        jitattn.plan(spec, batch.block_table, batch.seq_lens, batch.query_start_loc)
    assert built == [(spec, torch.device("cuda", 0))] * 2


# ---- plan / run -----------------------------------------------------------------------------------------
def _launch(spec, q_lens, kv_lens, **kw):
    kernel, module = fake_kernel(spec)
    batch = random_paged_batch(spec, q_lens, kv_lens, device="cpu", seed=3)
    result = kernel.paged_attention(*batch.args(), **kw)
    (launch,) = module.launches
    return kernel, batch, result, launch


def test_an_fp8_latent_cache_takes_its_k_scale_as_both_scales():
    spec = latent(16, 64, kv_dtype="float8_e4m3fn")
    kernel, module = fake_kernel(spec)
    batch = random_paged_batch(spec, [1, 2], [100, 50], device="cpu", seed=1)
    kernel.paged_attention(*batch.args(), k_scale=0.25)
    (launch,) = module.launches
    assert (launch["fields"]["k_scale"], launch["fields"]["v_scale"]) == (0.25, 0.25)
    with pytest.raises(ValueError, match=r"v_scale=0.5: a latent cache has one scale, k_scale"):
        kernel.paged_attention(*batch.args(), k_scale=0.25, v_scale=0.5)


def test_a_latent_cache_with_strided_rows_is_refused_naming_its_dims():
    spec = latent(16, 64)
    kernel, module = fake_kernel(spec)
    batch = random_paged_batch(spec, [1], [100], device="cpu", seed=1)
    wide = torch.zeros(*batch.kv_cache.shape[:2], 640, dtype=batch.kv_cache.dtype)[..., :576]  # rows 640 apart
    args = list(batch.args())
    args[1] = wide
    with pytest.raises(ValueError, match=r"kv_cache: dims 1-2 must be contiguous \(strides \(576, 1\)\), got \(640"):
        kernel.paged_attention(*args)
    assert module.launches == []


def test_one_launch_of_the_mla_kernel_serves_every_row_of_a_mixed_batch():
    """1 and 4 queries per sequence, an empty sequence: one decode launch, grid (splits, slots, batch)."""
    spec = latent(128)
    kernel, batch, (out, lse), launch = _launch(spec, [1, 4, 0], [300, 900, 0], return_lse=True, max_query_len=4)
    tiles = 128 // LATENT_TILE_ROWS
    splits = kernel.num_splits(3 * 4 * tiles, kernel.max_decode_keys(batch.block_table.shape[1]))
    assert (launch["kernel"], launch["grid"]) == ("decode", [splits, 4 * tiles, 3])
    assert (launch["block"], launch["smem"]) == (lc.GEOMETRY["decode_threads"], lc.GEOMETRY["decode_smem"])
    f = launch["fields"]
    assert f["num_splits"] == splits > 1 and f["total_q"] == 5 and f["batch_size"] == 3
    assert f["q_stride_token"] == 128 * 576 and f["q_stride_head"] == 576 and f["kv_stride_page"] == 64 * 576
    assert f["o"] == out.data_ptr() and f["lse"] == lse.data_ptr() and f["q"] == batch.q.data_ptr()
    assert f["block_table_stride"] == batch.block_table.shape[1] and f["prefill_skip_decode_rows"] == 0
    # partial states per (split, query row, head), one counter per (query row, tile of 16 heads)
    counters = next(iter(kernel._split_counters.values()))
    assert counters.numel() >= 5 * tiles and f["split_counters"] == counters.data_ptr()
    assert f["partial_lse"] - f["partial_o"] == 4 * splits * 5 * 128 * 512



def test_a_numpy_max_query_len_launches_the_grid_an_int_gives():
    """max_query_len sets the latent grid's query slots: numpy's integer is taken as its int (the driver
    binding's launch memo is keyed on exact ints; the recorder asserts them)."""
    np = pytest.importorskip("numpy")
    _, _, _, launch = _launch(latent(128), [1, 4, 0], [300, 900, 0], max_query_len=np.int64(4))
    _, _, _, plain = _launch(latent(128), [1, 4, 0], [300, 900, 0], max_query_len=4)
    assert launch["grid"] == plain["grid"]

def test_groups_that_are_not_whole_tiles_run_one_split_and_graph_mode_bounds_the_slots():
    kernel, batch, out, launch = _launch(latent(20), [1], [32768])  # no max_query_len: slots from total_q
    assert launch["grid"] == [1, 1 * 2, 1] and launch["fields"]["num_splits"] == 1
    assert launch["fields"]["partial_o"] == 0 and launch["fields"]["split_counters"] == 0
    kernel, batch, out, launch = _launch(latent(16), [3] * 5, [700] * 5)
    assert launch["grid"][1:] == [LATENT_MAX_QUERY_SLOTS, 5]  # 15 queries could be one sequence's: 8 slots
    _, _, _, launch = _launch(latent(16), [1], [32768], max_query_len=1)
    assert launch["grid"][:2] == [64, 1]  # one block per split: the 32,768 keys over a full wave


# ---- the warpgroup-MMA kernel for sm_90a (templates/mla_decode_sm90.cuh): 16-bit caches' sm_90a cubin ----
# A latent cubin whose sm_90a kernel takes tiles of 64 flattened query rows: no prefill kernel (prefill_threads 0),
# the tile in prefill_block_m (attention.cu.j2's MlaLaunch geometry).
SM90_GEOMETRY = {"decode_threads": 256, "decode_smem": 230912, "decode_tile_keys": 64, "prefill_threads": 0,
                 "prefill_smem": 0, "prefill_block_m": 64, "prefill_block_n": 0}
# The swapped-operand kernel at 16 heads over a bf16 cache (MlaSm90SwapTraits: tiles of 16 flattened rows).
SWAP_GEOMETRY = {"decode_threads": 128, "decode_smem": 171280, "decode_tile_keys": 64, "prefill_threads": 0,
                 "prefill_smem": 0, "prefill_block_m": 16, "prefill_block_n": 0}


def _cubin_geometry(entry) -> dict[str, int]:
    """The cubin's launch geometry table (runtime._GEOMETRY order) read from its ELF symbol table, no GPU."""
    data = entry.cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shnum, = struct.unpack_from("<H", data, 0x3C)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i) for i in range(shnum)]
    symtab = next(sec for sec in sections if sec[1] == 2)  # SHT_SYMTAB
    strtab = sections[symtab[6]]
    for off in range(symtab[4], symtab[4] + symtab[5], 24):
        name, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
        end = data.index(b"\0", strtab[4] + name)
        if data[strtab[4] + name:end] == KERNEL_NAMES["geometry"].encode():
            raw = struct.unpack_from(f"<{size // 4}i", data, sections[shndx][4] + value)
            return dict(zip(runtime._GEOMETRY, raw))
    raise AssertionError(f"no {KERNEL_NAMES['geometry']} in {entry.cubin}")


def test_every_latent_render_holds_both_kernels_and_the_cubin_picks():
    # One source for both archs: MlaLaunch picks the kernel at compile time (the sm_90a feature macro and the
    # spec), so a bf16 and an FP8 spec render the same dispatch; which one runs is the cubin's geometry (below).
    for spec in (latent(), latent(kv_dtype="float8_e4m3fn")):
        text = render(spec).text
        assert "#include \"mla_decode_sm90.cuh\"" in text and "MlaLaunch<jitattn::Spec>::kSm90" in text
        assert "jitattn::mla_decode_sm90_kernel<jitattn::Spec, jitattn::MlaLaunch<jitattn::Spec>::T>(params)" in text
        assert "jitattn::mla_decode_kernel<jitattn::Spec>(params)" in text
    assert "mla_decode" not in render(AttentionSpec(32, 8, 128)).text  # paged specs: no MLA kernel


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_a_16_head_latent_cubin_runs_the_swapped_operand_kernel_on_sm_90a_only(compiled, arch):
    entry = built(compiled, latent(), arch)
    g = _cubin_geometry(entry)
    assert g["params_size"] == runtime.ParamsLayout(latent()).size
    g.pop("params_size")
    log = entry.manifest["compiler_log"]
    if arch == "sm_90a":
        assert g == SWAP_GEOMETRY
        assert "used 1 barriers" in log  # one warpgroup: no named barrier
    else:
        assert (g["decode_threads"], g["prefill_threads"], g["prefill_block_m"]) == (128, 0, 0)


@pytest.mark.slow
def test_a_128_head_bf16_latent_cubin_runs_the_64_row_kernel_on_sm_90a(compiled_more):
    entry = built(compiled_more, SLOW_SPECS["h128-p16"], "sm_90a")
    g = _cubin_geometry(entry)
    g.pop("params_size")
    assert g == SM90_GEOMETRY
    assert "used 2 barriers" in entry.manifest["compiler_log"]  # the two warpgroups exchange maxima and P


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n in SLOW_SPECS if "fp8" in n))
def test_an_fp8_latent_cubin_runs_the_swapped_kernel_up_to_32_heads_else_mma_sync_and_plans_its_tiles(
        compiled_more, name):
    # Up to 32 heads an FP8 cache runs the swapped-operand kernel on sm_90a, raw tiles widened in registers (two
    # blocks per SM at 16 rows: 227 KiB of shared memory each SM); a larger group stays on mma.sync (#20).
    spec = SLOW_SPECS[name]
    g90, g80 = (_cubin_geometry(built(compiled_more, spec, a)) for a in ("sm_90a", "sm_80"))
    assert (g80["decode_threads"], g80["prefill_block_m"]) == (128, 0)
    swapped = spec.num_qo_heads <= 32
    assert (g90["decode_threads"], g90["prefill_block_m"]) == ((128, 16) if swapped else (128, 0))
    if spec.num_qo_heads <= 16:
        assert 2 * (g90["decode_smem"] + 1024) <= 227 * 1024, g90
    assert "used 2 barriers" not in built(compiled_more, spec, "sm_90a").manifest["compiler_log"]
    g80.pop("params_size")
    module = Recorder()
    kernel = runtime.JitKernel.from_module(spec, module, g80, device=torch.device("cpu"), num_sms=lc.NUM_SMS,
                                           decode_blocks_per_sm=1, stream_handle=lambda: lc.STREAM)
    module.kernel = kernel
    batch = random_paged_batch(spec, [4, 1], [900, 300], device="cpu", seed=3)
    kernel.paged_attention(*batch.args(), max_query_len=4, k_scale=0.25)
    (launch,) = module.launches
    tiles = -(-spec.num_qo_heads // LATENT_TILE_ROWS)  # per query: tiles of 16 heads, not flattened rows
    assert launch["grid"][1:] == [4 * tiles, 2] and launch["block"] == 128


def _launch_sm90(spec, q_lens, kv_lens, **kw):
    module = Recorder()
    kernel = runtime.JitKernel.from_module(spec, module, SM90_GEOMETRY, device=torch.device("cpu"),
                                           num_sms=lc.NUM_SMS, decode_blocks_per_sm=1, stream_handle=lambda: lc.STREAM)
    module.kernel = kernel
    batch = random_paged_batch(spec, q_lens, kv_lens, device="cpu", seed=3)
    result = kernel.paged_attention(*batch.args(), **kw)
    (launch,) = module.launches
    return kernel, batch, result, launch


def test_the_sm90_geometry_plans_tiles_of_64_flattened_rows_and_splits_every_group():
    # 16 heads x 1 query: one tile (48 padding rows); the split count by the wave rule over batch x slots.
    kernel, batch, out, launch = _launch_sm90(latent(16), [1], [32768], max_query_len=1)
    splits = kernel.num_splits(1, kernel.max_decode_keys(batch.block_table.shape[1]))
    assert launch["grid"] == [splits, 1, 1] and splits > 1 and launch["block"] == 256
    counters = next(iter(kernel._split_counters.values()))
    assert counters.numel() >= 1  # one per (query row, tile of 64 of its heads)
    # 128 heads x 4 queries: 8 tiles; 20 heads (not a whole tile of 16: one split on the mma.sync kernel) splits.
    kernel, batch, (out, lse), launch = _launch_sm90(latent(128), [1, 4, 0], [300, 900, 0], return_lse=True,
                                                     max_query_len=4)
    splits = kernel.num_splits(3 * 8, kernel.max_decode_keys(batch.block_table.shape[1]))
    assert launch["grid"] == [splits, 8, 3]
    f = launch["fields"]
    if splits > 1:
        assert next(iter(kernel._split_counters.values())).numel() >= 5 * 2
        assert f["partial_lse"] - f["partial_o"] == 4 * splits * 5 * 128 * 512
    _, _, _, launch = _launch_sm90(latent(20), [4], [32768], max_query_len=4)
    assert launch["grid"][1:] == [2, 1] and launch["fields"]["num_splits"] > 1  # 80 rows: 2 tiles


def test_the_swapped_geometry_plans_tiles_of_16_flattened_rows():
    # 16 heads x 4 queries: 4 tiles of 16 rows, one per query; the split count by the wave rule over batch x slots.
    module = Recorder()
    spec = latent(16)
    kernel = runtime.JitKernel.from_module(spec, module, SWAP_GEOMETRY, device=torch.device("cpu"),
                                           num_sms=lc.NUM_SMS, decode_blocks_per_sm=1, stream_handle=lambda: lc.STREAM)
    module.kernel = kernel
    batch = random_paged_batch(spec, [4, 1], [32768, 300], device="cpu", seed=3)
    kernel.paged_attention(*batch.args(), max_query_len=4)
    (launch,) = module.launches
    splits = kernel.num_splits(2 * 4, kernel.max_decode_keys(batch.block_table.shape[1]))
    assert launch["grid"] == [splits, 4, 2] and launch["block"] == 128 and splits > 1
    assert next(iter(kernel._split_counters.values())).numel() >= 5  # one per (query row, tile of 16 heads)

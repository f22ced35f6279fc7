"""CPU tests of the runtime's host-side decisions (no GPU needed)."""

import types

import numpy as np
import pytest
import torch

from jitattn.cuda_driver import CudaDriverError
from jitattn.runtime import MAX_SPLITS, choose_num_splits


@pytest.mark.parametrize("blocks, slots, max_useful, expected", [
    (512, 264, 16, 1),    # 64 x 4096, 8 KV heads, tensor-core decode: 2 waves 97 % full (H200 sweep: best 1)
    (512, 396, 16, 3),    # Gemma-2 64 x 8192 on the CUDA-core decode (sweep: 2 and 3 tie, 1 is 12 % slower)
    (8, 264, 128, 33),    # 1 x 32768: exactly one wave (best 33: 0.0411 ms, 30: 0.0432; 64 was 31 % slower)
    (2048, 264, 1, 1),    # a 128-key window: one split is all it has
    (8, 264, 4, 4),       # short sequences: at least 4 tiles per split
    (256, 264, 2, 1),     # issue 18's mixed probe, 32 x 512: one wave 97 % full unsplit (20.4 us; 2 splits 27.4)
    (128, 132, 16, 1),    # MLA TP8 bf16, one block per SM: 0.174 ms unsplit, 0.204 at 2
    (128, 264, 16, 2),    # MLA TP8 FP8, two blocks per SM: 0.146 ms at 2, 0.188 at 4, 0.182 at 1
    (237, 264, 64, 10),   # 90 % of a wave is the bar: 237 blocks (89.8 %) split, to 10 waves 99.7 % full
    (1, 264, 1000, MAX_SPLITS),
])
def test_choose_num_splits_fills_whole_waves(blocks, slots, max_useful, expected):
    assert choose_num_splits(blocks, slots, max_useful) == expected


def test_choose_num_splits_wave_fill():
    for blocks in range(1, 700, 7):
        s = choose_num_splits(blocks, 264, 64)
        assert 1 <= s <= 64
        if blocks <= 264 and blocks * min(64, 264 // blocks) >= 0.9 * 264:
            assert s == min(64, 264 // blocks)  # one wave, as full as it goes
        else:
            waves = -(-blocks * s // 264)
            assert s == 64 or blocks * s / (waves * 264) >= 0.9
            assert all(blocks * t / (-(-blocks * t // 264) * 264) < 0.9 for t in range(max(1, 264 // blocks) + 1, s))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", [None, "cuda", 0, "cuda:1"])
def test_load_kernel_without_cuda_says_why(device):
    """On a CPU-only torch, asking for a kernel is a RuntimeError that says what is missing, not torch's
    'Torch not compiled with CUDA enabled' AssertionError from deep inside."""
    from jitattn import AttentionSpec
    from jitattn.runtime import load_kernel

    with pytest.raises(RuntimeError, match=r"device=cuda(:\d)?: (this torch is built without CUDA|torch sees no CUDA "
                                           r"device); jitattn kernels need an NVIDIA GPU"):
        load_kernel(AttentionSpec(8, 2, 64), device)


def test_load_kernel_on_the_cpu_points_to_the_reference():
    from jitattn import AttentionSpec
    from jitattn.runtime import load_kernel

    with pytest.raises(ValueError, match=r"device=cpu: jitattn kernels run on CUDA devices; use jitattn.reference"):
        load_kernel(AttentionSpec(8, 2, 64), "cpu")


def test_outgrown_split_counters_stay_alive(monkeypatch):
    """A CUDA graph captured with a small batch keeps the address of the fused-merge counters it used;
    when a larger batch needs a larger buffer, the old one must not be freed (its memory could be
    reused and no longer be zero when the graph replays)."""
    from types import SimpleNamespace

    from jitattn.runtime import JitKernel

    kernel = object.__new__(JitKernel)  # the buffer policy only: no cubin, no GPU
    kernel.device, kernel._split_counters, kernel._retired_counters = torch.device("cpu"), {}, []
    kernel._unzeroed_counters = set()
    kernel.stream_handle = lambda: 7
    small = kernel.split_counters(64)
    assert small.numel() >= 64 and not small.any()
    assert kernel.split_counters(512) is small  # fits: reused, no new allocation
    large = kernel.split_counters(5000)
    assert large.numel() >= 5000 and large is not small
    assert any(t is small for t in kernel._retired_counters)  # still referenced, so never freed
    assert kernel.split_counters(64) is large


def test_split_counters_made_under_capture_are_zeroed_at_their_next_use(monkeypatch):
    """A counter buffer allocated while a CUDA graph is being captured is zero only once that graph
    replays (the capture records the fill, runs nothing). Its next use zeroes it again: eagerly, or
    recorded into the next captured graph (which may replay first); else the fused merge would count
    from garbage, never see its last split and leave the rows unwritten, for every later call too."""
    from types import SimpleNamespace

    from jitattn import runtime
    from jitattn.runtime import JitKernel

    kernel = object.__new__(JitKernel)
    kernel.device, kernel._split_counters, kernel._retired_counters = torch.device("cpu"), {}, []
    kernel._unzeroed_counters = set()
    kernel.stream_handle = lambda: 7
    capturing = [True]
    monkeypatch.setattr(runtime, "capturing", lambda: capturing[0])
    buf = kernel.split_counters(64)  # graph 1 captures the allocation
    buf.fill_(12345)  # on a GPU: whatever the memory held, the captured fill has not run
    again = kernel.split_counters(64)  # graph 2 captures a use: its own fill recorded
    assert again is buf and not buf.any()
    buf.fill_(12345)
    capturing[0] = False
    assert kernel.split_counters(64) is buf and not buf.any()  # the first eager use zeroes it
    buf[3] = 1  # eager launches leave it zero; this shows no fill runs per call once it is known zero
    assert kernel.split_counters(64) is buf and buf[3] == 1


def _dry_kernel(spec, monkeypatch):
    """A JitKernel on the CPU whose module records its launches instead of running them
    (:meth:`JitKernel.from_module`): the host side of a call (checks, outputs, Params packing, grids)
    runs for real, no GPU needed."""
    from types import SimpleNamespace

    from jitattn import runtime

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _STREAMS[-1])
    launches = []
    streams = []  # the stream handle of each launch

    def launch(name, grid, block, smem, args, stream):
        layout = kernel.layout
        launches.append((name, grid, block, dict(zip(layout.field_order, layout.packer.unpack(args)))))
        streams.append(stream)

    geometry = {"decode_threads": 128, "decode_smem": 0, "decode_tile_keys": 64, "prefill_threads": 384,
                "prefill_smem": 0, "prefill_block_m": 128, "prefill_block_n": 128}
    kernel = runtime.JitKernel.from_module(spec, SimpleNamespace(launch=launch), geometry, device=torch.device("cpu"),
                                           num_sms=132, decode_blocks_per_sm=2,
                                           stream_handle=lambda: _STREAMS[-1].cuda_stream)
    kernel.mixed_on_two_streams = False
    kernel.launch_streams = streams
    return kernel, launches


class _FakeStream:
    """A CUDA stream stand-in that records which streams it was made to wait for."""

    def __init__(self, handle: int):
        self.cuda_stream, self.waited_for = handle, []

    def wait_stream(self, other: "_FakeStream") -> None:
        self.waited_for.append(other.cuda_stream)


_STREAMS = [_FakeStream(7)]  # the current stream is the last


class _FakeFork:
    """runtime.StreamFork's calls, recorded as one stream waiting for the other; made for the caller's
    current stream (the kernel's stream_handle)."""

    def __init__(self, main: _FakeStream, side: _FakeStream, handle: int):
        assert handle == main.cuda_stream
        self.main, self.side = main, side

    def fork(self) -> int:
        self.side.wait_stream(self.main)
        return self.side.cuda_stream

    def join(self) -> None:
        self.main.wait_stream(self.side)


def test_paged_call_host_side(monkeypatch):
    from jitattn import AttentionSpec
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(8, 2, 64, alibi=True)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    b = random_paged_batch(spec, [1, 5, 1], [30, 40, 17])
    out, lse = kernel.paged_attention(*b.args(), return_lse=True)
    assert out.shape == (7, 8, 64) and out.dtype == torch.bfloat16 and lse.shape == (7, 8)
    assert [name for name, *_ in launches] == ["decode", "prefill"]
    assert launches[0][1][1:] == (2, 3)  # (splits, kv heads, batch)
    decode, prefill = launches[0][3], launches[1][3]
    assert decode == prefill  # one Params for both kernels
    assert decode["o"] == out.data_ptr() and decode["lse"] == lse.data_ptr() and decode["total_q"] == 7
    assert decode["alibi_slopes"] == kernel.default_slopes.data_ptr()  # the spec's slopes, no copy per call
    assert launches[1][1] == (1 + 3, 2, 1)  # ceil(7 rows x group 4 / 128) + batch tiles, kv heads
    launches.clear()
    given = torch.empty(7, 8, 64, dtype=torch.bfloat16)
    assert kernel.paged_attention(*b.args(), out=given, max_query_len=5) is given
    assert launches[0][3]["lse"] == 0 and launches[0][3]["o"] == given.data_ptr()


def test_mixed_call_forks_the_decode_onto_a_side_stream(monkeypatch):
    """With mixed_on_two_streams, the decode kernel goes to the side stream after it waits for the
    caller's, the prefill kernel to the caller's stream, which then waits for the side stream; a pure
    decode call (max_query_len=1) stays on the caller's stream."""
    from jitattn import AttentionSpec
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(8, 2, 64)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    main, side = _STREAMS[-1], _FakeStream(8)
    main.waited_for.clear()
    kernel.mixed_on_two_streams, kernel.stream_fork = True, lambda handle: _FakeFork(main, side, handle)
    b = random_paged_batch(spec, [1, 5, 1], [30, 4000, 17])
    kernel.paged_attention(*b.args())
    assert [name for name, *_ in launches] == ["decode", "prefill"] and kernel.launch_streams == [8, 7]
    assert side.waited_for == [7] and main.waited_for == [8]
    assert launches[0][3]["partial_o"] != 0  # split scratch allocated (here: on the CPU) for the side stream
    launches.clear(), kernel.launch_streams.clear(), side.waited_for.clear(), main.waited_for.clear()
    kernel.paged_attention(*b.args(), max_query_len=1)
    assert [name for name, *_ in launches] == ["decode"] and kernel.launch_streams == [7]
    assert side.waited_for == [] and main.waited_for == []


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [2, 0, 1]])
def test_a_one_call_with_no_more_queries_than_sequences_keeps_one_stream(monkeypatch, q_lens):
    """The one-call, lengths unread, launches both kernels; with total_q <= batch its prefill can hold only a few
    rows (none in a pure decode batch), so both go to the caller's stream, decode first, and nothing forks or
    waits. A plan the engine makes itself keeps the fork (test_plan_launches.py)."""
    from jitattn import AttentionSpec
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(8, 2, 64)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    main, side = _STREAMS[-1], _FakeStream(8)
    main.waited_for.clear()
    kernel.mixed_on_two_streams, kernel.stream_fork = True, lambda handle: _FakeFork(main, side, handle)
    b = random_paged_batch(spec, q_lens, [30, 400, 17])
    for _ in range(2):  # the plan made, then the stream's last plan reused
        launches.clear(), kernel.launch_streams.clear()
        kernel.paged_attention(*b.args())
        assert [name for name, *_ in launches] == ["decode", "prefill"] and kernel.launch_streams == [7, 7]
        assert side.waited_for == [] and main.waited_for == []


@pytest.mark.parametrize("fails", ["decode", "prefill"])
def test_mixed_call_joins_the_side_stream_when_a_launch_raises(monkeypatch, fails):
    """A launch that raises between the fork and the join still joins the side stream back into the
    caller's: otherwise the caller's stream would not wait for a decode kernel already queued (its
    tensors freed and reused under it), and a CUDA graph capture would end unjoined, hiding the error."""
    from jitattn import AttentionSpec
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(8, 2, 64)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    main, side = _STREAMS[-1], _FakeStream(8)
    main.waited_for.clear()
    kernel.mixed_on_two_streams, kernel.stream_fork = True, lambda handle: _FakeFork(main, side, handle)
    real_launch = kernel.launch

    def launch(name, *args):
        if name == fails:
            raise RuntimeError(f"CUDA error: {name} launch failed")
        real_launch(name, *args)

    kernel.launch = launch
    b = random_paged_batch(spec, [1, 5, 1], [30, 4000, 17])
    with pytest.raises(RuntimeError, match=f"{fails} launch failed"):
        kernel.paged_attention(*b.args())
    assert side.waited_for == [7] and main.waited_for == [8]
    assert _STREAMS[-1] is main  # the side stream is no longer current


def test_ragged_call_host_side(monkeypatch):
    from jitattn import AttentionSpec
    from jitattn.testing import random_ragged_batch
    from jitattn.variant import sigmoid_attention

    spec = AttentionSpec(8, 2, 64, head_dim_vo=32, kv_storage="ragged")
    kernel, launches = _dry_kernel(spec, monkeypatch)
    r = random_ragged_batch(spec, [1, 9], [20, 37])
    out = kernel.ragged_attention(r.q, r.k, r.v, r.query_start_loc, r.kv_start_loc)
    assert out.shape == (10, 8, 32)
    [(name, grid, _, fields)] = launches
    assert name == "prefill" and grid == (1 + 2, 2, 1) and fields["lse"] == 0 and fields["o"] == out.data_ptr()
    assert fields["total_kv"] == 57 and fields["batch_size"] == 2
    no_softmax = AttentionSpec(8, 2, 64, kv_storage="ragged", variant=sigmoid_attention())
    kernel, launches = _dry_kernel(no_softmax, monkeypatch)
    r = random_ragged_batch(no_softmax, [1, 9], [20, 37])
    with pytest.raises(ValueError, match="has no softmax, so there is no lse"):
        kernel.ragged_attention(r.q, r.k, r.v, r.query_start_loc, r.kv_start_loc, params={"bias": -2.0},
                                return_lse=True)
    assert launches == []


@pytest.mark.parametrize("value", [True, 1.0, "1", torch.tensor(1), -1])
def test_max_query_len_must_be_a_count(monkeypatch, value):
    """max_query_len picks the kernels (1: decode only, the other rows left unwritten), so it must be
    None or an int >= 0: True compared equal to 1 and dropped the prefill rows, '1' reached the
    validate comparison as a TypeError, a tensor compared elementwise."""
    from jitattn import AttentionSpec
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(8, 2, 64)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    b = random_paged_batch(spec, [1, 5], [30, 40])
    with pytest.raises(ValueError, match=r"max_query_len=.*: expected None or an int >= 0"):
        kernel.paged_attention(*b.args(), max_query_len=value, validate=True)
    assert launches == []
    kernel.paged_attention(*b.args(), max_query_len=np.int64(5), validate=True)  # numpy ints are ints
    assert [name for name, *_ in launches] == ["decode", "prefill"]


def test_validate_under_graph_capture_is_refused_before_any_work(monkeypatch):
    """validate=True reads the metadata on the host, a sync that CUDA graph capture forbids: the call
    says so, naming validate, before anything is captured (the sync raised a CUDA error from inside
    the checks and invalidated the capture)."""
    from jitattn import AttentionSpec, runtime
    from jitattn.testing import random_paged_batch, random_ragged_batch

    from jitattn import planning

    monkeypatch.setattr(planning, "capturing", lambda: True)
    spec = AttentionSpec(8, 2, 64)
    kernel, launches = _dry_kernel(spec, monkeypatch)
    b = random_paged_batch(spec, [1, 5], [30, 40])
    with pytest.raises(ValueError, match=r"validate=True: .*CUDA graph capture"):
        kernel.paged_attention(*b.args(), validate=True)
    kernel.paged_attention(*b.args())  # validate=False: captured as usual
    assert [name for name, *_ in launches] == ["decode", "prefill"]
    ragged = AttentionSpec(8, 2, 64, kv_storage="ragged")
    kernel, launches = _dry_kernel(ragged, monkeypatch)
    r = random_ragged_batch(ragged, [1, 9], [20, 37])
    with pytest.raises(ValueError, match=r"validate=True: .*CUDA graph capture"):
        kernel.ragged_attention(r.q, r.k, r.v, r.query_start_loc, r.kv_start_loc, validate=True)
    assert launches == []


def test_loaded_once_loads_each_key_once_until_cleared():
    """load_kernel's memo: one load per key, reused; clear() (tools/tune_decode_variants.py swaps the
    templates between variants) makes the next get load again."""
    from jitattn.runtime import LoadedOnce

    memo, loads = LoadedOnce(), []

    def load(key):
        loads.append(key)
        return object()

    a = memo.get("a", lambda: load("a"))
    assert memo.get("a", lambda: load("a")) is a and memo.get("b", lambda: load("b")) is not a
    assert loads == ["a", "b"]
    memo.clear()
    assert memo.get("a", lambda: load("a")) is not a and loads == ["a", "b", "a"]


def test_load_kernel_finds_a_loaded_spec_object_by_identity_until_cleared(monkeypatch):
    """The one-call path's lookup: the same spec object on the same explicit device, no new load; an equal
    spec object gets the same kernel; another device or a cleared memo loads again."""
    from jitattn import runtime
    from jitattn.spec import AttentionSpec

    loads = []

    def build(spec, dev):
        loads.append((spec, dev))
        return object()

    monkeypatch.setattr(runtime, "_KERNELS", runtime.LoadedOnce())
    monkeypatch.setattr(runtime, "JitKernel", build)
    spec, dev = AttentionSpec(8, 2, 64), torch.device("cuda", 0)
    kernel = runtime.load_kernel(spec, dev)
    assert runtime.load_kernel(spec, torch.device("cuda", 0)) is kernel
    assert runtime.load_kernel(AttentionSpec(8, 2, 64), dev) is kernel  # equal, not identical: the process's kernel
    assert runtime.load_kernel(spec, torch.device("cuda", 1)) is not kernel
    assert len(loads) == 2
    runtime._KERNELS.clear()
    assert runtime.load_kernel(spec, dev) is not kernel and len(loads) == 3


class _EventDriver:
    """CudaDriver's event calls, recorded with the context current at each (``ctx``); a record on a stream in
    ``failing`` raises, as the driver's binding does."""

    def __init__(self):
        self.calls, self.ctx, self.made, self.failing = [], "caller's", 0, set()

    def event_create(self):
        self.made += 1
        return 0xE0 + self.made

    def event_destroy(self, event):
        self.calls.append(("destroy", event))

    def record_and_wait(self, event, stream, waiter):
        self.calls.append((event, stream, waiter, self.ctx))
        if stream in self.failing:
            raise CudaDriverError("cuEventRecord", 201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context")


def _event_module(monkeypatch, current):
    """A CubinModule with no cubin: the fake driver, and a context that is current or made so."""
    from jitattn.runtime import CubinModule

    module = object.__new__(CubinModule)
    module._driver, module.device_index = _EventDriver(), 1
    drv = module._driver
    if current:
        drv.ctx = "kernel's"
    monkeypatch.setattr(module, "is_current", lambda: drv.ctx == "kernel's", raising=False)

    def make_current():
        prev, drv.ctx = drv.ctx, "kernel's"
        return prev

    monkeypatch.setattr(module, "_make_current", make_current, raising=False)
    monkeypatch.setattr(module, "_restore", lambda prev: setattr(drv, "ctx", prev), raising=False)
    return module


@pytest.mark.parametrize("current", [True, False])
def test_stream_fork_records_and_waits_with_the_kernels_context_current(monkeypatch, current):
    """fork: the caller's stream recorded, the side stream waits; join: the other way round; each with the
    kernel's context current (another device's current would make handle 0 name its stream, and a wait there
    would order nothing here), then the caller's context back."""
    from jitattn.runtime import StreamFork

    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: types.SimpleNamespace(cuda_stream=0x5D))
    module = _event_module(monkeypatch, current)
    drv = module._driver
    fork = StreamFork(module, torch.device("cuda", 1), 0)  # 0: the legacy default stream of the caller
    assert fork.fork() == 0x5D
    fork.join()
    assert drv.calls == [(0xE1, 0, 0x5D, "kernel's"), (0xE2, 0x5D, 0, "kernel's")]
    assert drv.ctx == ("kernel's" if current else "caller's")


def test_stream_fork_raises_the_drivers_error_and_restores_the_context(monkeypatch):
    from jitattn.runtime import StreamFork

    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: types.SimpleNamespace(cuda_stream=0x5D))
    module = _event_module(monkeypatch, False)
    fork = StreamFork(module, torch.device("cuda", 0), 7)
    module._driver.failing = {7}
    with pytest.raises(CudaDriverError, match="cuEventRecord failed: CUDA_ERROR_INVALID_CONTEXT"):
        fork.fork()
    assert module._driver.ctx == "caller's"


def test_stream_fork_destroys_its_first_event_when_the_second_cannot_be_made(monkeypatch):
    from jitattn.runtime import StreamFork

    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: types.SimpleNamespace(cuda_stream=0x5D))
    module = _event_module(monkeypatch, True)
    drv, create = module._driver, module._driver.event_create

    def create_once():
        if drv.made:
            raise CudaDriverError("cuEventCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
        return create()

    drv.event_create = create_once
    with pytest.raises(CudaDriverError, match="cuEventCreate failed"):
        StreamFork(module, torch.device("cuda", 0), 7)
    assert drv.calls == [("destroy", 0xE1)]

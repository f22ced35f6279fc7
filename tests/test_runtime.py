"""CPU tests of the runtime's host-side decisions (no GPU needed)."""

import pytest
import torch

from jitattn.runtime import MAX_SPLITS, choose_num_splits


@pytest.mark.parametrize("blocks, slots, max_useful, expected", [
    (512, 264, 16, 1),    # 64 x 4096, 8 KV heads, tensor-core decode: 2 waves 97 % full (H200 sweep: best 1)
    (512, 396, 16, 3),    # Gemma-2 64 x 8192 on the CUDA-core decode (sweep: 2 and 3 tie, 1 is 12 % slower)
    (8, 264, 128, 33),    # 1 x 32768: exactly one wave (sweep: best 33; 64 was 31 % slower)
    (2048, 264, 1, 1),    # a 128-key window: one split is all it has
    (8, 264, 4, 4),       # short sequences: at least 4 tiles per split
    (1, 264, 1000, MAX_SPLITS),
])
def test_choose_num_splits_fills_whole_waves(blocks, slots, max_useful, expected):
    assert choose_num_splits(blocks, slots, max_useful) == expected


def test_choose_num_splits_wave_fill():
    for blocks in range(1, 700, 7):
        s = choose_num_splits(blocks, 264, 64)
        assert 1 <= s <= 64
        if s < 64 and blocks * s >= 264:
            waves = -(-blocks * s // 264)
            assert blocks * s / (waves * 264) >= 0.9


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
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    small = kernel.split_counters(64)
    assert small.numel() >= 64 and not small.any()
    assert kernel.split_counters(512) is small  # fits: reused, no new allocation
    large = kernel.split_counters(5000)
    assert large.numel() >= 5000 and large is not small
    assert any(t is small for t in kernel._retired_counters)  # still referenced, so never freed
    assert kernel.split_counters(64) is large

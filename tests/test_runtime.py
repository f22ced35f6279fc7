"""CPU tests of the runtime's host-side decisions (no GPU needed)."""

import pytest

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

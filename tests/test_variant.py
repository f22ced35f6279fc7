"""The one visibility rule in Python: the closed-form key range agrees with the structural mask."""

import itertools

import torch

from jitattn.trace import ParamView
from jitattn.variant import structural_mask, visible_key_range


def test_visible_key_range_is_the_structural_mask_in_closed_form():
    kv_len = 12
    j = torch.arange(kv_len)
    for causal, left, right in itertools.product((True, False), (-1, 0, 3), (-1, 0, 2)):
        if causal and right >= 0:
            continue  # a causal spec has no right window
        mask = structural_mask(causal, left, right)
        for first, last in ((0, 0), (5, 5), (11, 11), (3, 8), (0, 11)):
            lo, hi = visible_key_range(causal, left, right, first, last, kv_len)
            seen = torch.zeros(kv_len, dtype=torch.bool)
            for p in range(first, last + 1):
                seen |= torch.ones(kv_len, dtype=torch.bool) if mask is None else mask(0, 0, torch.tensor(p), j,
                                                                                        ParamView({}))
            expected = seen.nonzero().flatten().tolist()
            got = list(range(lo, hi + 1))
            assert got == (list(range(expected[0], expected[-1] + 1)) if expected else []), \
                (causal, left, right, first, last)
            assert got == expected, "the visible keys of a query run are one contiguous range"

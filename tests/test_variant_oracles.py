"""The ready-made variants (jitattn.variant) against oracles written independently (tests/oracles.py).

The reference runs each variant's own Python function, so it agrees with the kernels by construction;
here the masks, biases and rotations the functions produce, and the reference's whole attention, are
compared with plain-torch oracles built from each variant's definition (loops and index arithmetic).
The same oracles check the kernels in tests/test_gpu_variant_oracles.py.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import reference
from jitattn.testing import random_paged_batch, relative_error
from jitattn.trace import ParamView
from tests import oracles

Q_LENS, KV_LENS = [1, 9, 0, 24, 3], [40, 9, 5, 300, 150]  # decode, full prefill, no queries, chunk after a prefix
CASES = oracles.oracle_cases(Q_LENS, KV_LENS)


def _hook_grid(q_len: int, kv_len: int, heads: int):
    """Broadcastable (head, qo_idx, kv_idx) of one sequence, as the reference passes them to a hook."""
    return (torch.arange(heads)[:, None, None], torch.arange(kv_len - q_len, kv_len)[None, :, None],
            torch.arange(kv_len)[None, None, :])


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith(("document", "prefix"))], ids=lambda c: c.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_mask_hooks_equal_the_hand_written_masks(case, seed):
    params = case.params("cpu", seed)
    pieces = case.pieces(params)
    for b, (ql, kl) in enumerate(zip(Q_LENS, KV_LENS)):
        head, qi, ki = _hook_grid(ql, kl, case.spec.num_qo_heads)
        got = case.spec.variant.logits_mask(b, head, qi, ki, ParamView(params)).expand(-1, ql, kl)
        want = pieces.mask(b, list(range(kl - ql, kl)), kl)
        assert torch.equal(got, want.expand_as(got)), f"sequence {b}"


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("t5")], ids=lambda c: c.name)
def test_t5_bias_hook_equals_the_hand_written_buckets(case):
    params = case.params("cpu", 3)
    pieces = case.pieces(params)
    for b, (ql, kl) in enumerate(zip(Q_LENS, KV_LENS)):
        head, qi, ki = _hook_grid(ql, kl, case.spec.num_qo_heads)
        score = torch.zeros(case.spec.num_qo_heads, ql, kl)
        got = case.spec.variant.logits_transform(score, b, head, qi, ki, ParamView(params))
        assert torch.equal(got.double(), pieces.bias(b, list(range(kl - ql, kl)), kl)), f"sequence {b}"


@pytest.mark.parametrize("num_buckets, max_distance, bidirectional, relative, bucket", [
    (32, 128, False, -5, 0), (32, 128, False, 0, 0), (32, 128, False, 15, 15), (32, 128, False, 16, 16),
    (32, 128, False, 127, 31), (32, 128, False, 10 ** 6, 31),
    (32, 128, True, 7, 7), (32, 128, True, -7, 23), (32, 128, True, 8, 8), (32, 128, True, 128, 15),
    (32, 128, True, -10 ** 6, 31), (32, 128, True, 0, 0), (32, 128, True, -1, 17),
])
def test_t5_bucket_oracle_at_hand_computed_points(num_buckets, max_distance, bidirectional, relative, bucket):
    """Points computed by hand from the formula: exact buckets below B/2, log-spaced up to max_distance,
    the last bucket beyond; bidirectional: keys after the query in the upper half."""
    assert oracles.t5_bucket(relative, num_buckets, max_distance, bidirectional) == bucket


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_hook_equals_the_pairwise_rotation(theta):
    from jitattn.variant import rotary_embedding

    fn = rotary_embedding(64, theta).query_transform
    x = torch.randn(7, 3, 64, dtype=torch.float64)
    pos = [0, 1, 5, 100, 1000, 4095, 30000]
    x_rot = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)  # the hook's x_rot: rotate_half(x)
    got = fn(x, x_rot, 0, torch.arange(3)[None, :, None], torch.tensor(pos)[:, None, None],
             torch.arange(64)[None, None, :], ParamView({}))
    err = (got.double() - oracles.rope_rotate(x, pos, theta)).abs().amax(dim=(1, 2))  # (positions,)
    # the hook's angle p * w is float32 (as the kernels' and transformers'): off by up to p * 2^-24 rad
    allowed = torch.tensor([1e-5 + 2 * p * 2.0 ** -24 * x.abs().max().item() for p in pos], dtype=torch.float64)
    assert (err <= allowed).all(), (err, allowed)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_attention_equals_the_oracle(case, layout):
    spec = case.spec.replace(kv_layout=layout, page_size=16 if layout == "NHD" else 7)
    params = case.params("cpu", 5)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, params=params, seed=9)
    want, want_lse = oracles.attention(spec, batch, case.pieces(params))
    softmax = want_lse is not None
    got = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=softmax,
                                    compute_dtype=torch.float64)
    out, lse = got if softmax else (got, None)
    assert relative_error(out, want) < 4e-3  # the output is rounded to bf16
    if softmax:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse.float()))
        finite = torch.isfinite(want_lse)
        assert (lse.double()[finite] - want_lse[finite]).abs().max().item() < 1e-5

"""Explicit query positions (``AttentionSpec(query_positions="explicit")``), CPU: the reference's
semantics and the checks every caller gets. The kernels against this reference: test_gpu_explicit_positions.py."""

import pytest
import torch

from jitattn import reference, variant
from jitattn.spec import AttentionSpec
from jitattn.testing import random_paged_batch

SPECS = [
    AttentionSpec(8, 2, 64, window_left=5, alibi=True, sinks=True),
    AttentionSpec(4, 4, 32, causal=False, window_left=3, window_right=2, logits_soft_cap=20.0, page_size=4),
    AttentionSpec(4, 2, 32, variant=variant.rotary_embedding(32), page_size=3),
    AttentionSpec(4, 1, 32, variant=variant.prefix_lm_mask(), causal=False),
]


def _implicit_positions(batch):
    pos, hook_batch = [], []
    for b, (ql, kl) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        pos += range(kl - ql, kl)
        hook_batch += [b] * ql
    return torch.tensor(pos, dtype=torch.int32), torch.tensor(hook_batch, dtype=torch.int32)


def _params(spec, batch_size):
    if spec.variant is not None and spec.variant.name == "prefix_lm":
        return {"prefix_len": torch.tensor([3, 7, 0][:batch_size], dtype=torch.int32)}
    return {}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_implicit_positions_given_explicitly_give_the_same_result(spec):
    """Positions kv_len - qo_len + i, the sequence's own index as the hook batch and offset 0 are what
    the implicit spec computes: the two references agree exactly."""
    batch = random_paged_batch(spec, [3, 1, 5], [9, 20, 5], params=_params(spec, 3), seed=3)
    want, want_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    pos, hook_batch = _implicit_positions(batch)
    espec = spec.replace(query_positions="explicit")
    got, got_lse = reference.paged_attention(espec, *batch.args(), **batch.kwargs(), return_lse=True,
                                             query_positions=pos, functor_batch=hook_batch,
                                             position_offset=torch.zeros(3, dtype=torch.int32))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)


def test_offset_moves_the_hook_positions_only():
    """RoPE (a hook on q and k) sees positions + offset: shifting every position by the same offset
    changes nothing (rotary scores depend on differences only), so offset 0 and offset 1000 agree up to
    rounding; a different offset per query would not (checked: moving only the queries changes it)."""
    spec = AttentionSpec(4, 2, 32, variant=variant.rotary_embedding(32), query_positions="explicit", page_size=4)
    batch = random_paged_batch(spec, [2, 3], [9, 6], seed=5)
    pos = torch.tensor([8, 3, 5, 5, 0], dtype=torch.int32)
    hook_batch = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    run = lambda p, off: reference.paged_attention(spec, *batch.args(), **batch.kwargs(),  # noqa: E731
                                                   query_positions=p, functor_batch=hook_batch,
                                                   position_offset=torch.tensor(off, dtype=torch.int32),
                                                   compute_dtype=torch.float64)
    base = run(pos, [0, 0])
    torch.testing.assert_close(run(pos, [1000, 77]), base, rtol=1e-3, atol=1e-3)
    assert not torch.allclose(run(pos + 2, [0, 0]), base, rtol=1e-2, atol=1e-2)


def test_a_query_past_every_key_and_more_queries_than_keys():
    """Causal, window 2: a query at position 100 of a 4-key sequence sees none of them (output 0, lse
    -inf), nor one at -1; at position 4 it sees keys 2, 3; 6 queries against 4 keys are allowed."""
    spec = AttentionSpec(2, 1, 32, window_left=2, query_positions="explicit", page_size=4)
    batch = random_paged_batch(spec, [6], [4], seed=1)
    pos = torch.tensor([100, 4, -1, 3, 1, 2], dtype=torch.int32)
    out, lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True, query_positions=pos,
                                         functor_batch=torch.zeros(6, dtype=torch.int32),
                                         position_offset=torch.zeros(1, dtype=torch.int32))
    for row in (0, 2):  # past the window's reach / before the first key: nothing visible
        assert torch.equal(out[row].float(), torch.zeros_like(out[row].float())) and torch.isinf(lse[row]).all()
    k, v = reference.gather_kv(spec, batch.kv_cache, batch.block_table, 0, 4)
    s = torch.einsum("hd,khd->hk", batch.q[1].float(), k.float().repeat_interleave(2, dim=1)) * spec.sm_scale
    p = torch.softmax(s[:, 2:4], dim=-1)
    want = torch.einsum("hk,khd->hd", p, v.float().repeat_interleave(2, dim=1)[2:4])
    torch.testing.assert_close(out[1].float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad, match", [
    ({"query_positions": None}, r"query_positions: the spec has query_positions='explicit', so an int32 \(total_q,\)"),
    ({"functor_batch": torch.zeros(5, dtype=torch.int64)}, r"functor_batch: .*int32"),
    ({"position_offset": torch.zeros(3, dtype=torch.int32)}, r"position_offset: dim 0 \(batch\) must be 2, got 3"),
    ({"functor_batch": torch.tensor([0, 0, 0, 0, -4], dtype=torch.int32)}, r"functor_batch\[4\]=-4: expected a value >= 0"),
])
def test_bad_explicit_positions_are_named(bad, match):
    spec = AttentionSpec(4, 2, 32, query_positions="explicit")
    batch = random_paged_batch(spec, [2, 3], [9, 6], seed=5)
    kw = {"query_positions": torch.zeros(5, dtype=torch.int32), "functor_batch": torch.zeros(5, dtype=torch.int32),
          "position_offset": torch.zeros(2, dtype=torch.int32), **bad}
    with pytest.raises(ValueError, match=match):
        reference.paged_attention(spec, *batch.args(), **batch.kwargs(), **kw)


def test_positions_given_to_an_implicit_spec_are_refused():
    spec = AttentionSpec(4, 2, 32)
    batch = random_paged_batch(spec, [2], [9], seed=5)
    with pytest.raises(ValueError, match=r"query_positions: given, but the spec has query_positions='implicit'"):
        reference.paged_attention(spec, *batch.args(), **batch.kwargs(), query_positions=torch.zeros(2, dtype=torch.int32))


def test_functor_batch_past_a_batch_indexed_param_is_refused():
    """The hooks read params indexed by batch at functor_batch[t], whose size the explicit spec leaves free
    (a cascade's requests, not this call's sequences): an entry past it was an IndexError in the reference
    and an out-of-bounds read in the kernel (validate=True); now a ValueError naming the entry and param."""
    spec = AttentionSpec(4, 1, 32, variant=variant.prefix_lm_mask(), causal=False, query_positions="explicit")
    batch = random_paged_batch(spec, [3, 1, 5], [9, 20, 5], seed=3)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    kw = dict(query_positions=i32(list(range(9))), position_offset=i32([0, 0, 0]))
    prefix_len = {"prefix_len": i32([3, 7, 0])}
    with pytest.raises(ValueError, match=r"functor_batch\[3\]=5: the hooks read params\['prefix_len'\] .*size 3"):
        reference.paged_attention(spec, *batch.args(), params=prefix_len, functor_batch=i32([0, 0, 0, 5, 1, 1, 1, 1, 1]),
                                  **kw)
    with pytest.raises(ValueError, match=r"functor_batch\[0\]=0: .*size 0"):
        reference.paged_attention(spec, *batch.args(), params={"prefix_len": i32([])}, functor_batch=i32([0] * 9), **kw)
    # in range (one param entry for every query's hook batch, fewer than the call's sequences): fine
    reference.paged_attention(spec, *batch.args(), params={"prefix_len": i32([4])}, functor_batch=i32([0] * 9), **kw)


@pytest.mark.parametrize("name", ["sdpa", "reference"])
def test_backends_that_cannot_take_positions_refuse_an_explicit_spec(name):
    """Only the jit backend's call takes query_positions / functor_batch / position_offset: the sdpa backend
    served an explicit spec (selected on the CPU by jitattn.ops.paged_attention) with each sequence's queries
    at its last positions, a silent wrong answer; now every other backend gives the reason."""
    from jitattn import ops
    from jitattn.backends import get_backend
    from jitattn.selector import NoBackendError

    spec = AttentionSpec(4, 2, 32, query_positions="explicit")
    batch = random_paged_batch(spec, [2, 3], [9, 6], seed=5)
    reasons = get_backend(name).reasons(spec, "cpu")
    assert any("explicit query positions (query_positions='explicit') not supported" in r for r in reasons)
    with pytest.raises(ValueError, match=r"explicit query positions"):
        get_backend(name).build(spec, "cpu")
    with pytest.raises(NoBackendError, match=r"explicit query positions"):
        ops.paged_attention(spec, *batch.args())
    assert not get_backend("jit")._position_reasons(spec)

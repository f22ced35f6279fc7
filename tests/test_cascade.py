"""Cascade attention (jitattn.cascade), CPU: the composition run with the reference as its attention
function equals the reference on the un-split batch, for every feature the split preserves; the plan's
layout; the rule; bad input. The kernels: tests/test_gpu_cascade.py."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from jitattn import reference, variant
from jitattn.cascade import (CascadeLevel, cascade_attention, cascade_pays, check_level_values,
                             explicit_twin, plain_metadata, plan_cascade, rule_shape, two_level)
from jitattn.spec import AttentionSpec
from jitattn.testing import random_cascade_batch
from tests.test_plan_launches import kernels  # noqa: F401 (fixture: recording jit kernels)

PREFIX_LM = variant.prefix_lm_mask()

CASES = [  # (spec, prefix_lens, group_sizes, suffix_lens, q_lens)
    (AttentionSpec(8, 2, 32, page_size=4), [13], [3], [5, 0, 9], [1, 1, 1]),  # mid-page prefix, a suffix of 0
    (AttentionSpec(8, 2, 32, page_size=4, window_left=6), [13], [3], [5, 0, 2], [3, 1, 2]),  # window crossing
    (AttentionSpec(4, 1, 32, page_size=4, alibi=True, sinks=True), [9, 16], [2, 2], [3, 4, 0, 7], [1, 2, 1, 4]),
    (AttentionSpec(4, 2, 32, page_size=3, logits_soft_cap=5.0, causal=False), [7], [2], [4, 1], [2, 1]),
    (AttentionSpec(4, 2, 32, page_size=4, variant=variant.rotary_embedding(32)), [10], [3], [6, 2, 0], [2, 1, 1]),
    (AttentionSpec(4, 2, 32, page_size=4, causal=False, variant=PREFIX_LM), [8], [3], [3, 5, 1], [3, 2, 1]),
    (AttentionSpec(8, 2, 32, page_size=4), [5], [2], [0, 0], [3, 5]),  # queries inside the prefix (append)
]


def _params(spec, n):
    if spec.variant is PREFIX_LM:
        return {"prefix_len": torch.tensor([4, 11, 9][:n], dtype=torch.int32)}
    return {}


@pytest.mark.parametrize("chunks", [None, [3, 1]], ids=["auto-chunks", "3-prefix-chunks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].name)
def test_cascade_equals_the_unsplit_batch(case, chunks):
    spec, pre, groups, suf, ql = case
    batch = random_cascade_batch(spec, pre, groups, suf, ql, seed=7, params=_params(spec, len(suf)))
    p = batch.plain
    want, want_lse = reference.paged_attention(spec, *p.args(), **p.kwargs(), return_lse=True)
    got, got_lse = cascade_attention(spec, batch.q, batch.kv_cache, batch.levels, **p.kwargs(), return_lse=True,
                                     use_cascade=True, chunks=chunks, validate=True,
                                     attention=reference.paged_attention)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-4, atol=1e-4)


def test_three_levels():
    """Levels nest: a prefix shared by all four requests, a second level shared by pairs, then suffixes."""
    spec = AttentionSpec(4, 2, 32, page_size=4, window_left=9, alibi=True)
    # requests 0,1 share A + B0; 2,3 share A + B1; two levels from random_cascade_batch, split by hand
    b = random_cascade_batch(spec, [11], [4], [6, 3, 9, 5], [1, 2, 1, 1], seed=3)
    l0, l1 = b.levels
    # level 1's first 4 keys of requests (0, 1) and (2, 3) become a shared middle level: copy them
    table1 = l1.block_table
    mid_table = torch.stack([table1[0, :1], table1[2, :1]])  # one page (4 keys) each
    # the requests' own suffixes then start one page later, and requests 1 and 3 must read the same
    # first page as 0 and 2: write those pages' K/V into their partners' first pages
    cache = b.kv_cache.clone()
    cache[table1[1, 0]] = cache[table1[0, 0]]
    cache[table1[3, 0]] = cache[table1[2, 0]]
    levels = [l0, CascadeLevel(mid_table, torch.tensor([4, 4], dtype=torch.int32),
                               torch.tensor([0, 3, 5], dtype=torch.int32)),
              CascadeLevel(table1[:, 1:].contiguous(), l1.kv_lens - 4, l1.query_start_loc)]
    two = cascade_attention(spec, b.q, cache, [l0, l1], use_cascade=True, attention=reference.paged_attention)
    three = cascade_attention(spec, b.q, cache, levels, use_cascade=True, attention=reference.paged_attention)
    torch.testing.assert_close(three.float(), two.float(), rtol=2e-2, atol=2e-2)


def test_plan_offsets_and_positions():
    """Two prefix chunks of 8 keys (page 4) then the suffix: offsets 0, 8, 13; a decode query of a
    request with 13 + 5 keys sits at 17: local 17, 9, 4."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 1], seed=1)
    plan = plan_cascade(spec, b.levels, 3, num_sms=132, chunks=[2, 1])
    assert plan.num_states == 3
    assert plan.position_offset.tolist() == [0, 8, 13, 13, 13]
    assert plan.seq_lens.tolist() == [8, 5, 5, 0, 9]
    assert plan.query_start_loc.tolist() == [0, 3, 6, 7, 8, 9]
    assert plan.query_positions.tolist() == [17, 12, 21, 9, 4, 13, 4, -1, 8]
    assert plan.functor_batch.tolist() == [0, 1, 2] * 3


def test_plain_path_when_prefixes_are_page_aligned():
    """use_cascade=False (and the rule, when it says no) runs the plain call on concatenated block tables."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 1], seed=2)
    want = reference.paged_attention(spec, *b.plain.args())
    seen = []

    def spy(spec_, *args, **kw):
        seen.append(spec_.explicit_positions)
        return reference.paged_attention(spec_, *args, **kw)

    got = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=False, attention=spy)
    assert seen == [False]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)


def test_one_level_is_the_plain_call():
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 1, 9], [1, 1, 2], seed=4)
    want = reference.paged_attention(spec, *b.plain.args())
    # one level: each request's whole sequence (the plain batch's own tables)
    level = CascadeLevel(b.plain.block_table, b.plain.seq_lens, b.plain.query_start_loc)
    for use in (None, True):
        got = cascade_attention(spec, b.q, b.plain.kv_cache, [level], use_cascade=use,
                                attention=reference.paged_attention)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)


def test_rule_shape_reads_the_lengths():
    """Two prefixes (13 and 16 keys) shared by 3 + 2 requests with suffixes 5, 0, 9, 2, 4: R = 2.5 requests
    per prefix, P = mean shared keys per request = (3 * 13 + 2 * 16) / 5, s = 4."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13, 16], [3, 2], [5, 0, 9, 2, 4], [1, 1, 1, 1, 1], seed=2)
    r, p, s = rule_shape(spec, b.levels, 5)
    assert (r, s) == (2.5, 4.0) and abs(p - 71 / 5) < 1e-5


def test_plain_path_refused_for_a_mid_page_prefix():
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [2], [5, 1], [1, 1], seed=2)
    with pytest.raises(ValueError, match=r"use_cascade=False: a shared level ends mid-page"):
        cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=False, attention=reference.paged_attention)


def test_the_rule_against_its_measurements():
    """cascade_pays on the 84 measured shapes (H200 sweep, tools/tune_cascade_rule.py): it takes the cascade
    where it was faster and not where it was slower, except the three shapes its docstring names."""
    rows = json.loads((Path(__file__).parent.parent / "results" / "cascade-rule.json").read_text())
    assert len(rows) == 84
    wrong = {(r["R"], r["P"], r["s"]) for r in rows if cascade_pays(r["R"], r["P"], r["s"]) != (r["speedup"] > 1.0)}
    assert wrong == {(8, 8192, 2048), (8, 1024, 512), (128, 1024, 512)}
    assert cascade_pays(64, 8192, 256) and cascade_pays(50, 1000, 100)  # the two bench cases (3.52x, 1.84x)
    assert not cascade_pays(1, 8192, 256)  # nothing shared


@pytest.mark.parametrize("mutate, match", [
    (lambda lv: [CascadeLevel(lv[0].block_table, lv[0].kv_lens, torch.tensor([0, 2, 3], dtype=torch.int32)), lv[1]],
     r"levels\[0\].kv_lens: expected shape \(2,\)"),
    (lambda lv: [CascadeLevel(lv[0].block_table, lv[0].kv_lens.long(), lv[0].query_start_loc), lv[1]],
     r"levels\[0\].kv_lens: .*int32"),
    (lambda lv: [CascadeLevel(lv[0].block_table, lv[0].kv_lens, torch.tensor([0, 2], dtype=torch.int32)), lv[1]],
     r"levels\[0\].query_start_loc \(two_level's prefix_start_loc\) = \[0, 2\]: ends at 2; expected"),
    (lambda lv: [CascadeLevel(lv[0].block_table, torch.tensor([999], dtype=torch.int32), lv[0].query_start_loc), lv[1]],
     r"levels\[0\].kv_lens\[0\]=999: expected 0 <= kv_len <= block_table capacity"),
    (lambda lv: [lv[1], lv[0]], r"levels\[0\].query_start_loc \(two_level's prefix_start_loc\) = \[0, 1, 2, 3\]: "
                                r"its boundary 1 splits request 0 \(queries \[0, 3\)\)"),
    (lambda lv: "levels", r"levels: expected a non-empty list of CascadeLevel"),
])
def test_bad_levels_are_named(mutate, match):
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 1], seed=2)
    with pytest.raises(ValueError, match=match):
        cascade_attention(spec, b.q, b.kv_cache, mutate(b.levels), validate=True, use_cascade=True,
                          attention=reference.paged_attention)


@pytest.mark.parametrize("spec, match", [
    (AttentionSpec(4, 2, 32, variant=variant.sigmoid_attention()), r"has no softmax"),
    (AttentionSpec(4, 2, 32, query_positions="explicit"), r"implicit query positions"),
    (AttentionSpec(4, 1, 64, 32, kv_storage="latent", sm_scale=0.1),  # not the explicit twin's error: a field never set
     r"^spec: cascade attention takes a paged spec with implicit query positions \(kv_storage='paged', "
     r"query_positions='implicit'\), got kv_storage='latent', query_positions='implicit'$"),
])
def test_specs_the_split_cannot_preserve_are_refused(spec, match):
    b = random_cascade_batch(AttentionSpec(4, 2, 32), [16], [2], [1, 1], [1, 1], seed=2)
    with pytest.raises(ValueError, match=match):
        cascade_attention(spec, b.q, b.kv_cache, b.levels, attention=reference.paged_attention)


def test_check_level_values_catches_a_page_outside_the_cache():
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 1], seed=2)
    bad = b.levels[1].block_table.clone()
    bad[2, 1] = 10 ** 6
    levels = [b.levels[0], CascadeLevel(bad, b.levels[1].kv_lens, b.levels[1].query_start_loc)]
    with pytest.raises(ValueError, match=r"levels\[1\].block_table\[2\]: page ids must be in"):
        check_level_values(spec, levels, 3, b.kv_cache.shape[0])


def test_the_rule_saying_no_runs_the_cascade_for_a_mid_page_prefix():
    """use_cascade=None on a batch the rule does not take (3 requests) whose prefix ends mid-page: the plain
    call cannot express it, so the cascade runs (as documented), not the use_cascade=False error."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 2], seed=5)
    assert not cascade_pays(3, 16, 12)
    want = reference.paged_attention(spec, *b.plain.args())
    got = cascade_attention(spec, b.q, b.kv_cache, b.levels, attention=reference.paged_attention)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("use", [True, False])
def test_sinks_for_a_spec_without_sinks_are_refused_on_both_paths(use):
    """The cascade passes run with -inf sinks and fold the real ones in after the merge only when spec.sinks:
    sinks given to a spec without them were dropped silently on the cascade path (the plain path refuses)."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    with pytest.raises(ValueError, match=r"sinks: given, but spec.sinks=False"):
        cascade_attention(spec, b.q, b.kv_cache, b.levels, sinks=torch.zeros(8), use_cascade=use,
                          attention=reference.paged_attention)


def test_validate_refuses_a_request_with_more_queries_than_keys():
    """validate=True let a request bring more queries than its whole sequence has keys (an empty prefix and
    an empty suffix, one query): the cascade returned zeros for it; the plain call refuses such a batch."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 2], seed=2)
    l0, l1 = b.levels
    levels = [CascadeLevel(l0.block_table, torch.zeros(1, dtype=torch.int32), l0.query_start_loc), l1]
    with pytest.raises(ValueError, match=r"request 1 has qo_len=1 queries but 0 keys"):
        cascade_attention(spec, b.q, b.kv_cache, levels, validate=True, use_cascade=True,
                          attention=reference.paged_attention)
    # at most as many queries as keys, and requests with no query, pass; one query more does not
    zero = torch.zeros(1, dtype=torch.int32)
    for qsl, ok in (([0, 5, 5, 11], True), ([0, 6, 6, 11], False)):
        loc = torch.tensor(qsl, dtype=torch.int32)
        levels = [CascadeLevel(l0.block_table, zero, torch.tensor([0, 11], dtype=torch.int32)),
                  CascadeLevel(l1.block_table, l1.kv_lens, loc)]
        if ok:
            check_level_values(spec, levels, 11, b.kv_cache.shape[0])
        else:
            with pytest.raises(ValueError, match=r"request 0 has qo_len=6 queries but 5 keys"):
                check_level_values(spec, levels, 11, b.kv_cache.shape[0])


def test_a_plan_for_another_layout_is_refused():
    """A plan bakes in the page size (chunk boundaries) and the levels' segment counts: one made for another
    spec's page size or another batch ran silently (an error of 0.9 on this batch); now a ValueError."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [40], [3], [5, 0, 9], [1, 1, 2], seed=2)
    other = random_cascade_batch(spec, [40], [2], [5, 0], [2, 2], seed=2)  # total_q 4 too
    for plan in (plan_cascade(AttentionSpec(8, 2, 32, page_size=8), b.levels, 4, num_sms=132, chunks=[3, 1]),
                 plan_cascade(spec, other.levels, 4, num_sms=132)):
        with pytest.raises(ValueError, match=r"plan: made for page_size and level shapes"):
            cascade_attention(spec, b.q, b.kv_cache, b.levels, plan=plan, attention=reference.paged_attention)
    want = reference.paged_attention(spec, *b.plain.args())
    got = cascade_attention(spec, b.q, b.kv_cache, b.levels, plan=plan_cascade(spec, b.levels, 4, num_sms=132),
                            attention=reference.paged_attention)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("chunks", [[1.5, 1], "21", [True, 1], [2, None], [2, 1, 1], [0, 1]])
def test_bad_chunks_are_a_value_error(chunks):
    """chunks that are not one int >= 1 per level: a float or a string was a TypeError from deep inside
    plan_cascade (torch.zeros / a division), a bool was read as 1; now the documented ValueError."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [40], [3], [5, 0, 9], [1, 1, 2], seed=2)
    with pytest.raises(ValueError, match=r"chunks=.*: expected one int >= 1 per level \(2\)"):
        cascade_attention(spec, b.q, b.kv_cache, b.levels, chunks=chunks, use_cascade=True,
                          attention=reference.paged_attention)
    import numpy as np
    want = cascade_attention(spec, b.q, b.kv_cache, b.levels, chunks=[3, 1], use_cascade=True,
                             attention=reference.paged_attention)
    for ok in (np.array([3, 1]), torch.tensor([3, 1]), (3, 1)):
        got = cascade_attention(spec, b.q, b.kv_cache, b.levels, chunks=ok, use_cascade=True,
                                attention=reference.paged_attention)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("use", [None, False])
def test_the_plain_path_with_no_queries(use):
    """total_q = 0 on the plain path (page-aligned levels, or a single level): plain_metadata built 0 rows
    for the R requests (a RuntimeError in gather, or the plain call's seq_lens shape error)."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [8], [3], [5, 0, 9], [0, 0, 0], seed=2)
    table, seq_lens, qsl = plain_metadata(spec, b.levels, 0)
    assert table.shape[0] == seq_lens.shape[0] == 3 and qsl.tolist() == [0, 0, 0, 0]
    out, lse = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=use, return_lse=True,
                                 attention=reference.paged_attention)
    assert out.shape == (0, 8, 32) and lse.shape == (0, 8)
    one = CascadeLevel(b.plain.block_table, b.plain.seq_lens, b.plain.query_start_loc)
    assert cascade_attention(spec, b.q, b.plain.kv_cache, [one], attention=reference.paged_attention).shape == (0, 8, 32)


def test_a_cuda_hook_with_a_parameter_named_like_kv_len_is_served():
    """The refusal of CUDA-string hooks reading qo_len / kv_len matched substrings: a parameter named
    max_kv_len made the cascade refuse a hook that reads no length. Whole names only; kv_len itself is
    still refused."""
    from jitattn.variant import Param, Variant

    ref = lambda score, batch, qo_head, qo_idx, kv_idx, params: torch.clamp(score, max=params.max_kv_len)  # noqa: E731
    v = Variant("capped", logits_transform="logits < max_kv_len ? logits : max_kv_len",
                params=(Param("max_kv_len", "float32"),), reference_transform=ref)
    spec = AttentionSpec(8, 2, 32, page_size=4, variant=v)
    b = random_cascade_batch(spec, [13], [3], [5, 0, 9], [1, 1, 2], seed=2, params={"max_kv_len": 0.5})
    want = reference.paged_attention(spec, *b.plain.args(), **b.plain.kwargs())
    got = cascade_attention(spec, b.q, b.kv_cache, b.levels, params={"max_kv_len": 0.5},
                            attention=reference.paged_attention)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    reads = Variant("reads", logits_transform="logits - kv_len", reference_transform=ref)
    with pytest.raises(ValueError, match=r"a CUDA hook reads qo_len / kv_len"):
        cascade_attention(AttentionSpec(8, 2, 32, page_size=4, variant=reads), b.q, b.kv_cache, b.levels,
                          attention=reference.paged_attention)


def test_out_is_written_in_place_on_both_paths():
    """cascade_attention(out=...) writes the result into out and returns it, on the cascade and the plain path."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    for use in (True, False):
        want, want_lse = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=use, return_lse=True,
                                           attention=reference.paged_attention)
        out = torch.full_like(want, float("nan"))
        got, lse = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=use, return_lse=True, out=out,
                                     attention=reference.paged_attention)
        assert got is out and torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \(4, 8, 32\)"):
        cascade_attention(spec, b.q, b.kv_cache, b.levels, out=torch.empty(4, 8, 16, dtype=want.dtype),
                          attention=reference.paged_attention)


def test_the_rule_assumes_graph_replay_and_takes_no_cascade_eagerly():
    assert cascade_pays(50, 1000, 100) and cascade_pays(50, 1000, 100, mode="graph")
    assert not cascade_pays(50, 1000, 100, mode="eager")
    with pytest.raises(ValueError, match=r"mode='fast': expected 'eager'"):
        cascade_pays(50, 1000, 100, mode="fast")


def test_a_cascade_plan_runs_every_layer_through_one_jit_plan(kernels):
    """On the jit kernels (recording ones here), the cascade plan makes its jit plan at the first layer and
    reuses it: one prefill launch per layer over the pseudo-batch, each with that layer's q copy and cache."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    plan = plan_cascade(spec, b.levels, b.q.shape[0], num_sms=132, chunks=[2, 1], mode="eager")
    assert plan.mode == "eager" and plan.attention_plan is None
    out = torch.empty(b.q.shape[0], 8, 32, dtype=b.q.dtype)
    for layer in range(2):
        assert cascade_attention(spec, b.q, b.kv_cache, b.levels, plan=plan, out=out) is out
        if layer == 0:
            first = plan.attention_plan
    assert plan.attention_plan is first and first.specs == (explicit_twin(spec),)
    [(kernel, module)] = kernels.values()
    assert [x["kernel"] for x in module.launches] == ["prefill", "prefill"]
    assert all(x["fields"]["total_q"] == plan.num_states * b.q.shape[0] for x in module.launches)
    assert all(x["fields"]["query_positions"] == plan.query_positions.data_ptr() for x in module.launches)


@pytest.mark.parametrize("args, match", [
    (lambda b, s: ("spec", b.levels, 4), r"spec: expected a jitattn.AttentionSpec, got str .*plan_cascade\(spec"),
    (lambda b, s: (AttentionSpec(8, 2, 32, kv_storage="ragged"), b.levels, 4),
     r"spec: cascade attention takes a paged"),
    (lambda b, s: (AttentionSpec(8, 1, 64, 32, kv_storage="latent", sm_scale=0.1, page_size=4), b.levels, 4),
     r"spec: cascade attention takes a paged .*got kv_storage='latent'"),
    (lambda b, s: (s, [], 4), r"levels: expected a non-empty list of CascadeLevel, got \[\]"),
    (lambda b, s: (s, b.levels, -1), r"total_q=-1: expected an int >= 0"),
    (lambda b, s: (s, b.levels, 4.0), r"total_q=4.0: expected an int >= 0"),
    (lambda b, s: (s, b.levels, 4, 0), r"num_sms=0: expected an int >= 1"),
])
def test_plan_cascade_checks_its_arguments_before_building(args, match):
    """plan_cascade is called by the engine directly (once per step): a bad spec, levels or size is a
    ValueError naming it, not an AttributeError / IndexError / torch error from inside the layout."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    spec_arg, levels, total_q, *rest = args(b, spec)
    with pytest.raises(ValueError, match=match):
        plan_cascade(spec_arg, levels, total_q, num_sms=rest[0] if rest else 132)


def test_a_cascade_over_a_padded_q_leaves_the_padding_out():
    """q with rows past the last request (an engine pads q to a graph's size): its segment index ran past
    the requests and plan_cascade indexed out of range (an IndexError here, a device-side assert on a
    GPU); the requests' rows are now those of the unpadded call."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    want = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=True, attention=reference.paged_attention)
    padded = torch.cat([b.q, torch.zeros(3, *b.q.shape[1:], dtype=b.q.dtype)])
    got = cascade_attention(spec, padded, b.kv_cache, b.levels, use_cascade=True, attention=reference.paged_attention)
    assert got.shape[0] == b.q.shape[0] + 3 and torch.equal(got[: b.q.shape[0]], want)


def test_a_shared_level_may_cover_a_padded_qs_padding_rows():
    """With a padded q, a shared level's last segment may end at total_q (over the padding rows) as well as
    where the requests end (b7cc86f ran it; the start checks of a70435a refused it on the reference path);
    the requests' rows stay those of the unpadded call. A boundary among the padding rows is still refused."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12, 8], [2, 1], [5, 3, 9], [1, 1, 2], seed=3)
    want = cascade_attention(spec, b.q, b.kv_cache, b.levels, use_cascade=True, attention=reference.paged_attention)
    padded = torch.cat([b.q, torch.zeros(3, *b.q.shape[1:], dtype=b.q.dtype)])
    ends = b.levels[0].query_start_loc.tolist()
    assert ends[-1] == b.q.shape[0] == 4
    for starts, ok in (([0, 2, 7], True), ([0, 2, 5, 7], False)):
        level0 = dataclasses.replace(b.levels[0], query_start_loc=torch.tensor(starts, dtype=torch.int32),
                                     kv_lens=b.levels[0].kv_lens[:len(starts) - 1].clone(),
                                     block_table=b.levels[0].block_table[:len(starts) - 1].clone())
        if len(starts) == 4:  # a third prefix (empty) among the padding rows
            level0 = dataclasses.replace(level0, kv_lens=torch.tensor([12, 8, 0], dtype=torch.int32),
                                         block_table=torch.cat([b.levels[0].block_table, b.levels[0].block_table[:1]]))
        levels = [level0, *b.levels[1:]]
        if ok:
            got = cascade_attention(spec, padded, b.kv_cache, levels, use_cascade=True,
                                    attention=reference.paged_attention)
            assert torch.equal(got[: b.q.shape[0]], want)
        else:
            with pytest.raises(ValueError, match=r"prefix_start_loc\) = \[0, 2, 5, 7\]: its boundary 5 falls among "
                                                 r"q's padding rows \(past the last request's end, 4\)"):
                cascade_attention(spec, padded, b.kv_cache, levels, use_cascade=True,
                                  attention=reference.paged_attention)


def test_an_out_that_requires_grad_is_refused_before_any_launch(kernels):  # noqa: F811
    """Writing the result into out in place is what autograd refuses for a tensor that requires grad: the
    call names out up front (no launch); under torch.no_grad() the same out is written."""
    spec = AttentionSpec(8, 2, 32, page_size=4)
    b = random_cascade_batch(spec, [12], [3], [5, 0, 9], [1, 1, 2], seed=2)
    plan = plan_cascade(spec, b.levels, b.q.shape[0], num_sms=132, chunks=[2, 1], mode="eager")
    out = torch.empty(b.q.shape[0], 8, 32, dtype=b.q.dtype, requires_grad=True)
    for kw in ({"plan": plan}, {"use_cascade": False, "attention": reference.paged_attention}):
        with pytest.raises(ValueError, match=r"out: requires_grad=True; cascade_attention writes its result into "
                                             r"out in place"):
            cascade_attention(spec, b.q, b.kv_cache, b.levels, out=out, **kw)
    assert sum(len(m.launches) for _, m in kernels.values()) == 0
    with torch.no_grad():
        assert cascade_attention(spec, b.q, b.kv_cache, b.levels, out=out, plan=plan) is out


def _two_prefixes(prefix_start_loc):
    """The new-user probe's batch: 2 prefixes (6 and 5 keys, page 4), requests of 2 and 1 queries."""
    spec = AttentionSpec(8, 2, 64, page_size=4, q_dtype="float16")
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(20, 2, 4, 2, 64, generator=gen).half()
    q = torch.randn(3, 8, 64, generator=gen).half()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    levels = two_level(i32([[0, 1], [6, 7]]), i32([6, 5]), i32(prefix_start_loc),
                       i32([[2, 3], [4, 5]]), i32([3, 5]), i32([0, 2, 3]))
    return spec, q, kv, levels


BAD_PREFIX_STARTS = [  # (prefix_start_loc, what the message says is wrong) with query_start_loc [0, 2, 3]
    ([0, 1, 3], r"its boundary 1 splits request 0 \(queries \[0, 2\)\)"),
    ([0, 3, 2], r"decreases at entry 2 \(3 -> 2\)"),
    ([0, 2, 9], r"ends at 9"),
    ([1, 2, 3], r"starts at 1"),
]


def _bad_prefix_match(psl, problem):
    return (rf"^levels\[0\].query_start_loc \(two_level's prefix_start_loc\) = {re.escape(str(psl))}: {problem}; "
            rf"expected int32 \(num_prefixes \+ 1,\): 0 first, non-decreasing, ending at total_q=3 as query_start_loc "
            rf"does, every entry also an entry of query_start_loc \(each prefix's queries are whole requests\)$")


@pytest.mark.parametrize("use", [True, False, None])
@pytest.mark.parametrize("psl, problem", BAD_PREFIX_STARTS, ids=[str(p) for p, _ in BAD_PREFIX_STARTS])
def test_a_bad_prefix_start_loc_is_named_before_any_pass(psl, problem, use):
    """The probe: [0, 1, 3] (request 0 split across two prefixes) and [0, 3, 2] (decreasing) gave outputs off
    by up to 2.19, [0, 2, 9] (past total_q) passed, [1, 2, 3] was the reference's message about the
    pseudo-batch ("query_start_loc ... total_q=6"). CPU levels are read without a device sync: checked always."""
    spec, q, kv, levels = _two_prefixes(psl)
    calls = []

    def attention(*args, **kwargs):
        calls.append(args)
        return reference.paged_attention(*args, **kwargs)

    with pytest.raises(ValueError, match=_bad_prefix_match(psl, problem)):
        cascade_attention(spec, q, kv, levels, attention=attention, use_cascade=use)
    assert calls == []


@pytest.mark.parametrize("psl, problem", BAD_PREFIX_STARTS, ids=[str(p) for p, _ in BAD_PREFIX_STARTS])
def test_plan_cascade_refuses_a_bad_prefix_start_loc(psl, problem):
    spec, _, _, levels = _two_prefixes(psl)
    with pytest.raises(ValueError, match=_bad_prefix_match(psl, problem)):
        plan_cascade(spec, levels, 3, num_sms=132)


def test_the_good_prefix_start_loc_equals_the_unsplit_batch():
    """[0, 2, 3] (and [0, 3, 3]: the second prefix shares no query) pass and equal the plain reference."""
    spec, q, kv, levels = _two_prefixes([0, 2, 3])
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    # request 0: prefix 0 (6 keys: pages 0, 1) + 3 own keys (page 2); request 1: prefix 1 (5 keys: 6, 7) + 5 (4, 5);
    # the plain call cannot express a mid-page prefix: copy each request's keys onto its own pages
    plain_kv = kv.clone()
    flat = lambda pages: plain_kv[pages].transpose(1, 2).reshape(-1, 2, 2, 64)  # noqa: E731  (keys, k/v, heads, d)
    seqs = [torch.cat([flat([0, 1])[:6], flat([2])[:3]]), torch.cat([flat([6, 7])[:5], flat([4, 5])[:5]])]
    table = i32([[10, 11, 12], [13, 14, 15]])
    for row, keys in zip(table.tolist(), seqs):
        pad = torch.zeros(12 - keys.shape[0], *keys.shape[1:], dtype=keys.dtype)
        plain_kv[row] = torch.cat([keys, pad]).view(3, 4, 2, 2, 64).transpose(1, 2)
    want = reference.paged_attention(spec, q, plain_kv, table, i32([9, 10]), i32([0, 2, 3]))
    for validate in (False, True):
        got = cascade_attention(spec, q, kv, levels, attention=reference.paged_attention, use_cascade=True,
                                validate=validate)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    plan_cascade(spec, _two_prefixes([0, 3, 3])[3], 3, num_sms=132)


@pytest.mark.parametrize("use, validate, reads", [(True, False, 0), (False, False, 1), (None, False, 1),
                                                   (True, True, 1)])
def test_cuda_levels_start_locations_are_read_only_where_values_are_read(monkeypatch, use, validate, reads):
    """Levels taken for CUDA ones (no host read for free): the cascade path reads their start locations only
    with validate=True; the path that may take the plain call reads them with the lengths it reads anyway, in
    one transfer (the eager rule says no here). A bad prefix_start_loc is then refused there too."""
    import jitattn.cascade as cascade

    spec, q, kv, levels = _two_prefixes([0, 1, 3])
    monkeypatch.setattr(cascade, "_on_host", lambda levels: False)
    seen = []
    real = cascade._host_lists
    monkeypatch.setattr(cascade, "_host_lists", lambda tensors: seen.append(len(tensors)) or real(tensors))
    call = lambda: cascade_attention(spec, q, kv, levels, attention=reference.paged_attention,  # noqa: E731
                                     use_cascade=use, validate=validate, mode="eager")
    if reads:
        with pytest.raises(ValueError, match=r"prefix_start_loc\) = \[0, 1, 3\]: its boundary 1 splits request 0"):
            call()
    else:
        call()  # undefined result, as documented
    assert len(seen) == reads


def test_the_jit_kernels_refuse_cpu_levels_as_jitattn_plan_does():
    """plan_cascade takes CPU levels (the reference path runs them); the jit kernels, cascade_attention's
    default, refuse them when its jit plan is made, before any launch, with jitattn.plan's message."""
    spec, q, kv, levels = _two_prefixes([0, 2, 3])
    plan = plan_cascade(spec, levels, 3, num_sms=132)
    for kw in ({"plan": plan}, {"use_cascade": True}):
        with pytest.raises(ValueError, match=r"device=cpu: jitattn kernels run on CUDA devices; use jitattn.reference"):
            cascade_attention(spec, q, kv, levels, **kw)


def test_validate_under_graph_capture_is_refused_before_any_read(monkeypatch):
    """validate=True reads the levels on the host, which capture forbids: the ValueError jitattn.plan gives,
    not a CUDA error from inside the capture; plan_cascade's new validate too."""
    import jitattn.cascade as cascade

    spec, q, kv, levels = _two_prefixes([0, 2, 3])
    monkeypatch.setattr(cascade, "capturing", lambda: True)
    for call in (lambda: cascade_attention(spec, q, kv, levels, attention=reference.paged_attention, validate=True),
                 lambda: plan_cascade(spec, levels, 3, num_sms=132, validate=True)):
        with pytest.raises(ValueError, match=r"validate=True: the cascade's checks read the levels on the host"):
            call()

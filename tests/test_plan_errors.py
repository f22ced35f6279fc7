"""Every plan / run error on the CPU: a plan used with tensors it does not fit is a ValueError naming
the argument, raised before any launch (the recording kernels of tests/test_plan_launches.py)."""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, runtime
from tests import launch_cases as lc
from tests.test_plan_launches import kernels  # noqa: F401 (fixture)

SPEC = AttentionSpec(8, 2, 64)


@pytest.fixture
def step(kernels):  # noqa: F811
    t = lc._paged(SPEC, [1, 5, 1], [30, 40, 17])
    plan = runtime.plan(SPEC, t["block_table"], t["seq_lens"], t["query_start_loc"], num_pages=t["kv_cache"].shape[0])
    return t, plan, kernels


def _launched(kernels) -> int:
    return sum(len(m.launches) for _, m in kernels.values())


@pytest.mark.parametrize("change, match", [
    (lambda t: dict(q=t["q"][:6]), r"q: expected shape \(7, 8, 64\) .* got \(6, 8, 64\)"),
    (lambda t: dict(q=t["q"].to(torch.float16)), r"q: expected dtype torch.bfloat16, got torch.float16"),
    (lambda t: dict(q=t["q"].to("meta")), r"q: on meta, but the plan .* is on cpu"),
    (lambda t: dict(q=t["q"].transpose(1, 2).contiguous().transpose(1, 2)), r"q: heads and head_dim must be contig"),
    (lambda t: dict(q=t["q"][..., :32]), r"q: expected shape \(7, 8, 64\)"),
    (lambda t: dict(q="q"), r"q: expected a torch.Tensor, got str"),
    (lambda t: dict(kv_cache=t["kv_cache"][:5]), r"kv_cache: 5 pages, but the plan was made for num_pages=10"),
    (lambda t: dict(kv_cache=torch.zeros(9, 2, 32, 2, 64, dtype=torch.bfloat16)),
     r"kv_cache: dim 2 \(page_size\) must be 16"),
    (lambda t: dict(kv_cache=t["kv_cache"].to(torch.float16)), r"kv_cache: expected dtype torch.bfloat16"),
    (lambda t: dict(kv_cache=t["kv_cache"].to("meta")),
     r"kv_cache: on meta, but the plan \(its metadata and kernel\) is on cpu"),
    (lambda t: dict(kv_cache=t["kv_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
     r"kv_cache: dims 1-4 must be contiguous"),
    (lambda t: dict(out=torch.empty(7, 8, 32, dtype=torch.bfloat16)), r"out: expected a contiguous \(7, 8, 64\)"),
    (lambda t: dict(out=torch.empty(7, 8, 64, dtype=torch.float16)), r"out: expected dtype torch.bfloat16"),
    (lambda t: dict(out=torch.empty(7 * 8 * 64 + 1, dtype=torch.bfloat16)[1:].view(7, 8, 64)),
     r"out: the data must start 16-byte aligned, got data_ptr % 16 = 2"),
    (lambda t: dict(sinks=torch.zeros(8)), r"sinks: given, but spec.sinks=False"),
    (lambda t: dict(alibi_slopes=torch.zeros(8)), r"alibi_slopes: given, but spec.alibi=False"),
    (lambda t: dict(params={"x": 1}), r"params: unknown names \['x'\]"),
    (lambda t: dict(k_scale=2.0), r"k_scale=2.0: only an FP8 cache"),
    (lambda t: dict(return_lse="yes"), r"return_lse='yes': expected True or False"),
])
def test_run_refuses_what_does_not_fit_the_plan(step, change, match):
    t, plan, kernels = step
    args = {"q": t["q"], "kv_cache": t["kv_cache"], **change(t)}
    q, kv = args.pop("q"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        runtime.run(q, kv, plan, **args)
    assert _launched(kernels) == 0


def test_run_refuses_a_spec_of_another_layout(step):
    t, plan, kernels = step
    for other, match in [(SPEC.replace(page_size=32), r"spec: page_size=32, but the plan's block_table indexes pages "
                                                      r"of 16 tokens"),
                         (SPEC.replace(query_positions="explicit"), r"spec: query_positions='explicit', but the plan "
                                                                    r"was made without explicit query positions"),
                         (AttentionSpec(8, 2, 64, kv_storage="ragged"), r"spec: kv_storage='ragged', but the plan is "
                                                                        r"for a paged batch")]:
        with pytest.raises(ValueError, match=match):
            runtime.run(t["q"], t["kv_cache"], plan, spec=other)
    with pytest.raises(ValueError, match=r"spec: expected a jitattn.AttentionSpec, got str"):
        runtime.run(t["q"], t["kv_cache"], plan, spec="spec")
    with pytest.raises(ValueError, match=r"plan: expected a Plan from jitattn.plan"):
        runtime.run(t["q"], t["kv_cache"], object())
    assert _launched(kernels) == 0


def test_a_spec_of_other_heads_sharing_the_layout_checks_its_own_shapes(step):
    """A second spec on the same plan (planned on first use) checks q against its own heads."""
    t, plan, kernels = step
    wider = AttentionSpec(16, 2, 64)
    with pytest.raises(ValueError, match=r"q: expected shape \(7, 16, 64\)"):
        runtime.run(t["q"], t["kv_cache"], plan, spec=wider)
    out = runtime.run(torch.zeros(7, 16, 64, dtype=torch.bfloat16), t["kv_cache"], plan, spec=wider)
    assert out.shape == (7, 16, 64) and plan.specs == (SPEC, wider)


@pytest.mark.parametrize("change, match", [
    (lambda t: dict(query_start_loc=t["query_start_loc"].long()), r"query_start_loc: expected dtype torch.int32"),
    (lambda t: dict(seq_lens=t["seq_lens"][:2]), r"seq_lens: dim 0 \(batch, from query_start_loc\) must be 3"),
    (lambda t: dict(block_table=t["block_table"].t().contiguous().t()), r"block_table: rows must be contiguous"),
    (lambda t: dict(block_table=t["block_table"].to("meta")),
     r"block_table: expected device cpu \(the device of the kernel\), got meta"),
    (lambda t: dict(mode="lazy"), r"mode='lazy': expected 'eager'"),
    (lambda t: dict(mode="graph"), r"total_q: required in graph mode"),
    (lambda t: dict(total_q=-1), r"total_q=-1: expected None or an int >= 0"),
    (lambda t: dict(total_q=6), r"total_q=6: query_start_loc ends at 7, so its last queries have no row of q"),
    (lambda t: dict(max_query_len=True), r"max_query_len=True: expected None or an int >= 0"),
    (lambda t: dict(validate=True), r"num_pages: validate=True checks the page ids"),
    (lambda t: dict(validate=True, num_pages=2), r"block_table\[1\]: page ids must be in \[0, 2\)"),
    (lambda t: dict(validate=True, num_pages=9, max_query_len=1), r"max_query_len=1: a sequence brings 5 queries"),
    (lambda t: dict(query_positions=torch.zeros(7, dtype=torch.int32)), r"query_positions: given, but the spec has "
                                                                        r"query_positions='implicit'"),
])
def test_plan_refuses_bad_metadata(kernels, change, match):  # noqa: F811
    t = lc._paged(SPEC, [1, 5, 1], [30, 40, 17])
    args = {"block_table": t["block_table"], "seq_lens": t["seq_lens"], "query_start_loc": t["query_start_loc"],
            **change(t)}
    with pytest.raises(ValueError, match=match):
        runtime.plan(SPEC, args.pop("block_table"), args.pop("seq_lens"), args.pop("query_start_loc"), **args)


def test_plan_refuses_bad_specs(kernels):  # noqa: F811
    t = lc._paged(SPEC, [1], [30])
    md = (t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=r"spec: expected a jitattn.AttentionSpec, got dict"):
        runtime.plan({"num_qo_heads": 8}, *md)
    with pytest.raises(ValueError, match=r"spec: expected an AttentionSpec or a non-empty sequence"):
        runtime.plan([], *md)
    with pytest.raises(ValueError, match=r"spec: page_size=32, but the plan's block_table"):
        runtime.plan([SPEC, SPEC.replace(page_size=32)], *md)
    with pytest.raises(ValueError, match=r"this kernel reads ragged K/V; plan it with plan_ragged"):
        runtime.plan(AttentionSpec(8, 2, 64, kv_storage="ragged"), *md)


def test_ragged_run_errors(kernels):  # noqa: F811
    spec = AttentionSpec(8, 2, 64, kv_storage="ragged")
    t = lc._ragged(spec, [1, 9], [20, 37])
    plan = runtime.plan_ragged(spec, t["query_start_loc"], t["kv_start_loc"])
    with pytest.raises(ValueError, match=r"kv: a ragged plan runs with a \(k, v\) pair, got Tensor"):
        runtime.run(t["q"], t["k"], plan)
    with pytest.raises(ValueError, match=r"k: dim 1 \(num_kv_heads\) must be 2"):
        runtime.run(t["q"], (t["k"][:, :1], t["v"]), plan)
    with pytest.raises(ValueError, match=r"v: dim 0 \(total_kv\) must equal k's, 57"):
        runtime.run(t["q"], (t["k"], t["v"][:50]), plan)
    with pytest.raises(ValueError, match=r"q: expected shape \(10, 8, 64\)"):
        runtime.run(t["q"][:9], (t["k"], t["v"]), plan)
    with pytest.raises(ValueError, match=r"kv_start_loc: dim 0 \(batch \+ 1, from query_start_loc\) must be 3"):
        runtime.plan_ragged(spec, t["query_start_loc"], t["kv_start_loc"][:2])
    with pytest.raises(ValueError, match=r"total_kv: validate=True checks kv_start_loc"):
        runtime.plan_ragged(spec, t["query_start_loc"], t["kv_start_loc"], validate=True)
    assert sum(len(m.launches) for _, m in kernels.values()) == 0


def test_validate_under_graph_capture_is_refused(kernels, monkeypatch):  # noqa: F811
    from jitattn import planning

    monkeypatch.setattr(planning, "capturing", lambda: True)
    t = lc._paged(SPEC, [1], [30])
    with pytest.raises(ValueError, match=r"validate=True: .*CUDA graph capture"):
        runtime.plan(SPEC, t["block_table"], t["seq_lens"], t["query_start_loc"], total_q=1, validate=True)


def test_an_out_at_an_odd_element_offset_is_refused_on_every_run_path(kernels):  # noqa: F811
    """A contiguous out one element into its storage would fault the kernels' 32-bit stores: refused on
    the one-call paged path and on a ragged run too, before any launch."""
    t = lc._paged(SPEC, [1, 5, 1], [30, 40, 17])
    odd = torch.empty(7 * 8 * 64 + 1, dtype=torch.bfloat16)[1:].view(7, 8, 64)
    with pytest.raises(ValueError, match=r"out: the data must start 16-byte aligned"):
        runtime.paged_attention(SPEC, t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], t["query_start_loc"],
                                out=odd)
    spec = AttentionSpec(8, 2, 64, kv_storage="ragged")
    r = lc._ragged(spec, [1, 9], [20, 37])
    plan = runtime.plan_ragged(spec, r["query_start_loc"], r["kv_start_loc"])
    with pytest.raises(ValueError, match=r"out: the data must start 16-byte aligned"):
        runtime.run(r["q"], (r["k"], r["v"]), plan, out=torch.empty(10 * 8 * 64 + 1, dtype=torch.bfloat16)[1:]
                    .view(10, 8, 64))
    assert _launched(kernels) == 0


def test_a_ragged_plan_given_total_kv_refuses_k_and_v_of_another_row_count(kernels):  # noqa: F811
    """As num_pages for a paged plan: the rows validate checked kv_start_loc against are the rows a run takes;
    the one-call path, which plans with k's rows, plans again for k of another row count."""
    spec = AttentionSpec(8, 2, 64, kv_storage="ragged")
    t = lc._ragged(spec, [1, 9], [20, 37])
    plan = runtime.plan_ragged(spec, t["query_start_loc"], t["kv_start_loc"], total_kv=57, validate=True)
    with pytest.raises(ValueError, match=r"k: 40 rows, but the plan was made for total_kv=57"):
        runtime.run(t["q"], (t["k"][:40], t["v"][:40]), plan)
    assert _launched(kernels) == 0
    runtime.ragged_attention(spec, t["q"], t["k"], t["v"], t["query_start_loc"], t["kv_start_loc"])
    runtime.ragged_attention(spec, t["q"], t["k"][:50], t["v"][:50], t["query_start_loc"], t["kv_start_loc"])
    (kernel, module), = kernels.values()
    assert [m["fields"]["total_kv"] for m in module.launches] == [57, 50]


def test_a_float32_parameter_beyond_float32_is_a_value_error_before_any_launch(kernels):  # noqa: F811
    """The run packs a float32 scalar into Params: a finite value float32 cannot hold is refused by the
    checks (naming the parameter), not by struct's OverflowError mid-pack; inf still passes."""
    from jitattn.variant import Param, Variant

    variant = Variant("scaled", logits_transform="logits * alpha", params=(Param("alpha", "float32"),),
                      reference_transform=lambda s, b, h, qi, ki, p: s * p.alpha)
    spec = AttentionSpec(8, 2, 64, variant=variant)
    t = lc._paged(spec, [1, 5, 1], [30, 40, 17])
    plan = runtime.plan(spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=r"params\['alpha'\]: 1e\+40 is outside float32's range"):
        runtime.run(t["q"], t["kv_cache"], plan, params={"alpha": 1e40})
    assert _launched(kernels) == 0
    runtime.run(t["q"], t["kv_cache"], plan, params={"alpha": float("inf")})
    assert _launched(kernels) == 2


def test_an_fp8_scale_float32_cannot_hold_is_a_value_error_before_any_launch(kernels):  # noqa: F811
    """k_scale is packed as a float32: 1e40 was checked as positive and finite and then raised struct's
    OverflowError mid-pack; now it is refused by the checks, naming k_scale."""
    spec = AttentionSpec(8, 2, 64, kv_dtype="float8_e4m3fn")
    t = lc._paged(spec, [1, 5, 1], [30, 40, 17])
    plan = runtime.plan(spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=r"k_scale=1e\+40: expected a positive finite Python float .*float32"):
        runtime.run(t["q"], t["kv_cache"], plan, k_scale=1e40)
    assert _launched(kernels) == 0


@pytest.mark.parametrize("call", ["paged", "ragged"])
def test_the_one_call_forms_name_a_bad_spec_or_q_before_loading_a_kernel(kernels, call):  # noqa: F811
    """They load the spec's kernel on q's device first: a non-spec or a non-tensor q was an AttributeError."""
    fn = runtime.paged_attention if call == "paged" else runtime.ragged_attention
    t = lc._paged(SPEC, [1], [30])
    rest = (t["kv_cache"], t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=rf"spec: expected a jitattn.AttentionSpec, got str .*{call}_attention\(spec"):
        fn("spec", t["q"], *rest)
    with pytest.raises(ValueError, match=r"q: expected a torch.Tensor, got list"):
        fn(SPEC, [[0.0]], *rest)
    assert not kernels


def test_a_plan_names_query_start_loc_that_is_not_a_tensor_before_loading_a_kernel(kernels):  # noqa: F811
    """Its device is where the kernels load: a list there loaded on the current CUDA device (on the CPU:
    a RuntimeError about CUDA) before the metadata checks named it."""
    t = lc._paged(SPEC, [1], [30])
    with pytest.raises(ValueError, match=r"query_start_loc: expected a torch.Tensor, got list"):
        runtime.plan(SPEC, t["block_table"], t["seq_lens"], [0, 1])
    with pytest.raises(ValueError, match=r"query_start_loc: expected a torch.Tensor, got list"):
        runtime.plan_ragged(AttentionSpec(8, 2, 64, kv_storage="ragged"), [0, 1], torch.tensor([0, 30]))
    assert not kernels


def test_an_out_that_overlaps_an_input_is_refused_before_any_launch(kernels):  # noqa: F811
    """out=q, out inside the cache's pages (one tensor or a pair), out inside ragged k: each a ValueError
    naming what it overlaps, on run and the one-call path; out and q in disjoint halves of one buffer run."""
    t = lc._paged(SPEC, [1, 5, 1], [30, 40, 17])
    md = (t["block_table"], t["seq_lens"], t["query_start_loc"])
    plan = runtime.plan(SPEC, *md)
    q, kv = t["q"], t["kv_cache"]
    rows = 7 * 8 * 64
    with pytest.raises(ValueError, match=r"out: overlaps q in memory .*pass an out of its own"):
        runtime.run(q, kv, plan, out=q)
    with pytest.raises(ValueError, match=r"out: overlaps q in memory"):
        runtime.paged_attention(SPEC, q, kv, *md, out=q)
    in_pages = kv.view(-1)[1024:1024 + rows].view(7, 8, 64)  # inside page 0's K and V
    with pytest.raises(ValueError, match=r"out: overlaps kv_cache in memory"):
        runtime.run(q, kv, plan, out=in_pages)
    last_page = kv.view(-1)[(kv.shape[0] - 1) * kv.stride(0):][:rows].view(7, 8, 64)
    param = torch.nn.Parameter(kv, requires_grad=False)  # a tensor subclass is one cache, not a (k, v) pair
    with pytest.raises(ValueError, match=r"out: overlaps kv_cache in memory"):
        runtime.run(q, param, plan, out=last_page)
    with pytest.raises(ValueError, match=r"out: overlaps kv_cache in memory"):
        runtime.paged_attention(SPEC, q, param, *md, out=last_page)
    k_cache, v_cache = torch.zeros(2, *kv[:, 0].shape, dtype=torch.bfloat16)  # a pair of separate tensors
    with pytest.raises(ValueError, match=r"out: overlaps v_cache in memory"):
        runtime.run(q, (k_cache, v_cache), plan, out=v_cache.view(-1)[:rows].view(7, 8, 64))
    spec = AttentionSpec(8, 2, 64, kv_storage="ragged")
    r = lc._ragged(spec, [1, 9], [20, 37])
    ragged = runtime.plan_ragged(spec, r["query_start_loc"], r["kv_start_loc"])
    with pytest.raises(ValueError, match=r"out: overlaps k in memory"):
        runtime.run(r["q"], (r["k"], r["v"]), ragged, out=r["k"].view(-1)[:10 * 8 * 64].view(10, 8, 64))
    assert _launched(kernels) == 0
    halves = torch.empty(2, 7, 8, 64, dtype=torch.bfloat16)  # q and out side by side in one buffer
    out = halves[1]
    assert runtime.run(halves[0], kv, plan, out=out) is out
    runtime.run(q, (kv[:, 0], kv[:, 1]), plan, out=torch.empty(7, 8, 64, dtype=torch.bfloat16))
    assert _launched(kernels) == 4


def test_an_out_that_overlaps_sinks_or_slopes_is_refused_before_any_launch(kernels):  # noqa: F811
    """out sharing bytes with the sinks or the ALiBi slopes the kernels read: a ValueError naming them, on
    the per-layer fast path (sinks) and the full checks (slopes); beside them, in one buffer, it runs."""
    spec = AttentionSpec(8, 2, 64, sinks=True, alibi=True)
    t = lc._paged(spec, [1, 5, 1], [30, 40, 17])
    md = (t["block_table"], t["seq_lens"], t["query_start_loc"])
    plan = runtime.plan(spec, *md)
    out_bytes = 7 * 8 * 64 * 2
    pool = torch.zeros(out_bytes + 64, dtype=torch.uint8)  # out's bytes, then 64 more
    out = pool[:out_bytes].view(torch.bfloat16).view(7, 8, 64)
    inside = pool[32:64].view(torch.float32)  # 8 floats in out's first row
    with pytest.raises(ValueError, match=r"out: overlaps sinks in memory .*pass an out of its own"):
        runtime.run(t["q"], t["kv_cache"], plan, out=out, sinks=inside)
    with pytest.raises(ValueError, match=r"out: overlaps sinks in memory"):
        runtime.paged_attention(spec, t["q"], t["kv_cache"], *md, out=out, sinks=inside)
    apart = pool[out_bytes:out_bytes + 32].view(torch.float32)
    with pytest.raises(ValueError, match=r"out: overlaps alibi_slopes in memory"):
        runtime.run(t["q"], t["kv_cache"], plan, out=out, sinks=apart, alibi_slopes=inside)
    assert _launched(kernels) == 0
    assert runtime.run(t["q"], t["kv_cache"], plan, out=out, sinks=apart) is out
    assert runtime.run(t["q"], t["kv_cache"], plan, out=out, sinks=apart,
                       alibi_slopes=pool[out_bytes + 32:].view(torch.float32)) is out
    assert _launched(kernels) == 4  # a decode and a prefill launch per run

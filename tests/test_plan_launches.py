"""plan/run on the CPU: the launches it makes equal those of the one-call path before it (a351357).

The CPU cannot launch, so the kernels here are :meth:`JitKernel.from_module` over a module that
records each launch (kernel name, grid, block, shared memory, stream, the Params bytes unpacked
field by field) from the fixed geometry of tests/launch_cases.py. tests/golden/launches.json holds
the launches the old code made for the same batches (tests/golden/make_launch_golden.py, run on a
scratch worktree of a351357); pointer fields are compared as the names of the tensors they point to.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jitattn import runtime
from jitattn.planning import Plan
from tests import launch_cases as lc

GOLDEN = json.loads((Path(__file__).parent / "golden" / "launches.json").read_text())


class Recorder:
    """A module whose launches are recorded, not run."""

    def __init__(self):
        self.launches: list[dict] = []
        self.kernel = None

    def launch(self, name, grid, block, smem, params, stream):
        layout = self.kernel.layout
        assert isinstance(params, bytes) and len(params) == layout.size
        # what the driver binding takes (its argument memo is keyed on them): a tuple grid, exact ints
        assert type(grid) is tuple and len(grid) == 3 and all(type(d) is int for d in (*grid, block, smem, stream))
        self.launches.append({"kernel": name, "grid": list(grid), "block": block, "smem": smem, "stream": stream,
                              "fields": dict(zip(layout.field_order, layout.packer.unpack(params)))})


def fake_kernel(spec, *, two_streams: bool = False) -> tuple[runtime.JitKernel, Recorder]:
    module = Recorder()
    kernel = runtime.JitKernel.from_module(spec, module, lc.GEOMETRY, device=torch.device("cpu"), num_sms=lc.NUM_SMS,
                                           decode_blocks_per_sm=lc.DECODE_BLOCKS_PER_SM,
                                           stream_handle=lambda: lc.STREAM)
    kernel.mixed_on_two_streams = two_streams
    module.kernel = kernel
    return kernel, module


def _recorded_split_rule(blocks: int, slots: int, max_useful: int, *, min_wave_fill: float = 0.9) -> int:
    """The split-KV rule the golden launches were recorded under (until 2026-12-04 a single wave had to be
    whole): the split count is the rule's choice (tests/test_runtime.py holds today's), not what is compared."""
    cap = max(1, min(max_useful, runtime.MAX_SPLITS))
    s = min(max(1, math.ceil(slots / max(blocks, 1))), cap)
    while s < cap and blocks * s / (math.ceil(blocks * s / slots) * slots) < min_wave_fill:
        s += 1
    return s


@pytest.fixture
def kernels(monkeypatch):
    """load_kernel returns recording kernels (one per spec), so jitattn.plan / paged_attention run on the CPU;
    split counts by the rule the golden record was made under."""
    made: dict[str, tuple[runtime.JitKernel, Recorder]] = {}
    monkeypatch.setattr(runtime, "choose_num_splits", _recorded_split_rule)

    def load(spec, device=None):
        if spec.canonical_text not in made:
            made[spec.canonical_text] = fake_kernel(spec)
        return made[spec.canonical_text][0]

    monkeypatch.setattr(runtime, "load_kernel", load)
    return made


def _symbolic(case, kernel, launches, result, plan=None):
    extra = {"default_slopes": kernel.default_slopes,
             **{"split_counters": t for t in kernel._split_counters.values()}}
    names = lc.pointer_names(case, result, extra)
    if plan is not None:
        part = plan.for_spec(case.spec)
        if part.counters is not None:
            names[part.counters.data_ptr()] = "split_counters"
    out = []
    for launch in launches:
        out.append({**launch, "fields": lc.symbolic(launch["fields"], kernel.layout.pointer_fields, names)})
    return out


def _does_work(launch, case) -> bool:
    """Whether an old launch had rows to serve: a decode kernel serves the one-query sequences, a
    prefill kernel that skips them (prefill_skip_decode_rows) the others."""
    lens = case.tensors["query_start_loc"].diff().tolist()
    if launch["kernel"] == "decode":
        return any(n == 1 for n in lens)
    return not launch["fields"]["prefill_skip_decode_rows"] or any(n > 1 for n in lens)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_one_call_launches_equal_the_old_ones(name, kernels):
    """jitattn.paged_attention / ragged_attention (now a plan made and run per call): the very launches
    of the old call, every field of every launch."""
    case = lc.cases()[name]
    fn = runtime.paged_attention if case.kind == "paged" else runtime.ragged_attention
    result = case.call(lambda *a, **kw: fn(case.spec, *a, **kw))
    kernel, module = kernels[case.spec.canonical_text]
    assert _symbolic(case, kernel, module.launches, result) == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_plan_run_launches_equal_the_old_ones_that_do_work(name, kernels):
    """An eager plan (made once) run as a layer would be: the old launches, less those that had no rows
    to serve (the decode kernel of a batch without one-query sequences, the prefill kernel of a pure
    decode batch, which the old call launched unless told max_query_len=1); a prefill-only launch then
    carries no split scratch (the prefill kernel reads none)."""
    case = lc.cases()[name]
    t, kw = case.tensors, dict(case.kwargs)
    run_kw = {k: kw.pop(k) for k in ("return_lse", "k_scale", "v_scale") if k in kw}
    for k in ("out", "sinks", "alibi_slopes"):
        if k in t:
            run_kw[k] = t[k]
    if case.params:
        run_kw["params"] = case.params
    if case.kind == "paged":
        positions = {k: t[k] for k in ("query_positions", "functor_batch", "position_offset") if k in t}
        plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"], **kw, **positions)
        result = runtime.run(t["q"], t["kv_cache"], plan, **run_kw)
    else:
        kw.pop("max_query_len", None)
        plan = runtime.plan_ragged(case.spec, t["query_start_loc"], t["kv_start_loc"])
        result = runtime.run(t["q"], (t["k"], t["v"]), plan, **run_kw)
    kernel, module = kernels[case.spec.canonical_text]
    got = _symbolic(case, kernel, module.launches, result, plan)
    want = [launch for launch in GOLDEN[name] if _does_work(launch, case)]
    if [w["kernel"] for w in want] == ["prefill"] and GOLDEN[name][0]["kernel"] == "decode":
        for w in want:
            w["fields"] = {**w["fields"], "num_splits": 1, "partial_o": 0, "partial_lse": 0, "split_counters": 0}
    if case.kind == "paged":  # an eager plan read the lengths: its prefill grid is the exact tile count
        for w in want:
            if w["kernel"] == "prefill":
                w["grid"] = [_exact_prefill_tiles(case), *w["grid"][1:]]
    assert got == want


def _exact_prefill_tiles(case) -> int:
    """The m-tiles prefill_find_tile numbers for the case's lengths (:func:`_kernel_tiles`; one-query
    sequences go to the decode kernel, but for explicit positions), at least one."""
    qsl = case.tensors["query_start_loc"].tolist()
    return max(1, _kernel_tiles(qsl, qsl[-1], case.spec.group_size, lc.GEOMETRY["prefill_block_m"],
                                skip=not case.spec.explicit_positions))


def test_a_plan_serves_every_layer_with_its_own_pointers(kernels):
    """Three layers through one plan: the plan-time fields are the same in every launch, the per-layer
    ones (q, kv_cache, o, kv_stride_page, num_pages) are each layer's."""
    case = lc.cases()["split_kv_mixed"]
    t = case.tensors
    plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    layers = [(t["q"].clone(), t["kv_cache"].clone()) for _ in range(3)]
    outs = [runtime.run(q, kv, plan) for q, kv in layers]
    _, module = kernels[case.spec.canonical_text]
    assert [launch["kernel"] for launch in module.launches] == ["decode", "prefill"] * 3
    for i, ((q, kv), out) in enumerate(zip(layers, outs)):
        for launch in module.launches[2 * i: 2 * i + 2]:
            f = launch["fields"]
            assert (f["q"], f["kv_cache"], f["o"]) == (q.data_ptr(), kv.data_ptr(), out.data_ptr())
            assert f["block_table"] == t["block_table"].data_ptr() and f["num_splits"] > 1
    partial = {launch["fields"]["partial_o"] for launch in module.launches}
    assert len(partial) == 1  # the plan's scratch, allocated once


def test_specs_sharing_a_layout_share_one_plan(kernels):
    """Gemma-2's sliding and full layers: one plan, each spec its own kernel, split factor and Params."""
    full = lc.AttentionSpec(16, 8, 256, logits_soft_cap=50.0, q_dtype="float16")
    sliding = full.replace(window_left=511)
    t = lc._paged(full, [1, 1, 1], [9000, 100, 5000], pages_per_seq=600)
    plan = runtime.plan([sliding, full], t["block_table"], t["seq_lens"], t["query_start_loc"])
    assert plan.specs == (sliding, full)
    runtime.run(t["q"], t["kv_cache"], plan)  # the first spec by default
    runtime.run(t["q"], t["kv_cache"], plan, spec=full)
    (ks, ms), (kf, mf) = kernels[sliding.canonical_text], kernels[full.canonical_text]
    [s], [f] = ms.launches, mf.launches
    assert s["kernel"] == f["kernel"] == "decode"
    assert s["fields"]["num_splits"] < f["fields"]["num_splits"]  # the window reads fewer keys
    assert s["fields"]["block_table"] == f["fields"]["block_table"] == t["block_table"].data_ptr()


def test_graph_mode_decides_from_shapes_only(kernels, monkeypatch):
    """mode='graph' reads nothing on the host: it needs total_q, launches both kernels unless told
    max_query_len=1, and its launches do not change when the metadata values do."""
    case = lc.cases()["decode_batch_lse"]
    t = case.tensors
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self) or real_tolist(self))
    with pytest.raises(ValueError, match="total_q: required in graph mode"):
        runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"], mode="graph")
    plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"], mode="graph", total_q=3)
    decode_only = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"], mode="graph",
                               total_q=3, max_query_len=1)
    assert reads == []
    runtime.run(t["q"], t["kv_cache"], plan)
    runtime.run(t["q"], t["kv_cache"], decode_only)
    _, module = kernels[case.spec.canonical_text]
    assert [launch["kernel"] for launch in module.launches] == ["decode", "prefill", "decode"]
    eager = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    assert len(reads) == 1 and eager.decode_rows and eager.prefill_rows is False  # the one host read


def _two_stream_plan(monkeypatch, mode="graph"):
    """The split_kv_mixed case planned (graph mode: the lengths unknown) on a recording kernel with
    mixed_on_two_streams, torch's current stream and the kernel's side stream replaced by fakes that record
    what they waited for."""
    case = lc.cases()["split_kv_mixed"]
    t = case.tensors
    kernel, module = fake_kernel(case.spec, two_streams=True)
    main, side = _FakeStream(lc.STREAM), _FakeStream(8)
    forks = []

    def stream_fork(handle):
        assert handle == lc.STREAM  # the caller's current stream (the kernel's stream_handle)
        forks.append(handle)
        return _FakeFork(main, side)

    kernel.stream_fork = stream_fork
    plan = kernel.plan(t["block_table"], t["seq_lens"], t["query_start_loc"], total_q=t["q"].shape[0], mode=mode)
    return t, module, main, side, plan


def test_mixed_plan_forks_the_decode_onto_a_side_stream(monkeypatch):
    """With mixed_on_two_streams, a run with both kernels launches the decode on the side stream (after
    it waits for the caller's) and the prefill on the caller's, which then waits for the side stream."""
    t, module, main, side, plan = _two_stream_plan(monkeypatch)
    runtime.run(t["q"], t["kv_cache"], plan)
    assert [(x["kernel"], x["stream"]) for x in module.launches] == [("decode", 8), ("prefill", lc.STREAM)]
    assert side.waited_for == [lc.STREAM] and main.waited_for == [8]


def test_an_eager_plan_launches_the_prefill_on_its_exact_grid(monkeypatch):
    """Eager, the lengths read: the prefill grid is its tile count (1 x 7 queries x group 4 rows in 128-row
    tiles: one tile per KV head), not the bound any lengths of these shapes fit (ceil(9 x 4 / 128) + 3 = 4),
    so no block of it only finds it has nothing to do; a graph-mode plan keeps the bound."""
    t, module, main, side, plan = _two_stream_plan(monkeypatch, mode="eager")
    runtime.run(t["q"], t["kv_cache"], plan)
    assert [(x["kernel"], x["grid"]) for x in module.launches][1] == ("prefill", [1, 8, 1])
    module.launches.clear()
    t, module, main, side, plan = _two_stream_plan(monkeypatch, mode="graph")
    runtime.run(t["q"], t["kv_cache"], plan)
    assert [(x["kernel"], x["grid"]) for x in module.launches][1] == ("prefill", [4, 8, 1])


@pytest.mark.parametrize("fails", ["decode", "prefill"])
def test_mixed_run_joins_the_side_stream_when_a_launch_raises(monkeypatch, fails):
    """A launch that raises between the fork and the join still joins the side stream back into the
    caller's (else the caller's stream would run ahead of a queued decode, and a capture end unjoined)."""
    t, module, main, side, plan = _two_stream_plan(monkeypatch)
    real = plan.for_spec(None)._launch

    def launch(name, *args):
        if name == fails:
            raise RuntimeError(f"CUDA error: {name} launch failed")
        real(name, *args)

    plan.for_spec(None)._launch = launch
    with pytest.raises(RuntimeError, match=f"{fails} launch failed"):
        runtime.run(t["q"], t["kv_cache"], plan)
    assert side.waited_for == [lc.STREAM] and main.waited_for == [8]


class _FakeStream(SimpleNamespace):
    def __init__(self, handle):
        super().__init__(cuda_stream=handle, waited_for=[])

    def wait_stream(self, other):
        self.waited_for.append(other.cuda_stream)


class _FakeFork:
    """runtime.StreamFork's calls, recorded as one stream waiting for the other."""

    def __init__(self, main, side):
        self.main, self.side = main, side

    def fork(self):
        self.side.wait_stream(self.main)
        return self.side.cuda_stream

    def join(self):
        self.main.wait_stream(self.side)


def test_plan_counters_made_under_capture_are_zeroed_at_their_next_run(kernels, monkeypatch):
    """A plan made while a graph is captured holds fused-merge counters whose zero fill only runs when
    that graph replays: its next run zeroes them (recorded again under capture, eagerly once)."""
    from jitattn import planning

    case = lc.cases()["split_kv_decode"]
    t = case.tensors
    monkeypatch.setattr(planning, "capturing", lambda: True)
    plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"], total_q=2,
                        max_query_len=1)
    assert plan.mode == "graph"
    part = plan.for_spec(None)
    part.counters.fill_(7)
    runtime.run(t["q"], t["kv_cache"], plan)
    assert not part.counters.any() and part._unzeroed  # still to be zeroed outside the capture
    monkeypatch.setattr(planning, "capturing", lambda: False)
    part.counters.fill_(7)
    runtime.run(t["q"], t["kv_cache"], plan)
    assert not part.counters.any() and not part._unzeroed
    part.counters[0] = 1  # eager runs leave them zero; no fill per run once they are known zero
    runtime.run(t["q"], t["kv_cache"], plan)
    assert part.counters[0] == 1


def test_plan_repr_and_type(kernels):
    case = lc.cases()["mixed_alibi_default"]
    t = case.tensors
    plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    assert isinstance(plan, Plan) and "kernels=decode+prefill" in repr(plan) and plan.max_query_len == 5


def test_one_calls_on_the_same_metadata_plan_once(kernels, monkeypatch):
    """Layers calling paged_attention with one batch's metadata tensors reuse the stream's last plan (a
    graph-mode plan reads no value, so new values in the same tensors change nothing it holds); other
    tensors, validate=True or a capture make a new one."""
    from jitattn import planning

    case = lc.cases()["split_kv_mixed"]
    t = case.tensors
    made = []
    real = planning.make_paged_plan
    monkeypatch.setattr(runtime, "make_paged_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    args = lambda: (t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], t["query_start_loc"])  # noqa: E731
    for _ in range(3):
        runtime.paged_attention(case.spec, *args())
    t["seq_lens"].copy_(t["seq_lens"].flip(0))  # new values, same tensor: the plan still holds
    runtime.paged_attention(case.spec, *args())
    assert len(made) == 1
    kernel, module = kernels[case.spec.canonical_text]
    same = [{**x, "fields": {k: v for k, v in x["fields"].items() if k != "o"}} for x in module.launches]
    assert len(same) == 8 and all(x == same[i % 2] for i, x in enumerate(same))  # out aside (new per call)
    t["seq_lens"] = t["seq_lens"].clone()  # another tensor: a new plan
    runtime.paged_attention(case.spec, *args())
    assert len(made) == 2
    runtime.paged_attention(case.spec, *args(), max_query_len=7)  # another hint
    assert len(made) == 3
    bad = t["block_table"].clone()
    bad[0, 0] = 10 ** 6
    t["block_table"] = bad
    runtime.paged_attention(case.spec, *args())
    with pytest.raises(ValueError, match=r"block_table\[0\]: page ids must be in"):
        runtime.paged_attention(case.spec, *args(), validate=True)  # values read again, never a reused plan
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    n = len(made)
    runtime.paged_attention(case.spec, *args())
    runtime.paged_attention(case.spec, *args())
    assert len(made) == n + 2  # under capture: planned per call, as before


def test_a_one_call_plan_is_not_reused_for_metadata_changed_in_place(kernels, monkeypatch):
    """The very tensor objects of the last call, given other memory (``set_``) or another shape
    (``resize_``) in place: a new plan, whose launch carries the new address and row stride, never the
    stale plan (the memo compares addresses, shapes and strides, not the objects)."""
    from jitattn import planning

    case = lc.cases()["split_kv_decode"]
    t = case.tensors
    made = []
    real = planning.make_paged_plan
    monkeypatch.setattr(runtime, "make_paged_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    def call():
        runtime.paged_attention(case.spec, t["q"], t["kv_cache"], t["block_table"], t["seq_lens"],
                                t["query_start_loc"], max_query_len=1)

    call()
    call()
    assert len(made) == 1
    _, module = kernels[case.spec.canonical_text]
    seq_lens, table = t["seq_lens"], t["block_table"]
    seq_lens.set_(seq_lens.clone())  # the same object, its values in new memory
    call()
    assert len(made) == 2 and module.launches[-1]["fields"]["seq_lens"] == seq_lens.data_ptr()
    wider = torch.zeros(table.shape[0], table.shape[1] + 3, dtype=table.dtype)
    wider[:, :table.shape[1]] = table
    table.resize_(wider.shape).copy_(wider)  # the same object, one more column of pages
    call()
    assert len(made) == 3
    assert module.launches[-1]["fields"]["block_table_stride"] == table.shape[1]
    assert module.launches[-1]["fields"]["block_table"] == table.data_ptr()


def test_one_call_inputs_without_a_dim_0_are_named_not_an_index_error(kernels):
    """The one-call's plan memo reads q's and the cache's dim 0 for its key: a 0-d q, an empty pair or a 0-d
    k give way to the checks, which name the argument (an IndexError escaped before), and nothing launches."""
    case = lc.cases()["mixed_out_hint"]
    t = case.tensors
    meta = (t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=r"^q: "):
        runtime.paged_attention(case.spec, torch.tensor(1.0, dtype=torch.bfloat16), t["kv_cache"], *meta)
    with pytest.raises(ValueError, match=r"^kv_cache: "):
        runtime.paged_attention(case.spec, t["q"], (), *meta)
    ragged = lc.cases()["ragged"]
    r = ragged.tensors
    with pytest.raises(ValueError, match=r"^k: "):
        runtime.ragged_attention(ragged.spec, r["q"], r["k"][0, 0, 0], r["v"], r["query_start_loc"],
                                 r["kv_start_loc"])
    assert all(not module.launches for _, module in kernels.values())


def test_a_reused_one_call_plan_checks_the_layer_tensors(kernels):
    """A reused plan still checks q / kv_cache / out of each call."""
    case = lc.cases()["mixed_out_hint"]
    t = case.tensors
    runtime.paged_attention(case.spec, t["q"], t["kv_cache"], t["block_table"], t["seq_lens"], t["query_start_loc"])
    with pytest.raises(ValueError, match=r"q: expected dtype torch.bfloat16, got torch.float16"):
        runtime.paged_attention(case.spec, t["q"].half(), t["kv_cache"], t["block_table"], t["seq_lens"],
                                t["query_start_loc"])
    with pytest.raises(ValueError, match=r"out: expected a contiguous \(7, 8, 64\)"):
        runtime.paged_attention(case.spec, t["q"], t["kv_cache"], t["block_table"], t["seq_lens"],
                                t["query_start_loc"], out=torch.empty(7, 8, 32, dtype=torch.bfloat16))


def test_ragged_one_calls_on_the_same_metadata_plan_once(kernels, monkeypatch):
    case = lc.cases()["ragged"]
    t = case.tensors
    made = []
    real = runtime.make_ragged_plan
    monkeypatch.setattr(runtime, "make_ragged_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    for k in (t["k"], t["k"].clone()):  # another k: a per-layer tensor, the same plan
        runtime.ragged_attention(case.spec, t["q"], k, t["v"], t["query_start_loc"], t["kv_start_loc"])
    runtime.ragged_attention(case.spec, t["q"], t["k"], t["v"], t["query_start_loc"], t["kv_start_loc"].clone())
    assert len(made) == 2
    _, module = kernels[case.spec.canonical_text]
    assert [x["fields"]["k"] for x in module.launches[:2]] == [t["k"].data_ptr(), module.launches[1]["fields"]["k"]]
    assert module.launches[0]["fields"]["k"] != module.launches[1]["fields"]["k"]


def _kernel_tiles(qsl: list[int], total_q: int, group: int, block_m: int, skip: bool) -> int:
    """templates/prefill.cuh's prefill_find_tile, counted: the m-tiles it numbers for these start locations."""
    tiles = 0
    for q0, q1 in zip(qsl, qsl[1:]):
        if 0 <= q0 <= q1 <= total_q and not (skip and q1 - q0 == 1):
            tiles += -(-(q1 - q0) * group // block_m)
    return tiles


def test_an_eager_prefill_grid_covers_every_tile_the_kernel_numbers(kernels):
    """Over random start locations, invalid ones too (decreasing, past total_q, empty and one-query sequences),
    the exact grid of an eager plan is never smaller than the tiles prefill_find_tile numbers: a block short
    would leave a sequence's rows unwritten."""
    spec = lc.cases()["split_kv_mixed"].spec
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        batch = int(torch.randint(1, 9, (1,), generator=g))
        t = lc._paged(spec, [1] * batch, [600] * batch)
        total_q = 300
        t["q"] = torch.zeros(total_q, spec.num_qo_heads, spec.head_dim_qk, dtype=t["q"].dtype)
        qsl = torch.randint(-5, total_q + 40, (batch + 1,), generator=g, dtype=torch.int32)
        if trial % 2:  # half of them valid: sorted, from 0
            qsl = qsl.clamp(0, total_q).sort().values
            qsl[0] = 0
        qsl[-1] = min(int(qsl[-1]), total_q)  # the plan refuses an end past q's rows
        t["query_start_loc"] = qsl
        plan = runtime.plan(spec, t["block_table"], t["seq_lens"], qsl, total_q=total_q, max_query_len=None)
        part = plan.for_spec(None)
        need = _kernel_tiles(qsl.tolist(), total_q, spec.group_size, lc.GEOMETRY["prefill_block_m"], skip=True)
        if part.prefill is not None:
            assert part.prefill[0][0] >= need, (qsl.tolist(), part.prefill[0], need)
        else:
            assert need == 0, qsl.tolist()


def test_a_captured_run_of_an_eager_plan_takes_the_bound_grid(monkeypatch, kernels):
    """A graph captured from a run may replay with other lengths of the same shapes: under capture the prefill
    is launched on the bound any lengths fit, as a graph-mode plan's; eager, on the exact count."""
    from jitattn import planning

    case = lc.cases()["split_kv_mixed"]
    t = case.tensors
    plan = runtime.plan(case.spec, t["block_table"], t["seq_lens"], t["query_start_loc"])
    kernel, module = kernels[case.spec.canonical_text]
    runtime.run(t["q"], t["kv_cache"], plan)
    monkeypatch.setattr(planning, "capturing", lambda: True)
    runtime.run(t["q"], t["kv_cache"], plan)
    grids = [x["grid"] for x in module.launches if x["kernel"] == "prefill"]
    assert grids == [[1, 8, 1], [4, 8, 1]]

"""The per-layer fast path of ``jitattn.run`` (``SpecPlan._fast_values``) against the full checks, on the CPU.

The fast path reads q, the cache, out and sinks once and compares them with what the plan recorded; on
any difference it gives way to the full checks (``SpecPlan.check``), which name the argument. So:
every input it accepts, the full checks accept too, and the launch it makes carries the very bytes
the full path packs; every input the full checks refuse, ``run`` refuses with their message, before
any launch. The inputs are a plan's fitting tensors changed one way at a time (dtype, shape, strides,
alignment, device, page count, a tensor subclass, overlapping out, sinks), fitting and not.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import runtime
from jitattn.spec import AttentionSpec
from jitattn.testing import random_paged_batch
from tests import launch_cases as lc


class _Recorder:
    def __init__(self):
        self.launches: list[tuple[str, bytes]] = []

    def launch(self, name, grid, block, smem, params, stream):
        assert isinstance(params, bytes)
        self.launches.append((name, params))


def _plan(spec, q_lens, kv_lens, **plan_kwargs):
    module = _Recorder()
    kernel = runtime.JitKernel.from_module(spec, module, lc.GEOMETRY, device=torch.device("cpu"), num_sms=lc.NUM_SMS,
                                           decode_blocks_per_sm=lc.DECODE_BLOCKS_PER_SM,
                                           stream_handle=lambda: lc.STREAM)
    kernel.mixed_on_two_streams = False
    b = random_paged_batch(spec, q_lens, kv_lens, device="cpu")
    plan = kernel.plan(b.block_table, b.seq_lens, b.query_start_loc, **plan_kwargs)
    return plan.for_spec(None), b, module


class _Sub(torch.Tensor):
    pass


def _strided_rows(t: torch.Tensor, row: int) -> torch.Tensor:
    """``t``'s values in rows ``row`` elements apart (a wider buffer), the inner dims contiguous."""
    base = torch.zeros(t.shape[0] * row + 64, dtype=torch.float16).to(t.dtype)
    view = base.as_strided(t.shape, (row, *t.stride()[1:]))
    view.copy_(t)
    return view


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` one element past a 16-byte boundary."""
    base = torch.zeros(t.numel() + 1, dtype=t.dtype)
    return base[1:].view(t.shape)


def _variants(spec, b, part):
    """(name, q, kv, out, sinks): the batch's fitting tensors, then each changed one way."""
    q, kv, sinks = b.q, b.kv_cache, b.sinks
    out = torch.empty(part._out_shape, dtype=part._dtypes[2])
    wide = torch.empty(q.shape[0], spec.num_qo_heads * spec.head_dim_qk + 64, dtype=q.dtype)
    yield "fits", q, kv, out, sinks
    yield "no out", q, kv, None, sinks
    yield "q rows strided (fused QKV)", _strided_rows(q, spec.num_qo_heads * spec.head_dim_qk + 64), kv, out, sinks
    yield "q rows strided, not 16-byte", _strided_rows(q, spec.num_qo_heads * spec.head_dim_qk + 4), kv, out, sinks
    yield "q misaligned", _misaligned(q), kv, out, sinks
    yield "q heads strided", q.transpose(0, 1).contiguous().transpose(0, 1), kv, out, sinks
    yield "q dtype", q.half() if q.dtype == torch.bfloat16 else q.bfloat16(), kv, out, sinks
    yield "q float32", q.float(), kv, out, sinks
    yield "q one row more", torch.cat([q, q[:1]]), kv, out, sinks
    yield "q 2 dims", q.flatten(1), kv, out, sinks
    yield "q on meta", q.to("meta"), kv, out, sinks
    yield "q subclass", q.as_subclass(_Sub), kv, out, sinks
    yield "q not a tensor", q.tolist(), kv, out, sinks
    yield "kv pages strided", q, kv.repeat(2, 1, 1, 1, 1)[::2], out, sinks
    yield "kv pages 1 element apart more", q, _strided_rows(kv, kv[0].numel() + 1), out, sinks
    yield "kv page count + 1", q, torch.cat([kv, kv[:1]]), out, sinks
    yield "kv dtype", q, kv.float(), out, sinks
    yield "kv inner strides", q, kv.transpose(2, 3).contiguous().transpose(2, 3), out, sinks
    yield "kv misaligned", q, _misaligned(kv), out, sinks
    yield "kv on meta", q, kv.to("meta"), out, sinks
    yield "kv subclass", q, kv.as_subclass(_Sub), out, sinks
    yield "kv pair", q, (kv[:, 0], kv[:, 1]), out, sinks
    yield "out dtype", q, kv, out.float(), sinks
    yield "out shape", q, kv, out[:, :-1], sinks
    yield "out not contiguous", q, kv, out.transpose(1, 2).contiguous().transpose(1, 2), sinks
    yield "out misaligned", q, kv, _misaligned(out), sinks
    yield "out on meta", q, kv, out.to("meta"), sinks
    yield "out is q", q, kv, q if q.shape == out.shape and q.dtype == out.dtype else out, sinks
    yield "out inside q's buffer", wide[:, :spec.num_qo_heads * spec.head_dim_qk].view(q.shape), kv, \
        wide[:, 64:].reshape(-1)[:out.numel()].view(out.shape) if wide.dtype == out.dtype else out, sinks
    yield "out inside the cache", q, kv, kv.view(-1)[:out.numel()].view(out.shape) if kv.dtype == out.dtype else out, \
        sinks
    yield "sinks given, spec has none" if not spec.sinks else "sinks missing", q, kv, out, \
        None if spec.sinks else torch.zeros(spec.num_qo_heads)
    if spec.sinks:
        yield "sinks float16", q, kv, out, sinks.half()
        yield "sinks short", q, kv, out, sinks[:-1]
        yield "sinks strided", q, kv, out, torch.stack([sinks, sinks], 1)[:, 0]
        yield "sinks on meta", q, kv, out, sinks.to("meta")


SPECS = {
    "plain": (AttentionSpec(32, 8, 128, page_size=16), [1, 1, 1], [40, 17, 100]),
    "sinks, soft-cap, window": (AttentionSpec(16, 8, 64, page_size=16, sinks=True, logits_soft_cap=30.0,
                                              window_left=31), [1, 5], [40, 9]),
    "alibi, HND": (AttentionSpec(8, 2, 64, page_size=16, alibi=True, kv_layout="HND"), [3, 1], [20, 70]),
    "fp8 cache": (AttentionSpec(8, 2, 128, page_size=16, kv_dtype="float8_e4m3fn"), [1, 1], [30, 31]),
}


def _full_path(part, q, kv, out, sinks, k_scale=1.0, v_scale=1.0):
    """What run did before the fast path: the full checks, then the bytes pack writes (None: refused)."""
    try:
        scales = part.check(q, kv, out, False, sinks, None, {}, k_scale, v_scale)
    except ValueError as exc:
        return None, str(exc)
    given = out if out is not None else torch.empty(part._out_shape, dtype=part._dtypes[2])
    return part.pack(q, kv, given, None, sinks, None, {}, scales), given


@pytest.mark.parametrize("which", sorted(SPECS))
@pytest.mark.parametrize("num_pages", [False, True])
def test_fast_path_accepts_only_what_the_full_checks_accept(which, num_pages):
    spec, q_lens, kv_lens = SPECS[which]
    part, b, module = _plan(spec, q_lens, kv_lens)
    if num_pages:
        part, b, module = _plan(spec, q_lens, kv_lens, num_pages=b.kv_cache.shape[0])
    scales = b.scales or {}
    seen = set()
    for name, q, kv, out, sinks in _variants(spec, b, part):
        fast = part._fast_values(q, kv, out, sinks)
        want, detail = _full_path(part, q, kv, out, sinks, **scales)
        module.launches.clear()
        if want is None:
            assert fast is None, f"{which} / {name}: the fast path accepts what the full checks refuse ({detail})"
            with pytest.raises(ValueError) as info:
                runtime.run(q, kv, part.plan, out=out, sinks=sinks, **scales)
            assert str(info.value) == detail and not module.launches, f"{which} / {name}"
            seen.add("refused")
            continue
        got = runtime.run(q, kv, part.plan, out=out, sinks=sinks, **scales)
        if out is not None:
            assert got is out
        # the fast path's bytes, with its own out where none was given: the full path's for that out
        want, _ = _full_path(part, q, kv, got, sinks, **scales)
        assert [p for _, p in module.launches] == [want] * len(module.launches) and module.launches, \
            f"{which} / {name}: other Params than the full path's"
        seen.add("fast" if fast is not None else "full")
    assert seen == {"refused", "fast", "full"}  # each branch taken (the subclass takes the full one)


def test_fast_path_scales_are_checked_as_before():
    """An FP8 cache's scales go through check_scales on the fast path too: written as floats, refused
    with its message (a bool, a negative, a tensor)."""
    spec, q_lens, kv_lens = SPECS["fp8 cache"]
    part, b, module = _plan(spec, q_lens, kv_lens)
    runtime.run(b.q, b.kv_cache, part.plan, k_scale=0.5, v_scale=2.0)
    fields = dict(zip(part.layout.field_order, part.layout.packer.unpack(module.launches[-1][1])))
    assert (fields["k_scale"], fields["v_scale"]) == (0.5, 2.0)
    for bad in (True, -1.0, torch.tensor(0.5), float("nan")):
        try:
            part.check(b.q, b.kv_cache, None, False, None, None, {}, bad, 1.0)
        except ValueError as exc:
            message = str(exc)
        else:
            pytest.fail(f"k_scale={bad!r}: the full checks accept it")
        with pytest.raises(ValueError) as info:
            runtime.run(b.q, b.kv_cache, part.plan, k_scale=bad)
        assert str(info.value) == message


def test_a_plan_refuses_tensors_of_another_batch():
    """A plan made for one step, run with the next step's q (one more row) or a cache of another page
    count (the plan was given num_pages), is refused by name, never launched."""
    spec, q_lens, kv_lens = SPECS["plain"]
    part, b, module = _plan(spec, q_lens, kv_lens, num_pages=None)
    nxt = random_paged_batch(spec, q_lens + [1], kv_lens + [5], device="cpu")
    with pytest.raises(ValueError, match=r"q: expected shape \(3, 32, 128\)"):
        runtime.run(nxt.q, b.kv_cache, part.plan)
    part, b, module = _plan(spec, q_lens, kv_lens, num_pages=b.kv_cache.shape[0])
    with pytest.raises(ValueError, match=r"kv_cache: \d+ pages, but the plan was made for num_pages="):
        runtime.run(b.q, torch.cat([b.kv_cache, b.kv_cache]), part.plan)
    assert not module.launches


@pytest.mark.parametrize("which", sorted(SPECS))
@pytest.mark.parametrize("num_pages", [False, True])
def test_fast_path_memo_takes_nothing_over_from_the_last_accepted_layer(which, num_pages):
    """_fast_values keeps the strides of the last q and the shape and strides of the last cache it accepted
    (``_q_seen``, ``_kv_seen``): each variant, run right after each accepted one (the memo then holding that
    one's), is refused exactly where the full checks refuse it and otherwise gives the full path's bytes."""
    spec, q_lens, kv_lens = SPECS[which]
    part, b, _ = _plan(spec, q_lens, kv_lens)
    if num_pages:
        part, b, _ = _plan(spec, q_lens, kv_lens, num_pages=b.kv_cache.shape[0])
    variants = list(_variants(spec, b, part))
    accepted = [v for v in variants if part._fast_values(*v[1:]) is not None]
    assert len({(tuple(v[2].shape), v[2].stride()) for v in accepted}) > 1  # the memo sees more than one cache
    for before in accepted:
        for name, q, kv, out, sinks in variants:
            assert part._fast_values(*before[1:]) is not None
            fast = part._fast_values(q, kv, out, sinks)
            want, detail = _full_path(part, q, kv, out, sinks)
            if want is None:
                assert fast is None, f"{which} / after {before[0]} / {name}: accepted what the full checks refuse"
            elif fast is not None:
                packed = part._packer.pack(*part._assemble(part._plan_values + fast))
                assert packed == _full_path(part, q, kv, fast[-1], sinks)[0], f"{which} / after {before[0]} / {name}"


@pytest.mark.parametrize("which", sorted(SPECS))
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_run_packs_what_the_whole_struct_packs(which, kind):
    """A run packs the plan's bytes between its layer fields and its own values in one ``struct.pack``
    (``StructLayout.assembler``): the bytes the struct's whole packer gives for the same field values."""
    from jitattn.planning import PAGED_LAYER_FIELDS, RAGGED_LAYER_FIELDS, ParamsLayout

    spec = SPECS[which][0]
    layout = ParamsLayout(spec)
    names = (PAGED_LAYER_FIELDS if kind == "paged" else RAGGED_LAYER_FIELDS) + layout.param_fields
    codes = dict(zip(layout.field_order, layout.packer.format[1:].replace("x", "")))
    fields = {n: (0.25 * (i + 1) if codes[n] == "f" else 0x100000001 * (i + 3) if codes[n] in "Qq" else 7 * i + 1)
              for i, n in enumerate(layout.field_order)}
    run = layout.assembler(names)
    plan_bytes = run.pieces(layout.values({n: v for n, v in fields.items() if n not in names}))
    packed = run.packer.pack(*run.assemble(plan_bytes + tuple(fields[n] for n in names) + ("past the fields",)))
    assert packed == bytes(layout.pack(fields))

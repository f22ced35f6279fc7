"""The host case: microseconds per eager call of each way to call attention, on inputs too small to time the GPU.

Issue #18's probe: :data:`~jitattn.bench.cases.HOST_CALLS` back-to-back eager calls, synchronised
only at the end (:func:`jitattn.bench.harness.host_us_per_call`), of

- ``jitattn``: ``jitattn.paged_attention(spec, ...)``, the one-call convenience;
- ``jitattn-one-stream``: the one-call with both kernels on the caller's stream, one after the other
  (``JitKernel.mixed_on_two_streams`` off for the call): what the side-stream fork and join cost the
  host against what their overlap gains on the GPU (on the decode probe the one-call keeps one stream
  itself, as any with no more query rows than sequences, so the two rows should agree there);
- ``jitattn-kernel``: ``load_kernel(spec).paged_attention(..., out=..., max_query_len=...)``;
- ``jitattn-plan``: ``jitattn.run`` with a plan made once (:func:`plan_run_call`), when this jitattn has
  ``jitattn.plan``;
- ``sdpa-cudnn`` / ``sdpa-flash``: torch SDPA on the dense equivalent (equal lengths only);
- ``flashinfer``: FlashInfer's wrapper ``run``, planned once, when ``import flashinfer`` works;
- ``torch.add``: two 1-element tensors, the floor of any eager torch call;

all in one process on the same inputs. Attention rows are checked once against the reference.

The append case (phase ``"append"``, :func:`run_append_case`, issue 19's target) times

- ``jitattn``: ``jitattn.append_kv(k, v, kv_cache, slot_mapping)`` of a decode step (one token per sequence);
- ``torch.index_copy_``: the same K and V rows (stacked, their row indices made once) copied into the
  cache seen flat, ``(num_pages * 2 * page_size, H_kv, head_dim)``: the one eager torch call moving those bytes;

each checked once (the written rows against K and V); the jitattn row's note has the target,
append_kv <= :data:`APPEND_TARGET` x index_copy_.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from jitattn.bench.anchors import flashinfer_runner, sdpa_runners, to_contiguous
from jitattn.bench.cases import HOST_CALLS, BenchCase
from jitattn.bench.harness import Runner, build_runners, check_error, host_us_per_call, with_notes
from jitattn.bench.report import HOST_UNIT, Result, one_line
from jitattn.reference import torch_dtype
from jitattn.spec import AttentionSpec
from jitattn.testing import PagedBatch, random_paged_batch

#: The anchor families a host case runs (Flex's eager call is not what an engine would time).
HOST_ANCHORS = ("sdpa", "flashinfer")
#: Issue 19's target: append_kv of a decode step costs at most this many times an index_copy_ of its bytes.
APPEND_TARGET = 2.0


def plan_run_call(spec: AttentionSpec, batch: PagedBatch, out: torch.Tensor, max_query_len: int
                  ) -> Callable[[], torch.Tensor]:
    """``jitattn.run(q, kv_cache, plan, out=out, **batch.kwargs())`` with ``plan = jitattn.plan(...)`` made
    once, here (the batch's sinks, ALiBi slopes, params and an FP8 cache's k_scale / v_scale).

    The plan/run API's call as the bench uses it, in one place (its names may still change).

    Raises:
        ValueError: ``jitattn.plan`` refuses the spec (one the jit backend does not serve) or the batch.
    """
    import jitattn

    plan = jitattn.plan(spec, batch.block_table, batch.seq_lens, batch.query_start_loc, max_query_len=max_query_len)
    return lambda: jitattn.run(batch.q, batch.kv_cache, plan, out=out, **batch.kwargs())


def jitattn_host_runners(case: BenchCase, batch: PagedBatch) -> dict[str, Runner]:
    """The one-call convenience (with the side-stream fork, and without it), and the kernel's call with
    ``out`` and the ``max_query_len`` hint."""
    import jitattn
    from jitattn.runtime import load_kernel

    spec = case.spec
    kernel = load_kernel(spec, batch.q.device)  # the one-call's own: it loads by q's device
    max_q = max(case.q_lens)
    out = torch.empty(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                      device=batch.q.device)
    return {
        "jitattn": Runner(lambda: jitattn.paged_attention(spec, *batch.args(), **batch.kwargs()),
                          note="jitattn.paged_attention(spec, ...)"),
        "jitattn-one-stream": Runner(lambda: _one_stream(kernel, lambda: jitattn.paged_attention(
                                         spec, *batch.args(), **batch.kwargs())),
                                     note="jitattn.paged_attention(spec, ...), both kernels on the caller's stream"),
        "jitattn-kernel": Runner(lambda: kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out,
                                                                max_query_len=max_q),
                                 note=f"load_kernel(spec).paged_attention(..., out=, max_query_len={max_q})"),
    }


def _one_stream(kernel, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()`` with ``kernel``'s mixed launches on the caller's stream alone (restored after)."""
    kept, kernel.mixed_on_two_streams = kernel.mixed_on_two_streams, False
    try:
        return call()
    finally:
        kernel.mixed_on_two_streams = kept


def plan_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """:func:`plan_run_call` on the batch, writing into its own ``out``."""
    spec = case.spec
    out = torch.empty(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                      device=batch.q.device)
    return Runner(plan_run_call(spec, batch, out, max(case.q_lens)), note="jitattn.run(q, kv_cache, plan, out=)")


def torch_add_runner(device: torch.device) -> Runner:
    """``torch.add`` of two 1-element tensors: what any eager torch call costs on the host."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return Runner(lambda: torch.add(a, b), note="two 1-element tensors")


def time_host(case: BenchCase, impl: str, runner: Runner, ref: torch.Tensor | None) -> Result:
    """Check ``runner`` once against ``ref`` (None: not checked), then its us per call. Never raises."""
    try:
        err = check_error(runner.rows(runner.call()), ref)
        us = host_us_per_call(runner.call, calls=HOST_CALLS)
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return Result.not_run(case.name, impl, HOST_UNIT, "failed", one_line(exc))
    result = Result(case.name, impl, us / 1e3, math.nan, us, HOST_UNIT, err, f"{HOST_CALLS} calls, one sync")
    return with_notes(result, runner, err)


def run_host_case(case: BenchCase, *, seed: int = 0, check: bool = True, anchors: tuple[str, ...] = HOST_ANCHORS
                  ) -> list[Result]:
    """Every call form of the module doc on one random batch of ``case``, in that order (an append case's:
    :func:`run_append_case`)."""
    import jitattn
    from jitattn import reference

    if case.phase == "append":
        return run_append_case(case, seed=seed, check=check)

    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    ref = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs()) if check else None
    dense = to_contiguous(batch) if "sdpa" in anchors else None
    builders = {"jitattn": lambda: jitattn_host_runners(case, batch), "jitattn-plan": lambda: plan_runner(case, batch),
                "sdpa": lambda: dict(sorted(sdpa_runners(case, dense).items())),  # cudnn, then flash
                "flashinfer": lambda: flashinfer_runner(case, batch)}
    results: list[Result] = []
    plan = ("jitattn-plan",) if hasattr(jitattn, "plan") else ()
    for family in ("jitattn", *plan, *(a for a in HOST_ANCHORS if a in anchors)):
        runners, rows = build_runners(case, family, builders[family], HOST_UNIT)
        results += rows + [time_host(case, impl, runner, ref) for impl, runner in runners.items()]
    results.append(time_host(case, "torch.add", torch_add_runner(batch.q.device), None))
    return results


def append_runners(case: BenchCase, batch: PagedBatch, seed: int = 0
                   ) -> tuple[dict[str, Runner], torch.Tensor, Callable[[], None]]:
    """The append case's two calls on ``batch``'s cache, the rows they write (K's then V's, the reference)
    and a call that zeroes those rows in the cache (so that each call's check sees its own writes).

    One new token per sequence, written at its last key's slot (page ``block_table[b, (L - 1) // page]``).
    """
    from jitattn.kv_write import append_kv

    spec, cache = case.spec, batch.kv_cache
    heads, dim, page = spec.num_kv_heads, spec.head_dim_qk, spec.page_size
    g = torch.Generator(device=cache.device).manual_seed(seed + 1)
    k, v = (torch.randn(len(case.q_lens), heads, dim, generator=g, device=cache.device).to(cache.dtype)
            for _ in range(2))
    last = batch.seq_lens.long() - 1
    slots = batch.block_table.long().gather(1, (last // page).unsqueeze(1)).squeeze(1) * page + last % page
    rows = (slots // page) * 2 * page + slots % page  # K's row of the flat view; V's is a page further
    flat, index, src = cache.view(-1, heads, dim), torch.cat([rows, rows + page]), torch.cat([k, v])
    written = lambda _: flat[index]  # noqa: E731
    runners = {
        "jitattn": Runner(lambda: append_kv(k, v, cache, slots), rows=written,
                          note="jitattn.append_kv(k, v, kv_cache, slot_mapping)"),
        "torch.index_copy_": Runner(lambda: flat.index_copy_(0, index, src), rows=written,
                                    note=f"{index.numel()} rows (K, V stacked) into the cache seen flat"),
    }
    return runners, src, lambda: flat.index_fill_(0, index, 0)


def run_append_case(case: BenchCase, *, seed: int = 0, check: bool = True, device: str = "cuda") -> list[Result]:
    """Both rows of the append case (module doc), then the target in the jitattn row's note."""
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device=device, seed=seed)
    runners, ref, clear = append_runners(case, batch, seed)
    results = []
    for impl, runner in runners.items():
        clear()
        results.append(time_host(case, impl, runner, ref if check else None))
    rows = {r.impl: r for r in results if r.status == "ok"}
    mine, anchor = rows.get("jitattn"), rows.get("torch.index_copy_")
    if mine is not None and anchor is not None:
        ratio = mine.rate / anchor.rate
        verdict = "met" if ratio <= APPEND_TARGET else "not met"
        mine.note = f"{ratio:.2f}x torch.index_copy_ (target <= {APPEND_TARGET:g}x: {verdict}); {mine.note}"
    return results

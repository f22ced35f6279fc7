"""Plan once per step, run per layer: the launch machinery under :func:`jitattn.plan` / :func:`jitattn.run`.

A serving engine runs the same batch layout through every attention layer of a step. Everything that
depends only on that layout is done once, by a :class:`Plan`: the structural checks of the metadata,
the choice of kernels (decode, prefill, or both) and of the split-KV factor, the tile grid, the
scratch buffers, and the kernel's ``Params`` struct packed except the fields that change per layer.
A run (:meth:`SpecPlan.run`) then checks only the per-layer tensors (q, the cache, ``out``, sinks,
slopes, the variant's parameters: shape, dtype, device, strides), packs its pointers and strides with
the plan's bytes in one ``struct.pack`` (the field order made once per spec: :class:`ParamsLayout`),
and launches. The common layer (one cache tensor, no variant parameters, no lse) takes a fast path,
:meth:`SpecPlan._fast_values`: each tensor's attributes read once and compared with what the plan
recorded, the full checks (which name what differs) only when something does not match.

Three steps, each a small method: check (:meth:`SpecPlan.check`), pack (:meth:`SpecPlan.pack`),
launch (:meth:`SpecPlan.launch`).

The kernel a plan launches is any object with the attributes of :class:`jitattn.runtime.JitKernel`
that this module reads (``spec``, ``device``, ``geometry``, ``layout``, ``num_splits``,
``max_decode_keys``, ``split_counters``, ``stream_fork``, ``mixed_on_two_streams``,
``stream_handle``, ``launch``, ``default_slopes``): the runtime passes its loaded kernels, and the CPU
tests a kernel whose module records launches instead of running them.
"""

from __future__ import annotations

import functools
import math
import struct
from operator import itemgetter
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import torch

from jitattn.checks import (check_flag, check_kv_cache, check_kv_cache_layout, check_max_query_len,
                            check_metadata_layout, check_metadata_values, check_out, check_out_layout,
                            check_paged_metadata, check_params, check_position_values, check_positions,
                            check_q_layout, check_ragged_metadata_values, check_ragged_tensors, check_scales,
                            check_spec, check_tensor, check_vector, fail, is_kv_pair, kv_cache_shape,
                            kv_stride_kv)
from jitattn.dtypes import TORCH_DTYPES
from jitattn.render import params_fields, params_layout
from jitattn.spec import AttentionSpec, kv_copy_bytes

#: What a plan may assume: "eager" reads the metadata on the host once (exact kernels for this
#: step's values; the plan holds for these values only); "graph" decides from shapes and arguments
#: alone (no host read: any values of the same shapes, what a captured CUDA graph replays).
MODES = ("eager", "graph")

_STRUCT_CODE = {"ptr": "Q", "i64": "q", "i32": "i", "f32": "f"}
#: Query heads per tile of the MLA decode kernel (templates/mla_decode.cuh: the m16 of mma.sync), and the most
#: query tokens per sequence whose tiles get blocks of their own (a latent grid's row-tile slots; the kernel
#: loops over any more: speculative / MTP decode brings 1..8).
LATENT_TILE_ROWS, LATENT_MAX_QUERY_SLOTS = 16, 8

#: The ``Params`` fields a run writes (the per-layer tensors, their strides and sizes, the scales), in
#: the order :meth:`SpecPlan.pack` gives their values; the variant's parameters follow.
PAGED_LAYER_FIELDS = ("q", "kv_cache", "o", "lse", "sinks", "alibi_slopes", "q_stride_token", "kv_stride_page",
                      "num_pages", "k_scale", "v_scale")
RAGGED_LAYER_FIELDS = ("q", "k", "v", "o", "lse", "sinks", "alibi_slopes", "q_stride_token", "q_stride_head",
                       "k_stride_token", "k_stride_head", "v_stride_token", "v_stride_head", "total_kv")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``(first, end)``: the bytes from ``t``'s first element to just past its last (torch strides are
    never negative); ``(0, 0)`` for an empty tensor."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _refuse_overlaps(start: int, end: int, spans: Mapping[str, tuple[int, int]]) -> None:
    """Raise if out's bytes ``[start, end)`` meet any named ``(first, end)`` span of a tensor the kernels read."""
    for name, (a, b) in spans.items():
        if a < end and start < b:
            fail(f"out: overlaps {name} in memory (out's bytes {start:#x}-{end:#x}, {name}'s {a:#x}-{b:#x}); "
                 f"the kernels read {name} while they write out, so the result would be wrong: pass an out of "
                 f"its own, e.g. torch.empty_like(out)")


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # asked once: a process does not gain or lose CUDA


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return _cuda_available() and torch.cuda.is_current_stream_capturing()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class StructLayout:
    """A by-value kernel argument struct's bytes (fields placed by :func:`jitattn.render.params_layout`):
    the whole-struct packer, and writers of chosen fields into packed bytes.

    ``assembler(names)`` lets a call that gives the values of ``names`` pack the whole struct at once
    with the other fields' bytes kept from before (what ``run`` does with a plan's);
    ``writers(names)`` turns a tuple of field names (in the order a call gives their values) into
    ``(pack_into, offset, pick)`` triples, one per run of fields adjacent in the struct, to patch
    packed bytes. Any struct of :class:`~jitattn.render.Field`
    members: a spec's ``Params`` (:class:`ParamsLayout`), the utility modules' (``AppendKvParams``).
    """

    def __init__(self, fields: Sequence[Any]):
        placed, size = params_layout(tuple(fields))
        fmt, pos = "<", 0
        for f, off in placed:
            fmt += "x" * (off - pos) + _STRUCT_CODE[f.kind]
            pos = off + f.size
        self.packer = struct.Struct(fmt + "x" * (size - pos))
        self.field_order = tuple(f.name for f, _ in placed)
        self.placed = {f.name: (f, off) for f, off in placed}
        kinds = {f.name: f.kind for f, _ in placed}
        self.pointer_fields = frozenset(n for n, k in kinds.items() if k == "ptr")
        self._writers: dict[tuple[str, ...], tuple] = {}
        self._assemblers: dict[tuple[str, ...], tuple] = {}
        self._index = {name: i for i, name in enumerate(self.field_order)}

    @property
    def size(self) -> int:
        return self.packer.size

    def values(self, fields: Mapping[str, Any]) -> list:
        """Every field's value in the struct's order: ``fields`` set, every other field 0."""
        values = [0] * len(self.field_order)
        index = self._index
        for name, value in fields.items():
            values[index[name]] = value
        return values

    def pack(self, fields: Mapping[str, Any]) -> bytearray:
        """The struct's bytes with ``fields`` set; every other field 0."""
        return bytearray(self.packer.pack(*self.values(fields)))

    def assembler(self, names: tuple[str, ...]) -> SimpleNamespace:
        """How a call that writes ``names`` packs the whole struct at once (made once per names tuple):
        ``pieces(every)`` packs every field's value (in :attr:`field_order`) and keeps the bytes between the
        ``names`` fields (the other fields and padding: a few ``bytes`` objects); ``assemble(pieces +
        call_values)`` orders those and the call's values (in ``names``' order; any past them ignored) for
        ``packer.pack``, which gives the struct's bytes."""
        found = self._assemblers.get(names)
        if found is None:
            where = {n: i for i, n in enumerate(names)}
            spans = sorted((self.placed[n][1], self.placed[n][0]) for n in names)
            fmt, gaps, order, pos = "<", [], [], 0
            for off, f in [*spans, (self.size, None)]:
                if off > pos:  # the bytes from the last call field's end to this one's start: the plan's
                    fmt += f"{off - pos}s"
                    order.append(len(gaps))
                    gaps.append((pos, off))
                if f is not None:
                    fmt += _STRUCT_CODE[f.kind]
                    order.append(~where[f.name])
                    pos = off + f.size
            idx = [i if i >= 0 else len(gaps) + ~i for i in order]
            packer, whole = struct.Struct(fmt), self.packer

            def pieces(every: Sequence[Any]) -> tuple[bytes, ...]:
                packed = whole.pack(*every)
                return tuple(packed[a:b] for a, b in gaps)

            found = self._assemblers[names] = SimpleNamespace(
                pieces=pieces, packer=packer,
                assemble=itemgetter(*idx) if len(idx) > 1 else (lambda v, i=idx[0]: (v[i],)))
        return found

    def writers(self, names: tuple[str, ...]) -> tuple[tuple[Callable[..., None], int, Callable[[tuple], tuple]], ...]:
        """Writers of ``names`` (values given in this order), adjacent fields merged into one struct
        (made once per names tuple)."""
        found = self._writers.get(names)
        if found is None:
            found = self._writers[names] = self._make_writers(names)
        return found

    def _make_writers(self, names: tuple[str, ...]) -> tuple:
        spans = sorted((self.placed[n][1], self.placed[n][0], i) for i, n in enumerate(names))
        out, group = [], []
        for off, f, i in spans:
            if group and off != group[-1][0] + group[-1][1].size:
                out.append(group)
                group = []
            group.append((off, f, i))
        if group:
            out.append(group)
        writers = []
        for g in out:
            fmt = "<" + "".join(_STRUCT_CODE[f.kind] for _, f, _ in g)
            idx = [i for _, _, i in g]
            pick = itemgetter(*idx) if len(idx) > 1 else (lambda v, i=idx[0]: (v[i],))
            writers.append((struct.Struct(fmt).pack_into, g[0][0], pick))
        return tuple(writers)


class ParamsLayout(StructLayout):
    """A spec's ``Params`` bytes (:class:`StructLayout` of :func:`jitattn.render.params_fields`), and
    what every run of the spec checks against and writes (:meth:`constants`).

    Made once per loaded kernel.
    """

    def __init__(self, spec: AttentionSpec):
        super().__init__(params_fields(spec))
        self.spec = spec
        self.param_fields = tuple(n for p in spec.params for n in ((p.name,) if p.is_scalar else
                                                                     (p.name, f"{p.name}__numel")))
        self._constants: dict[str, SimpleNamespace] = {}

    def constants(self, kind: str) -> SimpleNamespace:
        """What every run of the spec on a ``kind`` ("paged" / "ragged") plan checks against and writes,
        made once: the writers of the per-layer fields, the cache's inner shape and strides, the dtypes."""
        found = self._constants.get(kind)
        if found is None:
            spec = self.spec
            inner = kv_cache_shape(spec, 1)[1:] if kind == "paged" else ()
            names = PAGED_LAYER_FIELDS if kind == "paged" else RAGGED_LAYER_FIELDS
            layer = names + self.param_fields
            found = self._constants[kind] = SimpleNamespace(
                run=self.assembler(layer), kv_inner=inner or None,  # a run: its layer values and the plan's bytes
                kv_strides=tuple(math.prod(inner[i + 1:]) for i in range(len(inner))),  # a page is contiguous
                kv_stride_kv=math.prod(inner[1:]) if inner else 0,
                kv_align=kv_copy_bytes(spec.head_dim_qk, spec.kv_dtype) // TORCH_DTYPES[spec.kv_dtype].itemsize,
                dtypes=(TORCH_DTYPES[spec.q_dtype], TORCH_DTYPES[spec.kv_dtype], TORCH_DTYPES[spec.o_dtype]),
                softmax=spec.variant is None or spec.variant.softmax)
        return found


def params_packer(spec: AttentionSpec) -> tuple[struct.Struct, tuple[str, ...]]:
    """A ``struct.Struct`` that packs the ``Params`` fields (in their order) into the kernel's bytes."""
    layout = ParamsLayout(spec)
    return layout.packer, layout.field_order


def choose_mode(mode: Any) -> str:
    """``mode`` checked: "eager", "graph", or None (graph while the current stream captures, else eager).

    Raises:
        ValueError: anything else.
    """
    if mode is None:
        return "graph" if capturing() else "eager"
    if mode not in MODES:
        fail(f"mode={mode!r}: expected 'eager' (read the metadata once on the host), 'graph' (shapes only, "
             f"for CUDA graph capture) or None (graph while capturing, else eager)")
    return mode


def _validating(validate: Any) -> bool:
    """``validate`` checked (a bool), and refused under CUDA graph capture, which forbids its host reads.

    Raises:
        ValueError: not a bool; True while the current stream captures a graph.
    """
    if check_flag("validate", validate) and capturing():
        fail("validate=True: the metadata checks read the values on the host (a device sync), which "
             "CUDA graph capture does not allow; check the batch outside the capture and pass "
             "validate=False inside it")
    return bool(validate)


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fail(f"{name}={value!r}: expected None or an int >= 0")
    return value


class Plan:
    """One step's batch layout, planned once and run by every attention layer of the step.

    Made by :func:`jitattn.plan` (paged) or :func:`jitattn.plan_ragged`; run by :func:`jitattn.run`.
    Holds the metadata tensors (it reads them at run time on the device: keep them alive and, under
    a CUDA graph, update them in place), the sizes read from them, the kernels it launches and, per
    spec, a :class:`SpecPlan` (Params packed but for the per-layer fields, split scratch).

    Several specs that read the same batch layout (Gemma-2's sliding and full layers, gpt-oss) share
    one plan: pass them all to ``plan`` (each gets its SpecPlan at once), or run the plan with
    another ``spec=`` (planned on first use, an allocation then). They must agree on the storage
    (paged / ragged), the page size, the query positions (implicit / explicit) and the device.

    A plan's scratch (the split-KV partial states) is its own: runs of one plan must not overlap
    (run it on one stream at a time); keep it alive as long as a CUDA graph that replays its runs.
    """

    def __init__(self, kind: str, device: torch.device, mode: str, batch: int, total_q: int,
                 metadata: dict[str, torch.Tensor | None], *, max_pages_per_seq: int = 0,
                 num_pages: int | None = None, max_query_len: int | None = None,
                 decode_rows: bool | None = None, prefill_rows: bool | None = None, validate: bool = False,
                 load: Callable[[AttentionSpec], Any], shared_scratch: bool = False,
                 query_lens: list[int] | None = None):
        self.kind, self.device, self.mode = kind, device, mode
        self.batch, self.total_q, self.max_pages_per_seq, self.num_pages = batch, total_q, max_pages_per_seq, num_pages
        self.total_kv: int | None = None  # a ragged plan's rows of k and v, when given
        self.max_query_len = max_query_len
        self.decode_rows, self.prefill_rows = decode_rows, prefill_rows  # None: unknown (graph mode)
        self.query_lens = query_lens if mode == "eager" else None  # each sequence's queries, where read
        self.metadata, self.validate = metadata, validate
        self._load, self._shared_scratch = load, shared_scratch
        self._parts: dict[str, SpecPlan] = {}
        self._first: SpecPlan | None = None

    @property
    def specs(self) -> tuple[AttentionSpec, ...]:
        """The specs planned so far (the first is the one a run without ``spec=`` takes)."""
        return tuple(p.spec for p in self._parts.values())

    def add(self, spec: AttentionSpec) -> "SpecPlan":
        """Plan ``spec`` on this batch layout (once; later calls return the same :class:`SpecPlan`).

        Raises:
            ValueError: a spec that does not read this layout (storage, page size, query positions).
        """
        part = self._parts.get(spec.canonical_text)
        if part is None:
            self._check_spec(spec)
            part = SpecPlan(self, self._load(spec), shared_scratch=self._shared_scratch)
            self._parts[spec.canonical_text] = part
            if self._first is None:
                self._first = part
        return part

    def for_spec(self, spec: AttentionSpec | None) -> "SpecPlan":
        """The :class:`SpecPlan` of ``spec`` (None: the first planned), planned now if new."""
        first = self._first
        if spec is None or (first is not None and spec is first.spec):
            return first  # type: ignore[return-value]
        return self.add(check_spec(spec, "run(q, kv_cache, plan, spec=spec, ...)"))

    def _check_spec(self, spec: AttentionSpec) -> None:
        first = self._first.spec if self._first is not None else None
        if (self.kind == "ragged") != spec.ragged:
            fail(f"spec: kv_storage={spec.kv_storage!r}, but the plan is for a {self.kind} batch "
                 f"({'plan_ragged' if self.kind == 'ragged' else 'plan'} made it); plan this spec separately")
        explicit = self.metadata.get("query_positions") is not None
        if spec.explicit_positions != explicit:
            fail(f"spec: query_positions={spec.query_positions!r}, but the plan was made "
                 f"{'with' if explicit else 'without'} explicit query positions; plan this spec separately")
        if first is not None and not spec.ragged and spec.page_size != first.page_size:
            fail(f"spec: page_size={spec.page_size}, but the plan's block_table indexes pages of {first.page_size} "
                 f"tokens ({first.describe()}); plan this spec separately")

    def run(self, q: torch.Tensor, kv: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:func:`run` with this plan (``kwargs``: those of :meth:`SpecPlan.run` and ``spec``)."""
        return self.for_spec(kwargs.pop("spec", None)).run(q, kv, **kwargs)

    def __repr__(self) -> str:
        launched = (("decode", self.decode_rows), ("prefill", self.prefill_rows))
        kernels = "+".join(k for k, on in launched if on is not False)
        return (f"Plan({self.kind}, batch={self.batch}, total_q={self.total_q}, mode={self.mode!r}, "
                f"kernels={kernels}, specs={len(self._parts)})")


def make_paged_plan(load: Callable[[AttentionSpec], Any], specs: Sequence[AttentionSpec], device: torch.device,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                    total_q: int | None, max_query_len: int | None, num_pages: int | None,
                    query_positions: torch.Tensor | None, functor_batch: torch.Tensor | None,
                    position_offset: torch.Tensor | None, mode: str | None, validate: bool,
                    shared_scratch: bool = False) -> Plan:
    """The :class:`Plan` of a paged batch (the checks and decisions of :func:`jitattn.plan`, its docs):
    check the metadata, read it on the host if the mode allows and something needs it, check its values
    if asked, choose the kernels, plan each spec."""
    first, mode = specs[0], choose_mode(mode)
    batch, max_pages = check_paged_metadata(first, block_table, seq_lens, query_start_loc, device,
                                            device_of="the kernel")
    check_metadata_layout(block_table, seq_lens, query_start_loc)
    total_q, num_pages = _count("total_q", total_q), _count("num_pages", num_pages)
    max_query_len, validate = check_max_query_len(max_query_len), _validating(validate)
    qsl = _read_starts(query_start_loc, mode, total_q, max_query_len, validate)
    lens = None if qsl is None else [b - a for a, b in zip(qsl, qsl[1:])]
    if qsl is not None and total_q is not None and qsl[-1] > total_q:  # read anyway: the kernels would skip them
        fail(f"total_q={total_q}: query_start_loc ends at {qsl[-1]}, so its last queries have no row of q and "
             f"would be left unwritten; pass total_q=q.shape[0] with q holding every query")
    total_q = total_q if total_q is not None else qsl[-1]  # type: ignore[index]
    if total_q >= 2 ** 31:
        fail(f"total_q={total_q}: at most 2**31 - 1 query tokens (int32 start locations)")
    positions = {"query_positions": query_positions, "functor_batch": functor_batch,
                 "position_offset": position_offset}
    check_positions(first, *positions.values(), total_q=total_q, batch=batch, device=device)
    if validate:
        _check_values(first, block_table, seq_lens, query_start_loc, functor_batch, num_pages, total_q,
                      max_query_len, lens)
    decode_rows, prefill_rows = _kernels(mode, max_query_len, lens)
    if mode == "eager" and lens is not None and max_query_len is None:
        max_query_len = max(lens, default=0)
    metadata = {"block_table": block_table, "seq_lens": seq_lens, "query_start_loc": query_start_loc, **positions}
    plan = Plan("paged", device, mode, batch, total_q, metadata, max_pages_per_seq=max_pages, num_pages=num_pages,
                max_query_len=max_query_len, decode_rows=decode_rows, prefill_rows=prefill_rows, validate=validate,
                load=load, shared_scratch=shared_scratch, query_lens=lens)
    for spec in specs:
        plan.add(spec)
    return plan


def _read_starts(query_start_loc: torch.Tensor, mode: str, total_q: int | None, max_query_len: int | None,
                 validate: bool) -> list[int] | None:
    """``query_start_loc`` read on the host (the plan's one device sync) when the checks ask for values
    or an eager plan lacks ``total_q`` / ``max_query_len``; None when nothing is read.

    Raises:
        ValueError: graph mode without ``total_q``.
    """
    eager = mode == "eager"
    if total_q is None and not eager:
        fail("total_q: required in graph mode (the plan reads nothing on the host); pass q.shape[0]")
    if not (validate or (eager and (total_q is None or max_query_len is None))):
        return None
    return query_start_loc.tolist()


def _check_values(spec: AttentionSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, functor_batch: torch.Tensor | None, num_pages: int | None,
                  total_q: int, max_query_len: int | None, lens: list[int] | None) -> None:
    """``validate=True``: the metadata's values (every spec of a plan shares what these read).

    Raises:
        ValueError: naming the entry (:func:`jitattn.checks.check_metadata_values`), or ``num_pages``
            missing, or a broken ``max_query_len`` promise.
    """
    if num_pages is None:
        fail("num_pages: validate=True checks the page ids against the cache; pass num_pages=kv_cache.shape[0]")
    check_metadata_values(spec, seq_lens, query_start_loc, block_table, num_pages, total_q)
    if spec.explicit_positions:
        check_position_values(functor_batch, spec, None)  # against the params: at each run
    if max_query_len is not None and lens and max(lens) > max_query_len:
        fail(f"max_query_len={max_query_len}: a sequence brings {max(lens)} queries; "
             f"pass the longest query count (or None)")


def _kernels(mode: str, max_query_len: int | None, lens: list[int] | None) -> tuple[bool | None, bool | None]:
    """Whether the batch has decode rows (one query) and prefill rows (more): None where not known, and
    an unknown kind of row is launched for. Eager with the lengths read: exactly; else ``max_query_len=1``
    promises no prefill row."""
    if mode == "eager" and lens is not None:
        return any(n == 1 for n in lens), any(n > 1 for n in lens)
    return None, (False if max_query_len == 1 else None)


def make_ragged_plan(load: Callable[[AttentionSpec], Any], specs: Sequence[AttentionSpec], device: torch.device,
                     query_start_loc: torch.Tensor, kv_start_loc: torch.Tensor, *, total_q: int | None,
                     total_kv: int | None, mode: str | None, validate: bool) -> Plan:
    """The :class:`Plan` of a ragged batch (the checks and decisions of :func:`jitattn.plan_ragged`)."""
    mode = choose_mode(mode)
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device, device_of="the kernel")
    batch = query_start_loc.shape[0] - 1
    if batch < 1:
        fail(f"query_start_loc: expected shape (batch + 1,) with batch >= 1, got {tuple(query_start_loc.shape)}")
    check_tensor("kv_start_loc", kv_start_loc, dtype=torch.int32, ndim=1, device=device, device_of="the kernel")
    if kv_start_loc.shape[0] != batch + 1:
        fail(f"kv_start_loc: dim 0 (batch + 1, from query_start_loc) must be {batch + 1}, "
             f"got {kv_start_loc.shape[0]} (shape {tuple(kv_start_loc.shape)})")
    for name, t in (("query_start_loc", query_start_loc), ("kv_start_loc", kv_start_loc)):
        if not t.is_contiguous():
            fail(f"{name}: must be contiguous")
    total_q, total_kv = _count("total_q", total_q), _count("total_kv", total_kv)
    validate = _validating(validate)
    if total_q is None:
        if mode == "graph":
            fail("total_q: required in graph mode (the plan reads nothing on the host); pass q.shape[0]")
        total_q = int(query_start_loc[-1])
    if total_q >= 2 ** 31:
        fail(f"total_q={total_q}: at most 2**31 - 1 query tokens (int32 start locations)")
    if validate:
        if total_kv is None:
            fail("total_kv: validate=True checks kv_start_loc against the rows of k and v; pass total_kv=k.shape[0]")
        check_ragged_metadata_values(query_start_loc, kv_start_loc, total_q, total_kv)
    plan = Plan("ragged", device, mode, batch, total_q, {"query_start_loc": query_start_loc,
                                                         "kv_start_loc": kv_start_loc},
                decode_rows=False, prefill_rows=True, validate=validate, load=load)
    plan.total_kv = total_kv
    for spec in specs:
        plan.add(spec)
    return plan


class SpecPlan:
    """One spec's launches on a :class:`Plan`'s batch: the packed Params but for the per-layer fields,
    the grids, the split-KV scratch. Made by :meth:`Plan.add`; :meth:`run` is the per-layer call."""

    def __init__(self, plan: Plan, kernel: Any, *, shared_scratch: bool = False):
        spec = kernel.spec
        self.plan, self.kernel, self.spec = plan, kernel, spec
        self.layout: ParamsLayout = kernel.layout
        self._launch = kernel.launch
        self._stream = kernel.stream_handle
        self.partial: torch.Tensor | None = None  # split-KV partial states (float32), None without splits
        self.counters: torch.Tensor | None = None
        self._unzeroed = False  # counters made under graph capture: zero them at the next run
        # Both kernels on two streams (with JitKernel.mixed_on_two_streams); the one-call turns it off where its
        # prefill can hold few rows (JitKernel._one_call_plan)
        self.two_streams = True
        c = self.layout.constants(plan.kind)
        self._kv_inner, self._kv_strides, self._kv_align, self._dtypes, self._softmax = (
            c.kv_inner, c.kv_strides, c.kv_align, c.dtypes, c.softmax)
        self._q_shape = (plan.total_q, spec.num_qo_heads, spec.head_dim_qk)
        self._out_shape = (plan.total_q, spec.num_qo_heads, spec.head_dim_vo)
        # byte sizes the out-overlap check adds to data pointers (q's row and a page are contiguous)
        self._q_item, self._kv_item = self._dtypes[0].itemsize, self._dtypes[1].itemsize
        self._out_bytes = math.prod(self._out_shape) * self._dtypes[2].itemsize
        self._q_last_row = (plan.total_q - 1, spec.num_qo_heads * spec.head_dim_qk * self._q_item)
        self._page_bytes = math.prod(self._kv_inner or ()) * self._kv_item
        self._device = plan.device
        # the last q strides and cache shape / strides _fast_values accepted, with their byte spans: equal ones pass
        self._q_seen: tuple = (None, 0)
        self._kv_seen: tuple = (None, None, 0)
        fields = self._plan_fields(plan, kernel, shared_scratch, c.kv_stride_kv)
        # the plan's Params bytes between the layer fields: a run adds its layer values and packs once
        self._plan_values = c.run.pieces(self.layout.values(fields))
        self._assemble, self._packer = c.run.assemble, c.run.packer
        # the fast per-layer path (:meth:`_fast_values`): a paged batch of rows, no variant parameters
        self._fast = plan.kind == "paged" and plan.total_q > 0 and not self.layout.param_fields
        self._sinks_shape = (spec.num_qo_heads,)
        self._sinks_bytes = 4 * spec.num_qo_heads  # float32
        self._q_inner_strides = (spec.head_dim_qk, 1)
        self._has_sinks = spec.sinks
        slopes = kernel.default_slopes if spec.alibi else None  # made once per kernel: its address holds
        self._slopes_ptr = 0 if slopes is None else slopes.data_ptr()

    # ---- plan ---------------------------------------------------------------------------------------
    def _plan_fields(self, plan: Plan, kernel: Any, shared_scratch: bool, kv_stride_kv: int) -> dict[str, Any]:
        """The plan-time fields, the kernels to launch and their grids, the split scratch."""
        spec, g, md = self.spec, kernel.geometry, plan.metadata
        fields = {k: _ptr(t) for k, t in md.items()}
        fields.update(batch_size=plan.batch, total_q=plan.total_q, num_splits=1, prefill_skip_decode_rows=0,
                      k_scale=1.0, v_scale=1.0)
        self.decode, self._prefill_bound = None, None
        if spec.latent:  # a paged batch; the run checks q's head stride: the spec's
            fields.update(block_table_stride=md["block_table"].stride(0), q_stride_head=spec.head_dim_qk)
            return self._latent_fields(plan, g, fields, shared_scratch)
        block_m = g["prefill_block_m"]
        bound = math.ceil(plan.total_q * spec.group_size / block_m) + plan.batch  # tiles for any values
        tiles = bound
        if plan.query_lens is not None and plan.kind == "paged":
            # eager, the lengths read: exactly the m-tiles prefill_find_tile numbers (never fewer: a sequence it
            # finds no rows for counts here too), so no block of the grid is one that only finds nothing
            skip = not spec.explicit_positions  # prefill_skip_decode_rows below
            tiles = max(1, sum(-(-n * spec.group_size // block_m) for n in plan.query_lens
                               if n > 0 and not (skip and n == 1)))
        self.prefill = (tiles, spec.num_kv_heads, 1), g["prefill_threads"], g["prefill_smem"]
        # a graph captured from a run may replay with other lengths: there, the bound (see launch)
        self._prefill_bound = None if tiles >= bound else ((bound, spec.num_kv_heads, 1), *self.prefill[1:])
        if plan.kind == "ragged":
            return fields
        # a paged run checks q's head stride and the cache's inner strides: they are the spec's
        fields.update(block_table_stride=md["block_table"].stride(0), q_stride_head=spec.head_dim_qk,
                      kv_stride_kv=kv_stride_kv)
        if spec.explicit_positions:  # the prefill kernel serves every row (no decode kernel is built)
            return fields
        fields["prefill_skip_decode_rows"] = 1
        if plan.prefill_rows is False:
            self.prefill = None
        if plan.decode_rows is False:
            return fields
        splits = kernel.num_splits(plan.batch, kernel.max_decode_keys(plan.max_pages_per_seq))
        fields["num_splits"] = splits
        if splits > 1:
            fields.update(self._split_scratch(splits, shared_scratch))
        self.decode = (splits, spec.num_kv_heads, plan.batch), g["decode_threads"], g["decode_smem"]
        return fields

    def _latent_fields(self, plan: Plan, g: Mapping[str, int], fields: dict[str, Any], shared_scratch: bool
                       ) -> dict[str, Any]:
        """A latent spec's launch: the MLA decode kernel alone serves every row; grid ``(splits, row-tile slots,
        batch)``. The kernel loops over a sequence's tiles (one per query token and 16 heads) in steps of the
        slots, so the slots set the parallelism, not what is served: up to :data:`LATENT_MAX_QUERY_SLOTS`
        queries' tiles per sequence (all of them below that). Split-KV (the wave rule, :meth:`JitKernel.num_splits`
        over blocks x slots) for groups that are whole tiles; its partial states are per query row, and one
        counter per (query row, tile) lets the last split merge (templates/mla_decode.cuh, MlaMergeSpec). The sm_90a
        kernel (templates/mla_decode_sm90.cuh; the geometry's ``prefill_block_m`` gives its tile of flattened query
        rows) packs a sequence's queries x heads into tiles of 64 rows and splits every group."""
        spec, kernel = self.spec, self.kernel
        queries = plan.max_query_len if plan.max_query_len is not None else plan.total_q  # graph mode: any may
        queries = max(1, min(queries, LATENT_MAX_QUERY_SLOTS))
        # A latent cubin has no prefill kernel (prefill_threads 0): its prefill_block_m entry is the MLA kernel's
        # tile of flattened query rows (64: the sm_90a kernel), or 0 (the mma.sync kernel's tiles of 16 heads).
        flat_rows = g.get("prefill_block_m", 0) if not g.get("prefill_threads") else 0
        if flat_rows:  # templates/mla_decode_sm90.cuh: tiles of flattened (query, head) rows; every group splits
            tiles = -(-spec.num_qo_heads // flat_rows)  # per query: its counters' stride (q_row * tiles + tile)
            slots = -(-queries * spec.num_qo_heads // flat_rows)
            can_split = True
        else:
            tiles = -(-spec.num_qo_heads // LATENT_TILE_ROWS)
            slots = queries * tiles
            can_split = spec.num_qo_heads % LATENT_TILE_ROWS == 0  # the kernel's kSplitKV
        splits = 1
        if can_split:
            splits = kernel.num_splits(plan.batch * slots, kernel.max_decode_keys(plan.max_pages_per_seq))
        fields["num_splits"] = splits
        if splits > 1:
            fields.update(self._split_scratch(splits, shared_scratch, rows=plan.total_q, pairs=plan.total_q * tiles))
        self.prefill = None
        self.decode = (splits, slots, plan.batch), g["decode_threads"], g["decode_smem"]
        return fields

    def _split_scratch(self, splits: int, shared: bool, rows: int | None = None, pairs: int | None = None
                       ) -> dict[str, int]:
        """Partial outputs and lse of the split-KV decode (one float32 buffer) and the fused merge's counters.

        The counters start zeroed; the decode kernel's last split of each (sequence, kv head) merges
        and resets its counter, so they are zero again after every launch. ``shared``: the kernel's
        per-stream counters (the one-call path, which plans per call). ``rows`` (default: the batch's
        sequences) get a partial state per split and head, ``pairs`` (default: sequences x kv heads) a counter.
        """
        spec, plan = self.spec, self.plan
        rows = plan.batch if rows is None else rows
        n_o = splits * rows * spec.num_qo_heads * spec.head_dim_vo
        self.partial = torch.empty(n_o + splits * rows * spec.num_qo_heads, dtype=torch.float32,
                                   device=plan.device)
        pairs = plan.batch * spec.num_kv_heads if pairs is None else pairs
        if shared:
            self.counters = self.kernel.split_counters(pairs)
        else:
            self.counters = torch.zeros(pairs, dtype=torch.int32, device=plan.device)
            self._unzeroed = capturing()  # the zero fill only runs when the captured graph replays
        base = self.partial.data_ptr()
        return {"partial_o": base, "partial_lse": base + 4 * n_o, "split_counters": self.counters.data_ptr()}

    def describe(self) -> str:
        return self.spec.describe()

    # ---- run: check -> pack -> launch ---------------------------------------------------------------
    def run(self, q: torch.Tensor, kv: Any, out: torch.Tensor | None = None, return_lse: bool = False,
            sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
            params: Mapping[str, Any] | None = None, k_scale: float = 1.0, v_scale: float = 1.0
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One layer on the planned batch (arguments: :func:`jitattn.run`, which passes them by position: no
        keyword matching per layer)."""
        if self._fast and return_lse is False and alibi_slopes is None and not params:
            values = self._fast_values(q, kv, out, sinks)
            if values is not None:
                if type(k_scale) is not float or type(v_scale) is not float or k_scale != 1.0 or v_scale != 1.0:
                    values = values[:9] + check_scales(self.spec, k_scale, v_scale) + values[-1:]  # check()'s last step
                self.launch(self._packer.pack(*self._assemble(self._plan_values + values)))  # out past them: unread
                return values[-1]
        params = params if params is not None else {}
        scales = self.check(q, kv, out, return_lse, sinks, alibi_slopes, params, k_scale, v_scale)
        out, lse = self._outputs(q, out, return_lse)
        if self.plan.total_q:
            self.launch(self.pack(q, kv, out, lse, sinks, alibi_slopes, params, scales))
        return (out, lse) if return_lse else out

    def _fast_values(self, q: Any, kv: Any, out: Any, sinks: Any) -> tuple | None:
        """The layer values :meth:`pack` writes (scales 1.0) and then ``out`` (given, else new), when q, one cache
        tensor, out and sinks pass what :meth:`check` asks of them, read once each and compared with what the
        plan recorded; None on any difference, and nothing allocated: then the full checks run and name it.

        q's strides and the cache's shape and strides are compared whole with the last ones accepted (``_q_seen``,
        ``_kv_seen``), and only where they differ part by part with the plan's; the memo holds values, never a
        tensor, so a tensor changed in place since is read afresh. Accepts nothing that :meth:`check` refuses
        (tests/test_plan_fast_path.py holds the two to each other).
        """
        tensor, dev = torch.Tensor, self._device
        if type(q) is not tensor or type(kv) is not tensor:
            return None
        dtypes = self._dtypes
        if q.dtype is not dtypes[0] or q.shape != self._q_shape or q.device != dev:
            return None
        qs = q.stride()
        qp = q.data_ptr()
        q_seen = self._q_seen
        if qs != q_seen[0]:
            if qs[1:] != self._q_inner_strides or qs[0] % 8:  # check_q_layout
                return None
            rows, row_bytes = self._q_last_row
            q_seen = self._q_seen = (qs, rows * qs[0] * self._q_item + row_bytes)
        if qp & 15:
            return None
        if kv.dtype is not dtypes[1] or kv.device != dev:
            return None
        kshape = kv.shape
        ks = kv.stride()
        kp = kv.data_ptr()
        kv_seen = self._kv_seen
        if kshape != kv_seen[0] or ks != kv_seen[1]:
            pages = kshape[0] if kshape else 0
            if kshape[1:] != self._kv_inner or (self.plan.num_pages is not None and pages != self.plan.num_pages):
                return None
            if ks[1:] != self._kv_strides or ks[0] % self._kv_align:
                return None
            kv_seen = self._kv_seen = (kshape, ks, (pages - 1) * ks[0] * self._kv_item + self._page_bytes)
        if kp & 15:
            return None
        if self._has_sinks:
            if type(sinks) is not tensor or sinks.dtype is not torch.float32 or sinks.shape != self._sinks_shape or \
                    sinks.device != dev or not sinks.is_contiguous():
                return None
            sp = sinks.data_ptr()
        elif sinks is not None:
            return None
        else:
            sp = 0
        if out is None:
            out = torch.empty(*self._out_shape, dtype=dtypes[2], device=dev)  # unpacked sizes: torch parses them faster
            op = out.data_ptr()
        else:
            if type(out) is not tensor or out.dtype is not dtypes[2] or out.shape != self._out_shape or \
                    out.device != dev or not out.is_contiguous():
                return None
            op = out.data_ptr()
            end = op + self._out_bytes  # _check_out_apart's spans
            if op & 15 or (qp < end and op < qp + q_seen[1]) or (kp < end and op < kp + kv_seen[2]) or \
                    (sp and sp < end and op < sp + self._sinks_bytes):
                return None
        return qp, kp, op, 0, sp, self._slopes_ptr, qs[0], ks[0], kshape[0], 1.0, 1.0, out

    def check(self, q: Any, kv: Any, out: Any, return_lse: Any, sinks: Any, alibi_slopes: Any,
              params: Mapping[str, Any], k_scale: Any, v_scale: Any) -> tuple[float, float]:
        """The per-layer checks (no host read): q, the cache (or k and v), out, sinks, slopes, params,
        flags and scales against the spec and the plan. Returns the scales.

        Raises:
            ValueError: naming the argument, what the plan expects and what was given.
        """
        self._check_tensors(q, kv, out)
        spec, plan = self.spec, self.plan
        if sinks is not None or spec.sinks:
            check_vector("sinks", sinks, spec.sinks, spec.num_qo_heads, plan.device, "spec.sinks")
        if alibi_slopes is not None:
            check_vector("alibi_slopes", alibi_slopes, spec.alibi, spec.num_qo_heads, plan.device, "spec.alibi",
                         optional=True)
        if params or spec.params:
            check_params(spec, params, batch=plan.batch, total_q=plan.total_q, device=plan.device)
            if plan.validate and spec.explicit_positions:
                check_position_values(plan.metadata["functor_batch"], spec, params)
        if out is not None and plan.total_q and (sinks is not None or alibi_slopes is not None or params):
            read = {"sinks": sinks, "alibi_slopes": alibi_slopes, **{f"params[{k!r}]": v for k, v in params.items()}}
            self._check_out_apart_from(out, read)
        if return_lse is not False and check_flag("return_lse", return_lse) and not self._softmax:
            fail(f"return_lse=True: variant {spec.variant.name!r} has no softmax, so there is no lse")
        if type(k_scale) is float and type(v_scale) is float and k_scale == 1.0 and v_scale == 1.0:
            return 1.0, 1.0
        return check_scales(spec, k_scale, v_scale)

    def _check_tensors(self, q: Any, kv: Any, out: Any) -> None:
        """q, the cache (or k and v) and out: compared with what the plan made once, the slow checks
        only to name what differs."""
        plan = self.plan
        if type(q) is not torch.Tensor or q.dtype != self._dtypes[0] or tuple(q.shape) != self._q_shape:
            self._explain_q(q)
        if q.device != plan.device:
            fail(f"q: on {q.device}, but the plan (its metadata and kernel) is on {plan.device}")
        if plan.kind == "paged":
            self._check_kv_cache(kv)
            check_q_layout(self.spec, q)
        else:
            self._check_ragged_kv(q, kv)
        if out is not None and not (type(out) is torch.Tensor and out.dtype == self._dtypes[2] and
                                    out.shape == self._out_shape and out.device == plan.device and
                                    out.is_contiguous() and out.data_ptr() % 16 == 0):
            check_out(self.spec, out, plan.total_q, plan.device, device_of="the plan")
            check_out_layout(out)
        if out is not None and plan.total_q:
            self._check_out_apart(q, kv, out)

    def _check_out_apart(self, q: torch.Tensor, kv: Any, out: torch.Tensor) -> None:
        """``out`` shares no byte with q or the cache (or k, v): the kernels read them while writing out.

        Compares byte spans, first element to last, from data pointers and strides (torch has no public
        overlap check; a storage walk would cost more): two views of one buffer that interleave are
        refused too, views of disjoint parts pass. The checks before it made q's rows, out and a page
        contiguous, so the common case (one cache tensor) is a few integer operations.
        """
        start = out.data_ptr()
        end = start + self._out_bytes
        single = type(kv) is torch.Tensor or isinstance(kv, torch.Tensor)  # exact type first: the hot path
        if self.plan.kind == "paged" and single:
            q0, k0 = q.data_ptr(), kv.data_ptr()
            rows, row_bytes = self._q_last_row
            q1 = q0 + rows * q.stride(0) * self._q_item + row_bytes
            k1 = k0 + (kv.shape[0] - 1) * kv.stride(0) * self._kv_item + self._page_bytes
            if not ((q0 < end and start < q1) or (k0 < end and start < k1)):
                return
            spans = {"q": (q0, q1), "kv_cache": (k0, k1)}
        elif self.plan.kind == "paged":
            spans = {"q": byte_span(q), "k_cache": byte_span(kv[0]), "v_cache": byte_span(kv[1])}
        else:
            spans = {"q": byte_span(q), "k": byte_span(kv[0]), "v": byte_span(kv[1])}
        _refuse_overlaps(start, end, spans)

    def _check_out_apart_from(self, out: torch.Tensor, tensors: Mapping[str, Any]) -> None:
        """``out`` shares no byte with the per-layer tensors the kernels read (sinks, slopes, params)."""
        start = out.data_ptr()
        spans = {name: byte_span(t) for name, t in tensors.items()
                 if isinstance(t, torch.Tensor) and t.device == out.device}
        _refuse_overlaps(start, start + self._out_bytes, spans)

    def _explain_q(self, q: Any) -> None:
        """The slow path of q's check: passes a tensor subclass that fits, else names what differs."""
        check_tensor("q", q, dtype=self._dtypes[0], ndim=3, device=None)
        if tuple(q.shape) != self._q_shape:
                fail(f"q: expected shape {self._q_shape} (total_q, num_qo_heads, head_dim_qk) for this plan and "
                 f"spec, got {tuple(q.shape)}")

    def _check_kv_cache(self, kv: Any) -> None:
        if type(kv) is not torch.Tensor and is_kv_pair(kv):
            self._check_kv_pair(kv)
            return
        if type(kv) is not torch.Tensor or kv.dtype != self._dtypes[1] or tuple(kv.shape[1:]) != self._kv_inner:
            check_kv_cache(self.spec, kv, self.plan.device, device_of="the plan")
        if kv.device != self.plan.device:
            fail(f"kv_cache: on {kv.device}, but the plan (its metadata and kernel) is on {self.plan.device}")
        if self.plan.num_pages is not None and kv.shape[0] != self.plan.num_pages:
            fail(f"kv_cache: {kv.shape[0]} pages, but the plan was made for num_pages={self.plan.num_pages}")
        if kv.stride()[1:] != self._kv_strides or kv.stride(0) % self._kv_align or kv.data_ptr() % 16:
            check_kv_cache_layout(self.spec, kv)  # the slow path names what differs (or passes size-1 dims)

    def _check_kv_pair(self, kv: Any) -> None:
        """A ``(k_cache, v_cache)`` pair: the full checks (a pair's V offset is per run, so nothing is cached)."""
        check_kv_cache(self.spec, kv, self.plan.device, device_of="the plan")
        if self.plan.num_pages is not None and kv[0].shape[0] != self.plan.num_pages:
            fail(f"kv_cache: {kv[0].shape[0]} pages, but the plan was made for num_pages={self.plan.num_pages}")
        check_kv_cache_layout(self.spec, kv)

    def _check_ragged_kv(self, q: torch.Tensor, kv: Any) -> None:
        if not isinstance(kv, (tuple, list)) or len(kv) != 2:
            fail(f"kv: a ragged plan runs with a (k, v) pair, got {type(kv).__name__}")
        check_ragged_tensors(self.spec, q, kv[0], kv[1], self.plan.device)
        if self.plan.total_kv is not None and kv[0].shape[0] != self.plan.total_kv:
            fail(f"k: {kv[0].shape[0]} rows, but the plan was made for total_kv={self.plan.total_kv}")

    def _outputs(self, q: torch.Tensor, out: torch.Tensor | None, return_lse: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``out`` (given, else new) and, when asked, the float32 lse ``(total_q, num_qo_heads)``."""
        spec, n = self.spec, self.plan.total_q
        if out is None:
            out = torch.empty(n, spec.num_qo_heads, spec.head_dim_vo, dtype=self._dtypes[2], device=q.device)
        lse = torch.empty(n, spec.num_qo_heads, dtype=torch.float32, device=q.device) if return_lse else None
        return out, lse

    def pack(self, q: torch.Tensor, kv: Any, out: torch.Tensor, lse: torch.Tensor | None, sinks: Any,
             alibi_slopes: Any, params: Mapping[str, Any], scales: tuple[float, float]) -> bytes:
        """The launch's Params bytes: the plan's, with this layer's fields written in."""
        if alibi_slopes is None and self.spec.alibi:
            alibi_slopes = self.kernel.default_slopes  # the spec's slopes, made once per kernel
        pair = None
        if self.plan.kind == "paged":
            if type(kv) is not torch.Tensor and is_kv_pair(kv):  # K's address; V at the pair's kv_stride_kv
                pair, kv = kv_stride_kv(kv), kv[0]
            values = (q.data_ptr(), kv.data_ptr(), out.data_ptr(), _ptr(lse), _ptr(sinks), _ptr(alibi_slopes),
                      q.stride(0), kv.stride(0), kv.shape[0], scales[0], scales[1])
        else:
            k, v = kv
            values = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), _ptr(lse), _ptr(sinks),
                      _ptr(alibi_slopes), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                      v.stride(1), k.shape[0])
        if self.layout.param_fields:
            values += self._param_values(params)
        packed = self._packer.pack(*self._assemble(self._plan_values + values))  # new bytes per run
        if pair is None:
            return packed
        buf = bytearray(packed)  # the plan packed a single tensor's K-to-V stride: a pair's is its own
        for write, offset, pick in self.layout.writers(("kv_stride_kv",)):
            write(buf, offset, *pick((pair,)))
        return bytes(buf)

    def _param_values(self, params: Mapping[str, Any]) -> tuple:
        out: list[Any] = []
        for p in self.spec.params:
            value = params[p.name]
            out += (value,) if p.is_scalar else (value.data_ptr(), value.numel())
        return tuple(out)

    def launch(self, args: bytes) -> None:
        """The planned launches on the caller's stream (a mixed batch's decode on a side stream)."""
        if self._unzeroed:
            self._zero_counters()
        decode, prefill = self.decode, self.prefill
        if prefill is not None and self._prefill_bound is not None and capturing():  # exact: for the values read
            prefill = self._prefill_bound
        if decode is not None and prefill is not None and self.two_streams and self.kernel.mixed_on_two_streams:
            self._launch_two_streams(args, prefill)
            return
        stream = self._stream()
        if decode is not None:
            self._launch("decode", decode[0], decode[1], decode[2], args, stream)
        if prefill is not None:
            self._launch("prefill", prefill[0], prefill[1], prefill[2], args, stream)

    def _launch_two_streams(self, args: bytes, prefill: tuple) -> None:
        """The decode kernel on a side stream beside the prefill kernel on the caller's: they write
        disjoint rows and share no scratch, so the prefill blocks take each SM the memory-bound decode
        leaves (a fork and join that CUDA graph capture records as two branches)."""
        main = self._stream()
        fork = self.kernel.stream_fork(main)  # made once per caller's stream: its side stream
        side = fork.fork()
        try:
            grid, block, smem = self.decode
            self._launch("decode", grid, block, smem, args, side)
            self._launch("prefill", prefill[0], prefill[1], prefill[2], args, main)
        finally:  # joined even when a launch raises: the caller's stream must not run ahead of the
            # decode kernel already queued, and a capture must not end with a fork unjoined
            fork.join()

    def _zero_counters(self) -> None:
        """Counters made under capture hold garbage until that graph replays: zero them eagerly (then
        they are known zero) or record the fill into this capture too (a later graph may replay first)."""
        self.counters.zero_()  # type: ignore[union-attr]
        if not capturing():
            self._unzeroed = False

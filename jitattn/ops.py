"""jitattn's paged attention as a torch custom op: ``torch.ops.jitattn.paged_attention``.

``torch.compile`` traces through it without a graph break (the op is opaque to the compiler; its
fake implementation gives the output shapes), and a call on the ``jit`` backend can be captured
in a CUDA graph (the ``jit`` launch reads no tensor on the host; pass ``max_query_len=1`` for a
pure decode batch).

Use :func:`paged_attention` (the Python wrapper); the raw op's schema is::

    jitattn::paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens,
        Tensor query_start_loc, str spec_json, str backend, Tensor? sinks, Tensor? alibi_slopes,
        Tensor[] param_tensors, float[] param_scalars, bool return_lse, int max_query_len,
        float k_scale, float v_scale) -> (Tensor out, Tensor lse)

- ``spec_json``: the spec's canonical JSON (:attr:`AttentionSpec.canonical_text`). The op finds
  the spec object by it (:func:`jitattn.spec.live_spec`; :func:`register_spec` keeps one alive), so a
  variant's torch functors, which JSON does not carry, reach the torch backends; an unknown text
  is parsed with :meth:`AttentionSpec.from_json`.
- ``backend``: a registered backend name; the wrapper asks the selector once per (spec, device,
  phase, lse) at trace time, so the choice is a constant of the compiled graph; eager calls reuse
  the remembered choice (:func:`jitattn.selector.select_cached`).
- ``param_tensors`` / ``param_scalars``: the variant's tensor and scalar parameters, each in
  declaration order (int32 scalars travel as floats and are converted back).
- ``max_query_len``: ``-1`` for unknown, ``1`` for a pure decode batch.
- ``k_scale`` / ``v_scale``: an FP8 cache's per-tensor scales (passed on only for an FP8 ``kv_dtype``;
  the wrapper refuses anything but 1.0 for a 16-bit cache).
- ``lse``: float32 ``(total_q, num_qo_heads)`` when ``return_lse``, else an empty ``(0,)`` tensor.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

import torch

from jitattn.backends import DeviceInfo, get_backend
from jitattn.checks import check_flag, check_max_query_len, check_scales, check_spec, fail
from jitattn.dtypes import torch_dtype
from jitattn.selector import build_cached, select_cached
from jitattn.spec import AttentionSpec, live_spec

# The one registry of live specs is jitattn.spec's (by canonical text, held weakly); the op keeps the
# specs it was handed alive here, so a compiled graph's text still finds its spec (and torch functors).
_kept: dict[int, AttentionSpec] = {}
_lock = threading.Lock()


def _keep(spec: AttentionSpec) -> AttentionSpec:
    with _lock:
        return _kept.setdefault(id(spec), spec)


def register_spec(spec: AttentionSpec) -> str:
    """Keep ``spec`` (with its variant's torch functors) alive, findable by its canonical JSON; return that text."""
    _keep(spec)
    return spec.canonical_text


def spec_from_json(text: str) -> AttentionSpec:
    """The spec for ``text``: the live one (:func:`jitattn.spec.live_spec`), else parsed (and kept)."""
    spec = live_spec(text)
    return spec if spec is not None else _keep(AttentionSpec.from_json(text))


@torch.library.custom_op("jitattn::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, spec_json: str, backend: str, sinks: Optional[torch.Tensor],
                       alibi_slopes: Optional[torch.Tensor], param_tensors: list[torch.Tensor],
                       param_scalars: list[float], return_lse: bool, max_query_len: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    spec = spec_from_json(spec_json)
    fn = build_cached(get_backend(backend), spec, DeviceInfo.from_torch(q.device))
    fp8 = {"k_scale": k_scale, "v_scale": v_scale} if spec.kv_dtype != spec.q_dtype else {}
    res = fn(q, kv_cache, block_table, seq_lens, query_start_loc, sinks=sinks, alibi_slopes=alibi_slopes,
             params=_unpack_params(spec, param_tensors, param_scalars), return_lse=return_lse,
             max_query_len=None if max_query_len < 0 else max_query_len, **fp8)
    if return_lse:
        return res[0], res[1]
    return res, q.new_empty((0,), dtype=torch.float32)


@paged_attention_op.register_fake
def _paged_attention_fake(q, kv_cache, block_table, seq_lens, query_start_loc, spec_json, backend, sinks,
                          alibi_slopes, param_tensors, param_scalars, return_lse, max_query_len, k_scale=1.0,
                          v_scale=1.0):
    spec = spec_from_json(spec_json)
    out = q.new_empty((q.shape[0], spec.num_qo_heads, spec.head_dim_vo), dtype=torch_dtype(spec.o_dtype))
    lse = q.new_empty((q.shape[0], spec.num_qo_heads) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _unpack_params(spec: AttentionSpec, tensors: list[torch.Tensor], scalars: list[float]) -> dict[str, Any]:
    it_t, it_s = iter(tensors), iter(scalars)
    out: dict[str, Any] = {}
    for p in spec.params:
        if p.is_scalar:
            value = next(it_s)
            out[p.name] = int(value) if p.dtype == "int32" else float(value)
        else:
            out[p.name] = next(it_t)
    return out


def _pack_params(layout: tuple[tuple[str, bool], ...], params: Mapping[str, Any] | None
                 ) -> tuple[list[torch.Tensor], list[float]]:
    params = dict(params or {})
    names = [name for name, _ in layout]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ValueError(f"params: unknown names {unknown}; the variant declares {names}")
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(f"params: missing {missing}")
    tensors = [params[name] for name, scalar in layout if not scalar]
    scalars = [float(params[name]) for name, scalar in layout if scalar]
    return tensors, scalars


# The wrapper below hands the compiler only strings and numbers: the spec object itself never
# crosses into a traced call (torch 2.11's dynamo cannot reconstruct a frozen dataclass there).
# Each helper runs once per distinct argument tuple at trace time and is a constant of the graph.
@torch.compiler.assume_constant_result
def _param_layout(text: str) -> tuple[tuple[str, bool], ...]:
    return tuple((p.name, p.is_scalar) for p in spec_from_json(text).params)


@torch.compiler.assume_constant_result
def _backend_name(text: str, device_type: str, device_index: int, phase: str, need_lse: bool,
                  backend: str = "") -> str:
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    # Under torch.compile this runs once per argument tuple; eager calls find the remembered choice.
    # A backend the caller names is checked against the spec too (the selector's forced path).
    return select_cached(spec_from_json(text), DeviceInfo.from_torch(device), phase, need_lse=need_lse,
                         backend=backend or None).name


def paged_attention(spec: AttentionSpec, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                    return_lse: bool = False, max_query_len: int | None = None, backend: str | None = None,
                    phase: str = "mixed", k_scale: float = 1.0, v_scale: float = 1.0
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention through the custom op; contract of :func:`jitattn.reference.paged_attention`.

    Args:
        backend: a backend name (checked like ``JITATTN_BACKEND``: one that cannot serve the spec,
            e.g. sdpa for a soft-cap, raises NoBackendError with the reasons); None asks
            :func:`jitattn.selector.select` (honouring ``JITATTN_BACKEND``), once per (spec, device,
            phase, return_lse): a constant of a compiled graph, remembered across eager calls.
        phase: passed to the selector.
        max_query_len: ``1`` promises a pure decode batch (the jit backend then launches only its
            decode kernel).
        k_scale, v_scale: per-tensor scales of an FP8 KV cache (Python floats; 1.0 for a 16-bit cache).

    Returns:
        ``out`` ``(total_q, num_qo_heads, head_dim_vo)``, and lse if ``return_lse``.

    Raises:
        jitattn.selector.NoBackendError: no backend serves the spec (or the forced one cannot).
        ValueError: bad tensors or params (from the backend's checks); a ``k_scale`` / ``v_scale``
            other than 1.0 for a 16-bit cache.
    """
    check_spec(spec, "jitattn.ops.paged_attention(spec, q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
    if isinstance(kv_cache, (tuple, list)):
        fail("kv_cache: the custom op's schema takes one cache tensor, got a (k_cache, v_cache) pair; call "
             "jitattn.paged_attention or jitattn.plan / run with the pair (they take it as is), or pass one tensor")
    check_scales(spec, k_scale, v_scale)
    check_flag("return_lse", return_lse)
    max_query_len = check_max_query_len(max_query_len)
    text = spec.canonical_text
    device = q.device
    name = _backend_name(text, device.type, -1 if device.index is None else device.index, phase, return_lse,
                         backend or "")
    tensors, scalars = _pack_params(_param_layout(text), params)
    out, lse = torch.ops.jitattn.paged_attention(
        q, kv_cache, block_table, seq_lens, query_start_loc, text, name, sinks, alibi_slopes, tensors, scalars,
        return_lse, -1 if max_query_len is None else int(max_query_len), float(k_scale), float(v_scale))
    return (out, lse) if return_lse else out

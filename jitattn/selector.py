"""The selector: which backend serves a layer's spec on a device, in a phase, and why the others do not.

Priority (each backend's ``priority``; the first whose :meth:`~jitattn.backends.Backend.reasons`
is empty wins):

1. ``jit`` (100): the kernels built for this exact spec; every feature; CUDA 8.0+.
2. ``flashinfer`` (80): prebuilt-quality kernels for the common head dims, when installed.
3. ``flex`` (60): FlexAttention, compiled by Triton; no sinks; pays a page gather per call.
4. ``sdpa`` (40): torch SDPA for plain attention; pays a page gather and a host sync per call.
5. ``reference`` (0): always serves, slowly.

On a CUDA device that makes jit > flashinfer > flex > sdpa > reference; on the CPU only sdpa and
reference pass their device checks, so plain attention runs through SDPA and everything else
through the reference. Third-party backends slot in by their own priority. The checks consider
the device type and compute capability, dtypes (an FP8 KV cache: jit and reference only, the
others refuse it), head dims, features (windows, soft-cap, sinks, ALiBi, custom functors),
the phase, and two call requirements: the lse (``need_lse``) and CUDA-graph capture
(``cuda_graph``).

A backend on this machine's devices (the CPU, ``cuda`` / ``cuda:N``) needs torch installed
(:func:`import_reasons`): without it every backend is passed over with that reason (a named GPU,
``h100`` or ``sm_90``, is planned for another machine and not judged so). ``cuda`` / ``cuda:N`` where
torch sees no CUDA device is an error naming the device (:func:`no_gpu_problem`), as torch's own
``torch.zeros(1, device="cuda")`` is: no backend is picked for a GPU that is not there.

Nothing falls back silently:

- ``JITATTN_BACKEND=NAME`` (or ``select(..., backend=NAME)``) forces a backend; if it cannot
  serve, :class:`NoBackendError` carries its reasons. An unknown name lists the registered ones.
- An automatic selection that finds no backend raises :class:`NoBackendError` listing every
  backend's reasons.
- Each decision is logged once per (spec, device, phase, requirements) at INFO on the
  ``jitattn.selector`` logger, with the reasons the backends before it were passed over.

:func:`selection_table` renders a model's layer kinds and their backends for ``jitattn select``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from jitattn import settings
from jitattn.backends import (Backend, DeviceInfo, PagedAttentionFn, Requirements, get_backend, registered_backends,
                              registry_generation)
from jitattn.backends.base import check_phase
from jitattn.models import LayerKind, ModelAttention, load_model_config
from jitattn.spec import AttentionSpec

logger = logging.getLogger("jitattn.selector")


class NoBackendError(RuntimeError):
    """No backend can serve the spec (or the forced one cannot). ``rejections`` holds each backend's reasons."""

    def __init__(self, message: str, rejections: tuple["Rejection", ...]):
        super().__init__(message)
        self.rejections = rejections


@dataclass(frozen=True)
class Rejection:
    """Why one backend was not chosen.

    Attributes:
        backend: its name.
        reasons: why it cannot serve; empty when it could have, but a higher-priority one won (or
            another was forced).
        note: for a backend that could serve, why it was passed over anyway.
    """

    backend: str
    reasons: tuple[str, ...]
    note: str = ""

    @property
    def could_serve(self) -> bool:
        return not self.reasons

    def lines(self) -> list[str]:
        """One line for this backend: its reasons joined (``"flashinfer: not installed (...); latent
        attention ... not served: ..."``), or the note of one that could serve."""
        return [_joined(self.backend, self.reasons)] if self.reasons else [f"{self.backend}: {self.note}"]


def _joined(backend: str, reasons: "tuple[str, ...] | list[str]") -> str:
    """A backend's reasons as one line: the first as it is, the others after ``; `` without the
    ``"name: "`` each starts with (a backend with two reasons is listed once, not once per reason)."""
    prefix = f"{backend}: "
    rest = [r[len(prefix):] if r.startswith(prefix) else r for r in reasons[1:]]
    return "; ".join([reasons[0], *rest])


@dataclass(frozen=True)
class Selection:
    """The backend chosen for one (spec, device, phase, requirements), and why the others were not.

    Attributes:
        backend: the chosen backend.
        forced: chosen by ``JITATTN_BACKEND`` / ``backend=`` rather than by priority.
        passed_over: every other registered backend, in priority order, with its reasons.
        forced_by: what forced it: ``"backend"`` (the argument) or ``"JITATTN_BACKEND"``; ``""`` when not forced.
    """

    spec: AttentionSpec
    device: DeviceInfo
    phase: str
    requirements: Requirements
    backend: Backend
    forced: bool
    passed_over: tuple[Rejection, ...]
    forced_by: str = ""

    @property
    def name(self) -> str:
        return self.backend.name

    def build(self) -> PagedAttentionFn:
        """The chosen backend's callable for this spec and device (built once per process, then reused)."""
        return build_cached(self.backend, self.spec, self.device)

    def explain(self) -> str:
        how = f"forced by {self.forced_by or 'JITATTN_BACKEND'}={self.name}" if self.forced else "by priority"
        lines = [f"{self.spec.describe()} on {self.device.describe()}, phase {self.phase}: "
                 f"backend {self.name} ({how})"]
        lines += [f"  {line}" for r in self.passed_over for line in r.lines()]
        return "\n".join(lines)


def select(spec: AttentionSpec, device: DeviceInfo | str | Any = None, phase: str = "mixed", *,
           need_lse: bool = False, cuda_graph: bool = False, backend: str | None = None) -> Selection:
    """Choose the backend for ``spec`` on ``device`` (module doc: priority, forcing, logging).

    Args:
        device: a :class:`DeviceInfo`, a name (``"cpu"``, ``"cuda"``, ``"h100"``, ``"sm_90"``), a
            torch device, or None (the current CUDA device, else the CPU).
        phase: ``"prefill"``, ``"decode"`` or ``"mixed"``.
        need_lse, cuda_graph: call requirements (:class:`~jitattn.backends.Requirements`).
        backend: force this backend (overrides ``JITATTN_BACKEND``).

    Raises:
        NoBackendError: the forced backend cannot serve, or none can; the message lists the reasons.
            Also ``cuda`` / ``cuda:N`` (a name or a torch device) when torch sees no CUDA device
            (:func:`no_gpu_problem`): the message names the device, forced or not.
        ValueError: an unknown backend name, device name or phase, or a CUDA index past this machine's devices.
    """
    device = DeviceInfo.parse(device)
    check_phase(phase)
    req = Requirements(need_lse=need_lse, cuda_graph=cuda_graph)
    forced = backend or settings.forced_backend()
    no_gpu = no_gpu_problem(device)
    missing = import_reasons(device) + ((no_gpu,) if no_gpu else ())
    verdicts = [(b, tuple(b.reasons(spec, device, phase, req))) for b in registered_backends()]
    # a backend that would serve but cannot run here says why (the others' reasons already bar it)
    verdicts = [(b, r or tuple(f"{b.name}: {m}" for m in missing)) for b, r in verdicts]
    if no_gpu:
        raise NoBackendError(f"device {device.name!r}: {no_gpu}, so no backend can run there; name the GPU or "
                             f"arch to plan for another machine ('h100', 'sm_90'), or use 'cpu'",
                             tuple(Rejection(b.name, r) for b, r in verdicts))
    if forced:
        chosen = _forced(forced, verdicts, spec, device, phase, "backend" if backend else "JITATTN_BACKEND")
    else:
        chosen = next((b for b, reasons in verdicts if not reasons), None)
        if chosen is None:
            raise NoBackendError(_none_message(spec, device, phase, verdicts),
                                 tuple(Rejection(b.name, r) for b, r in verdicts))
    note = f"could serve; {chosen.name} forced" if forced else f"could serve; lower priority than {chosen.name}"
    passed = tuple(Rejection(b.name, r, "" if r else note) for b, r in verdicts if b is not chosen)
    forced_by = ("backend" if backend else "JITATTN_BACKEND") if forced else ""
    selection = Selection(spec, device, phase, req, chosen, bool(forced), passed, forced_by)
    _log_once(selection)
    return selection


def import_reasons(device: DeviceInfo) -> tuple[str, ...]:
    """What this machine lacks to run any backend on ``device``: ``("torch is not installed ...",)`` for
    a device of this machine when ``import torch`` would fail, else ``()``.

    Every backend's call takes torch tensors (the latent specs the MLA kernel does not take have only
    sdpa and reference, torch itself). The CPU, ``cuda`` and ``cuda:N`` are this machine's
    (:func:`names_this_machine`); a named GPU (``h100``, ``sm_90``) may be a serving node that a build
    box without torch plans for, so it is not judged here.
    """
    if not names_this_machine(device) or torch_installed():
        return ()
    return (TORCH_MISSING,)


#: Why no backend runs on this machine without torch (:func:`import_reasons`).
TORCH_MISSING = "torch is not installed (its calls take torch tensors; pip install 'jitattn[torch]')"
#: Why no backend runs on ``cuda`` / ``cuda:N`` when torch finds no GPU (:func:`no_gpu_problem`).
NO_GPU = "no CUDA device is visible on this machine (torch.cuda.is_available() is False)"


def no_gpu_problem(device: DeviceInfo) -> str | None:
    """:data:`NO_GPU` when ``device`` names this machine's GPU (``cuda``, ``cuda:N``: capability unknown)
    and torch, installed, sees none; else None. Without torch nothing is judged here
    (:func:`import_reasons` says torch is missing); a named GPU (``h100``, ``sm_90``) is never judged."""
    if device.type != "cuda" or device.capability is not None or not names_this_machine(device):
        return None
    if not torch_installed():
        return None
    import torch

    return None if torch.cuda.is_available() else NO_GPU


def names_this_machine(device: DeviceInfo) -> bool:
    """Whether ``device`` is one of this machine's: the CPU, a CUDA device torch found (it has an
    index), or ``cuda`` / ``cuda:N`` (this machine's GPU, whose capability is unknown without torch)."""
    name = device.name.strip().lower()
    return device.type == "cpu" or device.index is not None or name == "cuda" or name.startswith("cuda:")


@functools.lru_cache(maxsize=1)
def torch_installed() -> bool:
    """Whether ``import torch`` would find torch, without importing it (a process neither gains nor loses it)."""
    if "torch" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def select_cached(spec: AttentionSpec, device: DeviceInfo, phase: str = "mixed", *,
                  need_lse: bool = False, backend: str | None = None) -> Selection:
    """:func:`select`, remembered: the per-call path of :func:`jitattn.ops.paged_attention` in eager mode.

    The key is (spec, device, phase, need_lse, ``backend``, ``JITATTN_BACKEND``, the registry's
    :func:`~jitattn.backends.registry_generation`), so setting the variable or registering a backend takes effect on the next call;
    :func:`clear_caches` forgets. A failed selection is not remembered (it raises again, with its
    reasons). A ``backend`` named by the caller is checked like any forced one: one that cannot serve
    the spec raises :class:`NoBackendError` with its reasons.

    Raises:
        NoBackendError, ValueError: as :func:`select`.
    """
    key = (spec, device, phase, need_lse, backend, settings.forced_backend(), registry_generation())
    with _lock:
        sel = _selected.get(key)
    if sel is None:
        sel = select(spec, device, phase, need_lse=need_lse, backend=backend)
        with _lock:
            sel = _selected.setdefault(key, sel)
    return sel


def build_backend(spec: AttentionSpec, device: DeviceInfo | str | Any = None, phase: str = "mixed",
                  **kwargs: Any) -> PagedAttentionFn:
    """``select(spec, device, phase, **kwargs).build()``: the callable to run (same errors as :func:`select`)."""
    return select(spec, device, phase, **kwargs).build()


def _forced(name: str, verdicts: list[tuple[Backend, tuple[str, ...]]], spec: AttentionSpec, device: DeviceInfo,
            phase: str, source: str = "JITATTN_BACKEND") -> Backend:
    """The backend ``name`` forced by ``source`` (``"JITATTN_BACKEND"`` or the ``"backend"`` argument,
    which ``jitattn select --backend`` passes); errors name the one the user set."""
    try:
        chosen = get_backend(name)
    except KeyError as exc:
        raise ValueError(f"{source}={name!r}: {exc.args[0]}") from None
    reasons = dict((b.name, r) for b, r in verdicts)[chosen.name]
    if reasons:
        text = "\n".join(f"  - {r}" for r in reasons)
        undo = "unset JITATTN_BACKEND" if source == "JITATTN_BACKEND" else "pass no backend"
        raise NoBackendError(f"{source}={name} cannot serve {spec.describe()} on {device.describe()} "
                             f"(phase {phase}):\n{text}\n{undo} to select automatically",
                             (Rejection(name, reasons),))
    return chosen


def _none_message(spec: AttentionSpec, device: DeviceInfo, phase: str,
                  verdicts: list[tuple[Backend, tuple[str, ...]]]) -> str:
    text = "\n".join(f"  - {_joined(b.name, reasons)}" for b, reasons in verdicts if reasons)
    return f"no attention backend can serve {spec.describe()} on {device.describe()} (phase {phase}):\n{text}"


# ---- logging and building, once each -------------------------------------------------------------
_logged: set[tuple] = set()
_built: dict[tuple, PagedAttentionFn] = {}
_selected: dict[tuple, Selection] = {}
_lock = threading.Lock()


def _log_once(sel: Selection) -> None:
    key = (sel.spec, sel.device, sel.phase, sel.requirements, sel.name, sel.forced)
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    # A deployment that meant to ship its kernels must hear that a slower backend took over.
    missing = any("missing kernel" in reason for r in sel.passed_over for reason in r.reasons)
    logger.log(logging.WARNING if missing else logging.INFO, "jitattn: %s", sel.explain())


def build_cached(backend: Backend, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
    """``backend.build(spec, device)``, once per process per (backend, spec, device); later calls
    return the same callable (what :meth:`Selection.build` and :mod:`jitattn.ops` run).

    Raises:
        whatever the backend's ``build`` raises (a failed build is not remembered).
    """
    key = (backend.name, id(backend), spec, device)
    with _lock:
        fn = _built.get(key)
    if fn is None:
        fn = backend.build(spec, device)  # may compile: outside the lock
        with _lock:
            fn = _built.setdefault(key, fn)
    return fn


def clear_caches() -> None:
    """Forget logged decisions, remembered selections and built callables (for tests)."""
    with _lock:
        _logged.clear()
        _built.clear()
        _selected.clear()


# ---- a model's layer kinds ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSelection:
    """One layer kind of a model and its backend (``selection``), or why none serves (``error``)."""

    kind: LayerKind
    selection: Selection | None
    error: NoBackendError | None = None

    @property
    def backend(self) -> str | None:
        return self.selection.name if self.selection else None

    def passed_over(self) -> list[str]:
        """One line per other backend, with every reason it was passed over (all backends' on error)."""
        if self.selection is not None:
            return [line for r in self.selection.passed_over for line in r.lines()]
        return [line for r in self.error.rejections for line in r.lines()]  # type: ignore[union-attr]

    def to_json(self) -> dict[str, Any]:
        return {"layer_kind": self.kind.name, "layers": list(self.kind.layers), "spec": self.kind.spec.to_json(),
                "backend": self.backend, "forced": bool(self.selection and self.selection.forced),
                "passed_over": self.passed_over(), "error": str(self.error) if self.error else None}


@dataclass(frozen=True)
class ModelSelection:
    """Every layer kind of a model with its backend on one device."""

    model: ModelAttention
    device: DeviceInfo
    phase: str
    rows: tuple[LayerSelection, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every layer kind has a backend."""
        return all(r.selection is not None for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model.name, "model_type": self.model.model_type, "num_layers": self.model.num_layers,
                "tensor_parallel_size": self.model.tensor_parallel_size,
                "device": self.device.describe(), "phase": self.phase, "ok": self.ok,
                "layer_kinds": [r.to_json() for r in self.rows]}


def select_model(config: str | os.PathLike | dict, device: DeviceInfo | str | Any = None, *, phase: str = "mixed",
                 dtype: str | None = None, kv_layout: str = "NHD", page_size: int = 16, need_lse: bool = False,
                 cuda_graph: bool = False, backend: str | None = None, kv_dtype: str | None = None,
                 tensor_parallel_size: int = 1) -> ModelSelection:
    """The backend of each layer kind of a Hugging Face model config on ``device``.

    A layer kind no backend serves gets its :class:`NoBackendError` in ``error`` instead of raising,
    so the whole model is reported; check :attr:`ModelSelection.ok`. ``tensor_parallel_size``: the
    layer specs are one rank's (:func:`jitattn.models.per_rank_heads`). Needs torch only when
    ``device`` is None (to find the current device) or a torch device: a named device
    (``"h100"``, ``"sm_90"``) is planned without it.

    Raises:
        FileNotFoundError, ValueError: the config cannot be read or mapped (:func:`jitattn.models.load_model_config`);
            an unknown device name, phase or forced backend name.
    """
    model = load_model_config(config, dtype=dtype, kv_layout=kv_layout, page_size=page_size, kv_dtype=kv_dtype,
                              tensor_parallel_size=tensor_parallel_size)
    device = DeviceInfo.parse(device)
    rows = []
    for kind in model.layer_kinds:
        try:
            sel = select(kind.spec, device, phase, need_lse=need_lse, cuda_graph=cuda_graph, backend=backend)
            rows.append(LayerSelection(kind, sel))
        except NoBackendError as err:
            rows.append(LayerSelection(kind, None, err))
    return ModelSelection(model, device, phase, tuple(rows))


def selection_table(model_config_path: str | os.PathLike | dict, device: DeviceInfo | str | Any = None,
                    **kwargs: Any) -> str:
    """``jitattn select``'s text: a markdown table of layer kinds and backends, then why each other
    backend was passed over, per layer kind. Arguments as :func:`select_model`; works without a GPU
    when the device is named (``"h100"``, ``"sm_90"``).

    Returns the text even when a layer kind has no backend (its row says ``none``); call
    :func:`select_model` for the structured result and its ``ok``.
    """
    return format_model_selection(select_model(model_config_path, device, **kwargs))


def format_model_selection(ms: ModelSelection) -> str:
    m = ms.model
    tp = f", tensor parallel {m.tensor_parallel_size} (heads per rank)" if m.tensor_parallel_size > 1 else ""
    lines = [f"{m.name} ({m.model_type}, {m.num_layers} layers{tp}) on {ms.device.describe()}, phase {ms.phase}", "",
             "| layer kind | layers | backend | spec |", "|---|---|---|---|"]
    for row in ms.rows:
        chosen = row.backend or "none"
        if row.selection is not None and row.selection.forced:
            chosen += " (forced)"
        lines.append(f"| {row.kind.name} | {_layers(row.kind.layers)} | {chosen} | {row.kind.spec.describe()} |")
    for row in ms.rows:
        head = f"{row.kind.name} -> {row.backend}" if row.selection else f"{row.kind.name} -> no backend"
        lines += ["", head + (":" if row.passed_over() else "")]
        lines += [f"  - {line}" for line in row.passed_over()]
    return "\n".join(lines) + "\n"


def _layers(layers: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, layers[:4]))
    return f"{len(layers)} ({shown}{', ...' if len(layers) > 4 else ''})"

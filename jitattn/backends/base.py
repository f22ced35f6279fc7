"""The backend interface: what every attention backend answers, and the device it answers about.

A backend is one way to compute :func:`jitattn.reference.paged_attention` for a spec. It answers
two questions:

- :meth:`Backend.reasons` ``(spec, device, phase)``: why it cannot serve, as a list of precise
  sentences that each start with the backend's name (``"sdpa: logits_soft_cap=50 not supported
  (torch SDPA has no soft-cap)"``); an empty list means it can. It never needs the device itself,
  only a :class:`DeviceInfo`, so ``jitattn select --device h100`` works on a laptop.
- :meth:`Backend.build` ``(spec, device)``: a callable with the paged signature (:data:`PagedAttentionFn`)::

      fn(q, kv_cache, block_table, seq_lens, query_start_loc, *, sinks=None, alibi_slopes=None,
         params=None, return_lse=False, out=None, max_query_len=None, k_scale=1.0, v_scale=1.0,
         validate=False) -> out | (out, lse)

  shapes and semantics exactly as :func:`jitattn.reference.paged_attention`: ``out``
  ``(total_q, num_qo_heads, head_dim_vo)`` in ``spec.o_dtype``, ``lse`` float32 natural-log
  ``(total_q, num_qo_heads)``. ``out`` (optional) is written in place and returned;
  ``max_query_len`` is a host-side hint (``1``: a pure decode batch) that a backend may ignore;
  ``k_scale`` / ``v_scale`` are an FP8 cache's per-tensor scales (for 16-bit KV they must be 1.0:
  another value is a ValueError, :func:`jitattn.checks.check_scales`);
  ``validate=True`` also checks the metadata values (query_start_loc bounds and order, seq_lens
  against the block table, page ids in range: :func:`jitattn.checks.check_metadata_values`, a device
  sync) and raises ValueError instead of computing on them. Backends that read the metadata on the
  host anyway (``reference``, ``sdpa``) always check them.

  For a ragged spec (``spec.kv_storage == "ragged"``) the callable takes contiguous varlen K/V
  instead, as :func:`jitattn.reference.ragged_attention`::

      fn(q, k, v, query_start_loc, kv_start_loc, *, sinks=None, alibi_slopes=None, params=None,
         return_lse=False, out=None, max_query_len=None, validate=False) -> out | (out, lse)

  A backend that cannot take ragged K/V says so in its reasons.

Phases (``phase`` argument): ``"prefill"`` (sequences bring many queries), ``"decode"`` (one
query per sequence) and ``"mixed"`` (both in one call; the default). Every built-in backend
serves every phase through the same call; a backend that could not would say so in its reasons.

Two requirements a caller may add (:class:`Requirements`): ``need_lse`` (the call passes
``return_lse=True``) and ``cuda_graph`` (the call is captured in a CUDA graph, so the backend must
not read tensors on the host).
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from jitattn.spec import QO_DTYPES, AttentionSpec

Phase = Literal["prefill", "decode", "mixed"]
PHASES: tuple[str, ...] = ("prefill", "decode", "mixed")

#: The paged attention signature every built backend has (see the module doc).
PagedAttentionFn = Callable[..., Any]

#: GPU product names -> compute capability, for naming a device that is not present.
KNOWN_GPUS: dict[str, tuple[int, int]] = {
    "v100": (7, 0), "t4": (7, 5),
    "a100": (8, 0), "a800": (8, 0), "a30": (8, 0), "a10": (8, 6), "a10g": (8, 6), "a40": (8, 6),
    "rtx3090": (8, 6), "l4": (8, 9), "l40": (8, 9), "l40s": (8, 9), "rtx4090": (8, 9),
    "h100": (9, 0), "h800": (9, 0), "h200": (9, 0), "h20": (9, 0), "gh200": (9, 0),
    "b200": (10, 0), "gb200": (10, 0), "b100": (10, 0), "rtx5090": (12, 0),
}
_ARCH = re.compile(r"^(?:sm_?)?(\d{2,3})a?$")
_CAPABILITY = re.compile(r"^(\d{1,2})\.(\d)$")


def check_phase(phase: str) -> str:
    """``phase`` if it is one of :data:`PHASES`; ValueError naming the allowed ones otherwise."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: expected one of {PHASES}")
    return phase


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the backends see it: no handle to it, so it can name a device that is absent.

    Attributes:
        name: how it was named (``"cpu"``, ``"cuda"``, ``"h100"``, ``"sm_90"``, or torch's device name).
        type: ``"cpu"`` or ``"cuda"``.
        capability: ``(major, minor)`` for a CUDA device, None when unknown (``"cuda"`` named on a
            machine without a GPU) or for the CPU.
        index: the CUDA device index when it describes a real device, else None.
    """

    name: str
    type: str
    capability: tuple[int, int] | None = None
    index: int | None = None

    @classmethod
    def parse(cls, text: "str | DeviceInfo | Any | None") -> "DeviceInfo":
        """A device from a name: ``"cpu"``; ``"cuda"`` / ``"cuda:1"`` (the real device if torch sees
        one, else capability unknown); a GPU name from :data:`KNOWN_GPUS` (``"h100"``); an arch
        (``"sm_90"``, ``"sm_90a"``, ``"90"``) or a capability (``"9.0"``). A torch.device or None
        (the current CUDA device if any, else the CPU) goes through :meth:`from_torch`.

        Raises:
            ValueError: an unknown name, listing what is accepted, or a ``cuda:N`` this machine does not have.
        """
        if isinstance(text, DeviceInfo):
            return text
        if text is None or not isinstance(text, str):
            return cls.from_torch(text)
        raw = text.strip().lower()
        if raw == "cpu":
            return cls("cpu", "cpu")
        if raw == "cuda" or raw.startswith("cuda:"):
            return cls._real_cuda(raw)
        key = raw.replace("nvidia", "").replace("-", "").replace(" ", "").replace("_", "")
        if key in KNOWN_GPUS:
            return cls(raw, "cuda", KNOWN_GPUS[key])
        m = _ARCH.match(raw)
        if m:
            num = int(m.group(1))
            return cls(raw, "cuda", (num // 10, num % 10))
        m = _CAPABILITY.match(raw)
        if m:
            return cls(raw, "cuda", (int(m.group(1)), int(m.group(2))))
        raise ValueError(
            f"device={text!r}: unknown device; expected 'cpu', 'cuda', 'cuda:N', a GPU name "
            f"({', '.join(sorted(KNOWN_GPUS))}), an arch such as 'sm_90' or a capability such as '9.0'")

    @classmethod
    def _real_cuda(cls, raw: str) -> "DeviceInfo":
        index = int(raw.split(":")[1]) if ":" in raw else None
        try:
            import torch
        except ImportError:
            return cls(raw, "cuda", None, index)
        if not torch.cuda.is_available():
            return cls(raw, "cuda", None, index)
        return cls.from_torch(torch.device(raw))

    @classmethod
    def from_torch(cls, device: Any = None) -> "DeviceInfo":
        """The real device a torch device (or tensor's device) names; None: current CUDA device, else CPU.

        A CUDA device on a machine where torch sees none is returned with its capability unknown, as
        :meth:`parse` does for ``"cuda"`` (``jitattn.select`` then names it in its error).

        Raises:
            ValueError: ``device`` is None and torch is not installed (name the device instead), or a CUDA
                index this machine does not have (naming how many it has).
        """
        if getattr(device, "type", None) == "cuda" and getattr(device, "index", None) is not None:
            try:
                return _cuda_device_info(device.index)  # a tensor's device: the per-attention-call path
            except (AssertionError, RuntimeError):  # no GPU or no such index: said below
                pass
        try:
            import torch
        except ImportError:
            raise ValueError("device=None: no device named, and torch is not installed to find the current one; "
                             "name the device ('h100', 'sm_90', '9.0', 'cpu')") from None

        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dev = torch.device(device)
        if dev.type != "cuda":
            return cls(dev.type, dev.type)
        if not torch.cuda.is_available():
            return cls(str(dev), "cuda", None, dev.index)
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(f"device={str(dev)!r}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}")
        return _cuda_device_info(dev.index if dev.index is not None else torch.cuda.current_device())

    @property
    def arch(self) -> str | None:
        """``"sm_90"`` for capability (9, 0); None when unknown."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else None

    def torch_device(self) -> Any:
        """The torch device to run on (``cuda:index`` or the current CUDA device; ``cpu``)."""
        import torch

        if self.type == "cuda":
            return torch.device("cuda", self.index) if self.index is not None else torch.device("cuda")
        return torch.device(self.type)

    def describe(self) -> str:
        if self.type != "cuda":
            return self.name
        cap = f"{self.capability[0]}.{self.capability[1]}" if self.capability else "capability unknown"
        if self.name == cap:  # named by its capability ("--device 7.0"): say it once
            return f"compute capability {cap} (cuda)"
        return f"{self.name} (cuda, {cap})"


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    """A real CUDA device's name and capability, asked once per process (calls run per attention call)."""
    import torch

    return DeviceInfo(torch.cuda.get_device_name(index), "cuda",
                      tuple(torch.cuda.get_device_capability(index)), index)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Requirements:
    """What a call needs beyond the spec.

    Attributes:
        need_lse: the call asks for the log-sum-exp (``return_lse=True``), e.g. to merge states.
        cuda_graph: the call is captured in a CUDA graph: no host reads of tensor values, no
            allocation that changes between replays.
    """

    need_lse: bool = False
    cuda_graph: bool = False


class Backend(ABC):
    """One attention implementation. Subclasses set the class attributes and the two methods.

    Attributes:
        name: short unique name (``JITATTN_BACKEND`` value, table column).
        priority: higher is tried first by the selector (built-ins: jit 100, flashinfer 80,
            flex 60, sdpa 40, reference 0). A third-party backend picks its own.
        graph_safe: its calls can be captured in a CUDA graph.
        supports_lse: its calls can return the lse.
        supports_explicit_positions: its paged calls take ``query_positions`` / ``functor_batch`` /
            ``position_offset`` (a spec with ``query_positions="explicit"``); built-ins: jit only.
        supports_latent: its paged calls take a latent (MLA) spec's cache ``(num_pages, page_size,
            head_dim_qk)``; built-ins: jit, sdpa and reference. Without it, ``latent_refusal`` says why.
        description: one line for tables and docs.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 50
    graph_safe: ClassVar[bool] = False
    supports_lse: ClassVar[bool] = True
    supports_explicit_positions: ClassVar[bool] = False
    supports_latent: ClassVar[bool] = False
    latent_refusal: ClassVar[str] = "its call reads a paged K/V cache, not the latent rows of an MLA cache"
    description: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Guard each subclass's :meth:`build`: a spec the backend refuses is a ValueError there too.

        The selector builds only what :meth:`reasons` accepted, but ``get_backend("sdpa").build(spec,
        device)`` called directly would otherwise return a callable that drops what it cannot do
        (a soft-cap, a window): a silent wrong answer.
        """
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is None or getattr(build, "_refuses_unserved_specs", False):
            return

        @functools.wraps(build)
        def checked_build(self: "Backend", spec: AttentionSpec, device: "DeviceInfo | str", *args: Any,
                          **kwargs: Any) -> PagedAttentionFn:
            device = DeviceInfo.parse(device)

            def refusal(judged: DeviceInfo) -> list[str]:
                """The reasons, when no phase is served on ``judged`` (a backend may serve decode only)."""
                kind = self._position_reasons(spec) + self._latent_reasons(spec)
                refused = [self.spec_reasons(spec, judged, phase) + kind for phase in PHASES]
                return refused[PHASES.index("mixed")] if all(refused) else []

            reasons = refusal(device)
            if reasons and device.type != "cuda":
                # Off CUDA a torch backend may be refused for selection only ("runs on CUDA devices
                # only") and still compute right on the CPU: its spec features are judged on a CUDA
                # device too, and the reasons both judgements give (the spec's, not the device's) name it.
                on_cuda = refusal(DeviceInfo("sm_90", "cuda", (9, 0)))
                reasons = ([r for r in reasons if r in on_cuda] or reasons) if on_cuda else []
            if reasons:
                raise ValueError(f"backend {self.name!r} cannot serve this spec on {device.describe()}: "
                                 + "; ".join(reasons))
            return build(self, spec, device, *args, **kwargs)

        checked_build._refuses_unserved_specs = True  # type: ignore[attr-defined]
        cls.build = checked_build  # type: ignore[method-assign]

    @abstractmethod
    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        """Reasons specific to this backend (each a full sentence starting with ``"{name}: "``)."""

    @abstractmethod
    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        """The callable serving ``spec`` on ``device`` (module doc: signature).

        May load or compile kernels. Raises ValueError (naming the reasons) for a spec that
        :meth:`spec_reasons` refuses in every phase: subclasses' ``build`` is wrapped to check.
        """

    def reasons(self, spec: AttentionSpec, device: "DeviceInfo | str", phase: str = "mixed",
                requirements: Requirements = Requirements()) -> list[str]:
        """Why this backend cannot serve ``spec`` on ``device`` in ``phase``; empty when it can.

        Raises:
            ValueError: an unknown phase or device name (a caller error, not a reason).
        """
        device = DeviceInfo.parse(device)
        check_phase(phase)
        out = list(self.spec_reasons(spec, device, phase))
        out += self._position_reasons(spec) + self._latent_reasons(spec)
        if requirements.need_lse and not self.supports_lse:
            out.append(f"{self.name}: cannot return the lse (return_lse=True)")
        if requirements.need_lse and spec.variant is not None and not spec.variant.softmax:
            out.append(f"{self.name}: variant {spec.variant.name!r} has no softmax, so there is no lse")
        if requirements.cuda_graph and not self.graph_safe:
            out.append(f"{self.name}: not CUDA-graph capturable (reads sequence lengths on the host each call)")
        return out

    def _position_reasons(self, spec: AttentionSpec) -> list[str]:
        """A spec with explicit query positions, for a backend whose call cannot take them."""
        if spec.explicit_positions and not self.supports_explicit_positions:
            return [f"{self.name}: explicit query positions (query_positions='explicit') not supported (its call "
                    f"takes no query_positions / functor_batch / position_offset; it would place each sequence's "
                    f"queries at its last positions)"]
        return []

    def _latent_reasons(self, spec: AttentionSpec) -> list[str]:
        """A latent (MLA) spec, for a backend whose call cannot take its cache."""
        if spec.latent and not self.supports_latent:
            return [f"{self.name}: latent attention (kv_storage='latent', MLA) not served: {self.latent_refusal}"]
        return []

    def __repr__(self) -> str:
        return f"<jitattn backend {self.name!r} priority={self.priority}>"


# ---- shared reason helpers -------------------------------------------------------------------------
#: The 16-bit KV dtypes every built-in backend takes; an FP8 cache needs its scales applied on load.
KV_DTYPES_16BIT = ("float16", "bfloat16")


def dtype_reasons(name: str, spec: AttentionSpec, qo: tuple[str, ...] = QO_DTYPES,
                  kv: tuple[str, ...] = KV_DTYPES_16BIT) -> list[str]:
    """Reasons for q/o and KV dtypes outside what a backend takes (by default 16-bit KV only)."""
    out = []
    if spec.q_dtype not in qo or spec.o_dtype not in qo:
        out.append(f"{name}: q_dtype={spec.q_dtype} / o_dtype={spec.o_dtype} not supported (takes {', '.join(qo)})")
    if spec.kv_dtype not in kv:
        extra = " (an FP8 cache needs k_scale / v_scale applied on load; this backend does not)" \
            if "float8" in spec.kv_dtype else ""
        out.append(f"{name}: kv_dtype={spec.kv_dtype} not supported (takes {', '.join(kv)}){extra}")
    return out


def cuda_reasons(name: str, device: DeviceInfo, *, min_capability: tuple[int, int] | None = None) -> list[str]:
    """Reasons a CUDA-only backend gives for this device (not CUDA; capability unknown or too old)."""
    if device.type != "cuda":
        return [f"{name}: runs on CUDA devices only, device is {device.name}"]
    if device.capability is None:
        return [f"{name}: compute capability of device {device.name!r} unknown (no GPU visible); "
                f"name the GPU or arch, e.g. --device h100 or --device sm_90"]
    if min_capability and device.capability < min_capability:
        have = f"{device.capability[0]}.{device.capability[1]}"
        need = f"{min_capability[0]}.{min_capability[1]}"
        return [f"{name}: needs compute capability >= {need}, device {device.name} has {have}"]
    return []


def _window_words(spec: AttentionSpec) -> str | None:
    sides = [f"{side}={getattr(spec, side)}" for side in ("window_left", "window_right") if getattr(spec, side) >= 0]
    return f"sliding window ({', '.join(sides)}) not supported" if sides else None


#: How a reason names each spec feature a backend may lack (None: the spec does not have it). A ragged
#: spec is the adapter's gap, not its library's, so it reads "not served by this adapter".
FEATURE_WORDS: dict[str, Callable[[AttentionSpec], "str | None"]] = {
    "window": _window_words,
    "window_right": lambda s: f"window_right={s.window_right} not supported" if s.window_right >= 0 else None,
    "logits_soft_cap": lambda s: f"logits_soft_cap={s.logits_soft_cap:g} not supported" if s.logits_soft_cap else None,
    "sinks": lambda s: "sinks not supported" if s.sinks else None,
    "alibi": lambda s: "ALiBi not supported" if s.alibi else None,
    "variant": lambda s: f"custom functors (variant {s.variant.name!r}) not supported"
               if s.variant is not None else None,
    "ragged": lambda s: "ragged K/V (kv_storage='ragged') not served by this adapter" if s.ragged else None,
}


def unsupported_reasons(name: str, spec: AttentionSpec, **why: str) -> list[str]:
    """One reason per feature named in ``why`` that ``spec`` has, in the order given:
    ``"{name}: {the feature, with its values} not supported ({why})"``.

    ``why`` maps a key of :data:`FEATURE_WORDS` (``window`` for either side, ``window_right``,
    ``logits_soft_cap``, ``sinks``, ``alibi``, ``variant``, ``ragged``) to the backend's reason in a clause.

    Raises:
        KeyError: a feature that :data:`FEATURE_WORDS` does not know (a backend's mistake).
    """
    return [f"{name}: {words} ({reason})" for feature, reason in why.items()
            if (words := FEATURE_WORDS[feature](spec))]

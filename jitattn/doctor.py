"""``jitattn doctor``: can this node serve some models with ``JITATTN_DISABLE_JIT=1``, and if not, why.

It reports, without compiling anything and without needing torch or a GPU:

- nvcc: where :func:`jitattn.settings.nvcc` resolves it and its version, or why it cannot run;
- the GPUs and the driver (asked of the driver library, ``libcuda.so.1``, through ctypes), if any;
- torch: its version and the CUDA it was built with, or "torch not installed";
- every cache layer: its root, whether it exists and is writable, its entries and the corrupt ones;
- for each model (``--model``), each kernel it needs (its layer kinds' specs, per rank under
  ``--tensor-parallel-size``, the ``merge_state`` module of its output dtype and the ``append_kv``
  module of its paged kinds: :func:`model_modules`, what warm-up builds) and the archs it
  is cached for. A spec jitattn builds no kernel for (a latent, MLA, spec whose head dims its kernel does
  not take) counts as served, with a note naming the backend that serves it (:func:`no_kernel_note`).

A node *can serve* a model when, for every kernel, the cache holds it for an arch the node runs:
with GPUs, for each GPU any arch of :func:`jitattn.archs.archs_for_capability` (the runtime takes the
best one cached); without one (a build box checking what it ships), each requested arch (``--arch``, default
``JITATTN_ARCHS``). Lookups are the ones a ``JITATTN_DISABLE_JIT=1`` process makes (an entry any
nvcc built serves), and never write. :func:`diagnose` returns a :class:`Report`; its ``ok`` is
the exit code's answer (false for a model that cannot be served and for a corrupt entry in any layer,
``--model`` given or not), its ``warmup_command`` the command that fills the gap.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from jitattn import settings
from jitattn.archs import archs_for_capability, normalize_arch
from jitattn.build import BuildError, nvcc_version
from jitattn.cache import KernelCache, check_entry
from jitattn.commands import models_warmup_command
from jitattn.append_kv_module import AppendKvModule
from jitattn.merge_module import MergeModule
from jitattn.models import ModelAttention, load_model_config
from jitattn.spec import AttentionSpec, latent_kernel_problem


@dataclass(frozen=True)
class Nvcc:
    """The nvcc builds would run: ``path`` (as :func:`jitattn.settings.nvcc` resolves it), its ``version``
    banner, or None with ``error`` saying why it cannot run."""

    path: str
    version: str | None
    error: str = ""


@dataclass(frozen=True)
class Gpu:
    """One GPU as the driver reports it: its device ``index``, product ``name`` and compute
    ``capability`` ``(major, minor)``; :attr:`archs` are the jitattn archs it runs, best first."""

    index: int
    name: str
    capability: tuple[int, int]

    @property
    def archs(self) -> list[str]:
        return archs_for_capability(*self.capability)


@dataclass(frozen=True)
class Driver:
    """The NVIDIA driver: the CUDA ``version`` it supports (``"13.0"``) and its ``gpus``, or None with
    ``error`` saying why there is none."""

    version: str | None
    gpus: tuple[Gpu, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Torch:
    """torch's ``version`` (None: not installed), the ``cuda`` it was built with (None: a CPU build) and
    whether it sees a GPU (``cuda_available``)."""

    version: str | None
    cuda: str | None = None
    cuda_available: bool = False


@dataclass(frozen=True)
class Layer:
    """One cache layer: its ``root``, ``kind`` (``"writable"``: the root; ``"read-only"``: a
    ``JITATTN_CACHE_PATH`` layer), whether it ``exists`` and is ``writable``, its number of ``entries``
    and the ``corrupt`` ones (``"<path>: <problem>"``, checked and left in place)."""

    root: str
    kind: str
    exists: bool
    writable: bool
    entries: int
    corrupt: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kernel:
    """One module a model needs and where it is cached: ``found`` arch -> the entry's path."""

    name: str
    describe: str
    needed_by: tuple[str, ...]
    found: dict[str, str]
    served: bool
    note: str = ""  # a module with no kernel to cache (a latent spec the MLA kernel does not take): what serves it


@dataclass(frozen=True)
class ModelReport:
    """One ``--model``: its ``config`` path, the model's ``name``, the ``tensor_parallel_size`` its specs
    are one rank of, and each kernel it needs; ``ok`` when every one is served."""

    config: str
    name: str
    tensor_parallel_size: int
    kernels: tuple[Kernel, ...]

    @property
    def ok(self) -> bool:
        return all(k.served for k in self.kernels)


@dataclass(frozen=True)
class Report:
    """What :func:`diagnose` found. ``ok``: every model can be served here with JITATTN_DISABLE_JIT=1 and
    the cache holds no corrupt entry."""

    nvcc: Nvcc
    driver: Driver
    torch: Torch
    layers: tuple[Layer, ...]
    archs: tuple[str, ...]
    any_arch: bool  # True: one of ``archs`` per kernel suffices (the node's GPU runs each)
    models: tuple[ModelReport, ...] = ()
    warmup_command: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def corrupt(self) -> tuple[str, ...]:
        """Every layer's corrupt entries (``"<path>: <problem>"``): never loaded, so never served."""
        return tuple(c for layer in self.layers for c in layer.corrupt)

    @property
    def ok(self) -> bool:
        """Every model is served, and no entry of any layer is corrupt (with or without ``--model``)."""
        return all(m.ok for m in self.models) and not self.corrupt

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for m, report in zip(data["models"], self.models):
            m["ok"] = report.ok
        return data


# ---- the parts -----------------------------------------------------------------------------------
def find_nvcc() -> Nvcc:
    """Where nvcc resolves (:func:`jitattn.settings.nvcc`) and its version, or why it cannot run."""
    path = settings.nvcc()
    try:
        return Nvcc(path, nvcc_version(path))
    except BuildError as exc:
        return Nvcc(path, None, str(exc))


def find_driver(library: str = "libcuda.so.1") -> Driver:
    """The NVIDIA driver's CUDA version and its GPUs, asked through ctypes (no torch needed)."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return Driver(None, (), f"no NVIDIA driver: cannot load {library} ({exc})")
    status = lib.cuInit(0)
    if status != 0:
        return Driver(None, (), f"cuInit failed with CUresult {status} (no usable GPU, or a driver problem)")
    version, count = ctypes.c_int(), ctypes.c_int()
    lib.cuDriverGetVersion(ctypes.byref(version))
    lib.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for index in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGet(ctypes.byref(device), index)
        lib.cuDeviceGetName(name, len(name), device)
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # ..._MINOR
        gpus.append(Gpu(index, name.value.decode(errors="replace"), (major.value, minor.value)))
    v = version.value
    return Driver(f"{v // 1000}.{v % 1000 // 10}", tuple(gpus))


def find_torch() -> Torch:
    """torch's version and the CUDA it was built with; ``version`` None when it is not installed."""
    try:
        import torch
    except ImportError:
        return Torch(None)
    return Torch(torch.__version__, torch.version.cuda, bool(torch.cuda.is_available()))


def cache_layers(cache: KernelCache) -> tuple[Layer, ...]:
    """Each root of ``cache``: exists, writable, entry count, corrupt entries (checked, never moved)."""
    out = []
    for root in cache.roots:
        writable_kind = root == cache.root
        corrupt, count = [], 0
        for path in cache.entry_paths(root):
            count += 1
            problem = check_entry(path)[0]
            if problem:
                corrupt.append(f"{path}: {problem}")
        existing = next((p for p in (root, *root.parents) if p.exists()), root)
        out.append(Layer(str(root), "writable" if writable_kind else "read-only", root.is_dir(),
                         os.access(existing, os.W_OK), count, tuple(corrupt)))
    return tuple(out)


def no_kernel_note(module: Any, arch: str) -> str | None:
    """Why ``module`` has no kernel to build, cache or ship (a latent spec the MLA kernel cannot serve:
    :func:`jitattn.spec.latent_kernel_problem`), naming the backend the selector picks for it on ``arch``
    (and that it needs torch, when this machine has none: those backends are torch's); None for a module
    that compiles (every other spec, latent ones included)."""
    if not isinstance(module, AttentionSpec):
        return None
    problem = latent_kernel_problem(module)
    if not problem:
        return None
    from jitattn import selector

    try:
        served = f"served by the {selector.select(module, arch).name} backend on {arch}"
        if not selector.torch_installed():  # a named arch is not judged by this machine's imports: say it here
            served += ", which needs torch: not installed here (pip install 'jitattn[torch]' where it serves)"
    except (selector.NoBackendError, ValueError) as err:  # ValueError: a JITATTN_BACKEND of no registered backend
        why = dict.fromkeys(r for rej in getattr(err, "rejections", ()) for r in rej.reasons)  # the lines below
        served = f"no backend serves it on {arch}: {str(err).splitlines()[0].rstrip(':')}"
        served += f": {'; '.join(why)}" if why else ""
    return f"no kernel to build: {problem}; {served}"


def model_modules(model: ModelAttention) -> list[tuple[Any, str]]:
    """Every module serving ``model`` loads, in build order, each with the part of the model that needs it:
    its layer kinds' specs (the kind's name), the ``merge_state`` module of each output dtype
    (``"merge_state"``) and the ``append_kv`` module of each (K/V dtype, cache dtype) pair of its paged
    kinds (``"append_kv"``; a latent cache's writes are torch's). ``jitattn warmup --model`` builds
    these, ``jitattn cache export`` ships them and ``jitattn doctor`` checks them. A module may repeat."""
    out: list[tuple[Any, str]] = [(kind.spec, kind.name) for kind in model.layer_kinds]
    out += [(MergeModule(o), "merge_state") for o in dict.fromkeys(kind.spec.o_dtype for kind in model.layer_kinds)]
    out += [(AppendKvModule(*pair), "append_kv")
            for pair in dict.fromkeys((kind.spec.q_dtype, kind.spec.kv_dtype) for kind in model.layer_kinds
                                      if kind.spec.kv_storage == "paged")]
    return out


def model_kernels(path: Path, cache: KernelCache, archs: Sequence[str], any_arch: bool, *, dtype: str | None,
                  page_size: int, kv_layout: str, kv_dtype: str | None, tensor_parallel_size: int,
                  gpu_archs: Sequence[Sequence[str]] = ()) -> ModelReport:
    """Which archs each kernel of one model is cached for (lookups as under JITATTN_DISABLE_JIT=1).

    ``any_arch``: a kernel is served when one of ``archs`` is cached for each group of ``gpu_archs``
    (the archs each GPU of the node runs; no groups: one of ``archs``), else when every one is.

    Raises:
        FileNotFoundError, ValueError: the config cannot be read or mapped (:func:`load_model_config`).
    """
    model = load_model_config(path, dtype=dtype, page_size=page_size, kv_layout=kv_layout, kv_dtype=kv_dtype,
                              tensor_parallel_size=tensor_parallel_size)
    needed: dict[Any, list[str]] = {}
    for module, part in model_modules(model):
        needed.setdefault(module, []).append(part)
    kernels = []
    with settings.scope(JITATTN_DISABLE_JIT="1"):  # what a serving node finds: any nvcc's build, no compile
        for module, sources in needed.items():
            note = no_kernel_note(module, archs[0]) if archs else None
            if note:
                kernels.append(Kernel(module.name, module.describe(), tuple(sources), {}, True, note))
                continue
            found = {a: str(e.path) for a in archs if (e := cache.find(module, a)) is not None}
            if not any_arch:
                served = len(found) == len(archs)
            else:  # every GPU must run one cached arch: an sm_80 build does not serve an H100 beside an A100
                served = all(any(a in found for a in group) for group in gpu_archs) if gpu_archs else bool(found)
            kernels.append(Kernel(module.name, module.describe(), tuple(sources), found, served))
    return ModelReport(str(path), model.name, tensor_parallel_size, tuple(kernels))


def diagnose(models: Sequence[Path] = (), archs: Sequence[str] = (), *, dtype: str | None = None,
             page_size: int = 16, kv_layout: str = "NHD", kv_dtype: str | None = None,
             tensor_parallel_size: int = 1, cache: KernelCache | None = None) -> Report:
    """Everything ``jitattn doctor`` prints (module doc: what "can serve" means).

    Args:
        models: Hugging Face config.json paths.
        archs: target archs to check (default: the archs this node's GPU runs, else ``JITATTN_ARCHS``).
        dtype, page_size, kv_layout, kv_dtype, tensor_parallel_size: as ``jitattn warmup`` takes them.

    Raises:
        FileNotFoundError, ValueError: a model config cannot be read or mapped; an unknown arch.
    """
    cache = cache or KernelCache()
    looking = KernelCache(cache.root, cache.layers, look_only=True)  # a corrupt entry is reported, not moved
    driver = find_driver()
    notes, gpu_archs = [], ()
    if archs:
        chosen, any_arch = [normalize_arch(a, field="--arch") for a in archs], False
    elif driver.gpus:
        gpu_archs = tuple(dict.fromkeys(tuple(g.archs) for g in driver.gpus))  # one group per kind of GPU
        chosen = list(dict.fromkeys(a for group in gpu_archs for a in group))
        any_arch = True
    else:
        chosen, any_arch = list(settings.archs()), False
        notes.append(f"no GPU here: checking the archs a serving node needs, {', '.join(chosen)} (JITATTN_ARCHS, "
                     f"or --arch)")
    reports = tuple(model_kernels(Path(m), looking, chosen, any_arch, dtype=dtype, page_size=page_size,
                                  kv_layout=kv_layout, kv_dtype=kv_dtype, tensor_parallel_size=tensor_parallel_size,
                                  gpu_archs=gpu_archs)
                    for m in models)
    command = None
    if any(not r.ok for r in reports):
        fill = [normalize_arch(a) for a in archs] if archs else (
            list(dict.fromkeys(group[0] for group in gpu_archs if group)) if any_arch else chosen)  # each GPU's best
        command = models_warmup_command([r.config for r in reports if not r.ok], [], fill, dtype=dtype,
                                        page_size=page_size, kv_layout=kv_layout, kv_dtype=kv_dtype,
                                        tensor_parallel_size=tensor_parallel_size)
    return Report(find_nvcc(), driver, find_torch(), cache_layers(cache), tuple(chosen), any_arch, reports,
                  command, tuple(notes))

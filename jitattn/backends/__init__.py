"""Attention backends: the built-ins, third-party ones, and the registry the selector reads.

Built-ins, by selector priority (higher first; :mod:`jitattn.selector` explains the choice):

| name | priority | serves |
|---|---|---|
| ``jit`` | 100 | every spec feature; CUDA, compute capability 8.0+ (:mod:`jitattn.backends.jit`) |
| ``flashinfer`` | 80 | hd 64/128/256, window_left, soft-cap; when ``import flashinfer`` works |
| ``flex`` | 60 | windows, soft-cap, ALiBi, torch functors; not sinks; CUDA |
| ``sdpa`` | 40 | plain causal / bidirectional attention; any device |
| ``reference`` | 0 | everything, any device, slow |

Third-party backends: subclass :class:`Backend` (set ``name`` and ``priority``, implement
``spec_reasons`` and ``build``) and either call :func:`register_backend` or declare an entry point
in the ``jitattn.backends`` group (``pyproject.toml``)::

    [project.entry-points."jitattn.backends"]
    mybackend = "mypackage.attention:MyBackend"

The entry point may name a :class:`Backend` subclass, an instance, or a zero-argument callable
returning one. Entry points are loaded once, on the first registry lookup. One that fails to load
is not dropped silently: it is logged and stays in the registry as a backend that refuses every
spec with the load error as its reason.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import Any

from jitattn.backends.base import (PHASES, Backend, DeviceInfo, PagedAttentionFn, Phase, Requirements)
from jitattn.backends.flashinfer import FlashInferBackend
from jitattn.backends.flex import FlexBackend
from jitattn.backends.jit import JitBackend
from jitattn.backends.reference import ReferenceBackend
from jitattn.backends.sdpa import SdpaBackend
from jitattn.spec import AttentionSpec

__all__ = [
    "Backend", "DeviceInfo", "PagedAttentionFn", "Phase", "PHASES", "Requirements", "ENTRY_POINT_GROUP",
    "BUILTIN_BACKENDS", "register_backend", "get_backend", "registered_backends", "registry_generation",
    "reset_registry",
]

ENTRY_POINT_GROUP = "jitattn.backends"
BUILTIN_BACKENDS: tuple[type[Backend], ...] = (JitBackend, FlashInferBackend, FlexBackend, SdpaBackend,
                                               ReferenceBackend)

logger = logging.getLogger("jitattn.backends")
_lock = threading.RLock()
_registry: dict[str, Backend] = {}
_entry_points_loaded = False
_generation = 0  # bumped on every change of _registry: selector.select_cached's key names the registry by it


class EntryPointLoadError(Backend):
    """Stands in for a third-party backend whose entry point failed to load: refuses everything, says why."""

    priority = -1000

    def __init__(self, name: str, target: str, error: str):
        self.name = name  # type: ignore[misc]
        self.message = f"{name}: entry point {name} = {target!r} ({ENTRY_POINT_GROUP}) failed to load: {error}"

    def spec_reasons(self, spec: AttentionSpec, device: DeviceInfo, phase: str) -> list[str]:
        return [self.message]

    def build(self, spec: AttentionSpec, device: DeviceInfo) -> PagedAttentionFn:
        raise RuntimeError(self.message)


def _as_backend(obj: Any, origin: str) -> Backend:
    """A Backend from a Backend instance, subclass, or zero-argument factory; TypeError otherwise."""
    if isinstance(obj, type) and issubclass(obj, Backend):
        obj = obj()
    elif not isinstance(obj, Backend) and callable(obj):
        obj = obj()
    if not isinstance(obj, Backend):
        raise TypeError(f"{origin}: expected a jitattn.backends.Backend subclass, instance or factory, "
                        f"got {type(obj).__name__}")
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        raise TypeError(f"{origin}: backend {type(obj).__name__} has no name")
    return obj


def register_backend(backend: Backend | type[Backend], *, replace: bool = False) -> Backend:
    """Add a backend to the registry (an instance or a class with a no-argument constructor).

    Raises:
        ValueError: a backend of that name is already registered and ``replace`` is False.
        TypeError: not a Backend.
    """
    obj = _as_backend(backend, "register_backend")
    with _lock:
        _ensure_loaded()
        if obj.name in _registry and not replace:
            raise ValueError(f"register_backend: a backend named {obj.name!r} is already registered "
                             f"({_registry[obj.name]!r}); pass replace=True to replace it")
        _registry[obj.name] = obj
        _changed()
    return obj


def unregister_backend(name: str) -> None:
    """Remove a backend by name (KeyError if absent)."""
    with _lock:
        _ensure_loaded()
        del _registry[name]
        _changed()


def registered_backends() -> list[Backend]:
    """Every registered backend, highest priority first (ties by name)."""
    with _lock:
        _ensure_loaded()
        return sorted(_registry.values(), key=lambda b: (-b.priority, b.name))


def registry_generation() -> int:
    """A number that changes whenever a backend is registered, replaced or removed (the entry points' loading and
    :func:`reset_registry` included): a cache of selections keys on it instead of the backends' list."""
    with _lock:
        _ensure_loaded()
        return _generation


def _changed() -> None:
    """Callers hold the lock."""
    global _generation
    _generation += 1


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        KeyError: no such backend, with the registered names.
    """
    with _lock:
        _ensure_loaded()
        if name not in _registry:
            raise KeyError(f"no attention backend named {name!r}; registered: "
                           f"{', '.join(b.name for b in registered_backends())}")
        return _registry[name]


def reset_registry() -> None:
    """Back to the built-ins, entry points not yet loaded (for tests)."""
    global _entry_points_loaded
    with _lock:
        _registry.clear()
        _entry_points_loaded = False
        _changed()


def _ensure_loaded() -> None:
    """Register the built-ins and load the entry points, once (callers hold the lock)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    _changed()
    for cls in BUILTIN_BACKENDS:
        _registry.setdefault(cls.name, cls())
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _load_entry_point(ep)


def _load_entry_point(ep: Any) -> None:
    try:
        backend = _as_backend(ep.load(), f"entry point {ep.name} = {ep.value!r}")
    except Exception as exc:  # a broken plugin must not break jitattn, nor vanish: it becomes a refusal
        stub = EntryPointLoadError(ep.name, ep.value, f"{type(exc).__name__}: {exc}")
        logger.warning("%s", stub.message)
        _registry.setdefault(ep.name, stub)
        return
    if backend.name in _registry:
        logger.warning("entry point %s = %r (%s): a backend named %r is already registered; ignored",
                       ep.name, ep.value, ENTRY_POINT_GROUP, backend.name)
        return
    _registry[backend.name] = backend

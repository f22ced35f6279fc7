"""jitattn: a JIT kernel-specialisation compiler for attention.

Describe a variant with :class:`AttentionSpec`; jitattn renders CUDA templates with its functors,
compiles them with nvcc through ninja, caches the cubins on disk by content and launches them on
torch's current stream. Importing the package needs neither torch nor a GPU: the build path
(``jitattn warmup``) runs on a CPU box with nvcc.
"""

from jitattn._version import __version__
from jitattn.spec import AttentionSpec
from jitattn.trace import TraceError
from jitattn.variant import Param, Variant

__all__ = ["AttentionSpec", "Param", "Variant", "__version__", "paged_attention", "ragged_attention", "load_kernel",
           "plan", "plan_ragged", "run", "merge_state", "merge_state_in_place", "merge_states", "append_kv",
           "append_latent_kv", "TraceError",
           "MissingKernelError"]


# Submodules reachable as attributes (``jitattn.testing.random_paged_batch``) without importing them
# first; loaded on first use, so ``import jitattn`` stays light (and torch-free).
_SUBMODULES = frozenset({"append_kv_module", "archs", "backends", "bench", "build", "cache", "cache_admin", "checks", "cli", "commands",
                         "constants", "cuda_driver", "doctor", "dtypes", "integrations", "kv_write", "merge", "merge_module",
                         "models", "modules", "ops", "planning", "reference", "render", "runtime", "selector",
                         "settings", "spec", "testing", "trace", "variant"})


def __getattr__(name: str):
    value = _load_attribute(name)
    if name not in _SUBMODULES:  # kept: an engine calls jitattn.run per layer, and this lookup is not free
        globals()[name] = value
    return value


def _load_attribute(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"jitattn.{name}")
    # Torch-dependent entry points load lazily so a build box without torch can import jitattn.
    if name in ("paged_attention", "ragged_attention", "load_kernel", "plan", "plan_ragged", "run"):
        from jitattn import runtime

        return getattr(runtime, name)
    if name == "MissingKernelError":  # the cache (and its renderer) load only when asked for
        from jitattn.cache import MissingKernelError

        return MissingKernelError
    if name in ("merge_state", "merge_state_in_place", "merge_states"):
        from jitattn import merge

        return getattr(merge, name)
    if name in ("append_kv", "append_latent_kv"):
        from jitattn import kv_write

        return getattr(kv_write, name)
    raise AttributeError(f"module 'jitattn' has no attribute {name!r}")

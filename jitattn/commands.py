"""The ``jitattn`` command lines the library prints for a person to run.

The one place that spells them: the warm-up that fills a missing kernel (the cache's
:class:`~jitattn.cache.MissingKernelError`, ``jitattn select`` and ``jitattn doctor`` print it), and
the warm-up that builds what ``jitattn cache export`` or ``jitattn doctor`` found missing. Each is
the exact inverse of what the command line parses (``--spec`` takes a module's canonical JSON back).
The cache asks this module for the text; the command line itself (typer, :mod:`jitattn.cli`) is
never imported below it.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable, Sequence

from jitattn.modules import ATTENTION, KernelModule, kind_of


def warmup_command(module: KernelModule, arch: str) -> str:
    """The shell command that compiles ``(module, arch)`` into the cache."""
    return f"jitattn warmup --spec {shlex.quote(module.canonical_json())} --arch {arch}"


def _attention_model_flags(spec) -> list[str] | None:
    """The ``--model`` flags under which a model's layer specs can equal ``spec``, or None when no
    model config gives such a spec (jitattn.models makes causal, paged specs without a variant)."""
    if spec.variant is not None or spec.ragged or not spec.causal or spec.window_right >= 0 \
            or spec.o_dtype != spec.q_dtype:
        return None
    words = [f"--dtype {spec.q_dtype}"]
    if spec.kv_dtype != spec.q_dtype:
        words.append(f"--kv-dtype {spec.kv_dtype}")
    if spec.page_size != 16:
        words.append(f"--page-size {spec.page_size}")
    if spec.kv_layout != "NHD":
        words.append(f"--kv-layout {spec.kv_layout}")
    return words


#: Module kind -> the ``jitattn warmup --model`` flags that build a module of that kind (None: no
#: model builds it). A kind without a row gets only the exact ``--spec`` command.
MODEL_FLAGS: dict[str, Callable[[KernelModule], list[str] | None]] = {
    ATTENTION: _attention_model_flags,
    "merge_state": lambda module: [],  # every --model warm-up builds its output dtype's merge module
    "append_kv": lambda module: [f"--dtype {module.dtype}"] + (  # and the append_kv module of its K/V dtypes
        [f"--kv-dtype {module.kv_dtype}"] if module.kv_dtype != module.dtype else []),
}


def model_warmup_command(module: KernelModule, arch: str) -> str | None:
    """``jitattn warmup --model <config.json> ...`` with the flags under which a model's warm-up
    builds ``module``, or None when no model config gives it (a variant, ragged K/V: use
    :func:`warmup_command`)."""
    flags = MODEL_FLAGS.get(kind_of(module).name, lambda _: None)(module)
    if flags is None:
        return None
    return " ".join(["jitattn warmup --model <config.json>", *flags, f"--arch {arch}"])


def fill_hint(module: KernelModule, arch: str) -> str:
    """The lines of a missing kernel's error that say how to fill the cache."""
    model = model_warmup_command(module, arch)
    return (f"  fill it on a build box with:\n    {warmup_command(module, arch)}\n"
            + (f"  (or `{model}` for the whole model), " if model else "  ")
            + "then ship the cache.")


def models_warmup_command(models: Sequence[Path | str], specs: Sequence[str], archs: Sequence[str], *,
                          dtype: str | None = None, page_size: int = 16, kv_layout: str = "NHD",
                          kv_dtype: str | None = None, tensor_parallel_size: int = 1,
                          cascade: bool = False) -> str:
    """The ``jitattn warmup`` command that builds what the same model and spec arguments name."""
    words = ["jitattn", "warmup"]
    words += [w for m in models for w in ("--model", str(m))] + [w for s in specs for w in ("--spec", s)]
    words += [w for a in archs for w in ("--arch", a)]
    if dtype:
        words += ["--dtype", dtype]
    if page_size != 16:
        words += ["--page-size", str(page_size)]
    if kv_layout != "NHD":
        words += ["--kv-layout", kv_layout]
    if kv_dtype:
        words += ["--kv-dtype", kv_dtype]
    if tensor_parallel_size != 1:
        words += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if cascade:
        words += ["--cascade"]
    return " ".join(shlex.quote(w) for w in words)

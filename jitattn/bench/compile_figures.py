"""Compile figures: cold nvcc seconds, warm-load milliseconds in a fresh process, Flex's torch.compile seconds.

:func:`compile_figure` measures one spec into a fresh cache root (the timing that follows reuses
it); the warm load runs :mod:`jitattn.bench.warm_load` in a new interpreter with
``JITATTN_DISABLE_JIT=1``, so a cache miss fails instead of compiling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from jitattn.bench.anchors import flex_call, flex_problem
from jitattn.bench.cases import REPO, BenchCase, distinct_specs
from jitattn.bench.harness import Skip
from jitattn.bench.report import CompileFigure, one_line
from jitattn.reference import torch_dtype
from jitattn.spec import AttentionSpec

#: The phases whose Flex compile is measured (a mixed or cascade case compiles the prefill or decode form).
FLEX_PHASES = ("prefill", "decode")


def cold_compile(spec: AttentionSpec, arch: str, root: Path) -> tuple[float, float]:
    """``(wall s, manifest build_seconds)`` of compiling ``spec`` for ``arch`` into the cache at ``root``.

    Raises:
        RuntimeError: the kernel was already in ``root`` (the figure would not be cold).
        jitattn.build.CompileError / BuildError: nvcc failed or cannot run.
    """
    from jitattn.cache import KernelCache

    t0 = time.perf_counter()
    entry, built = KernelCache(root=root, layers=()).get_or_build(spec, arch)
    wall = time.perf_counter() - t0
    if not built:
        raise RuntimeError(f"{spec.name} for {arch} was already cached in {root}: not a cold compile")
    return wall, float(entry.manifest.get("build_seconds", math.nan))


def warm_load(spec: AttentionSpec, root: Path, *, timeout: float = 300) -> dict[str, float]:
    """Load ``spec``'s cached kernel in a fresh Python process (JITATTN_DISABLE_JIT=1: a miss fails).

    Returns ms: ``total_ms`` (process start to exit, measured outside), and from inside
    (:func:`jitattn.bench.warm_load.measure`) ``import_ms``, ``jitattn_import_ms``, ``cuda_init_ms``,
    ``load_ms`` and ``reload_ms``.

    Raises:
        RuntimeError: the process failed (its stderr's last line in the message).
    """
    env = {**os.environ, "JITATTN_CACHE_DIR": str(root), "JITATTN_DISABLE_JIT": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("JITATTN_CACHE_PATH", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jitattn.bench.warm_load", spec.canonical_json()],
                          capture_output=True, text=True, env=env, timeout=timeout)
    total = (time.perf_counter() - t0) * 1e3
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"warm load of {spec.name} exited {proc.returncode}: {tail}")
    return {"total_ms": total, **json.loads(proc.stdout.strip().splitlines()[-1])}


@contextlib.contextmanager
def _inductor_caches_off() -> Iterator[None]:
    """Inductor's on-disk caches disabled (a cold torch.compile), where this torch has the switch."""
    import torch._inductor.config as config
    if hasattr(config, "force_disable_caches"):
        with config.patch(force_disable_caches=True):
            yield
    else:
        yield


def flex_compile_seconds(spec: AttentionSpec, phase: str) -> float:
    """Seconds of the first call of torch.compile'd Flex for ``spec`` (compile + one small run).

    After ``torch._dynamo.reset()`` with inductor's caches off. Shapes: prefill 1 x (L q, L kv);
    decode 8 x (1 q, L kv), with L = 1024, or 256 keys past the window so the mask is compiled in
    too: compile time barely depends on the shapes.

    Raises:
        Skip: the spec has no Flex form (sinks, custom variant).
    """
    import torch._dynamo

    problem = flex_problem(spec)
    if problem:
        raise Skip(problem)
    kv_len = max(1024, -(-(spec.window_left + 257) // 128) * 128)
    b, n = (8, 1) if phase == "decode" else (1, kv_len)
    dt, d = torch_dtype(spec.q_dtype), spec.head_dim_qk
    q = torch.randn(b, spec.num_qo_heads, n, d, dtype=dt, device="cuda")
    k, v = (torch.randn(b, spec.num_kv_heads, kv_len, d, dtype=dt, device="cuda") for _ in range(2))
    torch._dynamo.reset()
    with _inductor_caches_off():
        t0 = time.perf_counter()
        flex_call(spec, q, k, v, kv_len - n)()
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def compile_figure(spec: AttentionSpec, phases: set[str], arch: str, root: Path, *, gpu: bool) -> CompileFigure:
    """Every compile figure of one spec; a failing step leaves nan and a note, never raises."""
    fig = CompileFigure(spec.name, arch, *([math.nan] * 6))
    notes = []
    try:
        fig.nvcc_s, fig.build_s = cold_compile(spec, arch, root)
    except Exception as exc:  # noqa: BLE001
        return _with_note(fig, [f"nvcc: {one_line(exc)}"])
    if not gpu:
        return _with_note(fig, ["no CUDA device: warm load and Flex not measured"])
    try:
        warm = warm_load(spec, root)
        fig.warm_total_ms, fig.warm_import_ms = warm["total_ms"], warm["import_ms"]
        fig.warm_cuda_init_ms, fig.warm_load_ms = warm["cuda_init_ms"], warm["load_ms"]
        fig.warm_jitattn_import_ms, fig.warm_reload_ms = warm["jitattn_import_ms"], warm["reload_ms"]
    except Exception as exc:  # noqa: BLE001
        notes.append(f"warm load: {one_line(exc)}")
    for phase in sorted(set(phases) & set(FLEX_PHASES)):
        try:
            setattr(fig, f"flex_{phase}_s", flex_compile_seconds(spec, phase))
        except Exception as exc:  # noqa: BLE001
            notes.append(f"flex {phase}: {one_line(exc, 100)}")
    return _with_note(fig, notes)


def _with_note(fig: CompileFigure, notes: list[str]) -> CompileFigure:
    fig.note = "; ".join(notes)
    return fig


def device_arch() -> str:
    """The best jitattn arch for the current CUDA device; ``sm_90a`` (the H200's) without one."""
    from jitattn.build import archs_for_capability

    if not torch.cuda.is_available():
        return "sm_90a"
    return archs_for_capability(*torch.cuda.get_device_capability())[0]


def run_compile_figures(cases: list[BenchCase], root: Path, log: Callable[[str], None]) -> list[CompileFigure]:
    """:func:`compile_figure` for every distinct spec of ``cases``, compiling into the fresh cache ``root``."""
    arch, gpu = device_arch(), torch.cuda.is_available()
    figures = []
    for spec, phases in distinct_specs(cases):
        figures.append(compile_figure(spec, phases, arch, root, gpu=gpu))
        log(f"compile {spec.name}: nvcc {figures[-1].nvcc_s:.1f} s, warm load {figures[-1].warm_load_ms:.1f} ms")
    return figures

"""examples/run_models.py runs (reference path only here: no GPU) and covers every layer kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_run_models():
    spec = importlib.util.spec_from_file_location("run_models", EXAMPLES / "run_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_models_without_gpu_runs_the_reference(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the kernels")
    run_models = load_run_models()
    monkeypatch.setattr(run_models, "STEPS", (("prefill", [20, 7], [40, 7]), ("decode", [1, 1], [50, 3])))
    assert run_models.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No GPU here (torch sees no CUDA device): running the reference path only")
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("gemma-2-9b", "gpt-oss-20b"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (m, k, s) for m in ("gemma-2-9b", "gpt-oss-20b") for k in ("sliding_attention", "full_attention")
        for s in ("prefill", "decode")]

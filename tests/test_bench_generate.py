"""The bench's generate case (issue 19) on the CPU: the catalogue, and the three ways on tiny shapes.

The models are the case's own (:func:`jitattn.bench.generate.small_config`: the config's heads, head
dims, scale, windows and soft-caps, 2 layers here) with a 24-token context, 2 decode steps and, for
Gemma-2, an 8-token window so that the steps cross it. On the CPU the integration runs its torch
backends (sdpa / reference): the timings mean nothing here, the rows, errors and marks do. The full
case runs on a GPU only (``test_generate_case_on_gpu``).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from jitattn.bench import cases, report
from jitattn.bench.cases import GenerateSetup
from jitattn.spec import AttentionSpec

transformers = pytest.importorskip("transformers")
from jitattn.bench import generate  # noqa: E402
import jitattn.integrations.transformers as jt  # noqa: E402

TINY = {"batch": 2, "context": 24, "layers": 2, "hidden_size": 64, "warmup": 0, "steps": 2}
WINDOW = {"llama-3-8b": None, "gemma-2-9b": 8}


def tiny(model: str) -> GenerateSetup:
    return GenerateSetup(model, window=WINDOW[model], **TINY)


def test_the_generate_cases_are_issue_19s():
    made = {c.name: c for c in cases.generate_cases()}
    assert list(made) == ["generate-llama-3-8b-b8x4096", "generate-gemma-2-9b-b8x4096"]
    assert set(made) <= {c.name for c in cases.all_cases()}
    llama, gemma = made.values()
    assert llama.generate == GenerateSetup("llama-3-8b") and (llama.generate.batch, llama.generate.context) == (8, 4096)
    assert llama.spec == AttentionSpec(32, 8, 128) and llama.phase == "generate"
    assert (gemma.spec.num_qo_heads, gemma.spec.num_kv_heads, gemma.spec.head_dim_qk) == (16, 8, 256)
    assert gemma.spec.logits_soft_cap == 50.0 and gemma.spec.window_left == 4095
    assert llama.describe().startswith("generate: attention us per decode step, llama-3-8b at 4 layers, 32 steps "
                                       "after 4, 8 x (1 q, 4096 kv)")
    assert report.case_json(gemma)["generate"] == {"model": "gemma-2-9b", "batch": 8, "context": 4096, "layers": 4,
                                                   "hidden_size": 512, "warmup": 4, "steps": 32, "window": None}
    config = generate.small_config(gemma.generate)  # the real attention, the rest shrunk
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 256)
    assert (config.attn_logit_softcapping, config.sliding_window, config.num_hidden_layers) == (50.0, 4096, 4)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("model", ["llama-3-8b", "gemma-2-9b"])
def test_two_decode_steps_each_way_on_cpu(model):
    case = cases.generate_case(tiny(model))
    rows = {r.impl: r for r in generate.run_generate_case(case, device="cpu")}
    assert list(rows) == ["jitattn", "jitattn-copying", "sdpa"]
    ran = ["jitattn", "jitattn-copying"] + (["sdpa"] if model == "llama-3-8b" else [])
    for impl in ran:
        r = rows[impl]
        assert r.status == "ok" and r.unit == report.STEP_UNIT, r
        assert r.rel_err < report.MAX_REL_ERR and r.ms > 0 and r.rate == pytest.approx(r.ms * 1e3)
        assert math.isnan(r.graph_ms) and "median of 2 steps" in r.note
    assert rows["jitattn"].note.startswith(f"{rows['jitattn'].ms / rows['jitattn-copying'].ms:.2f}x jitattn-copying "
                                           f"(target <= 0.5x: ")
    if model == "gemma-2-9b":  # torch SDPA has no soft-cap (some transformers releases drop it silently)
        assert rows["sdpa"].status == "skipped" and rows["sdpa"].note == (
            "torch SDPA has no soft-cap (attn_logit_softcapping=50): transformers' sdpa would drop it")
    else:
        assert "x sdpa (target < 1x: " in rows["jitattn"].note


def test_the_paged_row_appends_each_token_once_and_times_every_layer(monkeypatch):
    """The paged way: one append_kv per layer per step of the step's tokens, no copying packer; each
    step's marks cover every layer; the pages hold the context and the steps."""
    setup = tiny("llama-3-8b")
    config = generate.small_config(setup)
    model = generate.build_model(config, "jitattn", torch.bfloat16, "cpu")
    appended = []
    real = jt.append_kv
    monkeypatch.setattr(jt, "append_kv", lambda k, *a, **kw: (appended.append(k.shape[0]), real(k, *a, **kw))[1])
    for packer in ("_pack_dense", "_pack_padded", "_pages"):
        monkeypatch.setattr(jt, packer, lambda *a, **kw: pytest.fail("the paged cache's history was copied"))
    cache = generate.make_cache("paged", model, setup)
    prompt = torch.randint(3, generate.VOCAB, (2, 24))
    tokens = torch.randint(3, generate.VOCAB, (2, 2))
    logits, attn_ms, step_ms = generate.time_impl(model, "jitattn", cache, setup, prompt, tokens)
    assert logits.shape == (2, 2, generate.VOCAB) and logits.dtype == torch.float32
    assert appended == [2 * 24] * 2 + [2] * 4  # prefill, then 2 steps x 2 layers of one token per sequence
    assert cache.layers[1].seq_lens.tolist() == [26, 26]
    assert 0 < attn_ms < step_ms


def test_the_timing_wrapper_is_removed_afterwards():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    timer = generate.StepTimer(torch.device("cpu"))
    with generate.timed_attention("sdpa", timer):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_without_transformers_the_case_is_one_skipped_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` raises ImportError
    [row] = generate.run_generate_case(cases.generate_case(tiny("llama-3-8b")), device="cpu")
    assert (row.impl, row.status) == ("jitattn", "skipped") and row.note.startswith("transformers is not installed")


def test_step_rows_rank_the_lowest_time_best():
    unit = report.STEP_UNIT
    rows = [report.Result("g", "jitattn", 0.04, math.nan, 40.0, unit, 1e-3),
            report.Result("g", "jitattn-copying", 0.1, math.nan, 100.0, unit, 1e-3),
            report.Result("g", "sdpa", 0.05, math.nan, 50.0, unit, 1e-3)]
    assert report.best_anchor_rates(rows) == {"g": 50.0}
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in report.format_table(rows).splitlines()[2:]]
    table = {r[1]: r for r in cells}
    assert table["jitattn"][5] == "1.25x" and table["jitattn-copying"][5] == "0.50x"


@pytest.mark.gpu
def test_generate_case_on_gpu():
    """Both cases at their real shapes (fewer steps): every way runs and is right (sdpa skipped for Gemma-2)."""
    for case in cases.generate_cases():
        short = cases.generate_case(GenerateSetup(case.generate.model, warmup=2, steps=4))
        rows = {r.impl: r for r in generate.run_generate_case(short)}
        for impl, r in rows.items():
            if impl == "sdpa" and case.generate.model == "gemma-2-9b":
                assert r.status == "skipped", r
                continue
            assert r.status == "ok" and r.rel_err < report.MAX_REL_ERR and r.ms > 0, r

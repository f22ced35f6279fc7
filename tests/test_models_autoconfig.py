"""jitattn's reading of model configs against transformers' ``AutoConfig`` (``compare_with_transformers``).

Every config in ``examples/models`` and ``tests/models`` (the repository's copies of the real inputs,
so that a clean clone, CI's, compares them all: DeepSeek-V3's lies in tests/models) must read the same
both ways: heads, KV heads, head dim, softmax scale, soft-cap, which layers slide and by how much,
ALiBi, sinks, layer count and dtype. ``../shared/models`` (the real inputs, beside the repository),
when present, adds any config of its own that the repository has no identical copy of, and
:func:`test_every_shared_config_has_a_copy_in_the_repository` asks for that copy.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from jitattn import models
from jitattn.models import ConfigDifference, compare_with_transformers

pytest.importorskip("transformers", reason="the cross-check reads configs with transformers' AutoConfig")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
EXAMPLES = REPO / "examples" / "models"
#: The repository's real configs: the examples, and those the tests use but the examples leave out.
REPO_MODELS = (EXAMPLES, REPO / "tests" / "models")

#: Configs jitattn refuses on purpose, and why (the test expects the refusal, it does not skip them).
#: None today: DeepSeek-V3 (multi-head latent attention) is mapped and compared kind by kind.
REFUSED: dict[str, str] = {}


def repo_configs() -> list[Path]:
    return [p for d in REPO_MODELS for p in sorted(d.glob("*.json"))]


def _uncopied_shared() -> list[Path]:
    """The configs of ../shared/models (when present) that the repository has no identical copy of."""
    copies = {p.read_bytes() for p in repo_configs()}
    return [p for p in sorted(SHARED.glob("*.json")) if p.read_bytes() not in copies] if SHARED.is_dir() else []


def _configs() -> list:
    ours = [pytest.param(p, id=f"{p.parent.parent.name}/{p.stem}") for p in repo_configs()]
    return ours + [pytest.param(p, id=f"shared/{p.stem}") for p in _uncopied_shared()]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cross-check must never need the hub


@pytest.mark.parametrize("path", _configs())
def test_jitattn_and_autoconfig_agree(path: Path):
    if path.stem in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[path.stem]):
            compare_with_transformers(path)
        return
    differences = compare_with_transformers(path)
    assert differences == [], f"{path}:\n" + "\n".join(map(str, differences))


def test_the_examples_and_shared_configs_are_all_compared():
    """A config added to either folder joins the comparison; none is left out by name."""
    names = {p.stem for p in EXAMPLES.glob("*.json")}
    assert {"gemma-2-9b", "gemma-3-1b", "gpt-oss-20b", "bloom-560m"} <= names
    compared = {p.values[0] for p in _configs()}
    assert set(repo_configs()) <= compared and set(_uncopied_shared()) <= compared
    if SHARED.is_dir():
        assert names <= {p.stem for p in SHARED.glob("*.json")}, "every example also lies in shared/models"
        assert set(REFUSED) <= {p.stem for p in SHARED.glob("*.json")}


def test_a_clone_without_shared_compares_every_real_config(monkeypatch, tmp_path):
    """CI's clean clone has no ../shared: the repository's copies alone cover every model, DeepSeek-V3
    (multi-head latent attention, tests/models) included, and nothing is skipped."""
    monkeypatch.setitem(globals(), "SHARED", tmp_path / "absent")
    params = _configs()
    assert all(not p.marks for p in params)
    assert {"deepseek-v3", "llama-3-8b", "gemma-2-9b", "gpt-oss-20b", "bloom-560m"} <= \
        {p.values[0].stem for p in params}


def test_every_shared_config_has_a_copy_in_the_repository():
    """A config in ../shared/models without an identical copy in examples/models or tests/models would be
    compared here only, never in CI's clone: copy it into tests/models (examples/models holds the example
    models, which warmup, the bench and the kernel-compile tests also take)."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent")
    assert [p.name for p in _uncopied_shared()] == []


def test_a_file_its_directory_and_the_dict_compare_alike(tmp_path):
    src = EXAMPLES / "gemma-2-27b.json"
    (tmp_path / "config.json").write_text(src.read_text())
    assert compare_with_transformers(src) == []
    assert compare_with_transformers(tmp_path) == []
    assert compare_with_transformers(json.loads(src.read_text())) == []


def test_a_wrong_reading_is_reported_per_field_and_layer(monkeypatch):
    """The comparison can fail: a jitattn reading with one KV head too few and the sliding layers'
    window off by one is reported field by field, with the layers it concerns."""
    real = models.load_model_config

    def misread(config, **kwargs):
        model = real(config, **kwargs)
        kinds = tuple(replace(k, spec=k.spec.replace(num_kv_heads=4, window_left=k.spec.window_left + 1))
                      if k.name == models.SLIDING else k for k in model.layer_kinds)
        return replace(model, layer_kinds=kinds)

    monkeypatch.setattr(models, "load_model_config", misread)
    differences = compare_with_transformers(EXAMPLES / "gemma-2-9b.json")
    sliding = tuple(range(0, 42, 2))
    assert differences == [
        ConfigDifference("num_kv_heads", sliding, 4, 8, "num_key_value_heads"),
        ConfigDifference("window_left", sliding, 4096, 4095, "layer_types, sliding_window"),
    ]
    assert str(differences[1]).startswith("window_left (layers 0, 2, 4, 6, 8, 10, ... (21 layers)): jitattn reads "
                                          "4096, transformers 4095")


def test_a_model_type_transformers_does_not_know_is_a_clear_error():
    cfg = {"model_type": "not_a_model_type", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8}
    with pytest.raises(ValueError, match=r"not_a_model_type"):
        compare_with_transformers(cfg)

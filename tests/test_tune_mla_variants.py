"""tools/tune_mla_variants.py's variants stay runnable between GPU sessions: each one's edits find their text
once in today's mla_decode_sm90.cuh (prepare refuses otherwise), change only that header, and the
tiles-in-flight variant compiles for sm_90a without spilling."""

import hashlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import tune_mla_variants as tool  # noqa: E402


def test_every_variant_prepares_against_todays_templates(tmp_path):
    tool.prepare(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tool.VARIANTS)
    src = tool._render.template_dir()
    today = (src / tool.HEADER).read_text()
    assert (tmp_path / "base" / tool.HEADER).read_text() == today
    for name in tool.VARIANTS:
        for other in src.iterdir():
            if other.is_file() and other.name != tool.HEADER:
                assert (tmp_path / name / other.name).read_bytes() == other.read_bytes(), (name, other.name)
        if name != "base":
            assert (tmp_path / name / tool.HEADER).read_text() != today, name
    flight = (tmp_path / "tiles-in-flight" / tool.HEADER).read_text()
    # two tiles issued before the first wait, each waited for with the next one still in flight
    assert today.count("cp_async_wait<1>();") == 0 and flight.count("cp_async_wait<1>();") == 1
    assert flight.count("loader.load(p, stage(1), lo + T::kTileKeys, hi, bad);") == 1
    assert flight.count("loader.load(p, stage(it % 2), next, hi, bad);") == 1


def test_a_variant_with_text_that_is_gone_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(tool.VARIANTS, "stale", [("no such text in the header", "x")])
    with pytest.raises(SystemExit, match="variant stale: expected the text once"):
        tool.prepare(tmp_path)


def test_the_tiles_in_flight_variant_compiles_without_spilling(tmp_path, monkeypatch):
    from jitattn.cache import KernelCache

    tool.prepare(tmp_path / "variants")
    tp1 = next(c.spec for c in tool.cases().values() if c.spec.num_qo_heads == 128)
    monkeypatch.setattr(tool._render, "template_dir", lambda: tmp_path / "variants" / "tiles-in-flight")
    entry, built = KernelCache(root=tmp_path / "cache", layers=()).get_or_build(tp1, "sm_90a")
    log = entry.manifest["compiler_log"]
    variant = (tmp_path / "variants" / "tiles-in-flight" / tool.HEADER).read_bytes()
    assert hashlib.sha256(variant).hexdigest() in str(entry.manifest["key_inputs"])  # the variant's header was built
    assert built and re.search(r"Used \d+ registers", log), log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log

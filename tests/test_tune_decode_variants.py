"""tools/tune_decode_variants.py's variants stay runnable between GPU sessions: each one's template edits
find their text in today's templates (prepare asserts each once), and the "tail" variant (issue 21's padded
rows loaded with every thread busy) compiles its decode kernel without spills (nvcc, no GPU)."""

import re
import sys
from pathlib import Path

from jitattn.cache import KernelCache
from jitattn.spec import AttentionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import tune_decode_variants as tool  # noqa: E402


def test_every_variant_prepares_against_todays_templates(tmp_path):
    tool.prepare(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tool.VARIANTS)
    tail = (tmp_path / "tail" / "decode_mma.cuh").read_text()
    assert "decode_mma_load_padded_tile<S>(p, stage_k(s)" in tail and "kTailChunks = kKvChunks - kBodyChunks" in tail
    assert (tmp_path / "base" / "decode_mma.cuh").read_text() == (tool._render.template_dir() / "decode_mma.cuh").read_text()


def test_the_tail_variant_compiles_hd72_decode_without_spills(tmp_path, monkeypatch):
    tool.prepare(tmp_path / "variants", None)
    monkeypatch.setattr(tool._render, "template_dir", lambda: tmp_path / "variants" / "tail")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "cache"))
    entry, built = KernelCache().get_or_build(AttentionSpec(32, 8, 72), "sm_90a")
    log = entry.manifest.get("compiler_log", "")
    decode = re.search(r"Function properties for jitattn_decode\s*\n\s*(.*)\n", log)
    assert built and decode and "0 bytes spill stores" in decode.group(1), log[-2000:]

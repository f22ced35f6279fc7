"""tools/tune_decode_variants.py's variants stay runnable between GPU sessions: each one's template edits
find their text in today's templates (prepare asserts each once) and change what they say they change."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import tune_decode_variants as tool  # noqa: E402


def test_every_variant_prepares_against_todays_templates(tmp_path):
    tool.prepare(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tool.VARIANTS)
    today = (tool._render.template_dir() / "decode_mma.cuh").read_text()
    assert (tmp_path / "base" / "decode_mma.cuh").read_text() == today
    common = (tool._render.template_dir() / "common.cuh").read_text()
    plain = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;'
    assert plain in common
    for size in (128, 256):
        variant = (tmp_path / f"l2-{size}" / "common.cuh").read_text()
        assert plain not in variant and f'asm volatile("cp.async.cg.shared.global.L2::{size}B [%0], [%1], 16, %2;' in variant
        assert (tmp_path / f"l2-{size}" / "decode_mma.cuh").read_text() == today

"""tools/tune_decode_splits.py times what it says: each split count it sweeps is launched, on a recording kernel
(no GPU). Through the one-call form it timed one count for all: that form reuses the stream's last plan."""

import sys
from pathlib import Path

from jitattn import runtime
from jitattn.bench.cases import all_cases
from tests.test_plan_launches import fake_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import tune_decode_splits as tool  # noqa: E402


def test_the_sweep_launches_every_split_count(monkeypatch):
    made = {}

    def load(spec, device=None):
        if spec.canonical_text not in made:
            made[spec.canonical_text] = fake_kernel(spec)
        return made[spec.canonical_text][0]

    batch_on_cpu = tool.random_paged_batch
    monkeypatch.setattr(runtime, "load_kernel", load)
    monkeypatch.setattr(tool, "load_kernel", load)
    monkeypatch.setattr(tool, "random_paged_batch", lambda *a, device=None, **kw: batch_on_cpu(*a, device="cpu", **kw))
    monkeypatch.setattr(tool, "time_graph_ms", lambda call: (call(), 1.0)[1])
    monkeypatch.setattr(tool, "relative_error", lambda out, ref: 0.0)  # the recording kernel computes nothing
    case = next(c for c in all_cases() if c.name == "decode-hd128-b1x32768")
    rows = tool.sweep(case)
    module = made[case.spec.canonical_text][1]
    swept = [r["splits"] for r in rows]
    assert len(swept) > 5 and sum(r["rule"] for r in rows) == 1
    assert sorted({launch["grid"][0] for launch in module.launches}) == swept  # grid (splits, kv heads, batch)
    assert {launch["kernel"] for launch in module.launches} == {"decode"}

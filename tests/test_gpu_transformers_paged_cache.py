"""``PagedCache`` on a CUDA GPU (``pytest -m gpu``): greedy ``generate`` through the jit kernels.

The CPU test's models (tests/test_transformers_paged_cache.py: every config in examples/models and
../shared/models, 2 layers, the real attention, random weights, a left-padded batch) on the device:
``attn_implementation="jitattn"`` with a ``PagedCache`` (the jit backend reads the pages; new tokens
go in with the append_kv CUDA kernel) makes eager's tokens, or differs first at a bf16 near-tie
with the earlier logits within tolerance. Recorded per model: the first differing step per row and
the largest logit difference before it.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import selector

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

from tests.test_transformers_paged_cache import (CONFIGS, NEW, PROMPT, build_pair, compare, generate,  # noqa: E402
                                                 jt, padded_batch, small_config)

GPU_NEW = 64  # issue 19's length; the CPU test stops at NEW to stay fast


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_generate_matches_eager_on_device(name, session_cache, record, seed):
    eager, jit = build_pair(small_config(CONFIGS[name]), device="cuda", seed=seed)
    ids, mask = padded_batch(device="cuda", seed=seed)
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + GPU_NEW)
    ref = generate(eager, ids, mask, new_tokens=GPU_NEW)
    out = generate(jit, ids, mask, new_tokens=GPU_NEW, past_key_values=cache)
    first, worst = compare(ref, out, PROMPT)
    record(first_differing_step=first, new_tokens=GPU_NEW, max_logit_diff=round(worst, 4))
    assert cache.layers[0].kv_cache.is_cuda
    assert cache.layers[0].seq_lens.tolist()[0] == PROMPT + GPU_NEW - 1


def test_paged_decode_runs_the_jit_backend_and_the_append_kernel(session_cache, monkeypatch, seed):
    """The paged call is served by ``jit`` and append_kv takes its CUDA kernel (not the torch path)."""
    from jitattn import kv_write

    torch_path = []
    real = kv_write._append_torch
    monkeypatch.setattr(kv_write, "_append_torch", lambda *a, **k: (torch_path.append(1), real(*a, **k)))
    eager, jit = build_pair(small_config(CONFIGS["gemma-2-9b"]), device="cuda", seed=seed)
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(seed)).cuda()
    mask = torch.ones_like(ids)
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + NEW)
    compare(generate(eager, ids, mask), generate(jit, ids, mask, past_key_values=cache), PROMPT)
    assert not torch_path
    spec = jt.spec_from_json(jt._spec_text(16, 8, 256, torch.bfloat16, 256 ** -0.5, 50.0, 8, True, False))
    assert selector.select(spec, "cuda", "decode").name == "jit"

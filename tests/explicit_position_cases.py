"""Specs and batches for the explicit query position kernels (``AttentionSpec(query_positions="explicit")``):
tests/test_gpu_explicit_positions.py runs them against the reference, tests/test_explicit_positions_compile.py
compiles them for sm_80 and sm_90a.

Positions are drawn per token (not monotonic): anywhere in the key frame, a few small ones (rows that see
few keys), some at or past kv_len (queries after every key), and per case negative ones or ones past a
window (rows that see no key). The hook batch is random in [0, HOOK_BATCHES) and each sequence gets a
random position offset, so hooks that read batch or absolute positions show a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from jitattn import AttentionSpec, Param, Variant
from jitattn.variant import _cos, _sin, rotary_embedding

HOOK_BATCHES = 8
DOC_LEN = 20000


# ---- a variant whose four hooks all read batch and absolute positions ----------------------------
def _bias(score, batch, qo_head, qo_idx, kv_idx, params):
    return score + params.bias[batch] * ((qo_idx + kv_idx) % 7).float()


def _mask(batch, qo_head, qo_idx, kv_idx, params):
    return (params.doc[qo_idx] == params.doc[kv_idx]) | ((kv_idx + batch) % 3 == 0)


def _qrot(x, x_rot, batch, head, pos, dim, params):
    angle = (pos + batch).float() * 0.01 * ((dim % 4) + 1).float()
    return x * _cos(angle) + x_rot * _sin(angle)


def _out(out, batch, qo_head, qo_idx, dim, params):
    return out * (1.0 + 0.01 * (qo_idx % 5).float()) + params.bias[batch]


HOOKS = Variant("batch_position_hooks", logits_transform=_bias, logits_mask=_mask, query_transform=_qrot,
                output_transform=_out, params=(Param("bias", "float32", (HOOK_BATCHES,)), Param("doc", "int32", ("*",))))


def hook_params(device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    doc = torch.cumsum((torch.rand(DOC_LEN, generator=g) < 0.02).int(), 0).to(torch.int32)
    return {"bias": (0.3 * torch.randn(HOOK_BATCHES, generator=g)).to(device), "doc": doc.to(device)}


# ---- positions -----------------------------------------------------------------------------------
def scattered(kv_len: int, n: int, gen: torch.Generator, *, negative: bool = False, beyond: int = 40) -> list[int]:
    """n positions for one sequence: a mix of uniform in [0, kv_len + beyond), small ones (0..3), ones at
    or past kv_len, and (negative) a few below 0; in random order."""
    out = []
    for _ in range(n):
        kind = int(torch.randint(0, 10, (1,), generator=gen))
        if kind < 5:
            out.append(int(torch.randint(0, kv_len + beyond, (1,), generator=gen)))
        elif kind < 7:
            out.append(int(torch.randint(0, 4, (1,), generator=gen)))
        elif kind < 9 or not negative:
            out.append(kv_len + int(torch.randint(0, beyond, (1,), generator=gen)))
        else:
            out.append(-int(torch.randint(1, 50, (1,), generator=gen)))
    return out


def after_keys(kv_len: int, n: int, gen: torch.Generator, **_: Any) -> list[int]:
    """Every query past every key (a cascade's shared-prefix pass): P in [kv_len, kv_len + 4)."""
    return [kv_len + int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(n)]


def past_window(window_left: int) -> Callable[..., list[int]]:
    """scattered, plus every fourth query so far right that a causal window shows it no key."""
    def make(kv_len: int, n: int, gen: torch.Generator, **kw: Any) -> list[int]:
        pos = scattered(kv_len, n, gen, **kw)
        return [kv_len + window_left + 5 + i if i % 4 == 1 else p for i, p in enumerate(pos)]
    return make


@dataclass
class ExplicitCase:
    name: str
    spec: AttentionSpec
    q_lens: list[int]
    kv_lens: list[int]
    positions: Callable[..., list[int]] = scattered
    negative: bool = False
    offsets: bool = True  # random per-sequence position offsets (else 0)
    params: Callable[[str], dict[str, Any]] = field(default=lambda device: {})

    @property
    def id(self) -> str:
        return self.name

    def metadata(self, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query_positions, functor_batch, position_offset (int32, on device)."""
        gen = torch.Generator().manual_seed(seed)
        qp: list[int] = []
        for ql, kl in zip(self.q_lens, self.kv_lens):
            qp += self.positions(kl, ql, gen, negative=self.negative)
        fb = torch.randint(0, HOOK_BATCHES, (len(qp),), generator=gen)
        po = torch.randint(0, 1000, (len(self.q_lens),), generator=gen) if self.offsets \
            else torch.zeros(len(self.q_lens), dtype=torch.int64)
        as_int = lambda t: torch.as_tensor(t, dtype=torch.int32).to(device)  # noqa: E731
        return as_int(qp), as_int(fb), as_int(po)


E = {"query_positions": "explicit"}
# q_lens > kv_lens on some sequences (more queries than keys), one-query sequences (served by prefill too).
Q = [70, 5, 300, 1, 33]
KV = [1000, 3, 2000, 50, 700]


def explicit_cases() -> list[ExplicitCase]:
    fp8 = "float8_e4m3fn"
    return [
        ExplicitCase("causal-hd128", AttentionSpec(32, 8, 128, **E), Q, KV, negative=True),
        ExplicitCase("causal-hd128-page1", AttentionSpec(32, 8, 128, page_size=1, **E), Q, KV),
        ExplicitCase("noncausal-hd128-fp16", AttentionSpec(16, 16, 128, q_dtype="float16", causal=False, **E), Q, KV,
                     negative=True),
        ExplicitCase("cascade-prefix-64x4-8192", AttentionSpec(32, 8, 128, **E), [64], [8192], after_keys),
        ExplicitCase("cascade-prefix-3seq", AttentionSpec(32, 8, 128, **E), [64, 20, 7], [8192, 4096, 100], after_keys),
        ExplicitCase("window-crossing-hd64-page1", AttentionSpec(32, 8, 64, window_left=100, page_size=1, **E), Q, KV,
                     past_window(100), negative=True),
        ExplicitCase("window-lr-softcap-hd128", AttentionSpec(16, 4, 128, causal=False, window_left=50, window_right=30,
                                                              logits_soft_cap=30.0, **E), Q, KV),
        ExplicitCase("alibi-sinks-hd256", AttentionSpec(16, 8, 256, alibi=True, sinks=True, window_left=300, **E), Q, KV,
                     past_window(300)),
        ExplicitCase("softcap-window-hd256-gemma", AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=400, **E),
                     Q, KV),
        ExplicitCase("group6-tiles-mid-token", AttentionSpec(24, 4, 128, window_left=200, **E), Q, KV, past_window(200)),
        ExplicitCase("hd96-group4", AttentionSpec(8, 2, 96, **E), Q, KV),
        ExplicitCase("hooks-batch-positions", AttentionSpec(32, 8, 128, variant=HOOKS, **E), Q, KV,
                     params=hook_params),
        ExplicitCase("hooks-batch-positions-hd64-window", AttentionSpec(16, 4, 64, variant=HOOKS, window_left=64, **E),
                     Q, KV, past_window(64), params=hook_params),
        ExplicitCase("rope-qk-offset-hd64", AttentionSpec(16, 4, 64, variant=rotary_embedding(64), **E), Q, KV),
        ExplicitCase("rope-qk-offset-hd128-page1", AttentionSpec(32, 8, 128, variant=rotary_embedding(128),
                                                                 page_size=1, **E), Q, KV),
        # FP8 caches run prefill.cuh (mma.sync) on sm_90a too: the only way to the mma.sync path on the H200.
        ExplicitCase("fp8-causal-hd128", AttentionSpec(32, 8, 128, kv_dtype=fp8, **E), Q, KV, negative=True),
        ExplicitCase("fp8-cascade-prefix", AttentionSpec(32, 8, 128, kv_dtype=fp8, **E), [64, 9], [8192, 300],
                     after_keys),
        ExplicitCase("fp8-hd64-window-page1", AttentionSpec(32, 8, 64, kv_dtype=fp8, window_left=100, page_size=1, **E),
                     Q, KV, past_window(100)),
        ExplicitCase("fp8-alibi-sinks-hd256", AttentionSpec(16, 8, 256, kv_dtype=fp8, alibi=True, sinks=True, **E),
                     Q, KV),
        ExplicitCase("fp8-hooks-batch-positions", AttentionSpec(32, 8, 128, kv_dtype=fp8, variant=HOOKS, **E), Q, KV,
                     params=hook_params),
        ExplicitCase("fp8-rope-qk-offset-hd64", AttentionSpec(16, 4, 64, kv_dtype=fp8, variant=rotary_embedding(64),
                                                              **E), Q, KV),
        ExplicitCase("fp8-group6-softcap-window", AttentionSpec(24, 4, 128, kv_dtype=fp8, logits_soft_cap=30.0,
                                                                window_left=200, **E), Q, KV, past_window(200)),
        # FP8 rows of 8-byte chunks (hd 72 / 88): staged by 8-byte copies, widened into padded tiles
        ExplicitCase("fp8-hd72-hnd-page1", AttentionSpec(12, 3, 72, kv_dtype=fp8, kv_layout="HND", page_size=1, **E),
                     Q, KV, negative=True),
        ExplicitCase("fp8-hd88-cascade-prefix", AttentionSpec(32, 8, 88, kv_dtype=fp8, **E), [64, 9], [8192, 300],
                     after_keys),
    ]

"""The GPU test matrix: specs and batches the kernels are checked on against the reference.

Kept apart from the test functions so the session can compile every spec up front, in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from jitattn import AttentionSpec, Param, Variant
from jitattn.models import load_model_config
from jitattn.variant import (document_mask, prefix_lm_mask, relative_position_bias, rotary_embedding,
                             sigmoid_attention)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"

# ---- custom variants used by the tests (CUDA expression + the same functor in torch) -------------
REL_BIAS = Variant(
    name="rel_bias",
    logits_transform="logits + bias[qo_head] * fminf((float)(qo_idx - kv_idx), max_dist)",
    params=(Param("bias", "float32", ("num_qo_heads",)), Param("max_dist", "float32")),
    reference_transform=lambda s, b, h, qi, ki, p: s + p["bias"][h] * torch.clamp((qi - ki).float(), max=p["max_dist"]),
)
DOC_MASK = Variant(
    name="doc_mask",
    logits_mask="doc[qo_idx] == doc[kv_idx]",
    params=(Param("doc", "int32", ("*",)),),
    reference_mask=lambda b, h, qi, ki, p: p["doc"][qi] == p["doc"][ki],
)
HIDE_HEAD = Variant(  # every row of one head sees nothing: output 0, lse -inf (or the sink)
    name="hide_head",
    logits_mask="qo_head != hidden",
    params=(Param("hidden", "int32"),),
    reference_mask=lambda b, h, qi, ki, p: (h != p["hidden"]) & (qi >= 0) & (ki >= 0),
)


def _doc_params(device: str, n: int = 20000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    doc = torch.cumsum((torch.rand(n, generator=g) < 0.01).int(), 0).to(torch.int32)
    return {"doc": doc.to(device)}


@dataclass
class Case:
    """One spec and one batch (q_lens[b] queries against kv_lens[b] keys)."""

    name: str
    spec: AttentionSpec
    q_lens: list[int]
    kv_lens: list[int]
    params: Callable[[str], dict[str, Any]] = field(default=lambda device: {})

    @property
    def id(self) -> str:
        return self.name


MIXED_Q = [1, 1, 40, 1, 130, 7, 1]
MIXED_KV = [1, 300, 1000, 5000, 130, 4200, 17]


def model_cases() -> list[Case]:
    """Every layer kind of every example model config, on a mixed decode + prefill batch."""
    out = []
    for path in sorted(EXAMPLES.glob("*.json")):
        for kind in load_model_config(path).layer_kinds:
            out.append(Case(f"model-{path.stem}-{kind.name}", kind.spec, MIXED_Q, MIXED_KV))
    return out


def head_dim_cases() -> list[Case]:
    return [Case(f"hd{hd}", AttentionSpec(8, 2, hd), [1, 33, 1, 70], [200, 33, 1500, 900]) for hd in range(32, 257, 16)]


def sm90_head_dim_cases() -> list[Case]:
    """Head dims the wgmma prefill (prefill_sm90.cuh) serves with 64- and 32-byte swizzled tiles (not
    multiples of 64), on long causal prefills and with features whose code touches the tiles (query /
    key transforms in shared memory) or the page walk (HND, page 7), and 3-stage tiles at hd 224."""
    return [
        Case("sm90-hd96-causal-long", AttentionSpec(32, 32, 96), [1000, 17, 2048, 1], [1000, 8191, 4096, 300]),
        Case("sm90-hd96-fp16-hnd-page7-softcap-window", AttentionSpec(12, 4, 96, q_dtype="float16", kv_layout="HND",
                                                                     page_size=7, logits_soft_cap=30.0, window_left=200),
             [300, 1, 129], [2000, 5000, 129]),
        Case("sm90-hd80-alibi-sinks-noncausal", AttentionSpec(8, 8, 80, alibi=True, sinks=True, causal=False),
             [300, 1, 129], [2000, 5000, 129]),
        Case("sm90-hd160-rotary-qk", AttentionSpec(8, 2, 160, variant=rotary_embedding(160)), [300, 1, 129],
             [2000, 5000, 129]),
        Case("sm90-hd224-causal", AttentionSpec(8, 2, 224), [300, 1, 700], [2000, 5000, 700]),
    ]


def feature_cases() -> list[Case]:
    base = dict(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128)
    mk = lambda **kw: AttentionSpec(**{**base, **kw})  # noqa: E731
    q, kv = [1, 50, 1, 20, 3], [100, 50, 2049, 300, 3]
    return [
        Case("fp16-hnd-page1", mk(q_dtype="float16", kv_layout="HND", page_size=1), q, kv),
        Case("page64", mk(page_size=64), q, kv),
        Case("page7-hnd", mk(page_size=7, kv_layout="HND"), q, kv),
        Case("noncausal", mk(causal=False), q, kv),
        Case("noncausal-window-both", mk(causal=False, window_left=31, window_right=17), q, kv),
        Case("causal-window100", mk(window_left=100), q, kv),
        Case("softcap30-window64-hd256", mk(head_dim_qk=256, logits_soft_cap=30.0, window_left=64), q, kv),
        Case("alibi-12heads-fp16", AttentionSpec(12, 12, 64, q_dtype="float16", alibi=True), q, kv),
        Case("sinks-window", mk(num_qo_heads=16, head_dim_qk=64, sinks=True, window_left=127), q, kv),
        Case("group7", AttentionSpec(21, 3, 96), q, kv),
        Case("group1", AttentionSpec(8, 8, 80), q, kv),
        Case("group16", AttentionSpec(32, 2, 128), q, kv),
        Case("custom-transform", mk(variant=REL_BIAS), q, kv,
             lambda d: {"bias": torch.linspace(-0.2, 0.3, 8, device=d), "max_dist": 64.0}),
        Case("custom-mask-doc", mk(variant=DOC_MASK, causal=False), q, kv, lambda d: _doc_params(d)),
        Case("empty-rows-hidden-head", mk(variant=HIDE_HEAD), q, kv, lambda d: {"hidden": 3}),
        Case("empty-rows-hidden-head-sinks", mk(variant=HIDE_HEAD, sinks=True), q, kv, lambda d: {"hidden": 5}),
        Case("odd-lengths", mk(), [1, 15, 17, 127, 1, 1000], [1, 15, 17, 127, 8191, 1000]),
        Case("chunk-after-prefix", mk(window_left=255), [17, 127, 300], [1000, 8191, 300]),
        Case("zero-query-seqs", mk(), [0, 5, 0, 1], [10, 5, 3, 40]),
    ]


def decode_cases() -> list[Case]:
    spec = AttentionSpec(32, 8, 128)
    return [
        Case("decode-b1-32768-splitkv", spec, [1], [32768]),
        Case("decode-b3-splitkv", spec, [1, 1, 1], [8191, 17, 15]),
        Case("decode-b129", spec, [1] * 129, [(i * 97) % 3000 + 1 for i in range(129)]),
        Case("decode-gemma2-window", AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095,
                                                    sm_scale=256 ** -0.5), [1] * 4, [9000, 4096, 4097, 100]),
    ]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def variant_cases() -> list[Case]:
    """Python-traced variants (issue 4): each against its own Python definition run on torch."""
    q, kv = [1, 50, 1, 20, 3, 1], [100, 50, 2049, 300, 3, 9000]
    stride = max(kv)

    def doc_params(d):
        ids = torch.cumsum((torch.rand(len(kv) * stride, generator=_gen(3)) < 0.02).int(), 0).to(torch.int32)
        return {"doc": ids.to(d), "doc_stride": stride}

    def prefix_params(d):
        return {"prefix_len": torch.tensor([min(n, 37 * (i + 1)) for i, n in enumerate(kv)], dtype=torch.int32,
                                           device=d)}

    def t5_params(d, heads=8):
        return {"table": (torch.randn(32, heads, generator=_gen(5)) * 0.5).to(d)}

    base = dict(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128)
    mk = lambda **kw: AttentionSpec(**{**base, **kw})  # noqa: E731
    return [
        Case("traced-distance-bias", mk(variant=TRACED_DISTANCE), q, kv,
             lambda d: {"slope": torch.linspace(0.01, 0.2, 8, device=d)}),
        Case("traced-document-mask-causal", mk(variant=document_mask()), q, kv, doc_params),
        Case("traced-prefix-lm", mk(variant=prefix_lm_mask(), causal=False), q, kv, prefix_params),
        Case("traced-t5-bias-bidirectional", mk(variant=relative_position_bias(32, 128, True), causal=False), q, kv,
             t5_params),
        Case("traced-t5-bias-causal", mk(variant=relative_position_bias(32, 128, False)), q, kv, t5_params),
        Case("traced-sigmoid-attention", mk(variant=sigmoid_attention()), q, kv, lambda d: {"bias": -4.0}),
        Case("traced-sigmoid-decode-splitkv", mk(variant=sigmoid_attention()), [1, 1], [30000, 17],
             lambda d: {"bias": -6.0}),
        Case("traced-rotary-qk", mk(variant=rotary_embedding(128)), q, kv),
        Case("traced-rotary-qk-hd96-group7", AttentionSpec(21, 3, 96, variant=rotary_embedding(96)), q, kv),
        Case("traced-output-gate-sinks-splitkv", mk(variant=OUTPUT_GATE, sinks=True, window_left=3000), [1, 40, 1],
             [20000, 300, 5], lambda d: {"gate": torch.linspace(0.5, 2.0, 8, device=d)}),
    ]


def _distance_bias(score, batch, qo_head, qo_idx, kv_idx, params):
    return score - params.slope[qo_head] * torch.abs(qo_idx - kv_idx).float().sqrt()


def _output_gate(out, batch, qo_head, qo_idx, dim, params):
    return torch.where(dim % 2 == 0, out * params.gate[qo_head], out)


TRACED_DISTANCE = Variant("traced_distance", logits_transform=_distance_bias,
                          params=(Param("slope", "float32", ("num_qo_heads",)),))
OUTPUT_GATE = Variant("output_gate", output_transform=_output_gate,
                      params=(Param("gate", "float32", ("num_qo_heads",)),))


def _shift_key(x, x_rot, batch, kv_head, kv_idx, dim, params):
    return x + 0.5


# A key transform that is not linear in the key: over an FP8 cache it must see the dequantised key
# (k_scale applied first), as the reference does; folding k_scale into q instead would be wrong here.
SHIFT_KEY = Variant("shift_key", key_transform=_shift_key)


def fp8_cases() -> list[Case]:
    """FP8 (e4m3) KV cache with per-tensor scales: prefill widens tiles in shared memory, the
    tensor-core decode (groups 4..16) widens ldmatrix fragments in registers (the tile pipeline, the
    whole-window split-dims kernel with swizzled or padded rows, odd chunk counts: hd 80, 192 / 4
    warps), the CUDA-core decode (groups < 4, key transforms) dequantises in registers; rows of 8-byte
    chunks at hd 72 / 88 (tests/test_gpu_head_dims.py has the rest of those dims)."""
    q, kv = [1, 50, 1, 20, 3, 1], [100, 50, 2049, 300, 3, 9000]
    return [
        Case("fp8-kv-hd128", AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn"), q, kv),
        Case("fp8-kv-gpt-oss-sliding-hnd", AttentionSpec(64, 8, 64, kv_dtype="float8_e4m3fn", sinks=True,
                                                         window_left=127, kv_layout="HND"), q, kv),
        Case("fp8-kv-hd256-fp16-softcap-rotary", AttentionSpec(16, 8, 256, q_dtype="float16", kv_dtype="float8_e4m3fn",
                                                               logits_soft_cap=50.0, variant=rotary_embedding(256)), q, kv),
        Case("fp8-kv-decode-b1-32768", AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn"), [1], [32768]),
        Case("fp8-kv-hd256-group16-page1-softcap", AttentionSpec(32, 2, 256, kv_dtype="float8_e4m3fn", page_size=1,
                                                                 logits_soft_cap=30.0, window_left=1000), q, kv),
        Case("fp8-kv-whole-window-hd128-group8-sinks", AttentionSpec(64, 8, 128, kv_dtype="float8_e4m3fn", sinks=True,
                                                                     window_left=127), q, kv),
        Case("fp8-kv-fp16-group6-hd80-alibi-page64-hnd",
             AttentionSpec(24, 4, 80, q_dtype="float16", kv_dtype="float8_e4m3fn", alibi=True, page_size=64,
                           kv_layout="HND"), q, kv),
        Case("fp8-kv-whole-window-group12-hd192-softcap",
             AttentionSpec(24, 2, 192, kv_dtype="float8_e4m3fn", window_left=100, logits_soft_cap=30.0), q, kv),
        Case("fp8-kv-hnd-page64-group8-fp16", AttentionSpec(64, 8, 128, q_dtype="float16", kv_dtype="float8_e4m3fn",
                                                            kv_layout="HND", page_size=64), q, kv),
        Case("fp8-kv-hd72-group4-hnd-page1", AttentionSpec(12, 3, 72, kv_dtype="float8_e4m3fn", kv_layout="HND",
                                                           page_size=1), q, kv),
        Case("fp8-kv-hd80-group2-rotary", AttentionSpec(8, 4, 80, kv_dtype="float8_e4m3fn", variant=rotary_embedding(80)),
             q, kv),
        Case("fp8-kv-group2-shift-key", AttentionSpec(8, 4, 64, kv_dtype="float8_e4m3fn", variant=SHIFT_KEY), q, kv),
        Case("fp8-kv-hd88-group2-softcap", AttentionSpec(8, 4, 88, kv_dtype="float8_e4m3fn", logits_soft_cap=30.0), q, kv),
    ]


def whole_window_cases() -> list[Case]:
    """The tensor-core decode's whole-window mode with the head dims split over the warps
    (decode_mma.cuh, kSplitDims) beyond gpt-oss: a group of 16 (fragment rows 8..15 used), of 12
    (rows 12..15 padding), an output transform with sinks, fp16, HND, page 7, hd 192, no softmax."""
    q, kv = [1, 50, 1, 20, 3, 1, 1], [100, 50, 2049, 300, 3, 9000, 151]
    return [
        Case("whole-window-group16-fp16-hnd-page7-output-gate-sinks",
             AttentionSpec(32, 2, 128, q_dtype="float16", kv_layout="HND", page_size=7, window_left=150, sinks=True,
                           variant=OUTPUT_GATE), q, kv,
             lambda d: {"gate": torch.linspace(0.5, 2.0, 32, device=d)}),
        Case("whole-window-group12-hd192-sigmoid", AttentionSpec(24, 2, 192, window_left=100,
                                                                 variant=sigmoid_attention()), q, kv,
             lambda d: {"bias": -4.0}),
    ]


def all_cases() -> list[Case]:
    return (model_cases() + head_dim_cases() + sm90_head_dim_cases() + feature_cases() + decode_cases() + variant_cases() + fp8_cases() +
            whole_window_cases())


# ---- ragged (contiguous varlen) K/V: tests/test_gpu_ragged.py -------------------------------------
@dataclass
class RaggedCase(Case):
    """A ragged spec and batch; ``strided``: q, k, v as padded views (random_ragged_batch)."""

    strided: bool = False


def ragged_cases() -> list[RaggedCase]:
    """Ragged specs (kv_storage="ragged") on batches that mix one-query rows, short chunks after long
    prefixes and full prefills; lengths 1, 17, 127, 1000, 8191; head_dim_qk != head_dim_vo; GQA 1/4/8."""
    R = "ragged"
    mk = lambda *a, **kw: AttentionSpec(*a, kv_storage=R, **kw)  # noqa: E731
    lens = [1, 17, 127, 1000, 8191]
    q, kv = [1, 40, 17, 1, 127, 5], [1, 1000, 17, 8191, 300, 5]  # mixed: decode rows, chunks, full prefills
    return [
        RaggedCase("ragged-hd128-gqa4-full-prefill", mk(8, 2, 128), lens, lens),
        RaggedCase("ragged-hd128-gqa4-chunk-after-prefix", mk(8, 2, 128), [1, 17, 127, 300, 1], [1000, 8191, 127, 4000, 17]),
        RaggedCase("ragged-mla-192x128-gqa1", mk(16, 16, 192, 128), [1, 17, 127, 1000], [1, 17, 1000, 1000], strided=True),
        RaggedCase("ragged-192x128-gqa8-chunks", mk(16, 2, 192, 128, logits_soft_cap=30.0), q, kv),
        RaggedCase("ragged-hd64-softcap-window-gqa1", mk(8, 8, 64, logits_soft_cap=30.0, window_left=63), q, kv),
        RaggedCase("ragged-hd96-noncausal-window-both-alibi", mk(12, 3, 96, causal=False, window_left=31, window_right=17,
                                                                  alibi=True), q, kv),
        RaggedCase("ragged-sinks-window-gqa8-strided", mk(64, 8, 64, sinks=True, window_left=127), q, kv, strided=True),
        RaggedCase("ragged-fp16-256x64-group2", mk(8, 4, 256, 64, q_dtype="float16"), q, kv),
        RaggedCase("ragged-32x256-noncausal", mk(4, 4, 32, 256, causal=False), q, kv),
        # The pairs whose producer spilled at 40 registers (tests/test_ragged.py SPILLING_MIXED_DIMS): 56 / 224.
        RaggedCase("ragged-64x128-wide-producer", mk(8, 2, 64, 128), [1, 17, 127, 1000], [1, 17, 1000, 1000]),
        RaggedCase("ragged-48x80-wide-producer", mk(8, 2, 48, 80, window_left=255), q, kv),
        RaggedCase("ragged-custom-transform", mk(8, 2, 128, variant=REL_BIAS), q, kv,
                   lambda d: {"bias": torch.linspace(-0.2, 0.3, 8, device=d), "max_dist": 64.0}),
        RaggedCase("ragged-custom-mask-doc", mk(8, 2, 128, variant=DOC_MASK, causal=False), q, kv, lambda d: _doc_params(d)),
        RaggedCase("ragged-rotary-qk-192x128", mk(8, 2, 192, 128, variant=rotary_embedding(192)), q, kv),
        RaggedCase("ragged-output-gate-sinks-192x128", mk(8, 2, 192, 128, variant=OUTPUT_GATE, sinks=True), q, kv,
                   lambda d: {"gate": torch.linspace(0.5, 2.0, 8, device=d)}),
        RaggedCase("ragged-sigmoid-no-softmax", mk(8, 2, 128, variant=sigmoid_attention()), q, kv,
                   lambda d: {"bias": -6.0}),
        RaggedCase("ragged-hidden-head-empty-rows", mk(8, 2, 128, variant=HIDE_HEAD), q, kv, lambda d: {"hidden": 3}),
        RaggedCase("ragged-zero-query-seqs", mk(8, 2, 128), [0, 5, 0, 1], [10, 5, 3, 40]),
    ]

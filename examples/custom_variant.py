"""A new attention variant in ~15 lines: one Python function is the CUDA functor and the reference."""
import torch

import jitattn
from jitattn import AttentionSpec, Param, Variant
from jitattn.testing import random_paged_batch, relative_error


def log_distance_bias(score, batch, qo_head, qo_idx, kv_idx, params):  # FlexAttention-style score_mod
    return score - params.slope[qo_head] * torch.log1p((qo_idx - kv_idx).float())


variant = Variant("log_distance", logits_transform=log_distance_bias, params=(Param("slope", "float32", ("num_qo_heads",)),))
spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, variant=variant)
device = "cuda" if torch.cuda.is_available() else "cpu"
batch = random_paged_batch(spec, q_lens=[1, 300], kv_lens=[2000, 300], device=device,
                           params={"slope": torch.rand(32, device=device) * 0.1})
ref = jitattn.reference.paged_attention(spec, *batch.args(), **batch.kwargs())
if device == "cuda":  # traced once, compiled by nvcc, cached on disk: a new process loads it without compiling
    out = jitattn.paged_attention(spec, *batch.args(), **batch.kwargs())
    print(f"jitattn {spec.name} vs its Python definition (reference): relative error {relative_error(out, ref):.2e}")
else:
    print(f"no GPU here: ran the reference path only (the same Python function), output {tuple(ref.shape)}")

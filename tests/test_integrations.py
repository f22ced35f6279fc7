"""The custom op on the CPU (reference / sdpa backends): routing, schema, torch.compile, parameters.

On the CPU the op routes to the reference, so its output equals the reference's bit for bit: those
checks test the routing. Each of them also compares the op with an oracle written independently of
the reference (tests/oracles.py). The transformers integration: tests/test_transformers_integration.py;
the device version of both: tests/test_gpu_integrations.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.library import opcheck

from jitattn import AttentionSpec, reference, selector
from jitattn.ops import paged_attention, register_spec, spec_from_json
from jitattn.testing import random_paged_batch, relative_error
from tests import oracles
from tests.gpu_cases import REL_BIAS

GEMMA2_LIKE = AttentionSpec(8, 2, 64, window_left=20, logits_soft_cap=30.0)
Q_LENS, KV_LENS = [1, 17, 1, 5], [40, 17, 100, 60]


# ---- the custom op ---------------------------------------------------------------------------------------
def _close_to_oracle(out, lse, spec, batch, pieces=None):
    """The op's output and lse against the independent dense oracle (bf16 output rounding)."""
    want, want_lse = oracles.attention(spec, batch, pieces or oracles.Pieces())
    assert relative_error(out, want) < 4e-3
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse.double()[finite] - want_lse[finite]).abs().max() < 1e-4


def test_op_routes_to_the_reference_on_cpu_and_matches_the_oracle():
    batch = random_paged_batch(GEMMA2_LIKE, Q_LENS, KV_LENS)
    out, lse = paged_attention(GEMMA2_LIKE, *batch.args(), return_lse=True)
    ref_out, ref_lse = reference.paged_attention(GEMMA2_LIKE, *batch.args(), return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)  # routed to the reference
    assert selector.select(GEMMA2_LIKE, "cpu", need_lse=True).name == "reference"
    _close_to_oracle(out, lse, GEMMA2_LIKE, batch)  # soft-cap and window, written again


def test_op_schema_and_fake_implementation():
    batch = random_paged_batch(GEMMA2_LIKE, Q_LENS, KV_LENS)
    text = register_spec(GEMMA2_LIKE)
    for return_lse in (True, False):
        args = (*batch.args(), text, "reference", None, None, [], [], return_lse, -1)
        opcheck(torch.ops.jitattn.paged_attention.default, args, test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in batch.args()]
        out, lse = torch.ops.jitattn.paged_attention(*fake, text, "reference", None, None, [], [], True, -1)
    assert out.shape == (sum(Q_LENS), 8, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (sum(Q_LENS), 8) and lse.dtype == torch.float32


def test_op_compiles_without_graph_breaks():
    batch = random_paged_batch(GEMMA2_LIKE, Q_LENS, KV_LENS)

    def layer(q, kv_cache, block_table, seq_lens, qsl):
        return paged_attention(GEMMA2_LIKE, q * 2, kv_cache, block_table, seq_lens, qsl).float().sum(-1)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*batch.args()), layer(*batch.args()))



def test_op_compiles_with_a_max_query_len_that_varies():
    """A max_query_len that changes between calls becomes a SymInt under torch.compile: its check must
    trace without a graph break (check_max_query_len once called hasattr, which dynamo refuses)."""
    spec = AttentionSpec(8, 2, 64)
    compiled = torch.compile(lambda m, *a: paged_attention(spec, *a, max_query_len=m), fullgraph=True,
                             backend="aot_eager")
    for q_lens, m in (([1, 1, 1], 1), ([3, 1, 2], 3), ([3, 1, 2], 4)):
        batch = random_paged_batch(spec, q_lens, [20, 30, 40])
        torch.testing.assert_close(compiled(m, *batch.args()), reference.paged_attention(spec, *batch.args()))

def _rel_bias_pieces(bias: torch.Tensor, max_dist: float) -> oracles.Pieces:
    """REL_BIAS written again: ``bias[h] * min(p - j, max_dist)`` for query position p, key j."""
    def rows(b, qo_pos, kv_len):
        return torch.tensor([[[bias[h].item() * min(p - j, max_dist) for j in range(kv_len)] for p in qo_pos]
                             for h in range(len(bias))], dtype=torch.float64)
    return oracles.Pieces(bias=rows)


def test_op_carries_variant_params_and_torch_functors():
    spec = AttentionSpec(8, 2, 64, variant=REL_BIAS)
    params = {"bias": torch.linspace(-0.2, 0.3, 8), "max_dist": 16.0}
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, params=params)

    def layer(q, kv_cache, block_table, seq_lens, qsl, bias):
        return paged_attention(spec, q, kv_cache, block_table, seq_lens, qsl, params={"bias": bias, "max_dist": 16.0},
                               return_lse=True)

    out, lse = torch.compile(layer, fullgraph=True, backend="aot_eager")(*batch.args(), params["bias"])
    ref_out, ref_lse = reference.paged_attention(spec, *batch.args(), params=params, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)  # routed to the reference
    _close_to_oracle(out, lse, spec, batch, _rel_bias_pieces(params["bias"], 16.0))
    assert spec_from_json(spec.canonical_json()).variant.reference_transform is REL_BIAS.reference_transform
    with pytest.raises(ValueError, match=r"params: missing \['max_dist'\]"):
        paged_attention(spec, *batch.args(), params={"bias": params["bias"]})


def test_op_fp8_kv_cache_through_the_reference():
    spec = AttentionSpec(8, 2, 64, kv_dtype="float8_e4m3fn", window_left=10)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS)
    assert batch.kv_cache.dtype == torch.float8_e4m3fn and batch.kwargs()["k_scale"] != 1.0
    compiled = torch.compile(lambda *a, **kw: paged_attention(spec, *a, **kw), fullgraph=True, backend="aot_eager")
    out = compiled(*batch.args(), k_scale=batch.kwargs()["k_scale"], v_scale=batch.kwargs()["v_scale"])
    assert torch.equal(out, reference.paged_attention(spec, *batch.args(), **batch.kwargs()))  # routed
    assert relative_error(out, oracles.attention(spec, batch, oracles.Pieces())[0]) < 4e-3  # scales applied
    assert [selector.select(spec, d).name for d in ("cpu", "h100")] == ["reference", "jit"]


def test_op_with_forced_backend_name():
    spec = AttentionSpec(8, 2, 64)
    batch = random_paged_batch(spec, Q_LENS, KV_LENS)
    ref = reference.paged_attention(spec, *batch.args())
    assert relative_error(paged_attention(spec, *batch.args(), backend="sdpa"), ref) < 1e-2
    with pytest.raises(ValueError, match="backend='nope': no attention backend named 'nope'"):
        paged_attention(spec, *batch.args(), backend="nope")


@pytest.mark.parametrize("spec, backend, reason", [
    (AttentionSpec(8, 2, 64, logits_soft_cap=5.0), "sdpa", "sdpa: logits_soft_cap=5 not supported"),
    (AttentionSpec(8, 2, 64, window_left=3), "sdpa", "sdpa: sliding window (window_left=3) not supported"),
    (AttentionSpec(8, 2, 64, q_dtype="float16", kv_dtype="float8_e4m3fn"), "flex",
     "flex: kv_dtype=float8_e4m3fn not supported"),
])
def test_op_refuses_a_named_backend_that_cannot_serve_the_spec(spec, backend, reason):
    """A backend named in the call was built without asking whether it serves the spec: sdpa dropped
    the soft-cap and the window, flex the FP8 scales, and the op returned their wrong answers (max abs errors
    of 0.18, 2.4 and 350 against the reference on these batches). Now it is checked like a forced backend."""
    batch = random_paged_batch(spec, Q_LENS, KV_LENS)
    with pytest.raises(selector.NoBackendError, match=rf"(?s)^backend={backend} cannot serve .*{re.escape(reason)}"):
        paged_attention(spec, *batch.args(), backend=backend, **batch.scales)
    assert relative_error(paged_attention(spec, *batch.args(), backend="reference", **batch.scales),
                          reference.paged_attention(spec, *batch.args(), **batch.scales)) == 0

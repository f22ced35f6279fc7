// jitattn: how a spec's features and the user's functors act on one (query, key) logit.
//
// `S` is the rendered spec struct (see attention.cu.j2): compile-time constants plus the user's
// logits_transform / logits_mask as static device functions. Order (documented in
// jitattn/variant.py): scale -> soft-cap -> ALiBi -> logits_transform -> masks.
#pragma once

#include "common.cuh"

namespace jitattn {

// The factor folded into q once, when it is loaded. When no transform needs the logit in natural
// units, log2(e) is folded in too and the per-element work is nothing but masking.
template <class S>
__device__ __forceinline__ constexpr float q_prescale() {
  return S::kLogitsNatural ? S::kSmScale : S::kSmScale * kLog2e;
}

// `s` is dot(q * q_prescale, k). Returns the logit in log2 units (softmax) or the weight itself
// (a variant without softmax); not yet masked. `oob` collects out-of-range parameter reads.
template <class S>
__device__ __forceinline__ float transform_logit(const Params& p, float s, int batch, int qo_head, int kv_head,
                                                 int qo_idx, int kv_idx, int qo_len, int kv_len, bool& oob) {
  if constexpr (!S::kLogitsNatural) {
    return s;
  } else {
    if constexpr (S::kHasTransform)
      s = S::logits_transform(p, s, batch, qo_head, kv_head, qo_idx, kv_idx, qo_len, kv_len, oob);
    return S::kSoftmax ? s * kLog2e : s;
  }
}

// Causal and window bounds of one pair (positions are absolute within the sequence).
template <class S>
__device__ __forceinline__ bool structurally_visible(int qo_idx, int kv_idx) {
  return S::structural_mask(qo_idx, kv_idx);
}

template <class S>
__device__ __forceinline__ bool custom_visible(const Params& p, int batch, int qo_head, int kv_head, int qo_idx,
                                               int kv_idx, int qo_len, int kv_len, bool& oob) {
  if constexpr (S::kHasMask) {
    return S::logits_mask(p, batch, qo_head, kv_head, qo_idx, kv_idx, qo_len, kv_len, oob);
  } else {
    return true;
  }
}

// The element that rotate_half puts at `dim` of a head_dim-D vector, given the element D/2 away.
__device__ __forceinline__ float rotate_half_value(int dim, int head_dim, float partner) {
  return dim < head_dim / 2 ? -partner : partner;
}

// Key range [begin, end) that can be visible to queries at positions [qo_lo, qo_hi] of a sequence
// with kv_len keys: whole tiles outside it are never loaded.
template <class S>
__device__ __forceinline__ void visible_kv_range(int qo_lo, int qo_hi, int kv_len, int& begin, int& end) {
  begin = 0;
  end = kv_len;
  if constexpr (S::kWindowLeft >= 0) begin = max(0, qo_lo - S::kWindowLeft);
  if constexpr (S::kCausal) end = min(end, qo_hi + 1);
  if constexpr (S::kWindowRight >= 0) end = min(end, qo_hi + S::kWindowRight + 1);
}

// Folds the sink logit (natural units) into a finished state and returns the factor that turns the
// un-normalised accumulator into the output (0 for a row that saw nothing), and the lse (natural log;
// -inf for an empty row). Sinks join the denominator only (gpt-oss).
template <class S>
__device__ __forceinline__ float finalize_state(const Params& p, int qo_head, SoftmaxState st, float& lse) {
  float m = st.m, d = st.d;
  if constexpr (!S::kSoftmax) {  // a weighted sum: nothing to normalise, no lse
    lse = quiet_nan();
    return 1.0f;
  } else if constexpr (S::kHasSinks) {
    const float sink = p.sinks[qo_head] * kLog2e;
    const float m_new = fmaxf(m, sink);
    if (m_new == kNegInf) {  // no key and a -inf sink (no sink): nothing to normalise (exp2(-inf + inf) is NaN)
      lse = kNegInf;
      return 0.f;
    }
    d = d * rescale_factor(m, m_new) + fast_exp2(sink - m_new);
    const float out_scale = rescale_factor(m, m_new) / d;
    m = m_new;
    lse = (m + __log2f(d)) * kLn2;
    return out_scale;
  } else {
    if (d == 0.f) {
      lse = kNegInf;
      return 0.f;
    }
    lse = (m + __log2f(d)) * kLn2;
    return 1.0f / d;
  }
}

}  // namespace jitattn

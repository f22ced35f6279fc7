// jitattn: the online softmax (Milakov & Gimelshein 2018; Dao 2023, FlashAttention-2, sec. 3.1), in
// base 2: a row's running max m of the log2-scaled logits and running sum d of exp2(s - m); each tile
// of scores raises m, rescales d and the output accumulator by exp2(m_old - m_new), and becomes the
// unnormalised weights exp2(s - m). Merging two states is exact; a state that has seen no key has
// m = -inf, d = 0. Sinks join the denominator only, at the end (finalize_state).
#pragma once

#include "common.cuh"

namespace jitattn {

// Deferred rescaling's threshold (log2 units): see softmax_update_deferred.
constexpr float kRescaleThreshold = 8.0f;

struct SoftmaxState {
  float m;
  float d;
};

// exp2(m_old - m_new) guarded so that (-inf) - (-inf) never makes a NaN.
__device__ __forceinline__ float rescale_factor(float m_old, float m_new) {
  return m_old == kNegInf ? 0.f : fast_exp2(m_old - m_new);
}

// A row's state before any key; without softmax (a weighted sum) m stays 0 and d is unused.
template <class S>
__device__ __forceinline__ SoftmaxState softmax_initial() {
  return SoftmaxState{S::kSoftmax ? kNegInf : 0.f, 0.f};
}

// What a masked-out score becomes: a weight of exp2(-inf) = 0, or 0 itself without softmax.
template <class S>
__device__ __forceinline__ constexpr float masked_score() {
  return S::kSoftmax ? kNegInf : 0.f;
}

struct SoftmaxStep {
  float alpha;  // the factor the row's output accumulator is rescaled by
  float m_use;  // the max the weights exp2(s - m_use) are taken against (0 while no key was seen)
};
// One tile of a row, exact max: `tile_max` is the max over the row's new scores (already reduced over
// the lanes that share the row). Raises m, scales d; the caller rescales its output accumulator by
// alpha and turns each score s into the weight exp2(s - m_use), adding it to d.
__device__ __forceinline__ SoftmaxStep softmax_step(SoftmaxState& st, float tile_max) {
  const float m_new = fmaxf(st.m, tile_max);
  const float m_use = m_new == kNegInf ? 0.f : m_new;
  const float alpha = rescale_factor(st.m, m_use);
  st.m = m_new;
  st.d *= alpha;
  return SoftmaxStep{alpha, m_use};
}

// One tile of a row with deferred rescaling, the weights made in place: score(n, e) for n < kN, e < kE
// are this thread's scores of the row, rescale_o(alpha) rescales its output accumulator. The reference
// max, and with it the output's scale, moves only when the tile's max exceeds it by more than
// kRescaleThreshold, so most tiles skip the rescale and weights stay below 2^kRescaleThreshold
// (FlashAttention-4 does the same). `raise` is that test, `tile_max > st.m + kRescaleThreshold`, written
// at the call: computed inside a function, it changes how nvcc lays out the branch in every prefill
// kernel. (prefill_sm90's overlapped loop writes the step in its own form: four sum chains, the
// scale folded into exp2, the rescale deferred past the running P V MMAs.)
template <int kN, int kE, class Score, class RescaleO>
__device__ __forceinline__ void softmax_update_deferred(SoftmaxState& st, float tile_max, bool raise, Score score,
                                                        RescaleO rescale_o) {
  if (raise) {
    const float alpha = rescale_factor(st.m, tile_max);
    st.m = tile_max;
    st.d *= alpha;
    rescale_o(alpha);
  }
  const float m_use = st.m == kNegInf ? 0.f : st.m;
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      float& x = score(n, e);
      const float pe = fast_exp2(x - m_use);
      x = pe;
      st.d += pe;  // this thread's share of the row sum; the lanes of the row are summed at the end
    }
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

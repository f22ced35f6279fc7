// jitattn: how a spec's features and the user's functors act on one (query, key) logit.
//
// `S` is the rendered spec struct (see attention.cu.j2): compile-time constants plus the user's
// logits_transform / logits_mask as static device functions. Order (documented in
// jitattn/variant.py): scale -> soft-cap -> ALiBi -> logits_transform -> masks.
#pragma once

#include "common.cuh"
#include "softmax.cuh"
#include "visibility.cuh"

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

template <class S>
__device__ __forceinline__ bool custom_visible(const Params& p, int batch, int qo_head, int kv_head, int qo_idx,
                                               int kv_idx, int qo_len, int kv_len, bool& oob) {
  if constexpr (S::kHasMask) {
    return S::logits_mask(p, batch, qo_head, kv_head, qo_idx, kv_idx, qo_len, kv_len, oob);
  } else {
    return true;
  }
}

// A logit `v` after the masks: masked_score unless visible(custom), the kernel's bounds and structural
// rule `&& custom()` (the custom mask) in one chain: split into two tests, nvcc lays the prefill out
// differently.
template <class S, class Visible>
__device__ __forceinline__ float apply_masks(const Params& p, float v, int batch, int qo_head, int kv_head, int qo_idx,
                                             int kv_idx, int qo_len, int kv_len, bool& oob, Visible visible) {
  const bool ok =
      visible([&] { return custom_visible<S>(p, batch, qo_head, kv_head, qo_idx, kv_idx, qo_len, kv_len, oob); });
  return ok ? v : masked_score<S>();
}

// The element that rotate_half puts at `dim` of a head_dim-D vector, given the element D/2 away.
__device__ __forceinline__ float rotate_half_value(int dim, int head_dim, float partner) {
  return dim < head_dim / 2 ? -partner : partner;
}

}  // namespace jitattn

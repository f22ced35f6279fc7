// jitattn: which keys a query sees through the spec's causal and window bounds (positions are
// absolute within the sequence: query position P sees key j when j <= P if causal, j >= P - window_left
// and j <= P + window_right where set). Element tests go through the structural_mask functor (traced
// from jitattn/variant.py's structural_mask); whole ranges and tiles are decided here, so that keys
// outside the bounds are never loaded and tiles inside them never masked.
#pragma once

#include "common.cuh"

namespace jitattn {

// Causal and window bounds of one pair (positions are absolute within the sequence).
template <class S>
__device__ __forceinline__ bool structurally_visible(int qo_idx, int kv_idx) {
  return S::structural_mask(qo_idx, kv_idx);
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

// The keys [kv_begin, kv_end) that positions [pos_lo, pos_hi] see, none for a sequence whose metadata
// failed its checks (`ok` false). Returns !ok: the kernel's bad flag (its rows are written as NaN).
template <class S>
__device__ __forceinline__ bool visible_keys(bool ok, int pos_lo, int pos_hi, int kv_len, int& kv_begin, int& kv_end) {
  const bool bad = !ok;
  visible_kv_range<S>(pos_lo, pos_hi, kv_len, kv_begin, kv_end);
  if (bad) kv_end = kv_begin;
  return bad;
}

// Keys at or before its own position that the left window lets one query see (its own included), or
// 0 without a left window.
template <class S>
__host__ __device__ constexpr int left_window_keys() {
  return S::kWindowLeft >= 0 ? S::kWindowLeft + 1 : 0;
}

}  // namespace jitattn

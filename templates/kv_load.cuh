// jitattn: where a sequence's K/V rows are and how they reach shared memory: the paged cache (page
// ids from block_table, NHD or HND) or ragged K/V (contiguous varlen k / v from kv_start_loc), the
// page ids fetched a tile ahead (KvPages), and the metadata checks of a sequence's key range.
#pragma once

#include "common.cuh"

namespace jitattn {

// Bytes per copy of a K/V row: 16, or 8 for an FP8 row of a head dim that is a multiple of 8 only (72
// bytes: whole 8-byte chunks, 8-byte aligned in the cache). jitattn/spec.py's kv_copy_bytes mirrors it.
template <class S>
__host__ __device__ constexpr int kv_copy_bytes() {
  return S::kHeadDimQK * static_cast<int>(sizeof(typename S::DTypeKV)) % 16 == 0 ? 16 : 8;
}

// Address of row `kv_idx` (K if which == 0, V if 1) of sequence `batch`, head `kv_head`, chunk 0.
// A page id outside [0, num_pages) sets `bad` and reads page 0 instead: invalid metadata turns the
// sequence's output into NaN (loud) rather than an out-of-bounds read (a crash).
template <class S>
__device__ __forceinline__ const typename S::DTypeKV* kv_row_in_page(const Params& p, int page, int kv_head,
                                                                     int kv_idx, int which, bool& bad) {
  if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) {
    bad = true;
    page = 0;
  }
  const int slot = kv_idx % S::kPageSize;
  long long off = static_cast<long long>(page) * p.kv_stride_page + which * p.kv_stride_kv;
  if constexpr (S::kLayoutHND) {
    off += (static_cast<long long>(kv_head) * S::kPageSize + slot) * S::kHeadDimQK;
  } else {
    off += (static_cast<long long>(slot) * S::kNumKvHeads + kv_head) * S::kHeadDimQK;
  }
  return p.kv_cache + off;
}

template <class S>
__device__ __forceinline__ int page_of(const Params& p, int batch, int kv_idx) {
  return p.block_table[static_cast<long long>(batch) * p.block_table_stride + kv_idx / S::kPageSize];
}

// The page ids of the rows this thread copies when load_kv_rows loads kRows keys from `start` (the
// same chunk-to-thread assignment: chunk c = threadIdx.x + j * kThreads holds row c / kChunks).
// A decode kernel fetches them one tile ahead, so the dependent block_table read is off the path
// from a barrier to the next cp.async (with page_size 1 it is one read per row). kRowThreads: threads
// per row, the row's chunk count unless a loader rounds it up (decode_mma_load_tile at padded dims).
template <class S, int kRows, int kThreads,
          int kRowThreads = S::kHeadDimQK * static_cast<int>(sizeof(typename S::DTypeKV)) / kv_copy_bytes<S>()>
struct KvPages {
  static constexpr int kChunks = kRowThreads;
  static constexpr int kIters = ceil_div(kRows * kChunks, kThreads);
  int page[kIters];
  __device__ __forceinline__ void fetch(const Params& p, int batch, int start, int end) {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int c = threadIdx.x + j * kThreads, kv_idx = start + c / kChunks;
      page[j] = (c < kRows * kChunks && kv_idx < end) ? page_of<S>(p, batch, kv_idx) : 0;
    }
  }
};

// Sequence metadata the kernels can check without a host sync. A sequence that fails writes NaN.
template <class S>
__device__ __forceinline__ bool sequence_ok(const Params& p, int qo_len, int kv_len) {
  // explicit positions: the queries carry their own, so a sequence may bring any number of them
  const bool enough_keys = S::kExplicitPositions ? 0 <= kv_len : qo_len <= kv_len;
  return enough_keys && kv_len <= p.block_table_stride * S::kPageSize;
}

// Sequence `batch`'s metadata checks for a ragged spec, which reads its keys from kv_start_loc:
// [kv_start_loc[b], kv_start_loc[b + 1]) must lie inside [0, total_kv] and hold at least the
// sequence's queries. Paged specs check as sequence_ok above. A sequence that fails writes NaN.
template <class S>
__device__ __forceinline__ bool sequence_ok(const Params& p, int batch, int qo_len, int kv_len) {
  if constexpr (S::kRagged) {
    const int k0 = p.kv_start_loc[batch], k1 = p.kv_start_loc[batch + 1];
    return 0 <= k0 && k0 <= k1 && k1 <= p.total_kv && qo_len <= kv_len;
  } else {
    return sequence_ok<S>(p, qo_len, kv_len);
  }
}

// KV length of sequence `batch`: seq_lens (paged) or the kv_start_loc difference (ragged).
template <class S>
__device__ __forceinline__ int kv_length(const Params& p, int batch) {
  if constexpr (S::kRagged) {
    return p.kv_start_loc[batch + 1] - p.kv_start_loc[batch];
  } else {
    return p.seq_lens[batch];
  }
}

// load_kv_rows' paged path with the page ids already fetched (KvPages over the same rows), a copy of
// kv_copy_bytes each. kSwizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8) of the row (rows of
// a multiple of 8 chunks, unpadded): ldmatrix of 8 rows at one logical chunk then hits 8 distinct bank
// groups, as the padded rows (kRowStride = head_dim + 8) do, without the padding's shared memory.
template <class S, int kRows, int kRowStride, int kThreads, bool kSwizzle = false>
__device__ __forceinline__ void load_kv_rows_paged(const Params& p, typename S::DTypeKV* sk, typename S::DTypeKV* sv,
                                                   int kv_head, int start, int end,
                                                   const KvPages<S, kRows, kThreads>& pages, bool& bad) {
  constexpr int kVec = kv_copy_bytes<S>() / static_cast<int>(sizeof(typename S::DTypeKV));
  constexpr int kChunks = S::kHeadDimQK / kVec;
  static_assert(!kSwizzle || (kChunks % 8 == 0 && kRowStride == S::kHeadDimQK), "swizzled rows: 8k chunks, unpadded");
#pragma unroll
  for (int j = 0; j < KvPages<S, kRows, kThreads>::kIters; ++j) {
    const int c = threadIdx.x + j * kThreads;
    if (c < kRows * kChunks) {
      const int row = c / kChunks, chunk = c % kChunks;
      const int kv_idx = start + row;
      const bool in = kv_idx < end;
      const auto* k = in ? kv_row_in_page<S>(p, pages.page[j], kv_head, kv_idx, 0, bad) + chunk * kVec : p.kv_cache;
      const int dst = row * kRowStride + (kSwizzle ? (chunk ^ (row % 8)) : chunk) * kVec;
      cp_async<kv_copy_bytes<S>()>(sk + dst, k, in);
      cp_async<kv_copy_bytes<S>()>(sv + dst, k + p.kv_stride_kv, in);
    }
  }
}

// load_kv_rows' ragged copy of K (kV false) or V: rows first + r of p.k / p.v for keys start + r,
// r < kRows, to `dst`, rows kDstStride apart, 16 bytes a copy; rows at or past `end` zero-filled. p's
// fields are read here: passed in as arguments, they changed the sm_80 ragged prefill's code. Partly
// unrolled: fully unrolled, the hoisted 64-bit addresses of the K and V loops spilled a few bytes in
// the mask / ALiBi variants on sm_80 (ptxas -v).
template <class S, bool kV, int kRows, int kChunks, int kThreads, int kDstStride>
__device__ __forceinline__ void copy_ragged_rows(const Params& p, typename S::DTypeKV* dst, int first, int kv_head,
                                                 int start, int end) {
  using KV = typename S::DTypeKV;
  constexpr int kVec = 16 / sizeof(KV);
#pragma unroll 2
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int row = c / kChunks, chunk = c % kChunks;
    const bool in = start + row < end;
    const KV* base = kV ? p.v : p.k;
    const KV* src = base + (static_cast<long long>(first + row) * (kV ? p.v_stride_token : p.k_stride_token) +
                            kv_head * (kV ? p.v_stride_head : p.k_stride_head) + chunk * kVec);
    cp_async_16(dst + row * kDstStride + chunk * kVec, in ? src : base, in);
  }
}

// cp.async of the K and V rows of keys [start, start + kRows) into two shared-memory tiles whose rows
// are kRowStride (K) and kRowStrideV (V) elements apart, kv_copy_bytes per copy; rows at or past `end`
// are zero-filled (never read): the CUDA-core decode and prefill_kernel load through this (the
// tensor-core decode and prefill_sm90 have their own loaders over kv_row_in_page). Row addressing:
// - paged: one page lookup per row; V sits kv_stride_kv elements after K in the same page;
// - ragged (S::kRagged): row kv_start_loc[batch] + kv_idx of k / v, token and head strides from Params
//   (the sequence's bounds were checked by sequence_ok); K rows are head_dim_qk wide, V rows head_dim_vo.
template <class S, int kRows, int kRowStride, int kThreads, int kRowStrideV = kRowStride>
__device__ __forceinline__ void load_kv_rows(const Params& p, typename S::DTypeKV* sk, typename S::DTypeKV* sv,
                                             int batch, int kv_head, int start, int end, bool& bad) {
  using KV = typename S::DTypeKV;
  constexpr int kVec = kv_copy_bytes<S>() / sizeof(KV);
  constexpr int kChunks = S::kHeadDimQK / kVec;
  if constexpr (S::kRagged) {
    constexpr int kChunksV = S::kHeadDimVO / kVec;
    const int first = p.kv_start_loc[batch] + start;  // row of k / v holding key `start`
    copy_ragged_rows<S, false, kRows, kChunks, kThreads, kRowStride>(p, sk, first, kv_head, start, end);
    copy_ragged_rows<S, true, kRows, kChunksV, kThreads, kRowStrideV>(p, sv, first, kv_head, start, end);
  } else {
    static_assert(S::kHeadDimQK == S::kHeadDimVO && kRowStride == kRowStrideV,
                  "the paged cache holds K and V rows of one width");
    KvPages<S, kRows, kThreads> pages;
    pages.fetch(p, batch, start, end);
    load_kv_rows_paged<S, kRows, kRowStride, kThreads>(p, sk, sv, kv_head, start, end, pages, bad);
  }
}

}  // namespace jitattn

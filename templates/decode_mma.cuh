// jitattn: decode on tensor cores, for GQA groups of 4 to 16 query heads.
//
// The CUDA-core decode kernel spends per key and head a conversion, head_dim FMAs and a shuffle
// reduction; with 4+ query heads per KV head that, not memory, bounds it (ncu at group 4, hd128: SM-bound).
// Here the group's query heads are the rows of one m16 tile
// (rows past the group are zero), so S = Q K^T and O += P V are a handful of mma.sync per 16 keys
// and the kernel is left to stream K/V (FlashInfer decodes GQA the same way). Each of the 4 warps
// takes 16 keys of every 64-key tile and keeps its own online-softmax state; the warps' states merge
// at the end (decode_finish), and splits merge in the last split block (merge_splits_last_block).
// A window of at most kWholeWindowMaxTiles tiles (gpt-oss sliding layers) is loaded whole, up front
// (DecodeMmaTraits::kWholeWindow); there, for head dims 64/128/192/256, the warps split the head dims
// instead of the keys (kSplitDims, decode_mma_split_dims) and no merge is needed.
// An FP8 (e4m3) cache is read here too (DecodeMmaTraits::kFp8): raw rows are staged, and each lane
// widens the bytes of its ldmatrix fragments to f16 in registers (decode_mma_qk_fp8 / _pv_fp8); at
// hd <= 128 a warp takes 32 keys per tile (DecodeMmaTraits::kFp8Wide). An FP8 row that ends in half a
// 16-byte chunk (hd 72, 88, ...) is copied in 8-byte chunks into a row padded to 16 dims, as 16-bit
// rows of those head dims are.
#pragma once

#include "common.cuh"
#include "decode.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace jitattn {

template <bool B, class A, class C> struct DecodeMmaSelect { using type = A; };
template <class A, class C> struct DecodeMmaSelect<false, A, C> { using type = C; };
template <class X> struct DecodeMmaIsHalf { static constexpr bool value = false; };
template <> struct DecodeMmaIsHalf<__half> { static constexpr bool value = true; };

// Whether the tensor-core decode reads this spec's cache: a 16-bit one (q's dtype), or FP8 e4m3 when
// the P operand fits f16 (the FP8 path runs its mma in f16, DecodeMmaTraits::MT): softmax weights
// (at most 1), or any weight when q is f16 (the 16-bit path packs P as f16 then too). A bf16-query
// spec without softmax over an FP8 cache stays on the CUDA-core decode (its weights may exceed f16).
template <class S>
__host__ __device__ constexpr bool decode_mma_reads_cache() {
  return sizeof(typename S::DTypeKV) == 2 ||
         (sizeof(typename S::DTypeKV) == 1 && (S::kSoftmax || DecodeMmaIsHalf<typename S::DTypeQ>::value));
}

// Whether the tensor-core decode's merge scratch (decode_finish over its 4 warps' states of 16 rows, head_dim
// + 2 floats each) holds the split-KV merge of the group: from head dim 16 up every group of 16 fits; at 8,
// groups up to 9.
template <class S>
__host__ __device__ constexpr bool decode_mma_merge_fits() {
  return 4 * 16 * (S::kHeadDimVO + 2) + 16 >= S::kGroupSize * (kMaxSplits + 2) + 1;
}

// Whether the tensor-core decode serves this spec (attention.cu.j2, DecodeLaunch): GQA groups of 4 to
// 16 over a cache it reads, no key transform, a merge scratch that fits. Smaller groups run the
// CUDA-core decode (decode.cuh), faster for Gemma-2-9B's group 2 at hd256 (the one measured).
template <class S>
__host__ __device__ constexpr bool decode_mma_serves() {
  constexpr int kMinGroup = 4;
  return S::kGroupSize >= kMinGroup && S::kGroupSize <= 16 && decode_mma_reads_cache<S>() && !S::kHasKTransform &&
         decode_mma_merge_fits<S>();
}

template <class S>
struct DecodeMmaTraits {
  using DT = typename S::DTypeQ;
  using KV = typename S::DTypeKV;
  // An FP8 (e4m3) cache: raw rows are staged (16 dims per 16-byte chunk) and each lane widens the
  // bytes ldmatrix hands it to f16 in registers (e4m3x4_to_f16x4_scaled: value * 2^-8), never back
  // to shared memory. The mma then runs in f16 (MT) whatever q's dtype: q is staged as it comes and
  // its A fragments are f16, each row scaled by a power of two that brings its largest |q| into
  // [2^14, 2^15) (exact for bf16 q: 8 significant bits fit f16's 11, range moved; decode_mma_q_fp8),
  // the inverse folded into the logit scale with k_scale and the 2^8; P is packed as f16 and
  // v_scale * 2^8 scales the output. Fragment layouts: decode_mma_qk_fp8 / decode_mma_pv_fp8.
  static constexpr bool kFp8 = sizeof(KV) == 1;
  using MT = typename DecodeMmaSelect<kFp8, __half, DT>::type;  // mma operand type
  static constexpr int kHeadDim = S::kHeadDimQK;  // a row in global memory and in the merge scratch
  // The k-steps of S = Q K^T and the n-tile pairs of O are 16 wide: a head dim that is a multiple of 8
  // only pads its Q and K/V rows in shared memory with zeros to 16 dims (decode_mma_zero_pads: 16 bytes
  // of a 16-bit row, 8 of an FP8 one); every kPadded branch is `if constexpr`.
  static constexpr int kHeadDimPad = round_up(kHeadDim, 16);
  static constexpr bool kPadded = kHeadDimPad != kHeadDim;
  static constexpr int kKSteps = kHeadDimPad / 16;  // k-steps of S = Q K^T; an FP8 row's 16-byte chunks
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a q row in global memory
  // Copies of a K/V row: 16-byte chunks, or 8-byte ones for an FP8 row that ends in half a 16-byte chunk.
  static constexpr int kKvChunks = kHeadDim * static_cast<int>(sizeof(KV)) / kv_copy_bytes<S>();
  static constexpr int kWholeWindowMaxTiles = kHeadDim <= 128 ? 3 : 2;
  // Whole-window mode: when the window bounds a decode row to at most kWholeWindowMaxTiles tiles of 64 keys
  // (window_left + 1 keys; gpt-oss sliding layers: 128), every K/V row of the window is issued at once
  // (one block_table round trip, one wait, one barrier) instead of through the tile pipeline, the
  // shared memory holds exactly the window, and more blocks fit on an SM. Such a block reads little
  // (32 KB for gpt-oss), so its life is mostly fixed latency, and blocks resident per SM set the rate.
  static constexpr int kWindowTiles = ceil_div(left_window_keys<S>(), kWarps * 16);
  static constexpr bool kWholeWindow = kWindowTiles > 0 && kWindowTiles <= kWholeWindowMaxTiles;
  // Keys per warp per tile: one k-step of P V (16), or for the FP8 tile pipeline at hd <= 128
  // 32 (two k-steps, so the per-tile work that does not scale with bytes, the
  // barrier, the softmax reductions and rescaling, is spread over as many bytes as a 16-bit tile of 16
  // keys; at hd 256 the registers do not allow it: ptxas spilled 628 bytes for group 16).
  static constexpr bool kFp8Wide = kFp8 && !kWholeWindow && kHeadDim <= 128;
  static constexpr int kWarpKeys = kFp8Wide ? 32 : 16;
  static constexpr int kTileKeys = kWarps * kWarpKeys;  // keys per pipeline stage
  // Tile pipeline stages: 3 for head dims <= 128 (stages against blocks per SM: 4 leave 1, 2 allow 3,
  // both slower), 2 above and for the FP8 32-key tiles. Padded rows up to hd72 take 4: their blocks are
  // short of bytes in flight, and 4 stages still leave them 2 blocks per SM (hd104's would fall to 1).
  static constexpr int kPipelineStages = kFp8Wide ? 2 : kPadded && kHeadDim <= 72 ? 4 : (kHeadDim <= 128 ? 3 : 2);
  // Tile pipeline: the copies are issued by decode_mma_load_tile where a thread's chunk of a row is the
  // same on every pass (the threads are whole rows' worth of chunks). A padded row's odd chunk count
  // divides no thread count: there kLoadChunks threads, the next power of two, serve a row and those
  // past its chunks idle (load_kv_rows_paged's per-copy division and addressing instead cost hd72 /
  // hd88 most of the loss against hd64 / hd128).
  static constexpr int kPow2Chunks = kKvChunks <= 1 ? 1 : kKvChunks <= 2 ? 2 : kKvChunks <= 4 ? 4
                                     : kKvChunks <= 8 ? 8 : kKvChunks <= 16 ? 16 : 32;
  static constexpr bool kPaddedTileLoader = kPadded && !kWholeWindow &&
                                            kThreads % kPow2Chunks == 0 && kTileKeys % (kThreads / kPow2Chunks) == 0;
  static constexpr int kLoadChunks = kPaddedTileLoader ? kPow2Chunks : kKvChunks;
  static constexpr bool kTileLoader = kPaddedTileLoader || (!kWholeWindow && kThreads % kKvChunks == 0 &&
                                     (kTileKeys * kKvChunks) % kThreads == 0 && (kThreads / kKvChunks) % 8 == 0);
  // Rows are unpadded and XOR-swizzled (load_kv_rows_paged) where a row is 8k chunks: whole-window and
  // FP8 rows always, 16-bit pipeline rows at head dims <= 128 (faster than padded rows at hd128). 16-bit
  // hd 256 keeps padded rows: swizzled, the gemma-3-1b decode (group 4) spilled 140
  // bytes at 255 registers against 48 padded (ptxas, sm_90a).
  static constexpr bool kSwizzle = (kWholeWindow || kFp8 || kHeadDim <= 128) && kKvChunks % 8 == 0;
  // K/V rows in KV elements; padded by 16 bytes (hd 80, 96, ...): conflict-free ldmatrix (8 rows hit 8
  // distinct bank groups). A padded row is an odd number of 16-byte chunks for the same reason.
  static constexpr int kVec16 = 16 / static_cast<int>(sizeof(KV));  // KV elements per 16 bytes
  static constexpr int kRowStride = kSwizzle ? kHeadDim : kPadded ? (kHeadDimPad / kVec16 | 1) * kVec16
                                                                  : kHeadDimPad + kVec16;
  static constexpr int kQRowStride = kHeadDimPad + 8;
  static constexpr int kStageBytes = 2 * kTileKeys * kRowStride * static_cast<int>(sizeof(KV));  // K and V of one tile
  static constexpr int kStages = kWholeWindow ? kWindowTiles : kPipelineStages;
  // Whole window: its copies issued by decode_mma_load_tile too (fewer instructions in the kernel).
  static constexpr bool kWindowLoader = kWholeWindow && kSwizzle &&
                                        kThreads % kKvChunks == 0 && (kStages * kTileKeys * kKvChunks) % kThreads == 0 &&
                                        (kThreads / kKvChunks) % 8 == 0;
  static constexpr int kQBytes = 16 * kQRowStride * 2;
  static constexpr int kDTiles = kHeadDimPad / 8;
  // Of them, the ones holding real output dims; all of them for a padded FP8 row, whose last chunk's
  // pairs hold real and pad dims interleaved (decode_mma_out_pair): there each pair's dim is checked.
  static constexpr bool kOutDimCheck = kFp8 && kPadded;
  static constexpr int kDTilesOut = kOutDimCheck ? kDTiles : kHeadDim / 8;
  // Whole window, head dims split over the warps: each warp computes the scores of every key of the
  // window itself (the 4 warps repeat S = Q K^T) and P V for its kDTiles / 4 d-tiles only, so the
  // warps' softmax states are equal and need no merge: no merge scratch, no decode_finish, one
  // barrier after the loads. Needs an even count of d-tiles per warp (ldmatrix_x4_trans reads two):
  // head dims 64, 128, 192, 256.
  static constexpr bool kSplitDims = kWholeWindow && !kPadded && kDTiles % (2 * kWarps) == 0;
  static constexpr int kWarpDTiles = kSplitDims ? kDTiles / kWarps : kDTiles;
  static constexpr int kChunkKeys = 32;  // split dims: keys per online-softmax step (s: 16 registers)
  // Split dims: scratch only for merge_splits_last_block (num_splits > 1).
  static constexpr int kMergeBytes = kSplitDims ? (S::kGroupSize * (kMaxSplits + 2) + 1) * 4
                                                : (kWarps * 16 * (kHeadDim + 2) + 16) * 4;
  static constexpr int kSmemBytes = cmax(kQBytes + kStages * kStageBytes, kMergeBytes);
  // Fragment rows g + 8 (r = 1) hold group heads 8..15: with a group of at most 8 they are padding,
  // so their softmax, rescaling and accumulators are skipped (fewer registers, fewer instructions).
  static constexpr int kRowHalves = S::kGroupSize <= 8 ? 1 : 2;
  // Whole-window blocks are short: ask the compiler for registers that let the shared memory's count
  // of blocks be resident, at most 5 for the key-split kernel (6 blocks' 80 registers spilled, and ran
  // slower) and 6 for the split-dims one (its o is a quarter as large: 80 registers without spills,
  // faster than 5). FP8 rows are half as large, so
  // the shared memory would allow 6 blocks even at hd 128, where the widening's registers do not fit
  // 80 (4 / 98 bytes spilled for groups 8 / 16): FP8 at hd >= 128 takes at most 5 (96 registers).
  // Padded FP8 rows in the key-split kernel take at most 4: at 5's 96 registers ptxas spilled them.
  static constexpr int kMaxWholeWindowBlocks = kSplitDims ? (kFp8 && kHeadDim >= 128 ? 5 : 6)
                                                          : (kFp8 && kPadded ? 4 : 5);
  // The FP8 tile pipeline for groups <= 8 and hd <= 128 fits 3 blocks' registers (the shared memory
  // allows 4 with swizzled rows at hd 128: 53.5 KB per block); every other tile pipeline asks for 1.
  static constexpr bool kFp8Capped = kFp8 && !kWholeWindow && kRowHalves == 1 && kHeadDim <= 128;
  static constexpr int kMaxPipelineBlocks = kFp8Capped ? 3 : 1;
  static constexpr int kSmemFitBlocks = kSmemPerSm / (kSmemBytes + kSmemReservedPerBlock);
  static constexpr int kMinBlocksPerSM =
      cmax(1, cmin(kWholeWindow ? kMaxWholeWindowBlocks : kMaxPipelineBlocks, kSmemFitBlocks));
  static_assert(S::kGroupSize <= 16, "the group's query heads must fit one m16 tile");
  static_assert(decode_mma_reads_cache<S>(), "tensor-core decode: a 16-bit cache, or FP8 with f16-safe weights");
  static_assert(!kPadded || !kSwizzle, "padded rows are unswizzled (an odd chunk count)");
};

// A padded head dim (DecodeMmaTraits::kPadded): zero the pad columns of the 16 Q rows and of every K and V
// row of every stage (stage_k(s) / stage_v(s): kTileKeys rows each) once, before any load. No load writes
// them, so zero Q and K pads add nothing to the scores and zero V pads fill only unused output dims.
template <class T, class StageK, class StageV>
__device__ __forceinline__ void decode_mma_zero_pads(typename T::DT* sq, StageK stage_k, StageV stage_v) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < 16) *reinterpret_cast<uint4*>(sq + threadIdx.x * T::kQRowStride + T::kHeadDim) = zero;
  for (int r = threadIdx.x; r < T::kStages * T::kTileKeys; r += T::kThreads) {
    const int s = r / T::kTileKeys, row = r % T::kTileKeys;
    if constexpr (T::kFp8) {  // 8 pad bytes, 8-byte aligned
      *reinterpret_cast<uint2*>(stage_k(s) + row * T::kRowStride + T::kHeadDim) = make_uint2(0, 0);
      *reinterpret_cast<uint2*>(stage_v(s) + row * T::kRowStride + T::kHeadDim) = make_uint2(0, 0);
    } else {
      *reinterpret_cast<uint4*>(stage_k(s) + row * T::kRowStride + T::kHeadDim) = zero;
      *reinterpret_cast<uint4*>(stage_v(s) + row * T::kRowStride + T::kHeadDim) = zero;
    }
  }
}

// Tile pipeline (DecodeMmaTraits::kTileLoader): cp.async of the K and V rows of keys [start, start +
// kTileKeys), as load_kv_rows_paged (page ids from KvPages, a page id out of range sets `bad` and reads
// page 0, rows at or past `end` zero-filled), with the per-thread constants hoisted: thread t copies
// chunk t % kKvChunks of rows t / kKvChunks + i * (kThreads / kKvChunks), so its chunk, its swizzle and
// the head's offset in a page are fixed, and a row's address is page * kv_stride_page + slot * stride
// (load_kv_rows_paged spent 44 instructions per K/V chunk pair here with an FP8 cache, sm_90a).
// kRows: a pipeline stage's keys, or the whole window's (DecodeMmaTraits::kWindowLoader).
template <class S, int kRows = DecodeMmaTraits<S>::kTileKeys>
__device__ __forceinline__ void decode_mma_load_tile(
    const Params& p, typename S::DTypeKV* sk, typename S::DTypeKV* sv, int kv_head, int start, int end,
    const KvPages<S, kRows, DecodeMmaTraits<S>::kThreads, DecodeMmaTraits<S>::kLoadChunks>& pages, bool& bad) {
  using T = DecodeMmaTraits<S>;
  using KV = typename S::DTypeKV;
  constexpr int kC = T::kLoadChunks, kStep = T::kThreads / kC, kIters = kRows / kStep;
  constexpr int kVec = kv_copy_bytes<S>() / static_cast<int>(sizeof(KV));  // KV elements per copy
  static_assert(kIters == KvPages<S, kRows, T::kThreads, kC>::kIters && kRows % kStep == 0,
                "KvPages' rows are this loader's rows");
  // Threads past a padded row's chunks zero-fill its pad chunk (no read; a branch around their copies
  // cost the hoisted addressing: 36 instructions per K/V pair at hd72 against 7)
  const bool copies = kC == T::kKvChunks || threadIdx.x % kC < T::kKvChunks;
  const int row0 = threadIdx.x / kC;
  const int chunk = kC == T::kKvChunks ? threadIdx.x % kC : min(threadIdx.x % kC, T::kKvChunks);
  const int dst0 = row0 * T::kRowStride + (T::kSwizzle ? (chunk ^ (row0 % 8)) : chunk) * kVec;  // kStep % 8 == 0
  constexpr long long kSlotStride = S::kLayoutHND ? S::kHeadDimQK : static_cast<long long>(S::kNumKvHeads) * S::kHeadDimQK;
  const KV* base = p.kv_cache + (S::kLayoutHND ? static_cast<long long>(kv_head) * S::kPageSize * S::kHeadDimQK
                                               : static_cast<long long>(kv_head) * S::kHeadDimQK) + chunk * kVec;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int kv_idx = start + row0 + i * kStep;  // >= 0
    const bool in = kv_idx < end && copies;
    int page = pages.page[i];
    if (in && static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) {
      bad = true;
      page = 0;
    }
    const int slot = static_cast<int>(static_cast<unsigned>(kv_idx) % static_cast<unsigned>(S::kPageSize));
    const KV* k = base + static_cast<long long>(page) * p.kv_stride_page + slot * kSlotStride;
    // A padded head dim's rows with L2 prefetch (cp_async_16): an NHD piece shares sectors with the next head's
    cp_async<kv_copy_bytes<S>(), T::kPadded>(sk + dst0 + i * kStep * T::kRowStride, in ? k : p.kv_cache, in);
    cp_async<kv_copy_bytes<S>(), T::kPadded>(sv + dst0 + i * kStep * T::kRowStride,
                                             in ? k + p.kv_stride_kv : p.kv_cache, in);
  }
}

// FP8 cache: Q's A fragments (f16) and the per-row logit scale. The K fragments (decode_mma_qk_fp8)
// hold, in k slots 2c, 2c+1 / 2c+8, 2c+9 of each 16-dim chunk, dims 4c, 4c+2 / 4c+1, 4c+3 (c = lane %
// 4): Q's dims go to the same slots (a dot product does not care about the order). Each row is scaled
// by 2^e, e chosen per row (the quad's max |q|) so that its largest |q| lies in [2^14, 2^15): bf16 q
// converts exactly (elements below f16's normal range, 2^-29 of the row's max and smaller, round
// at 2^-24 absolute). qk_scale[r] = q_prescale * k_scale * 2^8 * 2^-e for row half r.
template <class S>
__device__ __forceinline__ void decode_mma_q_fp8(const Params& p, uint32_t (&qf)[DecodeMmaTraits<S>::kKSteps][4],
                                                 float (&qk_scale)[2], const typename S::DTypeQ* sq) {
  using T = DecodeMmaTraits<S>;
  using DT = typename S::DTypeQ;
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  auto load4 = [&](int r, int kk, float (&x)[4]) {  // dims 16 kk + 4c .. +3 of row g + 8 r
    const uint2 raw = *reinterpret_cast<const uint2*>(sq + (g + 8 * r) * T::kQRowStride + kk * 16 + 4 * c);
    const DT* e = reinterpret_cast<const DT*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = to_float(e[i]);
  };
  auto pow2 = [](int e) { return __int_as_float((e + 127) << 23); };  // e in [-126, 127]
  float row_scale[2] = {1.f, 1.f};
  qk_scale[1] = 0.f;
#pragma unroll
  for (int r = 0; r < T::kRowHalves; ++r) {
    float amax = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::kKSteps; ++kk) {
      float x[4];
      load4(r, kk, x);
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[i]));
    }
    amax = group_max<4>(amax);  // the quad holds the whole row
    int e = 0;                  // a zero or non-finite row stays as it is
    if (amax > 0.f && amax <= 3.4028235e38f) {
      const int x2 = ((__float_as_int(amax) >> 23) & 0xff) - 126;  // amax < 2^x2 (frexp's exponent)
      e = min(max(15 - x2, -120), 120);
    }
    row_scale[r] = pow2(e);
    qk_scale[r] = q_prescale<S>() * p.k_scale * kE4m3Unscale * pow2(-e);
  }
#pragma unroll
  for (int kk = 0; kk < T::kKSteps; ++kk)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r >= T::kRowHalves) {  // rows 8..15 are past a group of <= 8: zero (a constant, no registers)
        qf[kk][r] = qf[kk][r + 2] = 0u;
        continue;
      }
      float x[4];
      load4(r, kk, x);
      qf[kk][r] = pack2<__half>(x[0] * row_scale[r], x[2] * row_scale[r]);      // a0 / a1: k slots 2c, 2c+1
      qf[kk][r + 2] = pack2<__half>(x[1] * row_scale[r], x[3] * row_scale[r]);  // a2 / a3: k slots 2c+8, 2c+9
    }
}

// FP8 cache: S += Q K^T for the 16 keys at rows 0..15 of `sk` (s0: keys 0-7, s1: keys 8-15), all head
// dims. ldmatrix (b16) of 8 rows x 16 bytes gives lane (g = lane / 4, c = lane % 4) bytes 4c..4c+3 of
// row g: dims 4c..4c+3 of one 16-dim chunk of key g, a whole n8 x k16 B fragment once widened (dims
// 4c, 4c+2 in b0, 4c+1, 4c+3 in b1; decode_mma_q_fp8 orders Q's dims the same). One ldmatrix_x4: two
// chunks x 16 keys, 4 mma.
template <class T, class ChunkAt>
__device__ __forceinline__ void decode_mma_qk_fp8(float (&s0)[4], float (&s1)[4],
                                                  const uint32_t (&qf)[T::kKSteps][4], const uint8_t* sk,
                                                  ChunkAt chunk_at) {
  const int lane = threadIdx.x % 32;
  const int row = lane % 8 + ((lane / 8) % 2) * 8;  // x4: lanes 0-7 keys 0-7, 8-15 keys 8-15, then again
  auto mma2 = [&](int kk, uint32_t k0, uint32_t k1) {  // chunk kk: keys 0-7 (k0) and 8-15 (k1)
    uint32_t b[2][2];
    e4m3x4_to_f16x4(k0, b[0][0], b[0][1]);
    e4m3x4_to_f16x4(k1, b[1][0], b[1][1]);
    mma_16816<__half>(s0, qf[kk], b[0][0], b[0][1]);
    mma_16816<__half>(s1, qf[kk], b[1][0], b[1][1]);
  };
#pragma unroll
  for (int kk = 0; kk + 1 < T::kKSteps; kk += 2) {
    uint32_t b[4];
    ldmatrix_x4(b, sk + row * T::kRowStride + chunk_at(kk + lane / 16) * 16);
    mma2(kk, b[0], b[1]);
    mma2(kk + 1, b[2], b[3]);
  }
  if constexpr (T::kKSteps % 2 == 1) {
    uint32_t b[2];
    ldmatrix_x2(b, sk + row * T::kRowStride + chunk_at(T::kKSteps - 1) * 16);
    mma2(T::kKSteps - 1, b[0], b[1]);
  }
}

// P of n-tiles 2 j and 2 j + 1 (16 keys) as the A operand of one k-step of O += P V; rows g + 8 are
// zero when they are padding (kRowHalves == 1).
template <class T, class MT, int kN>
__device__ __forceinline__ void decode_mma_p_operand(uint32_t (&a)[4], const float (&s)[kN][4], int j) {
  a[0] = pack2<MT>(s[2 * j][0], s[2 * j][1]);
  a[1] = T::kRowHalves == 2 ? pack2<MT>(s[2 * j][2], s[2 * j][3]) : 0u;
  a[2] = pack2<MT>(s[2 * j + 1][0], s[2 * j + 1][1]);
  a[3] = T::kRowHalves == 2 ? pack2<MT>(s[2 * j + 1][2], s[2 * j + 1][3]) : 0u;
}

// One k-step of O += P V from a 16-bit tile: key rows row0 .. row0 + 15 of `tile` (kRowStride elements
// apart); n-tile pair d2 of o reads chunks tile0 + 2 d2 and + 1 (ldmatrix.trans: B fragments of 8 dims each).
template <class T, class MT, int kPairs, class E, class ChunkAt>
__device__ __forceinline__ void decode_mma_pv_16bit(float (&o)[2 * kPairs][4], const uint32_t (&a)[4], const E* tile,
                                                    int row0, int tile0, int lane, ChunkAt chunk_at) {
#pragma unroll
  for (int d2 = 0; d2 < kPairs; ++d2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, tile + (row0 + lane % 8 + ((lane / 8) % 2) * 8) * T::kRowStride +
                             chunk_at(tile0 + d2 * 2 + lane / 16) * 8);
    if constexpr (T::kRowHalves == 1) {  // rows g + 8 are padding: their accumulators are scratch
      o[2 * d2][2] = o[2 * d2][3] = o[2 * d2 + 1][2] = o[2 * d2 + 1][3] = 0.f;
    }
    mma_16816<MT>(o[2 * d2], a, b[0], b[1]);
    mma_16816<MT>(o[2 * d2 + 1], a, b[2], b[3]);
  }
}

// FP8 cache: O += P V for the 16 keys at rows 0..15 of `sv`, head-dim chunks c0 .. c0 + kN - 1 (16 dims
// each); o[2 i] takes the even dims of chunk c0 + i, o[2 i + 1] the odd ones. ldmatrix.trans (b16) of
// 8 keys x 16 bytes gives lane (r = lane / 4, c = lane % 4) bytes (key 2c, dim 2r), (2c, 2r+1), (2c+1,
// 2r), (2c+1, 2r+1): widened, `lo` (bytes 0, 2) is the B fragment register of dim 2r, `hi` of dim
// 2r+1. So lane (g, c)'s accumulators o[2 i][e], o[2 i + 1][e] (row g, columns 2c + e) are dims
// 16 (c0 + i) + 4c + 2e and + 1: decode_mma_out_pair.
template <class T, int kN, class ChunkAt>
__device__ __forceinline__ void decode_mma_pv_fp8(float (&o)[2 * kN][4], const uint32_t (&a)[4], const uint8_t* sv,
                                                  int c0, ChunkAt chunk_at) {
  const int lane = threadIdx.x % 32;
  const int row = lane % 8 + ((lane / 8) % 2) * 8;
  auto mma2 = [&](int i, uint32_t v0, uint32_t v1) {  // chunk c0 + i: keys 0-7 (v0) and 8-15 (v1)
    uint32_t b[2][2];
    e4m3x4_to_f16x4(v0, b[0][0], b[0][1]);
    e4m3x4_to_f16x4(v1, b[1][0], b[1][1]);
    if constexpr (T::kRowHalves == 1) {  // rows g + 8 are padding: their accumulators are scratch
      o[2 * i][2] = o[2 * i][3] = o[2 * i + 1][2] = o[2 * i + 1][3] = 0.f;
    }
    mma_16816<__half>(o[2 * i], a, b[0][0], b[1][0]);
    mma_16816<__half>(o[2 * i + 1], a, b[0][1], b[1][1]);
  };
#pragma unroll
  for (int i = 0; i + 1 < kN; i += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, sv + row * T::kRowStride + chunk_at(c0 + i + lane / 16) * 16);
    mma2(i, b[0], b[1]);
    mma2(i + 1, b[2], b[3]);
  }
  if constexpr (kN % 2 == 1) {
    uint32_t b[2];
    ldmatrix_x2_trans(b, sv + row * T::kRowStride + chunk_at(c0 + kN - 1) * 16);
    mma2(kN - 1, b[0], b[1]);
  }
}

// Accumulator pair i (0 .. N - 1) of row half r as two adjacent output dims: `dim` and its values;
// o[0] is n-tile `tile0` (an even number) of the head dims. 16-bit cache: o[i][2r], o[i][2r+1] are
// dims 8 (tile0 + i) + 2c, +1. FP8 cache (decode_mma_pv_fp8): pair i = 2j + e is o[2j][2r+e],
// o[2j+1][2r+e], dims 8 tile0 + 16j + 4c + 2e, +1, times 2^8 (the widened V was value * 2^-8).
template <class T, int N>
__device__ __forceinline__ void decode_mma_out_pair(const float (&o)[N][4], int tile0, int i, int r, int tig, int& dim,
                                                    float (&v)[2]) {
  if constexpr (T::kFp8) {
    const int j = i / 2, e = i % 2;
    dim = 16 * j + 4 * tig + 2 * e + tile0 * 8;
    v[0] = o[2 * j][2 * r + e] * kE4m3Unscale;
    v[1] = o[2 * j + 1][2 * r + e] * kE4m3Unscale;
  } else {
    dim = (tile0 + i) * 8 + 2 * tig;
    v[0] = o[i][2 * r];
    v[1] = o[i][2 * r + 1];
  }
}

// The whole-window kernel's compute and epilogue when the head dims are split over the warps
// (DecodeMmaTraits::kSplitDims): keys [lo, hi) are rows 0.. of sk / sv (swizzled when T::kSwizzle),
// all landed; qf holds Q's A fragments.
// One online-softmax step of a warp over kN n-tiles of 8 keys from key0 (S's accumulators in s, rows
// g and g + 8 of the m16 tile): the logit transform (scaled by qk_scale per row half) and the masks
// (keys at or past hi, custom masks) on each score, then with softmax the running max and sum, o's
// rescaling and s turned into exp2 weights. Shared by the whole-window split-dims loop and the tile
// pipeline (FlashAttention-2's online softmax, Dao 2023, sec. 3.1).
template <class S, class T, int kN, int kDTiles>
__device__ __forceinline__ void decode_mma_softmax_step(const Params& p, float (&s)[kN][4], SoftmaxState (&st)[2],
                                                        float (&o)[kDTiles][4], const float (&qk_scale)[2], int batch,
                                                        int kv_head, int qo_idx, int kv_len, int key0, int hi, int g,
                                                        int tig, bool& bad) {
#pragma unroll
  for (int r = 0; r < T::kRowHalves; ++r) {
    const int head = kv_head * S::kGroupSize + min(g + 8 * r, S::kGroupSize - 1);
    float tile_max = kNegInf;
    // (the loops written out: through for_each_row_key nvcc lays out the FP8 and window decodes differently)
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kv_idx = key0 + n * 8 + 2 * tig + e;
        float v = transform_logit<S>(p, s[n][2 * r + e] * qk_scale[r], batch, head, kv_head, qo_idx, kv_idx, 1, kv_len,
                                     bad);
        v = apply_masks<S>(p, v, batch, head, kv_head, qo_idx, kv_idx, 1, kv_len, bad,
                           [&](auto custom) { return kv_idx < hi && custom(); });
        s[n][2 * r + e] = v;
        tile_max = fmaxf(tile_max, v);
      }
    if constexpr (S::kSoftmax) {
      const SoftmaxStep step = softmax_step(st[r], group_max<4>(tile_max));
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        o[d][2 * r] *= step.alpha;
        o[d][2 * r + 1] *= step.alpha;
      }
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(s[n][2 * r + e] - step.m_use);
          s[n][2 * r + e] = pe;
          st[r].d += pe;
        }
    }
  }
}

template <class S>
__device__ __forceinline__ void decode_mma_split_dims(const Params& p,
                                                      const uint32_t (&qf)[DecodeMmaTraits<S>::kKSteps][4],
                                                      const float (&qk_scale)[2], const typename S::DTypeKV* sk,
                                                      const typename S::DTypeKV* sv, int batch, int kv_head, int split,
                                                      int q_row, int qo_idx, int kv_len, int lo, int hi, bool bad) {
  using T = DecodeMmaTraits<S>;
  using MT = typename T::MT;
  constexpr int kN = T::kChunkKeys / 8;  // n-tiles of 8 keys per step
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  auto chunk_at = [&](int chunk) { return T::kSwizzle ? chunk ^ (lane % 8) : chunk; };

  float o[T::kWarpDTiles][4];
  zero_fill(o);
  SoftmaxState st[2] = {softmax_initial<S>(), softmax_initial<S>()};

#pragma unroll
  for (int c0 = 0; c0 < T::kStages * T::kTileKeys; c0 += T::kChunkKeys) {
    if (lo + c0 >= hi) break;
    float s[kN][4];
    zero_fill(s);
    if constexpr (T::kFp8) {
#pragma unroll
      for (int j = 0; j < kN / 2; ++j)  // 16 keys: rows c0 + 16 j .. (multiples of 8: row % 8 == lane % 8)
        decode_mma_qk_fp8<T>(s[2 * j], s[2 * j + 1], qf, reinterpret_cast<const uint8_t*>(sk) + (c0 + 16 * j) * T::kRowStride,
                             chunk_at);
    } else {
#pragma unroll
      for (int kk = 0; kk < T::kHeadDim / 16; ++kk)
#pragma unroll
        for (int j = 0; j < kN / 2; ++j) {  // 16 keys: rows c0 + 16 j .. (multiples of 8: row % 8 == lane % 8)
          uint32_t b[4];
          ldmatrix_x4(b, sk + (c0 + 16 * j + lane % 8 + (lane / 16) * 8) * T::kRowStride +
                             chunk_at(kk * 2 + (lane / 8) % 2) * 8);
          mma_16816<MT>(s[2 * j], qf[kk], b[0], b[1]);
          mma_16816<MT>(s[2 * j + 1], qf[kk], b[2], b[3]);
        }
    }
    decode_mma_softmax_step<S, T>(p, s, st, o, qk_scale, batch, kv_head, qo_idx, kv_len, lo + c0, hi, g, tig, bad);
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) {  // P of 16 keys as the A operand of one k-step
      uint32_t a[4];
      decode_mma_p_operand<T, MT>(a, s, j);
      if constexpr (T::kFp8) {  // this warp's chunks: warp * kWarpDTiles / 2 ..
        decode_mma_pv_fp8<T, T::kWarpDTiles / 2>(o, a, reinterpret_cast<const uint8_t*>(sv) + (c0 + 16 * j) * T::kRowStride,
                                                 warp * T::kWarpDTiles / 2, chunk_at);
      } else {
        decode_mma_pv_16bit<T, MT, T::kWarpDTiles / 2>(o, a, sv, c0 + 16 * j, warp * T::kWarpDTiles, lane, chunk_at);
      }
    }
  }
  // Any thread's bad metadata (a page id out of range, seen by the thread that loaded the row) poisons
  // every output of the block.
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;
#pragma unroll
  for (int r = 0; r < T::kRowHalves; ++r) {
    const int row = g + 8 * r;
    const float d = group_sum<4>(st[r].d);  // every lane of the quad holds the row's sum
    if (row >= S::kGroupSize) continue;
    const int qo_head = kv_head * S::kGroupSize + row;
    float scale;
    if (p.num_splits == 1) {
      float lse;
      scale = finalize_state<S>(p, qo_head, SoftmaxState{st[r].m, d}, lse) * p.v_scale;
      if (warp == 0 && tig == 0 && p.lse != nullptr)
        p.lse[static_cast<long long>(q_row) * S::kNumQoHeads + qo_head] = lse + poison;
#pragma unroll
      for (int dt = 0; dt < T::kWarpDTiles; ++dt) {
        int dim;
        float value[2];
        decode_mma_out_pair<T>(o, warp * T::kWarpDTiles, dt, r, tig, dim, value);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          value[j] *= scale;
          bool oob = false;  // a parameter read out of range here poisons this element
          if constexpr (S::kHasOutTransform)
            value[j] = S::output_transform(p, value[j], batch, qo_head, qo_idx, dim + j, oob);
          value[j] += poison + (oob ? quiet_nan() : 0.f);
        }
        store2<typename S::DTypeO>(p.o + (static_cast<long long>(q_row) * S::kNumQoHeads + qo_head) * S::kHeadDimVO + dim,
                                   value[0], value[1]);
      }
    } else {  // this split's partial state (normalised, base 2), merged below by the pair's last split block
      const long long part = (static_cast<long long>(split) * p.batch_size + batch) * S::kNumQoHeads + qo_head;
      if constexpr (S::kSoftmax) {
        scale = d > 0.f ? p.v_scale / d : 0.f;
        if (warp == 0 && tig == 0) p.partial_lse[part] = (d > 0.f ? st[r].m + __log2f(d) : kNegInf) + poison;
      } else {
        scale = p.v_scale;
        if (warp == 0 && tig == 0) p.partial_lse[part] = poison;
      }
#pragma unroll
      for (int dt = 0; dt < T::kWarpDTiles; ++dt) {
        int dim;
        float value[2];
        decode_mma_out_pair<T>(o, warp * T::kWarpDTiles, dt, r, tig, dim, value);
        *reinterpret_cast<float2*>(p.partial_o + part * S::kHeadDimVO + dim) =
            make_float2(value[0] * scale + poison, value[1] * scale + poison);
      }
    }
  }
  if (p.num_splits > 1 && p.split_counters != nullptr) {
    extern __shared__ __align__(16) uint8_t smem[];  // K/V no longer read after merge_splits_last_block's barrier
    merge_splits_last_block<S, T::kThreads>(p, reinterpret_cast<float*>(smem), batch, kv_head, q_row, qo_idx);
  }
}

template <class S>
__device__ __forceinline__ void decode_mma_kernel(const Params& p) {
  using T = DecodeMmaTraits<S>;
  using DT = typename T::DT;
  using MT = typename T::MT;
  extern __shared__ __align__(16) uint8_t smem[];
  DT* sq = reinterpret_cast<DT*>(smem);
  using KV = typename S::DTypeKV;
  // Pipeline: stage s holds K then V of one tile. Whole window: the K rows of all tiles, then their V rows.
  auto stage_k = [&](int s) {
    if constexpr (T::kWholeWindow) return reinterpret_cast<KV*>(smem + T::kQBytes) + s * T::kTileKeys * T::kRowStride;
    else return reinterpret_cast<KV*>(smem + T::kQBytes + s * T::kStageBytes);
  };
  auto stage_v = [&](int s) {
    if constexpr (T::kWholeWindow) return stage_k(s) + T::kStages * T::kTileKeys * T::kRowStride;
    else return stage_k(s) + T::kTileKeys * T::kRowStride;
  };

  const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  if constexpr (S::kHasSinks && T::kWholeWindow) {  // read in the epilogue (finalize_state): start it now
    if (threadIdx.x < S::kGroupSize)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(p.sinks + kv_head * S::kGroupSize + threadIdx.x));
  }
  int q_row, kv_len;
  if (!decode_row<S>(p, batch, q_row, kv_len)) return;
  const int qo_idx = kv_len - 1;
  int kv_begin, kv_end, lo, hi;
  bool bad = visible_keys<S>(sequence_ok<S>(p, 1, kv_len), qo_idx, qo_idx, kv_len, kv_begin, kv_end);
  if constexpr (T::kWholeWindow) {
    // A window of a few tiles keeps chunks of ceil(keys / splits) rounded up to whole tiles, and its Q
    // fragments below keep their rows 8..15 as loaded (split_range and zeroed rows ran slower on the
    // gpt-oss sliding decode).
    const int chunk_len = round_up(ceil_div(max(kv_end - kv_begin, 0), p.num_splits), T::kTileKeys);
    lo = kv_begin + split * chunk_len;
    hi = min(kv_end, lo + chunk_len);
  } else {
    split_range<T::kTileKeys>(kv_begin, kv_end, split, p.num_splits, lo, hi);
  }
  // Page ids travel one tile ahead of the copies (KvPages): `pages` always holds those of the next
  // tile to issue, fetched right after the previous issue, so their latency hides behind a tile.
  using Pages = KvPages<S, T::kTileKeys, T::kThreads, T::kLoadChunks>;
  auto load_stage = [&](int s, int start, const Pages& pg, bool& bad_ref) {
    if constexpr (T::kTileLoader) {
      decode_mma_load_tile<S>(p, stage_k(s), stage_v(s), kv_head, start, hi, pg, bad_ref);
    } else {
      load_kv_rows_paged<S, T::kTileKeys, T::kRowStride, T::kThreads, T::kSwizzle>(p, stage_k(s), stage_v(s), kv_head,
                                                                                   start, hi, pg, bad_ref);
    }
  };

  if constexpr (T::kPadded) decode_mma_zero_pads<T>(sq, stage_k, stage_v);  // before the Q barrier below
  // Prologue first: kStages - 1 tiles in flight while the query rows are prepared (whole window: all
  // of it, page ids of every row fetched first in one round trip).
  Pages pages;
  if constexpr (T::kWholeWindow) {
    using AllPages = KvPages<S, T::kStages * T::kTileKeys, T::kThreads>;
    AllPages all;
    all.fetch(p, batch, lo, hi);
    if constexpr (T::kWindowLoader) {
      decode_mma_load_tile<S, T::kStages * T::kTileKeys>(p, stage_k(0), stage_v(0), kv_head, lo, hi, all, bad);
    } else {
      load_kv_rows_paged<S, T::kStages * T::kTileKeys, T::kRowStride, T::kThreads, T::kSwizzle>(
          p, stage_k(0), stage_v(0), kv_head, lo, hi, all, bad);
    }
    cp_async_commit();
  } else {
#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
      const int start = lo + s * T::kTileKeys;
      pages.fetch(p, batch, start, hi);
      if (start < hi) load_stage(s, start, pages, bad);
      cp_async_commit();
    }
    pages.fetch(p, batch, lo + (T::kStages - 1) * T::kTileKeys, hi);
  }
  // Q rows (group heads; rows past the group are 0) -> shared memory, query transform applied.
  const typename S::DTypeQ* q_base = p.q + q_row * p.q_stride_token + kv_head * S::kGroupSize * S::kHeadDimQK;
  if constexpr (!S::kHasQTransform) {  // 16-byte chunks copied as they are (q rows are 16-byte aligned)
    for (int e = threadIdx.x; e < 16 * T::kChunks; e += T::kThreads) {
      const int g = e / T::kChunks, c = e % T::kChunks;
      const uint4 raw = g < S::kGroupSize ? *reinterpret_cast<const uint4*>(q_base + g * S::kHeadDimQK + c * 8)
                                          : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(sq + g * T::kQRowStride + c * 8) = raw;
    }
  } else {
    for (int e = threadIdx.x; e < 16 * T::kHeadDim; e += T::kThreads) {
      const int g = e / T::kHeadDim, dim = e % T::kHeadDim;
      float x = 0.f;
      if (g < S::kGroupSize) {
        x = to_float(q_base[g * S::kHeadDimQK + dim]);
        if constexpr (S::kHasQTransform) {
          const int half = T::kHeadDim / 2, partner = dim < half ? dim + half : dim - half;
          x = S::query_transform(p, x, rotate_half_value(dim, T::kHeadDim, to_float(q_base[g * S::kHeadDimQK + partner])),
                                 batch, kv_head * S::kGroupSize + g, qo_idx, dim, bad);
        }
      }
      sq[g * T::kQRowStride + dim] = from_float<DT>(x);
    }
  }
  if constexpr (T::kWholeWindow) cp_async_wait<0>();  // the window landed: this barrier covers it too
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  uint32_t qf[T::kKSteps][4];  // A fragments of Q, loaded once
  float qk_scale[2];                 // factor from S's accumulators to q_prescale * q.k (per row half)
  if constexpr (T::kFp8) {
    decode_mma_q_fp8<S>(p, qf, qk_scale, sq);
  } else {
#pragma unroll
    for (int kk = 0; kk < T::kKSteps; ++kk) {
      ldmatrix_x4(qf[kk], sq + (lane % 16) * T::kQRowStride + kk * 16 + (lane / 16) * 8);
      // Rows g + 8 are padding for groups <= 8: zero, one register for all (tile pipeline only, above).
      if constexpr (T::kRowHalves == 1 && !T::kWholeWindow) qf[kk][1] = qf[kk][3] = 0u;
    }
    qk_scale[0] = qk_scale[1] = q_prescale<S>();
  }

  if constexpr (T::kSplitDims) {
    decode_mma_split_dims<S>(p, qf, qk_scale, stage_k(0), stage_v(0), batch, kv_head, split, q_row, qo_idx, kv_len, lo,
                             hi, bad);
    return;
  }

  float o[T::kDTiles][4];
  zero_fill(o);
  SoftmaxState st[2] = {softmax_initial<S>(), softmax_initial<S>()};

  int it = 0;
  for (int start = lo; start < hi; start += T::kTileKeys, ++it) {
    if constexpr (!T::kWholeWindow) {  // (whole window: everything landed before the Q barrier)
      cp_async_wait<T::kStages - 2>();
      __syncthreads();
      const int next = start + (T::kStages - 1) * T::kTileKeys;
      const int st_next = (it + T::kStages - 1) % T::kStages;
      if (next < hi) load_stage(st_next, next, pages, bad);
      cp_async_commit();
      pages.fetch(p, batch, next + T::kTileKeys, hi);  // used by the next iteration's issue
    }
    const KV* sk = stage_k(it % T::kStages) + warp * T::kWarpKeys * T::kRowStride;
    const KV* sv = stage_v(it % T::kStages) + warp * T::kWarpKeys * T::kRowStride;
    // Rows of a tile start at multiples of 8, so a lane's ldmatrix row r has r % 8 == lane % 8.
    auto chunk_at = [&](int chunk) { return T::kSwizzle ? chunk ^ (lane % 8) : chunk; };
    const int key0 = start + warp * T::kWarpKeys;

    constexpr int kN = T::kWarpKeys / 8;  // n-tiles of 8 keys
    float s[kN][4];                       // 16 rows x kWarpKeys keys
    zero_fill(s);
    if constexpr (T::kFp8) {
#pragma unroll
      for (int j = 0; j < kN / 2; ++j)
        decode_mma_qk_fp8<T>(s[2 * j], s[2 * j + 1], qf, reinterpret_cast<const uint8_t*>(sk) + 16 * j * T::kRowStride,
                             chunk_at);
    } else {
#pragma unroll
      for (int kk = 0; kk < T::kKSteps; ++kk) {
        uint32_t b[4];
        ldmatrix_x4(b, sk + (lane % 8 + (lane / 16) * 8) * T::kRowStride + chunk_at(kk * 2 + (lane / 8) % 2) * 8);
        mma_16816<MT>(s[0], qf[kk], b[0], b[1]);
        mma_16816<MT>(s[1], qf[kk], b[2], b[3]);
      }
    }
    decode_mma_softmax_step<S, T>(p, s, st, o, qk_scale, batch, kv_head, qo_idx, kv_len, key0, hi, g, tig, bad);
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) {
      uint32_t a[4];  // P as the A operand: two n-tiles' accumulators (16 keys) form one k-step
      decode_mma_p_operand<T, MT>(a, s, j);
      if constexpr (T::kFp8) {
        decode_mma_pv_fp8<T, T::kKSteps>(o, a, reinterpret_cast<const uint8_t*>(sv) + 16 * j * T::kRowStride, 0,
                                          chunk_at);
      } else {  // kWarpKeys == 16: j == 0. Inline, not decode_mma_pv_16bit: at hd256 that moved registers (SASS)
#pragma unroll
        for (int d2 = 0; d2 < T::kDTiles / 2; ++d2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sv + (lane % 8 + ((lane / 8) % 2) * 8) * T::kRowStride + chunk_at(d2 * 2 + lane / 16) * 8);
          if constexpr (T::kRowHalves == 1) {  // rows g + 8 are padding: their accumulators are scratch
            o[2 * d2][2] = o[2 * d2][3] = o[2 * d2 + 1][2] = o[2 * d2 + 1][3] = 0.f;
          }
          mma_16816<MT>(o[2 * d2], a, b[0], b[1]);
          mma_16816<MT>(o[2 * d2 + 1], a, b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;

  // Each warp's state of each row into the merge scratch: z = warp, slot = row (group head).
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_d = sm_m + T::kWarps * 16;
  float* sm_o = sm_d + T::kWarps * 16;
#pragma unroll
  for (int r = 0; r < T::kRowHalves; ++r) {
    const int row = g + 8 * r, slot = warp * 16 + row;
    const float d = group_sum<4>(st[r].d);
    if (tig == 0) {
      sm_m[slot] = st[r].m;
      sm_d[slot] = d;
    }
#pragma unroll
    for (int dt = 0; dt < T::kDTilesOut; ++dt) {  // the real dims only: the scratch rows are head_dim wide
      int dim;
      float value[2];
      decode_mma_out_pair<T>(o, 0, dt, r, tig, dim, value);
      if (T::kOutDimCheck && dim >= T::kHeadDim) continue;
      sm_o[slot * T::kHeadDim + dim] = value[0];
      sm_o[slot * T::kHeadDim + dim + 1] = value[1];
    }
  }
  __syncthreads();
  decode_finish<S, T::kWarps, 16, T::kThreads>(p, sm_m, split, batch, kv_head, q_row, qo_idx, poison);
}

}  // namespace jitattn

// Paged attention on tensor cores (mma.sync m16n8k16, fp16/bf16 inputs, fp32 accumulation): the
// decode-first kernel. Same arguments, work list, split rule and output as paged_attention.cu's
// SIMT kernel (which serves fp32 and stays as a variant); design and estimates: gpu/README.md.
//
//   rows          16 per CTA (the MMA's M): row = token_in_seq * group_size + head_in_group, so a
//                 decode step of a GQA group reads each K/V page once for the whole group
//   tiles         kTileN = 4096 / HEAD keys (16 KiB of K + V in 16-bit types), 3-stage cp.async
//                 ring; each thread copies 4 + 4 chunks of one key, whose block id it looked up
//                 one tile ahead (block-table prefetch)
//   Q.K           warp w takes key n-tiles of 8: S[16 x 8] += Q[16 x 16] K^T[16 x 8] per k-step
//   softmax       row maxima across warps through shared memory; P = exp2(S - m) is written as
//                 two 16-bit terms (P = hi + lo, |P - hi - lo| <= u^2 P) so that P.V loses nothing
//                 to the 16-bit rounding of P
//   P.V           warp w owns HEAD / 4 output dimensions: O[16 x 8] += P[16 x 16] V[16 x 8]
//   barriers      3 per tile: (A) tile landed and the previous one consumed, (B) row maxima,
//                 (C) probabilities
//
// Shared tiles are XOR-swizzled in 16-byte chunks (chunk c of row r sits at c ^ (r & 7)) so
// that the fragment loads of one instruction hit 32 different banks.

#include "pagedkv_common.cuh"

namespace pagedkv {

template <typename T, int HEAD>
struct MmaAttentionTraits {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = 16;
  static constexpr int kTileN = 4096 / HEAD;             // keys per stage: 16 KiB of K + V
  static constexpr int kStages = 3;
  static constexpr int kRowChunks = HEAD * 2 / 16;       // 16-byte chunks per K/V row
  static constexpr int kThreadsPerKey = kThreads / kTileN;
  static constexpr int kChunksPerThread = kRowChunks / kThreadsPerKey;
  static constexpr int kStageElems = 2 * kTileN * HEAD;  // K then V
  static constexpr int kKeyTiles = kTileN / 8;           // Q.K n-tiles per tile
  static constexpr int kKeyTilesPerWarp = kKeyTiles >= kWarps ? kKeyTiles / kWarps : 1;
  static constexpr int kDimTilesPerWarp = HEAD / 8 / kWarps;
  static constexpr int kKSteps = HEAD / 16;
  static constexpr int kPvSteps = kTileN / 16;
  static constexpr int kPStride = kTileN + 8;           // padded: conflict-free A fragments
  static constexpr int kKvBytes = kStages * kStageElems * 2;
  static constexpr int kQBytes = kRows * HEAD * 2;
  static constexpr int kPBytes = 2 * kRows * kPStride * 2;
  static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
  static constexpr int kValidBytes = kStages * kTileN * 4;
  static constexpr int kQposBytes = kRows * 4;
  static constexpr int kSmemBytes =
      kKvBytes + kQBytes + kPBytes + kStatBytes + kValidBytes + kQposBytes;
  static constexpr int kMinCtasPerSm = HEAD == 256 ? 3 : 4;

  static_assert(sizeof(T) == 2, "tensor cores take fp16 or bf16 here");
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(kRowChunks >= 8, "the swizzle permutes 8 chunks");
  static_assert(kThreads % kTileN == 0 && kRowChunks % kThreadsPerKey == 0, "loads divide");
  static_assert(kTileN % 16 == 0 && kDimTilesPerWarp >= 1, "MMA shapes divide");
  static_assert(kKvBytes % 16 == 0 && kQBytes % 16 == 0 && kPBytes % 16 == 0, "alignment");
};

// Element offset of (row, col) in a [rows][HEAD] 16-bit tile, 16-byte chunks XOR-swizzled.
template <int HEAD>
__device__ __forceinline__ int swizzle(int row, int col) {
  return row * HEAD + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

template <typename T>
__device__ __forceinline__ unsigned int load_pair(const T* p) {
  return *reinterpret_cast<const unsigned int*>(p);
}

template <typename T>
__device__ __forceinline__ unsigned int pack_pair(const T* lo, const T* hi) {
  return static_cast<unsigned int>(*reinterpret_cast<const unsigned short*>(lo)) |
         (static_cast<unsigned int>(*reinterpret_cast<const unsigned short*>(hi)) << 16);
}

template <typename T, int HEAD>
__global__ void __launch_bounds__(128, (MmaAttentionTraits<T, HEAD>::kMinCtasPerSm))
    paged_attention_mma_kernel(
        const T* __restrict__ q, const long long q_stride_token, const long long q_stride_head,
        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
        const long long cache_stride_block, const long long cache_stride_token,
        const long long cache_stride_head, const int* __restrict__ query_start_loc,
        const int* __restrict__ seq_lens, const int* __restrict__ block_table,
        const long long block_table_stride, const int* __restrict__ work_seq,
        const int* __restrict__ work_row, const int num_blocks, const int block_size_log2,
        const int group_size, const int sliding_window, const float scale_log2,
        T* __restrict__ out, const long long out_stride_token, const long long out_stride_head,
        float* __restrict__ partial_out, float* __restrict__ partial_lse, const int num_q_tokens,
        const int num_heads) {
  using Tr = MmaAttentionTraits<T, HEAD>;
  constexpr int kRows = Tr::kRows;
  constexpr int kTileN = Tr::kTileN;
  constexpr int kStages = Tr::kStages;
  constexpr int kWarps = Tr::kWarps;

  unsigned char* smem = dynamic_smem();
  T* s_kv = reinterpret_cast<T*>(smem);                                  // [stage][K, V]
  T* s_q = reinterpret_cast<T*>(smem + Tr::kKvBytes);                    // [kRows][HEAD]
  T* s_p = reinterpret_cast<T*>(smem + Tr::kKvBytes + Tr::kQBytes);      // [hi, lo][kRows][kPStride]
  float* s_max = reinterpret_cast<float*>(smem + Tr::kKvBytes + Tr::kQBytes + Tr::kPBytes);
  float* s_sum = s_max + kWarps * kRows;                                 // [kWarps][kRows] each
  int* s_valid = reinterpret_cast<int*>(s_sum + kWarps * kRows);         // [kStages][kTileN]
  int* s_qpos = s_valid + kStages * kTileN;                              // [kRows]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // the fragment's row group
  const int t = lane & 3;   // thread in group
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;

  const CtaKeys keys = cta_keys<kRows, kTileN>(query_start_loc, seq_lens, work_seq, work_row,
                                                 group_size, sliding_window);
  const int seq = keys.seq;
  const int row0 = keys.row0;
  const int q_start = keys.q_start;
  const int context = keys.context;
  const int n_rows = keys.n_rows;
  const int kv_start = keys.kv_start;
  const int kv_stop = keys.kv_stop;
  const int n_tiles = keys.n_tiles;
  const int* __restrict__ table = block_table + seq * block_table_stride;
  const int offset_mask = (1 << block_size_log2) - 1;

  // This thread copies chunks [part * kChunksPerThread, ...) of key `load_key` of every tile.
  const int load_key = tid / Tr::kThreadsPerKey;
  const int load_part = tid % Tr::kThreadsPerKey;
  auto lookup = [&](int tile) {  // the block id holding this thread's key of `tile`, or -1
    const int pos = kv_start + tile * kTileN + load_key;
    return tile < n_tiles && pos < kv_stop ? table[pos >> block_size_log2] : -1;
  };
  auto issue = [&](int tile, int block) {  // one commit group per tile, empty past the range
    if (tile < n_tiles) {
      const int stage = tile % kStages;
      const int pos = kv_start + tile * kTileN + load_key;
      const bool ok = block >= 0 && block < num_blocks;
      const long long src = ok ? static_cast<long long>(block) * cache_stride_block +
                                     static_cast<long long>(pos & offset_mask) * cache_stride_token +
                                     static_cast<long long>(kv_head) * cache_stride_head
                               : 0;
      T* s_k = s_kv + stage * Tr::kStageElems;
      T* s_v = s_k + kTileN * HEAD;
#pragma unroll
      for (int i = 0; i < Tr::kChunksPerThread; ++i) {
        const int col = (load_part * Tr::kChunksPerThread + i) * 8;
        const int dst = swizzle<HEAD>(load_key, col);
        cp_async16(s_k + dst, k_cache + src + col, ok);
        cp_async16(s_v + dst, v_cache + src + col, ok);
      }
      if (load_part == 0) s_valid[stage * kTileN + load_key] = ok;
    }
    cp_async_commit();
  };

  int next_block = lookup(0);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue(s, next_block);
    next_block = lookup(s + 1);
  }

  for (int i = tid; i < kRows * HEAD; i += Tr::kThreads) {
    const int r = i / HEAD;
    const int d = i % HEAD;
    T value = from_float<T>(0.f);
    if (r < n_rows) {
      const int row = row0 + r;
      const long long token = q_start + row / group_size;
      const long long head = kv_head * group_size + row % group_size;
      value = q[token * q_stride_token + head * q_stride_head + d];
    }
    s_q[swizzle<HEAD>(r, d)] = value;
  }
  if (tid < kRows) s_qpos[tid] = context + (row0 + tid) / group_size;

  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};  // rows g and g + 8
  float l_run[2] = {0.f, 0.f};
  float acc[Tr::kDimTilesPerWarp][4];
#pragma unroll
  for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile % kStages;
    const int tile_start = kv_start + tile * kTileN;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // (A) this tile landed; every warp finished the previous tile
    issue(tile + kStages - 1, next_block);
    next_block = lookup(tile + kStages);
    const T* s_k = s_kv + stage * Tr::kStageElems;
    const T* s_v = s_k + kTileN * HEAD;

    // Q.K: this warp's key n-tiles, scaled into the log2 domain and masked.
    float score[Tr::kKeyTilesPerWarp][4];
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int j = 0; j < Tr::kKeyTilesPerWarp; ++j) {
      const int key_tile = warp * Tr::kKeyTilesPerWarp + j;
#pragma unroll
      for (int e = 0; e < 4; ++e) score[j][e] = -CUDART_INF_F;
      if (key_tile < Tr::kKeyTiles) {  // uniform across the warp
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4  // fully unrolled, D128 needs more than 128 registers (ptxas)
        for (int ks = 0; ks < Tr::kKSteps; ++ks) {
          const int col = 16 * ks + 2 * t;
          const unsigned int a[4] = {
              load_pair(s_q + swizzle<HEAD>(g, col)), load_pair(s_q + swizzle<HEAD>(g + 8, col)),
              load_pair(s_q + swizzle<HEAD>(g, col + 8)),
              load_pair(s_q + swizzle<HEAD>(g + 8, col + 8))};
          const int key = 8 * key_tile + g;
          const unsigned int b[2] = {load_pair(s_k + swizzle<HEAD>(key, col)),
                                     load_pair(s_k + swizzle<HEAD>(key, col + 8))};
          mma_m16n8k16<T>(s, a, b, s);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = g + 8 * (e >> 1);
          const int n = 8 * key_tile + 2 * t + (e & 1);
          const int pos = tile_start + n;
          const int qpos = s_qpos[r];
          const bool visible = pos < kv_stop && s_valid[stage * kTileN + n] && r < n_rows &&
                               pos <= qpos && (sliding_window <= 0 || pos > qpos - sliding_window);
          score[j][e] = visible ? s[e] * scale_log2 : -CUDART_INF_F;
          row_max[e >> 1] = fmaxf(row_max[e >> 1], score[j][e]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
    }
    if (t == 0) {
      s_max[warp * kRows + g] = row_max[0];
      s_max[warp * kRows + g + 8] = row_max[1];
    }
    __syncthreads();  // (B) every warp's row maxima

    float m_new[2];
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -CUDART_INF_F;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) tile_max = fmaxf(tile_max, s_max[w * kRows + g + 8 * h]);
      m_new[h] = fmaxf(m_run[h], tile_max);
      alpha[h] = m_new[h] == -CUDART_INF_F ? 1.f : exp2f(m_run[h] - m_new[h]);
    }
    float row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < Tr::kKeyTilesPerWarp; ++j) {
      const int key_tile = warp * Tr::kKeyTilesPerWarp + j;
      if (key_tile < Tr::kKeyTiles) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const float p = score[j][e] == -CUDART_INF_F ? 0.f : exp2f(score[j][e] - m_new[h]);
          const T hi = from_float<T>(p);
          const T lo = from_float<T>(p - to_float(hi));
          const int index = (g + 8 * h) * Tr::kPStride + 8 * key_tile + 2 * t + (e & 1);
          s_p[index] = hi;
          s_p[kRows * Tr::kPStride + index] = lo;
          row_sum[h] += p;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
      row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
    }
    if (t == 0) {
      s_sum[warp * kRows + g] = row_sum[0];
      s_sum[warp * kRows + g + 8] = row_sum[1];
    }
    __syncthreads();  // (C) probabilities and partial sums complete

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += s_sum[w * kRows + g + 8 * h];
      l_run[h] = l_run[h] * alpha[h] + sum;
      m_run[h] = m_new[h];
    }
#pragma unroll
    for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
    // P.V: O[:, this warp's dimensions] += (P_hi + P_lo) V.
#pragma unroll
    for (int ks = 0; ks < Tr::kPvSteps; ++ks) {
      const int key = 16 * ks + 2 * t;
      const T* p_hi = s_p;
      const T* p_lo = s_p + kRows * Tr::kPStride;
      const unsigned int a_hi[4] = {load_pair(p_hi + g * Tr::kPStride + key),
                                    load_pair(p_hi + (g + 8) * Tr::kPStride + key),
                                    load_pair(p_hi + g * Tr::kPStride + key + 8),
                                    load_pair(p_hi + (g + 8) * Tr::kPStride + key + 8)};
      const unsigned int a_lo[4] = {load_pair(p_lo + g * Tr::kPStride + key),
                                    load_pair(p_lo + (g + 8) * Tr::kPStride + key),
                                    load_pair(p_lo + g * Tr::kPStride + key + 8),
                                    load_pair(p_lo + (g + 8) * Tr::kPStride + key + 8)};
#pragma unroll
      for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
        const int dim = 8 * (warp * Tr::kDimTilesPerWarp + j) + g;
        const unsigned int b[2] = {
            pack_pair(s_v + swizzle<HEAD>(key, dim), s_v + swizzle<HEAD>(key + 1, dim)),
            pack_pair(s_v + swizzle<HEAD>(key + 8, dim), s_v + swizzle<HEAD>(key + 9, dim))};
        mma_m16n8k16<T>(acc[j], a_hi, b, acc[j]);
        mma_m16n8k16<T>(acc[j], a_lo, b, acc[j]);
      }
    }
  }
  cp_async_wait_all();  // the empty groups past the range

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= n_rows) continue;
    const float inv = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;
    const int row = row0 + r;
    const long long token = q_start + row / group_size;
    const long long head = kv_head * group_size + row % group_size;
    const long long idx =
        (static_cast<long long>(split) * num_q_tokens + token) * num_heads + head;
#pragma unroll
    for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
      const int d = 8 * (warp * Tr::kDimTilesPerWarp + j) + 2 * t;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float o = acc[j][2 * h + e] * inv;
        if (num_splits == 1) {
          out[token * out_stride_token + head * out_stride_head + d + e] = from_float<T>(o);
        } else {
          partial_out[idx * HEAD + d + e] = o;
        }
      }
    }
    if (num_splits > 1 && warp == 0 && t == 0) {
      partial_lse[idx] = l_run[h] > 0.f ? m_run[h] + log2f(l_run[h]) : -CUDART_INF_F;
    }
  }
}

}  // namespace pagedkv

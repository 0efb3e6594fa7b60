// Paged attention over a varlen batch (decode, chunked prefill and prefill alike), plus the
// split-KV merge. Layout and launch policy: gpu/README.md; host side: pagedkv.gpu.attention.
//
//   q, out        [num_tokens, num_heads, HEAD]                  any strides, last dim contiguous
//   k/v cache     [num_blocks, block_size, num_kv_heads, HEAD]   strides in elements, K == V
//   metadata      query_start_loc int32 [S+1], seq_lens int32 [S], block_table int32 [S, W]
//   work list     work_seq / work_row int32 [num_work]: CTA x handles rows
//                 [work_row, work_row + kRows) of sequence work_seq, one row per (token, head of
//                 the GQA group): row = token_in_seq * group_size + head_in_group
//   grid          (num_work, num_kv_heads, num_splits), 128 threads, Traits::kSmemBytes shared
//
// Query j of a sequence with q_len new tokens out of seq_len sits at position seq_len - q_len + j
// and sees keys p' with p' <= p and, with a window W > 0, p' > p - W (bottom-right causal). The
// CTA reads only keys in [first row's window start, last row's position], split into num_splits
// chunks; keys past seq_len are never loaded (zero-filled in shared memory), so uninitialised
// cache memory cannot reach the output. Softmax is online, in fp32, in the log2 domain.

#include "pagedkv_common.cuh"

namespace pagedkv {

template <typename T, int HEAD>
struct AttentionTraits {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  // Query rows per CTA: a decode step of a GQA group of up to 8 heads reads its KV once.
  static constexpr int kRows = 8;
  static constexpr int kElem = static_cast<int>(sizeof(T));
  static constexpr int kVec = 16 / kElem;                  // elements per 16-byte chunk
  static constexpr int kTileN = 8192 / (HEAD * kElem);      // keys per tile: 8 KiB of K
  static constexpr int kTpt = kThreads / kTileN;            // threads per key in Q.K
  static constexpr int kRowChunks = HEAD * kElem / 16;      // 16-byte chunks per K/V row
  static constexpr int kChunksPerThread = kRowChunks / kTpt;
  // Row stride in shared memory, padded so that the 8 lanes of one 128-bit shared load phase
  // (8 / kTpt keys x kTpt chunks) fall into 8 different 16-byte bank groups.
  static constexpr int kRowStride = (kRowChunks + kTpt % 8) * kVec;
  static constexpr int kTileElems = kTileN * kRowStride;
  static constexpr int kLoadsPerThread = kTileN * kRowChunks / kThreads;
  static constexpr int kKeysPerWarp = kTileN / kWarps;     // P.V: each warp a quarter of keys
  static constexpr int kPvElems = HEAD / 32;                // P.V: output elements per lane
  static constexpr int kKvBytes = 4 * kTileElems * kElem;   // {K, V} x 2 buffers
  static constexpr int kQBytes = kRows * HEAD * 4;
  static constexpr int kScoreBytes = kRows * kTileN * 4;
  static constexpr int kStatBytes = 4 * kRows * 4;          // alpha, m, l (float), qpos (int)
  static constexpr int kSmemBytes = kKvBytes + kQBytes + kScoreBytes + kStatBytes;
  // CTAs per SM the launch bounds promise: 4 caps registers at 128 per thread. The 8 x HEAD/32
  // accumulators fit without spills only with fewer CTAs for fp32 (3: 168 registers) and for
  // HEAD 256 (3 for 16-bit types, 2 for fp32). ptxas' report is checked for spills in CI.
  static constexpr int kMinCtasPerSm = HEAD == 256 ? (kElem == 4 ? 2 : 3) : (kElem == 4 ? 3 : 4);

  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(kTileN * HEAD * kElem == 8192, "a K tile is 8 KiB");
  static_assert(kTpt >= 1 && kTpt <= 32 && kThreads % kTileN == 0, "keys split within a warp");
  static_assert(kRowChunks % kTpt == 0, "Q.K chunks divide evenly");
  static_assert((kTileN * kRowChunks) % kThreads == 0, "tile loads divide evenly");
  static_assert(kTileN % kWarps == 0, "P.V keys divide evenly");
  static_assert(kWarps * kRows * HEAD * 4 <= kKvBytes, "merge buffer fits in the K/V buffers");
  static_assert(kKvBytes % 16 == 0 && kQBytes % 16 == 0, "16-byte aligned shared regions");
  static_assert(kRows % kWarps == 0, "softmax rows divide evenly");
  static_assert(kSmemBytes <= 48 * 1024, "no opt-in shared memory needed");
};

template <typename T, int HEAD>
__global__ void __launch_bounds__(128, (AttentionTraits<T, HEAD>::kMinCtasPerSm))
    paged_attention_kernel(
    const T* __restrict__ q, const long long q_stride_token, const long long q_stride_head,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const long long cache_stride_block, const long long cache_stride_token,
    const long long cache_stride_head, const int* __restrict__ query_start_loc,
    const int* __restrict__ seq_lens, const int* __restrict__ block_table,
    const long long block_table_stride, const int* __restrict__ work_seq,
    const int* __restrict__ work_row, const int num_blocks, const int block_size_log2,
    const int group_size, const int sliding_window, const float scale_log2, T* __restrict__ out,
    const long long out_stride_token, const long long out_stride_head,
    float* __restrict__ partial_out, float* __restrict__ partial_lse, const int num_q_tokens,
    const int num_heads) {
  using Tr = AttentionTraits<T, HEAD>;
  constexpr int kRows = Tr::kRows;
  constexpr int kTileN = Tr::kTileN;
  constexpr int kWarps = Tr::kWarps;
  constexpr int kRowsPerWarp = kRows / kWarps;

  unsigned char* smem = dynamic_smem();
  T* s_kv = reinterpret_cast<T*>(smem);                       // [buffer][K, V][kTileElems]
  float* s_q = reinterpret_cast<float*>(smem + Tr::kKvBytes);  // [kRows][HEAD], pre-scaled
  float* s_score = s_q + kRows * HEAD;                        // [kRows][kTileN]
  float* s_alpha = s_score + kRows * kTileN;                  // [kRows]
  float* s_m = s_alpha + kRows;                               // [kRows]
  float* s_l = s_m + kRows;                                   // [kRows]
  int* s_qpos = reinterpret_cast<int*>(s_l + kRows);          // [kRows]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
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

  // Issues the cp.async copies of tile `tile` (K and V) into buffer `buf`, one commit group.
  auto load_tile = [&](int tile, int buf) {
    const int tile_start = kv_start + tile * kTileN;
    T* s_k = s_kv + 2 * buf * Tr::kTileElems;
    T* s_v = s_k + Tr::kTileElems;
#pragma unroll
    for (int i = 0; i < Tr::kLoadsPerThread; ++i) {
      const int chunk = tid + i * Tr::kThreads;
      const int t = chunk / Tr::kRowChunks;
      const int c = chunk % Tr::kRowChunks;
      const int pos = tile_start + t;
      const int block = pos < kv_stop ? table[pos >> block_size_log2] : -1;
      const bool ok = block >= 0 && block < num_blocks;
      const long long src = ok ? static_cast<long long>(block) * cache_stride_block +
                                     static_cast<long long>(pos & offset_mask) * cache_stride_token +
                                     static_cast<long long>(kv_head) * cache_stride_head +
                                     c * Tr::kVec
                               : 0;
      const int dst = t * Tr::kRowStride + c * Tr::kVec;
      cp_async16(s_k + dst, k_cache + src, ok);
      cp_async16(s_v + dst, v_cache + src, ok);
    }
    cp_async_commit();
  };

  if (n_tiles > 0) load_tile(0, 0);

  for (int i = tid; i < kRows * HEAD; i += Tr::kThreads) {
    const int r = i / HEAD;
    float value = 0.f;
    if (r < n_rows) {
      const int row = row0 + r;
      const long long token = q_start + row / group_size;
      const long long head = kv_head * group_size + row % group_size;
      value = to_float(q[token * q_stride_token + head * q_stride_head + i % HEAD]) * scale_log2;
    }
    s_q[i] = value;
  }
  if (tid < kRows) s_qpos[tid] = context + (row0 + tid) / group_size;

  float m_run[kRowsPerWarp];
  float l_run[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m_run[i] = -CUDART_INF_F;
    l_run[i] = 0.f;
  }
  float acc[kRows][Tr::kPvElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < Tr::kPvElems; ++e) acc[r][e] = 0.f;
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int buf = tile & 1;
    const int tile_start = kv_start + tile * kTileN;
    const int n_valid = min(kTileN, kv_stop - tile_start);
    cp_async_wait_all();
    __syncthreads();  // (A) this tile landed; every warp finished the previous tile
    if (tile + 1 < n_tiles) load_tile(tile + 1, buf ^ 1);
    const T* s_k = s_kv + 2 * buf * Tr::kTileElems;
    const T* s_v = s_k + Tr::kTileElems;

    // Q.K: kTpt adjacent threads share a key, each summing kChunksPerThread interleaved chunks.
    {
      const int t = tid / Tr::kTpt;
      const int part = tid % Tr::kTpt;
      float dot[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) dot[r] = 0.f;
      const T* k_row = s_k + t * Tr::kRowStride;
#pragma unroll
      for (int j = 0; j < Tr::kChunksPerThread; ++j) {
        const int c = j * Tr::kTpt + part;
        float kf[Tr::kVec];
        load_floats<T, Tr::kVec>(k_row + c * Tr::kVec, kf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < n_rows) {
            const float4* qv = reinterpret_cast<const float4*>(s_q + r * HEAD + c * Tr::kVec);
#pragma unroll
            for (int e = 0; e < Tr::kVec / 4; ++e) {
              const float4 qq = qv[e];
              dot[r] = fmaf(qq.x, kf[4 * e], dot[r]);
              dot[r] = fmaf(qq.y, kf[4 * e + 1], dot[r]);
              dot[r] = fmaf(qq.z, kf[4 * e + 2], dot[r]);
              dot[r] = fmaf(qq.w, kf[4 * e + 3], dot[r]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < n_rows) {  // n_rows is uniform across the CTA: every lane shuffles
#pragma unroll
          for (int offset = Tr::kTpt / 2; offset > 0; offset >>= 1) {
            dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], offset);
          }
        }
      }
      if (part == 0) {
        const int pos = tile_start + t;
        bool key_ok = t < n_valid;
        if (key_ok) {
          const int block = table[pos >> block_size_log2];
          key_ok = block >= 0 && block < num_blocks;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < n_rows) {
            const int qpos = s_qpos[r];
            const bool visible =
                key_ok && pos <= qpos && (sliding_window <= 0 || pos > qpos - sliding_window);
            s_score[r * kTileN + t] = visible ? dot[r] : -CUDART_INF_F;
          }
        }
      }
    }
    __syncthreads();  // (B) scores complete

    // Online softmax: warp w owns rows w, w + kWarps, ...; scores become probabilities in place.
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      if (r < n_rows) {
        float* row_score = s_score + r * kTileN;
        float tile_max = -CUDART_INF_F;
        for (int t = lane; t < kTileN; t += 32) tile_max = fmaxf(tile_max, row_score[t]);
        tile_max = warp_max(tile_max);
        const float m_new = fmaxf(m_run[i], tile_max);
        float alpha = 1.f;
        float sum = 0.f;
        if (m_new != -CUDART_INF_F) {
          alpha = exp2f(m_run[i] - m_new);
          for (int t = lane; t < kTileN; t += 32) {
            const float p = exp2f(row_score[t] - m_new);
            row_score[t] = p;
            sum += p;
          }
        } else {
          for (int t = lane; t < kTileN; t += 32) row_score[t] = 0.f;
        }
        sum = warp_sum(sum);
        l_run[i] = l_run[i] * alpha + sum;
        m_run[i] = m_new;
        if (lane == 0) s_alpha[r] = alpha;
      }
    }
    __syncthreads();  // (C) probabilities and rescale factors complete

    // P.V: warp w accumulates its quarter of the keys for every row; merged after the loop.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < n_rows) {
        const float alpha = s_alpha[r];
#pragma unroll
        for (int e = 0; e < Tr::kPvElems; ++e) acc[r][e] *= alpha;
      }
    }
#pragma unroll
    for (int j = 0; j < Tr::kKeysPerWarp; ++j) {
      const int t = warp * Tr::kKeysPerWarp + j;
      if (t < n_valid) {  // uniform across the warp
        float vf[Tr::kPvElems];
        load_floats<T, Tr::kPvElems>(s_v + t * Tr::kRowStride + lane * Tr::kPvElems, vf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < n_rows) {
            const float p = s_score[r * kTileN + t];
#pragma unroll
            for (int e = 0; e < Tr::kPvElems; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (r < n_rows && lane == 0) {
      s_m[r] = m_run[i];
      s_l[r] = l_run[i];
    }
  }
  __syncthreads();  // every warp is done with the K/V buffers: reuse them to merge warps
  float* s_merge = reinterpret_cast<float*>(smem);  // [kWarps][kRows][HEAD]
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < n_rows) {
#pragma unroll
      for (int e = 0; e < Tr::kPvElems; ++e) {
        s_merge[(warp * kRows + r) * HEAD + lane * Tr::kPvElems + e] = acc[r][e];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < n_rows * HEAD; i += Tr::kThreads) {
    const int r = i / HEAD;
    const int d = i % HEAD;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_merge[(w * kRows + r) * HEAD + d];
    const float l = s_l[r];
    o = l > 0.f ? o / l : 0.f;
    const int row = row0 + r;
    const long long token = q_start + row / group_size;
    const long long head = kv_head * group_size + row % group_size;
    if (num_splits == 1) {
      out[token * out_stride_token + head * out_stride_head + d] = from_float<T>(o);
    } else {
      const long long idx = (static_cast<long long>(split) * num_q_tokens + token) * num_heads + head;
      partial_out[idx * HEAD + d] = o;
      if (d == 0) partial_lse[idx] = l > 0.f ? s_m[r] + log2f(l) : -CUDART_INF_F;
    }
  }
}

// Merges split-KV partial outputs: one warp per (token, head) of the first num_q_tokens tokens.
//   partial_out [num_splits, num_q_tokens, num_heads, head_size] fp32, normalised per split
//   partial_lse [num_splits, num_q_tokens, num_heads] fp32, log2-sum-exp (-inf: no keys)
template <typename T>
__global__ void __launch_bounds__(128) merge_splits_kernel(
    const float* __restrict__ partial_out, const float* __restrict__ partial_lse,
    const int num_splits, const int num_q_tokens, const int num_heads, const int head_size,
    T* __restrict__ out, const long long out_stride_token, const long long out_stride_head) {
  const long long pair = static_cast<long long>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (pair >= static_cast<long long>(num_q_tokens) * num_heads) return;
  const long long token = pair / num_heads;
  const long long head = pair % num_heads;
  const long long split_stride = static_cast<long long>(num_q_tokens) * num_heads;

  float lse_max = -CUDART_INF_F;
  for (int s = lane; s < num_splits; s += 32) lse_max = fmaxf(lse_max, partial_lse[s * split_stride + pair]);
  lse_max = warp_max(lse_max);
  float weight_sum = 0.f;
  if (lse_max != -CUDART_INF_F) {
    for (int s = lane; s < num_splits; s += 32) {
      weight_sum += exp2f(partial_lse[s * split_stride + pair] - lse_max);
    }
  }
  weight_sum = warp_sum(weight_sum);
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
  for (int d = lane; d < head_size; d += 32) {
    float o = 0.f;
    if (weight_sum > 0.f) {
      for (int s = 0; s < num_splits; ++s) {
        const float lse = partial_lse[s * split_stride + pair];
        if (lse != -CUDART_INF_F) {
          o = fmaf(exp2f(lse - lse_max), partial_out[(s * split_stride + pair) * head_size + d], o);
        }
      }
    }
    out[token * out_stride_token + head * out_stride_head + d] = from_float<T>(o * inv);
  }
}

}  // namespace pagedkv

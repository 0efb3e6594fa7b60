// Paged attention on tensor cores: the decode-first kernel. Same arguments, work list, split rule
// and output as paged_attention.cu's SIMT kernel (which serves fp32 and stays as a variant);
// design, instruction counts and estimates: gpu/README.md.
//
//   rows          16 per CTA (the MMA's M): row = token_in_seq * group_size + head_in_group, so a
//                 decode step of a GQA group reads each K/V page once for the whole group
//   tiles         kTileN keys (64 at D=64, 32 at D=128 and D=256), a ring of kStages stages of
//                 K and V; the kThreadsPerKey threads of a key copy its 16-byte chunks
//                 round-robin (thread p: chunks p, p + kThreadsPerKey, ...). K of tile
//                 t + kStages and V of tile t + kStages - 1 are issued as two commit groups once
//                 tile t's scores are done, so V lands while Q.K runs
//   Q.K           mma.sync m16n8k16 (T): warp w takes the tile's keys [w, w + 1) * kTileN / 4,
//                 Q fragments in registers, K fragments by ldmatrix
//   softmax       row maxima across warps through shared memory (barrier B); P = exp2(S - m) in
//                 fp32, split into two tf32 terms, P = hi + lo with |P - hi - lo| <= 2^-22 P for
//                 every P an fp32 holds (no 16-bit range: a key 2^-40 below the row maximum
//                 still counts); row sums kept per lane, summed once at the end. The lane that
//                 scores keys 2t, 2t + 1 of rows g, g + 8 of an 8-key block holds exactly the
//                 tf32 A fragment lane (g, t) needs for that block, so P goes to shared memory
//                 as one float4 per lane and block (hi and lo), in fragment order
//   P.V           mma.sync m16n8k8 tf32: warp w owns HEAD / 4 output dimensions, V fragments
//                 by ldmatrix.trans, converted exactly to fp32 (tf32 holds every fp16/bf16)
//   loop          unrolled by kStages, so every stage's shared-memory offsets are immediates
//   barriers      2 per tile: (B) row maxima; (C) probabilities, V of this tile and K of the next
//                 landed. A stage's V is reissued only after barrier B, which every warp passes
//                 after its P.V of the previous tile; K rows are private to a warp (the warp that
//                 copies a key is the one that scores it), so their reuse needs no barrier
//
// Shared K/V rows are XOR-swizzled in 16-byte chunks (chunk c of row r sits at c ^ (r & 7)), so
// every ldmatrix phase and every cp.async of a warp hit 32 different banks.

#include "pagedkv_common.cuh"

namespace pagedkv {

template <typename T, int HEAD>
struct MmaAttentionTraits {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = 16;
  static constexpr int kTileN = HEAD == 64 ? 64 : 32;          // keys per stage
  static constexpr int kStages = HEAD == 64 ? 2 : 3;
  static constexpr int kRowBytes = HEAD * 2;
  static constexpr int kRowChunks = HEAD / 8;                  // 16-byte chunks per K/V row
  static constexpr int kThreadsPerKey = kThreads / kTileN;
  static constexpr int kChunksPerThread = kRowChunks / kThreadsPerKey;
  static constexpr int kKeysPerWarp = kTileN / kWarps;         // Q.K: the warp's own keys
  static constexpr int kKeyTilesPerWarp = kKeysPerWarp / 8;    // n-tiles of 8 keys
  static constexpr int kKSteps = HEAD / 16;                    // Q.K k-steps
  static constexpr int kDimTilesPerWarp = HEAD / 8 / kWarps;   // P.V: the warp's n-tiles
  static constexpr int kVTilesPerLoad = kDimTilesPerWarp < 4 ? kDimTilesPerWarp : 4;
  static constexpr int kVLoads = kDimTilesPerWarp / kVTilesPerLoad;
  static constexpr int kBlocksPerVLoad = 4 / kVTilesPerLoad;   // 8-key blocks per ldmatrix
  static constexpr int kPvSteps = kTileN / 8;                  // P.V k-steps (tf32 k = 8)
  static constexpr int kHalfBytes = kTileN * kRowBytes;        // K (or V) of one stage
  static constexpr int kStageBytes = 2 * kHalfBytes;
  static constexpr int kKvBytes = kStages * kStageBytes;
  static constexpr int kPBytes = 2 * kPvSteps * 32 * 16;      // [hi, lo][block][lane] float4
  static constexpr int kMaxBytes = kRows * kWarps * 4;
  static constexpr int kValidBytes = kStages * kWarps * 4;
  static constexpr int kSmemBytes = kKvBytes + kPBytes + kMaxBytes + kValidBytes;
  static constexpr int kMinCtasPerSm = HEAD == 256 ? 2 : 4;

  static_assert(sizeof(T) == 2, "tensor cores take fp16 or bf16 here");
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head size 64, 128 or 256");
  static_assert(kRowChunks >= 8, "the swizzle permutes 8 chunks");
  static_assert(kThreads % kTileN == 0 && kRowChunks % kThreadsPerKey == 0, "loads divide");
  static_assert(32 % kThreadsPerKey == 0 && 32 / kThreadsPerKey == kKeysPerWarp,
                "the warp that copies a key is the warp that scores it");
  static_assert(kKeysPerWarp % 8 == 0 && kDimTilesPerWarp % kVTilesPerLoad == 0, "MMA shapes");
  static_assert(4 % kVTilesPerLoad == 0 && (kTileN / 8) % kBlocksPerVLoad == 0, "V loads");
  static_assert(kKSteps % 2 == 0 && kTileN >= kRows, "K loads pair k-steps; Q fits a V stage");
  static_assert(kKvBytes % 16 == 0 && kPBytes % 16 == 0, "alignment");
};

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
  constexpr int kRowBytes = Tr::kRowBytes;

  unsigned char* smem = dynamic_smem();
  unsigned char* s_kv = smem;                                              // [stage][K, V][key][HEAD]
  float4* s_p = reinterpret_cast<float4*>(smem + Tr::kKvBytes);            // [hi, lo][block][lane]
  float* s_max = reinterpret_cast<float*>(s_p + 2 * Tr::kPvSteps * 32);    // [row][warp]
  unsigned int* s_valid = reinterpret_cast<unsigned int*>(s_max + kRows * kWarps);  // [stage][warp]

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
  const int row0 = keys.row0;
  const int q_start = keys.q_start;
  const int n_rows = keys.n_rows;
  const int kv_start = keys.kv_start;
  const int kv_stop = keys.kv_stop;
  const int n_tiles = keys.n_tiles;
  const int* __restrict__ table = block_table + keys.seq * block_table_stride;
  const int offset_mask = (1 << block_size_log2) - 1;

  // Loads: this thread copies chunks part + i * kThreadsPerKey of key `load_key` of every tile
  // to their swizzled places (for 4 threads a key, two bases and immediate offsets).
  const int load_key = tid / Tr::kThreadsPerKey;
  const int load_part = tid % Tr::kThreadsPerKey;
  const long long head_offset = kv_head * cache_stride_head + load_part * 8;
  const T* __restrict__ k_src = k_cache + head_offset;
  const T* __restrict__ v_src = v_cache + head_offset;
  auto load_dst = [&](int i) {
    const int chunk = load_part + i * Tr::kThreadsPerKey;
    return load_key * kRowBytes + ((chunk ^ (load_key & 7)) << 4);
  };
  // This thread's key of `tile`: its element offset in a cache, and whether it is read at all
  // (not past the range, and its block id in range; otherwise a masked zero row).
  struct KeyRow {
    long long offset;
    bool ok;
  };
  auto lookup = [&](int tile) -> KeyRow {
    const int pos = kv_start + tile * kTileN + load_key;  // >= kv_stop for every tile >= n_tiles
    const int block = pos < kv_stop ? table[pos >> block_size_log2] : -1;
    const bool ok = static_cast<unsigned int>(block) < static_cast<unsigned int>(num_blocks);
    const unsigned int page = ok ? static_cast<unsigned int>(block) : 0u;
    const unsigned int slot = static_cast<unsigned int>(pos & offset_mask);
    return {page * cache_stride_block + slot * cache_stride_token, ok};
  };
  // One commit group each; empty past the range so that the group count stays uniform.
  auto issue_k = [&](int tile, int stage, KeyRow key) {
    if (tile < n_tiles) {
      unsigned char* dst = s_kv + stage * Tr::kStageBytes;
      const T* src = k_src + key.offset;
#pragma unroll
      for (int i = 0; i < Tr::kChunksPerThread; ++i) {
        cp_async16(dst + load_dst(i), src + 8 * Tr::kThreadsPerKey * i, key.ok);
      }
      const unsigned int valid = __ballot_sync(0xffffffffu, key.ok);  // bit key * kThreadsPerKey
      if (lane == 0) s_valid[stage * kWarps + warp] = valid;
    }
    cp_async_commit();
  };
  auto issue_v = [&](int tile, int stage, KeyRow key) {
    if (tile >= 0 && tile < n_tiles) {
      unsigned char* dst = s_kv + stage * Tr::kStageBytes + Tr::kHalfBytes;
      const T* src = v_src + key.offset;
#pragma unroll
      for (int i = 0; i < Tr::kChunksPerThread; ++i) {
        cp_async16(dst + load_dst(i), src + 8 * Tr::kThreadsPerKey * i, key.ok);
      }
    }
    cp_async_commit();
  };

  // Prologue: K of tiles 0 .. kStages - 1, V of tiles 0 .. kStages - 2 (what barrier B of
  // tiles -kStages .. -1 would have issued); the last stage's V space holds Q meanwhile.
  KeyRow k_row_next = lookup(0);
  KeyRow v_row_next = {0, false};
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    issue_k(s, s, k_row_next);
    issue_v(s - 1, s == 0 ? 0 : s - 1, v_row_next);
    v_row_next = k_row_next;
    k_row_next = lookup(s + 1);
  }
  unsigned char* s_q = s_kv + (kStages - 1) * Tr::kStageBytes + Tr::kHalfBytes;
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
    *reinterpret_cast<T*>(s_q + r * kRowBytes + ((((d >> 3) ^ (r & 7)) << 4) | ((d & 7) << 1))) =
        value;
  }
  cp_async_wait<2 * kStages - 2>();
  __syncthreads();  // (P) Q staged; K of tile 0 landed

  // Q's A fragments for every k-step, kept in registers.
  unsigned int qa[Tr::kKSteps][4];
  {
    const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      ldmatrix_x4(qa[ks], s_q + r * kRowBytes + (((2 * ks + (lane >> 4)) ^ (lane & 7)) << 4));
    }
  }
  // Per-lane shared-memory offsets: K rows for Q.K (keys 8j + lane % 8 of the warp's keys,
  // chunks 4c + lane / 8 of k-steps 2c, 2c + 1), V rows for P.V (keys 8b + lane % 8, the
  // warp's dimension chunks), P pairs (rows g, g + 8; keys 2t, 2t + 1 of each 8).
  const int warp_key0 = warp * Tr::kKeysPerWarp;
  int k_row[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    k_row[c] = (warp_key0 + (lane & 7)) * kRowBytes + (((4 * c + (lane >> 3)) ^ (lane & 7)) << 4);
  }
  int v_row[Tr::kVLoads];
#pragma unroll
  for (int i = 0; i < Tr::kVLoads; ++i) {
    const int matrix = lane >> 3;
    const int chunk = warp * Tr::kDimTilesPerWarp + i * Tr::kVTilesPerLoad +
                      matrix % Tr::kVTilesPerLoad;
    const int key = 8 * (matrix / Tr::kVTilesPerLoad) + (lane & 7);
    v_row[i] = Tr::kHalfBytes + key * kRowBytes + ((chunk ^ (lane & 7)) << 4);
  }
  // Keys this lane's rows see: (lo, hi] in positions (the causal bound, the split's end, the
  // window's start).
  int see_lo[2];
  int see_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int qpos = keys.context + (row0 + g + 8 * h) / group_size;
    see_hi[h] = min(qpos, kv_stop - 1);
    see_lo[h] = sliding_window > 0 ? qpos - sliding_window : -2147483647 - 1;
  }

  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};  // rows g and g + 8, log2 domain
  float l_run[2] = {0.f, 0.f};                      // this lane's keys only
  float acc[Tr::kDimTilesPerWarp][4];
#pragma unroll
  for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }

  for (int tile0 = 0; tile0 < n_tiles; tile0 += kStages) {
#pragma unroll
  for (int stage = 0; stage < kStages; ++stage) {
    const int tile = tile0 + stage;  // held in stage `stage`
    if (tile >= n_tiles) break;
    const int prev_stage = stage == 0 ? kStages - 1 : stage - 1;
    const unsigned char* s_stage = s_kv + stage * Tr::kStageBytes;

    // Q.K on this warp's keys, scaled into the log2 domain and masked.
    float score[Tr::kKeyTilesPerWarp][4];
#pragma unroll
    for (int j = 0; j < Tr::kKeyTilesPerWarp; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) score[j][e] = 0.f;
#pragma unroll
      for (int c = 0; c < Tr::kKSteps / 2; ++c) {
        unsigned int b[4];
        ldmatrix_x4(b, s_stage + k_row[c & 1] + 8 * j * kRowBytes + 128 * (c >> 1));
        mma_m16n8k16<T>(score[j], qa[2 * c], b, score[j]);
        mma_m16n8k16<T>(score[j], qa[2 * c + 1], b + 2, score[j]);
      }
    }
    const unsigned int valid = s_valid[stage * kWarps + warp];
    const int key0 = kv_start + tile * kTileN + warp_key0 + 2 * t;
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int j = 0; j < Tr::kKeyTilesPerWarp; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int key = 8 * j + 2 * t + (e & 1);  // among the warp's keys
        const int pos = key0 + 8 * j + (e & 1);
        const bool visible =
            (valid >> (key * Tr::kThreadsPerKey) & 1u) && pos > see_lo[h] && pos <= see_hi[h];
        score[j][e] = visible ? score[j][e] * scale_log2 : -CUDART_INF_F;
        row_max[h] = fmaxf(row_max[h], score[j][e]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
    }
    if (t == 0) {
      s_max[g * kWarps + warp] = row_max[0];
      s_max[(g + 8) * kWarps + warp] = row_max[1];
    }
    __syncthreads();  // (B) every warp's row maxima; every warp finished the previous tile

    // Stage `stage` held K of this tile (this warp's rows: scored above), stage `prev_stage`
    // V of the previous one (read by every warp's P.V before this barrier).
    issue_k(tile + kStages, stage, k_row_next);
    issue_v(tile + kStages - 1, prev_stage, v_row_next);
    v_row_next = k_row_next;
    k_row_next = lookup(tile + kStages + 1);

    float alpha[2];
    float ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 m4 = *reinterpret_cast<const float4*>(s_max + (g + 8 * h) * kWarps);
      const float m_new = fmaxf(fmaxf(m_run[h], fmaxf(m4.x, m4.y)), fmaxf(m4.z, m4.w));
      ref[h] = m_new == -CUDART_INF_F ? 0.f : m_new;  // no key yet: any finite reference
      alpha[h] = exp2_approx(m_run[h] - ref[h]);      // 0 while m_run is -inf
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < Tr::kKeyTilesPerWarp; ++j) {
      float p[4];  // (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1): the A fragment's order
      float4 hi;
      float4 lo;
      float* hi_e = &hi.x;
      float* lo_e = &lo.x;
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int h = a & 1;
        p[a] = exp2_approx(score[j][2 * h + (a >> 1)] - ref[h]);  // -inf: 0
        l_run[h] += p[a];
        const unsigned int bits = to_tf32(p[a]);
        hi_e[a] = __uint_as_float(bits);
        lo_e[a] = __uint_as_float(to_tf32(p[a] - __uint_as_float(bits)));
      }
      const int block = warp * Tr::kKeyTilesPerWarp + j;
      s_p[block * 32 + lane] = hi;
      s_p[(Tr::kPvSteps + block) * 32 + lane] = lo;
    }
    cp_async_wait<2 * kStages - 2>();
    __syncthreads();  // (C) P complete; V of this tile and K of the next landed

#pragma unroll
    for (int j = 0; j < Tr::kDimTilesPerWarp; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
    // P.V, 8 keys at a time; key 2t of each 8 is the MMA's k = t and key 2t + 1 its k = t + 4,
    // in A and in B alike.
#pragma unroll
    for (int kb = 0; kb < Tr::kPvSteps; kb += Tr::kBlocksPerVLoad) {
      unsigned int a_hi[Tr::kBlocksPerVLoad][4];
      unsigned int a_lo[Tr::kBlocksPerVLoad][4];
#pragma unroll
      for (int u = 0; u < Tr::kBlocksPerVLoad; ++u) {
        const float4 hi = s_p[(kb + u) * 32 + lane];
        const float4 lo = s_p[(Tr::kPvSteps + kb + u) * 32 + lane];
        a_hi[u][0] = __float_as_uint(hi.x);
        a_hi[u][1] = __float_as_uint(hi.y);
        a_hi[u][2] = __float_as_uint(hi.z);
        a_hi[u][3] = __float_as_uint(hi.w);
        a_lo[u][0] = __float_as_uint(lo.x);
        a_lo[u][1] = __float_as_uint(lo.y);
        a_lo[u][2] = __float_as_uint(lo.z);
        a_lo[u][3] = __float_as_uint(lo.w);
      }
#pragma unroll
      for (int i = 0; i < Tr::kVLoads; ++i) {
        unsigned int v[4];  // tile m: dimension tile m % kVTilesPerLoad, key block m / that
        ldmatrix_x4_trans(v, s_stage + v_row[i] + 8 * kb * kRowBytes);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int dim_tile = i * Tr::kVTilesPerLoad + m % Tr::kVTilesPerLoad;
          const int u = m / Tr::kVTilesPerLoad;
          const unsigned int b[2] = {__float_as_uint(low_to_float<T>(v[m])),
                                     __float_as_uint(high_to_float<T>(v[m]))};
          mma_m16n8k8_tf32(acc[dim_tile], a_hi[u], b, acc[dim_tile]);
          mma_m16n8k8_tf32(acc[dim_tile], a_lo[u], b, acc[dim_tile]);
        }
      }
    }
  }
  }
  cp_async_wait_all();  // the empty groups past the range

  // Row sums: this lane's keys, then the quad's, then every warp's (s_max is free: every warp
  // read the last maxima before barrier C).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if (t == 0) {
    s_max[g * kWarps + warp] = l_run[0];
    s_max[(g + 8) * kWarps + warp] = l_run[1];
  }
  __syncthreads();  // (E) every warp's row sums

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= n_rows) continue;
    const float4 l4 = *reinterpret_cast<const float4*>(s_max + r * kWarps);
    const float l = (l4.x + l4.y) + (l4.z + l4.w);
    const float inv = l > 0.f ? 1.f / l : 0.f;
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
      partial_lse[idx] = l > 0.f ? m_run[h] + log2f(l) : -CUDART_INF_F;
    }
  }
}

}  // namespace pagedkv

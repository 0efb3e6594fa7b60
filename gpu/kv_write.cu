// Paged KV write ("reshape and cache"): token i's K and V rows go to slot slot_mapping[i] of the
// caches, slot = block_id * block_size + offset; a negative slot means "skip this token". Host
// side: pagedkv.gpu.kv_write.
//
//   key, value      [num_tokens, num_kv_heads, head_size]              last dim contiguous
//   k/v cache       [num_blocks, block_size, num_kv_heads, head_size]  last dim contiguous
//   grid            (num_tokens,), block min(256, heads * row vectors rounded up to a warp)
//
// The kernel only copies bytes, so it is templated on the copy width (VecT: 16, 8, 4 or 2
// bytes; every pointer and stride is a multiple of it, checked on the host) and on the slot
// index type. All strides are in VecT units. Out-of-range slots are skipped, never written:
// the host rejects them before launching, this is the second line of defence.

#include "pagedkv_common.cuh"

namespace pagedkv {

template <typename VecT, typename IndexT>
__global__ void __launch_bounds__(256) write_kv_kernel(
    const VecT* __restrict__ key, const VecT* __restrict__ value,
    const long long key_stride_token, const long long key_stride_head,
    const long long value_stride_token, const long long value_stride_head,
    VecT* __restrict__ key_cache, VecT* __restrict__ value_cache,
    const long long cache_stride_block, const long long cache_stride_token,
    const long long cache_stride_head, const IndexT* __restrict__ slot_mapping,
    const int num_kv_heads, const int row_vecs, const int block_size,
    const long long num_slots) {
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0 || slot >= num_slots) return;
  const long long cache_row =
      (slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_token;
  const int n = num_kv_heads * row_vecs;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long head = i / row_vecs;
    const int v = i % row_vecs;
    const long long dst = cache_row + head * cache_stride_head + v;
    key_cache[dst] = key[token * key_stride_token + head * key_stride_head + v];
    value_cache[dst] = value[token * value_stride_token + head * value_stride_head + v];
  }
}

}  // namespace pagedkv

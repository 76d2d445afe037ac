// The interface between the torch-facing driver (cpu_attention.cpp) and the per-instruction-set
// attention kernels (attention_kernels.cpp). No torch and no intrinsics here: the kernels'
// translation unit includes no torch header, so none of torch's inline functions is compiled
// with instruction sets the host may lack.
#pragma once

#include <cstdint>

namespace mini_infer {

// 16-bit floats as raw bits; layout-compatible with c10::BFloat16 and c10::Half.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};
// fp8 values as raw bits (OCP 8-bit floating point), the KV cache's element with
// kv_cache_dtype "fp8_e5m2" and "fp8_e4m3" ("fp8"). E5M2: 1 sign, 5 exponent bits (bias 15), 2
// mantissa bits, infinities: the top byte of the IEEE binary16 of the same value.
// Layout-compatible with c10::Float8_e5m2.
struct fp8e5m2_t {
  uint8_t bits;
};
// E4M3 ("fn": finite): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN
// 0x7f / 0xff, largest value 448. Layout-compatible with c10::Float8_e4m3fn.
struct fp8e4m3_t {
  uint8_t bits;
};

// Keys per tile: the kernels take keys this many at a time at most (one AVX-512 register of
// scores); buffers sized per tile use it.
constexpr int64_t kMaxTileKeys = 16;

// One call's tensors as raw pointers and element strides (layouts as kernels/reference.py).
struct AttentionProblem {
  const void* query;  // [num_tokens, num_heads, head_dim]
  int64_t query_token_stride, query_head_stride;
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;  // same shape and strides as k_cache
  int64_t cache_block_stride, cache_row_stride, cache_head_stride;
  const int32_t* block_tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  int64_t block_size, head_dim;
  int64_t group;  // query heads per KV head (num_heads / num_kv_heads)
  float scale;    // softmax scale, applied to q.k
  // Decode tasks (attend_decode) prefetch the K/V rows ahead of them into L2 instead of L1
  // (cpu_attention.py: decode_prefetch_l2_default).
  bool prefetch_l2 = false;
};

// One unit of work: query tokens [token_begin, token_begin + num_tokens) of sequence `seq`,
// which sit at positions first_pos, first_pos + 1, ... of it, with the `group` query heads of
// each of the KV heads [kv_head, kv_head + num_heads), against the keys at positions
// [key_begin, key_end). A query token sees keys up to its own position (causal). Its `rows` =
// num_tokens * group * num_heads query rows are ordered token-major: with R = group *
// num_heads rows a token, row m is token m / R, query head kv_head * group + m % R. Only a
// decode task (num_tokens 1) takes more than one KV head: it reads each key position's rows
// of all its heads together, contiguous in the cache.
struct AttentionTask {
  int64_t seq, kv_head;
  int64_t token_begin, num_tokens, first_pos;
  int64_t key_begin, key_end;
  int64_t num_heads = 1;
};

// A task's result and its working memory, owned by the calling thread. `rows` is rounded up
// to a multiple of kMaxTileKeys (prefill tasks pad their rows to whole vectors).
struct TaskBuffers {
  float* acc;      // [rows, head_dim] out: sum over keys of exp(s - row_max) * v
  float* row_max;  // [rows] out: the largest score seen (-inf if none)
  float* row_sum;  // [rows] out: sum over keys of exp(s - row_max)
  float* alpha;    // [rows] scratch
  float* scores;   // [rows, kMaxTileKeys] scratch (or [kMaxTileKeys, rows], key-major)
  void* query;     // [rows, head_dim] scratch: fp32 (bf16 on the native bf16 dot path)
  float* k_tile;   // [kMaxTileKeys, head_dim] scratch
  float* v_tile;   // [kMaxTileKeys, head_dim] scratch
  const float* zeros;     // [head_dim] zeros: the missing keys of a short tile
  float* row_pos;         // [rows] scratch: each query row's position
  uint32_t* prob_pairs;   // [kMaxTileKeys / 2, rows] scratch: probabilities as bf16 pairs
};

using AttendFn = void (*)(const AttentionProblem&, const AttentionTask&, const TaskBuffers&);

// out[i] = silu(gate[i]) * up[i] over n bf16 elements (activation.h).
using SiluAndMulFn = void (*)(const bf16_t* gate, const bf16_t* up, bf16_t* out, int64_t n);

// The kernels of one fp8 cache format F (fp8e5m2_t, fp8e4m3_t): attention per query dtype over
// such a cache (widened exactly to fp32 as it is read), and the store's rounding of new keys
// and values into it per their dtype (kv_store.h: out[i] = in[i] in F, nearest with ties to
// even; E4M3 saturates at 448).
template <class F>
struct Fp8Kernels {
  AttendFn attend_f32, attend_bf16, attend_f16;
  void (*from_f32)(const float* in, F* out, int64_t n);
  void (*from_bf16)(const bf16_t* in, F* out, int64_t n);
  void (*from_f16)(const fp16_t* in, F* out, int64_t n);
};

// The head sizes that attention_tile.h's attend_decode is compiled for (one query token, all its
// KV heads): other head sizes' decode tasks go through attend_tiles.
constexpr bool decode_kernel_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// The kernels of one instruction set: attention per query dtype over a cache of the same dtype;
// the activation; attention over and stores into each fp8 cache format.
struct IsaKernels {
  const char* name;
  int64_t head_dim_multiple;  // head_dim must be a multiple of this (one vector)
  AttendFn attend_f32, attend_bf16, attend_f16;
  // A decode token is one task of all its KV heads at every head_dim, not only at those that
  // attend_decode takes (decode_kernel_head_dim), where it always is.
  bool whole_decode_tokens;
  SiluAndMulFn silu_and_mul_bf16;
  Fp8Kernels<fp8e5m2_t> e5m2;
  Fp8Kernels<fp8e4m3_t> e4m3;
};

// Defined in attention_kernels.cpp. Only kScalarKernels exists off x86-64 GCC; calling the
// others on a CPU without their instruction set is an illegal instruction, so the driver
// checks the CPU's flags first.
extern const IsaKernels kScalarKernels;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MINI_INFER_X86_KERNELS 1
extern const IsaKernels kAvx2Kernels, kAvx512Kernels, kAvx512Bf16Kernels;
#endif

}  // namespace mini_infer

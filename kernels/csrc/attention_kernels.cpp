// The attention kernels (and the MLP's activation, activation.h, and the rounding of an fp8 KV
// cache's store, kv_store.h), compiled once per instruction
// set in one translation unit: the same source (attention_tile.h and activation.h over vec_*.h)
// goes into a namespace per instruction set, inside a GCC `target` region, so the build does not
// depend on the build host's CPU (no -march) and the driver picks a kernel by the running CPU's
// flags (cpu_attention.cpp).
//
// Every header is included before the first target region, so that no inline function from
// a library header is compiled for an instruction set the CPU may lack; the regions define
// only this project's functions, each in its own namespace.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "attention_kernel.h"

#ifdef MINI_INFER_X86_KERNELS
#include <immintrin.h>
#endif

namespace mini_infer {
namespace {

inline float bits_to_float(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// fp32 -> bf16 bits, rounding to nearest even (torch's rounding); NaN to a quiet NaN.
inline uint16_t float_to_bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (x != x) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, exact (subnormals, infinities and NaN included).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal or zero
  return sign ? -magnitude : magnitude;
}

// The two fp8 formats' parameters (attention_kernel.h), for fp8_bits and the vector stores.
// Magnitudes from kOverflowFrom up (as fp32 bits) become kOverflowBits: E5M2's infinity from
// 2^16 (values from 61,440, halfway past its largest, 57,344, round there anyway); E4M3's
// largest value, 448, from 448 up (saturation, as vLLM's fp8 conversion; torch's `Tensor.to`
// would give NaN past 464).
template <class F>
struct Fp8Format;
template <>
struct Fp8Format<fp8e5m2_t> {
  static constexpr uint32_t kMantissaBits = 2, kBias = 15, kOverflowFrom = (127u + 16u) << 23;
  static constexpr uint8_t kOverflowBits = 0x7c;
};
template <>
struct Fp8Format<fp8e4m3_t> {
  static constexpr uint32_t kMantissaBits = 3, kBias = 7, kOverflowFrom = 0x43e00000u;  // 448.0f
  static constexpr uint8_t kOverflowBits = 0x7e;
};

// fp32 -> fp8 bits of format F, rounding to the nearest value with ties to even mantissas (as
// torch's `Tensor.to`), overflow as Fp8Format says, NaN to NaN (0x7f, with its sign).
template <class F>
inline uint8_t fp8_bits(float x) {
  using Format = Fp8Format<F>;
  constexpr uint32_t kDrop = 23 - Format::kMantissaBits;  // fp32 mantissa bits dropped
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (magnitude >= Format::kOverflowFrom) return sign | Format::kOverflowBits;
  if (magnitude < (128u - Format::kBias) << 23) {  // below the smallest normal: subnormal steps
    float abs_x;                                    // of 2^(1 - bias - mantissa bits), counted
    std::memcpy(&abs_x, &magnitude, sizeof(abs_x));  // exactly; a count of 2^mantissa bits is
    return sign | static_cast<uint8_t>(std::nearbyint(  // the smallest normal's bits
                      std::ldexp(abs_x, static_cast<int>(Format::kBias - 1 + Format::kMantissaBits))));
  }
  // Normal: re-bias the exponent and keep the top mantissa bits, adding half an ulp less one
  // plus the kept lowest bit, so that exact halves round to even; a carry moves into the
  // exponent.
  const uint32_t rebiased = magnitude - ((127u - Format::kBias) << 23);
  const uint32_t rounded = rebiased + ((1u << (kDrop - 1)) - 1u) + ((rebiased >> kDrop) & 1u);
  return sign | static_cast<uint8_t>(rounded >> kDrop);
}

// fp8 E4M3 bits -> the fp16 bits of its value / 2^8: sign in place, exponent and mantissa one
// bit down (the widening multiplies by 256 after; NaN, 0x7f, becomes +-480 and is put back).
inline uint16_t e4m3_to_scaled_fp16_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}

// An element as fp32 (exact), for the scalar tails of to_fp8.
inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bf16_to_float(x.bits); }
inline float to_float(fp16_t x) { return fp16_to_float(x.bits); }

}  // namespace

// An instruction set's IsaKernels: head_dim must be a multiple of its vector width;
// `whole_decode_tokens` as IsaKernels says.
#define MINI_INFER_KERNEL_TABLE(isa, name, whole_decode_tokens)                                                  \
  {name, isa::kLanes, &isa::attend<float>, &isa::attend<bf16_t>, &isa::attend<fp16_t>, whole_decode_tokens,       \
   &isa::silu_and_mul_bf16, MINI_INFER_FP8_KERNELS(isa, fp8e5m2_t), MINI_INFER_FP8_KERNELS(isa, fp8e4m3_t)}
#define MINI_INFER_FP8_KERNELS(isa, F)                                                                       \
  {&isa::attend<float, F>, &isa::attend<bf16_t, F>, &isa::attend<fp16_t, F>,                                \
   &isa::to_fp8<float, F>, &isa::to_fp8<bf16_t, F>, &isa::to_fp8<fp16_t, F>}

namespace isa_scalar {
#include "vec_scalar.h"
#include "attention_tile.h"
#include "activation.h"
#include "kv_store.h"
}  // namespace isa_scalar
// The scalar kernels plan as AVX2 does (untimed): so that the tests run whole decode tasks at
// every head_dim on every CPU (through attend_tiles at those that attend_decode does not take).
const IsaKernels kScalarKernels = MINI_INFER_KERNEL_TABLE(isa_scalar, "scalar", true);

#ifdef MINI_INFER_X86_KERNELS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#include "vec_avx2.h"
#include "attention_tile.h"
#include "activation.h"
#include "kv_store.h"
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace isa_avx512 {
#include "vec_avx512.h"
#include "attention_tile.h"
#include "activation.h"
#include "kv_store.h"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
#define MINI_INFER_NATIVE_BF16
namespace isa_avx512_bf16 {
#include "vec_avx512.h"
#include "attention_tile.h"
#include "activation.h"
#include "kv_store.h"
}  // namespace isa_avx512_bf16
#undef MINI_INFER_NATIVE_BF16
#pragma GCC pop_options

// Decode tokens as whole tasks through attend_tiles: faster with the AVX2 kernels (Zen 3 EPYC,
// fp32 0.39-0.41 -> 0.41-0.43 of copy at batch 64 x context 512), 0.85-0.89x as fast with the
// AVX-512 ones (Xeon with AMX, fp32, batch 16-256; bf16 0.78-0.83x there and on an AMD EPYC),
// where a task is then one KV head (docs/PERFORMANCE.md).
const IsaKernels kAvx2Kernels = MINI_INFER_KERNEL_TABLE(isa_avx2, "avx2", true);
const IsaKernels kAvx512Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512, "avx512", false);
const IsaKernels kAvx512Bf16Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512_bf16, "avx512_bf16", false);
#endif

}  // namespace mini_infer

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

// fp32 -> fp8 E5M2 bits, rounding to the nearest value, ties to even mantissas, as torch's
// `.to(torch.float8_e5m2)`: magnitudes from 61,440 (halfway past the largest finite value,
// 57,344) up become infinity, NaN stays NaN (0x7f, with its sign). E5M2: 1 sign, 5 exponent
// bits (bias 15), 2 mantissa bits; normal from 2^-14, subnormal steps of 2^-16.
inline uint8_t float_to_e5m2_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7fu;                  // NaN
  if (magnitude >= (127u + 16u) << 23) return sign | 0x7cu;          // >= 2^16: infinity
  if (magnitude < (127u - 14u) << 23) {                              // below 2^-14: subnormal steps
    float abs_x;                                                     // |x| * 2^16: exact, in steps
    std::memcpy(&abs_x, &magnitude, sizeof(abs_x));                  // (4 steps = 2^-14: the
    return sign | static_cast<uint8_t>(std::nearbyint(abs_x * 65536.f));  // smallest normal's bits)
  }
  // Normal: re-bias the exponent (127 -> 15) and keep the top 2 of 23 mantissa bits, adding half
  // an ulp less one plus the kept lowest bit, so that exact halves round to even; a carry moves
  // into the exponent (and past 57,344 into the infinity's bits, 0x7c).
  const uint32_t rebiased = magnitude - ((127u - 15u) << 23);
  const uint32_t rounded = rebiased + 0xfffffu + ((rebiased >> 21) & 1u);
  return sign | static_cast<uint8_t>(rounded >> 21);
}

// An element as fp32 (exact), for the scalar tails of to_e5m2.
inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bf16_to_float(x.bits); }
inline float to_float(fp16_t x) { return fp16_to_float(x.bits); }

}  // namespace

// An instruction set's IsaKernels: head_dim must be a multiple of its vector width.
// `whole_f32`: whether fp32 decode tokens are whole tasks (cpu_attention.cpp: paged_attention).
#define MINI_INFER_KERNEL_TABLE(isa, name, whole_f32) \
  {name, isa::kLanes, &isa::attend<float>, &isa::attend<bf16_t>, &isa::attend<fp16_t>,                   \
   &isa::attend<float, fp8e5m2_t>, &isa::attend<bf16_t, fp8e5m2_t>, &isa::attend<fp16_t, fp8e5m2_t>,      \
   whole_f32, &isa::silu_and_mul_bf16, &isa::to_e5m2<float>, &isa::to_e5m2<bf16_t>, &isa::to_e5m2<fp16_t>}

namespace isa_scalar {
#include "vec_scalar.h"
#include "attention_tile.h"
#include "activation.h"
#include "kv_store.h"
}  // namespace isa_scalar
// The scalar kernels plan as AVX2 does (untimed): so that the tests run whole fp32 decode
// tasks on every CPU.
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

const IsaKernels kAvx2Kernels = MINI_INFER_KERNEL_TABLE(isa_avx2, "avx2", true);
const IsaKernels kAvx512Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512, "avx512", false);
const IsaKernels kAvx512Bf16Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512_bf16, "avx512_bf16", false);
#endif

}  // namespace mini_infer

// The attention kernels (and the MLP's activation, activation.h), compiled once per instruction
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

}  // namespace

// An instruction set's IsaKernels: head_dim must be a multiple of its vector width.
// `whole_f32`: whether fp32 decode tokens are whole tasks (cpu_attention.cpp: paged_attention).
#define MINI_INFER_KERNEL_TABLE(isa, name, whole_f32) \
  {name, isa::kLanes, &isa::attend<float>, &isa::attend<bf16_t>, &isa::attend<fp16_t>, whole_f32, &isa::silu_and_mul_bf16}

namespace isa_scalar {
#include "vec_scalar.h"
#include "attention_tile.h"
#include "activation.h"
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
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace isa_avx512 {
#include "vec_avx512.h"
#include "attention_tile.h"
#include "activation.h"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
#define MINI_INFER_NATIVE_BF16
namespace isa_avx512_bf16 {
#include "vec_avx512.h"
#include "attention_tile.h"
#include "activation.h"
}  // namespace isa_avx512_bf16
#undef MINI_INFER_NATIVE_BF16
#pragma GCC pop_options

const IsaKernels kAvx2Kernels = MINI_INFER_KERNEL_TABLE(isa_avx2, "avx2", true);
const IsaKernels kAvx512Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512, "avx512", false);
const IsaKernels kAvx512Bf16Kernels = MINI_INFER_KERNEL_TABLE(isa_avx512_bf16, "avx512_bf16", false);
#endif

}  // namespace mini_infer

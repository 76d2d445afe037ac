// Portable vector primitives: one lane. Included into a namespace by attention_kernels.cpp
// (no include guard: it is included once per namespace); attention_tile.h is written against
// this set of names, which vec_avx2.h and vec_avx512.h provide for wider vectors.
using vfloat = float;
constexpr int kLanes = 1;
constexpr bool kNativeBf16Dot = false;

inline vfloat vzero() { return 0.f; }
inline vfloat vset1(float x) { return x; }
inline vfloat vload(const float* p) { return *p; }
inline vfloat vload(const bf16_t* p) { return bf16_to_float(p->bits); }
inline vfloat vload(const fp16_t* p) { return fp16_to_float(p->bits); }
inline vfloat vload(const fp8e5m2_t* p) { return fp16_to_float(static_cast<uint16_t>(p->bits << 8)); }
inline vfloat vload(const fp8e4m3_t* p) {
  if ((p->bits & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  return fp16_to_float(e4m3_to_scaled_fp16_bits(p->bits)) * 256.f;
}
inline void vstore(float* p, vfloat v) { *p = v; }
inline void vstore(fp8e5m2_t* p, vfloat v) { p->bits = fp8_bits<fp8e5m2_t>(v); }
inline void vstore(fp8e4m3_t* p, vfloat v) { p->bits = fp8_bits<fp8e4m3_t>(v); }
inline vfloat vadd(vfloat a, vfloat b) { return a + b; }
inline vfloat vsub(vfloat a, vfloat b) { return a - b; }
inline vfloat vmul(vfloat a, vfloat b) { return a * b; }
inline vfloat vdiv(vfloat a, vfloat b) { return a / b; }
inline void vstore(bf16_t* p, vfloat v) { p->bits = float_to_bf16_bits(v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return a * b + c; }
inline float vreduce_add(vfloat v) { return v; }
inline float vreduce_max(vfloat v) { return v; }
// Lanes [n, kLanes) replaced by `fill`.
inline vfloat vkeep_first(vfloat v, int n, float fill) { return n > 0 ? v : fill; }
inline vfloat vmin(vfloat a, vfloat b) { return std::min(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return std::max(a, b); }
inline vfloat vround(vfloat x) { return std::nearbyint(x); }
inline vfloat vscale_pow2(vfloat y, vfloat k) { return std::ldexp(y, static_cast<int>(k)); }  // y * 2^k
// y, or 0 where x < limit.
inline vfloat vzero_below(vfloat x, float limit, vfloat y) { return x < limit ? 0.f : y; }
// Lane r = the sum of the lanes of rows[r].
inline vfloat vreduce_rows(const vfloat* rows) { return rows[0]; }
inline void vprefetch(const void* p) { __builtin_prefetch(p); }
inline void vprefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }  // low temporal locality: L2
// bf16 elements p[0, 2 kLanes) as two vectors: lane i of `even` is p[2i], of `odd` p[2i + 1].
inline void vload_halves(const bf16_t* p, vfloat& even, vfloat& odd) {
  even = bf16_to_float(p[0].bits);
  odd = bf16_to_float(p[1].bits);
}
// *p (vec_avx2.h's broadcast at its use).
inline vfloat vbroadcast_once(const float* p) { return *p; }

// AVX2 + FMA + F16C vector primitives: 8 fp32 lanes. Same names as vec_scalar.h; included
// into a namespace compiled for those instruction sets (no include guard).
using vfloat = __m256;
constexpr int kLanes = 8;
constexpr bool kNativeBf16Dot = false;

inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const bf16_t* p) {  // bf16 is the top half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vfloat vload(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vfloat vload(const fp8e5m2_t* p) {  // e5m2 is the top byte of an fp16
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}
inline vfloat vload(const fp8e4m3_t* p) {  // as e4m3_to_scaled_fp16_bits, times 2^8; NaN kept
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(bytes, 8), 1), _mm_set1_epi16(0xbfff));
  const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
  const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x), _mm256_set1_ps(480.f), _CMP_EQ_OQ);
  return _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
// To fp8 format F, as fp8_bits (attention_kernels.cpp), 8 lanes. (Signed compares:
// magnitudes are below 2^31.)
template <class F>
inline void vstore_fp8(F* p, vfloat v) {
  using Format = Fp8Format<F>;
  constexpr int kDrop = 23 - Format::kMantissaBits;
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i rebiased = _mm256_sub_epi32(magnitude, _mm256_set1_epi32((127 - Format::kBias) << 23));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(rebiased, kDrop), _mm256_set1_epi32(1));
  __m256i out = _mm256_srli_epi32(
      _mm256_add_epi32(rebiased, _mm256_add_epi32(odd, _mm256_set1_epi32((1 << (kDrop - 1)) - 1))), kDrop);
  const __m256i steps = _mm256_cvtps_epi32(  // subnormal: |x| / the smallest step, nearest even
      _mm256_mul_ps(_mm256_castsi256_ps(magnitude),
                    _mm256_set1_ps(static_cast<float>(1u << (Format::kBias - 1 + Format::kMantissaBits)))));
  out = _mm256_blendv_epi8(out, steps, _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - Format::kBias) << 23), magnitude));
  out = _mm256_blendv_epi8(out, _mm256_set1_epi32(Format::kOverflowBits),
                           _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(Format::kOverflowFrom - 1)));
  out = _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000)));
  // byte 0 of each lane: the four of each 128-bit half into its first four bytes
  const __m256i first_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_shuffle_epi8(_mm256_or_si256(out, sign), first_bytes);
  const int32_t low = _mm256_extract_epi32(packed, 0), high = _mm256_extract_epi32(packed, 4);
  std::memcpy(p, &low, 4);
  std::memcpy(reinterpret_cast<uint8_t*>(p) + 4, &high, 4);
}
inline void vstore(fp8e5m2_t* p, vfloat v) { vstore_fp8(p, v); }
inline void vstore(fp8e4m3_t* p, vfloat v) { vstore_fp8(p, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
// To bf16, rounding to nearest even (float_to_bf16_bits, 8 lanes): NaN to a quiet NaN.
inline void vstore(bf16_t* p, vfloat v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);  // 8 words in the low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }

inline float vreduce_add(vfloat v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float vreduce_max(vfloat v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline vfloat vkeep_first(vfloat v, int n, float fill) {
  const __m256 keep = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep);
}

inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y * 2^k for integral k in [-127, 127]: k added to the exponent field.
inline vfloat vscale_pow2(vfloat y, vfloat k) {
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_k));
}
// y, with 0 in the lanes where x < limit.
inline vfloat vzero_below(vfloat x, float limit, vfloat y) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_LT_OQ), y);
}

// Lane r = the sum of the lanes of rows[r], r < 8: a transposing add tree (21 instructions
// instead of 8 horizontal sums).
inline vfloat vreduce_rows(const vfloat* rows) {
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)  // [a0+a2 b0+b2 a1+a3 b1+b3] per 128-bit half
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]),
                             _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // [a b c d] per half, each a half's sum
    const __m256d x = _mm256_castps_pd(pairs[2 * i]), y = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

// An asm statement, not _mm_prefetch: GCC deems __builtin_prefetch free of side effects and
// deleted every call of a function that does nothing but prefetch.
inline void vprefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
// The same into the L2 cache, not L1 (prefetcht2: on AMD CPUs t1 and t2 both fill L2).
inline void vprefetch_l2(const void* p) { asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }

// bf16 elements p[0, 2 kLanes) as two vectors, without reordering across lanes: lane i of
// `even` is p[2i], of `odd` p[2i + 1] (each 32-bit lane holds a pair; its low element shifted
// up is the even one, the pair with its low half cleared the odd one). One load and two
// instructions for 16 elements; vload(const bf16_t*) takes two and a load for 8.
inline void vload_halves(const bf16_t* p, vfloat& even, vfloat& odd) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// *p in every lane, loaded where it is used: a volatile asm, so that the compiler neither
// merges two broadcasts of the same element nor keeps one in a register past its use
// (decode_values on bf16: 12 accumulators, two value vectors and one probability fill 15 of
// the 16 registers; with a probability per query row held over the pass GCC spilled an
// accumulator, which put a store and a load into every key's dependency chain).
inline vfloat vbroadcast_once(const float* p) {
  vfloat v;
  asm volatile("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
  return v;
}

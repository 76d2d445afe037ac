// AVX-512F vector primitives: 16 fp32 lanes. Same names as vec_scalar.h; included into a
// namespace compiled for AVX-512F (no include guard). With MINI_INFER_NATIVE_BF16 defined
// (the namespace is also compiled for AVX512_BF16) bf16 dot products use vdpbf16ps.
using vfloat = __m512;
constexpr int kLanes = 16;

inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const bf16_t* p) {  // bf16 is the top half of an fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vfloat vload(const fp16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vfloat vload(const fp8e5m2_t* p) {  // e5m2 is the top byte of an fp16
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
inline vfloat vload(const fp8e4m3_t* p) {  // as e4m3_to_scaled_fp16_bits, times 2^8; NaN kept
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // byte << 8, then one arithmetic step down: the sign fills bits 15 and 14, bit 14 cleared
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 1), _mm256_set1_epi16(0xbfff));
  const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(480.f), _CMP_EQ_OQ),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
// To fp8 format F, as fp8_bits (attention_kernels.cpp), 16 lanes.
template <class F>
inline void vstore_fp8(F* p, vfloat v) {
  using Format = Fp8Format<F>;
  constexpr int kDrop = 23 - Format::kMantissaBits;
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i rebiased = _mm512_sub_epi32(magnitude, _mm512_set1_epi32((127 - Format::kBias) << 23));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(rebiased, kDrop), _mm512_set1_epi32(1));
  __m512i out = _mm512_srli_epi32(
      _mm512_add_epi32(rebiased, _mm512_add_epi32(odd, _mm512_set1_epi32((1 << (kDrop - 1)) - 1))), kDrop);
  const __m512i steps = _mm512_cvt_roundps_epi32(  // subnormal: |x| / the smallest step
      _mm512_mul_ps(_mm512_castsi512_ps(magnitude),
                    _mm512_set1_ps(static_cast<float>(1u << (Format::kBias - 1 + Format::kMantissaBits)))),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  out = _mm512_mask_mov_epi32(out, _mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32((128 - Format::kBias) << 23)),
                              steps);
  out = _mm512_mask_mov_epi32(out, _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(Format::kOverflowFrom)),
                              _mm512_set1_epi32(Format::kOverflowBits));
  out = _mm512_mask_mov_epi32(out, _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000)),
                              _mm512_set1_epi32(0x7f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_or_si512(out, sign)));
}
inline void vstore(fp8e5m2_t* p, vfloat v) { vstore_fp8(p, v); }
inline void vstore(fp8e4m3_t* p, vfloat v) { vstore_fp8(p, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
// To bf16, rounding to nearest even (float_to_bf16_bits, 16 lanes; AVX512_BF16's vcvtneps2bf16
// where MINI_INFER_NATIVE_BF16): NaN to a quiet NaN.
inline void vstore(bf16_t* p, vfloat v) {
#ifdef MINI_INFER_NATIVE_BF16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
#endif
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline float vreduce_add(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vreduce_max(vfloat v) { return _mm512_reduce_max_ps(v); }

inline vfloat vkeep_first(vfloat v, int n, float fill) {
  const __mmask16 keep = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << (n > 0 ? n : 0)) - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), keep, v);
}

inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat vscale_pow2(vfloat y, vfloat k) { return _mm512_scalef_ps(y, k); }  // y * 2^k
// y, with 0 in the lanes where x < limit.
inline vfloat vzero_below(vfloat x, float limit, vfloat y) {
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_LT_OQ)), y);
}
// x in the lanes where a <= b, else y.
inline vfloat vselect_le(vfloat a, vfloat b, vfloat x, vfloat y) { return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), x); }

// Lane r = the sum of the lanes of rows[r], r < 16: a transposing add tree (45 instructions
// instead of 16 horizontal sums of 8 each).
inline vfloat vreduce_rows(const vfloat* rows) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // [a0+a2 b0+b2 a1+a3 b1+b3] per 128-bit lane
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]),
                             _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // [a b c d] per 128-bit lane, each that lane's sum
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes: [q0 lanes 0+1, q0 lanes 2+3, q1 lanes 0+1, q1 lanes 2+3]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}

// An asm statement, not _mm_prefetch: GCC deems __builtin_prefetch free of side effects and
// deleted every call of a function that does nothing but prefetch.
inline void vprefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
// The same into the L2 cache, not L1 (prefetcht2: on AMD CPUs t1 and t2 both fill L2).
inline void vprefetch_l2(const void* p) { asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }

// bf16 elements p[0, 2 kLanes) as two vectors, without reordering across lanes: lane i of
// `even` is p[2i], of `odd` p[2i + 1] (as vec_avx2.h's, 32 elements a load).
inline void vload_halves(const bf16_t* p, vfloat& even, vfloat& odd) {
  const __m512i pairs = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// *p in every lane, loaded where it is used (vec_avx2.h says why: a volatile asm, so that the
// compiler keeps no broadcast in a register past its use). "v": any of the 32 registers.
inline vfloat vbroadcast_once(const float* p) {
  vfloat v;
  asm volatile("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

#ifdef MINI_INFER_NATIVE_BF16
constexpr bool kNativeBf16Dot = true;

// Lanes whose sum is q.k over head_dim (a multiple of 16; kHeadDim when not 0): vdpbf16ps
// multiplies bf16 pairs exactly and accumulates in fp32.
template <int64_t kHeadDim>
vfloat vdot(const bf16_t* q, const bf16_t* k, int64_t runtime_head_dim) {
  const int64_t head_dim = kHeadDim ? kHeadDim : runtime_head_dim;
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= head_dim; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  if (d < head_dim) {  // 16 left: the upper half of both operands zero
    const __m256i q_half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
    const __m256i k_half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + d));
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_inserti64x4(_mm512_setzero_si512(), q_half, 0),
                           (__m512bh)_mm512_inserti64x4(_mm512_setzero_si512(), k_half, 0));
  }
  return acc;
}

// A bf16 row's elements 2j and 2j + 1 as one 32-bit word (element 2j in the low half).
inline uint32_t bf16_pair(const bf16_t* row, int64_t j) {
  uint32_t word;
  std::memcpy(&word, row + 2 * j, sizeof(word));
  return word;
}

// The bf16 pairs of kRows rows of probabilities (each row's kMaxTileKeys in a row):
// pairs[i * kMaxTileKeys / 2 + j] = bf16(p[i][2j]) | bf16(p[i][2j + 1]) << 16.
template <int kRows>
void pack_row_pairs(const float* probs, uint32_t* pairs) {
  for (int i = 0; i < kRows; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + i * kMaxTileKeys / 2),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs + i * kMaxTileKeys)));
}

// The same pairs from probabilities stored key-major, st[r * R + m] for keys r < n (rounded up
// to even; the row past an odd n holds zeros) and R rows (a multiple of 16):
// pairs[j * R + m] = bf16(st[2j][m]) | bf16(st[2j + 1][m]) << 16.
inline void pack_key_major_pairs(const float* st, int64_t R, int n, uint32_t* pairs) {
  for (int j = 0; j < (n + 1) / 2; ++j)
    for (int64_t m = 0; m < R; m += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * j * R + m)));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * j + 1) * R + m)));
      _mm512_storeu_si512(pairs + j * R + m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// P @ V with vdpbf16ps, two value rows per instruction: probabilities rounded to bf16 (as flash
// attention rounds them before P @ V), products exact, sums fp32. Row i's probabilities of
// keys 2j and 2j + 1 are the bf16 pair pairs[i * pair_row_stride + j * pair_key_stride].
// unpacklo/hi_epi16 of value rows r and r + 1 pair the elements {0-3, 8-11, 16-19, 24-27}
// and {4-7, 12-15, 20-23, 28-31} of each 32; the accumulator keeps that order until
// natural_order() at the end of the task. head_dim a multiple of 32; acc and alpha point at
// the first of the kRows rows.
template <int kRows>
void accumulate_pairs_bf16(const uint32_t* pairs, int64_t pair_row_stride, int64_t pair_key_stride,
                           const float* alpha, const bf16_t* const* values, int n, int64_t head_dim, float* acc) {
  for (int64_t d = 0; d < head_dim; d += 32) {
    __m512 lo[kRows], hi[kRows];
    for (int i = 0; i < kRows; ++i) {
      const __m512 scale = _mm512_set1_ps(alpha[i]);
      lo[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * head_dim + d), scale);
      hi[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * head_dim + d + 16), scale);
    }
    for (int r = 0; r < n; r += 2) {  // values[n] is a row of zeros when n is odd
      const __m512i a = _mm512_loadu_si512(values[r] + d), b = _mm512_loadu_si512(values[r + 1] + d);
      const __m512bh pair_lo = (__m512bh)_mm512_unpacklo_epi16(a, b), pair_hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int i = 0; i < kRows; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(
            static_cast<int>(pairs[i * pair_row_stride + (r / 2) * pair_key_stride]));
        lo[i] = _mm512_dpbf16_ps(lo[i], p, pair_lo);
        hi[i] = _mm512_dpbf16_ps(hi[i], p, pair_hi);
      }
    }
    for (int i = 0; i < kRows; ++i) {
      _mm512_storeu_ps(acc + i * head_dim + d, lo[i]);
      _mm512_storeu_ps(acc + i * head_dim + d + 16, hi[i]);
    }
  }
}

// Row-lane scores (attention_tile.h: row_scores) on bf16 pairs: keys k0 and k1 against
// kVecs vectors of 16 rows from row m0, qt[j * R + m] the bf16 pair (q_m[2j], q_m[2j + 1]).
template <int kVecs>
void row_scores_bf16(const uint32_t* qt, int64_t R, int64_t m0, const bf16_t* k0, const bf16_t* k1,
                     int64_t head_dim, float scale, float* s0, float* s1) {
  __m512 a0[kVecs], a1[kVecs];
  for (int v = 0; v < kVecs; ++v) a0[v] = a1[v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < head_dim / 2; ++j) {
    const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(k0, j)));
    const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(k1, j)));
    for (int v = 0; v < kVecs; ++v) {
      const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + j * R + m0 + 16 * v);
      a0[v] = _mm512_dpbf16_ps(a0[v], q, x0);
      a1[v] = _mm512_dpbf16_ps(a1[v], q, x1);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    _mm512_storeu_ps(s0 + m0 + 16 * v, _mm512_mul_ps(a0[v], _mm512_set1_ps(scale)));
    _mm512_storeu_ps(s1 + m0 + 16 * v, _mm512_mul_ps(a1[v], _mm512_set1_ps(scale)));
  }
}

// accumulate_pairs_bf16's element order back to the natural one, over `rows` rows of acc.
inline void natural_order(float* acc, int64_t rows, int64_t head_dim) {
  // Element e < 16 of the 32 comes from lo lane (e / 8) * 4 + e % 4 if e % 8 < 4, else from hi
  // (index 16 +) lane (e / 8) * 4 + e % 4; likewise for e >= 16 with lanes 8-15.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t d = 0; d < head_dim; d += 32) {
      float* chunk = acc + m * head_dim + d;
      const __m512 lo = _mm512_loadu_ps(chunk), hi = _mm512_loadu_ps(chunk + 16);
      _mm512_storeu_ps(chunk, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(chunk + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#else
constexpr bool kNativeBf16Dot = false;
#endif

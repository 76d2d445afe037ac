// The rounding of new keys and values into an fp8 KV cache (kv_cache_dtype "fp8_e5m2",
// "fp8_e4m3"), written against the vector primitives of vec_*.h and included into one
// namespace per instruction set after them (no include guard).

// out[i] = in[i] in fp8 format F (fp8_bits: nearest with ties to even, E4M3 saturating at 448)
// for i < n: whole vectors, then element by element.
template <class T, class F>
void to_fp8(const T* in, F* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(out + i, vload(in + i));
  for (; i < n; ++i) out[i].bits = fp8_bits<F>(to_float(in[i]));
}

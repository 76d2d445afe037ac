// The rounding of new keys and values into an fp8 E5M2 KV cache (kv_cache_dtype="fp8_e5m2"),
// written against the vector primitives of vec_*.h and included into one namespace per
// instruction set after them (no include guard).

// out[i] = in[i] rounded to E5M2, nearest with ties to even (float_to_e5m2_bits), for i < n:
// whole vectors, then element by element.
template <class T>
void to_e5m2(const T* in, fp8e5m2_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(out + i, vload(in + i));
  for (; i < n; ++i) out[i].bits = float_to_e5m2_bits(to_float(in[i]));
}

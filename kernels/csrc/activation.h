// SwiGLU's activation for bf16 models, written against the vector primitives of vec_*.h and
// included into one namespace per instruction set after attention_tile.h (whose vexp it uses),
// so no include guard.
//
// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], in fp32, rounded once
// to bf16 (nearest even). Inductor's fused kernel computes the same with Sleef's exp (1 ulp);
// vexp is Cephes' (about 1 ulp), and fp32 rounding to bf16 hides most of the difference.
// vexp(-g) is 0 for g > 87.3 (silu(g) = g there) and saturates for g < -88.3 (silu(g) ~ 0).
inline vfloat silu_times(vfloat gate, vfloat up) {
  return vmul(vdiv(gate, vadd(vset1(1.f), vexp(vsub(vzero(), gate)))), up);
}

inline void silu_and_mul_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(out + i, silu_times(vload(gate + i), vload(up + i)));
  if (i < n) {  // the last n - i elements through one zero-padded vector
    bf16_t g[kLanes] = {}, u[kLanes] = {}, o[kLanes];
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    vstore(o, silu_times(vload(g), vload(u)));
    for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
  }
}

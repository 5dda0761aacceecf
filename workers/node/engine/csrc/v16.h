/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). 16 float lanes (v16) for attention and the GLUs. */

/* ---- 16 float lanes for attention and SwiGLU: __m512 in the AVX-512 build, an array
 * in plain C doing the same IEEE operation lane by lane (fmaf where the vector code
 * fuses, _mm512_reduce_add_ps's pairing tree, scalef as ldexpf), so both builds give the
 * same bits and the plain build runs the default path on any x86-64 CPU. */
/* The KV cache's element: float16, as ggml's default cache type (a value converts to and
 * from float exactly). */
typedef _Float16 h16;

#ifdef MVK_AVX512
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v_load_h(const h16 *p) { /* 16 float16 values, exactly as floats */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline float v_sum(v16 a) { return _mm512_reduce_add_ps(a); }
/* p * 2^n for n integral; where |n| > 192, +inf (n > 0) or 0 (as ggml_v_expf) */
static inline v16 v_scale2(v16 p, v16 n) {
    v16 r = _mm512_scalef_ps(p, n);
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    if (big) {
        const __mmask16 neg = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
        const __m512 alt = _mm512_mask_blend_ps(neg, _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
        r = _mm512_mask_blend_ps(big, r, alt);
    }
    return r;
}
#else
typedef struct {
    float f[16];
} v16;
#define V_EACH(expr)                              \
    v16 r;                                        \
    for (int l = 0; l < 16; l++) r.f[l] = (expr); \
    return r
static inline v16 v_zero(void) { V_EACH(0.0f); }
static inline v16 v_set1(float x) { V_EACH(x); }
static inline v16 v_load(const float *p) { V_EACH(p[l]); }
static inline v16 v_load_h(const h16 *p) { V_EACH((float)p[l]); }
static inline void v_store(float *p, v16 v) { memcpy(p, v.f, sizeof v.f); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { V_EACH(fmaf(a.f[l], b.f[l], c.f[l])); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { V_EACH(fmaf(-a.f[l], b.f[l], c.f[l])); }
static inline v16 v_add(v16 a, v16 b) { V_EACH(a.f[l] + b.f[l]); }
static inline v16 v_sub(v16 a, v16 b) { V_EACH(a.f[l] - b.f[l]); }
static inline v16 v_mul(v16 a, v16 b) { V_EACH(a.f[l] * b.f[l]); }
static inline v16 v_div(v16 a, v16 b) { V_EACH(a.f[l] / b.f[l]); }
static inline v16 v_scale2(v16 p, v16 n) {
    V_EACH(fabsf(n.f[l]) > 192.0f ? (n.f[l] <= 0.0f ? 0.0f : INFINITY)
                                  : ldexpf(p.f[l], (int)n.f[l]));
}
#undef V_EACH
static inline float v_sum(v16 a) { /* _mm512_reduce_add_ps: halves, quarters, pairs */
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = a.f[8 + i] + a.f[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}
#endif

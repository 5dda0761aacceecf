/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). SwiGLU (mvk_swiglu) and GeGLU (mvk_geglu). */

/* SwiGLU as ggml computes it: silu(x) = x / (1 + exp(-x)) with exp16, times g, 16 at a
 * time (n a multiple of 16; rows of gate | up, each `ld` wide, the halves n wide). */
int mvk_swiglu(const float *gu, int64_t t, int64_t n, int64_t ld, float *out) {
    if (n % 16) return -1;
    const v16 one = v_set1(1.0f);
    for (int64_t r = 0; r < t; r++) {
        const float *x = gu + r * ld, *g = x + n;
        for (int64_t i = 0; i < n; i += 16) {
            v16 v = v_load(x + i);
            v16 e = exp16(v_sub(v_zero(), v));
            v16 silu = v_div(v, v_add(one, e));
            v_store(out + r * n + i, v_mul(silu, v_load(g + i)));
        }
    }
    return 0;
}

/* GeGLU as ggml's CPU backend computes it: gelu (tanh form) looked up in a table of every
 * float16 input, its values float16, built with the float arithmetic ggml compiles it to
 * (0.5x (1 + tanhf(sqrt(2/pi) x fma(0.044715x, x, 1))), checked against ggml's table:
 * torch's tanh-gelu differs on 26 of the 65536 entries); 0 below -10, x above 10. */
static uint16_t g_gelu[(1 << 16) + 2]; /* +2: a 32-bit gather of the last entry */
static pthread_once_t g_gelu_once = PTHREAD_ONCE_INIT;

static void gelu_table(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) {
        uint16_t h = (uint16_t)i;
        _Float16 hf;
        memcpy(&hf, &h, 2);
        const float x = (float)hf;
        const float inner = fmaf(0.044715f * x, x, 1.0f);
        const float y = (0.5f * x) * (1.0f + tanhf((0.79788456080286535587989211986876f * x) * inner));
        _Float16 r = (_Float16)y;
        memcpy(&g_gelu[i], &r, 2);
    }
}

/* gu: rows of gate | up (each `ld` wide, halves n wide); out [t][n]. */
void mvk_geglu(const float *gu, int64_t t, int64_t n, int64_t ld, float *out) {
    pthread_once(&g_gelu_once, gelu_table);
    for (int64_t r = 0; r < t; r++) {
        const float *x = gu + r * ld, *g = x + n;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef MVK_AVX512
        /* 16 at a time: the same float16 rounding of x, table entry and products */
        for (; i + 16 <= n; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i), gv = _mm512_loadu_ps(g + i);
            const __m512i idx = _mm512_cvtepu16_epi32(
                _mm512_cvtps_ph(xv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m512i raw = _mm512_i32gather_epi32(idx, (const void *)g_gelu, 2);
            const __m512 y = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
            __m512 res = _mm512_mul_ps(y, gv);
            res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xv, _mm512_set1_ps(10.0f), _CMP_GE_OQ),
                                       res, _mm512_mul_ps(xv, gv));
            res = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xv, _mm512_set1_ps(-10.0f), _CMP_NLE_UQ),
                                      res);
            _mm512_storeu_ps(o + i, res);
        }
#endif
        for (; i < n; i++) {
            if (x[i] <= -10.0f) {
                o[i] = 0.0f;
            } else if (x[i] >= 10.0f) {
                o[i] = x[i] * g[i];
            } else {
                _Float16 hx = (_Float16)x[i], hy;
                uint16_t k;
                memcpy(&k, &hx, 2);
                memcpy(&hy, &g_gelu[k], 2);
                o[i] = (float)hy * g[i];
            }
        }
    }
}

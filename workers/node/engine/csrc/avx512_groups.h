/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX-512: rows of the per-group format (MVK_ARITH_GROUPS). */

#ifdef MVK_AVX512
/* Four scales from element i of a float16 (or float32) array. */
static inline __m128 scales4(const void *p, int64_t i, int f32) {
    if (f32) return _mm_loadu_ps((const float *)p + i);
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i)));
}

static inline __m512 scales16(const void *p, int64_t i, __mmask16 m, int f32) {
    if (f32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
}

/* Row tr of group G's 16 outputs (rows 16G..16G+15, fewer in the last group): r, plus
 * the product's addend where it has one, stored. Every tile ends here. */
static inline void store_group(const mvk_job *j, int64_t G, int64_t tr, __m512 r) {
    const int64_t r0 = 16 * G;
    const __mmask16 m = tail_mask(j->n - r0);
    if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
    _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
}

/* A row's 8 lane sums added in hsum_float_8's pairing ((0+4)+(2+6)) + ((1+5)+(3+7)): the
 * order llama.cpp adds them in, so the exact path's bits. */
static inline __m512 sum8(const __m512 L[8]) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(L[0], L[4]), _mm512_add_ps(L[2], L[6])),
                         _mm512_add_ps(_mm512_add_ps(L[1], L[5]), _mm512_add_ps(L[3], L[7])));
}

/* sum_g min[g] * sums[g] (or -zero * sum_g scale[g] * sums[g]) over ns groups */
static inline float min_term(const mvk_job *j, const void *sc, const void *mn,
                             int64_t off, const float *sm, int64_t ns) {
    const void *v = mn ? mn : sc;
    __m512 macc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= ns; g += 16)
        macc = _mm512_fmadd_ps(scales16(v, off + g, 0xffff, j->f32), _mm512_loadu_ps(sm + g),
                               macc);
    if (g < ns) {
        __mmask16 m = (__mmask16)((1u << (ns - g)) - 1u);
        macc = _mm512_fmadd_ps(scales16(v, off + g, m, j->f32), _mm512_maskz_loadu_ps(m, sm + g),
                               macc);
    }
    float r = _mm512_reduce_add_ps(macc);
    return mn ? r : -(float)j->zero * r;
}

/* Rows [n0, n1) of the job for activation rows [t0, t0 + TT). */
static inline __attribute__((always_inline)) void rows_simd(const mvk_job *j, int64_t n0,
                                                            int64_t n1, int64_t t0,
                                                            const int TT) {
    const int64_t kp = j->kp, ns = kp / j->sub;
    const int64_t row_bytes = j->nibble ? kp / 2 : kp;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* lane -> scale index within a chunk */
    const __m512i idx_a = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i idx_b = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i idx_q = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const float *sums = j->sub == 16 ? j->s16 : j->s32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->codes + n * row_bytes;
        const void *sc = j->scale, *mn = j->min;
        const int64_t off = n * ns;
        const int f32 = j->f32;
        __m512 acc[TILE];
        for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
        /* Two accumulators per activation row (the fmadd chain's latency bounds one). */
        __m512 acc2[TILE];
        for (int t = 0; t < TT; t++) acc2[t] = _mm512_setzero_ps();
        if (j->nibble) { /* sub 32; 128 elements per chunk */
            for (int64_t c = 0; c < kp / 128; c++) {
                __m512i v = _mm512_loadu_si512(w + 64 * c);
                __m512i lo = _mm512_and_si512(v, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                __m512 s4 = _mm512_castps128_ps512(scales4(sc, off + 4 * c, f32));
                __m512 sa = _mm512_permutexvar_ps(idx_a, s4);
                __m512 sb = _mm512_permutexvar_ps(idx_b, s4);
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 128 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 32 * c;
                    __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                     _mm512_loadu_si512(q));
                    __m512i ib = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi,
                                                     _mm512_loadu_si512(q + 64));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia),
                                             _mm512_mul_ps(sa, _mm512_loadu_ps(de)), acc[t]);
                    acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib),
                                              _mm512_mul_ps(sb, _mm512_loadu_ps(de + 16)), acc2[t]);
                }
            }
        } else { /* 64 elements per chunk: 2 groups of 32 or 4 of 16 */
            const __m512i idx = j->sub == 16 ? idx_q : idx_a;
            const int per = j->sub == 16 ? 4 : 2;
            const int64_t chunks = kp / 64;
            int64_t c = 0;
            for (; c + 2 <= chunks; c += 2) {
                __m512i v0 = _mm512_loadu_si512(w + 64 * c);
                __m512i v1 = _mm512_loadu_si512(w + 64 * c + 64);
                __m512 s0 = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scales4(sc, off + per * c, f32)));
                __m512 s1 = _mm512_permutexvar_ps(
                    idx, _mm512_castps128_ps512(scales4(sc, off + per * (c + 1), f32)));
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 64 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 16 * c;
                    __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0,
                                                     _mm512_loadu_si512(q));
                    __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v1,
                                                     _mm512_loadu_si512(q + 64));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0),
                                             _mm512_mul_ps(s0, _mm512_loadu_ps(de)), acc[t]);
                    acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1),
                                              _mm512_mul_ps(s1, _mm512_loadu_ps(de + 16)), acc2[t]);
                }
            }
            for (; c < chunks; c++) {
                __m512i v = _mm512_loadu_si512(w + 64 * c);
                __m512 s = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scales4(sc, off + per * c, f32)));
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 64 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 16 * c;
                    __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
                                                     _mm512_loadu_si512(q));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia),
                                             _mm512_mul_ps(s, _mm512_loadu_ps(de)), acc[t]);
                }
            }
        }
        for (int t = 0; t < TT; t++) acc[t] = _mm512_add_ps(acc[t], acc2[t]);
        for (int t = 0; t < TT; t++) {
            int64_t tr = t0 + t;
            float r = _mm512_reduce_add_ps(acc[t]) + min_term(j, sc, mn, off, sums + tr * ns, ns);
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}
#endif

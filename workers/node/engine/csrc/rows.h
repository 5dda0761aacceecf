/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). A chunk of a product's rows in this build: rows_generic (the builds
 * without AVX-512; the per-group format in plain C) and run_rows (every build). */

#ifndef MVK_AVX512
static void rows_generic(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    if (j->arith == MVK_ARITH_Q0R) {
#ifdef MVK_AVX2
        for (int64_t n = n0; n < n1; n++) {
            if (j->nibble && j->zrow && n % 8 == 0 && n + 8 <= n1) { /* 8 rows at once */
                rows8_avx2_q0r(j, n, t0, tt);
                n += 7;
            } else {
                rows_generic_q0r(j, n, n + 1, t0, tt);
            }
        }
#else
        rows_generic_q0r(j, n0, n1, t0, tt);
#endif
        return;
    }
    if (j->arith == MVK_ARITH_Q0) {
#ifdef MVK_AVX2
        rows_avx2_q0(j, n0, n1, t0, tt);
#else
        rows_generic_q0(j, n0, n1, t0, tt);
#endif
        return;
    }
    if (j->arith == MVK_ARITH_Q5K) { /* plain C in every build without AVX-512 */
        rows_generic_k(j, n0, n1, t0, tt);
        return;
    }
    if (j->arith == MVK_ARITH_Q4K || j->arith == MVK_ARITH_Q6K) {
#ifdef MVK_AVX2
        for (int64_t n = n0; n < n1; n++) {
            if (n % 8 == 0 && n + 8 <= n1) { /* 8 rows at once, one per lane */
                rows8_avx2_k(j, n, t0, tt);
                n += 7;
            } else {
                rows_generic_k(j, n, n + 1, t0, tt);
            }
        }
#else
        rows_generic_k(j, n0, n1, t0, tt);
#endif
        return;
    }
    const int64_t kp = j->kp, sub = j->sub, ns = kp / sub;
    const int64_t row_bytes = j->nibble ? kp / 2 : kp;
    const float *sums = sub == 16 ? j->s16 : j->s32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->codes + n * row_bytes;
        for (int t = 0; t < tt; t++) {
            int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc = 0.0f, macc = 0.0f;
            for (int64_t g = 0; g < ns; g++) {
                int32_t isum = 0;
                for (int64_t k = g * sub; k < (g + 1) * sub; k++) {
                    int32_t code;
                    if (j->nibble) {
                        int64_t c = k / 128, r = k % 128;
                        uint8_t b = w[64 * c + (r % 64)];
                        code = r < 64 ? (b & 15) : (b >> 4);
                    } else {
                        code = w[k];
                    }
                    isum += code * (int32_t)q[k];
                }
                int64_t i = n * ns + g;
                float scale = j->f32 ? ((const float *)j->scale)[i]
                                     : h2f(((const uint16_t *)j->scale)[i]);
                float mn = !j->min ? -(float)j->zero * scale
                           : j->f32 ? ((const float *)j->min)[i]
                                    : h2f(((const uint16_t *)j->min)[i]);
                acc += (float)isum * (scale * de[g * sub / 4]);
                macc += mn * sums[tr * ns + g];
            }
            float r = acc + macc;
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}
#endif

static void run_rows(const mvk_job *j, int64_t n0, int64_t n1) {
#ifdef MVK_AVX512
    if (arith_q0(j->arith) || arith_k(j->arith)) {
        rows_q0(j, n0, n1);
        return;
    }
#endif
    for (int64_t t0 = 0; t0 < j->t_rows; t0 += TILE) {
        int tt = (int)(j->t_rows - t0 < TILE ? j->t_rows - t0 : TILE);
#ifdef MVK_AVX512
        rows_simd_n(j, n0, n1, t0, tt);
#else
        rows_generic(j, n0, n1, t0, tt);
#endif
    }
}

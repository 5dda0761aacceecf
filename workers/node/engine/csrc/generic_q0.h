/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). Plain C: the Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows, in the AVX-512
 * tiles' order (the AVX2 build uses rows_generic_q0r and store_row_q0 too). */

#ifndef MVK_AVX512 /* the build without AVX-512: every row in plain C */
/* Row n of activation row tr of a Q0 product from its 8 lane sums: their pairing tree,
 * Q4_1's mins (no zero codes), the added term. */
static inline void store_row_q0(const mvk_job *j, int64_t n, int64_t tr, const float acc[8]) {
    const int64_t ns = j->kp / 32;
    float r = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    if (!j->zrow) {
        float summs = 0.0f;
        for (int64_t g = 0; g < ns; g++)
            summs = MVK_SUMMS(summs, param_q0(j, j->min, n, g), j->s32[tr * ns + g]);
        r += summs;
    }
    if (j->add) r += j->add[tr * j->ldadd + n];
    j->y[tr * j->ldy + n] = r;
}

/* MVK_ARITH_Q0R in plain C (the AVX2 build's too): q0r_tile's sums and chain. */
static void rows_generic_q0r(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc = 0.0f;
            for (int64_t g = 0; g < ns; g++) {
                const float d = param_q0(j, j->scale, n, g) * de[g * 8];
                int32_t isum = 0;
                for (int64_t k = g * 32; k < g * 32 + 32; k++)
                    isum += (code_q0(j, n, k) - zero) * (int32_t)q[k];
                acc = fmaf((float)isum, d, acc);
            }
            if (j->add) acc += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = acc;
        }
    }
}

#ifndef MVK_AVX2
/* MVK_ARITH_Q0 in plain C: the same lanes, chain and sums as rows_q0. */
static void rows_generic_q0(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        for (int t = 0; t < tt; t++) {
            int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc[8] = {0};
            for (int64_t g = 0; g < ns; g++) {
                float d = param_q0(j, j->scale, n, g) * de[g * 8];
                for (int l = 0; l < 8; l++) {
                    int32_t isum = 0;
                    for (int64_t k = g * 32 + 4 * l; k < g * 32 + 4 * l + 4; k++)
                        isum += (code_q0(j, n, k) - zero) * (int32_t)q[k];
                    acc[l] = fmaf((float)isum, d, acc[l]);
                }
            }
            store_row_q0(j, n, tr, acc);
        }
    }
}

#endif
#endif

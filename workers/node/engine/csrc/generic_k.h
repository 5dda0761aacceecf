/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). Plain C: the Q4_K / Q5_K / Q6_K rows, in the AVX-512 tiles' order. */

#ifndef MVK_AVX512
/* MVK_ARITH_Q4K and Q6K in plain C: the same integer sums, chains and lanes. */
static void rows_generic_k(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, nsb = kp / 256;
    const int q4 = j->arith == MVK_ARITH_Q4K, q5 = j->arith == MVK_ARITH_Q5K;
    for (int64_t n = n0; n < n1; n++) {
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const int32_t *qs = j->qs16 + tr * (kp / 16);
            float acc = 0.0f, accm = 0.0f, lacc[8] = {0};
            for (int64_t b = 0; b < nsb; b++) {
                const float dx = j->dxe[tr * kp / 4 + 64 * b];
                if (q4) { /* the interleaved layout (q4k_tile) */
                    const int64_t G = n / 16, r = n % 16, ns = kp / 32;
                    const uint8_t *sc = (const uint8_t *)j->ksc, *m = j->kmin;
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float kdmin = j->kdmin[(G * nsb + b) * 16 + r];
                    const int per64 = row_kind(j, tr) & MVK_ROW_PER64; /* see q4k_tile */
                    int32_t isum = 0, imin = 0;
                    for (int g = 0; g < 8; g++) {
                        const int64_t at = (G * ns + 8 * b + g) * 16 + r;
                        int32_t gs = 0;
                        for (int64_t k = 256 * b + 32 * g; k < 256 * b + 32 * g + 32; k++)
                            gs += code_q0(j, n, k) * (int32_t)q[k];
                        isum += sc[at] * gs;
                        imin += (int32_t)m[at] * (qs[16 * b + 2 * g] + qs[16 * b + 2 * g + 1]);
                        if (per64 && (g & 1)) {
                            acc = fmaf((float)isum, kd * dx, acc);
                            accm = fmaf((float)imin, kdmin * dx, accm);
                            isum = imin = 0;
                        }
                    }
                    if (!per64) {
                        acc = fmaf((float)isum, kd * dx, acc);
                        accm = fmaf((float)imin, kdmin * dx, accm);
                    }
                } else if (q5) { /* the interleaved byte layout (q5k_tile) */
                    const int64_t G = n / 16, r = n % 16, ns = kp / 32;
                    const uint8_t *sc = (const uint8_t *)j->ksc, *m = j->kmin;
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float kdmin = j->kdmin[(G * nsb + b) * 16 + r];
                    int32_t s1 = 0, s2 = 0, lane[8] = {0};
                    for (int g = 0; g < 8; g++) {
                        const int64_t at = (G * ns + 8 * b + g) * 16 + r;
                        for (int l = 0; l < 8; l++) {
                            int32_t ls = 0;
                            for (int64_t k = 256 * b + 32 * g + 4 * l; k < 256 * b + 32 * g + 4 * l + 4; k++)
                                ls += code_q0(j, n, k) * (int32_t)q[k];
                            lane[l] += sc[at] * ls;
                            s1 += sc[at] * ls;
                        }
                        s2 += (int32_t)m[at] * (qs[16 * b + 2 * g] + qs[16 * b + 2 * g + 1]);
                    }
                    /* 8 rows or more: llama.cpp's tiled K-quant GEMM (see q5k_tile) */
                    acc = fmaf(fmaf(-kdmin, (float)s2, (float)s1 * kd), dx, acc);
                    for (int l = 0; l < 8; l++) lacc[l] = fmaf(kd * dx, (float)lane[l], lacc[l]);
                    accm = fmaf(-(kdmin * dx), (float)s2, accm);
                } else { /* the interleaved layout (q6k_tile) */
                    const int64_t G = n / 16, r = n % 16;
                    const int8_t *scg = (const int8_t *)j->ksc + (G * (kp / 16) + 16 * b) * 16 + r;
#define SC(i) ((int32_t)scg[16 * (i)])
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float dd = kd * dx;
                    int32_t total = 0;
                    for (int l = 0; l < 8; l++) {
                        int32_t lane = 0;
                        for (int g = 0; g < 8; g++) {
                            int32_t ls = 0;
                            for (int64_t k = 256 * b + 32 * g + 4 * l; k < 256 * b + 32 * g + 4 * l + 4; k++)
                                ls += code_q0(j, n, k) * (int32_t)q[k];
                            lane += SC(2 * g + (l >= 4)) * ls;
                        }
                        lane -= 32 * (qs[16 * b + 2 * l] * SC(2 * l) + qs[16 * b + 2 * l + 1] * SC(2 * l + 1));
                        lacc[l] = fmaf(dd, (float)lane, lacc[l]);
                        total += lane;
                    }
#undef SC
                    /* 8 rows or more: llama.cpp's tiled K-quant GEMM (see q6k_tile) */
                    acc = fmaf(kd * (float)total, dx, acc);
                }
            }
            float r = q4                                ? acc - accm
                      : row_kind(j, tr) & MVK_ROW_TILED ? acc
                                       : ((lacc[0] + lacc[4]) + (lacc[2] + lacc[6])) +
                                             ((lacc[1] + lacc[5]) + (lacc[3] + lacc[7]));
            if (q5 && !(row_kind(j, tr) & MVK_ROW_TILED)) r += accm;
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}
#endif

/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX2: the Q4_K / Q6_K rows, 8 rows a vector. */

#ifdef MVK_AVX2
static inline __m256i bcast4_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* rows_generic_k's rows n..n+7 (n % 8 == 0) in AVX2, one row per int32 lane: the
 * interleaved layout's 32 bytes at 64c + 32h hold rows 8h..8h+7's 4 codes of lanes 2c
 * and 2c+1 (Q4_K's nibbles) or of lane c (Q6_K's bytes), so maddubs (codes <= 63,
 * |q| <= 127: no saturation) and madd give 8 rows' 4-element sums at once. Every integer
 * sum is rows_generic_k's (integers: any order), and every float operation its own, in
 * its order, lane for lane. */
static void rows8_avx2_k(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, nsb = kp / 256, ns = kp / 32, ns16 = kp / 16;
    const int64_t G = n / 16, h = (n % 16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *qx = j->qx + tr * kp;
        const int32_t *qs = j->qs16 + tr * ns16;
        const int kind = row_kind(j, tr);
        __m256 r;
        if (j->arith == MVK_ARITH_Q4K) {
            const uint8_t *wg = j->codes + G * ns * 256 + 32 * h;
            const int per64 = kind & MVK_ROW_PER64;
            __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const __m256 dx = _mm256_set1_ps(j->dxe[tr * kp / 4 + 64 * b]);
                const __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(j->kd + (G * nsb + b) * 16 + 8 * h), dx);
                const __m256 ddm = _mm256_mul_ps(_mm256_loadu_ps(j->kdmin + (G * nsb + b) * 16 + 8 * h), dx);
                __m256i isum = _mm256_setzero_si256(), imin = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const int64_t sb = 8 * b + g, at = (G * ns + sb) * 16 + 8 * h;
                    int64_t s8, m8;
                    memcpy(&s8, (const uint8_t *)j->ksc + at, 8);
                    memcpy(&m8, j->kmin + at, 8);
                    const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(s8));
                    const __m256i mn = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m8));
                    const int8_t *q = qx + 32 * sb;
                    if (t == 0) prefetch_ahead(wg + sb * 256 - 32 * h, 256);
                    __m256i e = _mm256_setzero_si256();
                    for (int c = 0; c < 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + sb * 256 + 64 * c));
                        const __m256i lo = _mm256_and_si256(v, m4);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4_avx2(q + 8 * c)),
                                                           _mm256_maddubs_epi16(hi, bcast4_avx2(q + 8 * c + 4)));
                        e = _mm256_add_epi32(e, _mm256_madd_epi16(p, ones16));
                    }
                    isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(e, sc));
                    imin = _mm256_add_epi32(imin, _mm256_mullo_epi32(mn, _mm256_set1_epi32(qs[2 * sb] + qs[2 * sb + 1])));
                    if (per64 ? (g & 1) : g == 7) {
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc);
                        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), ddm, accm);
                        isum = imin = _mm256_setzero_si256();
                    }
                }
            }
            r = _mm256_sub_ps(acc, accm);
        } else { /* MVK_ARITH_Q6K */
            const uint8_t *wg = j->codes + G * ns * 384 + 32 * h; /* 6 bits a code */
            const int8_t *ksc = (const int8_t *)j->ksc + G * ns16 * 16 + 8 * h;
            const int tiled = kind & MVK_ROW_TILED;
            __m256 lacc[8], acc = _mm256_setzero_ps();
            for (int l = 0; l < 8; l++) lacc[l] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const float dx = j->dxe[tr * kp / 4 + 64 * b];
                const __m256 kd = _mm256_loadu_ps(j->kd + (G * nsb + b) * 16 + 8 * h);
                __m256i sc[16];
                for (int s = 0; s < 16; s++) {
                    int64_t s8;
                    memcpy(&s8, ksc + (16 * b + s) * 16, 8);
                    sc[s] = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(s8));
                }
                __m256i lane[8];
                for (int l = 0; l < 8; l++) lane[l] = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    const uint8_t *w = wg + (8 * b + p) * 384;
                    const int8_t *q = qx + 256 * b + 32 * p;
                    if (t == 0) prefetch_ahead(w - 32 * h, 384);
                    for (int l = 0; l < 8; l++) {
                        const __m256i lo4 = _mm256_loadu_si256((const __m256i *)(w + 64 * (l / 2)));
                        const __m256i hi2 = _mm256_loadu_si256((const __m256i *)(w + 256 + 64 * (l / 4)));
                        const __m256i lo = (l & 1) ? _mm256_and_si256(_mm256_srli_epi16(lo4, 4), m4)
                                                   : _mm256_and_si256(lo4, m4);
                        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hi2, 2 * (l % 4)),
                                                            _mm256_set1_epi8(3));
                        const __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
                        const __m256i ls = _mm256_madd_epi16(_mm256_maddubs_epi16(v, bcast4_avx2(q + 4 * l)), ones16);
                        lane[l] = _mm256_add_epi32(lane[l], _mm256_mullo_epi32(sc[2 * p + (l >= 4)], ls));
                    }
                }
                __m256i total = _mm256_setzero_si256();
                for (int l = 0; l < 8; l++) {
                    const __m256i sub = _mm256_add_epi32(
                        _mm256_mullo_epi32(_mm256_set1_epi32(qs[16 * b + 2 * l]), sc[2 * l]),
                        _mm256_mullo_epi32(_mm256_set1_epi32(qs[16 * b + 2 * l + 1]), sc[2 * l + 1]));
                    lane[l] = _mm256_sub_epi32(lane[l], _mm256_slli_epi32(sub, 5));
                    total = _mm256_add_epi32(total, lane[l]);
                }
                if (tiled) {
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(kd, _mm256_cvtepi32_ps(total)), _mm256_set1_ps(dx), acc);
                } else {
                    const __m256 dd = _mm256_mul_ps(kd, _mm256_set1_ps(dx));
                    for (int l = 0; l < 8; l++)
                        lacc[l] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lane[l]), lacc[l]);
                }
            }
            r = tiled ? acc
                      : _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lacc[0], lacc[4]), _mm256_add_ps(lacc[2], lacc[6])),
                                      _mm256_add_ps(_mm256_add_ps(lacc[1], lacc[5]), _mm256_add_ps(lacc[3], lacc[7])));
        }
        if (j->add) r = _mm256_add_ps(r, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, r);
    }
}
#endif

/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX2: the Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows, 8 rows a vector. */

#ifdef MVK_AVX2
/* rows_generic_q0 in AVX2. Lane l of group g sums the 4 products of elements 4l..4l+3
 * (integers: any order gives the same sum); the 8 lanes are one __m256, each lane's
 * chain the same fused multiply-adds as the plain C, and the same final sum. */
static inline __m256i codes32_q0(const mvk_job *j, int64_t at, int64_t r) {
    if (j->nibble) { /* lanes 2p (low nibbles) and 2p+1 (high) in bytes 64p + 4r.. */
        const uint8_t *b = j->codes + at * 256 + 4 * r;
        uint32_t w0, w1, w2, w3;
        memcpy(&w0, b, 4);
        memcpy(&w1, b + 64, 4);
        memcpy(&w2, b + 128, 4);
        memcpy(&w3, b + 192, 4);
        const __m128i v = _mm_set_epi32((int)w3, (int)w2, (int)w1, (int)w0);
        const __m128i m = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
        return _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
    }
    uint32_t w[8];
    if (j->bits5) { /* 5 bits a code (see unpack5) */
        const uint8_t *b = j->codes + at * 320 + 4 * r;
        uint32_t hb;
        memcpy(&hb, b + 256, 4);
        for (int l = 0; l < 8; l++) {
            uint32_t v;
            memcpy(&v, b + 64 * (l / 2), 4);
            v = (l & 1) ? (v >> 4) & 0x0f0f0f0fu : v & 0x0f0f0f0fu;
            w[l] = v | (((hb >> l) & 0x01010101u) << 4);
        }
        return _mm256_set_epi32((int)w[7], (int)w[6], (int)w[5], (int)w[4], (int)w[3], (int)w[2],
                                (int)w[1], (int)w[0]);
    }
    const uint8_t *b = j->codes + at * 512 + 4 * r; /* lane l in bytes 64l + 4r.. */
    for (int l = 0; l < 8; l++) memcpy(&w[l], b + 64 * l, 4);
    return _mm256_set_epi32((int)w[7], (int)w[6], (int)w[5], (int)w[4], (int)w[3], (int)w[2],
                            (int)w[1], (int)w[0]);
}

/* 8 rows' float16 (or float32) parameters of one group, from element i on. */
static inline __m256 params8_avx2(const mvk_job *j, const void *p, int64_t i) {
    if (j->f32) return _mm256_loadu_ps((const float *)p + i);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    float v[8];
    for (int r = 0; r < 8; r++) v[r] = h2f(((const uint16_t *)p)[i + r]);
    return _mm256_loadu_ps(v);
#endif
}

/* Piece p (64 bytes) of a nibble block's codes for 8 rows, one row per 32-bit lane (low
 * nibbles: lane 2p, high: 2p + 1), against the block's activation codes q: the two lanes'
 * broadcast activations (x0, x1) and each row's 4-element dot products (i0, i1). */
static inline void nibble_dots_avx2(const uint8_t *b, const int8_t *q, int p, __m256i *x0,
                                    __m256i *x1, __m256i *i0, __m256i *i1) {
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 64 * p));
    const __m256i lo = _mm256_and_si256(w, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    int32_t a0, a1;
    memcpy(&a0, q + 8 * p, 4);
    memcpy(&a1, q + 8 * p + 4, 4);
    *x0 = _mm256_set1_epi32(a0);
    *x1 = _mm256_set1_epi32(a1);
    *i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, *x0), ones16);
    *i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, *x1), ones16);
}

/* Each 32-bit lane's 4 int8 activations summed (a zero code's correction is zero * sum). */
static inline __m256i sum4_avx2(__m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
}

/* rows n..n+7 (n % 8 == 0) of a Q0 product, one row per float lane. 4-bit codes: the
 * group's 16-row block holds, for lanes 2p and 2p+1, each row's 4 codes in 4 bytes at
 * 64p + 4r, so 8 rows' codes for two lanes are one 32-byte load. Byte codes (with a zero
 * code per row): lane l's at 64l + 4r, taken less the row's zero as int8 (Q8_0's
 * code - 128 and Q5_0's code - 16 fit) and multiplied by maddubs on their magnitude
 * and the activations' sign flipped by theirs (|w| <= 128, |q| <= 127: no saturation).
 * Each row's lane sums, chains and final sum are rows_generic_q0's, lane for lane (vector
 * adds are the same IEEE adds). */
static void rows8_avx2_q0(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32, base = (n / 16) * ns, h = (n % 16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    const __m256i ones8 = _mm256_set1_epi8(1);
    __m256i zv = _mm256_setzero_si256();
    if (j->zrow) {
        int64_t z8;
        memcpy(&z8, j->zrow + n, 8);
        zv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8));
    }
    const __m256i zb = _mm256_mullo_epi32(zv, _mm256_set1_epi32(0x01010101)); /* per byte */
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *q = j->qx + tr * kp;
        const float *de = j->dxe + tr * kp / 4;
        __m256 acc[8];
        for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) {
            const int64_t at = base + g;
            const __m256 d = _mm256_mul_ps(params8_avx2(j, j->scale, at * 16 + 8 * h),
                                           _mm256_set1_ps(de[g * 8]));
            if (!j->nibble) {
                const uint8_t *b = j->codes + at * (j->bits5 ? 320 : 512) + 32 * h;
                if (t == 0) prefetch_ahead(b - 32 * h, j->bits5 ? 320 : 512);
                for (int l = 0; l < 8; l++) {
                    __m256i c;
                    if (j->bits5) { /* 5 bits a code (see unpack5) */
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * (l / 2)));
                        const __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 256));
                        const __m256i lo = (l & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)
                                                   : _mm256_and_si256(v, m4);
                        c = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, l), ones8), 4));
                    } else {
                        c = _mm256_loadu_si256((const __m256i *)(b + 64 * l));
                    }
                    const __m256i w = _mm256_sub_epi8(c, zb);
                    int32_t a;
                    memcpy(&a, q + g * 32 + 4 * l, 4);
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
                    const __m256i i = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), x), ones16);
                    acc[l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), d, acc[l]);
                }
                continue;
            }
            const uint8_t *b = j->codes + at * 256 + 32 * h;
            if (t == 0) prefetch_ahead(b - 32 * h, 256);
            for (int p = 0; p < 4; p++) {
                __m256i x0, x1, i0, i1;
                nibble_dots_avx2(b, q + g * 32, p, &x0, &x1, &i0, &i1);
                if (j->zrow) {
                    i0 = _mm256_sub_epi32(i0, _mm256_mullo_epi32(zv, sum4_avx2(x0)));
                    i1 = _mm256_sub_epi32(i1, _mm256_mullo_epi32(zv, sum4_avx2(x1)));
                }
                acc[2 * p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), d, acc[2 * p]);
                acc[2 * p + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), d, acc[2 * p + 1]);
            }
        }
        __m256 r = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
            _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
        if (!j->zrow) {
            __m256 summs = _mm256_setzero_ps();
            for (int64_t g = 0; g < ns; g++)
                summs = _mm256_fmadd_ps(params8_avx2(j, j->min, (base + g) * 16 + 8 * h),
                                        _mm256_set1_ps(j->s32[tr * ns + g]), summs);
            r = _mm256_add_ps(r, summs);
        }
        if (j->add) r = _mm256_add_ps(r, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, r);
    }
}

/* MVK_ARITH_Q0R (4-bit codes with a zero code: Q4_0) for rows n..n+7, one row per float
 * lane: rows8_avx2_q0's lane sums added as integers per block, then one fused
 * multiply-add per block (rows_generic_q0r's chain). */
static void rows8_avx2_q0r(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32, base = (n / 16) * ns, h = (n % 16) / 8;
    int64_t z8;
    memcpy(&z8, j->zrow + n, 8);
    const __m256i zv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8));
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *q = j->qx + tr * kp;
        const float *de = j->dxe + tr * kp / 4;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) {
            const int64_t at = base + g;
            const __m256 d = _mm256_mul_ps(params8_avx2(j, j->scale, at * 16 + 8 * h),
                                           _mm256_set1_ps(de[g * 8]));
            const uint8_t *b = j->codes + at * 256 + 32 * h;
            __m256i isum = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                __m256i x0, x1, i0, i1;
                nibble_dots_avx2(b, q + g * 32, p, &x0, &x1, &i0, &i1);
                const __m256i s = _mm256_add_epi32(sum4_avx2(x0), sum4_avx2(x1));
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(i0, i1));
                isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(zv, s));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc);
        }
        if (j->add) acc = _mm256_add_ps(acc, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, acc);
    }
}

static void rows_avx2_q0(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256i ones8 = _mm256_set1_epi8(1);
    /* 4-bit codes times int8 activations (|q| <= 127) cannot saturate maddubs' int16
     * pair sums (2 x 15 x 127); wider codes go through int16 products (madd). */
    const int narrow = j->nibble;
    for (int64_t n = n0; n < n1; n++) {
        if ((narrow || j->zrow) && n % 8 == 0 && n + 8 <= n1) { /* 8 rows, one per lane */
            rows8_avx2_q0(j, n, t0, tt);
            n += 7;
            continue;
        }
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        const __m256i vzero = _mm256_set1_epi32(zero);
        const int64_t base = (n / 16) * ns, r = n % 16;
        __m256 acc[TILE];
        for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) { /* a group's codes once, for every row t */
            const __m256i c = codes32_q0(j, base + g, r);
            const __m256i ca = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c));
            const __m256i cb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1));
            const float scale = param_q0(j, j->scale, n, g);
            for (int t = 0; t < tt; t++) {
                const int64_t tr = t0 + t;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(j->qx + tr * kp + g * 32));
                __m256i isum; /* lane l: the sum over elements 4l..4l+3, lanes in order */
                if (narrow) {
                    isum = _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones16);
                    if (zero) {
                        const __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones16);
                        isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(vzero, xs));
                    }
                } else {
                    const __m256i xa = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x));
                    const __m256i xb = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
                    isum = _mm256_hadd_epi32(_mm256_madd_epi16(ca, xa), _mm256_madd_epi16(cb, xb));
                    if (zero) {
                        const __m256i xs = _mm256_hadd_epi32(_mm256_madd_epi16(xa, ones16),
                                                             _mm256_madd_epi16(xb, ones16));
                        isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(vzero, xs));
                    }
                    isum = _mm256_permute4x64_epi64(isum, 0xD8); /* 0,1,4,5,2,3,6,7 -> 0..7 */
                }
                const float d = scale * j->dxe[tr * kp / 4 + g * 8];
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc[t]);
            }
        }
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            float a[8];
            _mm256_storeu_ps(a, acc[t]);
            store_row_q0(j, n, tr, a);
        }
    }
}
#endif

/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). float16 to float, and one code, scale or min of the interleaved layout
 * at a time: the plain C products' reads (the AVX2 ones' where they go row by row). */

static inline float h2f(uint16_t h) {
#if defined(__F16C__) && (defined(MVK_AVX512) || defined(MVK_AVX2))
    return _cvtsh_ss(h); /* exact, as the bit manipulation below */
#endif
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {
        if (m == 0) {
            bits = sign;
        } else { /* subnormal */
            float f = ldexpf((float)m, -24);
            return sign ? -f : f;
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int32_t code_at(const mvk_job *j, const uint8_t *w, int64_t k) {
    if (!j->nibble) return w[k];
    int64_t c = k / 128, r = k % 128;
    uint8_t b = w[64 * c + (r % 64)];
    return r < 64 ? (b & 15) : (b >> 4);
}

/* MVK_ARITH_Q0's interleaved layout (see rows_q0): code k of row n, a scale or min of
 * row n's block g. */
static inline int32_t code_q0(const mvk_job *j, int64_t n, int64_t k) {
    const int64_t ns = j->kp / 32, at = (n / 16) * ns + k / 32, l = (k % 32) / 4;
    const int64_t byte = 4 * (n % 16) + k % 4;
    if (j->arith == MVK_ARITH_Q6K) { /* 6 bits a code (see unpack6) */
        const uint8_t *p = j->codes + at * 384;
        const uint8_t lo = p[64 * (l / 2) + byte], hi = p[256 + 64 * (l / 4) + byte];
        return ((l & 1) ? lo >> 4 : lo & 15) | (((hi >> (2 * (l % 4))) & 3) << 4);
    }
    if (j->bits5) { /* 5 bits a code (see unpack5) */
        const uint8_t *p = j->codes + at * 320;
        const uint8_t lo = p[64 * (l / 2) + byte];
        return ((l & 1) ? lo >> 4 : lo & 15) | (((p[256 + byte] >> l) & 1) << 4);
    }
    if (!j->nibble) return j->codes[at * 512 + 64 * l + byte];
    const uint8_t v = j->codes[at * 256 + 64 * (l / 2) + byte];
    return (l & 1) ? v >> 4 : v & 15;
}

static inline float param_q0(const mvk_job *j, const void *p, int64_t n, int64_t g) {
    const int64_t i = ((n / 16) * (j->kp / 32) + g) * 16 + n % 16;
    return j->f32 ? ((const float *)p)[i] : h2f(((const uint16_t *)p)[i]);
}

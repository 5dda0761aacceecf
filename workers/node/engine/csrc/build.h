/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). A stage's load: the interleaved layouts of Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0,
 * Q5_1 and Q8_0 matrices built straight from their GGUF blocks (mvk_build_q4k,
 * mvk_build_q5k, mvk_build_q6k, mvk_build_q0), byte for byte what kernels.py's
 * native_layout builds from the decoded codes, in one pass over the blocks. */

/* A 16-row group's 32 codes of row r in `bits` bits a code (4, 5 or 8) at `out` (a
 * block's piece): 8, lane l's 4 codes at byte 64 l + 4 r; 4, lanes 2c and 2c + 1 as the
 * low and high nibbles of bytes 64 c + 4 r..; 5, the low nibbles as 4 then 64 bytes whose
 * bit l of byte 256 + 4 r + i is code 4 l + i's fifth bit (qmm.c unpack5). */
static inline void put_codes(const uint8_t q[32], int bits, int r, uint8_t *out) {
    out += 4 * r;
    if (bits == 8) {
        for (int l = 0; l < 8; l++) memcpy(out + 64 * l, q + 4 * l, 4);
        return;
    }
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++)
            out[64 * c + i] = (uint8_t)((q[8 * c + i] & 15) | ((q[8 * c + 4 + i] & 15) << 4));
    if (bits == 5)
        for (int i = 0; i < 4; i++) {
            uint8_t plane = 0;
            for (int l = 0; l < 8; l++) plane |= (uint8_t)(((q[4 * l + i] >> 4) & 1) << l);
            out[256 + i] = plane;
        }
}

/* Code m (0..31) of 32-element sub-block j (0..7) of a Q4_K block's 128 code bytes: the
 * low nibbles of 32 bytes hold sub-block 2i, their high nibbles sub-block 2i + 1. */
static inline uint8_t q4k_code(const uint8_t *qs, int j, int m) {
    const uint8_t v = qs[(j / 2) * 32 + m];
    return (j & 1) ? (uint8_t)(v >> 4) : (uint8_t)(v & 15);
}

/* A Q4_K or Q5_K block's d and dmin (its first 4 bytes, float16) as float32. */
static inline void k_d_dmin(const uint8_t *blk, float *d, float *dmin) {
    uint16_t h;
    memcpy(&h, blk, 2);
    *d = h2f(h);
    memcpy(&h, blk + 2, 2);
    *dmin = h2f(h);
}

/* Sub-block j's 6-bit scale and min from a Q4_K or Q5_K block's 12 scale bytes. */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Sub-block j's 32 low nibbles (qs as Q4_K's, also Q5_K's) into a tile row's 4 vectors
 * at ``out`` (vector c: lanes 2c and 2c + 1 as low and high nibbles, 4 codes a row). */
static inline void put_k_nibbles(const uint8_t *qs, int j, uint8_t *out) {
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++)
            out[64 * c + i] =
                (uint8_t)(q4k_code(qs, j, 8 * c + i) | (q4k_code(qs, j, 8 * c + 4 + i) << 4));
}

/* Rows [0, n) (n a multiple of 16) of a Q4_K matrix of k inputs (a multiple of 256),
 * its blocks at `raw` (row-major, 144 bytes each), into the q4k_tile layout: codes
 * [n / 16][k / 32][256] (vector c of a sub-block: lanes 2c and 2c + 1 as low and high
 * nibbles, row r's 4 codes at byte 4r), ksc and kmin [n / 16][k / 32][16] (the 6-bit
 * scales and mins), kd and kdmin [n / 16][k / 256][16] (float32). */
void mvk_build_q4k(const uint8_t *raw, int64_t n, int64_t k, uint8_t *codes, uint8_t *ksc,
                   uint8_t *kmin, float *kd, float *kdmin) {
    const int64_t nb = k / 256, ns = k / 32;
    for (int64_t G = 0; G < n / 16; G++)
        for (int r = 0; r < 16; r++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = raw + ((G * 16 + r) * nb + b) * 144;
                k_d_dmin(blk, &kd[(G * nb + b) * 16 + r], &kdmin[(G * nb + b) * 16 + r]);
                const uint8_t *s = blk + 4, *qs = blk + 16;
                for (int j = 0; j < 8; j++) {
                    const int64_t at = (G * ns + 8 * b + j) * 16 + r;
                    k_scale_min(s, j, &ksc[at], &kmin[at]);
                    put_k_nibbles(qs, j, codes + (G * ns + 8 * b + j) * 256 + 4 * r);
                }
            }
}

/* Rows [0, n) of a Q5_K matrix (blocks of 176 bytes: d, dmin, Q4_K's 12 scale bytes,
 * qh[32], qs[128]; code m of sub-block j: qs[(j / 2) * 32 + m]'s nibble j & 1, bit j of
 * qh[m] its fifth) into the q5k_tile layout: codes [n / 16][k / 32][320] (put_codes' 5
 * bits, written here straight from qs and qh), ksc, kmin, kd and kdmin as Q4_K's. */
void mvk_build_q5k(const uint8_t *raw, int64_t n, int64_t k, uint8_t *codes, uint8_t *ksc,
                   uint8_t *kmin, float *kd, float *kdmin) {
    const int64_t nb = k / 256, ns = k / 32;
    for (int64_t G = 0; G < n / 16; G++)
        for (int r = 0; r < 16; r++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = raw + ((G * 16 + r) * nb + b) * 176;
                k_d_dmin(blk, &kd[(G * nb + b) * 16 + r], &kdmin[(G * nb + b) * 16 + r]);
                const uint8_t *s = blk + 4, *qh = blk + 16, *qs = blk + 48;
                /* byte l of hy[i]: qh[4 l + i], whose bit j is the fifth bit of code
                 * 4 l + i of sub-block j */
                uint64_t hy[4];
                for (int i = 0; i < 4; i++) {
                    hy[i] = 0;
                    for (int l = 0; l < 8; l++) hy[i] |= (uint64_t)qh[4 * l + i] << (8 * l);
                }
                for (int j = 0; j < 8; j++) {
                    const int64_t at = (G * ns + 8 * b + j) * 16 + r;
                    k_scale_min(s, j, &ksc[at], &kmin[at]);
                    uint8_t *out = codes + (G * ns + 8 * b + j) * 320 + 4 * r;
                    put_k_nibbles(qs, j, out);
                    /* put_codes' fifth-bit byte: bit j of byte l moved to bit l (the
                     * products of the multiply land on distinct bits: no carries) */
                    for (int i = 0; i < 4; i++)
                        out[256 + i] = (uint8_t)((((hy[i] >> j) & 0x0101010101010101ull) *
                                                  0x0102040810204080ull) >> 56);
                }
            }
}

/* A Q6_K block's 256 codes (0..63) from ql[128] and qh[64], as llama.cpp's
 * dequantize_row_q6_K reads them. */
static inline void q6k_codes(const uint8_t *ql, const uint8_t *qh, uint8_t q[256]) {
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, q += 128)
        for (int m = 0; m < 32; m++) {
            q[m] = (uint8_t)((ql[m] & 15) | ((qh[m] & 3) << 4));
            q[m + 32] = (uint8_t)((ql[m + 32] & 15) | (((qh[m] >> 2) & 3) << 4));
            q[m + 64] = (uint8_t)((ql[m] >> 4) | (((qh[m] >> 4) & 3) << 4));
            q[m + 96] = (uint8_t)((ql[m + 32] >> 4) | (((qh[m] >> 6) & 3) << 4));
        }
}

/* Rows [0, n) of a Q6_K matrix (blocks of 210 bytes: ql, qh, 16 int8 scales, d) into the
 * q6k_tile layout: codes [n / 16][k / 32][Q6K_PIECE] (unpack6's: the low nibbles as
 * Q4_K's, then vector h's byte 4r + e holding the high 2 bits of lanes 4h..4h+3 of row r,
 * lane 4h + i in bits 2i, 2i + 1), ksc [n / 16][k / 16][16] (int8), kd [n / 16][k / 256]
 * [16] (float32). */
void mvk_build_q6k(const uint8_t *raw, int64_t n, int64_t k, uint8_t *codes, int8_t *ksc,
                   float *kd) {
    const int64_t nb = k / 256, ns = k / 32, ns16 = k / 16;
    for (int64_t G = 0; G < n / 16; G++)
        for (int r = 0; r < 16; r++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = raw + ((G * 16 + r) * nb + b) * 210;
                uint16_t h;
                memcpy(&h, blk + 208, 2);
                kd[(G * nb + b) * 16 + r] = h2f(h);
                for (int s = 0; s < 16; s++)
                    ksc[(G * ns16 + 16 * b + s) * 16 + r] = (int8_t)blk[192 + s];
                uint8_t qb[256];
                q6k_codes(blk, blk + 128, qb);
                for (int p = 0; p < 8; p++) {
                    const uint8_t *q = qb + 32 * p;
                    uint8_t *out = codes + (G * ns + 8 * b + p) * 384 + 4 * r;
                    for (int c = 0; c < 4; c++)
                        for (int i = 0; i < 4; i++)
                            out[64 * c + i] = (uint8_t)((q[8 * c + i] & 15) | ((q[8 * c + 4 + i] & 15) << 4));
                    /* lane 4hh + i of row r: bits 2i, 2i + 1 of byte 256 + 64 hh + 4r + e */
                    for (int hh = 0; hh < 2; hh++)
                        for (int e = 0; e < 4; e++)
                            out[256 + 64 * hh + e] = (uint8_t)(
                                ((q[16 * hh + e] >> 4) & 3) | (((q[16 * hh + 4 + e] >> 4) & 3) << 2) |
                                (((q[16 * hh + 8 + e] >> 4) & 3) << 4) |
                                (((q[16 * hh + 12 + e] >> 4) & 3) << 6));
                }
            }
}

/* Rows [0, n) of a Q4_0 (src 0), Q8_0 (1), Q5_0 (2), Q4_1 (3) or Q5_1 (4) matrix (blocks
 * of 18, 34, 22, 20, 24 bytes: a float16 d, Q4_1/Q5_1 a float16 m, Q5_0/Q5_1 a 32-bit qh,
 * then 16 bytes of nibbles or Q8_0's 32 int8 codes; element j of a block in qs[j]'s low
 * nibble, j + 16 in its high one, bit j of qh its fifth) into rows_q0's interleaved
 * layout in `bits` bits a code (4, 5 or 8, put_codes; the widest of a fused run's
 * formats): codes [n / 16][k / 32][256, 320 or 512] (Q8_0: code + 128 as a byte), scales
 * and (Q4_1, Q5_1) mins [n / 16][k / 32][16] (d's and m's float16 bits). */
static inline __attribute__((always_inline)) void build_q0(const uint8_t *raw, int64_t n,
                                                            int64_t k, const int src,
                                                            const int bits, uint8_t *codes,
                                                            uint16_t *scales, uint16_t *mins) {
    static const int sizes[5] = {18, 34, 22, 20, 24};
    const int64_t ns = k / 32, size = sizes[src], piece = bits == 8 ? 512 : bits == 5 ? 320 : 256;
    const int with_m = src >= 3, with_h = src == 2 || src == 4;
    for (int64_t G = 0; G < n / 16; G++)
        for (int r = 0; r < 16; r++)
            for (int64_t b = 0; b < ns; b++) {
                const uint8_t *blk = raw + ((G * 16 + r) * ns + b) * size;
                memcpy(scales + (G * ns + b) * 16 + r, blk, 2);
                if (with_m) memcpy(mins + (G * ns + b) * 16 + r, blk + 2, 2);
                uint8_t q[32];
                if (src == 1) {
                    for (int e = 0; e < 32; e++) q[e] = (uint8_t)((int)(int8_t)blk[2 + e] + 128);
                } else {
                    uint32_t qh = 0;
                    const uint8_t *qs = blk + 2 + 2 * with_m;
                    if (with_h) {
                        memcpy(&qh, qs, 4); /* little-endian, as ggml reads it */
                        qs += 4;
                    }
                    for (int e = 0; e < 16; e++) {
                        q[e] = (uint8_t)((qs[e] & 15) | (((qh >> e) & 1) << 4));
                        q[e + 16] = (uint8_t)((qs[e] >> 4) | (((qh >> (e + 16)) & 1) << 4));
                    }
                }
                put_codes(q, bits, r, codes + (G * ns + b) * piece);
            }
}

/* build_q0 for each format and width as its own loop (constant src and bits: 5-10x faster
 * than one loop that tests them for every block). */
void mvk_build_q0(const uint8_t *raw, int64_t n, int64_t k, int src, int bits, uint8_t *codes,
                  uint16_t *scales, uint16_t *mins) {
#define Q0_SRC(S)                                                            \
    case S:                                                                  \
        if (bits == 8)                                                       \
            build_q0(raw, n, k, S, 8, codes, scales, mins);                  \
        else if (bits == 5)                                                  \
            build_q0(raw, n, k, S, 5, codes, scales, mins);                  \
        else                                                                 \
            build_q0(raw, n, k, S, 4, codes, scales, mins);                  \
        break;
    switch (src) { Q0_SRC(0) Q0_SRC(1) Q0_SRC(2) Q0_SRC(3) Q0_SRC(4) }
#undef Q0_SRC
}

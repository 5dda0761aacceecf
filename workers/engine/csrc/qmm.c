/* Quantised matrix products for the stage engine (workers/engine/native.py builds this).
 *
 * y[t, n] = sum_k x[t, k] * w[n, k] (+ add[t, n]) where every weight is affine in an
 * unsigned integer code, w = scale * code + min, per group of SUB consecutive k (16 or 32).
 * Scales and mins are float16: the GGUF values themselves for Q4_0/Q4_1/Q5_0/Q8_0 (whose
 * min is -zero * scale for a fixed zero code: then no mins are stored), d * sc rounded to
 * float16 (2^-12) for the K formats. The activations are
 * quantised per block of 32 to int8 (q = round(x / dx), dx = max|x| / 127, as llama.cpp's
 * Q8 blocks do), so each group's product is an integer dot product:
 *   sum_k x w  ~=  scale * dx * sum(code * q)  +  min * dx * sum(q).
 * Codes are stored one per byte ("byte" format: up to 8 bits) or two per byte ("nibble":
 * 4 bits; a 64-byte chunk holds groups 4c, 4c+1 in its low nibbles, 4c+2, 4c+3 in its high
 * ones, so both halves line up with the int8 activations in their natural order).
 * K is padded to a multiple of 128 (nibble) or 64 (byte) with zero codes and scales.
 *
 * The AVX-512 VNNI path (vpdpbusd: 64 u8 x s8 products per instruction) is built where the
 * compiler targets it (-march=native); a plain C path elsewhere computes the same sums.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(MVK_GENERIC)
#include <immintrin.h>
#define MVK_AVX512 1
#endif

int mvk_simd(void) {
#ifdef MVK_AVX512
    return 1;
#else
    return 0;
#endif
}

/* ---- activations ---------------------------------------------------------------------
 * x: T rows of k_in floats (row stride ldx), quantised the way llama.cpp's CPU backend
 * quantises them for the weight format at hand (its vec_dot_type), so that the products
 * are the ones it computes:
 *   MVK_Q8_0 (Q4_0, Q5_0, Q8_0 weights): blocks of 32, d = max|x| / 127 stored as float16,
 *            q = round-to-even(x * 127 / max|x|).
 *   MVK_Q8_1 (Q4_1): as Q8_0, and the block sum s = d * sum(q) is also a float16.
 *   MVK_Q8_K (K formats): blocks of 256, iscale = -127 / x_max (x_max: the element of
 *            largest magnitude, signed), q = round(iscale * x) <= 127, d = 1 / iscale
 *            (float32).
 * Outputs, per row t (kp = padded K):
 *   qx[t*kp + k]       int8 codes (0 past k_in)
 *   dxe[t*kp/4 + j]    d of element 4j (one per 32-bit lane of a vpdpbusd)
 *   s16[t*kp/16 + j]   d * sum(q) over elements 16j..16j+15
 *   s32[t*kp/32 + j]   d * sum(q) over elements 32j..32j+31 (Q8_1: its float16 s)
 */
enum { MVK_Q8_0 = 0, MVK_Q8_1 = 1, MVK_Q8_K = 2 };

static inline float f16r(float x) { return (float)(_Float16)x; }

void mvk_quantize(const float *x, int64_t t_rows, int64_t k_in, int64_t ldx, int64_t kp,
                  int mode, int8_t *qx, float *dxe, float *s16, float *s32) {
    const int64_t bs = mode == MVK_Q8_K ? 256 : 32;
    for (int64_t t = 0; t < t_rows; t++) {
        const float *xr = x + t * ldx;
        int8_t *q = qx + t * kp;
        for (int64_t b = 0; b < kp; b += bs) {
            float amax = 0.0f, xmax = 0.0f;
            for (int64_t k = b; k < b + bs && k < k_in; k++) {
                float a = fabsf(xr[k]);
                if (a > amax) {
                    amax = a;
                    xmax = xr[k];
                }
            }
            float id, d, dq;
            if (mode == MVK_Q8_K) {
                id = amax > 0.0f ? -127.0f / xmax : 0.0f;
                d = amax > 0.0f ? 1.0f / id : 0.0f;
                dq = d;
            } else {
                d = amax / 127.0f;
                id = amax > 0.0f ? 127.0f / amax : 0.0f;
                dq = f16r(d);
            }
            for (int64_t k0 = b; k0 < b + bs; k0 += 16) {
                int32_t sum = 0;
                for (int64_t k = k0; k < k0 + 16; k++) {
                    int32_t v = 0;
                    if (k < k_in) {
                        v = (int32_t)nearbyintf(xr[k] * id);
                        v = v > 127 ? 127 : (v < -128 ? -128 : v);
                    }
                    q[k] = (int8_t)v;
                    sum += v;
                }
                s16[t * kp / 16 + k0 / 16] = dq * (float)sum;
            }
            for (int64_t k0 = b; k0 < b + bs; k0 += 32) {
                int32_t sum = 0;
                for (int64_t k = k0; k < k0 + 32; k++) sum += q[k];
                s32[t * kp / 32 + k0 / 32] = mode == MVK_Q8_1 ? f16r(d * (float)sum)
                                                              : dq * (float)sum;
            }
            for (int64_t j = b / 4; j < (b + bs) / 4; j++) dxe[t * kp / 4 + j] = dq;
        }
    }
}

/* ---- products ------------------------------------------------------------------------ */
typedef struct {
    const int8_t *qx;
    const float *dxe, *s16, *s32;
    int64_t t_rows, kp;
    const uint8_t *codes;
    const void *scale, *min; /* [n][kp / sub] float16 (or float32: f32); min NULL: -zero * scale */
    int64_t n;
    int nibble, sub, zero, f32;
    float *y;
    int64_t ldy;
    const float *add;
    int64_t ldadd;
} mvk_job;

#define TILE 4

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

static void rows_simd_n(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    switch (tt) {
    case 1: rows_simd(j, n0, n1, t0, 1); break;
    case 2: rows_simd(j, n0, n1, t0, 2); break;
    case 3: rows_simd(j, n0, n1, t0, 3); break;
    default: rows_simd(j, n0, n1, t0, 4); break;
    }
}
#endif

static inline float h2f(uint16_t h) {
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

static void rows_generic(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
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

static void run_rows(const mvk_job *j, int64_t n0, int64_t n1) {
    for (int64_t t0 = 0; t0 < j->t_rows; t0 += TILE) {
        int tt = (int)(j->t_rows - t0 < TILE ? j->t_rows - t0 : TILE);
#ifdef MVK_AVX512
        rows_simd_n(j, n0, n1, t0, tt);
#else
        rows_generic(j, n0, n1, t0, tt);
#endif
    }
}

/* ---- threads -------------------------------------------------------------------------
 * A small pool shares each product's rows, in chunks claimed from one atomic ticket
 * (generation | chunk count | next chunk), so the calling thread never waits for a worker
 * that is not running: on a busy machine (several node processes on a few cores) it
 * simply does more chunks itself. Workers spin briefly for the next product (decode
 * calls come tens of microseconds apart), then sleep on a condition variable.
 */
#define MAX_THREADS 64
#define GEN_SHIFT 40
#define COUNT_SHIFT 20
#define FIELD ((1ull << COUNT_SHIFT) - 1)
static int g_threads = 1;
static mvk_job g_job;            /* written by the caller only while no chunk is out */
static int64_t g_chunk_rows = 16;
static atomic_ullong g_ticket;   /* gen << 40 | chunks << 20 | next */
static atomic_llong g_done;
static atomic_int g_sleepers;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */

static inline void relax(void) {
#ifdef MVK_AVX512
    _mm_pause();
#endif
}

/* Claim and run chunks of generation gen until none is left; returns chunks run. */
static int64_t work(unsigned long long gen) {
    int64_t ran = 0;
    for (;;) {
        unsigned long long t = atomic_load(&g_ticket);
        if ((t >> GEN_SHIFT) != gen) break;
        unsigned long long chunks = (t >> COUNT_SHIFT) & FIELD, next = t & FIELD;
        if (next >= chunks) break;
        if (!atomic_compare_exchange_weak(&g_ticket, &t, t + 1)) continue;
        int64_t n0 = (int64_t)next * g_chunk_rows;
        int64_t n1 = n0 + g_chunk_rows < g_job.n ? n0 + g_chunk_rows : g_job.n;
        run_rows(&g_job, n0, n1);
        atomic_fetch_add(&g_done, 1);
        ran++;
    }
    return ran;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* How long an idle worker spins before it sleeps: longer than the gap between a decode
 * step's products (the torch ops between them), short enough to give a busy machine its
 * core back as soon as decoding pauses. */
#define SPIN_NS 300000

static void *worker(void *arg) {
    (void)arg;
    unsigned long long seen = atomic_load(&g_ticket) >> GEN_SHIFT;
    for (;;) {
        unsigned long long gen;
        int64_t since = now_ns();
        int spins = 0;
        while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen) {
            if ((++spins & 63) != 0 || now_ns() - since < SPIN_NS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen)
                pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            break;
        }
        seen = gen;
        work(gen);
    }
    return NULL;
}

/* Grow the pool to n threads in all (the caller counts as one). Returns the number. */
int mvk_set_threads(int n) {
    pthread_mutex_lock(&g_call);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (g_threads < n) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, NULL) != 0) break;
        pthread_detach(th);
        g_threads++;
    }
    int r = g_threads;
    pthread_mutex_unlock(&g_call);
    return r;
}

void mvk_matmul(const int8_t *qx, const float *dxe, const float *s16, const float *s32,
                int64_t t_rows, int64_t kp, const uint8_t *codes, const void *scale,
                const void *min, int64_t n, int nibble, int sub, int zero, int f32, float *y,
                int64_t ldy, const float *add, int64_t ldadd, int threads) {
    mvk_job j = {qx, dxe, s16, s32, t_rows, kp, codes, scale, min, n, nibble, sub, zero, f32,
                 y, ldy, add, ldadd};
    pthread_mutex_lock(&g_call);
    int parts = threads < g_threads ? threads : g_threads;
    if (parts <= 1 || n < 64) {
        run_rows(&j, 0, n);
        pthread_mutex_unlock(&g_call);
        return;
    }
    /* About 8 chunks per thread, multiples of 16 rows. */
    int64_t rows = (n / (8 * parts) + 15) / 16 * 16;
    if (rows < 16) rows = 16;
    int64_t chunks = (n + rows - 1) / rows;
    g_job = j;
    g_chunk_rows = rows;
    atomic_store(&g_done, 0);
    unsigned long long gen = (atomic_load(&g_ticket) >> GEN_SHIFT) + 1;
    atomic_store(&g_ticket, (gen << GEN_SHIFT) | ((unsigned long long)chunks << COUNT_SHIFT));
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    work(gen);
    while (atomic_load(&g_done) < chunks) relax();
    pthread_mutex_unlock(&g_call);
}

/* ---- one call per product ------------------------------------------------------------
 * The weights' description is built once per matrix (native.py); the activations are
 * quantised into a per-thread scratch buffer, so a decode product is one foreign call. */
typedef struct {
    const uint8_t *codes;
    const void *scale, *min;
    int64_t n, kp;
    int32_t nibble, sub, zero, mode, f32, pad;
    const float *norm; /* RMS norm weights applied to x first (NULL: none) */
    float eps;
    float pad2;
} mvk_weights;

/* RMS norm as ggml computes it: the mean of squares summed in double, x * (1/sqrt(mean +
 * eps)) in float, then times the weight. */
static void rms_norm(const float *x, int64_t t_rows, int64_t k, int64_t ldx, const float *w,
                     float eps, float *out) {
    for (int64_t t = 0; t < t_rows; t++) {
        const float *xr = x + t * ldx;
        double sum = 0.0;
        for (int64_t i = 0; i < k; i++) sum += (double)(xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)k) + eps);
        float *o = out + t * k;
        for (int64_t i = 0; i < k; i++) o[i] = (xr[i] * scale) * w[i];
    }
}

static __thread int8_t *t_buf;
static __thread size_t t_cap;

int mvk_linear(const mvk_weights *w, const float *x, int64_t t_rows, int64_t k_in,
               int64_t ldx, float *y, const float *add, int64_t ldadd) {
    const int64_t kp = w->kp;
    size_t need = (size_t)t_rows * (size_t)(kp + (kp / 4 + kp / 16 + kp / 32) * 4) + 64;
    if (w->norm) need += (size_t)t_rows * (size_t)k_in * 4 + 64;
    if (need > t_cap) {
        free(t_buf);
        t_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        t_cap = t_buf ? need : 0;
        if (!t_buf) return -1;
    }
    float *dxe = (float *)t_buf;
    float *s16 = dxe + t_rows * kp / 4;
    float *s32 = s16 + t_rows * kp / 16;
    int8_t *qx = (int8_t *)(s32 + t_rows * kp / 32);
    if (w->norm) {
        float *xn = (float *)(((uintptr_t)(qx + t_rows * kp) + 63) & ~(uintptr_t)63);
        rms_norm(x, t_rows, k_in, ldx, w->norm, w->eps, xn);
        x = xn;
        ldx = k_in;
    }
    mvk_quantize(x, t_rows, k_in, ldx, kp, w->mode, qx, dxe, s16, s32);
    mvk_matmul(qx, dxe, s16, s32, t_rows, kp, w->codes, w->scale, w->min, w->n, w->nibble,
               w->sub, w->zero, w->f32, y, w->n, add, ldadd, MAX_THREADS);
    return 0;
}

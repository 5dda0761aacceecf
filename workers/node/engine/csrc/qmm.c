/* Quantised matrix products for the stage engine (workers/node/engine/native.py builds this).
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
#elif defined(__AVX2__) && defined(__FMA__) && !defined(MVK_GENERIC)
/* The build without AVX-512 on a CPU with AVX2: the Q4_0/Q4_1/Q5_0/Q8_0 products
 * (rows_avx2_q0) and the Q4_K/Q6_K products (rows8_avx2_k) in AVX2, the same integer sums
 * and the same float operations as the plain C (so the same bits); the rest in plain C. */
#include <immintrin.h>
#define MVK_AVX2 1
#endif

/* 1: the AVX-512 VNNI build; 2: the AVX2 build (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K products
 * in AVX2, the rest in plain C); 0: plain C. */
int mvk_simd(void) {
#if defined(MVK_AVX512)
    return 1;
#elif defined(MVK_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* How far ahead (bytes) a decode product's weight streams are prefetched (see
 * prefetch_ahead): mvk_set_prefetch sets it (0: no prefetch), returns the one in effect. */
static int g_pf_dist = 3072;
int mvk_set_prefetch(int bytes) {
    if (bytes >= 0 && bytes <= (1 << 16)) g_pf_dist = bytes;
    return g_pf_dist;
}

/* Decode reads each weight byte once, from memory: the hardware's prefetchers stop at
 * every 4 KiB page, so each piece's bytes a fixed distance ahead are asked for now (past
 * the matrix's end too: a prefetch never faults). */
#if defined(MVK_AVX512) || defined(MVK_AVX2)
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, int bytes) {
    if (g_pf_dist == 0) return;
    const uint8_t *a = p + g_pf_dist;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(a + o), _MM_HINT_T0);
}
#endif

/* ---- the pieces ----------------------------------------------------------------------
 * One translation unit, so one compiler call builds the one library (native.py): each
 * piece below is included once, in this order, and uses only what the pieces before it
 * (and the lines above) define. A piece for one instruction set is empty in the other
 * builds (MVK_AVX512: AVX-512 VNNI; MVK_AVX2; neither: plain C).
 *   quantize.h       the activations: mvk_quantize (llama.cpp's Q8_0 / Q8_1 / Q8_K blocks)
 *   job.h            a product: mvk_job, the row kinds (MVK_ROW_*), the sums (MVK_ARITH_*)
 *   avx512_groups.h  AVX-512: the per-group format's rows (rows_simd)
 *   avx512_q0.h      AVX-512: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 tiles (q0_tile, q0r_tile)
 *   avx512_k.h       AVX-512: Q4_K / Q6_K / Q5_K tiles (q4k_tile, q4k_tile64, q6k_tile,
 *                    q6k_tile64, q5k_tile)
 *   avx512_tiles.h   AVX-512: which tile runs which rows (rows_q0, rows_simd_n)
 *   codes.h          float16, and the interleaved layout's codes and scales one at a time
 *   generic_q0.h     plain C: Q4_0 ... Q8_0 rows (rows_generic_q0, rows_generic_q0r)
 *   avx2_q0.h        AVX2: Q4_0 ... Q8_0 rows, 8 at a time (rows_avx2_q0, rows8_avx2_q0r)
 *   generic_k.h      plain C: Q4_K / Q5_K / Q6_K rows (rows_generic_k)
 *   avx2_k.h         AVX2: Q4_K / Q6_K rows, 8 at a time (rows8_avx2_k)
 *   rows.h           a chunk of a product's rows in this build (rows_generic, run_rows)
 *   pool.h           the thread pool (dispatch, dispatch_task, mvk_set_threads, mvk_matmul)
 *   norm.h           RMS norm (rms_norm, mvk_rms_norm)
 *   linear.h         one call per product (mvk_weights, mvk_linear, mvk_linear_rows)
 *   rope.h           rope (mvk_rope_cache, mvk_rope_neox, mvk_rope_norm)
 *   v16.h            16 float lanes: __m512, or an array doing the same lane by lane
 *   attention.h      attention (mvk_attention)
 *   glu.h            SwiGLU and GeGLU (mvk_swiglu, mvk_geglu)
 *   layers.h         whole decoder layers in one call (mvk_layers, mvk_layers_batch)
 *   build.h          a load: Q4_K / Q6_K / Q4_0 / Q8_0 layouts from GGUF blocks (mvk_build_*)
 * They are the one file this was, cut where its sections began, in its order (but for
 * mvk_rms_norm, mvk_rope_norm and MVK_ATTN_SCRATCH, moved to their kind): the same code,
 * compiled to the same instructions. native.py's build cache is keyed by every file here;
 * every build compiles clean under -Wall -Wextra -Werror (tests/node/engine/test_native.py). */
#include "quantize.h"
#include "job.h"
#include "avx512_groups.h"
#include "avx512_q0.h"
#include "avx512_k.h"
#include "avx512_tiles.h"
#include "codes.h"
#include "generic_q0.h"
#include "avx2_q0.h"
#include "generic_k.h"
#include "avx2_k.h"
#include "rows.h"
#include "pool.h"
#include "norm.h"
#include "linear.h"
#include "rope.h"
#include "v16.h"
#include "attention.h"
#include "glu.h"
#include "layers.h"
#include "build.h"

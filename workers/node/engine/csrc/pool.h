/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). The thread pool, and mvk_matmul (a product over it). */

/* ---- threads -------------------------------------------------------------------------
 * A small pool shares each product's rows, in chunks claimed from one atomic ticket
 * (generation | chunk count | next chunk), so the calling thread never waits for a worker
 * that is not running: on a busy machine (several node processes on a few cores) it
 * simply does more chunks itself. Workers spin briefly for the next product (decode
 * calls come tens of microseconds apart), then sleep on a condition variable.
 *
 * The pool resizes both ways (mvk_set_threads): it grows by starting workers, and shrinks
 * by parking the workers numbered past the count (g_active), which then take no chunk and
 * sleep on a condition variable of their own until the count grows again. Each row's sum
 * is formed by one thread in a fixed order, so the count never changes a result.
 */
#define MAX_THREADS 64
#define GEN_SHIFT 40
#define COUNT_SHIFT 20
#define FIELD ((1ull << COUNT_SHIFT) - 1)
static int g_threads = 1;        /* threads started, the caller counted as one */
static atomic_int g_active = 1;  /* of those, how many take chunks (mvk_set_threads) */
static atomic_int g_ran;         /* threads that ran a chunk in the last generation */
static pthread_cond_t g_park_cv = PTHREAD_COND_INITIALIZER; /* parked workers wait here */
static mvk_job g_job;            /* written by the caller only while no chunk is out */
/* or, where set, chunk i of a generation is g_task(g_ctx, i) (dispatch_task) */
static void (*g_task)(const void *ctx, int64_t i);
static const void *g_ctx;
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
        /* Counted at its first chunk, before that chunk is done: the caller, which waits
         * for every chunk, then sees every thread that ran one of this product. */
        if (ran == 0) atomic_fetch_add(&g_ran, 1);
        if (g_task) {
            g_task(g_ctx, (int64_t)next);
        } else {
            int64_t n0 = (int64_t)next * g_chunk_rows;
            int64_t n1 = n0 + g_chunk_rows < g_job.n ? n0 + g_chunk_rows : g_job.n;
            run_rows(&g_job, n0, n1);
        }
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

/* An optional per-phase profile of the layers (mvk_profile): nanoseconds by phase,
 * counted only while switched on (one test of a flag per phase otherwise). */
enum { PROF_QKV, PROF_ATTN, PROF_WO, PROF_GATE_UP, PROF_ACT, PROF_DOWN, PROF_PREP, PROF_LAYERS,
       PROF_N };
static int g_prof_on;
static int64_t g_prof[PROF_N];
#define PROF_START() (g_prof_on ? now_ns() : 0)
#define PROF_ADD(i, t0)                                                                    \
    do {                                                                                   \
        if (g_prof_on && (t0) != 0) g_prof[i] += now_ns() - (t0);                          \
    } while (0)

/* Copies the first `n` counters (nanoseconds; PROF_N in all) into out where not NULL,
 * zeroes them all, and switches counting on or off. Returns PROF_N. A phase that began
 * while counting was off adds nothing when it ends (PROF_START gave 0). */
int mvk_profile(int on, int64_t *out, int n) {
    for (int i = 0; i < PROF_N; i++) {
        if (out && i < n) out[i] = g_prof[i];
        g_prof[i] = 0;
    }
    g_prof_on = on != 0;
    return PROF_N;
}

/* How long an idle worker spins before it sleeps: longer than the gap between a decode
 * step's products (the torch ops between them), short enough to give a busy machine its
 * core back as soon as decoding pauses. */
#define SPIN_NS 300000

/* Worker `index` (1, 2, ...: the caller is 0) takes part while index < g_active; past
 * it, the worker parks until mvk_set_threads raises the count. */
static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned long long seen = atomic_load(&g_ticket) >> GEN_SHIFT;
    for (;;) {
        if (index >= atomic_load(&g_active)) {
            pthread_mutex_lock(&g_mu);
            while (index >= atomic_load(&g_active)) pthread_cond_wait(&g_park_cv, &g_mu);
            pthread_mutex_unlock(&g_mu);
            seen = atomic_load(&g_ticket) >> GEN_SHIFT; /* what passed while parked */
            continue;
        }
        unsigned long long gen;
        int64_t since = now_ns();
        int spins = 0;
        while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen) {
            if (index >= atomic_load(&g_active)) break;
            if ((++spins & 63) != 0 || now_ns() - since < SPIN_NS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen &&
                   index < atomic_load(&g_active))
                pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            break;
        }
        if (gen == seen) continue; /* parked meanwhile: back to the top */
        seen = gen;
        if (index >= atomic_load(&g_active)) continue; /* counted out since: park */
        work(gen);
    }
    return NULL;
}

/* n threads in all take part in each product from now on (the caller counts as one):
 * the pool grows to n, or parks the workers past n. Returns the count now in effect
 * (fewer than n only where a thread could not be started). */
int mvk_set_threads(int n) {
    pthread_mutex_lock(&g_call);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (g_threads < n) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, (void *)(intptr_t)g_threads) != 0) break;
        pthread_detach(th);
        g_threads++;
    }
    int r = n < g_threads ? n : g_threads;
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_active, r);
    pthread_cond_broadcast(&g_park_cv); /* the newly counted leave their park */
    pthread_cond_broadcast(&g_cv);      /* the newly parked leave their wait for work */
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_call);
    return r;
}

/* The count in effect, and how many threads ran a chunk of the last product (the
 * caller included; fewer than the count where the product was small or a worker was
 * slow to wake): for the tests. */
int mvk_threads(void) { return atomic_load(&g_active); }
int mvk_last_ran(void) { return atomic_load(&g_ran); }

static void dispatch(mvk_job j, int threads);

void mvk_matmul(const int8_t *qx, const float *dxe, const float *s16, const float *s32,
                int64_t t_rows, int64_t kp, const uint8_t *codes, const void *scale,
                const void *min, int64_t n, int nibble, int sub, int zero, int f32, float *y,
                int64_t ldy, const float *add, int64_t ldadd, int threads) {
    mvk_job j = {qx, dxe, s16, s32, t_rows, kp, codes, scale, min, n, nibble, sub, zero, f32,
                 y, ldy, add, ldadd, NULL, NULL, MVK_ARITH_GROUPS, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL};
    dispatch(j, threads);
}

/* A new generation of `chunks` chunks (g_job's rows, or g_task's tasks, set before):
 * workers woken where they sleep, the caller taking part, back when all are done.
 * Called with g_call held. */
static void run_generation(int64_t chunks) {
    atomic_store(&g_done, 0);
    atomic_store(&g_ran, 0);
    unsigned long long gen = (atomic_load(&g_ticket) >> GEN_SHIFT) + 1;
    atomic_store(&g_ticket, (gen << GEN_SHIFT) | ((unsigned long long)chunks << COUNT_SHIFT));
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    work(gen);
    while (atomic_load(&g_done) < chunks) relax();
}

static void dispatch(mvk_job j, int threads) {
    const int64_t n = j.n;
    pthread_mutex_lock(&g_call);
    const int active = atomic_load(&g_active);
    int parts = threads < active ? threads : active;
    if (parts <= 1 || n < 64) {
        atomic_store(&g_ran, 1);
        run_rows(&j, 0, n);
        pthread_mutex_unlock(&g_call);
        return;
    }
    /* About 8 chunks per thread, multiples of 16 rows. */
    int64_t rows = (n / (8 * parts) + 15) / 16 * 16;
    if (rows < 16) rows = 16;
    int64_t chunks = (n + rows - 1) / rows;
    g_job = j;
    g_task = NULL;
    g_chunk_rows = rows;
    run_generation(chunks);
    pthread_mutex_unlock(&g_call);
}

/* Tasks 0..count-1 of fn over the pool, the caller taking part (as dispatch). */
static void dispatch_task(void (*fn)(const void *, int64_t), const void *ctx, int64_t count) {
    pthread_mutex_lock(&g_call);
    if (atomic_load(&g_active) <= 1 || count <= 1) {
        atomic_store(&g_ran, 1);
        for (int64_t i = 0; i < count; i++) fn(ctx, i);
        pthread_mutex_unlock(&g_call);
        return;
    }
    g_task = fn;
    g_ctx = ctx;
    run_generation(count);
    g_task = NULL;
    pthread_mutex_unlock(&g_call);
}

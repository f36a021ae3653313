/* GEMMs of a few rows on weights tiled for streaming: the expert GEMMs of a decode step, where an expert has one
 * or two rows and a library GEMM spends more on its call than on its arithmetic (small_gemm.py says when).
 *
 * A weight [O][K] is tiled as [O / TILE][K][TILE]: one tile's K rows of TILE outputs lie one after the other, so
 * a tile is read once, front to back, for all of an expert's rows. Every output is one chain of multiplies and
 * adds over k = 0 .. K-1 in order, built with -ffp-contract=off: the same bits on every CPU (no fused
 * multiply-add, no reordering), whatever the vector width, and the same for a row whatever other rows it is
 * multiplied with.
 *
 * With more than one thread (small_gemm_set_threads) the (expert, tile) units of a call are shared out one at a
 * time from an atomic counter by the caller and helper threads; a unit is computed whole by one thread, so the bits
 * do not depend on the thread count, and a helper the OS does not schedule only leaves its units to the others.
 * Between calls a helper spins for a while (a layer's next call comes within microseconds to a millisecond), then
 * sleeps on a condition variable until the next call.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TILE 32
#define VECS (TILE / 8)

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* y[r][0 .. TILE) = sum_k x[r][k] * tile[k][0 .. TILE) for r < ROWS; ROWS rows share each tile row read.
 * BLOCK_ROWS rows at a time: 4 (16 accumulators) where the CPU has 32 vector registers (AVX-512's, AArch64's), 3
 * (12) with AVX2's 16, where 4 rows spill accumulators to the stack: one thread, 8 experts of [512 -> 512] in
 * cache, 8-16 rows each, 52-54 GFLOP/s in blocks of 4 against 62-68 in blocks of 3 (AMD EPYC, AVX2 only). The
 * blocking does not change a bit: each output is the same chain in k order whatever rows share its block. */
#if defined(__AVX512F__) || defined(__aarch64__)
#define BLOCK_ROWS 4
#else
#define BLOCK_ROWS 3
#endif
/* The accumulators of ROWS rows (both kernels below): zeroed, each row's x[r][k] times the tile row w added, stored. */
#define ACC_ZERO(ROWS)                                                                                         \
    for (int r = 0; r < ROWS; r++)                                                                             \
        for (int j = 0; j < VECS; j++) acc[r][j] = (v8){0};
#define ACC_ADD(ROWS, k)                                                                                       \
    for (int r = 0; r < ROWS; r++) {                                                                           \
        float b = x[r * ldx + (k)];                                                                            \
        v8 bv = {b, b, b, b, b, b, b, b};                                                                      \
        for (int j = 0; j < VECS; j++) acc[r][j] += bv * w[j];                                                 \
    }
#define ACC_STORE(ROWS)                                                                                        \
    for (int r = 0; r < ROWS; r++)                                                                             \
        for (int j = 0; j < VECS; j++) store8(y + r * ldy + 8 * j, acc[r][j]);

#define ROW_BLOCK(ROWS)                                                                                        \
    static void rows##ROWS(const float *x, int64_t ldx, const float *tile, int64_t K, float *y, int64_t ldy) { \
        v8 acc[ROWS][VECS];                                                                                    \
        ACC_ZERO(ROWS)                                                                                         \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            v8 w[VECS];                                                                                        \
            for (int j = 0; j < VECS; j++) w[j] = load8(tile + k * TILE + 8 * j);                              \
            ACC_ADD(ROWS, k)                                                                                   \
        }                                                                                                      \
        ACC_STORE(ROWS)                                                                                        \
    }

ROW_BLOCK(1)
ROW_BLOCK(2)
ROW_BLOCK(3)
#if BLOCK_ROWS == 4
ROW_BLOCK(4)
#endif

/* FP8 (e4m3) weights: a tile row is TILE bytes, and each weight is its code's value times its scale, the scale of its
 * output row's block for k's block of KB columns, given pre-multiplied by 256 because a code converts to its value
 * over 256: (value / 256) * (scale * 256) is the one rounding of value * scale, the fp32 weight a dequantized
 * checkpoint holds, so the sums below are the fp32 tiles' bit for bit while reading a quarter of their bytes.
 *
 * A code's value over 256 as a half: the sign to bit 15, exponent and mantissa (7 bits) to bits 13..7 (e4m3's bias
 * 7 is the half's 15 minus 8); F16C converts eight halves, subnormals included, in one instruction. Without F16C the
 * same value is built in single precision (a zero exponent field is a subnormal: mantissa times 2^-17). */
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
/* sixteen codes: both halves of the 16-bit lanes converted with one shift pair and mask */
static inline void fp8x16(const uint8_t *p, v8 *lo, v8 *hi) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), _mm256_set1_epi16((short)0xBFFF));
    __m256 a = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    memcpy(lo, &a, sizeof *lo);
    memcpy(hi, &b, sizeof *hi);
}
#else
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 fp8x8(const uint8_t *p) {
    v8i b = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    v8i sign = (b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 7;
    v8i normal = sign | ((e + 112) << 23) | (m << 20);
    v8 sub = __builtin_convertvector(m, v8) * (v8){0x1p-17f, 0x1p-17f, 0x1p-17f, 0x1p-17f,
                                                   0x1p-17f, 0x1p-17f, 0x1p-17f, 0x1p-17f};
    v8i sub_bits;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    v8i zero = e == 0;
    v8i bits = (zero & (sub_bits | sign)) | (~zero & normal);
    v8 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
static inline void fp8x16(const uint8_t *p, v8 *lo, v8 *hi) {
    *lo = fp8x8(p);
    *hi = fp8x8(p + 8);
}
#endif

#define ROW_BLOCK_FP8(ROWS)                                                                                   \
    static void rows##ROWS##_fp8(const float *x, int64_t ldx, const uint8_t *tile, const float *scales,       \
                                 int64_t kb, int64_t K, float *y, int64_t ldy) {                              \
        v8 acc[ROWS][VECS], s[VECS];                                                                           \
        ACC_ZERO(ROWS)                                                                                         \
        for (int64_t k0 = 0; k0 < K; k0 += kb, scales += TILE) {                                              \
            for (int j = 0; j < VECS; j++) s[j] = load8(scales + 8 * j);                                       \
            int64_t k1 = k0 + kb < K ? k0 + kb : K;                                                            \
            for (int64_t k = k0; k < k1; k++) {                                                                \
                v8 w[VECS];                                                                                    \
                for (int j = 0; j < VECS; j += 2) fp8x16(tile + k * TILE + 8 * j, &w[j], &w[j + 1]);           \
                for (int j = 0; j < VECS; j++) w[j] *= s[j];                                                   \
                ACC_ADD(ROWS, k)                                                                               \
            }                                                                                                  \
        }                                                                                                      \
        ACC_STORE(ROWS)                                                                                        \
    }

ROW_BLOCK_FP8(1)
ROW_BLOCK_FP8(2)
ROW_BLOCK_FP8(3)
#if BLOCK_ROWS == 4
ROW_BLOCK_FP8(4)
#endif

int small_gemm_tile(void) { return TILE; }

/* One call's work: for each group g, rows starts[g] .. starts[g] + counts[g] of x [.][K] (row stride ldx) times the
 * transpose of the tiled weight at weights[g], into the same rows of y [.][O] (row stride ldy); a unit is one
 * group's one tile of TILE outputs. */
struct job {
    const float *x;
    int64_t ldx, K;
    const int64_t *starts, *counts, *weights;
    int64_t O;
    float *y;
    int64_t ldy, units;
    const int64_t *scales; /* FP8 weights: each group's scale tiles (NULL: fp32 weights) */
    int64_t kb;            /* ... and the columns of a scale block */
};

static void run_unit_fp8(const struct job *j, int64_t unit) {
    int64_t tiles = j->O / TILE, g = unit / tiles, t = unit % tiles, kblocks = (j->K + j->kb - 1) / j->kb;
    const uint8_t *tile = (const uint8_t *)(intptr_t)j->weights[g] + t * j->K * TILE;
    const float *scales = (const float *)(intptr_t)j->scales[g] + t * kblocks * TILE;
    const float *x = j->x + j->starts[g] * j->ldx;
    float *y = j->y + j->starts[g] * j->ldy + t * TILE;
    int64_t n = j->counts[g], r = 0, kb = j->kb, K = j->K, ldx = j->ldx, ldy = j->ldy;
#if BLOCK_ROWS == 4
    for (; r + 4 <= n; r += 4) rows4_fp8(x + r * ldx, ldx, tile, scales, kb, K, y + r * ldy, ldy);
#endif
    for (; r + 3 <= n; r += 3) rows3_fp8(x + r * ldx, ldx, tile, scales, kb, K, y + r * ldy, ldy);
    if (n - r == 2) rows2_fp8(x + r * ldx, ldx, tile, scales, kb, K, y + r * ldy, ldy);
    if (n - r == 1) rows1_fp8(x + r * ldx, ldx, tile, scales, kb, K, y + r * ldy, ldy);
}

static void run_unit(const struct job *j, int64_t unit) {
    if (j->scales) {
        run_unit_fp8(j, unit);
        return;
    }
    int64_t tiles = j->O / TILE, g = unit / tiles, t = unit % tiles;
    const float *tile = (const float *)(intptr_t)j->weights[g] + t * j->K * TILE;
    const float *x = j->x + j->starts[g] * j->ldx;
    float *y = j->y + j->starts[g] * j->ldy + t * TILE;
    int64_t n = j->counts[g], r = 0;
#if BLOCK_ROWS == 4
    for (; r + 4 <= n; r += 4) rows4(x + r * j->ldx, j->ldx, tile, j->K, y + r * j->ldy, j->ldy);
#endif
    for (; r + 3 <= n; r += 3) rows3(x + r * j->ldx, j->ldx, tile, j->K, y + r * j->ldy, j->ldy);
    if (n - r == 2) rows2(x + r * j->ldx, j->ldx, tile, j->K, y + r * j->ldy, j->ldy);
    if (n - r == 1) rows1(x + r * j->ldx, j->ldx, tile, j->K, y + r * j->ldy, j->ldy);
}

/* --- the helper threads --------------------------------------------------------------------------------------
 * `generation` is even while a job is published, odd while the caller rewrites it; a helper takes part in a job
 * only between counting itself `active` and seeing the same even generation, so the caller rewrites a job only
 * when no helper reads it. */
#define MAX_HELPERS 63
static struct job current;
static _Atomic int64_t next_unit;
static _Atomic uint64_t generation;
static _Atomic int active, sleeping, wanted = 1;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int helpers;      /* helper threads started in this process */
static pid_t helpers_of; /* the process that started them (a forked child has none) */
static int64_t spin_ns = 300000;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void take_units(void) {
    for (int64_t u; (u = atomic_fetch_add(&next_unit, 1)) < current.units;) run_unit(&current, u);
}

static void *helper_main(void *arg) {
    int index = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&generation);
    for (;;) {
        int64_t since = now_ns();
        uint64_t g;
        while (((g = atomic_load(&generation)) == seen || (g & 1)) && now_ns() - since < spin_ns) relax();
        if (g == seen || (g & 1)) {
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleeping, 1);
            while ((g = atomic_load(&generation)) == seen || (g & 1)) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleeping, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = g;
        if (index + 1 >= atomic_load(&wanted)) continue; /* fewer threads asked for since it started */
        atomic_fetch_add(&active, 1);
        if (atomic_load(&generation) == g) take_units();
        atomic_fetch_sub(&active, 1);
    }
    return 0;
}

/* Threads a call uses from now on (the caller and threads - 1 helpers), and how long a helper spins for the next
 * call before it sleeps. Returns the threads in use (fewer where a helper did not start). */
int64_t small_gemm_set_threads(int64_t threads, int64_t spin_us) {
    if (helpers_of != getpid()) { /* a fresh process, or a fork: no helper runs here */
        helpers = 0;
        helpers_of = getpid();
        pthread_mutex_init(&lock, 0);
        pthread_cond_init(&wake, 0);
        atomic_store(&active, 0);
        atomic_store(&sleeping, 0);
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
    spin_ns = spin_us * 1000;
    while (helpers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)helpers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        helpers++;
    }
    if (threads > helpers + 1) threads = helpers + 1;
    atomic_store(&wanted, (int)threads);
    return threads;
}

/* For each group g: rows starts[g] .. starts[g] + counts[g] of x, times the tiled weight at address weights[g],
 * into the same rows of y. One call for all of a layer's small experts. */
static void run_job(struct job j);

void small_gemm_groups(const float *x, int64_t ldx, int64_t K, const int64_t *starts, const int64_t *counts,
                       const int64_t *weights, int64_t groups, int64_t O, float *y, int64_t ldy) {
    struct job j = {x, ldx, K, starts, counts, weights, O, y, ldy, groups * (O / TILE), 0, 1};
    run_job(j);
}

/* small_gemm_groups on FP8 tiles: weights[g] the address of TILE-byte tile rows, scales[g] of their scale tiles
 * [O / TILE][ceil(K / kb)][TILE] (times 256, as fp8x8 asks). */
void small_gemm_groups_fp8(const float *x, int64_t ldx, int64_t K, const int64_t *starts, const int64_t *counts,
                           const int64_t *weights, const int64_t *scales, int64_t kb, int64_t groups, int64_t O,
                           float *y, int64_t ldy) {
    struct job j = {x, ldx, K, starts, counts, weights, O, y, ldy, groups * (O / TILE), scales, kb};
    run_job(j);
}

static void run_job(struct job j) {
    if (atomic_load(&wanted) < 2 || helpers_of != getpid() || j.units < 2) {
        for (int64_t u = 0; u < j.units; u++) run_unit(&j, u);
        return;
    }
    atomic_fetch_add(&generation, 1); /* odd: no helper starts on the job being written */
    while (atomic_load(&active)) relax();
    current = j;
    atomic_store(&next_unit, 0);
    atomic_fetch_add(&generation, 1); /* even: published */
    if (atomic_load(&sleeping)) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    take_units();
    while (atomic_load(&active)) relax(); /* the units helpers took are written before the call returns */
}

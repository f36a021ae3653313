/* GEMMs of a few rows on weights tiled for streaming: the expert GEMMs of a decode step, where an expert has one
 * or two rows and a library GEMM spends more on its call than on its arithmetic (small_gemm.py says when).
 *
 * A weight [O][K] is tiled as [O / TILE][K][TILE]: one tile's K rows of TILE outputs lie one after the other, so
 * a tile is read once, front to back, for all of an expert's rows. Every output is one chain of multiplies and
 * adds over k = 0 .. K-1 in order, built with -ffp-contract=off: the same bits on every CPU (no fused
 * multiply-add, no reordering), whatever the vector width, and the same for a row whatever other rows it is
 * multiplied with.
 */
#include <stdint.h>
#include <string.h>

#define TILE 32
#define VECS (TILE / 8)

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* y[r][0 .. TILE) = sum_k x[r][k] * tile[k][0 .. TILE) for r < ROWS; ROWS rows share each tile row read (4 rows:
 * 16 accumulators, in registers where the CPU has 32 vector registers, AVX-512's). */
#define ROW_BLOCK(ROWS)                                                                                        \
    static void rows##ROWS(const float *x, int64_t ldx, const float *tile, int64_t K, float *y, int64_t ldy) { \
        v8 acc[ROWS][VECS];                                                                                    \
        for (int r = 0; r < ROWS; r++)                                                                         \
            for (int j = 0; j < VECS; j++) acc[r][j] = (v8){0};                                                \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            v8 w[VECS];                                                                                        \
            for (int j = 0; j < VECS; j++) w[j] = load8(tile + k * TILE + 8 * j);                              \
            for (int r = 0; r < ROWS; r++) {                                                                   \
                float b = x[r * ldx + k];                                                                      \
                v8 bv = {b, b, b, b, b, b, b, b};                                                              \
                for (int j = 0; j < VECS; j++) acc[r][j] += bv * w[j];                                         \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < ROWS; r++)                                                                         \
            for (int j = 0; j < VECS; j++) store8(y + r * ldy + 8 * j, acc[r][j]);                             \
    }

ROW_BLOCK(1)
ROW_BLOCK(2)
ROW_BLOCK(3)
ROW_BLOCK(4)

/* y[n][O] (row stride ldy) = x[n][K] (row stride ldx) times the tiled weight's transpose. */
static void tiled_gemm(const float *x, int64_t ldx, int64_t n, int64_t K, const float *tiled, int64_t O, float *y,
                       int64_t ldy) {
    for (int64_t t = 0; t < O / TILE; t++) {
        const float *tile = tiled + t * K * TILE;
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) rows4(x + r * ldx, ldx, tile, K, y + r * ldy + t * TILE, ldy);
        if (n - r == 3) rows3(x + r * ldx, ldx, tile, K, y + r * ldy + t * TILE, ldy);
        if (n - r == 2) rows2(x + r * ldx, ldx, tile, K, y + r * ldy + t * TILE, ldy);
        if (n - r == 1) rows1(x + r * ldx, ldx, tile, K, y + r * ldy + t * TILE, ldy);
    }
}

int small_gemm_tile(void) { return TILE; }

/* For each group g: rows starts[g] .. starts[g] + counts[g] of x, times the tiled weight at address weights[g],
 * into the same rows of y. One call for all of a layer's small experts. */
void small_gemm_groups(const float *x, int64_t ldx, int64_t K, const int64_t *starts, const int64_t *counts,
                       const int64_t *weights, int64_t groups, int64_t O, float *y, int64_t ldy) {
    for (int64_t g = 0; g < groups; g++)
        tiled_gemm(x + starts[g] * ldx, ldx, counts[g], K, (const float *)(intptr_t)weights[g], O,
                   y + starts[g] * ldy, ldy);
}

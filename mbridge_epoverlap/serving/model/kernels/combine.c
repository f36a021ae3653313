/* The combine of a MoE layer: each token's k expert outputs weighted by its gates and summed, in ascending expert
 * id, onto its residual, in one pass over the rows (torch takes a gather of the rows and 2k elementwise passes).
 *
 * Per element the arithmetic is torch's, in its order: acc = 0, then acc = acc + row_j * gate_j for the slots j in
 * ascending expert id (each product rounded to fp32, then the sum), then out = resid + acc. Built with
 * -ffp-contract=off (no fused multiply-add), so the bits are those of the torch loop on every CPU.
 */
#include <stdint.h>

#define MAX_K 64

/* acc[h] = acc[h] + row[h] * gate: one slot's product added, element by element (vectorised over h). */
static void add_weighted(float *restrict acc, const float *restrict row, float gate, int64_t n) {
    for (int64_t h = 0; h < n; h++) acc[h] = acc[h] + row[h] * gate;
}

/* acc[h] = resid[h] + acc[h]: the residual added last, as torch adds it. */
static void add_resid(float *restrict acc, const float *restrict resid, int64_t n) {
    for (int64_t h = 0; h < n; h++) acc[h] = resid[h] + acc[h];
}

/* out[t][h] = (resid ? resid[t][h] + : ) sum_j rows[t * stride_token + slot_j * stride_slot + h] * gates[t][slot_j]
 * over the token's slots in ascending expert_ids[t][.]. Returns 0, or -1 when k exceeds MAX_K. */
int combine_rows(const float *rows, int64_t stride_token, int64_t stride_slot, const int64_t *expert_ids,
                 const float *gates, int64_t tokens, int64_t k, int64_t hidden, const float *resid, float *out) {
    if (k > MAX_K) return -1;
    int64_t order[MAX_K];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *ids = expert_ids + t * k;
        for (int64_t j = 0; j < k; j++) { /* insertion sort of the k slots by expert id (ids are distinct) */
            int64_t i = j;
            while (i > 0 && ids[order[i - 1]] > ids[j]) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = j;
        }
        float *acc = out + t * hidden;
        for (int64_t h = 0; h < hidden; h++) acc[h] = 0.0f;
        for (int64_t j = 0; j < k; j++)
            add_weighted(acc, rows + t * stride_token + order[j] * stride_slot, gates[t * k + order[j]], hidden);
        if (resid) add_resid(acc, resid + t * hidden, hidden);
    }
    return 0;
}

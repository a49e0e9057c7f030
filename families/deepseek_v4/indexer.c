/* DeepSeek-V4's Lightning Indexer for one decoded token (indexer_native.py): the scores by which a CSA layer picks
   the compressed entries it attends to. It computes as native/token_matmul.c does and on its threads: each product
   is that library's row dot (`token_matmul_dot`, its vector or plain loop) and the keys are split over its pool
   (`token_matmul_parallel`), both handed over once by indexer_bind; native/token_matmul.h holds the rest they
   share (the matrix descriptor, bfloat16 rounding, RoPE's rotation). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "token_matmul.h"

static row_dot_fn row_dot;
static parallel_fn parallel;

/* the token matmul library's entries this kernel calls (before any index_token) */
void indexer_bind(row_dot_fn dot, parallel_fn split) {
    row_dot = dot;
    parallel = split;
}

typedef struct {
    const float *q;  /* [heads, D] rotated, rounded */
    int64_t heads, dim;
    const float *keys;  /* [T, D] */
    int64_t T;
    const float *head_weights;  /* [heads] */
    int round_low;
    float *scores;
} index_args;

static void index_part(void *p, int part, int parts) {
    const index_args *a = p;
    int64_t t0, t1;
    share(a->T, part, parts, &t0, &t1);
    const matrix_t q = {KIND_F32, (const uint8_t *)a->q, NULL, NULL, a->heads, a->dim};
    for (int64_t t = t0; t < t1; t++) {
        float score = 0.0f;
        for (int64_t h = 0; h < a->heads; h++) {
            float y = row_dot(&q, h, a->keys + t * a->dim);
            y = a->round_low ? round_to_bf16(y) : y;
            score += a->head_weights[h] * (y > 0.0f ? y : 0.0f);
        }
        a->scores[t] = score;
    }
}

/* scores [T]: score(t) = sum_h head_weights[h] x relu(q_h . keys_t) (model.indexer_topk for one query), q [heads,
   D] as the indexer's wq_b gives it, its last rope_dim channels of each head rotated by rot first; round_low: the
   query and each product rounded to bfloat16, as a bfloat16 matmul rounds them (the keys must be rounded already).
   1: arguments refused; 2: out of memory; 3: not bound (indexer_bind) */
int index_token(const float *q, int64_t heads, int64_t dim, int64_t rope_dim, const float *rot, const float *keys,
                int64_t T, const float *head_weights, int round_low, float *scores, int threads)
{
    if (!row_dot || !parallel) return 3;
    if (heads < 1 || dim < 1 || T < 0 || rope_dim < 0 || rope_dim > dim || rope_dim % 2) return 1;
    float *rotated = malloc(sizeof(float) * (size_t)(heads * dim));
    if (!rotated) return 2;
    for (int64_t h = 0; h < heads; h++) {
        float *row = rotated + h * dim;
        memcpy(row, q + h * dim, sizeof(float) * (size_t)dim);
        rotate(row, dim, rope_dim, rot, 1.0f);
        if (round_low)
            for (int64_t d = 0; d < dim; d++) row[d] = round_to_bf16(row[d]);
    }
    index_args a = {rotated, heads, dim, keys, T, head_weights, round_low, scores};
    parallel(index_part, &a, T * heads * dim, threads);
    free(rotated);
    return 0;
}

/* The mHC weights of a sublayer (backends/mhc_native.py; model.hc_mix_weights in torch): pre, post and the
   Sinkhorn-normalised comb of LANES tokens side by side, so every step is one vector op. */
#include <math.h>
#include <stdint.h>
#define LANES 16
#define HC_MAX 8

/* One Sinkhorn pass: each of the hc lines of c (rows: line stride hc, step 1; columns: line stride 1, step hc)
   divided by its sum plus eps, for LANES tokens at once. */
static inline void normalize_lines(float c[][LANES], int hc, int line_stride, int step, float eps) {
    float sum[LANES];
    for (int a = 0; a < hc; a++) {
        for (int l = 0; l < LANES; l++) sum[l] = 0.0f;
        for (int b = 0; b < hc; b++)
            for (int l = 0; l < LANES; l++) sum[l] += c[a * line_stride + b * step][l];
        for (int b = 0; b < hc; b++)
            for (int l = 0; l < LANES; l++) c[a * line_stride + b * step][l] /= sum[l] + eps;
    }
}

/* mixes [n, (2 + hc) * hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc]; scale [3], base [(2 + hc) * hc].
   The tokens go LANES at a time, each value of the LANES tokens side by side, so every step is one vector op. */
int hc_mix_weights(const float *mixes, int64_t n, int hc, const float *scale, const float *base, int iters,
                   float eps, float *pre, float *post, float *comb)
{
    if (hc < 1 || hc > HC_MAX) return 1;
    const int width = (2 + hc) * hc;
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
        const int lanes = n - t0 < LANES ? (int)(n - t0) : LANES;
        float c[HC_MAX * HC_MAX][LANES], top[LANES], sum[LANES];
        for (int j = 0; j < hc; j++)
            for (int l = 0; l < lanes; l++) {
                const float *m = mixes + (t0 + l) * width;
                pre[(t0 + l) * hc + j] = 1.0f / (1.0f + expf(-(m[j] * scale[0] + base[j]))) + eps;
                post[(t0 + l) * hc + j] = 2.0f * (1.0f / (1.0f + expf(-(m[hc + j] * scale[1] + base[hc + j]))));
            }
        for (int i = 0; i < hc * hc; i++)
            for (int l = 0; l < LANES; l++)
                c[i][l] = l < lanes ? mixes[(t0 + l) * width + 2 * hc + i] * scale[2] + base[2 * hc + i] : 0.0f;
        for (int r = 0; r < hc; r++) {  /* softmax of each row, plus eps */
            for (int l = 0; l < LANES; l++) { top[l] = c[r * hc][l]; sum[l] = 0.0f; }
            for (int k = 1; k < hc; k++)
                for (int l = 0; l < LANES; l++) top[l] = fmaxf(top[l], c[r * hc + k][l]);
            for (int k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) sum[l] += (c[r * hc + k][l] = expf(c[r * hc + k][l] - top[l]));
            for (int k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) c[r * hc + k][l] = c[r * hc + k][l] / sum[l] + eps;
        }
        for (int round = 0; round < (iters > 1 ? iters : 1); round++) {  /* as torch: at least one column pass */
            if (round)  /* the first round's rows are the softmax's */
                normalize_lines(c, hc, hc, 1, eps);
            normalize_lines(c, hc, 1, hc, eps);
        }
        for (int i = 0; i < hc * hc; i++)
            for (int l = 0; l < lanes; l++) comb[(t0 + l) * hc * hc + i] = c[i][l];
    }
    return 0;
}

/* a . b over n floats in LANES partial sums (a single running sum would be one long chain of dependent adds) */
static float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (; i < n; i++) sum += a[i] * b[i];
    for (int l = 0; l < LANES; l++) sum += part[l];
    return sum;
}

/* The rest of hc_token_pre once the raw mixes [(2 + hc) * hc] = fn . streams are known (decode computes them on its
   threads: fn is 1.5 MB per sublayer on V4-Flash): scaled by the streams' RMS factor, then the weights, the
   collapse and the norm. */
int hc_token_pre_mixed(const float *streams, int hc, int64_t hidden, const float *raw_mixes, const float *scale,
                       const float *base, int iters, float hc_eps, float norm_eps, const float *norm_weight, float *x,
                       float *post, float *comb)
{
    if (hc < 1 || hc > HC_MAX || hidden < 1) return 1;
    const int64_t flat = hc * hidden;
    const int width = (2 + hc) * hc;
    float mixes[(2 + HC_MAX) * HC_MAX], pre[HC_MAX];
    const float factor = 1.0f / sqrtf(dot(streams, streams, flat) / (float)flat + norm_eps);
    for (int j = 0; j < width; j++) mixes[j] = raw_mixes[j] * factor;
    hc_mix_weights(mixes, 1, hc, scale, base, iters, hc_eps, pre, post, comb);
    for (int64_t h = 0; h < hidden; h++) x[h] = pre[0] * streams[h];
    for (int s = 1; s < hc; s++)
        for (int64_t h = 0; h < hidden; h++) x[h] += pre[s] * streams[s * hidden + h];
    const float inverse = 1.0f / sqrtf(dot(x, x, hidden) / (float)hidden + norm_eps);
    for (int64_t h = 0; h < hidden; h++) x[h] = x[h] * inverse * (norm_weight ? norm_weight[h] : 1.0f);
    return 0;
}

/* One decoded token's mHC entry, normed (model.hc_pre_norm): streams [hc, H] -> x [H] = RMSNorm(pre . streams) x
   norm_weight, with post [hc] and comb [hc, hc] from the mixes fn [(2 + hc) * hc, hc * H] . streams, scaled by
   the streams' RMS factor. In torch it is ~20 small ops. */
int hc_token_pre(const float *streams, int hc, int64_t hidden, const float *fn, const float *scale,
                 const float *base, int iters, float hc_eps, float norm_eps, const float *norm_weight, float *x,
                 float *post, float *comb)
{
    if (hc < 1 || hc > HC_MAX || hidden < 1) return 1;
    const int64_t flat = hc * hidden;
    float raw[(2 + HC_MAX) * HC_MAX];
    for (int j = 0; j < (2 + hc) * hc; j++) raw[j] = dot(fn + j * flat, streams, flat);
    return hc_token_pre_mixed(streams, hc, hidden, raw, scale, base, iters, hc_eps, norm_eps, norm_weight, x, post,
                              comb);
}

/* One decoded token's mHC exit (model.hc_post): into [hc, H] = comb^T . streams + post x out. Returns 2 (having
   written them) where the new streams hold a NaN or an infinity (decode's check_finite, from one sum). */
int hc_token_post(const float *streams, const float *out, const float *post, const float *comb, int hc,
                  int64_t hidden, float *into)
{
    if (hc < 1 || hc > HC_MAX || hidden < 1) return 1;
    float total = 0.0f;
    for (int k = 0; k < hc; k++) {
        float *row = into + k * hidden;
        for (int64_t h = 0; h < hidden; h++) row[h] = post[k] * out[h];
        for (int j = 0; j < hc; j++)
            for (int64_t h = 0; h < hidden; h++) row[h] += comb[j * hc + k] * streams[j * hidden + h];
        for (int64_t h = 0; h < hidden; h++) total += row[h] - row[h];  /* 0, or NaN from a NaN or an infinity */
    }
    return total == total ? 0 : 2;
}

/* Several decoded tokens' mHC entries after their raw mixes (hc_token_pre_mixed per row, the buffers' rows one after
   another: streams [rows, hc, H], raw_mixes [rows, (2 + hc) * hc], x [rows, H], post [rows, hc], comb [rows, hc,
   hc]): a batched step's rows in one call, each row's arithmetic the one-token call's. */
int hc_rows_pre_mixed(const float *streams, int64_t rows, int hc, int64_t hidden, const float *raw_mixes,
                      const float *scale, const float *base, int iters, float hc_eps, float norm_eps,
                      const float *norm_weight, float *x, float *post, float *comb)
{
    if (rows < 0) return 1;
    for (int64_t r = 0; r < rows; r++)
        if (hc_token_pre_mixed(streams + r * hc * hidden, hc, hidden, raw_mixes + r * (2 + hc) * hc, scale, base,
                               iters, hc_eps, norm_eps, norm_weight, x + r * hidden, post + r * hc,
                               comb + r * hc * hc))
            return 1;
    return 0;
}

/* Several decoded tokens' mHC exits (hc_token_post per row, rows one after another as above; out, into: [rows, H],
   [rows, hc, H]). Returns 1 where refused, else 2 (every row written) where any row's new streams are not finite. */
int hc_rows_post(const float *streams, const float *out, const float *post, const float *comb, int64_t rows, int hc,
                 int64_t hidden, float *into)
{
    if (rows < 0) return 1;
    int result = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int done = hc_token_post(streams + r * hc * hidden, out + r * hidden, post + r * hc, comb + r * hc * hc,
                                       hc, hidden, into + r * hc * hidden);
        if (done == 1) return 1;
        if (done == 2) result = 2;
    }
    return result;
}

/* kvpage native CPU kernels: a decoder layer's work around attention, for the few rows of a
 * decode step or a batch (llama family: RMSNorm, SiLU-gated MLP) over weights in a compact
 * format (formats.h).
 *
 * A decode step of a small model is hundreds of small operations; run one by one from Python,
 * their calls cost as much as their arithmetic. Here the layer is two calls: `kvp_layer_pre`
 * (norm, Q/K/V projections and their biases, RoPE on Q and K) before attention, `kvp_layer_post`
 * (output projection, residual, norm, MLP, residual) after it. The engine keeps the KV writes and
 * attention. Every row is computed alone, in one fixed order of operations, so the bits a row
 * gets do not depend on the rows beside it (a batch gives each sequence the bits it gets alone),
 * unless the caller asks for AMX tiles (`tiles`: a batch's generated tokens, from 8 rows).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpage.h"

/* out = w * (x / sqrt(mean(x^2) + eps)), row by row. */
static void rms_norm(const float *x, int M, int H, const float *w, float eps, float *out) {
    for (int r = 0; r < M; r++) {
        const float *xr = x + (int64_t)r * H;
        float *o = out + (int64_t)r * H;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; i++) ss += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

/* y[:, 0:m->rows] (row stride ldy) = x[M, m->cols] @ W^T (+ bias), outputs in feature order;
 * tmp: M * m->rows floats of scratch. */
static int product(const kvp_matrix *m, int tiles, const float *x, int M, const float *bias, float *y, int64_t ldy,
                   float *tmp) {
    const int N = m->rows;
    float *out = m->perm ? tmp : y;
    const int64_t ldo = m->perm ? N : ldy;
    const int rc = (m->int8 ? kvp_qgemm_rows_q8 : tiles ? kvp_qgemm_tiles : kvp_qgemm_rows)(
        m->type, x, m->cols, m->data, m->row_bytes, M, m->cols, N, out, ldo);
    if (rc != 0) return rc;
    for (int r = 0; r < M; r++) {
        float *yr = y + (int64_t)r * ldy;
        if (m->perm)
            for (int i = 0; i < N; i++) yr[i] = tmp[(int64_t)r * N + m->perm[i]];
        if (bias)
            for (int i = 0; i < N; i++) yr[i] += bias[i];
    }
    return 0;
}

/* x[n * D] <- RoPE at one position, head by head, as rope.py's apply_rope computes it:
 * x * cos + cat(-x[D/2:], x[:D/2]) * sin, each product and the sum rounded to float (this file is
 * built without floating-point contraction, so the bits are torch's). */
static void rope_heads(float *x, int n, int D, const float *cos, const float *sin) {
    const int half = D / 2;
    for (int j = 0; j < n; j++) {
        float *xh = x + (int64_t)j * D;
        float lo[half], hi[half];
        memcpy(lo, xh, sizeof(float) * half);
        memcpy(hi, xh + half, sizeof(float) * half);
        for (int i = 0; i < half; i++) {
            const float a = lo[i] * cos[i], b = -hi[i] * sin[i];
            xh[i] = a + b;
        }
        for (int i = 0; i < half; i++) {
            const float a = hi[i] * cos[half + i], b = lo[i] * sin[half + i];
            xh[half + i] = a + b;
        }
    }
}

/* qkv[M, q_size + 2 kv_size] = the Q, K, V projections of norm(h) (h: [M, hidden]), biases added;
 * with cos and sin ([M, head_dim], each row's position; NULL: none) Q and K leave rotated. tiles:
 * products through kvp_qgemm_tiles (AMX from 8 rows: other bits than the rows' path) rather than
 * kvp_qgemm_rows. Returns 0, a kvp_qgemm_rows error code, or -2 out of memory. */
int kvp_layer_pre(const kvp_layer *L, const float *h, int M, const float *cos, const float *sin, float *qkv, int tiles) {
    const int H = L->hidden, width = L->q_size + 2 * L->kv_size;
    float *x = malloc(sizeof(float) * (size_t)M * (size_t)(H + L->q_size));
    if (x == NULL) return -2;
    float *tmp = x + (size_t)M * H;
    rms_norm(h, M, H, L->norm_attn, L->eps, x);
    const float *b = L->qkv_bias;
    int rc = product(&L->q, tiles, x, M, b, qkv, width, tmp);
    if (rc == 0) rc = product(&L->k, tiles, x, M, b ? b + L->q_size : NULL, qkv + L->q_size, width, tmp);
    if (rc == 0) rc = product(&L->v, tiles, x, M, b ? b + L->q_size + L->kv_size : NULL, qkv + L->q_size + L->kv_size,
                              width, tmp);
    if (rc == 0 && cos != NULL) {
        const int D = L->head_dim;
        for (int r = 0; r < M; r++)
            rope_heads(qkv + (int64_t)r * width, (L->q_size + L->kv_size) / D, D, cos + (int64_t)r * D,
                       sin + (int64_t)r * D);
    }
    free(x);
    return rc;
}

/* h[M, hidden] += o(a); then h += down(silu(gate(x)) * up(x)), x = norm(h): the rest of the layer
 * (a: attention's output [M, q_size]; tiles: as kvp_layer_pre's). Returns 0, a kvp_qgemm_rows error code,
 * or -2 out of memory. */
int kvp_layer_post(const kvp_layer *L, float *h, const float *a, int M, int tiles) {
    const int H = L->hidden, I = L->inter;
    float *t = malloc(sizeof(float) * (size_t)M * (size_t)(3 * H + 3 * I));
    if (t == NULL) return -2;
    float *x = t + (size_t)M * H, *g = x + (size_t)M * H, *u = g + (size_t)M * I, *tmp = u + (size_t)M * I;
    int rc = product(&L->o, tiles, a, M, L->o_bias, t, H, tmp);
    if (rc == 0) {
        for (int64_t i = 0; i < (int64_t)M * H; i++) h[i] += t[i];
        rms_norm(h, M, H, L->norm_mlp, L->eps, x);
        const float *b = L->gate_up_bias;
        rc = product(&L->gate, tiles, x, M, b, g, I, tmp);
        if (rc == 0) rc = product(&L->up, tiles, x, M, b ? b + I : NULL, u, I, tmp);
    }
    if (rc == 0) {
        for (int64_t i = 0; i < (int64_t)M * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        rc = product(&L->down, tiles, g, M, L->down_bias, t, H, tmp);
    }
    if (rc == 0)
        for (int64_t i = 0; i < (int64_t)M * H; i++) h[i] += t[i];
    free(t);
    return rc;
}

/* kvpage native CPU kernels: decode attention over blocks read through an address table.
 *
 * Built on first use by kvpage_cli/engine/native.py with the machine's C compiler and loaded
 * with ctypes (no torch headers, no Python API). Every block is addressed through a table of
 * int64 addresses indexed by id, so the same kernel reads store arenas in place or pool slots.
 *
 * Each block's partial state (output normalised by its own softmax sum, and its log-sum-exp) is
 * computed independently and the states are merged in logical block order, so the result does
 * not depend on how blocks were grouped into passes or which slots held them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_TOKENS 64
#define MAX_GROUP 16
#define MAX_DIM 512

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) for x <= 0 (softmax numerators): Cephes-style polynomial, about 1 ulp, branch-free so
 * that the loops calling it vectorise. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* Converts one row of D elements to fp32. */
static inline __attribute__((always_inline)) void load_row(const void *base, int64_t index, int D, int bf16, float *row) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + index * D;
        for (int d = 0; d < D; d++) row[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(row, (const float *)base + index * D, sizeof(float) * (size_t)D);
    }
}

/* One block, one KV head: G query rows q[G, D] against K/V rows [t_lo, t_hi) of k, v ([64, D]).
 * Writes each row's output normalised by its softmax sum to o[G, D] and its lse to lse[G]. */
static inline __attribute__((always_inline)) void block_head(const float *q, const void *k, const void *v, int bf16, int G, int D,
                       int t_lo, int t_hi, float scale, float *o, float *lse) {
    float scores[MAX_GROUP][BLOCK_TOKENS];
    float row[MAX_DIM];
    for (int t = t_lo; t < t_hi; t++) {
        const float *krow = row;
        if (bf16) {
            load_row(k, t, D, 1, row);
        } else {
            krow = (const float *)k + (int64_t)t * D;
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < D; d++) acc += qg[d] * krow[d];
            scores[g][t] = acc * scale;
        }
    }
    float inv_l[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        float *s = scores[g];
        float m = -INFINITY;
        for (int t = t_lo; t < t_hi; t++) m = s[t] > m ? s[t] : m;
        float l = 0.0f;
#pragma omp simd reduction(+ : l)
        for (int t = t_lo; t < t_hi; t++) {
            float p = exp_nonpositive(s[t] - m);
            s[t] = p;
            l += p;
        }
        lse[g] = m + logf(l);
        inv_l[g] = 1.0f / l;
        memset(o + (int64_t)g * D, 0, sizeof(float) * (size_t)D);
    }
    for (int t = t_lo; t < t_hi; t++) {
        const float *vrow = row;
        if (bf16) {
            load_row(v, t, D, 1, row);
        } else {
            vrow = (const float *)v + (int64_t)t * D;
        }
        for (int g = 0; g < G; g++) {
            const float p = scores[g][t];
            float *og = o + (int64_t)g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) og[d] += p * vrow[d];
        }
    }
    for (int g = 0; g < G; g++) {
        float *og = o + (int64_t)g * D;
        const float f = inv_l[g];
#pragma omp simd
        for (int d = 0; d < D; d++) og[d] *= f;
    }
}

/* All blocks of one query token; D is a compile-time constant where the caller passes a literal,
 * so the inner loops unroll. */
static inline __attribute__((always_inline)) void decode_blocks(
    int bf16, const float *q, const int64_t *k_addr, const int64_t *v_addr, const int32_t *ids,
    const int32_t *block_pos, int n, int Hq, int Hkv, int D, int64_t q_pos, int64_t seq_end,
    int64_t window, float scale, float *states, float *lse) {
    const int G = Hq / Hkv;
    const int elem = bf16 ? 2 : 4;
    const int64_t head_bytes = (int64_t)BLOCK_TOKENS * D * elem;
    for (int b = 0; b < n; b++) {
        const int64_t start = (int64_t)block_pos[b] * BLOCK_TOKENS;
        int64_t lo = 0, hi = BLOCK_TOKENS;
        if (window > 0 && q_pos - window + 1 - start > lo) lo = q_pos - window + 1 - start;
        const int64_t end = (q_pos + 1 < seq_end ? q_pos + 1 : seq_end) - start;
        if (end < hi) hi = end;
        float *sb = states + (int64_t)b * Hq * D;
        float *lb = lse + (int64_t)b * Hq;
        if (hi <= lo) {
            memset(sb, 0, sizeof(float) * (size_t)Hq * D);
            for (int h = 0; h < Hq; h++) lb[h] = -INFINITY;
            continue;
        }
        const char *kb = (const char *)(intptr_t)k_addr[ids[b]];
        const char *vb = (const char *)(intptr_t)v_addr[ids[b]];
        for (int h = 0; h < Hkv; h++) {
            block_head(q + (int64_t)h * G * D, kb + h * head_bytes, vb + h * head_bytes, bf16, G, D,
                       (int)lo, (int)hi, scale, sb + (int64_t)h * G * D, lb + h * G);
        }
    }
}

/* Per-block states for one query token: states[n, Hq, D] and lse[n, Hq] (blocks in the order
 * given). A block with no visible token gets lse = -inf and a zero output. */
int kvp_decode_block_states(int bf16, const float *q, const int64_t *k_addr, const int64_t *v_addr,
                            const int32_t *ids, const int32_t *block_pos, int n, int Hq, int Hkv,
                            int D, int64_t q_pos, int64_t seq_end, int64_t window, float scale,
                            float *states, float *lse) {
    if (Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM) return -1;
#define CALL(DIM) decode_blocks(bf16, q, k_addr, v_addr, ids, block_pos, n, Hq, Hkv, DIM, q_pos, seq_end, window, scale, states, lse)
    switch (D) {
        case 64: CALL(64); break;
        case 128: CALL(128); break;
        case 256: CALL(256); break;
        default: CALL(D); break;
    }
#undef CALL
    return 0;
}

/* Merges per-block states [n, H, D] / [n, H] in block order into out[H, D] (fp32). */
void kvp_merge_states(const float *states, const float *lse, int n, int H, int D, float *out) {
    for (int h = 0; h < H; h++) {
        float m = -INFINITY;
        for (int b = 0; b < n; b++) m = lse[(int64_t)b * H + h] > m ? lse[(int64_t)b * H + h] : m;
        float *oh = out + (int64_t)h * D;
        memset(oh, 0, sizeof(float) * (size_t)D);
        if (m == -INFINITY) continue;
        float total = 0.0f;
        for (int b = 0; b < n; b++) {
            const float l = lse[(int64_t)b * H + h];
            if (l == -INFINITY) continue;
            const float w = expf(l - m);
            total += w;
            const float *sb = states + ((int64_t)b * H + h) * D;
#pragma omp simd
            for (int d = 0; d < D; d++) oh[d] += w * sb[d];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int d = 0; d < D; d++) oh[d] *= inv;
    }
}

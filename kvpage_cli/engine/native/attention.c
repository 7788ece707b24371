/* kvpage native CPU kernels: decode attention over blocks read through an address table, and
 * the in-order fold of per-block attention states.
 *
 * Built on first use by kvpage_cli/engine/native.py with the machine's C compiler and loaded
 * with ctypes (no torch headers, no Python API). OpenMP resolves to the runtime torch already
 * loaded (libgomp.so.1), so torch.set_num_threads governs these kernels too.
 *
 * Every block is addressed through a table of int64 addresses indexed by id, so the same kernel
 * reads store arenas in place or pool slots. Each block's partial state (output normalised by its
 * own softmax sum, and its log-sum-exp) is computed independently and states are merged in
 * logical block order, so results do not depend on how blocks were grouped into passes or which
 * slots held them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* Softmax of G rows of scores over tokens [t_lo, t_hi): scores become probabilities (not yet
 * normalised), lse[g] and inv_l[g] = 1 / sum are written. */
static inline __attribute__((always_inline)) void softmax_rows(float scores[][BLOCK_TOKENS], int G, int t_lo, int t_hi,
                                                               float *lse, float *inv_l) {
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
    }
}

/* Portable version: one block, one KV head, any G and D. q: [G, D]; k, v: [64, D] of fp32 or
 * bf16; rows [t_lo, t_hi) visible. Writes o: [G, D] normalised, lse: [G]. */
static void block_head_generic(const float *q, const void *k, const void *v, int bf16, int G, int D,
                               int t_lo, int t_hi, float scale, float *o, float *lse) {
    float scores[MAX_GROUP][BLOCK_TOKENS];
    float row[MAX_DIM];
    for (int t = t_lo; t < t_hi; t++) {
        for (int d = 0; d < D; d++)
            row[d] = bf16 ? bf16_to_f32(((const uint16_t *)k)[(int64_t)t * D + d]) : ((const float *)k)[(int64_t)t * D + d];
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < D; d++) acc += qg[d] * row[d];
            scores[g][t] = acc * scale;
        }
    }
    float inv_l[MAX_GROUP];
    softmax_rows(scores, G, t_lo, t_hi, lse, inv_l);
    for (int g = 0; g < G; g++) memset(o + (int64_t)g * D, 0, sizeof(float) * (size_t)D);
    for (int t = t_lo; t < t_hi; t++) {
        for (int d = 0; d < D; d++)
            row[d] = bf16 ? bf16_to_f32(((const uint16_t *)v)[(int64_t)t * D + d]) : ((const float *)v)[(int64_t)t * D + d];
        for (int g = 0; g < G; g++) {
            const float p = scores[g][t];
            float *og = o + (int64_t)g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) og[d] += p * row[d];
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) o[(int64_t)g * D + d] *= inv_l[g];
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t index, const int BF16) {
    if (BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* AVX-512 version for D in {64, 128, 256} and G <= 8, all compile-time constants after inlining
 * so that the K row and the output accumulators live in registers. */
static inline __attribute__((always_inline)) void block_head_512(const float *q, const void *k, const void *v, const int BF16,
                                                                 const int G, const int D, int t_lo, int t_hi, float scale,
                                                                 float *o, float *lse) {
    float scores[MAX_GROUP][BLOCK_TOKENS] __attribute__((aligned(64)));
    const int C = D / 16;
    for (int t = t_lo; t < t_hi; t++) {
        __m512 kr[16];
        for (int c = 0; c < C; c++) kr[c] = load16(k, (int64_t)t * D + 16 * c, BF16);
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
            for (int c = 1; c < C; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], acc);
            scores[g][t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    float inv_l[MAX_GROUP];
    softmax_rows(scores, G, t_lo, t_hi, lse, inv_l);
    int CC = C; /* chunks of 16 dims per pass, so that G * CC accumulators fit in registers */
    while (G * CC > 24 && CC > 1) CC /= 2;
    for (int c0 = 0; c0 < C; c0 += CC) {
        __m512 acc[8][16];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CC; c++) acc[g][c] = _mm512_setzero_ps();
        for (int t = t_lo; t < t_hi; t++) {
            for (int c = 0; c < CC; c++) {
                __m512 vv = load16(v, (int64_t)t * D + 16 * (c0 + c), BF16);
                for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][t]), vv, acc[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CC; c++)
                _mm512_storeu_ps(o + (int64_t)g * D + 16 * (c0 + c), _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_l[g])));
    }
}
#endif

/* The tokens of block b visible to the query: [*lo, *hi) within the block. */
static inline void visible_rows(int64_t block_index, int64_t q_pos, int64_t seq_end, int64_t window, int64_t *lo, int64_t *hi) {
    const int64_t start = block_index * BLOCK_TOKENS;
    *lo = 0;
    *hi = BLOCK_TOKENS;
    if (window > 0 && q_pos - window + 1 - start > *lo) *lo = q_pos - window + 1 - start;
    const int64_t end = (q_pos + 1 < seq_end ? q_pos + 1 : seq_end) - start;
    if (end < *hi) *hi = end;
}

/* All blocks of one query token, in parallel over blocks. SPECIAL selects the AVX-512 path
 * with compile-time G, D and element type. */
static inline __attribute__((always_inline)) void decode_blocks(
    const int SPECIAL, const int BF16, const int G, const int D, const float *q, const int64_t *k_addr,
    const int64_t *v_addr, const int32_t *ids, const int32_t *block_pos, int n, int Hkv, int64_t q_pos,
    int64_t seq_end, int64_t window, float scale, float *states, float *lse) {
    const int Hq = Hkv * G;
    const int64_t head_bytes = (int64_t)BLOCK_TOKENS * D * (BF16 ? 2 : 4);
#pragma omp parallel for schedule(static)
    for (int b = 0; b < n; b++) {
        int64_t lo, hi;
        visible_rows(block_pos[b], q_pos, seq_end, window, &lo, &hi);
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
            const float *qh = q + (int64_t)h * G * D;
#if defined(__AVX512F__)
            if (SPECIAL) {
                block_head_512(qh, kb + h * head_bytes, vb + h * head_bytes, BF16, G, D, (int)lo, (int)hi, scale,
                               sb + (int64_t)h * G * D, lb + h * G);
                continue;
            }
#endif
            block_head_generic(qh, kb + h * head_bytes, vb + h * head_bytes, BF16, G, D, (int)lo, (int)hi, scale,
                               sb + (int64_t)h * G * D, lb + h * G);
        }
    }
}

#define DECODE(SPECIAL, BF16, G, D) \
    decode_blocks(SPECIAL, BF16, G, D, q, k_addr, v_addr, ids, block_pos, n, Hkv, q_pos, seq_end, window, scale, states, lse)
#define CASE_G(BF16, D, G) \
    case G: DECODE(1, BF16, G, D); return 0;
#define CASES_G(BF16, D)                                                                                      \
    switch (G) {                                                                                              \
        CASE_G(BF16, D, 1) CASE_G(BF16, D, 2) CASE_G(BF16, D, 3) CASE_G(BF16, D, 4) CASE_G(BF16, D, 5) \
        CASE_G(BF16, D, 6) CASE_G(BF16, D, 7) CASE_G(BF16, D, 8) default: break;                           \
    }

/* Per-block states for one query token: states[n, Hq, D] and lse[n, Hq], blocks in the order
 * given. A block with no visible token gets lse = -inf and a zero output. Returns -1 for shapes
 * it does not handle. */
int kvp_decode_block_states(int bf16, const float *q, const int64_t *k_addr, const int64_t *v_addr,
                            const int32_t *ids, const int32_t *block_pos, int n, int Hq, int Hkv, int D,
                            int64_t q_pos, int64_t seq_end, int64_t window, float scale, float *states, float *lse) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM) return -1;
    const int G = Hq / Hkv;
#if defined(__AVX512F__)
    if (bf16) {
        if (D == 64) { CASES_G(1, 64) }
        if (D == 128) { CASES_G(1, 128) }
        if (D == 256) { CASES_G(1, 256) }
    } else {
        if (D == 64) { CASES_G(0, 64) }
        if (D == 128) { CASES_G(0, 128) }
        if (D == 256) { CASES_G(0, 256) }
    }
#endif
    if (bf16)
        DECODE(0, 1, G, D);
    else
        DECODE(0, 0, G, D);
    return 0;
}

/* Merges per-block states [n, H, D] / [n, H] in block order into out[H, D] (fp32). */
void kvp_merge_states(const float *states, const float *lse, int n, int H, int D, float *out) {
#pragma omp parallel for schedule(static)
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

/* Folds per-block states [n, H, D] / [n, H] one block after the other, in order, into a running
 * state (acc [H, D] unnormalised, m [H] running max, l [H] running sum). Folding block by block
 * makes the result independent of how the blocks were split into calls. */
void kvp_fold_states(const float *states, const float *lse, int n, int H, int D, float *acc, float *m, float *l) {
#pragma omp parallel for schedule(static)
    for (int h = 0; h < H; h++) {
        float *ah = acc + (int64_t)h * D;
        float mh = m[h], lh = l[h];
        for (int b = 0; b < n; b++) {
            const float x = lse[(int64_t)b * H + h];
            if (x == -INFINITY) continue;
            const float *sb = states + ((int64_t)b * H + h) * D;
            if (x > mh) {
                const float shrink = (mh == -INFINITY) ? 0.0f : expf(mh - x);
                lh = lh * shrink + 1.0f;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] = ah[d] * shrink + sb[d];
                mh = x;
            } else {
                const float w = expf(x - mh);
                lh += w;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] += w * sb[d];
            }
        }
        m[h] = mh;
        l[h] = lh;
    }
}

/* y[out] = x[in] @ w[in, out] (w row-major, i.e. the transposed weight). Rows are split between
 * threads, each streaming its rows in order into a partial sum; partials are added at the end. */
void kvp_gemv(int bf16, const float *x, const void *w, int in, int out, float *y, float *partial) {
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
    if (threads > 8) threads = 8;
#endif
#pragma omp parallel num_threads(threads)
    {
        int t = 0, nt = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int r0 = (int)((int64_t)in * t / nt), r1 = (int)((int64_t)in * (t + 1) / nt);
        float *acc = partial + (int64_t)t * out;
        memset(acc, 0, sizeof(float) * (size_t)out);
        int i = r0;
        for (; i + 4 <= r1; i += 4) {
            const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
            if (bf16) {
                const uint16_t *w0 = (const uint16_t *)w + (int64_t)i * out;
#pragma omp simd
                for (int j = 0; j < out; j++)
                    acc[j] += x0 * bf16_to_f32(w0[j]) + x1 * bf16_to_f32(w0[out + j]) + x2 * bf16_to_f32(w0[2 * out + j]) +
                              x3 * bf16_to_f32(w0[3 * out + j]);
            } else {
                const float *w0 = (const float *)w + (int64_t)i * out;
#pragma omp simd
                for (int j = 0; j < out; j++)
                    acc[j] += x0 * w0[j] + x1 * w0[out + j] + x2 * w0[2 * out + j] + x3 * w0[3 * out + j];
            }
        }
        for (; i < r1; i++) {
            const float xi = x[i];
            if (bf16) {
                const uint16_t *wi = (const uint16_t *)w + (int64_t)i * out;
#pragma omp simd
                for (int j = 0; j < out; j++) acc[j] += xi * bf16_to_f32(wi[j]);
            } else {
                const float *wi = (const float *)w + (int64_t)i * out;
#pragma omp simd
                for (int j = 0; j < out; j++) acc[j] += xi * wi[j];
            }
        }
#pragma omp barrier
        const int c0 = (int)((int64_t)out * t / nt), c1 = (int)((int64_t)out * (t + 1) / nt);
        for (int j = c0; j < c1; j++) {
            float s = 0.0f;
            for (int p = 0; p < nt; p++) s += partial[(int64_t)p * out + j];
            y[j] = s;
        }
    }
}

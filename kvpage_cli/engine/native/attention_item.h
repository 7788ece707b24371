/* attention_item.h: the per-item body of decode attention (kvp_decode_states in attention.c)
 * and the functions it is specialised into. attention_f32.c, attention_bf16.c and
 * attention_int8.c each compile the specialisations of one element kind (24 functions of
 * constant G and D, their inner loops unrolled: most of the library's compile time), so that
 * the build compiles the three at once; attention.c picks among them.
 */
#ifndef KVPAGE_ATTENTION_ITEM_H
#define KVPAGE_ATTENTION_ITEM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvpage.h"
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HAVE_BLOCK_HEAD_SIMD /* block_head_512 or block_head_256 below */
#endif

#ifndef BLOCK_TOKENS
#error "BLOCK_TOKENS is defined by the build (kvpage_cli/engine/native/__init__.py)"
#endif
#define MAX_GROUP 16
/* Rows of a block's pass in the SIMD path: several queries' G rows each where G is small. */
#if defined(__AVX512F__)
#define STACKED_ROWS 16
#else
#define STACKED_ROWS 12
#endif
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

/* softmax_rows, compiled once (R at run time): the SIMD paths below inline their rows' loops with
 * their counts as constants, and a row's softmax must come out the same whether it went through a
 * block with its query alone or beside others (the compiler could vectorise each inlined copy of
 * these loops its own way). */
#if defined(HAVE_BLOCK_HEAD_SIMD)
static __attribute__((noinline)) void softmax_rows_any(float scores[][BLOCK_TOKENS], int R, int t_lo, int t_hi,
                                                       float *lse, float *inv_l) {
    softmax_rows(scores, R, t_lo, t_hi, lse, inv_l);
}
#endif


static inline float row_scale(const void *block, int KIND, int D, int t) {
    return KIND == KIND_INT8 ? ((const float *)((const int8_t *)block + (int64_t)BLOCK_TOKENS * D))[t] : 1.0f;
}

static inline float element(const void *block, int KIND, int64_t index, float row_scale) {
    if (KIND == KIND_BF16) return bf16_to_f32(((const uint16_t *)block)[index]);
    if (KIND == KIND_INT8) return (float)((const int8_t *)block)[index] * row_scale;
    return ((const float *)block)[index];
}

/* Portable version: one block, one KV head, any G and D. q: [G, D]; k, v: [64, D] of one element
 * kind; rows [t_lo, t_hi) visible. Writes o: [G, D] normalised, lse: [G]. */
static void block_head_generic(const float *q, const void *k, const void *v, int KIND, int G, int D,
                               int t_lo, int t_hi, float scale, float *o, float *lse) {
    float scores[MAX_GROUP][BLOCK_TOKENS];
    float row[MAX_DIM];
    for (int t = t_lo; t < t_hi; t++) {
        const float rs = row_scale(k, KIND, D, t);
        for (int d = 0; d < D; d++) row[d] = element(k, KIND, (int64_t)t * D + d, rs);
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
        const float rs = row_scale(v, KIND, D, t);
        for (int d = 0; d < D; d++) row[d] = element(v, KIND, (int64_t)t * D + d, rs);
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
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t index, const int KIND, float rs) {
    if (KIND == KIND_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (KIND == KIND_INT8) {
        __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)base + index));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(rs));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* AVX-512 version for D in {64, 128, 256} and G <= 8, all compile-time constants after inlining
 * so that the K row and the output accumulators live in registers. The rows are those of QN
 * queries (QN * G <= MAX_GROUP) that see the same tokens of the block: query j's G rows at qs[j],
 * its outputs at os[j], its log-sum-exps at ls[j]; every row goes through the same operations
 * whatever QN is, so a query's bits do not depend on the queries beside it. pfk, pfv (or null):
 * another block head's K and V, prefetched row by row beside this one's rows (the next item's). */
static inline __attribute__((always_inline)) void block_head_512(const float *const *qs, const void *k, const void *v,
                                                                 const int KIND, const int QN, const int G, const int D,
                                                                 int t_lo, int t_hi, float scale, float *const *os,
                                                                 float *const *ls, const char *pfk, const char *pfv) {
    float scores[MAX_GROUP][BLOCK_TOKENS] __attribute__((aligned(64)));
    const int R = QN * G;
    const int C = D / 16;
    const int RB = D * (KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1); /* bytes of a row */
    if (KIND == KIND_INT8 && pfk && pfv)
        for (int off = 0; off < BLOCK_TOKENS * (int)sizeof(float); off += 64) { /* the rows' scales */
            _mm_prefetch(pfk + (int64_t)BLOCK_TOKENS * RB + off, _MM_HINT_T0);
            _mm_prefetch(pfv + (int64_t)BLOCK_TOKENS * RB + off, _MM_HINT_T0);
        }
    for (int t = t_lo; t < t_hi; t++) {
        if (pfk) for (int off = 0; off < RB; off += 64) _mm_prefetch(pfk + (int64_t)t * RB + off, _MM_HINT_T0);
        __m512 kr[16];
        const float rs = row_scale(k, KIND, D, t);
        for (int c = 0; c < C; c++) kr[c] = load16(k, (int64_t)t * D + 16 * c, KIND, rs);
        for (int r = 0; r < R; r++) {
            const float *qg = qs[r / G] + (int64_t)(r % G) * D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
            for (int c = 1; c < C; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], acc);
            scores[r][t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    float inv_l[MAX_GROUP], lse[MAX_GROUP];
    softmax_rows_any(scores, R, t_lo, t_hi, lse, inv_l);
    for (int r = 0; r < R; r++) ls[r / G][r % G] = lse[r];
    int CC = C; /* chunks of 16 dims per pass, so that R * CC accumulators fit in registers */
    while (R * CC > 24 && CC > 1) CC /= 2;
    for (int c0 = 0; c0 < C; c0 += CC) {
        __m512 acc[MAX_GROUP][16];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CC; c++) acc[r][c] = _mm512_setzero_ps();
        for (int t = t_lo; t < t_hi; t++) {
            if (pfv && c0 == 0) for (int off = 0; off < RB; off += 64) _mm_prefetch(pfv + (int64_t)t * RB + off, _MM_HINT_T0);
            for (int c = 0; c < CC; c++) {
                __m512 vv = load16(v, (int64_t)t * D + 16 * (c0 + c), KIND, row_scale(v, KIND, D, t));
                for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r][t]), vv, acc[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CC; c++)
                _mm512_storeu_ps(os[r / G] + (int64_t)(r % G) * D + 16 * (c0 + c),
                                 _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv_l[r])));
    }
}
#elif defined(HAVE_BLOCK_HEAD_SIMD)
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t index, const int KIND, float rs) {
    if (KIND == KIND_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (KIND == KIND_INT8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + index));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(rs));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

/* Lane i: the sum of a[i]'s eight floats, ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) for
 * every lane, so a row's sum does not depend on the rows beside it. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h23 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h01, h23, 0x20), _mm256_permute2f128_ps(h01, h23, 0x31));
}

/* AVX2 version of block_head_512 (CPUs without AVX-512): 8 floats a vector, the same steps and
 * arguments. Its bits are its own (not block_head_512's or the portable version's); each query's
 * state still depends on nothing but the query and the block. */
static inline __attribute__((always_inline)) void block_head_256(const float *const *qs, const void *k, const void *v,
                                                                 const int KIND, const int QN, const int G, const int D,
                                                                 int t_lo, int t_hi, float scale, float *const *os,
                                                                 float *const *ls, const char *pfk, const char *pfv) {
    float scores[MAX_GROUP][BLOCK_TOKENS] __attribute__((aligned(64)));
    const int R = QN * G;
    const int C = D / 8;
    const int RB = D * (KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1); /* bytes of a row */
    for (int t = t_lo; t < t_hi; t++) {
        if (pfk) for (int off = 0; off < RB; off += 64) _mm_prefetch(pfk + (int64_t)t * RB + off, _MM_HINT_T0);
        __m256 kr[32];
        const float rs = row_scale(k, KIND, D, t);
        for (int c = 0; c < C; c++) kr[c] = load8(k, (int64_t)t * D + 8 * c, KIND, rs);
        for (int r0 = 0; r0 < R; r0 += 8) { /* eight rows' sums at once (rows past R: zeros) */
            __m256 acc[8];
            for (int i = 0; i < 8; i++) {
                acc[i] = _mm256_setzero_ps();
                if (r0 + i >= R) continue;
                const float *qg = qs[(r0 + i) / G] + (int64_t)((r0 + i) % G) * D;
                acc[i] = _mm256_mul_ps(_mm256_loadu_ps(qg), kr[0]);
                for (int c = 1; c < C; c++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), kr[c], acc[i]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
            for (int i = 0; i < 8 && r0 + i < R; i++) scores[r0 + i][t] = sums[i];
        }
    }
    float inv_l[MAX_GROUP], lse[MAX_GROUP];
    softmax_rows_any(scores, R, t_lo, t_hi, lse, inv_l);
    for (int r = 0; r < R; r++) ls[r / G][r % G] = lse[r];
    int CC = C; /* chunks of 8 dims per pass, so that R * CC accumulators fit in registers */
    while (R * CC > 12 && CC > 1) CC /= 2;
    for (int c0 = 0; c0 < C; c0 += CC) {
        __m256 acc[MAX_GROUP][32];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CC; c++) acc[r][c] = _mm256_setzero_ps();
        for (int t = t_lo; t < t_hi; t++) {
            if (pfv && c0 == 0)
                for (int off = 0; off < RB; off += 64) _mm_prefetch(pfv + (int64_t)t * RB + off, _MM_HINT_T0);
            for (int c = 0; c < CC; c++) {
                __m256 vv = load8(v, (int64_t)t * D + 8 * (c0 + c), KIND, row_scale(v, KIND, D, t));
                for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[r][t]), vv, acc[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CC; c++)
                _mm256_storeu_ps(os[r / G] + (int64_t)(r % G) * D + 8 * (c0 + c),
                                 _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv_l[r])));
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

/* One (block, query) pair: the query's G rows per KV head over the block's visible tokens.
 * SPECIAL selects the SIMD path (AVX-512, else AVX2) with compile-time G, D and element kind;
 * there QN > 1 takes QN pairs of the block at once (queries at q[j], states at sb[j] and lb[j]),
 * all seeing its tokens [lo, hi), each with the bits it gets alone. */
static inline __attribute__((always_inline)) void pair_state(
    const int SPECIAL, const int KIND, const int QN, const int G, const int D, const float *const *q,
    const int64_t *k_addr, const int64_t *v_addr, int Hkv, int64_t lo, int64_t hi, float scale, float *const *sb,
    float *const *lb, const int64_t *pk_addr, const int64_t *pv_addr) {
    const int Hq = Hkv * G;
    if (hi <= lo) {
        for (int j = 0; j < QN; j++) {
            memset(sb[j], 0, sizeof(float) * (size_t)Hq * D);
            for (int h = 0; h < Hq; h++) lb[j][h] = -INFINITY;
        }
        return;
    }
    for (int h = 0; h < Hkv; h++) {
        const void *kb = (const void *)(intptr_t)k_addr[h];
        const void *vb = (const void *)(intptr_t)v_addr[h];
#if defined(HAVE_BLOCK_HEAD_SIMD)
        if (SPECIAL) {
            const float *qs[MAX_GROUP];
            float *os[MAX_GROUP], *ls[MAX_GROUP];
            for (int j = 0; j < QN; j++) {
                qs[j] = q[j] + (int64_t)h * G * D;
                os[j] = sb[j] + (int64_t)h * G * D;
                ls[j] = lb[j] + h * G;
            }
            const char *pfk = pk_addr ? (const char *)(intptr_t)pk_addr[h] : 0;
            const char *pfv = pv_addr ? (const char *)(intptr_t)pv_addr[h] : 0;
#if defined(__AVX512F__)
            block_head_512(qs, kb, vb, KIND, QN, G, D, (int)lo, (int)hi, scale, os, ls, pfk, pfv);
#else
            block_head_256(qs, kb, vb, KIND, QN, G, D, (int)lo, (int)hi, scale, os, ls, pfk, pfv);
#endif
            continue;
        }
#else
        (void)SPECIAL, (void)pk_addr, (void)pv_addr;
#endif
        for (int j = 0; j < QN; j++)
            block_head_generic(q[j] + (int64_t)h * G * D, kb, vb, KIND, G, D, (int)lo, (int)hi, scale,
                               sb[j] + (int64_t)h * G * D, lb[j] + h * G);
    }
}

/* The arguments of one kvp_decode_states call, as the per-item functions below read them. */
typedef struct {
    int n_items;
    const float *q;
    const int64_t *k_addr, *v_addr;
    const int32_t *item_ids, *item_pos, *item_off, *pair_query;
    const int64_t *q_pos, *q_end;
    int Hkv, G, D;
    int64_t window;
    float scale;
    float *states, *lse;
} decode_args;

/* Every pair of item i: an item is one block and the queries that read it (several sequences
 * sharing a forked prefix read it once, from cache, for all of them). */
static inline __attribute__((always_inline)) void decode_item(const int SPECIAL, const int KIND, const int G, const int D,
                                                              const decode_args *a, int i) {
    const int Hq = a->Hkv * G;
    /* The next item's K and V rows are prefetched a row at a time while this item's rows are
     * computed (by its first pair, in block_head_512), so that memory and arithmetic overlap; the
     * next item is most often this thread's next (first_item_of). */
    const int64_t *pk = 0, *pv = 0;
    if (SPECIAL && i + 1 < a->n_items) {
        pk = a->k_addr + (int64_t)a->item_ids[i + 1] * a->Hkv;
        pv = a->v_addr + (int64_t)a->item_ids[i + 1] * a->Hkv;
    }
    const int64_t *ka = a->k_addr + (int64_t)a->item_ids[i] * a->Hkv;
    const int64_t *va = a->v_addr + (int64_t)a->item_ids[i] * a->Hkv;
    /* QN pairs that see the same tokens of the block go through it together where the SIMD path
     * runs (a batch's queries over a shared document, a prompt segment's rows over earlier blocks):
     * its K and V rows loaded once for all their rows. */
    const int QN = SPECIAL ? STACKED_ROWS / G > 1 ? STACKED_ROWS / G : 1 : 1;
    for (int p = a->item_off[i]; p < a->item_off[i + 1];) {
        int64_t lo, hi, lo2, hi2;
        visible_rows(a->item_pos[i], a->q_pos[a->pair_query[p]], a->q_end[a->pair_query[p]], a->window, &lo, &hi);
        int n = 1;
        while (QN > 1 && n < QN && p + n < a->item_off[i + 1]) {
            const int qn = a->pair_query[p + n];
            visible_rows(a->item_pos[i], a->q_pos[qn], a->q_end[qn], a->window, &lo2, &hi2);
            if (lo2 != lo || hi2 != hi) break;
            n++;
        }
        const int64_t *pfk = p == a->item_off[i] ? pk : 0, *pfv = p == a->item_off[i] ? pv : 0;
        if (QN > 1 && n == QN) {
            const float *qs[MAX_GROUP];
            float *sbs[MAX_GROUP], *lbs[MAX_GROUP];
            for (int j = 0; j < QN; j++) {
                qs[j] = a->q + (int64_t)a->pair_query[p + j] * Hq * D;
                sbs[j] = a->states + (int64_t)(p + j) * Hq * D;
                lbs[j] = a->lse + (int64_t)(p + j) * Hq;
            }
            pair_state(SPECIAL, KIND, QN, G, D, qs, ka, va, a->Hkv, lo, hi, a->scale, sbs, lbs, pfk, pfv);
            p += QN;
            continue;
        }
        const float *q1 = a->q + (int64_t)a->pair_query[p] * Hq * D;
        float *sb1 = a->states + (int64_t)p * Hq * D, *lb1 = a->lse + (int64_t)p * Hq;
        pair_state(SPECIAL, KIND, 1, G, D, &q1, ka, va, a->Hkv, lo, hi, a->scale, &sb1, &lb1, pfk, pfv);
        p++;
    }
}

typedef void (*item_fn)(const decode_args *a, int i);

/* One function per specialisation (element kind, G, D: constants in its body, so that the
 * AVX-512 path keeps its accumulators in registers), called per item from one parallel loop: an
 * OpenMP region inside an inlined function would be outlined once, before inlining, with its
 * "constants" passed at run time. ITEM_FNS(KIND, name) defines them, the generic one (G and D
 * read at run time) and `item_fn attention_items_<name>(int G, int D)`, which picks one. */
#define ITEM_FN(KIND, G, D) \
    static void item_##KIND##_##G##_##D(const decode_args *a, int i) { decode_item(1, KIND, G, D, a, i); }
#define ITEM_FNS_G(KIND, D) \
    ITEM_FN(KIND, 1, D) ITEM_FN(KIND, 2, D) ITEM_FN(KIND, 3, D) ITEM_FN(KIND, 4, D) \
    ITEM_FN(KIND, 5, D) ITEM_FN(KIND, 6, D) ITEM_FN(KIND, 7, D) ITEM_FN(KIND, 8, D)
#define PICK_G(KIND, D)                                                                                    \
    switch (G) {                                                                                           \
        case 1: return item_##KIND##_1_##D; case 2: return item_##KIND##_2_##D;                          \
        case 3: return item_##KIND##_3_##D; case 4: return item_##KIND##_4_##D;                          \
        case 5: return item_##KIND##_5_##D; case 6: return item_##KIND##_6_##D;                          \
        case 7: return item_##KIND##_7_##D; case 8: return item_##KIND##_8_##D;                          \
        default: break;                                                                                    \
    }
#if defined(HAVE_BLOCK_HEAD_SIMD)
#define ITEM_FNS(KIND, name)                                                                               \
    ITEM_FNS_G(KIND, 64) ITEM_FNS_G(KIND, 128) ITEM_FNS_G(KIND, 256)                                     \
    static void item_generic(const decode_args *a, int i) { decode_item(0, KIND, a->G, a->D, a, i); }    \
    item_fn attention_items_##name(int G, int D) {                                                        \
        if (D == 64) { PICK_G(KIND, 64) }                                                                 \
        if (D == 128) { PICK_G(KIND, 128) }                                                               \
        if (D == 256) { PICK_G(KIND, 256) }                                                               \
        return item_generic;                                                                              \
    }
#else
#define ITEM_FNS(KIND, name)                                                                               \
    static void item_generic(const decode_args *a, int i) { decode_item(0, KIND, a->G, a->D, a, i); }    \
    item_fn attention_items_##name(int G, int D) { (void)G, (void)D; return item_generic; }
#endif

item_fn attention_items_f32(int G, int D);
item_fn attention_items_bf16(int G, int D);
item_fn attention_items_int8(int G, int D);

#endif

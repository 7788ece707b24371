/* kvpage native CPU kernels: prefill attention of many query rows over bfloat16 keys and values,
 * with the CPU's bfloat16 dot products (AVX512-BF16).
 *
 * A prefill chunk's R query rows per KV head attend to the S keys before and in the chunk (every
 * key, or causally up to each row's token, and within a sliding window where the layer has one),
 * read in place from the store's runs of blocks. torch's CPU flash attention does this in fp32 at
 * 100-200 GFLOP/s on a 2-core Zen 5, where the bfloat16 dot products of the same cores multiply at
 * four times the rate. The store keeps K and V in bfloat16 (the default beside quantized
 * weights), so their products with bfloat16 operands are exact; a query row is written as the sum
 * of three bfloat16 terms (each the bfloat16 of what the ones before leave, together within 2^-27
 * of it) and a softmax probability as two (within 2^-18), and every term is multiplied. Scores,
 * softmax statistics and outputs accumulate in fp32. bench/prefill_attention.py: 1.4-1.8x torch's
 * kernel, results within 4e-6 of the largest output from float64 attention (torch's: 2e-6).
 * Measured, not taken: two terms for Q (20% faster, 8x further off) and one for each (2.4-3.2x
 * torch's speed, 1e-2 to 2.5e-2 off).
 *
 * Each row is computed alone, in one fixed order of operations (64-key chunks in key order from
 * the call's first key, always a block's first; the same pairs of head dimensions per product), so
 * the bits a row gets do not depend on the rows beside it, their count, the thread computing it,
 * or where the prompt was cut into chunks: a batch gives each sequence the bits it gets alone.
 *
 * Where the CPU has AMX (its bfloat16 tile products) and Linux grants the tile state, the same
 * products run on tiles of 16 query rows (amx_rows): the same terms of Q and of the probabilities,
 * every product exact, sums in fp32 in another order than the dot products', so other bits than
 * the AVX512-BF16 path's, and again each row's own, whatever the rows beside it.
 * kvp_prefill_set_amx(0) takes the AVX512-BF16 path (tests hold both to the same tolerance).
 *
 * kvp_decode_tiles runs amx_rows for decode: a batch's queries that read the same block (forks
 * of one document) attend it on tiles, 16 of their rows at a time, the block as the one chunk.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpage.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define CHUNK 64 /* keys per softmax step */
#define TILE 6   /* query rows per register tile */
#define Q_TERMS 3 /* bfloat16 terms a query row is written as */

/* exp(x) for x <= 0, 16 lanes: attention.c's exp_nonpositive, vectorised. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* The fp32 values of bf16 lanes 0-15 (half 0) or 16-31 (half 1) of b. */
static inline __m512 hi_part(__m512bh b, int half) {
    const __m256i h = half ? _mm512_extracti64x4_epi64((__m512i)b, 1) : _mm512_castsi512_si256((__m512i)b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The keys and values attended, as consecutive runs of rows read in place: run i holds the next
 * runs[7i+6] keys, head h's key j at (uint16_t *)runs[7i] + h*runs[7i+2] + j*runs[7i+3], its value
 * at (uint16_t *)runs[7i+1] + h*runs[7i+4] + j*runs[7i+5]. A cursor walks them in key order. */
#define RUN_FIELDS 7
typedef struct {
    const int64_t *runs;
    int n, run, base; /* the run holding keys base.. */
} cursor;

/* Head h's key (which = 0) or value (1) row `key`, keys visited in increasing order; NULL past the
 * last run. */
static inline const uint16_t *row_at(cursor *c, int h, int key, int which) {
    while (c->run < c->n && key >= c->base + (int)c->runs[RUN_FIELDS * c->run + 6]) {
        c->base += (int)c->runs[RUN_FIELDS * c->run + 6];
        c->run++;
    }
    if (c->run >= c->n) return NULL;
    const int64_t *r = c->runs + RUN_FIELDS * c->run;
    return (const uint16_t *)(intptr_t)r[which] + h * r[2 + 2 * which] + (int64_t)(key - c->base) * r[3 + 2 * which];
}

/* r[i] = column i of the 16 x 16 matrix of 32-bit lanes whose row j was r[j]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { /* lanes (4L + k) of rows i, i+1 interleaved, per 128-bit lane L */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + k], lane L: column 4L + k of rows i..i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
        const __m512i c = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
        t[k] = _mm512_shuffle_i32x4(a, b, 0x88);
        t[k + 8] = _mm512_shuffle_i32x4(a, b, 0xdd);
        t[k + 4] = _mm512_shuffle_i32x4(c, d, 0x88);
        t[k + 12] = _mm512_shuffle_i32x4(c, d, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Chunk `chunk` of head h's K re-laid for the score products: per 16-key tile, per pair of head
 * dimensions, the 16 keys' pairs (one 32-bit lane each; keys past S are zeros). And the chunk's V
 * for the output products: per pair of keys (2i, 2i+1), for every head dimension d, the pair
 * (v[2i][d], v[2i+1][d]) in one 32-bit lane (keys past S are zeros). */
static void layout_chunk(const int64_t *runs, int n_runs, int h, int S, int D, int chunk, uint32_t *kt, uint32_t *vp) {
    const int pairs = D / 2;
    cursor c = {runs, n_runs, 0, 0};
    uint32_t *dst = kt + (int64_t)chunk * CHUNK * pairs;
    for (int tile = 0; tile < CHUNK / 16; tile++) {
        const uint32_t *rows[16];
        for (int j = 0; j < 16; j++) {
            const int key = chunk * CHUNK + tile * 16 + j;
            rows[j] = key < S ? (const uint32_t *)row_at(&c, h, key, 0) : NULL;
        }
        for (int p0 = 0; p0 < pairs; p0 += 16) { /* 16 keys x 16 pairs, transposed */
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = rows[j] ? _mm512_loadu_si512((const void *)(rows[j] + p0)) : _mm512_setzero_si512();
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512((void *)(dst + ((int64_t)tile * pairs + p0 + p) * 16), r[p]);
        }
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    c.run = c.base = 0;
    for (int i = 0; i < CHUNK / 2; i++) {
        const int key = chunk * CHUNK + 2 * i;
        const uint16_t *ra = key < S ? row_at(&c, h, key, 1) : NULL, *rb = key + 1 < S ? row_at(&c, h, key + 1, 1) : NULL;
        uint32_t *out = vp + ((int64_t)chunk * (CHUNK / 2) + i) * D;
        for (int d = 0; d < D; d += 32) {
            const __m512i a = ra ? _mm512_loadu_si512((const void *)(ra + d)) : _mm512_setzero_si512();
            const __m512i b = rb ? _mm512_loadu_si512((const void *)(rb + d)) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(out + d), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512((void *)(out + d + 16), _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* A query row x[0..D) as Q_TERMS bfloat16 terms (each the bfloat16 of what the ones before leave),
 * each as pairs of bf16: dst[term * D/2 + pair]. */
static void write_terms(const float *x, int D, uint32_t *dst) {
    const int pairs = D / 2;
    for (int d = 0; d < D; d += 32) {
        __m512 x0 = _mm512_loadu_ps(x + d), x1 = _mm512_loadu_ps(x + d + 16);
        for (int part = 0; part < Q_TERMS; part++) {
            const __m512bh b = _mm512_cvtne2ps_pbh(x1, x0);
            _mm512_storeu_si512((void *)(dst + part * pairs + d / 2), (__m512i)b);
            x0 = _mm512_sub_ps(x0, hi_part(b, 0));
            x1 = _mm512_sub_ps(x1, hi_part(b, 1));
        }
    }
}

/* One row's online-softmax step over a 64-key chunk: its raw scores sv (4 vectors of 16 keys),
 * scaled, with the keys outside [skip, valid) masked; its running max *m and sum *l updated;
 * *alpha, the factor its output so far is rescaled by; and the chunk's probabilities as two terms
 * of bf16 pairs (ph: the bf16 of each, plo: the bf16 of what that leaves), zeros where the row
 * has no key yet. */
static inline __attribute__((always_inline)) void softmax_chunk(__m512 *sv, int valid, int skip, __m512 vscale, float *m,
                                                                float *l, float *alpha, uint32_t *ph, uint32_t *plo) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < 4; t++) {
        sv[t] = _mm512_mul_ps(sv[t], vscale);
        if (valid < CHUNK || skip > 0) {
            const int n = valid - 16 * t, z = skip - 16 * t;
            const __mmask16 below = n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
            const __mmask16 above = z <= 0 ? 0xFFFF : z >= 16 ? 0 : (__mmask16)~((1u << z) - 1);
            sv[t] = _mm512_mask_blend_ps(below & above, _mm512_set1_ps(-INFINITY), sv[t]);
        }
        mx = _mm512_max_ps(mx, sv[t]);
    }
    const float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx));
    if (m_new == -INFINITY) { /* none of its keys yet (a window's row, in a chunk before them): nothing to add */
        *alpha = 1.0f;
        memset(ph, 0, sizeof(uint32_t) * (CHUNK / 2));
        memset(plo, 0, sizeof(uint32_t) * (CHUNK / 2));
        return;
    }
    *alpha = *m == -INFINITY ? 0.0f : expf(*m - m_new);
    *m = m_new;
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), pr[4];
    for (int t = 0; t < 4; t++) {
        pr[t] = exp512(_mm512_sub_ps(sv[t], mv));
        sum = _mm512_add_ps(sum, pr[t]);
    }
    *l = *l * *alpha + _mm512_reduce_add_ps(sum);
    const __m512bh b0 = _mm512_cvtne2ps_pbh(pr[1], pr[0]), b1 = _mm512_cvtne2ps_pbh(pr[3], pr[2]);
    _mm512_store_si512((void *)ph, (__m512i)b0);
    _mm512_store_si512((void *)(ph + 16), (__m512i)b1);
    _mm512_store_si512((void *)plo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(pr[1], hi_part(b0, 1)),
                                                                 _mm512_sub_ps(pr[0], hi_part(b0, 0))));
    _mm512_store_si512((void *)(plo + 16), (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(pr[3], hi_part(b1, 1)),
                                                                        _mm512_sub_ps(pr[2], hi_part(b1, 0))));
}

/* Rows [0, T) of o divided by their sums l, and their log-sum-exps. */
static void finish_rows(int T, int D, const float *m, const float *l, float *o, float *lse) {
    for (int r = 0; r < T; r++) {
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) o[(int64_t)r * D + d] *= inv;
        lse[r] = m[r] + logf(l[r]);
    }
}

/* T rows of one head over all chunks: the flash-attention loop. qb: each row's Q_TERMS terms, each
 * as pairs of bf16 ([rows][Q_TERMS][D/2]); o: the rows' fp32 outputs [rows][D] (accumulated, then
 * normalised); lse: their log-sum-exps. */
static inline __attribute__((always_inline)) void tile_rows(const int T, const uint32_t *qb, int D, const uint32_t *kt,
                                                            const uint32_t *vp, const int *from, const int *lim, float scale,
                                                            float *o, float *lse) {
    int most = 0, least = from[0];
    for (int r = 0; r < T; r++) {
        most = lim[r] > most ? lim[r] : most;
        least = from[r] < least ? from[r] : least;
    }
    const int pairs = D / 2, first = least / CHUNK, chunks = (most + CHUNK - 1) / CHUNK;
    float m[TILE], l[TILE];
    uint32_t pb[TILE][CHUNK / 2] __attribute__((aligned(64)));
    uint32_t pl[TILE][CHUNK / 2] __attribute__((aligned(64)));
    for (int r = 0; r < T; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + (int64_t)r * D, 0, sizeof(float) * D);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int c = first; c < chunks; c++) {
        /* scores of the T rows over the chunk's 64 keys: 4 vectors of 16 keys per row */
        __m512 s[TILE][4];
        for (int r = 0; r < T; r++)
            for (int t = 0; t < 4; t++) s[r][t] = _mm512_setzero_ps();
        const uint32_t *kc = kt + (int64_t)c * CHUNK * pairs;
        for (int p = 0; p < pairs; p++) {
            __m512bh kv[4];
            for (int t = 0; t < 4; t++) kv[t] = (__m512bh)_mm512_loadu_si512((const void *)(kc + ((int64_t)t * pairs + p) * 16));
            for (int r = 0; r < T; r++) {
                for (int part = 0; part < Q_TERMS; part++) {
                    const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[((int64_t)r * Q_TERMS + part) * pairs + p]);
                    for (int t = 0; t < 4; t++) s[r][t] = _mm512_dpbf16_ps(s[r][t], qv, kv[t]);
                }
            }
        }
        /* online softmax: the chunk's probabilities (keys past the row's last: 0) as two terms of
         * bf16 pairs, the rows' running max and sum, and the factor their outputs so far are
         * rescaled by */
        float alpha[TILE];
        for (int r = 0; r < T; r++) /* the row's keys: [from, lim) */
            softmax_chunk(s[r], lim[r] - c * CHUNK, from[r] - c * CHUNK, vscale, &m[r], &l[r], &alpha[r], pb[r], pl[r]);
        /* o = o * alpha + P V, 64 head dimensions at a time */
        const uint32_t *vc = vp + (int64_t)c * (CHUNK / 2) * D;
        for (int d0 = 0; d0 < D; d0 += 64) {
            __m512 acc[TILE][4];
            for (int r = 0; r < T; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * D + d0 + 16 * j), a);
            }
            for (int i = 0; i < CHUNK / 2; i++) {
                __m512bh vv[4];
                for (int j = 0; j < 4; j++) vv[j] = (__m512bh)_mm512_loadu_si512((const void *)(vc + (int64_t)i * D + d0 + 16 * j));
                for (int r = 0; r < T; r++) {
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pb[r][i]);
                    for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pv, vv[j]);
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)pl[r][i]);
                    for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pw, vv[j]);
                }
            }
            for (int r = 0; r < T; r++)
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(o + (int64_t)r * D + d0 + 16 * j, acc[r][j]);
        }
    }
    finish_rows(T, D, m, l, o, lse);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVP_AMX 1
#define AMX_ROWS 16

static int amx_wanted = 1;

static int amx_ready(void) { return amx_wanted && kvp_amx_granted(); }

/* tile_rows for up to 16 rows on AMX tiles. qp: the rows' Q terms as tile_rows's qb, 16 rows
 * (rows past T are any bits: a tile product's row r comes from its A tile's row r alone, and rows
 * past T are never read back); buffers: per thread. Scores: tiles 0-3 (the chunk's four 16-key tiles) += Q
 * term tile (4) x K tile (5-7), terms in order, 32 head dimensions at a time; outputs: tiles 0-3 (64
 * head dimensions) += P tile (4) x V tile (5-7), P's high terms then low, 32 keys at a time. */
static void amx_rows(const int T, const uint32_t *qp, int D, const uint32_t *kt, const uint32_t *vp, const int *from,
                     const int *lim, float scale, float *o, float *lse, float *sb, uint32_t *pb, uint32_t *pl,
                     float *ob) {
    int most = 0, least = from[0];
    for (int r = 0; r < T; r++) {
        most = lim[r] > most ? lim[r] : most;
        least = from[r] < least ? from[r] : least;
    }
    const int pairs = D / 2, first = least / CHUNK, chunks = (most + CHUNK - 1) / CHUNK, qstride = Q_TERMS * pairs * 4;
    float m[AMX_ROWS], l[AMX_ROWS], alpha[AMX_ROWS];
    for (int r = 0; r < T; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + (int64_t)r * D, 0, sizeof(float) * D);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int c = first; c < chunks; c++) {
        const uint32_t *kc = kt + (int64_t)c * CHUNK * pairs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int part = 0; part < Q_TERMS; part++)
            for (int p0 = 0; p0 < pairs; p0 += 16) {
                _tile_loadd(4, qp + part * pairs + p0, qstride); /* K tiles rotate over 5-7: a load need not wait */
                _tile_loadd(5, kc + ((int64_t)0 * pairs + p0) * 16, 64); /* for the product reading the last */
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, kc + ((int64_t)1 * pairs + p0) * 16, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, kc + ((int64_t)2 * pairs + p0) * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, kc + ((int64_t)3 * pairs + p0) * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        _tile_stored(0, sb, CHUNK * 4);
        _tile_stored(1, sb + 16, CHUNK * 4);
        _tile_stored(2, sb + 32, CHUNK * 4);
        _tile_stored(3, sb + 48, CHUNK * 4);
        for (int r = 0; r < T; r++) { /* tile_rows's online softmax, row by row */
            __m512 sv[4];
            for (int t = 0; t < 4; t++) sv[t] = _mm512_load_ps(sb + r * CHUNK + 16 * t);
            softmax_chunk(sv, lim[r] - c * CHUNK, from[r] - c * CHUNK, vscale, &m[r], &l[r], &alpha[r],
                          pb + r * (CHUNK / 2), pl + r * (CHUNK / 2));
        }
        const uint32_t *vc = vp + (int64_t)c * (CHUNK / 2) * D;
        for (int d0 = 0; d0 < D; d0 += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int term = 0; term < 2; term++)
                for (int k0 = 0; k0 < CHUNK / 2; k0 += 16) { /* 32 keys: 16 key pairs */
                    _tile_loadd(4, (term ? pl : pb) + k0, CHUNK / 2 * 4);
                    _tile_loadd(5, vc + (int64_t)k0 * D + d0, D * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, vc + (int64_t)k0 * D + d0 + 16, D * 4);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, vc + (int64_t)k0 * D + d0 + 32, D * 4);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, vc + (int64_t)k0 * D + d0 + 48, D * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
            _tile_stored(0, ob, 64 * 4);
            _tile_stored(1, ob + 16, 64 * 4);
            _tile_stored(2, ob + 32, 64 * 4);
            _tile_stored(3, ob + 48, 64 * 4);
            for (int r = 0; r < T; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                float *orow = o + (int64_t)r * D + d0;
                for (int j = 0; j < 4; j++)
                    _mm512_storeu_ps(orow + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * j), a,
                                                                      _mm512_load_ps(ob + r * 64 + 16 * j)));
            }
        }
    }
    finish_rows(T, D, m, l, o, lse);
}

/* T rows (their Q terms in qp; rows past T are not read: a tile's rows are independent) over the
 * blocks laid out in kt (their K) and vt (their V), row r seeing their keys [lo[r], hi[r]): each
 * row's state (amx_rows over the blocks' chunks: output normalised by their own sum, log-sum-exp)
 * to states[owner[r] * D] and lse[owner[r]]. sb: per-thread scratch of 16 x (2 * CHUNK + 64 + D +
 * 16) floats. */
static void tile_states(int T, uint32_t *qp, int D, const uint32_t *kt, const uint32_t *vt, const int *lo,
                        const int *hi, const int *owner, float scale, float *states, float *lse, float *sb) {
    uint32_t *pb = (uint32_t *)sb + AMX_ROWS * CHUNK;
    float *ob = sb + 2 * AMX_ROWS * CHUNK, *o = ob + AMX_ROWS * 64, *ls = o + AMX_ROWS * (size_t)D;
    amx_rows(T, qp, D, kt, vt, lo, hi, scale, o, ls, sb, pb, pb + AMX_ROWS * CHUNK / 2, ob);
    for (int r = 0; r < T; r++) {
        memcpy(states + (int64_t)owner[r] * D, o + (int64_t)r * D, sizeof(float) * (size_t)D);
        lse[owner[r]] = ls[r];
    }
}

/* The keys [*a, *b) of the block starting at token `start` that a decode query at q_pos, seeing keys
 * before q_end (and within `window` where > 0), reads: attention.c's visible_rows. */
static inline void block_keys(int64_t start, int64_t q_pos, int64_t q_end, int64_t window, int64_t *a, int64_t *b) {
    *a = 0;
    *b = (q_pos + 1 < q_end ? q_pos + 1 : q_end) - start;
    if (window > 0 && q_pos - window + 1 - start > *a) *a = q_pos - window + 1 - start;
    *b = *b > CHUNK ? CHUNK : *b;
}
#endif

/* Whether prefill takes AMX tiles where it can (1, the default) or the AVX512-BF16 dot products
 * (0); -1 changes nothing. Returns 1 if AMX runs from now on. */
int kvp_prefill_set_amx(int on) {
#if defined(KVP_AMX)
    if (on >= 0) amx_wanted = on != 0;
    return amx_ready();
#else
    (void)on;
    return 0;
#endif
}

/* out[h, r] = softmax(scale * q[h, r] . k[h, keys]) v[h, keys] for H heads of R fp32 query rows
 * (row r of head h at q + h*ldqh + r*ldq) over S bf16 keys and values in n_runs runs (see cursor):
 * with causal < 0 every key is visible to every row; with causal >= 0 row r sees keys
 * 0 .. causal + r / group (rows are token-major, `group` query heads per KV head, token r / group
 * at position causal + r / group), and with window > 0 only the last `window` of them. out: [H, R, D] fp32, lse: [H, R]. D a multiple of 64 up to
 * 512, S >= 1. Returns 0; -1 for a shape it does not take; -2 out of memory. */
int kvp_prefill_bf16(const float *q, int64_t ldqh, int64_t ldq, int H, int R, int group, int causal, int window,
                     const int64_t *runs, int n_runs, int D, float scale, float *out, float *lse) {
    int S = 0;
    for (int i = 0; i < n_runs; i++) S += (int)runs[RUN_FIELDS * i + 6];
    if (D % 64 != 0 || D > 512 || S < 1 || R < 1 || H < 1 || group < 1) return -1;
    if (causal >= 0 && causal + (R - 1) / group + 1 > S) return -1;
    const int chunks = (S + CHUNK - 1) / CHUNK, pairs = D / 2, tiles = (R + TILE - 1) / TILE;
    const size_t per_head = (size_t)chunks * CHUNK * pairs; /* 32-bit lanes, K's and V's alike */
    uint32_t *kt = aligned_alloc(64, sizeof(uint32_t) * 2 * per_head * (size_t)H);
    uint32_t *qb = malloc(sizeof(uint32_t) * Q_TERMS * (size_t)H * (size_t)R * (size_t)pairs);
    if (kt == NULL || qb == NULL) {
        free(kt);
        free(qb);
        return -2;
    }
    uint32_t *vp = kt + per_head * (size_t)H;
    int failed = 0;
#if defined(KVP_AMX)
    const int amx = amx_ready(), tiles16 = (R + AMX_ROWS - 1) / AMX_ROWS;
#endif
#pragma omp parallel
    {
#pragma omp for schedule(static) collapse(2) nowait
        for (int h = 0; h < H; h++)
            for (int c = 0; c < chunks; c++) layout_chunk(runs, n_runs, h, S, D, c, kt + per_head * h, vp + per_head * h);
#pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < H; h++)
            for (int r = 0; r < R; r++) {
                write_terms(q + h * ldqh + r * ldq, D, qb + ((int64_t)h * R + r) * Q_TERMS * pairs);
            }
#if defined(KVP_AMX)
        if (amx) {
            kvp_amx_configure();
            uint32_t *qp = aligned_alloc(64, sizeof(uint32_t) * AMX_ROWS * Q_TERMS * (size_t)pairs);
            float *sb = aligned_alloc(64, sizeof(float) * AMX_ROWS * (CHUNK + 64));
            uint32_t *pb = aligned_alloc(64, sizeof(uint32_t) * AMX_ROWS * CHUNK);
            if (qp == NULL || sb == NULL || pb == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < tiles16; t++) {
                    if (failed) continue;
                    const int r0 = t * AMX_ROWS, n = R - r0 < AMX_ROWS ? R - r0 : AMX_ROWS;
                    int from[AMX_ROWS], lim[AMX_ROWS];
                    for (int r = 0; r < n; r++) {
                        const int last = causal + (r0 + r) / group;
                        lim[r] = causal < 0 ? S : last + 1;
                        from[r] = causal < 0 || window <= 0 || last - window + 1 < 0 ? 0 : last - window + 1;
                    }
                    const size_t row_lanes = (size_t)Q_TERMS * pairs;
                    memcpy(qp, qb + ((int64_t)h * R + r0) * row_lanes, sizeof(uint32_t) * row_lanes * n);
                    amx_rows(n, qp, D, kt + per_head * h, vp + per_head * h, from, lim, scale,
                             out + ((int64_t)h * R + r0) * D, lse + (int64_t)h * R + r0, sb, pb,
                             pb + AMX_ROWS * CHUNK / 2, sb + AMX_ROWS * CHUNK);
                }
            free(qp);
            free(sb);
            free(pb);
            _tile_release();
        } else
#endif
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < tiles; t++) {
                const int r0 = t * TILE, n = R - r0 < TILE ? R - r0 : TILE;
                int from[TILE], lim[TILE];
                for (int r = 0; r < n; r++) {
                    const int last = causal + (r0 + r) / group; /* the row's own key */
                    lim[r] = causal < 0 ? S : last + 1;
                    from[r] = causal < 0 || window <= 0 || last - window + 1 < 0 ? 0 : last - window + 1;
                }
                const uint32_t *qt = qb + ((int64_t)h * R + r0) * Q_TERMS * pairs;
                const uint32_t *kh = kt + per_head * h, *vh = vp + per_head * h;
                float *o = out + ((int64_t)h * R + r0) * D, *ls = lse + (int64_t)h * R + r0;
                switch (n) {
                case 6: tile_rows(6, qt, D, kh, vh, from, lim, scale, o, ls); break;
                case 5: tile_rows(5, qt, D, kh, vh, from, lim, scale, o, ls); break;
                case 4: tile_rows(4, qt, D, kh, vh, from, lim, scale, o, ls); break;
                case 3: tile_rows(3, qt, D, kh, vh, from, lim, scale, o, ls); break;
                case 2: tile_rows(2, qt, D, kh, vh, from, lim, scale, o, ls); break;
                default: tile_rows(1, qt, D, kh, vh, from, lim, scale, o, ls); break;
                }
            }
    }
    free(kt);
    free(qb);
    return failed ? -2 : 0;
}

#if defined(KVP_AMX)
#define MAX_RUN 64 /* blocks one pass of kvp_decode_tiles may attend */

/* Whether every pair of item i sees all of its block (a run of such items may be attended as one). */
static int whole_item(int i, const int32_t *item_pos, const int32_t *item_off, const int32_t *pair_query,
                      const int64_t *q_pos, const int64_t *q_end, int64_t window) {
    for (int p = item_off[i]; p < item_off[i + 1]; p++) {
        int64_t a, b;
        block_keys((int64_t)item_pos[i] * BLOCK_TOKENS, q_pos[pair_query[p]], q_end[pair_query[p]], window, &a, &b);
        if (a != 0 || b != CHUNK) return 0;
    }
    return 1;
}
#endif

/* Decode states on AMX tiles: kvp_decode_states's contract (attention.c) for the items read by
 * min_pairs queries or more (the others are left alone), over bfloat16 blocks of a head dimension
 * that is a multiple of 64. An item is one block and the queries that read it (several sequences
 * of a batch sharing a forked document read it once for all of them): its K and V are laid out
 * once, then every pair's G rows of each KV head go through amx_rows 16 at a time. With max_run
 * 1 each item is one chunk, so that a row's state is the block's alone (output normalised by its
 * own sum, and its log-sum-exp); with max_run > 1, up to max_run consecutive items read whole by
 * the same queries are one pass of as many chunks (online softmax over them), its state on their
 * first item's pairs and the others' pairs' lse -inf (their outputs left unwritten), which the
 * merge skips: fewer states written and merged, Q laid out once per pass (per-block states are
 * what a selector observes: the caller asks for 1 then). Either way a row gets the same terms and
 * sums whatever rows share its tile, and other bits than attention.c's fp32 products of the same
 * pairs (bench/native_attention.py, the states and their merge, 16 queries over 16 blocks: 1.5x
 * those a block at a time, 2.4x in passes of 8; at two queries 0.8x, stop 41). Returns -1 where
 * it does not apply (no tiles, another shape), -2 out of memory. */
int kvp_decode_tiles(const float *q, const int64_t *k_addr, const int64_t *v_addr, int n_items,
                     const int32_t *item_ids, const int32_t *item_pos, const int32_t *item_off,
                     const int32_t *pair_query, const int64_t *q_pos, const int64_t *q_end, int Hq, int Hkv, int D,
                     int64_t window, float scale, float *states, float *lse, int min_pairs, int max_run) {
#if defined(KVP_AMX)
    if (!amx_ready() || D % 64 != 0 || D > 512 || Hkv <= 0 || Hq % Hkv != 0 || max_run < 1) return -1;
    max_run = max_run < MAX_RUN ? max_run : MAX_RUN;
    const int G = Hq / Hkv, pairs = D / 2, P = item_off[n_items];
    int Nq = 0;
    for (int p = 0; p < P; p++) Nq = pair_query[p] + 1 > Nq ? pair_query[p] + 1 : Nq;
    const size_t row_lanes = (size_t)Q_TERMS * pairs;
    uint32_t *qb = malloc(sizeof(uint32_t) * row_lanes * (size_t)Nq * (size_t)Hq + 64);
    int *first = malloc(sizeof(int) * ((size_t)n_items + 1)); /* passes: items first[r] .. first[r + 1] */
    if (qb == NULL || first == NULL) {
        free(qb);
        free(first);
        return -2;
    }
    int passes = 0;
    for (int i = 0; i < n_items; passes++) {
        const int count = item_off[i + 1] - item_off[i], head = i;
        const size_t bytes = sizeof(int32_t) * (size_t)count;
        first[passes] = i++;
        if (max_run == 1 || count < min_pairs) continue;
        if (!whole_item(head, item_pos, item_off, pair_query, q_pos, q_end, window)) continue;
        while (i < n_items && i - head < max_run && item_off[i + 1] - item_off[i] == count &&
               !memcmp(pair_query + item_off[i], pair_query + item_off[head], bytes) &&
               whole_item(i, item_pos, item_off, pair_query, q_pos, q_end, window))
            i++;
    }
    first[passes] = n_items;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < Nq * Hq; r++) write_terms(q + (int64_t)r * D, D, qb + (size_t)r * row_lanes);
        uint32_t *kt = aligned_alloc(64, sizeof(uint32_t) * 2 * CHUNK * (size_t)pairs * (size_t)max_run);
        uint32_t *qp = aligned_alloc(64, sizeof(uint32_t) * AMX_ROWS * row_lanes);
        float *sb = aligned_alloc(64, sizeof(float) * AMX_ROWS * (2 * CHUNK + 64 + (size_t)D + 16));
        uint32_t *vt = kt + CHUNK * (size_t)pairs * (size_t)max_run;
        if (kt == NULL || qp == NULL || sb == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            kvp_amx_configure();
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int r = 0; r < passes; r++)
            for (int h = 0; h < Hkv; h++) {
                const int i = first[r], n = first[r + 1] - first[r];
                if (failed || item_off[i + 1] - item_off[i] < min_pairs) continue;
                const int64_t start = (int64_t)item_pos[i] * BLOCK_TOKENS;
                int lo[AMX_ROWS], hi[AMX_ROWS], owner[AMX_ROWS], T = 0, S = 0;
                for (int p = item_off[i]; p < item_off[i + 1]; p++) { /* each pair's visible rows of the block */
                    int64_t a, b;
                    block_keys(start, q_pos[pair_query[p]], q_end[pair_query[p]], window, &a, &b);
                    if (b <= a) {
                        for (int g = 0; g < G; g++) {
                            memset(states + ((int64_t)p * Hq + h * G + g) * D, 0, sizeof(float) * (size_t)D);
                            lse[(int64_t)p * Hq + h * G + g] = -INFINITY;
                        }
                    }
                    S = b > S ? (int)b : S;
                }
                for (int j = 1; j < n; j++) /* a pass's later items: their pairs' states are in the first's */
                    for (int p = item_off[i + j]; p < item_off[i + j + 1]; p++)
                        for (int g = 0; g < G; g++) lse[(int64_t)p * Hq + h * G + g] = -INFINITY;
                if (S == 0) continue;
                int64_t run[RUN_FIELDS * MAX_RUN];
                for (int j = 0; j < n; j++) { /* the blocks' head rows in place, one run each (see cursor) */
                    const int64_t id = (int64_t)item_ids[i + j] * Hkv + h;
                    const int64_t fields[RUN_FIELDS] = {k_addr[id], v_addr[id], 0, D, 0, D, CHUNK};
                    memcpy(run + RUN_FIELDS * j, fields, sizeof fields);
                }
                const int keys = n > 1 ? n * CHUNK : S;
                for (int c = 0; c < n; c++) layout_chunk(run, n, 0, keys, D, c, kt, vt);
                for (int p = item_off[i]; p < item_off[i + 1]; p++) {
                    const int qi = pair_query[p];
                    int64_t a, b;
                    block_keys(start, q_pos[qi], q_end[qi], window, &a, &b);
                    if (b <= a) continue;
                    for (int g = 0; g < G; g++) {
                        memcpy(qp + (size_t)T * row_lanes, qb + ((size_t)qi * Hq + h * G + g) * row_lanes,
                               sizeof(uint32_t) * row_lanes);
                        lo[T] = (int)a;
                        hi[T] = n > 1 ? keys : (int)b;
                        owner[T++] = p * Hq + h * G + g;
                        if (T == AMX_ROWS) {
                            tile_states(T, qp, D, kt, vt, lo, hi, owner, scale, states, lse, sb);
                            T = 0;
                        }
                    }
                }
                if (T > 0) tile_states(T, qp, D, kt, vt, lo, hi, owner, scale, states, lse, sb);
            }
        if (kt != NULL && qp != NULL && sb != NULL) _tile_release();
        free(kt);
        free(qp);
        free(sb);
    }
    free(qb);
    free(first);
    return failed ? -2 : 0;
#else
    (void)q, (void)k_addr, (void)v_addr, (void)n_items, (void)item_ids, (void)item_pos, (void)item_off, (void)pair_query,
        (void)q_pos, (void)q_end, (void)Hq, (void)Hkv, (void)D, (void)window, (void)scale, (void)states, (void)lse,
        (void)min_pairs, (void)max_run;
    return -1;
#endif
}

#else
int kvp_prefill_set_amx(int on) {
    (void)on;
    return 0;
}

int kvp_prefill_bf16(const float *q, int64_t ldqh, int64_t ldq, int H, int R, int group, int causal, int window,
                     const int64_t *runs, int n_runs, int D, float scale, float *out, float *lse) {
    (void)q, (void)ldqh, (void)ldq, (void)H, (void)R, (void)group, (void)causal, (void)window, (void)runs, (void)n_runs, (void)D,
        (void)scale, (void)out, (void)lse;
    return -3; /* built without AVX512-BF16 */
}

int kvp_decode_tiles(const float *q, const int64_t *k_addr, const int64_t *v_addr, int n_items,
                     const int32_t *item_ids, const int32_t *item_pos, const int32_t *item_off,
                     const int32_t *pair_query, const int64_t *q_pos, const int64_t *q_end, int Hq, int Hkv, int D,
                     int64_t window, float scale, float *states, float *lse, int min_pairs, int max_run) {
    (void)q, (void)k_addr, (void)v_addr, (void)n_items, (void)item_ids, (void)item_pos, (void)item_off, (void)pair_query,
        (void)q_pos, (void)q_end, (void)Hq, (void)Hkv, (void)D, (void)window, (void)scale, (void)states, (void)lse,
        (void)min_pairs, (void)max_run;
    return -1; /* built without AVX512-BF16 */
}
#endif

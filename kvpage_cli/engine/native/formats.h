/* kvpage native CPU kernels over weights kept in a compact format, internal: what the files that
 * read the block formats share (formats.c decodes them, rows.c multiplies fp32 rows, int8.c int8
 * rows, tiles.c multiplies on AMX tiles). Small helpers are static inline here so that the hot
 * loops inline them; functions shared across files are hidden in the library (KVP_INTERNAL).
 *
 * A weight matrix is W[N, K] row-major (the layout GGUF files keep): row n is `row_bytes` bytes,
 * its K values in blocks along k. A value is dequantized exactly as the gguf package's reference
 * (gguf.quants) does it, the same float operations in the same order, so these kernels and the
 * weights dequantized once to fp32 describe the same model (tests/test_quant.py holds them equal
 * bit for bit).
 */
#ifndef KVPAGE_FORMATS_H
#define KVPAGE_FORMATS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "kvpage.h"
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* d * q + m as two roundings, as the reference computes it (GCC: off under -std=c11) */
#endif

#define KVP_INTERNAL __attribute__((visibility("hidden")))

/* Where the CPU runs AVX-512 with BW, DQ, FMA and F16C: one row of W read straight from its blocks
 * (rows.c's direct_dot, int8.c's direct_q8_dot) and the AMX tiles' decoding (tiles.c). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__FMA__) && defined(__F16C__)
#define KVP_DIRECT_512 1
#endif

#if defined(__AVX2__)
static inline float hsum8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

static inline float half_value(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as the portable conversion below */
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        const float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K and Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K: the sixteen 6-bit scales from the 12 packed bytes, unsigned (the scale is the byte less
 * 32), four a word: scale j's low nibble is byte j's (j < 8: low, else high nibble of byte j - 8),
 * its two high bits bits 2 (j / 4), + 1 of byte 8 + j % 4. */
static inline void scales_k3(const uint8_t *q, uint32_t out[4]) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    out[0] = (a & 0x0f0f0f0fu) | ((c & 0x03030303u) << 4);
    out[1] = (b & 0x0f0f0f0fu) | (((c >> 2) & 0x03030303u) << 4);
    out[2] = ((a >> 4) & 0x0f0f0f0fu) | (((c >> 4) & 0x03030303u) << 4);
    out[3] = ((b >> 4) & 0x0f0f0f0fu) | (((c >> 6) & 0x03030303u) << 4);
}

/* Q2_K, Q3_K: a superblock's 256 unsigned values in value order. Value 128 h + 32 k + l is bits 2k,
 * 2k + 1 of qs[32 h + l]; Q3_K's third bit is bit 4 h + k of hmask[l] (its values then less 4). */
static inline void values_k2(int type, const uint8_t *p, uint8_t *u) {
    const int three = type == T_Q3_K;
    const uint8_t *qs = p + (three ? 32 : 16);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * k + l] = (uint8_t)(((qs[32 * h + l] >> (2 * k)) & 3) |
                                                    (three ? ((p[l] >> (4 * h + k)) & 1) << 2 : 0));
}

/* A quantized row is decoded into its integer values (as floats, exact) and one scale and one
 * offset per block of BS values: value j = d[b] * q[j] + m[b], b = j / BS, the float operations
 * of the reference (the offset is 0 for formats without one: d[b] * q[j] alone). */
static inline int is_kquant(int type) {
    return type == T_Q2_K || type == T_Q3_K || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}
static inline int block_of(int type) { return type == T_Q2_K || type == T_Q3_K || type == T_Q6_K ? 16 : 32; }
static inline int has_offset(int type) {
    return type == T_Q4_1 || type == T_Q5_1 || type == T_Q2_K || type == T_Q4_K || type == T_Q5_K;
}
static inline int is_float(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

/* Whether W's rows of K values in `type` are something these kernels read. */
static inline int check(int type, int K) {
    int values, bytes;
    if (type == T_I8_ROW) return K % 32 == 0;
    return kvp_quant_block(type, &values, &bytes) && K % values == 0 && (is_float(type) || K % block_of(type) == 0);
}

/* Formats whose rows rows.c and int8.c read straight from their blocks (blocks of 32 values). */
#define DIRECT_MAX_BLOCKS 512 /* K up to 16,384 */
/* A decode step's one-row products (direct_dot, direct_q8_dot) fetch the bytes of the weight row this
 * many rows on into L2 as they read a row: 2-vCPU Intel Xeon VM, the 1B-shaped Q8_0 file, 15.2-17.4 tok/s
 * against 11.8-12.4 without (2, 4 and 8 rows alike); SmolLM2's Q4_1 80-84 against 71-74. */
#define PREFETCH_ROWS 4
static inline int direct_format(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }
static inline int block_size(int type) { return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34; }

/* sum_b m[b] xs[b], in one fixed order. */
static inline float offset_sum(const float *m, const float *xs, int nb) {
    float extra = 0.0f;
    int b0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 e = _mm256_setzero_ps();
    for (; b0 + 8 <= nb; b0 += 8) e = _mm256_fmadd_ps(_mm256_loadu_ps(m + b0), _mm256_loadu_ps(xs + b0), e);
    extra = hsum8(e);
#endif
    for (int b = b0; b < nb; b++) extra = __builtin_fmaf(m[b], xs[b], extra);
    return extra;
}

/* formats.c */
KVP_INTERNAL void decode_i8(int type, const uint8_t *restrict p, int K, int8_t *restrict w, float *restrict d,
                            float *restrict m);
KVP_INTERNAL void decode_row(int type, const uint8_t *p, int K, float *q, float *d, float *m, int8_t *w);
KVP_INTERNAL void float_row(int type, const uint8_t *p, int K, float *out);
/* rows.c */
KVP_INTERNAL float *block_sums(const float *x, int64_t ldx, int M, int K, int bs);
/* kquants.c: kvp_qgemm_rows_q8 for the K-quants (Q2_K ... Q6_K) */
KVP_INTERNAL int kquant_q8(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K,
                           int N, float *y, int64_t ldy);
#endif

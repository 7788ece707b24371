/* kvpage native CPU kernels over weights kept in a compact format: the GGUF block formats
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32) and kvpage's own int8 rows.
 *
 * A weight matrix is W[N, K] row-major (the layout GGUF files keep): row n is `row_bytes` bytes,
 * its K values in blocks along k. A value is dequantized exactly as the gguf package's reference
 * (gguf.quants) does it, the same float operations in the same order, so these kernels and the
 * weights dequantized once to fp32 describe the same model (tests/test_quant.py holds them equal
 * bit for bit).
 *
 * y[M, N] = x[M, K] @ W^T: each thread decodes one row of W at a time into a buffer (its integer
 * values, and a scale and an offset per block) and takes its dot product with every row of x,
 * scaling block by block (block_dot; float rows: a plain dot). An output element is one fixed reduction over k, the same
 * whatever the number of rows, the thread count or which thread computes it: a batch gives each
 * sequence the bits it gets alone.
 *
 * kvp_qgemm_rows_q8 is the llama.cpp way, faster and not those bits: x rounded to int8 in groups
 * of 32 and integer dot products with the row's integers (VNNI where the CPU has it, else AVX2's
 * maddubs, else plain C), scaled per block.
 */
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
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* d * q + m as two roundings, as the reference computes it (GCC: off under -std=c11) */
#endif

#if defined(__AVX2__)
static inline float hsum8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
    T_I8_ROW = 1000, /* kvpage int8: a row is one fp32 scale, then K int8 values */
};

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

/* Values per block and bytes per block of a format; 0 for an unknown format. */
int kvp_quant_block(int type, int *values, int *bytes) {
    switch (type) {
        case T_F32: *values = 1; *bytes = 4; return 1;
        case T_F16: case T_BF16: *values = 1; *bytes = 2; return 1;
        case T_Q4_0: *values = 32; *bytes = 18; return 1;
        case T_Q4_1: *values = 32; *bytes = 20; return 1;
        case T_Q5_0: *values = 32; *bytes = 22; return 1;
        case T_Q5_1: *values = 32; *bytes = 24; return 1;
        case T_Q8_0: *values = 32; *bytes = 34; return 1;
        case T_Q4_K: *values = 256; *bytes = 144; return 1;
        case T_Q5_K: *values = 256; *bytes = 176; return 1;
        case T_Q6_K: *values = 256; *bytes = 210; return 1;
        default: return 0;
    }
}


/* A quantized row is decoded into its integer values (as floats, exact) and one scale and one
 * offset per block of BS values: value j = d[b] * q[j] + m[b], b = j / BS, the float operations
 * of the reference (the offset is 0 for formats without one: d[b] * q[j] alone). */
static inline int block_of(int type) { return type == T_Q6_K ? 16 : 32; }
static inline int has_offset(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }
static inline int is_float(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

/* A quantized row as signed 8-bit integers w[K] with, per block of BS values (block_of), a scale d
 * and an offset m: value j = d[b] * w[j] + m[b] (m only for formats with an offset): the integers
 * decode_row gives as floats. For the integer dot products of kvp_qgemm_rows_q8. */
static void decode_i8(int type, const uint8_t *restrict p, int K, int8_t *restrict w, float *restrict d,
                      float *restrict m) {
    switch (type) {
        case T_I8_ROW: {
            float scale;
            memcpy(&scale, p, sizeof scale);
            memcpy(w, p + 4, (size_t)K);
            for (int b = 0; b < K / 32; b++) d[b] = scale;
            return;
        }
        case T_Q8_0:
            for (int b = 0; b < K / 32; b++, p += 34, w += 32) {
                d[b] = half_value(p);
                memcpy(w, p + 2, 32);
            }
            return;
        case T_Q4_0:
        case T_Q4_1: {
            const int offset = type == T_Q4_1, size = offset ? 20 : 18, bias = offset ? 0 : 8;
            for (int b = 0; b < K / 32; b++, p += size, w += 32) {
                d[b] = half_value(p);
                if (offset) m[b] = half_value(p + 2);
                const uint8_t *v = p + 2 + 2 * offset;
#if defined(__AVX2__)
                const __m128i bytes = _mm_loadu_si128((const __m128i *)v), mask = _mm_set1_epi8(0x0F), b8 = _mm_set1_epi8((char)bias);
                _mm_storeu_si128((__m128i *)w, _mm_sub_epi8(_mm_and_si128(bytes, mask), b8));
                _mm_storeu_si128((__m128i *)(w + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), b8));
#else
                for (int j = 0; j < 16; j++) {
                    w[j] = (int8_t)((v[j] & 0xF) - bias);
                    w[j + 16] = (int8_t)((v[j] >> 4) - bias);
                }
#endif
            }
            return;
        }
        case T_Q5_0:
        case T_Q5_1: {
            const int offset = type == T_Q5_1, size = offset ? 24 : 22, bias = offset ? 0 : 16;
            for (int b = 0; b < K / 32; b++, p += size, w += 32) {
                d[b] = half_value(p);
                if (offset) m[b] = half_value(p + 2);
                uint32_t qh;
                memcpy(&qh, p + 2 + 2 * offset, sizeof qh);
                const uint8_t *v = p + 6 + 2 * offset;
                for (int j = 0; j < 16; j++) {
                    w[j] = (int8_t)(((v[j] & 0xF) | (((qh >> j) & 1) << 4)) - bias);
                    w[j + 16] = (int8_t)(((v[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
                }
            }
            return;
        }
        case T_Q4_K:
        case T_Q5_K: {
            const int five = type == T_Q5_K;
            for (int b = 0; b < K / 256; b++, p += five ? 176 : 144, w += 256, d += 8, m += 8) {
                const float dd = half_value(p), dmin = half_value(p + 2);
                const uint8_t *scales = p + 4, *qh = p + 16, *qs = p + (five ? 48 : 16);
                for (int s = 0; s < 4; s++) { /* 64 values: sub-blocks 2s (low nibbles), 2s+1 (high) */
                    uint8_t sc, mn;
                    scale_min_k4(2 * s, scales, &sc, &mn);
                    d[2 * s] = dd * (float)sc;
                    m[2 * s] = -(dmin * (float)mn);
                    scale_min_k4(2 * s + 1, scales, &sc, &mn);
                    d[2 * s + 1] = dd * (float)sc;
                    m[2 * s + 1] = -(dmin * (float)mn);
                    const uint8_t *v = qs + 32 * s;
                    int8_t *o = w + 64 * s;
#if defined(__AVX2__)
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)v), mask = _mm256_set1_epi8(0x0F);
                    __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                    if (five) {
                        const __m256i h = _mm256_loadu_si256((const __m256i *)qh), one = _mm256_set1_epi8(1);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * s), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * s + 1), one), 4));
                    }
                    _mm256_storeu_si256((__m256i *)o, lo);
                    _mm256_storeu_si256((__m256i *)(o + 32), hi);
                    continue;
#endif
                    for (int l = 0; l < 32; l++) {
                        const int hi5 = five ? ((qh[l] >> (2 * s)) & 1) << 4 : 0, hi5b = five ? ((qh[l] >> (2 * s + 1)) & 1) << 4 : 0;
                        o[l] = (int8_t)((v[l] & 0xF) | hi5);
                        o[l + 32] = (int8_t)((v[l] >> 4) | hi5b);
                    }
                }
            }
            return;
        }
        case T_Q6_K:
            for (int b = 0; b < K / 256; b++, p += 210, w += 256, d += 16) {
                const uint8_t *ql = p, *qh = p + 128;
                const int8_t *sc = (const int8_t *)(p + 192);
                const float dd = half_value(p + 208);
                for (int h = 0; h < 2; h++) { /* 128 values per half; sub-blocks of 16 in value order */
                    const uint8_t *l0 = ql + 64 * h, *h0 = qh + 32 * h;
                    int8_t *o = w + 128 * h;
                    for (int g = 0; g < 8; g++) d[8 * h + g] = dd * (float)sc[8 * h + g];
#if defined(__AVX2__)
                    const __m256i a = _mm256_loadu_si256((const __m256i *)l0), b = _mm256_loadu_si256((const __m256i *)(l0 + 32));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)h0);
                    const __m256i f = _mm256_set1_epi8(0x0F), b32 = _mm256_set1_epi8(32);
                    const __m256i a_hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), f), b_hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), f);
                    /* (hb >> 2k) & 3, then << 4: (hb << (4 - 2k)) & 0x30 for k = 0, 1, and (hb >> (2k - 4)) & 0x30 for k = 2, 3 */
                    const __m256i top = _mm256_set1_epi8(0x30);
                    const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(hb, 4), top), h2 = _mm256_and_si256(_mm256_slli_epi16(hb, 2), top);
                    const __m256i h3 = _mm256_and_si256(hb, top), h4 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), top);
                    _mm256_storeu_si256((__m256i *)o, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, f), h1), b32));
                    _mm256_storeu_si256((__m256i *)(o + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(b, f), h2), b32));
                    _mm256_storeu_si256((__m256i *)(o + 64), _mm256_sub_epi8(_mm256_or_si256(a_hi, h3), b32));
                    _mm256_storeu_si256((__m256i *)(o + 96), _mm256_sub_epi8(_mm256_or_si256(b_hi, h4), b32));
                    continue;
#endif
                    for (int l = 0; l < 32; l++) {
                        o[l] = (int8_t)(((l0[l] & 0xF) | ((h0[l] & 3) << 4)) - 32);
                        o[l + 32] = (int8_t)(((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4)) - 32);
                        o[l + 64] = (int8_t)(((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32);
                        o[l + 96] = (int8_t)(((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32);
                    }
                }
            }
            return;
        default:
            return;
    }
}

/* A quantized row as its integer values, exact as floats (q[K]), with decode_i8's scales and
 * offsets; w: K bytes of scratch. */
static void decode_row(int type, const uint8_t *p, int K, float *q, float *d, float *m, int8_t *w) {
    decode_i8(type, p, K, w, d, m);
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= K; i += 16)
        _mm512_storeu_ps(q + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i)))));
#elif defined(__AVX2__)
    for (; i + 8 <= K; i += 8)
        _mm256_storeu_ps(q + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i)))));
#endif
    for (; i < K; i++) q[i] = (float)w[i];
}

/* A float row (F32, F16, BF16) into out. */
static void float_row(int type, const uint8_t *p, int K, float *out) {
    int i = 0;
    if (type == T_F32) {
        memcpy(out, p, sizeof(float) * (size_t)K);
    } else if (type == T_F16) {
#if defined(__F16C__)
        for (; i + 8 <= K; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
        for (; i < K; i++) out[i] = half_value(p + 2 * i);
    } else {
#if defined(__AVX2__)
        for (; i + 8 <= K; i += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
#endif
        for (; i < K; i++) {
            const uint32_t bits = (uint32_t)(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
            memcpy(out + i, &bits, sizeof(float));
        }
    }
}

/* One row of K values into out (fp32): the reference's values, bit for bit. w: K bytes of scratch. */
static void dequant_row(int type, const uint8_t *p, int K, float *out, float *d, float *m, int8_t *w) {
    if (is_float(type)) {
        float_row(type, p, K, out);
        return;
    }
    decode_row(type, p, K, out, d, m, w);
    const int bs = block_of(type), offset = has_offset(type);
    for (int b = 0; b < K / bs; b++) {
        float *o = out + b * bs;
        const float db = d[b], mb = offset ? m[b] : 0.0f;
        if (offset) {
            for (int j = 0; j < bs; j++) o[j] = db * o[j] + mb;
        } else {
            for (int j = 0; j < bs; j++) o[j] = db * o[j];
        }
    }
}

/* The dot product of two fp32 vectors of length K: one fixed order of operations for a given K. */
static inline float dot(const float *a, const float *b, int K) {
    int k = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
    }
    total = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#endif
    for (; k < K; k++) total = __builtin_fmaf(a[k], b[k], total);
    return total;
}

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

/* sum_j x[j] * (d[b] q[j] + m[b]) = sum_b d[b] (sum_{j in b} x[j] q[j]) + sum_b m[b] xs[b], where
 * xs[b] is the sum of x over block b (computed once per row of x). One fixed order for a given K. */
static inline float block_dot(const float *x, const float *xs, const float *q, const float *d, const float *m,
                              int offset, int bs, int K) {
    const int nb = K / bs;
    const float extra = offset ? offset_sum(m, xs, nb) : 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    if (bs == 32) {
        for (int b = 0; b < nb; b++, x += 32, q += 32) {
            __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(q));
            __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(q + 8));
            t0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(q + 16), t0);
            t1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_loadu_ps(q + 24), t1);
            const __m256 db = _mm256_set1_ps(d[b]);
            acc0 = _mm256_fmadd_ps(db, t0, acc0);
            acc1 = _mm256_fmadd_ps(db, t1, acc1);
        }
    } else { /* 16 */
        for (int b = 0; b < nb; b++, x += 16, q += 16) {
            const __m256 db = _mm256_set1_ps(d[b]);
            acc0 = _mm256_fmadd_ps(db, _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(q)), acc0);
            acc1 = _mm256_fmadd_ps(db, _mm256_mul_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(q + 8)), acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + extra;
#else
    float total = 0.0f;
    for (int b = 0; b < nb; b++, x += bs, q += bs) {
        float t = 0.0f;
        for (int j = 0; j < bs; j++) t = __builtin_fmaf(x[j], q[j], t);
        total = __builtin_fmaf(d[b], t, total);
    }
    return total + extra;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* block_dot of one row of x with four decoded rows of W (x read once for the four): each output's
 * float operations are block_dot's, in its order, so the bits are block_dot's. */
static inline __attribute__((always_inline)) void block_dot4(const float *x, int64_t ldx, const float *xs, int nxs,
        int rows, float *const *q, float *const *d, float *const *m, int offset, int bs, int K, float *out) {
    /* rows (1 or 2) rows of x at once, too, where the registers allow (AVX-512's 32) */
    const int nb = K / bs;
    __m256 a0[2][4], a1[2][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) a0[r][j] = a1[r][j] = _mm256_setzero_ps();
    if (bs == 32) {
        for (int b = 0; b < nb; b++) {
            __m256 x0[2], x1[2], x2[2], x3[2];
            for (int r = 0; r < rows; r++) {
                const float *xb = x + r * ldx + 32 * b;
                x0[r] = _mm256_loadu_ps(xb), x1[r] = _mm256_loadu_ps(xb + 8);
                x2[r] = _mm256_loadu_ps(xb + 16), x3[r] = _mm256_loadu_ps(xb + 24);
            }
            for (int j = 0; j < 4; j++) {
                const float *qb = q[j] + 32 * b;
                const __m256 q0 = _mm256_loadu_ps(qb), q1 = _mm256_loadu_ps(qb + 8);
                const __m256 q2 = _mm256_loadu_ps(qb + 16), q3 = _mm256_loadu_ps(qb + 24);
                const __m256 db = _mm256_set1_ps(d[j][b]);
                for (int r = 0; r < rows; r++) {
                    __m256 t0 = _mm256_mul_ps(x0[r], q0);
                    __m256 t1 = _mm256_mul_ps(x1[r], q1);
                    t0 = _mm256_fmadd_ps(x2[r], q2, t0);
                    t1 = _mm256_fmadd_ps(x3[r], q3, t1);
                    a0[r][j] = _mm256_fmadd_ps(db, t0, a0[r][j]);
                    a1[r][j] = _mm256_fmadd_ps(db, t1, a1[r][j]);
                }
            }
        }
    } else { /* 16 */
        for (int b = 0; b < nb; b++) {
            __m256 x0[2], x1[2];
            for (int r = 0; r < rows; r++) {
                x0[r] = _mm256_loadu_ps(x + r * ldx + 16 * b);
                x1[r] = _mm256_loadu_ps(x + r * ldx + 16 * b + 8);
            }
            for (int j = 0; j < 4; j++) {
                const float *qb = q[j] + 16 * b;
                const __m256 q0 = _mm256_loadu_ps(qb), q1 = _mm256_loadu_ps(qb + 8);
                const __m256 db = _mm256_set1_ps(d[j][b]);
                for (int r = 0; r < rows; r++) {
                    a0[r][j] = _mm256_fmadd_ps(db, _mm256_mul_ps(x0[r], q0), a0[r][j]);
                    a1[r][j] = _mm256_fmadd_ps(db, _mm256_mul_ps(x1[r], q1), a1[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++)
            out[4 * r + j] = hsum8(_mm256_add_ps(a0[r][j], a1[r][j])) + (offset ? offset_sum(m[j], xs + r * nxs, nb) : 0.0f);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
/* block_dot4 for up to four rows of x in 512-bit registers: lanes 0-7 of an accumulator are
 * block_dot's acc0, lanes 8-15 its acc1, and every lane sees block_dot's operations in its order
 * (as direct_dot_t), so the bits are block_dot's; half the instructions of the 256-bit code, and
 * each decoded row of W is read once for four rows of x. rows and bs are constants at each call. */
static inline __attribute__((always_inline)) void block_dot4_512(const float *x, int64_t ldx, const float *xs, int nxs,
        const int rows, float *const *q, float *const *d, float *const *m, int offset, const int bs, int K, float *out) {
    const int nb = K / bs;
    __m512 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 lo[4], hi[4];
        for (int r = 0; r < rows; r++) {
            lo[r] = _mm512_loadu_ps(x + r * ldx + bs * b);
            if (bs == 32) hi[r] = _mm512_loadu_ps(x + r * ldx + 32 * b + 16);
        }
        for (int j = 0; j < 4; j++) {
            const __m512 qlo = _mm512_loadu_ps(q[j] + bs * b), db = _mm512_set1_ps(d[j][b]);
            const __m512 qhi = bs == 32 ? _mm512_loadu_ps(q[j] + 32 * b + 16) : qlo;
            for (int r = 0; r < rows; r++) {
                __m512 t = _mm512_mul_ps(lo[r], qlo);
                if (bs == 32) t = _mm512_fmadd_ps(hi[r], qhi, t);
                acc[r][j] = _mm512_fmadd_ps(db, t, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) {
            const __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(acc[r][j]), _mm512_extractf32x8_ps(acc[r][j], 1));
            out[4 * r + j] = hsum8(sum) + (offset ? offset_sum(m[j], xs + r * nxs, nb) : 0.0f);
        }
}

/* block_dot4_512 with rows and bs as constants. */
static void block_dot4_rows(const float *x, int64_t ldx, const float *xs, int nxs, int rows, float *const *q,
                            float *const *d, float *const *m, int offset, int bs, int K, float *out) {
#define KVP_DOT4(R, BS) block_dot4_512(x, ldx, xs, nxs, R, q, d, m, offset, BS, K, out)
    if (bs == 32) {
        if (rows == 4) KVP_DOT4(4, 32); else if (rows == 3) KVP_DOT4(3, 32); else if (rows == 2) KVP_DOT4(2, 32); else KVP_DOT4(1, 32);
    } else {
        if (rows == 4) KVP_DOT4(4, 16); else if (rows == 3) KVP_DOT4(3, 16); else if (rows == 2) KVP_DOT4(2, 16); else KVP_DOT4(1, 16);
    }
#undef KVP_DOT4
}
#define HAVE_DOT4_512 1
#endif

/* One row of W read straight from its blocks, for one row of activations (decode steps): formats
 * with blocks of 32 values (Q4_0, Q4_1, Q8_0). Each keeps, operation for operation, the float
 * arithmetic of block_dot / q8_dot (so the bits a row gets do not depend on the path, the rows
 * beside it or the CPU's vector width), without decoding the row into scratch first: a 512-bit
 * register holds what the 256-bit code keeps in two (lanes 0-7: its acc0, 8-15: its acc1). */
#define DIRECT_MAX_BLOCKS 512 /* K up to 16,384 */
static inline int direct_format(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__FMA__) && defined(__F16C__)
static inline int block_size(int type) { return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34; }

/* Block b's 32 values as fp32 (the integers decode_i8 gives): values 0-15 and 16-31. */
static inline __attribute__((always_inline)) void block_values(int type, const uint8_t *p, __m512 *lo, __m512 *hi) {
    if (type == T_Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
        return;
    }
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (type == T_Q4_1 ? 4 : 2))));
    const __m512i bias = _mm512_set1_epi32(type == T_Q4_0 ? 8 : 0);
    *lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)), bias));
    *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), bias));
}

/* block_dot(x, row) for one row of W (p: its bytes). */
static inline __attribute__((always_inline)) float direct_dot_t(const int type, const uint8_t *p, const float *x,
                                                                const float *xs, int K) {
    const int nb = K / 32, size = block_size(type), offset = type == T_Q4_1;
    float m[DIRECT_MAX_BLOCKS];
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, p += size, x += 32) {
        __m512 lo, hi;
        block_values(type, p, &lo, &hi);
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x), lo);
        t = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), hi, t);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(half_value(p)), t, acc);
        if (offset) m[b] = half_value(p + 2);
    }
    const __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    return hsum8(sum) + (offset ? offset_sum(m, xs, nb) : 0.0f);
}

static float direct_dot(int type, const uint8_t *p, const float *x, const float *xs, int K) {
    return type == T_Q4_0 ? direct_dot_t(T_Q4_0, p, x, xs, K)
         : type == T_Q4_1 ? direct_dot_t(T_Q4_1, p, x, xs, K) : direct_dot_t(T_Q8_0, p, x, xs, K);
}
#define HAVE_DIRECT_DOT 1
#endif


/* A few rows on AMX tiles: formats with blocks of 32 values (Q4_0, Q4_1, Q8_0), whose integers
 * are exact in bfloat16. Each row of x is written as the sum of three bfloat16 terms (each the
 * bfloat16 of what the ones before leave, together within 2^-27 of it, as prefill.c writes Q), so
 * every tile product is exact, and accumulates in fp32: per block, the 16 x 16 products of 16
 * rows of W with 16 rows of x (three terms, summed on the tile), then scaled by the block's d
 * into fp32 accumulators (and the offsets' sum_b m[b] xs[b] first, as block_dot adds it). Each
 * row's result depends only on that row, but sums in another order than block_dot: other bits
 * than the rows' path, within the same tolerance (tests/test_quant.py). kvp_qgemm_tiles calls it.
 * Measured on a 2-core Sapphire Rapids VM (bench/decode_gemm.py): a decode step's products 1.6x
 * the rows' path's at 16 rows, 2.0x at 64; per matrix 1.2-1.6x at 8 rows (a throwaway script).
 * Not measured below 8 with this kernel: stop 40's prototype was even at 4 rows, slower at 1. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(HAVE_DIRECT_DOT)
#define KVP_TILES 1
#ifndef TILE_MIN_ROWS
#error "TILE_MIN_ROWS is defined by the build (kvpage_cli/engine/native.py)"
#endif
#define TILE_GROUP 48     /* rows of W decoded at a time: three tiles of 16 */
#define TILE_ROW_CHUNK 128 /* rows of x per pass over W (their terms stay in L2) */
int kvp_amx_granted(void); /* amx.c */
void kvp_amx_configure(void);
static int tiles_wanted = 1;

/* Rows r0.. (up to 16) of x over block b: three terms in B-tile order (16 pairs of values x 16 rows,
 * one 32-bit lane per pair), term p at out + 256 * p lanes; rows past M are zeros. */
static void split_rows(const float *x, int64_t ldx, int M, int r0, int b, uint32_t *out) {
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int r = 0; r < 16; r++) {
        const int row = r0 + r;
        __m512 v0 = row < M ? _mm512_loadu_ps(x + (int64_t)row * ldx + 32 * b) : _mm512_setzero_ps();
        __m512 v1 = row < M ? _mm512_loadu_ps(x + (int64_t)row * ldx + 32 * b + 16) : _mm512_setzero_ps();
        for (int p = 0; p < 3; p++) {
            const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
            _mm512_i32scatter_epi32(out + 256 * p + r, lanes, h, 4);
            v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
            v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
        }
    }
}

/* Row n of W (its bytes p) as bfloat16 integers a[0..K), its scales d[b * 16] and offsets
 * m[b * 16] (stride 16: a tile's outputs side by side). */
static inline void tile_decode_row(int type, const uint8_t *p, int nb, __m512i table, uint16_t *a, float *d, float *m) {
    const int size = block_size(type);
    for (int b = 0; b < nb; b++, p += size) {
        d[b * 16] = half_value(p);
        if (type == T_Q8_0) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
            _mm512_storeu_si512((void *)(a + 32 * b), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            continue;
        }
        const __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + (type == T_Q4_1 ? 4 : 2))));
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w16, _mm256_set1_epi16(15))),
                                               _mm256_srli_epi16(w16, 4), 1);
        _mm512_storeu_si512((void *)(a + 32 * b), _mm512_permutexvar_epi16(idx, table));
        if (type == T_Q4_1) m[b * 16] = half_value(p + 2);
    }
}

/* Per-thread scratch, kept between calls (OpenMP's threads persist). */
static _Thread_local void *tile_scratch;
static _Thread_local size_t tile_scratch_bytes;

static void *scratch_of(size_t bytes) {
    if (bytes > tile_scratch_bytes) {
        free(tile_scratch);
        tile_scratch = aligned_alloc(64, bytes);
        tile_scratch_bytes = tile_scratch ? bytes : 0;
    }
    return tile_scratch;
}

/* kvp_qgemm_rows's y = x @ W^T on tiles; -1 where they do not apply (another format, no tile
 * state), -2 out of memory. xs: the rows' block sums (Q4_1), [M, nb]. */
static int qgemm_tiles(int type, const float *x, int64_t ldx, const float *xs, const uint8_t *w, int64_t row_bytes,
                       int M, int K, int N, float *y, int64_t ldy) {
    if (!tiles_wanted || !direct_format(type) || K % 32 != 0 || !kvp_amx_granted()) return -1;
    const int nb = K / 32, offset = type == T_Q4_1, groups = (N + TILE_GROUP - 1) / TILE_GROUP;
    const int chunk_tiles = ((M < TILE_ROW_CHUNK ? M : TILE_ROW_CHUNK) + 15) / 16; /* a pass's tiles of x, at most */
    uint32_t *xb = aligned_alloc(64, (size_t)chunk_tiles * nb * 3 * 1024);
    float *xsT = aligned_alloc(64, sizeof(float) * 16 * (size_t)chunk_tiles * nb); /* [tile][b][row] */
    if (xb == NULL || xsT == NULL) {
        free(xb);
        free(xsT);
        return -2;
    }
    uint16_t tv[32]; /* a 4-bit value's bfloat16 (Q4_0: minus 8) */
    for (int i = 0; i < 32; i++) {
        const float f = (float)(i < 16 ? i - (type == T_Q4_0 ? 8 : 0) : 0);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        tv[i] = (uint16_t)(u >> 16);
    }
    const __m512i table = _mm512_loadu_si512(tv);
    int failed = 0;
    for (int r0 = 0; r0 < M; r0 += TILE_ROW_CHUNK) {
        const int rows = M - r0 < TILE_ROW_CHUNK ? M - r0 : TILE_ROW_CHUNK, tiles = (rows + 15) / 16;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int i = 0; i < tiles * nb; i++) {
                const int t = i / nb, b = i % nb;
                split_rows(x + (int64_t)r0 * ldx, ldx, rows, 16 * t, b, xb + ((size_t)t * nb + b) * 768);
                for (int r = 0; r < 16; r++)
                    xsT[((size_t)t * nb + b) * 16 + r] = offset && 16 * t + r < rows ? xs[(int64_t)(r0 + 16 * t + r) * nb + b] : 0.0f;
            }
            /* per thread: 48 decoded rows of W (bf16 integers), their scales and offsets, 16 x 16 sums */
            const size_t a_bytes = (size_t)TILE_GROUP * K * 2, s_bytes = sizeof(float) * TILE_GROUP * (size_t)nb;
            char *buf = scratch_of(a_bytes + 2 * s_bytes + 2 * sizeof(float) * 3 * 256);
            if (buf == NULL) {
#pragma omp atomic write
                failed = 1;
            }
            uint16_t *a = (uint16_t *)buf;
            float *d = (float *)(buf + a_bytes), *m = (float *)(buf + a_bytes + s_bytes);
            float *cb = (float *)(buf + a_bytes + 2 * s_bytes), *acc = cb + 3 * 256;
            kvp_amx_configure();
#pragma omp for schedule(static)
            for (int g = 0; g < groups; g++) {
                if (failed) continue;
                const int n0 = TILE_GROUP * g, count = N - n0 < TILE_GROUP ? N - n0 : TILE_GROUP, P = (count + 15) / 16;
                for (int j = 0; j < 16 * P; j++) { /* d, m: [panel][b][16] */
                    float *dj = d + (j / 16) * 16 * nb + j % 16, *mj = m + (j / 16) * 16 * nb + j % 16;
                    if (j < count) {
                        tile_decode_row(type, w + (int64_t)(n0 + j) * row_bytes, nb, table, a + (size_t)j * K, dj, mj);
                        continue;
                    }
                    memset(a + (size_t)j * K, 0, (size_t)K * 2);
                    for (int b = 0; b < nb; b++) dj[b * 16] = mj[b * 16] = 0.0f;
                }
                for (int t = 0; t < tiles; t++) {
                    for (int i = 0; i < P; i++) /* acc[i][n][r]: output n0 + 16 i + n of row 16 t + r */
                        for (int n = 0; n < 16; n++) {
                            __m512 s = _mm512_setzero_ps();
                            for (int b = 0; offset && b < nb; b++)
                                s = _mm512_fmadd_ps(_mm512_set1_ps(m[(i * nb + b) * 16 + n]),
                                                    _mm512_load_ps(xsT + ((size_t)t * nb + b) * 16), s);
                            _mm512_store_ps(acc + i * 256 + 16 * n, s);
                        }
                    for (int b = 0; b < nb; b++) {
                        /* tiles 0-2: the panels' sums; 3-5: their rows of W; 6, 7: x's terms in turn (so
                         * that a load need not wait for the products reading the tile it replaces) */
                        const uint32_t *xt = xb + ((size_t)t * nb + b) * 768;
                        const uint16_t *ab = a + 32 * b;
                        const int64_t panel = (int64_t)16 * K, stride = K * 2;
                        _tile_zero(0);
                        _tile_loadd(3, ab, stride);
                        if (P > 1) {
                            _tile_zero(1);
                            _tile_loadd(4, ab + panel, stride);
                        }
                        if (P > 2) {
                            _tile_zero(2);
                            _tile_loadd(5, ab + 2 * panel, stride);
                        }
                        _tile_loadd(6, xt, 64);
                        _tile_dpbf16ps(0, 3, 6);
                        if (P > 1) _tile_dpbf16ps(1, 4, 6);
                        if (P > 2) _tile_dpbf16ps(2, 5, 6);
                        _tile_loadd(7, xt + 256, 64);
                        _tile_dpbf16ps(0, 3, 7);
                        if (P > 1) _tile_dpbf16ps(1, 4, 7);
                        if (P > 2) _tile_dpbf16ps(2, 5, 7);
                        _tile_loadd(6, xt + 512, 64);
                        _tile_dpbf16ps(0, 3, 6);
                        if (P > 1) _tile_dpbf16ps(1, 4, 6);
                        if (P > 2) _tile_dpbf16ps(2, 5, 6);
                        _tile_stored(0, cb, 64);
                        if (P > 1) _tile_stored(1, cb + 256, 64);
                        if (P > 2) _tile_stored(2, cb + 512, 64);
                        for (int i = 0; i < P; i++) {
                            const float *di = d + (i * nb + b) * 16;
                            for (int n = 0; n < 16; n++)
                                _mm512_store_ps(acc + i * 256 + 16 * n,
                                                _mm512_fmadd_ps(_mm512_set1_ps(di[n]), _mm512_load_ps(cb + i * 256 + 16 * n),
                                                                _mm512_load_ps(acc + i * 256 + 16 * n)));
                        }
                    }
                    const int live = rows - 16 * t < 16 ? rows - 16 * t : 16;
                    for (int r = 0; r < live; r++) {
                        float *yr = y + (int64_t)(r0 + 16 * t + r) * ldy + n0;
                        for (int n = 0; n < count; n++) yr[n] = acc[(n / 16) * 256 + 16 * (n % 16) + r];
                    }
                }
            }
            _tile_release();
        }
        if (failed) break;
    }
    free(xb);
    free(xsT);
    return failed ? -2 : 0;
}
#endif

/* Whether kvp_qgemm_tiles multiplies on AMX tiles where they apply (1, the default) or always as the
 * rows' path (0); -1 changes nothing. Returns 1 if tiles run from now on. */
int kvp_qgemm_set_tiles(int on) {
#if defined(KVP_TILES)
    if (on >= 0) tiles_wanted = on != 0;
    return tiles_wanted && kvp_amx_granted();
#else
    (void)on;
    return 0;
#endif
}

static int check(int type, int K) {
    int values, bytes;
    if (type == T_I8_ROW) return K % 32 == 0;
    return kvp_quant_block(type, &values, &bytes) && K % values == 0 && (is_float(type) || K % block_of(type) == 0);
}

/* Each row of x's sums over its blocks of bs values, [M, K / bs] (malloc'd; NULL out of memory):
 * the offsets' term sum_b m[b] xs[b]. */
static float *block_sums(const float *x, int64_t ldx, int M, int K, int bs) {
    const int nb = K / bs;
    float *xs = malloc(sizeof(float) * (size_t)M * (size_t)nb);
    for (int r = 0; xs && r < M; r++)
        for (int b = 0; b < nb; b++) {
            float t = 0.0f;
            for (int j = 0; j < bs; j++) t += x[(int64_t)r * ldx + b * bs + j];
            xs[(int64_t)r * nb + b] = t;
        }
    return xs;
}

/* y[M, N] = x[M, K] @ W^T, W[N, K] in `type` (see above); x, y fp32 with row strides ldx, ldy.
 * Returns 0; -1 for an unknown format or a K that is not a whole number of blocks; -2 out of memory. */
int kvp_qgemm_rows(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K, int N,
                   float *y, int64_t ldy) {
    if (!check(type, K)) return -1;
    const int bs = block_of(type), nb = K / bs, offset = has_offset(type), flt = is_float(type);
    float *xs = NULL; /* sums of x over each block: only formats with offsets use them */
    if (offset && (xs = block_sums(x, ldx, M, K, bs)) == NULL) return -2;
#if defined(HAVE_DIRECT_DOT)
    if (M == 1 && direct_format(type) && nb <= DIRECT_MAX_BLOCKS) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) y[n] = direct_dot(type, w + (int64_t)n * row_bytes, x, xs, K);
        free(xs);
        return 0;
    }
#endif
    int failed = 0;
#pragma omp parallel
    {
        /* four rows of W decoded at a time (each: values, scales, offsets), then K bytes of scratch;
         * blocked: x's rows are shared by the four (measured: faster from two rows of x, or with
         * rows short enough that four decoded ones stay in L1/L2; one long row at a time otherwise) */
        const int blocked = M > 1 || K <= 2048;
        const size_t width = ((sizeof(float) * (size_t)K + 63) / 64) * 64, scales = 64 * (((size_t)nb + 15) / 16);
        const size_t slot = width + 2 * scales;
        char *buf = aligned_alloc(64, 4 * slot + (((size_t)K + 63) / 64) * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *q[4], *d[4], *m[4];
            for (int j = 0; j < 4; j++) {
                q[j] = (float *)(buf + j * slot);
                d[j] = (float *)(buf + j * slot + width);
                m[j] = (float *)(buf + j * slot + width + scales);
            }
            int8_t *scratch = (int8_t *)(buf + 4 * slot);
#pragma omp for schedule(static)
            for (int g = 0; g < (N + 3) / 4; g++) {
                const int n0 = 4 * g, count = N - n0 < 4 ? N - n0 : 4;
                if (flt) {
                    for (int n = n0; n < n0 + count; n++) {
                        float_row(type, w + (int64_t)n * row_bytes, K, q[0]);
                        for (int r = 0; r < M; r++) y[(int64_t)r * ldy + n] = dot(x + (int64_t)r * ldx, q[0], K);
                    }
                    continue;
                }
                int j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
                if (count == 4 && blocked) {
                    for (int j = 0; j < 4; j++) decode_row(type, w + (int64_t)(n0 + j) * row_bytes, K, q[j], d[j], m[j], scratch);
                    int r = 0;
#if defined(HAVE_DOT4_512)
                    for (; r < M; r += 4) {
                        const int rows = M - r < 4 ? M - r : 4;
                        float out[16];
                        block_dot4_rows(x + (int64_t)r * ldx, ldx, offset ? xs + (int64_t)r * nb : NULL, nb, rows, q, d, m,
                                        offset, bs, K, out);
                        for (int i = 0; i < rows; i++) memcpy(y + (int64_t)(r + i) * ldy + n0, out + 4 * i, 4 * sizeof(float));
                    }
#elif defined(__AVX512F__)
                    for (; r + 2 <= M; r += 2) {
                        float out[8];
                        block_dot4(x + (int64_t)r * ldx, ldx, offset ? xs + (int64_t)r * nb : NULL, nb, 2, q, d, m, offset,
                                   bs, K, out);
                        memcpy(y + (int64_t)r * ldy + n0, out, 4 * sizeof(float));
                        memcpy(y + (int64_t)(r + 1) * ldy + n0, out + 4, 4 * sizeof(float));
                    }
#endif
                    for (; r < M; r++) {
                        float out[4];
                        block_dot4(x + (int64_t)r * ldx, ldx, offset ? xs + (int64_t)r * nb : NULL, nb, 1, q, d, m, offset,
                                   bs, K, out);
                        memcpy(y + (int64_t)r * ldy + n0, out, sizeof out);
                    }
                    j0 = 4;
                }
#endif
                for (int j = j0; j < count; j++) {
                    decode_row(type, w + (int64_t)(n0 + j) * row_bytes, K, q[0], d[0], m[0], scratch);
                    for (int r = 0; r < M; r++)
                        y[(int64_t)r * ldy + n0 + j] = block_dot(x + (int64_t)r * ldx, offset ? xs + (int64_t)r * nb : NULL,
                                                                 q[0], d[0], m[0], offset, bs, K);
                }
            }
        }
        free(buf);
    }
    free(xs);
    return failed ? -2 : 0;
}

/* kvp_qgemm_rows's y = x @ W^T, on AMX tiles where they apply (Q4_0, Q4_1, Q8_0; M >= 8; a CPU with
 * AMX whose tile state Linux grants; kvp_qgemm_set_tiles(1)): each row's result still its own, in
 * other bits than kvp_qgemm_rows's; elsewhere kvp_qgemm_rows itself. */
int kvp_qgemm_tiles(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K, int N,
                    float *y, int64_t ldy) {
#if defined(KVP_TILES)
    if (M >= TILE_MIN_ROWS && direct_format(type) && K % 32 == 0) {
        float *xs = NULL; /* Q4_1's block sums, as kvp_qgemm_rows adds them */
        if (type == T_Q4_1 && (xs = block_sums(x, ldx, M, K, 32)) == NULL) return -2;
        const int rc = qgemm_tiles(type, x, ldx, xs, w, row_bytes, M, K, N, y, ldy);
        free(xs);
        if (rc != -1) return rc;
    }
#endif
    return kvp_qgemm_rows(type, x, ldx, w, row_bytes, M, K, N, y, ldy);
}

/* Activations for integer dot products, as llama.cpp quantizes them: each row of x in groups of
 * 32 values, q = round(x / e) with e = max|x| / 127 (q in -127..127), and es = e * sum(q) per
 * group (the offsets' term). */
static void quantize_rows(const float *x, int64_t ldx, int M, int K, int8_t *q, float *e, float *es) {
    const int nc = K / 32;
    for (int r = 0; r < M; r++) {
        const float *xr = x + (int64_t)r * ldx;
        for (int c = 0; c < nc; c++) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xr[32 * c + j]));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                const int v = (int)nearbyintf(xr[32 * c + j] * inv);
                q[(int64_t)r * K + 32 * c + j] = (int8_t)v;
                sum += v;
            }
            e[(int64_t)r * nc + c] = scale;
            es[(int64_t)r * nc + c] = scale * (float)sum;
        }
    }
}

#if defined(__AVX2__)
/* Per 32-bit lane i, the sum of the four products w[4i..4i+3] * x[4i..4i+3] of signed bytes (exact:
 * |w| <= 128 and |x| <= 127, so maddubs' 16-bit pair sums cannot saturate). */
static inline __m256i dot4_i8(__m256i w, __m256i x) {
    const __m256i u = _mm256_abs_epi8(w), s = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

/* sum_b d[b] e[b] (sum_{j in b} w[j] q[j]) + sum_c m[c] es[c]: integer sums per block (exact), then
 * one fixed order of float operations for a given K (the same with or without VNNI). */
static inline float q8_dot(const int8_t *w, const float *d, const float *m, const int8_t *q, const float *e,
                           const float *es, int offset, int bs, int K) {
    const int nc = K / 32;
    const float extra = offset ? offset_sum(m, es, nc) : 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int c = 0; c < nc; c++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
        const __m256 p = _mm256_cvtepi32_ps(dot4_i8(wv, xv)); /* lanes 0-3: values 0-15, 4-7: 16-31 */
        const __m256 scale = bs == 32 ? _mm256_set1_ps(d[c] * e[c])
                                      : _mm256_setr_m128(_mm_set1_ps(d[2 * c] * e[c]), _mm_set1_ps(d[2 * c + 1] * e[c]));
        if (c & 1)
            acc1 = _mm256_fmadd_ps(scale, p, acc1);
        else
            acc0 = _mm256_fmadd_ps(scale, p, acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + extra;
#else
    float total = 0.0f;
    for (int b = 0; b < K / bs; b++) {
        int sum = 0;
        for (int j = 0; j < bs; j++) sum += (int)w[b * bs + j] * (int)q[b * bs + j];
        total = __builtin_fmaf(d[b] * e[b * bs / 32], (float)sum, total);
    }
    return total + extra;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* q8_dot of `rows` (1 or 2) rows of activations with four decoded rows of W at once (each row of x
 * read once for the four): each output's float operations are q8_dot's, in its order. */
static inline __attribute__((always_inline)) void q8_dot4(int8_t *const *w, float *const *d, float *const *m,
        const int8_t *q, const float *e, const float *es, int rows, int offset, int bs, int K, float *out) {
    const int nc = K / 32;
    __m256 a0[2][4], a1[2][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) a0[r][j] = a1[r][j] = _mm256_setzero_ps();
    for (int c = 0; c < nc; c++) {
        __m256i xv[2];
        for (int r = 0; r < rows; r++) xv[r] = _mm256_loadu_si256((const __m256i *)(q + (int64_t)r * K + 32 * c));
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w[j] + 32 * c));
            for (int r = 0; r < rows; r++) {
                const float ec = e[r * nc + c];
                const __m256 p = _mm256_cvtepi32_ps(dot4_i8(wv, xv[r]));
                const __m256 scale = bs == 32 ? _mm256_set1_ps(d[j][c] * ec)
                                              : _mm256_setr_m128(_mm_set1_ps(d[j][2 * c] * ec), _mm_set1_ps(d[j][2 * c + 1] * ec));
                if (c & 1)
                    a1[r][j] = _mm256_fmadd_ps(scale, p, a1[r][j]);
                else
                    a0[r][j] = _mm256_fmadd_ps(scale, p, a0[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++)
            out[4 * r + j] = hsum8(_mm256_add_ps(a0[r][j], a1[r][j])) + (offset ? offset_sum(m[j], es + r * nc, nc) : 0.0f);
}
#endif

#if defined(HAVE_DIRECT_DOT) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* The 32 bytes dpbusd multiplies for block b, as unsigned bytes (Q4_0's bias 8 is taken off the sums) */
static inline __attribute__((always_inline)) __m256i nibble_bytes(const uint8_t *v) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)v), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* q8_dot(row, q) for one row of W read from its blocks: per block, eight lanes of sums of four
 * integer products (exactly dot4_i8's), then q8_dot's float operations in its order. */
static inline __attribute__((always_inline)) float direct_q8_dot_t(const int type, const uint8_t *p, const int8_t *q,
                                                                   const float *e, const float *es, int K) {
    const int nc = K / 32, size = block_size(type), offset = type == T_Q4_1, q8 = type == T_Q8_0;
    float m[DIRECT_MAX_BLOCKS];
    __m512 acc = _mm512_setzero_ps();
    const __m512i eight = _mm512_set1_epi8(8);
    int c = 0;
    for (; c + 2 <= nc; c += 2, p += 2 * size) {
        const __m512i xv = _mm512_loadu_si512((const void *)(q + 32 * c));
        __m512i s;
        if (q8) {
            const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
                                                  _mm256_loadu_si256((const __m256i *)(p + size + 2)), 1);
            const __m512i u = _mm512_abs_epi8(wv);
            /* sign(x, w): x where w > 0, -x where w < 0, 0 where w == 0 */
            const __mmask64 neg = _mm512_movepi8_mask(wv), zero = _mm512_testn_epi8_mask(wv, wv);
            __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            sx = _mm512_maskz_mov_epi8(~zero, sx);
            s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sx);
        } else {
            const int head = offset ? 4 : 2;
            const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(nibble_bytes(p + head)), nibble_bytes(p + size + head), 1);
            s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
            if (!offset) s = _mm512_sub_epi32(s, _mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, xv));
        }
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(half_value(p) * e[c])),
                                                _mm256_set1_ps(half_value(p + size) * e[c + 1]), 1);
        acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc);
        if (offset) {
            m[c] = half_value(p + 2);
            m[c + 1] = half_value(p + size + 2);
        }
    }
    __m256 acc0 = _mm512_castps512_ps256(acc);
    const __m256 acc1 = _mm512_extractf32x8_ps(acc, 1);
    if (c < nc) { /* an odd last block: acc0's */
        __m256i s;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
        if (q8) {
            s = dot4_i8(_mm256_loadu_si256((const __m256i *)(p + 2)), xv);
        } else {
            s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibble_bytes(p + (offset ? 4 : 2)), xv);
            if (!offset) s = _mm256_sub_epi32(s, _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(8), xv));
        }
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_value(p) * e[c]), _mm256_cvtepi32_ps(s), acc0);
        if (offset) m[c] = half_value(p + 2);
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + (offset ? offset_sum(m, es, nc) : 0.0f);
}

static float direct_q8_dot(int type, const uint8_t *p, const int8_t *q, const float *e, const float *es, int K) {
    return type == T_Q4_0 ? direct_q8_dot_t(T_Q4_0, p, q, e, es, K)
         : type == T_Q4_1 ? direct_q8_dot_t(T_Q4_1, p, q, e, es, K) : direct_q8_dot_t(T_Q8_0, p, q, e, es, K);
}
#define HAVE_DIRECT_Q8_DOT 1
#endif

/* y[M, N] = q8(x)[M, K] @ W^T with integer dot products: x quantized as quantize_rows does, W[N, K]
 * in a block format (not F32/F16/BF16). Faster than kvp_qgemm_rows, and not its bits (the
 * activations are rounded to 8 bits). Each output element is one fixed reduction, whatever M,
 * the thread count or the thread: a batch gives each sequence the bits it gets alone.
 * Returns 0; -1 for a float or unknown format or K not a whole number of blocks; -2 out of memory. */
int kvp_qgemm_rows_q8(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K,
                      int N, float *y, int64_t ldy) {
    if (!check(type, K) || is_float(type)) return -1;
    const int bs = block_of(type), nb = K / bs, nc = K / 32, offset = has_offset(type);
    int8_t *q = malloc((size_t)M * (size_t)K);
    float *e = malloc(sizeof(float) * 2 * (size_t)M * (size_t)nc);
    if (q == NULL || e == NULL) {
        free(q);
        free(e);
        return -2;
    }
    float *es = e + (size_t)M * (size_t)nc;
    quantize_rows(x, ldx, M, K, q, e, es);
#if defined(HAVE_DIRECT_Q8_DOT)
    if (M == 1 && direct_format(type) && nc <= DIRECT_MAX_BLOCKS) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) y[n] = direct_q8_dot(type, w + (int64_t)n * row_bytes, q, e, es, K);
        free(q);
        free(e);
        return 0;
    }
#endif
    int failed = 0;
#pragma omp parallel
    {
        /* four rows of W decoded at a time: each its bytes, scales and offsets */
        const size_t width = (((size_t)K + 63) / 64) * 64, scales = 16 * (((size_t)nb + 15) / 16);
        const size_t slot = width + 2 * sizeof(float) * scales;
        int8_t *buf = aligned_alloc(64, 4 * slot);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            int8_t *ws[4];
            float *d[4], *m[4];
            for (int j = 0; j < 4; j++) {
                ws[j] = buf + j * slot;
                d[j] = (float *)(buf + j * slot + width);
                m[j] = d[j] + scales;
            }
            if (M == 1) { /* one row of activations: nothing to share, one weight row at a time (less to cache) */
#pragma omp for schedule(static)
                for (int n = 0; n < N; n++) {
                    decode_i8(type, w + (int64_t)n * row_bytes, K, ws[0], d[0], m[0]);
                    y[n] = q8_dot(ws[0], d[0], m[0], q, e, es, offset, bs, K);
                }
            } else {
#pragma omp for schedule(static)
                for (int g = 0; g < (N + 3) / 4; g++) {
                    const int n0 = 4 * g, count = N - n0 < 4 ? N - n0 : 4;
                    for (int j = 0; j < count; j++) decode_i8(type, w + (int64_t)(n0 + j) * row_bytes, K, ws[j], d[j], m[j]);
                    int j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
                    if (count == 4) {
                        int r = 0;
#if defined(__AVX512F__)
                        for (; r + 2 <= M; r += 2) {
                            float out[8];
                            q8_dot4(ws, d, m, q + (int64_t)r * K, e + (int64_t)r * nc, es + (int64_t)r * nc, 2, offset, bs, K, out);
                            memcpy(y + (int64_t)r * ldy + n0, out, 4 * sizeof(float));
                            memcpy(y + (int64_t)(r + 1) * ldy + n0, out + 4, 4 * sizeof(float));
                        }
#endif
                        for (; r < M; r++) {
                            float out[4];
                            q8_dot4(ws, d, m, q + (int64_t)r * K, e + (int64_t)r * nc, es + (int64_t)r * nc, 1, offset, bs, K, out);
                            memcpy(y + (int64_t)r * ldy + n0, out, sizeof out);
                        }
                        j0 = 4;
                    }
#endif
                    for (int j = j0; j < count; j++)
                        for (int r = 0; r < M; r++)
                            y[(int64_t)r * ldy + n0 + j] = q8_dot(ws[j], d[j], m[j], q + (int64_t)r * K, e + (int64_t)r * nc,
                                                                  es + (int64_t)r * nc, offset, bs, K);
                }
            }
        }
        free(buf);
    }
    free(q);
    free(e);
    return failed ? -2 : 0;
}

/* out[i, :] = W[rows[i], :] dequantized to fp32 (out row stride ldo), for i < n. */
int kvp_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *rows, int n, int K, float *out,
                     int64_t ldo) {
    if (!check(type, K)) return -1;
    const int nb = K / block_of(type);
    int failed = 0;
#pragma omp parallel
    {
        float *scales = malloc(sizeof(float) * 2 * ((size_t)nb + 1) + (size_t)K);
        if (scales == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++)
                dequant_row(type, w + rows[i] * row_bytes, K, out + (int64_t)i * ldo, scales, scales + nb + 1,
                            (int8_t *)(scales + 2 * (nb + 1)));
        }
        free(scales);
    }
    return failed ? -2 : 0;
}

/* Rows 0..n-1 of a block format (not F32/F16/BF16) as their integer values q[n][K] with, per
 * group of block_of(type) values, a scale d and an offset m ([n][K / block_of(type)]; m is 0 where
 * the format has none): every weight is exactly d*q + m. The layout the Triton kernels read.
 * Returns 0; -1 for a float or unknown format or a K that is not a whole number of blocks. */
int kvp_decode_i8_rows(int type, const uint8_t *w, int64_t row_bytes, int n, int K, int8_t *q, float *d, float *m) {
    if (!check(type, K) || is_float(type)) return -1;
    const int groups = K / block_of(type);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        float *mi = m + (int64_t)i * groups;
        for (int b = 0; b < groups; b++) mi[b] = 0.0f;
        decode_i8(type, w + (int64_t)i * row_bytes, K, q + (int64_t)i * K, d + (int64_t)i * groups, mi);
    }
    return 0;
}

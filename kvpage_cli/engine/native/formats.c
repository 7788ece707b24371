/* kvpage native CPU kernels: the block formats decoded (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, F32 and kvpage's own int8 rows): a row's integers with their
 * scales and offsets, or its values dequantized to fp32 bit for bit as the gguf package's
 * reference computes them (formats.h).
 */
#include "formats.h"

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
        case T_Q2_K: *values = 256; *bytes = 84; return 1;
        case T_Q3_K: *values = 256; *bytes = 110; return 1;
        case T_Q4_K: *values = 256; *bytes = 144; return 1;
        case T_Q5_K: *values = 256; *bytes = 176; return 1;
        case T_Q6_K: *values = 256; *bytes = 210; return 1;
        default: return 0;
    }
}

/* A quantized row as signed 8-bit integers w[K] with, per block of BS values (block_of), a scale d
 * and an offset m: value j = d[b] * w[j] + m[b] (m only for formats with an offset): the integers
 * decode_row gives as floats. For the integer dot products of kvp_qgemm_rows_q8. */
void decode_i8(int type, const uint8_t *restrict p, int K, int8_t *restrict w, float *restrict d,
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
        case T_Q2_K:
        case T_Q3_K: {
            const int three = type == T_Q3_K; /* values_k2; Q3_K's are offset by 4 */
            for (int b = 0; b < K / 256; b++, p += three ? 110 : 84, w += 256, d += 16) {
                if (three) {
                    uint32_t words[4];
                    uint8_t sc[16];
                    scales_k3(p + 96, words);
                    memcpy(sc, words, 16);
                    const float dd = half_value(p + 108);
                    for (int j = 0; j < 16; j++) d[j] = dd * (float)((int)sc[j] - 32);
                } else { /* scales[16]: the scale in the low nibble, the min in the high one */
                    const float dd = half_value(p + 80), dmin = half_value(p + 82);
                    for (int j = 0; j < 16; j++) {
                        d[j] = dd * (float)(p[j] & 0xF);
                        m[j] = -(dmin * (float)(p[j] >> 4));
                    }
                    m += 16;
                }
                uint8_t u[256];
                values_k2(type, p, u);
                for (int j = 0; j < 256; j++) w[j] = (int8_t)(u[j] - (three ? 4 : 0));
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
void decode_row(int type, const uint8_t *p, int K, float *q, float *d, float *m, int8_t *w) {
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
void float_row(int type, const uint8_t *p, int K, float *out) {
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

/* kvpage native CPU kernels: y = x @ W^T with x rounded to int8 (--activations int8), W in a block
 * format (formats.h): the llama.cpp way, faster than rows.c and not its bits: x rounded to int8
 * in groups of 32 and integer dot products with the row's integers (VNNI where the CPU has it,
 * else AVX2's maddubs, else plain C), scaled per block.
 */
#include "formats.h"

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

#if defined(KVP_DIRECT_512) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* The 32 bytes dpbusd multiplies for block b, as unsigned bytes (Q4_0's bias 8 is taken off the sums) */
static inline __attribute__((always_inline)) __m256i nibble_bytes(const uint8_t *v) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)v), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* q8_dot(row, q) for one row of W read from its blocks: per block, eight lanes of sums of four
 * integer products (exactly dot4_i8's), then q8_dot's float operations in its order. */
static inline __attribute__((always_inline)) float direct_q8_dot_t(const int type, const uint8_t *p, const int8_t *q,
                                                                   const float *e, const float *es, int K,
                                                                   const uint8_t *next) {
    const int nc = K / 32, size = block_size(type), offset = type == T_Q4_1, q8 = type == T_Q8_0;
    float m[DIRECT_MAX_BLOCKS];
    __m512 acc = _mm512_setzero_ps();
    const __m512i eight = _mm512_set1_epi8(8);
    int c = 0;
    for (; c + 2 <= nc; c += 2, p += 2 * size) {
        if (next) { /* a row further on, the same bytes of it, into L2 (as rows.c's direct_dot) */
            __builtin_prefetch(next + (int64_t)c * size, 0, 2);
            __builtin_prefetch(next + (int64_t)(c + 1) * size, 0, 2);
        }
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

static float direct_q8_dot(int type, const uint8_t *p, const int8_t *q, const float *e, const float *es, int K,
                           const uint8_t *next) {
    return type == T_Q4_0 ? direct_q8_dot_t(T_Q4_0, p, q, e, es, K, next)
         : type == T_Q4_1 ? direct_q8_dot_t(T_Q4_1, p, q, e, es, K, next) : direct_q8_dot_t(T_Q8_0, p, q, e, es, K, next);
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
    if (is_kquant(type)) return kquant_q8(type, x, ldx, w, row_bytes, M, K, N, y, ldy);
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
        for (int n = 0; n < N; n++)
            y[n] = direct_q8_dot(type, w + (int64_t)n * row_bytes, q, e, es, K,
                                 n + PREFETCH_ROWS < N ? w + (int64_t)(n + PREFETCH_ROWS) * row_bytes : NULL);
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

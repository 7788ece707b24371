/* kvpage native CPU kernels: y[M, N] = x[M, K] @ W^T for a few fp32 rows of x (decode steps,
 * batches), W in a block format (formats.h).
 *
 * Each thread decodes one row of W at a time into a buffer (its integer values, and a scale and an
 * offset per block) and takes its dot product with every row of x, scaling block by block
 * (block_dot; float rows: a plain dot). An output element is one fixed reduction over k, the same
 * whatever the number of rows, the thread count or which thread computes it: a batch gives each
 * sequence the bits it gets alone.
 */
#include "formats.h"

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
#if defined(KVP_DIRECT_512)
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
                                                                const float *xs, int K, const uint8_t *next) {
    const int nb = K / 32, size = block_size(type), offset = type == T_Q4_1;
    float m[DIRECT_MAX_BLOCKS];
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, p += size, x += 32) {
        if (next) __builtin_prefetch(next + (int64_t)b * size, 0, 2); /* a row further on, into L2 */
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

static float direct_dot(int type, const uint8_t *p, const float *x, const float *xs, int K, const uint8_t *next) {
    return type == T_Q4_0 ? direct_dot_t(T_Q4_0, p, x, xs, K, next)
         : type == T_Q4_1 ? direct_dot_t(T_Q4_1, p, x, xs, K, next) : direct_dot_t(T_Q8_0, p, x, xs, K, next);
}
#define HAVE_DIRECT_DOT 1
#endif

/* Each row of x's sums over its blocks of bs values, [M, K / bs] (malloc'd; NULL out of memory):
 * the offsets' term sum_b m[b] xs[b]. */
float *block_sums(const float *x, int64_t ldx, int M, int K, int bs) {
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
        for (int n = 0; n < N; n++)
            y[n] = direct_dot(type, w + (int64_t)n * row_bytes, x, xs, K,
                              n + PREFETCH_ROWS < N ? w + (int64_t)(n + PREFETCH_ROWS) * row_bytes : NULL);
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
#if defined(__AVX2__) && defined(__FMA__)
        const int blocked = M > 1 || K <= 2048;
#endif
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

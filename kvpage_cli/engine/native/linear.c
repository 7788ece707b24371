/* kvpage native CPU kernels: y = x @ w for a few rows (decode steps, batches, short prompts).
 *
 * Every output element is one chain of fused multiply-adds over k = 0 .. K-1 in order, whatever
 * the number of rows, the tiling or the number of threads (threads split the columns, never k).
 * So a row's result does not depend on which other rows share the call: a batch of sequences
 * gives each sequence the very bits it gets alone.
 */
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KB 32    /* rows of w per pass: their column strip is reused from cache by every row group */
#define RB 4     /* rows of x per register group */
#define CT 32    /* columns per register tile (two vectors) */

static inline float bf16_value(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
static inline __m512 load_w(const void *w, int64_t index, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + index);
}

/* Rows r0 .. r0+rows-1 (rows <= RB), columns [c, c+32), k in [k0, k1): acc in y. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const void *w, int64_t ldw, int bf16,
                                                       float *y, int64_t ldy, int r0, const int rows, int c, int k0, int k1) {
    __m512 a0[RB], a1[RB];
    for (int r = 0; r < rows; r++) {
        a0[r] = _mm512_loadu_ps(y + (int64_t)(r0 + r) * ldy + c);
        a1[r] = _mm512_loadu_ps(y + (int64_t)(r0 + r) * ldy + c + 16);
    }
    for (int k = k0; k < k1; k++) {
        const __m512 w0 = load_w(w, (int64_t)k * ldw + c, bf16);
        const __m512 w1 = load_w(w, (int64_t)k * ldw + c + 16, bf16);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[(int64_t)(r0 + r) * ldx + k]);
            a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + (int64_t)(r0 + r) * ldy + c, a0[r]);
        _mm512_storeu_ps(y + (int64_t)(r0 + r) * ldy + c + 16, a1[r]);
    }
}

static void strip(const float *x, int64_t ldx, const void *w, int64_t ldw, int bf16, float *y, int64_t ldy,
                  int M, int K, int c0, int c1) {
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        for (int c = c0; c < c1; c += CT) {
            int r = 0;
            for (; r + RB <= M; r += RB) tile(x, ldx, w, ldw, bf16, y, ldy, r, RB, c, k0, k1);
            switch (M - r) {
                case 1: tile(x, ldx, w, ldw, bf16, y, ldy, r, 1, c, k0, k1); break;
                case 2: tile(x, ldx, w, ldw, bf16, y, ldy, r, 2, c, k0, k1); break;
                case 3: tile(x, ldx, w, ldw, bf16, y, ldy, r, 3, c, k0, k1); break;
                default: break;
            }
        }
    }
}
#endif

/* Columns [c0, c1) one at a time: the same chain per element, without vectors. */
static void strip_scalar(const float *x, int64_t ldx, const void *w, int64_t ldw, int bf16, float *y, int64_t ldy,
                         int M, int K, int c0, int c1) {
    for (int r = 0; r < M; r++)
        for (int c = c0; c < c1; c++) {
            float acc = y[(int64_t)r * ldy + c];
            for (int k = 0; k < K; k++) {
                const float wv = bf16 ? bf16_value(((const uint16_t *)w)[(int64_t)k * ldw + c]) : ((const float *)w)[(int64_t)k * ldw + c];
                acc = __builtin_fmaf(x[(int64_t)r * ldx + k], wv, acc);
            }
            y[(int64_t)r * ldy + c] = acc;
        }
}

/* y[M, N] = x[M, K] @ w[K, N] (w row-major: the transposed weight, fp32 or bf16; x, y fp32).
 * ldx, ldw, ldy: row strides in elements. */
void kvp_gemm_rows(int bf16, const float *x, int64_t ldx, const void *w, int64_t ldw, int M, int K, int N,
                   float *y, int64_t ldy) {
    for (int r = 0; r < M; r++) memset(y + (int64_t)r * ldy, 0, sizeof(float) * (size_t)N);
    const int tiles = N / 32;
#pragma omp parallel
    {
        int t = 0, nt = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int c0 = (int)((int64_t)tiles * t / nt) * 32, c1 = (int)((int64_t)tiles * (t + 1) / nt) * 32;
#if defined(__AVX512F__)
        if (c1 > c0) strip(x, ldx, w, ldw, bf16, y, ldy, M, K, c0, c1);
#else
        if (c1 > c0) strip_scalar(x, ldx, w, ldw, bf16, y, ldy, M, K, c0, c1);
#endif
        if (t == nt - 1 && tiles * 32 < N) strip_scalar(x, ldx, w, ldw, bf16, y, ldy, M, K, tiles * 32, N);
    }
}

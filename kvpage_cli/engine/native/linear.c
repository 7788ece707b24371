/* kvpage native CPU kernels: y = x @ w for a few rows (decode steps, batches, short prompts).
 *
 * Every output element is one chain of fused multiply-adds over k = 0 .. K-1 in order, whatever
 * the number of rows, the tiling or the number of threads (threads split the columns, never k).
 * So a row's result does not depend on which other rows share the call: a batch of sequences
 * gives each sequence the very bits it gets alone.
 */
#include <stdint.h>
#include <string.h>

#include "kvpage.h"
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KB 32    /* rows of w per pass: their column strip is reused from cache by every row group */
#define RB 4     /* rows of x per register group */

static inline float bf16_value(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The vector unit: AVX-512 (16 floats) or AVX2 with FMA (8 floats); tiles are two vectors wide. */
#if defined(__AVX512F__)
#define VLEN 16
typedef __m512 vec;
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec load_w(const void *w, int64_t index, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + index);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VLEN 8
typedef __m256 vec;
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec load_w(const void *w, int64_t index, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + index);
}
#endif

#if defined(VLEN)
#define CT (2 * VLEN)  /* columns per register tile (two vectors) */

/* Rows r0 .. r0+rows-1 (rows <= RB), columns [c, c+CT), k in [k0, k1): acc in y. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const void *w, int64_t ldw, int bf16,
                                                       float *y, int64_t ldy, int r0, const int rows, int c, int k0, int k1) {
    vec a0[RB], a1[RB];
    for (int r = 0; r < rows; r++) {
        a0[r] = vload(y + (int64_t)(r0 + r) * ldy + c);
        a1[r] = vload(y + (int64_t)(r0 + r) * ldy + c + VLEN);
    }
    for (int k = k0; k < k1; k++) {
        const vec w0 = load_w(w, (int64_t)k * ldw + c, bf16);
        const vec w1 = load_w(w, (int64_t)k * ldw + c + VLEN, bf16);
        for (int r = 0; r < rows; r++) {
            const vec xv = vset1(x[(int64_t)(r0 + r) * ldx + k]);
            a0[r] = vfma(xv, w0, a0[r]);
            a1[r] = vfma(xv, w1, a1[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        vstore(y + (int64_t)(r0 + r) * ldy + c, a0[r]);
        vstore(y + (int64_t)(r0 + r) * ldy + c + VLEN, a1[r]);
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
#else
#define CT 32
#endif

/* Columns [c0, c1) without intrinsics: k outer, columns inner (the compiler vectorises the
 * columns), still one chain per element over k in order. */
static void strip_scalar(const float *x, int64_t ldx, const void *w, int64_t ldw, int bf16, float *y, int64_t ldy,
                         int M, int K, int c0, int c1) {
    for (int r = 0; r < M; r++) {
        float *yr = y + (int64_t)r * ldy;
        for (int k = 0; k < K; k++) {
            const float xv = x[(int64_t)r * ldx + k];
            if (bf16) {
                const uint16_t *wk = (const uint16_t *)w + (int64_t)k * ldw;
                for (int c = c0; c < c1; c++) yr[c] = __builtin_fmaf(xv, bf16_value(wk[c]), yr[c]);
            } else {
                const float *wk = (const float *)w + (int64_t)k * ldw;
#pragma omp simd
                for (int c = c0; c < c1; c++) yr[c] = __builtin_fmaf(xv, wk[c], yr[c]);
            }
        }
    }
}

/* y[M, N] = x[M, K] @ w[K, N] (w row-major: the transposed weight, fp32 or bf16; x, y fp32).
 * ldx, ldw, ldy: row strides in elements. */
void kvp_gemm_rows(int bf16, const float *x, int64_t ldx, const void *w, int64_t ldw, int M, int K, int N,
                   float *y, int64_t ldy) {
    for (int r = 0; r < M; r++) memset(y + (int64_t)r * ldy, 0, sizeof(float) * (size_t)N);
    const int tiles = N / CT;
#pragma omp parallel
    {
        int t = 0, nt = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int c0 = (int)((int64_t)tiles * t / nt) * CT, c1 = (int)((int64_t)tiles * (t + 1) / nt) * CT;
#if defined(VLEN)
        if (c1 > c0) strip(x, ldx, w, ldw, bf16, y, ldy, M, K, c0, c1);
#else
        if (c1 > c0) strip_scalar(x, ldx, w, ldw, bf16, y, ldy, M, K, c0, c1);
#endif
        if (t == nt - 1 && tiles * CT < N) strip_scalar(x, ldx, w, ldw, bf16, y, ldy, M, K, tiles * CT, N);
    }
}

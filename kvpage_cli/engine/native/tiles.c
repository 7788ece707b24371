/* kvpage native CPU kernels: a few rows' products with W on AMX tiles (Q4_0, Q4_1, Q8_0), in other
 * bits than rows.c's (each row's result still its own). The tile state is amx.c's.
 */
#include "formats.h"

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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(KVP_DIRECT_512)
#define KVP_TILES 1
#ifndef TILE_MIN_ROWS
#error "TILE_MIN_ROWS is defined by the build (kvpage_cli/engine/native/__init__.py)"
#endif
#define TILE_GROUP 48     /* rows of W decoded at a time: three tiles of 16 */
#define TILE_ROW_CHUNK 128 /* rows of x per pass over W (their terms stay in L2) */
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

/* kvpage native CPU kernels: K-quant rows (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) times activations rounded
 * to int8, read straight from their blocks (no dequantized copy of a row), as llama.cpp multiplies
 * them.
 *
 * Activations: each row of x in groups of 256 values (one superblock), q = round(x * 127 / amax)
 * in -127..127 with the group's scale e = amax / 127, and the sums of q over each sub-block of the
 * weights' format (16 values for Q2_K, Q3_K and Q6_K, 32 for Q4_K and Q5_K).
 *
 * A superblock of W holds 256 unsigned integers u (2 to 6 bits), an integer scale sc per sub-block,
 * a float d and, for Q2_K, Q4_K and Q5_K, an integer min mn per sub-block and a float dmin:
 * w = d sc u - dmin mn; Q3_K and Q6_K's scales are signed and their values offset by a power of
 * two b (4 and 32): w = d sc (u - b). An output is, per superblock s in order, two exact integer sums
 *     I_s = sum_j sc_j sum_{i in j} u_i q_i     (Q3_K, Q6_K: sum_j sc_j sum_{i in j} (u_i - b) q_i)
 *     J_s = sum_j mn_j sum_{i in j} q_i         (Q2_K, Q4_K, Q5_K)
 * and then t = fmaf(d_s e_s, I_s, t), t = fmaf(-(dmin_s e_s), J_s, t). The integers cannot
 * overflow (|I_s| < 2^28) and every path computes them exactly, so every path gives the same
 * bits: one row of W at a time against a few rows of x (AVX-512, AVX2, portable C), and for long
 * chunks tiles of 16 rows of W decoded once and multiplied with VNNI against many rows of x; a
 * row's result does not depend on the rows beside it, the path, the thread count or the CPU.
 * Every format goes through the same loops: the helpers below say, per type, where a
 * superblock's values, scales, mins and floats are (KQ_DISPATCH makes the type a constant in each).
 */
#include "formats.h"

#define SUPER 256
#define GEMM_LANES 16 /* rows of W in a tile of the long chunks' path (one per 32-bit lane) */
#define GEMM_ROWS 8   /* rows of x per register block there */

/* Rows of x from which the tiles' path multiplies (kvp_kquant_set_gemm_rows); below, the rows' path. */
static int gemm_min_rows = 5;

/* CALL(T) with the format T a constant, so that the always-inline kernels below are compiled per format. */
#define KQ_DISPATCH(type, CALL)              \
    switch (type) {                          \
        case T_Q2_K: CALL(T_Q2_K); break;    \
        case T_Q3_K: CALL(T_Q3_K); break;    \
        case T_Q4_K: CALL(T_Q4_K); break;    \
        case T_Q5_K: CALL(T_Q5_K); break;    \
        default: CALL(T_Q6_K); break;        \
    }

/* Values per sub-block (a scale each): 16 for Q2_K, Q3_K, Q6_K; 32 for Q4_K, Q5_K. Formats with
 * mins (J_s, dmin) are formats.h's has_offset: Q2_K, Q4_K, Q5_K. */
static inline int sub_values(int type) { return block_of(type); }
/* The offset b of the signed formats' values, as a shift (b = 1 << bias_bits): Q3_K 4, Q6_K 32; 0: none. */
static inline int bias_bits(int type) { return type == T_Q6_K ? 5 : type == T_Q3_K ? 2 : 0; }
static inline int two_bits(int type) { return type == T_Q2_K || type == T_Q3_K; } /* values as 2-bit fields */
/* A superblock's d and dmin (0 for formats without mins). */
static inline float super_d(int type, const uint8_t *p) {
    return half_value(p + (type == T_Q2_K ? 80 : type == T_Q3_K ? 108 : type == T_Q6_K ? 208 : 0));
}
static inline float super_dmin(int type, const uint8_t *p) {
    return type == T_Q2_K ? half_value(p + 82) : type == T_Q4_K || type == T_Q5_K ? half_value(p + 2) : 0.0f;
}

/* x's rows as kvp_qgemm_rows_q8 multiplies them with `type`: q [M, K], e [M, K/256], bs [M, K/sub]. */
static void quantize_k(int type, const float *x, int64_t ldx, int M, int K, int8_t *q, float *e, int16_t *bs) {
    const int nsb = K / SUPER, sub = sub_values(type), nbs = K / sub;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)M * nsb; i++) {
        const int r = (int)(i / nsb), s = (int)(i % nsb);
        const float *xs = x + (int64_t)r * ldx + SUPER * s;
        int8_t *qs = q + (int64_t)r * K + SUPER * s;
        float amax = 0.0f;
        int j = 0;
#if defined(__AVX512F__)
        __m512 m = _mm512_setzero_ps();
        for (; j < SUPER; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xs + j)));
        amax = _mm512_reduce_max_ps(m);
#endif
        for (; j < SUPER; j++) amax = fmaxf(amax, fabsf(xs[j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        e[(int64_t)r * nsb + s] = amax / 127.0f;
        j = 0;
#if defined(__AVX512F__)
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; j < SUPER; j += 16) /* round to nearest even, as nearbyintf */
            _mm_storeu_si128((__m128i *)(qs + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + j), vinv))));
#elif defined(__AVX2__)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; j < SUPER; j += 16) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j), vinv));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 8), vinv));
            const __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* 16 int16 in order */
            _mm_storeu_si128((__m128i *)(qs + j), _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        }
#endif
        for (; j < SUPER; j++) qs[j] = (int8_t)(int)nearbyintf(xs[j] * inv);
        int16_t *b = bs + (int64_t)r * nbs + (SUPER / sub) * s;
        for (int g = 0; g < SUPER / sub; g++) {
            int sum = 0;
            for (int k = 0; k < sub; k++) sum += qs[sub * g + k];
            b[g] = (int16_t)sum;
        }
    }
}

/* The s-th `size` bytes of the next rows of W (next: NULL for none) fetched into L2 ahead of their
 * products (see dot8_512 for why L2). */
static inline void prefetch_next(const uint8_t *next, int s, int64_t size) {
    if (next) /* locality 2: x86's prefetcht1 */
        for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(next + s * size + b, 0, 2);
}

/* One superblock's integers: u[256] in value order, the sub-blocks' scales and mins, d and dmin. */
typedef struct {
    uint8_t u[SUPER];
    int32_t sc[16], mn[16];
    float d, dmin;
} kq_block;

/* Q4_K and Q5_K: the eight 6-bit scales and eight mins of a superblock (the 12 bytes at p + 4) as
 * bytes: sc0..sc7 (low 8 bytes), mn0..mn7 (high 8), four at a time (scale_min_k4's layout). */
static inline void scales_k4(const uint8_t *p, uint32_t out[4]) {
    uint32_t a, b, c;
    memcpy(&a, p + 4, 4);
    memcpy(&b, p + 8, 4);
    memcpy(&c, p + 12, 4);
    out[0] = a & 0x3f3f3f3fu;
    out[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    out[2] = b & 0x3f3f3f3fu;
    out[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
}

static inline void unpack_scales(int type, const uint8_t *p, kq_block *b) {
    b->d = super_d(type, p);
    b->dmin = super_dmin(type, p);
    uint32_t words[4];
    uint8_t bytes[16];
    if (type == T_Q6_K) {
        for (int j = 0; j < 16; j++) b->sc[j] = (int8_t)p[192 + j];
    } else if (type == T_Q3_K) {
        scales_k3(p + 96, words);
        memcpy(bytes, words, 16);
        for (int j = 0; j < 16; j++) b->sc[j] = bytes[j] - 32;
    } else if (type == T_Q2_K) { /* the scale in the low nibble, the min in the high one */
        for (int j = 0; j < 16; j++) {
            b->sc[j] = p[j] & 0xF;
            b->mn[j] = p[j] >> 4;
        }
    } else {
        scales_k4(p, words);
        memcpy(bytes, words, 16);
        for (int j = 0; j < 8; j++) {
            b->sc[j] = bytes[j];
            b->mn[j] = bytes[8 + j];
        }
    }
}

/* The float operations on one superblock's exact sums, the same on every path. */
static inline float fold(float t, float d, float dmin, float e, int32_t I, int32_t J, int mins) {
    t = __builtin_fmaf(d * e, (float)I, t);
    return mins ? __builtin_fmaf(-(dmin * e), (float)J, t) : t;
}

#if defined(__AVX2__)
/* A superblock's values as eight 32-byte chunks in value order (u8): chunk c holds values 32c..32c+31. */
static inline __attribute__((always_inline)) void values_256(const int type, const uint8_t *p, __m256i *u) {
    const __m256i f = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    if (type == T_Q6_K) {
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            u[4 * h] = _mm256_or_si256(_mm256_and_si256(a, f), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
            u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(b, f), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
            u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), f), _mm256_and_si256(hb, top));
            u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), f),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
        }
    } else if (two_bits(type)) { /* chunk 4h + k: bits 2k, 2k + 1 of qs[32h ..]; Q3_K's third: bit 4h + k of hmask */
        const int three = type == T_Q3_K;
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m256i hm = three ? _mm256_loadu_si256((const __m256i *)p) : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(p + (three ? 32 : 16) + 32 * h));
            for (int k = 0; k < 4; k++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * k), m3);
                if (three)
                    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + k), one), 2));
                u[4 * h + k] = v;
            }
        }
    } else { /* chunk 2c: the low nibbles of qs[32c ..], 2c + 1: the high ones; Q5_K's fifth bits 2c, 2c + 1 of qh */
        const int five = type == T_Q5_K;
        const uint8_t *qs = p + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(bytes, f), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), f);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
            }
            u[2 * c] = lo;
            u[2 * c + 1] = hi;
        }
    }
}

/* A superblock's scales as int16 lanes (returned) and the coefficients of its correction sums J
 * (*coef), against the sub-block sums of q laid out as dot8's `sums`: Q2_K sc0..sc15 and mn0..mn15;
 * Q3_K, Q6_K sc0..sc15 (signed) and the same; Q4_K, Q5_K sc0..sc7 then mn0..mn7 for both (the sums
 * sit in lanes 8-15). */
static inline __m256i scales16(const int type, const uint8_t *p, __m256i *coef) {
    __m256i sc;
    if (type == T_Q6_K) {
        sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    } else if (type == T_Q2_K) {
        const __m128i b = _mm_loadu_si128((const __m128i *)p), f = _mm_set1_epi8(0x0F);
        *coef = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), f));
        return _mm256_cvtepu8_epi16(_mm_and_si128(b, f));
    } else {
        uint32_t words[4];
        if (type == T_Q3_K) scales_k3(p + 96, words);
        else scales_k4(p, words);
        sc = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)words));
        if (type == T_Q3_K) sc = _mm256_sub_epi16(sc, _mm256_set1_epi16(32));
    }
    *coef = sc;
    return sc;
}

/* The sub-block sums of q against which scales16's coefficients are multiplied (bs: one superblock's). */
static inline __m256i sub_sums(const int type, const int16_t *bs) {
    if (sub_values(type) == 16) return _mm256_loadu_si256((const __m256i *)bs);
    return _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)bs), 1);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* A superblock's values as four 64-byte chunks in value order (u8): chunk c holds values 64c..64c+63. */
static inline __attribute__((always_inline)) void values_512(const int type, const uint8_t *p, __m512i *w) {
    __m256i u[8];
    values_256(type, p, u);
    for (int c = 0; c < 4; c++) w[c] = _mm512_inserti64x4(_mm512_castsi256_si512(u[2 * c]), u[2 * c + 1], 1);
}

/* Pair lane i of chunk c (values 64 c + 2 i, + 1) belongs to sub-block (64 c + 2 i) / sub. */
#define PICK(c, sub, i) (64 * (c) + 2 * (i)) / (sub)
#define PICK32(c, sub) PICK(c, sub, 0), PICK(c, sub, 1), PICK(c, sub, 2), PICK(c, sub, 3), PICK(c, sub, 4), PICK(c, sub, 5), \
    PICK(c, sub, 6), PICK(c, sub, 7), PICK(c, sub, 8), PICK(c, sub, 9), PICK(c, sub, 10), PICK(c, sub, 11), PICK(c, sub, 12), \
    PICK(c, sub, 13), PICK(c, sub, 14), PICK(c, sub, 15), PICK(c, sub, 16), PICK(c, sub, 17), PICK(c, sub, 18),             \
    PICK(c, sub, 19), PICK(c, sub, 20), PICK(c, sub, 21), PICK(c, sub, 22), PICK(c, sub, 23), PICK(c, sub, 24),             \
    PICK(c, sub, 25), PICK(c, sub, 26), PICK(c, sub, 27), PICK(c, sub, 28), PICK(c, sub, 29), PICK(c, sub, 30), PICK(c, sub, 31)
static const int16_t pick16[4][32] __attribute__((aligned(64))) = {{PICK32(0, 16)}, {PICK32(1, 16)}, {PICK32(2, 16)}, {PICK32(3, 16)}};
#undef PICK32
#undef PICK
/* Q4_K, Q5_K in dot8_512's order (a 64-byte load's low nibbles: sub-blocks 4h and 4h + 2; its high
 * nibbles: 4h + 1 and 4h + 3): pair lanes 0-15 and 16-31 of chunk c take these sub-blocks' scales. */
#define HALVES(a, b) a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b
static const int16_t pick_nibbles[4][32] __attribute__((aligned(64))) = {{HALVES(0, 2)}, {HALVES(1, 3)}, {HALVES(4, 6)},
                                                                          {HALVES(5, 7)}};
#undef HALVES
/* Q2_K, Q3_K in dot8_512's order (chunk k: values 32k.. and 128 + 32k..): pair lanes 0-7, 8-15,
 * 16-23 and 24-31 of chunk k take the scales of sub-blocks 2k, 2k + 1, 8 + 2k and 9 + 2k. */
#define EIGHT(a) a, a, a, a, a, a, a, a
#define QUARTERS(k) EIGHT(2 * (k)), EIGHT(2 * (k) + 1), EIGHT(8 + 2 * (k)), EIGHT(9 + 2 * (k))
static const int16_t pick_2bit[4][32] __attribute__((aligned(64))) = {{QUARTERS(0)}, {QUARTERS(1)}, {QUARTERS(2)},
                                                                      {QUARTERS(3)}};
#undef QUARTERS
#undef EIGHT

/* A superblock's values as four 64-byte chunks, each from one 64-byte load of its packed values:
 * Q6_K's in value order, the others in the order of their bytes (see dot8_512). */
static inline __attribute__((always_inline)) void packed_values_512(const int type, const uint8_t *p, __m512i *u) {
    const __m512i f = _mm512_set1_epi8(0x0F);
    if (type == T_Q6_K) {
        const __m512i top = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(p + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            const __m512i hq = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            u[2 * h] = _mm512_or_si512(_mm512_and_si512(l, f), _mm512_and_si512(_mm512_slli_epi16(hq, 4), top));
            u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), f), _mm512_and_si512(hq, top));
        }
        return;
    }
    if (two_bits(type)) { /* chunk k: bits 2k, 2k + 1 of all 64 bytes of qs */
        const int three = type == T_Q3_K;
        const __m512i b = _mm512_loadu_si512(p + (three ? 32 : 16)), m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
        __m512i hq = _mm512_setzero_si512();
        if (three) { /* bit 4h + k of hmask[l], the third bit of value 128h + 32k + l: [hm | hm >> 4] lines bits 4h up */
            const __m256i hm = _mm256_loadu_si256((const __m256i *)p);
            hq = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi16(hm, 4), 1);
        }
        for (int k = 0; k < 4; k++) {
            __m512i v = _mm512_and_si512(_mm512_srli_epi16(b, 2 * k), m3);
            if (three) v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hq, k), one), 2));
            u[k] = v;
        }
        return;
    }
    const int five = type == T_Q5_K;
    const uint8_t *qs = p + (five ? 48 : 16);
    __m512i hq = _mm512_setzero_si512();
    if (five) { /* bit j of qh[l]: value l of sub-block j's fifth bit; [qh | qh >> 2] lines bits 4h, 4h+2 up */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        hq = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    }
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    for (int h = 0; h < 2; h++) {
        const __m512i b = _mm512_loadu_si512(qs + 64 * h);
        __m512i lo = _mm512_and_si512(b, f), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), f);
        if (five) { /* bit 4h of hq to bit 4 for lo, bit 4h + 1 for hi */
            lo = _mm512_or_si512(lo, _mm512_and_si512(h ? hq : _mm512_slli_epi16(hq, 4), bit4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(h ? _mm512_srli_epi16(hq, 1) : _mm512_slli_epi16(hq, 3), bit4));
        }
        u[2 * h] = lo;
        u[2 * h + 1] = hi;
    }
}

/* One superblock of a row of x (q) in the order of packed_values_512's chunks: Q6_K's in value order;
 * Q4_K's and Q5_K's as a 64-byte load of nibbles holds them (low nibbles: sub-blocks 4h and 4h + 2,
 * high: 4h + 1, 4h + 3); Q2_K's and Q3_K's chunk k as values 32k.. and 128 + 32k.. */
static inline __attribute__((always_inline)) void x_chunks_512(const int type, const int8_t *q, __m512i *x) {
    for (int h = 0; h < 2; h++) {
        if (two_bits(type)) {
            for (int k = 2 * h; k < 2 * h + 2; k++)
                x[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32 * k))),
                                          _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * k)), 1);
            continue;
        }
        const __m512i a = _mm512_loadu_si512(q + 128 * h), b = _mm512_loadu_si512(q + 128 * h + 64);
        x[2 * h] = type == T_Q6_K ? a : _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0));
        x[2 * h + 1] = type == T_Q6_K ? b : _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
}

/* Lane i of the result: the sum of the 16 lanes of v[i], from t[k] = unpacklo32(v[2k], v[2k+1]) +
 * unpackhi32(v[2k], v[2k+1]) (each 128-bit part: pair sums of v[2k] and v[2k+1], interleaved). */
static inline __m256i sum8_512_pairs(const __m512i *t) {
    __m512i u[2];
    for (int i = 0; i < 2; i++) /* per 128-bit part: partial sums of v[4i] .. v[4i+3] */
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i d = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castsi512_si256(_mm512_shuffle_i32x4(d, d, _MM_SHUFFLE(2, 0, 2, 0)));
}

/* Lane i of the result: the sum of the 8 lanes of v[i], from t[k] as sum8_512_pairs takes it. */
static inline __m256i sum8_256_pairs(const __m256i *t) {
    __m256i u[2];
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* One row of W's superblock (p) against x's chunks (x_chunks_512): the int32 lanes whose sum is
 * I_s (Q3_K, Q6_K: less b sum_j sc_j bs_j) and those whose sum is J_s (Q3_K, Q6_K: sum_j sc_j bs_j). */
static inline __attribute__((always_inline)) void row_sums_512(const int type, const uint8_t *p, const __m512i *x,
                                                               __m256i sums, __m512i *v_out, __m256i *j_out) {
    const int16_t(*pick)[32] = type == T_Q6_K ? pick16 : two_bits(type) ? pick_2bit : pick_nibbles;
    __m512i u[4];
    packed_values_512(type, p, u);
    __m256i coef;
    const __m256i sc = scales16(type, p, &coef);
    const __m512i sc512 = _mm512_zextsi256_si512(sc);
    __m512i v = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i S = _mm512_permutexvar_epi16(_mm512_load_si512(pick[c]), sc512);
        v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], x[c]), S));
    }
    const __m256i j = _mm256_madd_epi16(coef, sums); /* Q3_K, Q6_K: sum_j sc_j bs_j; else sum_j mn_j bs_j */
    *v_out = bias_bits(type) ? _mm512_sub_epi32(v, _mm512_zextsi256_si512(_mm256_slli_epi32(j, bias_bits(type)))) : v;
    *j_out = j;
}

/* Eight rows of W (row i's superblocks at w[i]) with one row of x, AVX-512: per superblock and
 * row of W, int16 pair sums of u q (maddubs: at most 2 * 63 * 127), times their sub-block's
 * scale into int32 lanes (madd), summed, less the Q3_K, Q6_K correction; the eight rows' sums reduced
 * together (pairs as they come) into one vector, whose lanes then take the shared float steps
 * side by side. The next eight rows' bytes are prefetched into L2 a superblock's worth at a time
 * (prefetch_next): a decode step's products stream every weight from memory once, and into L1 (T0)
 * they read 25.6 GB/s where into L2 they read 32.9 GB/s, about the 31.5 GB/s bench/quant_models.py
 * measured on that machine (all of a 1B-shaped Q4_K_M file's matrices, one row of x, 2 threads, a
 * 2-vCPU Zen 4; no prefetch: 14.0 GB/s). */
static inline __attribute__((always_inline)) void dot8_512(const int type, const uint8_t *const *w, int64_t block_bytes,
        int nsb, const int8_t *q, const float *e, const int16_t *bs, const uint8_t *next, float *out) {
    const int nsub = SUPER / sub_values(type), mins = has_offset(type);
    __m256 F = _mm256_setzero_ps();
    for (int s = 0; s < nsb; s++) {
        prefetch_next(next, s, 8 * block_bytes);
        __m512i x[4];
        x_chunks_512(type, q + SUPER * s, x);
        const __m256i sums = sub_sums(type, bs + nsub * s);
        __m512i T[4];
        __m256i JT[4];
        float d[8], dmin[8];
        for (int i = 0; i < 8; i += 2) { /* lane sums of rows i, i + 1 interleaved: see sum8_512 */
            __m512i v0, v1;
            __m256i j0, j1;
            const uint8_t *p0 = w[i] + (int64_t)s * block_bytes, *p1 = w[i + 1] + (int64_t)s * block_bytes;
            row_sums_512(type, p0, x, sums, &v0, &j0);
            row_sums_512(type, p1, x, sums, &v1, &j1);
            T[i / 2] = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
            JT[i / 2] = _mm256_add_epi32(_mm256_unpacklo_epi32(j0, j1), _mm256_unpackhi_epi32(j0, j1));
            d[i] = super_d(type, p0);
            d[i + 1] = super_d(type, p1);
            dmin[i] = super_dmin(type, p0);
            dmin[i + 1] = super_dmin(type, p1);
        }
        const __m256 es = _mm256_set1_ps(e[s]);
        F = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d), es), _mm256_cvtepi32_ps(sum8_512_pairs(T)), F);
        if (mins) F = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dmin), es), _mm256_cvtepi32_ps(sum8_256_pairs(JT)), F);
    }
    _mm256_storeu_ps(out, F);
}
#define KQ_DOT8 dot8_512

#elif defined(__AVX2__) && defined(__FMA__)
/* Lane i of the result: the sum of the 8 lanes of v[i]. */
static inline __m256i sum8_256(const __m256i *v) {
    __m256i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* dot8_512 in 256-bit registers: eight chunks of 32 values, in value order. */
static inline __attribute__((always_inline)) void dot8_256(const int type, const uint8_t *const *w, int64_t block_bytes,
        int nsb, const int8_t *q, const float *e, const int16_t *bs, const uint8_t *next, float *out) {
    const int sub = sub_values(type), nsub = SUPER / sub, mins = has_offset(type), bias = bias_bits(type);
    __m256 F = _mm256_setzero_ps();
    for (int s = 0; s < nsb; s++) {
        prefetch_next(next, s, 8 * block_bytes);
        const int8_t *qs = q + SUPER * s;
        const __m256i sums = sub_sums(type, bs + nsub * s);
        __m256i V[8], J[8];
        float d[8], dmin[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = w[i] + (int64_t)s * block_bytes;
            __m256i u[8], coef;
            int16_t sc[16];
            values_256(type, p, u);
            _mm256_storeu_si256((__m256i *)sc, scales16(type, p, &coef));
            __m256i v = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) { /* chunk c: values 32c..32c+31 */
                const __m256i S = sub == 16 ? _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]))
                                            : _mm256_set1_epi16(sc[c]);
                v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], _mm256_loadu_si256((const __m256i *)(qs + 32 * c))), S));
            }
            J[i] = _mm256_madd_epi16(coef, sums);
            V[i] = bias ? _mm256_sub_epi32(v, _mm256_slli_epi32(J[i], bias)) : v;
            d[i] = super_d(type, p);
            dmin[i] = super_dmin(type, p);
        }
        const __m256 es = _mm256_set1_ps(e[s]);
        F = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d), es), _mm256_cvtepi32_ps(sum8_256(V)), F);
        if (mins) F = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dmin), es), _mm256_cvtepi32_ps(sum8_256(J)), F);
    }
    _mm256_storeu_ps(out, F);
}
#define KQ_DOT8 dot8_256
#endif

#if !defined(KQ_DOT8)
static void unpack(int type, const uint8_t *p, kq_block *b) {
    unpack_scales(type, p, b);
    if (type == T_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *l0 = p + 64 * h, *h0 = p + 128 + 32 * h;
            uint8_t *o = b->u + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((l0[l] & 0xF) | ((h0[l] & 3) << 4));
                o[l + 32] = (uint8_t)((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4));
            }
        }
        return;
    }
    if (two_bits(type)) {
        values_k2(type, p, b->u);
        return;
    }
    const int five = type == T_Q5_K;
    const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
    for (int s = 0; s < 4; s++)
        for (int l = 0; l < 32; l++) {
            const int h0 = five ? ((qh[l] >> (2 * s)) & 1) << 4 : 0, h1 = five ? ((qh[l] >> (2 * s + 1)) & 1) << 4 : 0;
            b->u[64 * s + l] = (uint8_t)((qs[32 * s + l] & 0xF) | h0);
            b->u[64 * s + 32 + l] = (uint8_t)((qs[32 * s + l] >> 4) | h1);
        }
}

/* Portable C: one row of W (p) with one row of x (q, e, bs). */
static float dot_portable(int type, const uint8_t *p, int64_t block_bytes, int nsb, const int8_t *q, const float *e,
                          const int16_t *bs) {
    kq_block b;
    float t = 0.0f;
    const int sub = sub_values(type), nsub = SUPER / sub, mins = has_offset(type);
    const int bias = bias_bits(type) ? 1 << bias_bits(type) : 0;
    for (int s = 0; s < nsb; s++, p += block_bytes, q += SUPER, bs += nsub) {
        unpack(type, p, &b);
        int32_t I = 0, J = 0;
        for (int j = 0; j < nsub; j++) {
            int32_t sum = 0;
            for (int i = 0; i < sub; i++) sum += (int32_t)b.u[sub * j + i] * q[sub * j + i];
            I += b.sc[j] * (sum - bias * bs[j]);
            if (mins) J += b.mn[j] * bs[j];
        }
        t = fold(t, b.d, b.dmin, e[s], I, J, mins);
    }
    return t;
}
#endif

/* out[i] for eight rows of W (w[i]) with one row of x. */
static void dot8(int type, const uint8_t *const *w, int64_t block_bytes, int nsb, const int8_t *q, const float *e,
                 const int16_t *bs, const uint8_t *next, float *out) {
#if defined(KQ_DOT8)
#define KQ_DOT8_OF(T) KQ_DOT8(T, w, block_bytes, nsb, q, e, bs, next, out)
    KQ_DISPATCH(type, KQ_DOT8_OF)
#undef KQ_DOT8_OF
#else
    for (int s = 0; s < nsb; s++) prefetch_next(next, s, 8 * block_bytes);
    for (int i = 0; i < 8; i++) out[i] = dot_portable(type, w[i], block_bytes, nsb, q, e, bs);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_GEMM 1
/* A tile: 16 rows of W decoded for VNNI, superblock by superblock: u as [64 groups of 4 values][16
 * rows][4 bytes], the sub-blocks' scales [nsub][16] and the corrections' coefficient pairs
 * [nsub/2][16] (int16 pairs: mn for Q2_K, Q4_K and Q5_K, sc for Q3_K and Q6_K), d and dmin [16]. */
typedef struct {
    uint8_t u[SUPER * GEMM_LANES];
    int32_t sc[16][GEMM_LANES], coef[8][GEMM_LANES];
    float d[GEMM_LANES], dmin[GEMM_LANES];
} tile_block;

/* 16 x 16 32-bit transpose: out[i] lane j = in[j] lane i. */
static inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* v[4a + b] now holds, per 128-bit part k, lanes (row 4k'..) of rows 4a..4a+3, column b */
    for (int i = 0; i < 4; i++) {
        const __m512i a0 = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88), a1 = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xDD);
        const __m512i b0 = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88), b1 = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xDD);
        t[i] = _mm512_shuffle_i32x4(a0, b0, 0x88);
        t[i + 8] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
        t[i + 4] = _mm512_shuffle_i32x4(a1, b1, 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
    }
    for (int i = 0; i < 16; i++) v[i] = t[i];
}

/* Rows n0.. (count of them, the rest zeros) of W, superblock s, into a tile block. */
static void decode_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t block_bytes, int n0, int count, int s,
                        tile_block *t) {
    const int nsub = SUPER / sub_values(type), mins = has_offset(type);
    __m512i rows[GEMM_LANES][4];
    kq_block b;
    for (int i = 0; i < GEMM_LANES; i++) {
        if (i >= count) {
            for (int c = 0; c < 4; c++) rows[i][c] = _mm512_setzero_si512();
            for (int j = 0; j < 16; j++) t->sc[j][i] = 0;
            for (int j = 0; j < 8; j++) t->coef[j][i] = 0;
            t->d[i] = t->dmin[i] = 0.0f;
            continue;
        }
        const uint8_t *p = w + (int64_t)(n0 + i) * row_bytes + (int64_t)s * block_bytes;
#define KQ_VALUES_OF(T) values_512(T, p, rows[i])
        KQ_DISPATCH(type, KQ_VALUES_OF)
#undef KQ_VALUES_OF
        unpack_scales(type, p, &b);
        for (int j = 0; j < nsub; j++) t->sc[j][i] = b.sc[j];
        for (int j = 0; j < nsub / 2; j++) {
            const int32_t lo = mins ? b.mn[2 * j] : b.sc[2 * j], hi = mins ? b.mn[2 * j + 1] : b.sc[2 * j + 1];
            t->coef[j][i] = (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)lo);
        }
        t->d[i] = b.d;
        t->dmin[i] = b.dmin;
    }
    for (int c = 0; c < 4; c++) { /* chunk c: groups 16c..16c+15 */
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = rows[i][c];
        transpose16(v);
        for (int g = 0; g < 16; g++) _mm512_storeu_si512(t->u + (16 * c + g) * 64, v[g]);
    }
}

/* R rows of x (q: their int8 rows, row stride K) against a decoded tile of nsb superblocks: out[R][16]. */
static inline __attribute__((always_inline)) void tile_rows(const int type, const tile_block *tb, int nsb,
        const int8_t *q, int K, const float *e, const int16_t *bs, int nbs, const int R, float *out, int64_t ldo) {
    const int sub = sub_values(type), nsub = SUPER / sub, groups = sub / 4, mins = has_offset(type), bias = bias_bits(type);
    __m512 F[GEMM_ROWS];
    for (int r = 0; r < R; r++) F[r] = _mm512_setzero_ps();
    for (int s = 0; s < nsb; s++) {
        const tile_block *t = tb + s;
        __m512i V[GEMM_ROWS], T[GEMM_ROWS];
        for (int r = 0; r < R; r++) V[r] = _mm512_setzero_si512();
        for (int j = 0; j < nsub; j++) {
            for (int r = 0; r < R; r++) T[r] = _mm512_setzero_si512();
            for (int g = groups * j; g < groups * (j + 1); g++) {
                const __m512i u = _mm512_loadu_si512(t->u + 64 * g);
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    memcpy(&x4, q + (int64_t)r * K + SUPER * s + 4 * g, 4);
                    T[r] = _mm512_dpbusd_epi32(T[r], u, _mm512_set1_epi32(x4));
                }
            }
            const __m512i sc = _mm512_loadu_si512(t->sc[j]);
            for (int r = 0; r < R; r++) V[r] = _mm512_add_epi32(V[r], _mm512_mullo_epi32(T[r], sc));
        }
        for (int r = 0; r < R; r++) T[r] = _mm512_setzero_si512(); /* the corrections' sums */
        for (int j = 0; j < nsub / 2; j++) {
            const __m512i c = _mm512_loadu_si512(t->coef[j]);
            for (int r = 0; r < R; r++) {
                int32_t b2;
                memcpy(&b2, bs + (int64_t)r * nbs + nsub * s + 2 * j, 4);
                T[r] = _mm512_dpwssd_epi32(T[r], c, _mm512_set1_epi32(b2));
            }
        }
        const __m512 d = _mm512_loadu_ps(t->d), dmin = _mm512_loadu_ps(t->dmin);
        for (int r = 0; r < R; r++) {
            const __m512 er = _mm512_set1_ps(e[(int64_t)r * nsb + s]);
            if (bias) V[r] = _mm512_sub_epi32(V[r], _mm512_slli_epi32(T[r], bias));
            F[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, er), _mm512_cvtepi32_ps(V[r]), F[r]);
            if (mins) F[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, er), _mm512_cvtepi32_ps(T[r]), F[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * ldo, F[r]);
}

static void tile_rows_any(int type, const tile_block *tb, int nsb, const int8_t *q, int K, const float *e,
                          const int16_t *bs, int nbs, int R, float *out, int64_t ldo) {
#define KQ_TILE(T, RR) tile_rows(T, tb, nsb, q, K, e, bs, nbs, RR, out, ldo)
#define KQ_TILE_ROWS(T)                                                                                       \
    switch (R) {                                                                                             \
        case 1: KQ_TILE(T, 1); break; case 2: KQ_TILE(T, 2); break; case 3: KQ_TILE(T, 3); break;            \
        case 4: KQ_TILE(T, 4); break; case 5: KQ_TILE(T, 5); break; case 6: KQ_TILE(T, 6); break;            \
        case 7: KQ_TILE(T, 7); break; default: KQ_TILE(T, 8); break;                                          \
    }
    KQ_DISPATCH(type, KQ_TILE_ROWS)
#undef KQ_TILE_ROWS
#undef KQ_TILE
}
#endif

/* Rows of x from which kvp_qgemm_rows_q8 multiplies K-quants on VNNI tiles of 16 rows of W (where
 * the CPU has AVX512-VNNI), below which one row of W at a time: the same bits either way; n <= 0
 * changes nothing. Returns the number in force. */
int kvp_kquant_set_gemm_rows(int n) {
    if (n > 0) gemm_min_rows = n;
    return gemm_min_rows;
}

/* kvp_qgemm_rows_q8 for K-quants (see above). Returns 0, or -2 out of memory. */
int kquant_q8(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K, int N,
              float *y, int64_t ldy) {
    int values, block_bytes;
    kvp_quant_block(type, &values, &block_bytes);
    const int nsb = K / SUPER, nbs = K / sub_values(type);
    int8_t *q = malloc((size_t)M * (size_t)K);
    float *e = malloc(sizeof(float) * (size_t)M * (size_t)nsb);
    int16_t *bs = malloc(sizeof(int16_t) * (size_t)M * (size_t)nbs);
    if (q == NULL || e == NULL || bs == NULL) {
        free(q);
        free(e);
        free(bs);
        return -2;
    }
    quantize_k(type, x, ldx, M, K, q, e, bs);
#if defined(KQ_GEMM)
    if (M >= gemm_min_rows) {
        int failed = 0;
        const int tiles = (N + GEMM_LANES - 1) / GEMM_LANES;
#pragma omp parallel
        {
            tile_block *tb = aligned_alloc(64, sizeof(tile_block) * (size_t)nsb);
            if (tb == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int i = 0; i < tiles; i++) {
                if (tb == NULL) continue;
                const int n0 = GEMM_LANES * i, count = N - n0 < GEMM_LANES ? N - n0 : GEMM_LANES;
                for (int s = 0; s < nsb; s++) decode_tile(type, w, row_bytes, block_bytes, n0, count, s, tb + s);
                for (int r0 = 0; r0 < M; r0 += GEMM_ROWS) {
                    const int R = M - r0 < GEMM_ROWS ? M - r0 : GEMM_ROWS;
                    float out[GEMM_ROWS][GEMM_LANES];
                    tile_rows_any(type, tb, nsb, q + (int64_t)r0 * K, K, e + (int64_t)r0 * nsb, bs + (int64_t)r0 * nbs,
                                  nbs, R, &out[0][0], GEMM_LANES);
                    for (int r = 0; r < R; r++) memcpy(y + (int64_t)(r0 + r) * ldy + n0, out[r], sizeof(float) * count);
                }
            }
            free(tb);
        }
        free(q);
        free(e);
        free(bs);
        return failed ? -2 : 0;
    }
#endif
    const int groups = (N + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++) { /* each thread one run of rows of W, read in order */
        const uint8_t *rows[8];
        const int n0 = 8 * g, count = N - n0 < 8 ? N - n0 : 8;
        for (int i = 0; i < 8; i++) rows[i] = w + (int64_t)(n0 + (i < count ? i : 0)) * row_bytes; /* past N: row n0 again */
        for (int r = 0; r < M; r++) {
            float out[8];
            /* the next group's bytes fetched ahead while this one is read (once: with the first row of x) */
            const uint8_t *next = r == 0 && n0 + 16 <= N ? w + (int64_t)(n0 + 8) * row_bytes : NULL;
            dot8(type, rows, block_bytes, nsb, q + (int64_t)r * K, e + (int64_t)r * nsb, bs + (int64_t)r * nbs, next, out);
            for (int i = 0; i < count; i++) y[(int64_t)r * ldy + n0 + i] = out[i];
        }
    }
    free(q);
    free(e);
    free(bs);
    return 0;
}

/* Intel AMX emulated in C, for the tests: the native kernels' tile paths run, unchanged, on a CPU
 * without AMX (AMD Zen 4, Intel Ice Lake: AVX512-BF16 and no tiles).
 *
 * tests/conftest.py (`tile_library`) builds a copy of the kernel library with this header forced in
 * before each source (`-include`) and -mamx-tile -mamx-bf16, so that prefill.c, quant.c and amx.c
 * compile their AMX branches as they are; the header then replaces each tile intrinsic those
 * branches use with a function doing what the Intel SDM's pseudocode for its instruction says, and
 * has Linux's grant of the tile state succeed. The library users get is never built with it.
 *
 * TDPBF16PS, as the SDM writes it: for each row m of the destination, two fp32 accumulators per
 * output n (one for the even bfloat16 of every pair, one for the odd), each updated by a fused
 * multiply-add for k = 0, 1, ... in turn, input denormals taken as zero and denormal results
 * flushed, rounding to nearest even; then per output: destination += (even + odd). The order of
 * those sums is what makes tiles give other bits than the kernels' dot products. Configuration,
 * loads, stores, zeroing and release follow the SDM too (rows past a tile's configured rows and
 * bytes past its configured width read as zero; a tile used before its thread configured it is the
 * #UD the hardware raises: the process stops).
 */
#ifndef KVP_AMX_EMULATION_H
#define KVP_AMX_EMULATION_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall(), as amx.c asks for it */
#endif
#include <immintrin.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "build with -mamx-tile -mamx-bf16 so that the sources compile their tile paths"
#endif

typedef struct {
    int rows, colsb;            /* as configured: rows of colsb bytes */
    unsigned char data[16][64]; /* 16 rows of 64 bytes: a tile register */
} kvp_emu_tile;

/* The calling thread's tile registers and whether its palette is loaded: one state per thread, as
 * the hardware keeps it, shared by every source of the library (weak: one definition in the end). */
__attribute__((weak)) _Thread_local kvp_emu_tile kvp_emu_tmm[8];
__attribute__((weak)) _Thread_local int kvp_emu_configured;

static inline void kvp_emu_fault(const char *what) {
    fprintf(stderr, "amx_emulation.h: %s (the hardware raises #UD here)\n", what);
    abort();
}

static inline kvp_emu_tile *kvp_emu_reg(int t) {
    if (!kvp_emu_configured) kvp_emu_fault("a tile used before its thread loaded a tile configuration");
    if (t < 0 || t > 7) kvp_emu_fault("no such tile register");
    return &kvp_emu_tmm[t];
}

/* LDTILECFG: palette 1, per tile its bytes per row (offset 16, 16 x uint16) and rows (offset 48). */
static inline void kvp_emu_loadconfig(const void *config) {
    const unsigned char *c = (const unsigned char *)config;
    if (c[0] != 1) kvp_emu_fault("palette other than 1");
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        if (colsb > 64 || c[48 + t] > 16) kvp_emu_fault("a tile configured past 16 rows of 64 bytes");
        kvp_emu_tmm[t].colsb = colsb;
        kvp_emu_tmm[t].rows = c[48 + t];
        memset(kvp_emu_tmm[t].data, 0, sizeof kvp_emu_tmm[t].data);
    }
    kvp_emu_configured = 1;
}

static inline void kvp_emu_release(void) {
    memset(kvp_emu_tmm, 0, sizeof kvp_emu_tmm);
    kvp_emu_configured = 0;
}

static inline void kvp_emu_loadd(int t, const void *base, long stride) {
    kvp_emu_tile *tile = kvp_emu_reg(t);
    memset(tile->data, 0, sizeof tile->data);
    for (int r = 0; r < tile->rows; r++) memcpy(tile->data[r], (const char *)base + (long)r * stride, tile->colsb);
}

static inline void kvp_emu_stored(int t, void *base, long stride) {
    const kvp_emu_tile *tile = kvp_emu_reg(t);
    for (int r = 0; r < tile->rows; r++) memcpy((char *)base + (long)r * stride, tile->data[r], tile->colsb);
}

static inline void kvp_emu_zero(int t) { memset(kvp_emu_reg(t)->data, 0, sizeof kvp_emu_tmm[0].data); }

/* DAZ on an fp32 input, FTZ on an fp32 result: a denormal is a zero of its sign. */
static inline float kvp_emu_flush(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

/* make_fp32: a bfloat16 in the top half of an fp32 (a denormal one taken as zero). */
static inline float kvp_emu_bf16(const unsigned char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return kvp_emu_flush(f);
}

static inline float kvp_emu_f32(const unsigned char *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* TDPBF16PS c, a, b: c [M x N] fp32 += a [M x K pairs] . b [K x N pairs] of bfloat16, as above. */
static inline void kvp_emu_dpbf16ps(int tc, int ta, int tb) {
    kvp_emu_tile *c = kvp_emu_reg(tc);
    const kvp_emu_tile *a = kvp_emu_reg(ta), *b = kvp_emu_reg(tb);
    const int M = c->rows, K = a->colsb / 4, N = c->colsb / 4;
    if (c->colsb % 4 || a->colsb % 4 || b->colsb % 4 || a->rows != M || b->rows != K || b->colsb != c->colsb)
        kvp_emu_fault("TDPBF16PS on tiles of shapes that do not multiply");
    for (int m = 0; m < M; m++) {
        float even[16] = {0}, odd[16] = {0};
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                even[n] = kvp_emu_flush(fmaf(kvp_emu_bf16(a->data[m] + 4 * k), kvp_emu_bf16(b->data[k] + 4 * n), even[n]));
                odd[n] = kvp_emu_flush(fmaf(kvp_emu_bf16(a->data[m] + 4 * k + 2), kvp_emu_bf16(b->data[k] + 4 * n + 2),
                                            odd[n]));
            }
        for (int n = 0; n < N; n++) {
            const float sum = kvp_emu_flush(even[n] + odd[n]);
            const float out = kvp_emu_flush(kvp_emu_flush(kvp_emu_f32(c->data[m] + 4 * n)) + sum);
            memcpy(c->data[m] + 4 * n, &out, 4);
        }
    }
}

/* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), amx.c's one system call: granted. */
static inline long kvp_emu_syscall(long number, ...) {
    va_list args;
    va_start(args, number);
    const int code = va_arg(args, int), feature = va_arg(args, int);
    va_end(args);
    if (number != SYS_arch_prctl || code != 0x1023 || feature != 18)
        kvp_emu_fault("a system call other than the request for the tile state");
    return 0;
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) kvp_emu_loadconfig(config)
#define _tile_release() kvp_emu_release()
#define _tile_loadd(t, base, stride) kvp_emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) kvp_emu_stored(t, base, stride)
#define _tile_zero(t) kvp_emu_zero(t)
#define _tile_dpbf16ps(c, a, b) kvp_emu_dpbf16ps(c, a, b)
#define syscall kvp_emu_syscall

#endif

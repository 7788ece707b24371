/* kvpage native CPU kernels: the AMX tile state (Intel's matrix unit, from Sapphire Rapids) that
 * the kernels multiplying on tiles share (prefill.c's prompt attention, tiles.c's products).
 *
 * Linux hands the tile state to a process that asks for it (ARCH_REQ_XCOMP_PERM for XTILEDATA);
 * every tile is configured as 16 rows of 64 bytes: 16 x 16 fp32 (C), 16 x 32 bf16 (A), or 16
 * pairs x 16 bf16 pairs (B, "VNNI" order).
 */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall() */
#endif
#include <stdint.h>
#include <string.h>

#include "kvpage.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static int granted = -1; /* -1: not asked yet */

/* 1 where Linux granted this process the tile state (asked once). */
int kvp_amx_granted(void) {
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-7 as 16 rows of 64 bytes. A constant in memory: GCC 12 dropped the stores into a local
 * configuration before ldtilecfg read it (only the palette was left, and the load faulted). */
static const tile_config tiles_16x64 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* The calling thread's tiles configured so (each thread that multiplies on tiles, once per call). */
void kvp_amx_configure(void) { _tile_loadconfig(&tiles_16x64); }
#else
int kvp_amx_granted(void) { return 0; }
#endif

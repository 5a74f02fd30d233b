/* AMX (Sapphire Rapids and later), for the kernels that multiply in tiles: every tile 16 rows
 * of 64 bytes, and the process's permission to use them. */
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Eight tiles of 16 rows of 64 bytes. A constant object: a configuration built on the stack
 * had its stores dropped by GCC 12 (ldtilecfg's read of it is not seen), and the half-written
 * one faulted. */
static const TileConfig TILES = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* This thread's tiles configured (each thread that uses them, before it does). */
static inline void amx_configure(void) { _tile_loadconfig(&TILES); }

/* Whether the kernels may use the tiles: Linux grants AMX state per process on request
 * (ARCH_REQ_XCOMP_PERM for XTILEDATA), once; oneDNN asks the same. */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}
#else
#define HAVE_AMX 0
static inline int amx_permitted(void) { return 0; }
static inline void amx_configure(void) {}
static inline void _tile_release(void) {}
#endif

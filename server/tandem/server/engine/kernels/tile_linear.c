/* bfloat16 products of a decode step's few rows by a weight kept in AMX's tile layout.
 *
 * oneDNN's packed bfloat16 product (torch's and vLLM's) took 26-38 ms for the default model's
 * 30 layers and lm_head at 1 to 32 rows on two Emerald Rapids cores, reading 270 MB of
 * weights at 7-10 GB/s where a streaming read runs at 18; with the weights in cache it stayed
 * as slow (a 576 x 3,072 weight at one row: 135 us, 26 GB/s from L2). Here the weight is
 * packed once so that every 32 output columns' tiles lie in one contiguous run, and each B
 * tile (16 pairs of inputs x 16 columns, 1 KB) meets every row of the step as it streams
 * past. Best of five, one invocation, cold weights (ms, oneDNN -> tiles): 1 row 18.0 -> 11.6,
 * 16 rows 17.0 -> 12.0, 32 rows 19.5 -> 13.9, 64 rows 21.8 -> 19.5, 96 rows 26.0 -> 25.1
 * (the machine's memory is noisy: the same products took up to twice as long in other
 * runs, both sides alike). The rows are packed per call into A tiles (16 rows x 32 inputs
 * each, zero past the last), and the float32 sums round once into the output, as oneDNN's
 * do: nearly every output is oneDNN's bits, and the default model's greedy tokens came out
 * the same.
 *
 * Layout of a packed [n, k] weight (n, k rounded up to 32, zero padding): blocks of 32
 * columns, each block's k / 32 steps of two tiles (columns 0-15, 16-31), each tile 16 rows of
 * 16 columns x 2 inputs: element (row r, column c, e) of tile t in step s of block b is
 * w[32b + 16t + c][32s + 2r + e]. Its reference is torch's product (tests/engine/
 * test_decode_linear.py).
 *
 * tile_linear_silu is the gated MLP's gate|up product and silu_mul in one pass, for the decode
 * chain: the default model's 30 gate|up weights, two threads, best of three, both called from
 * Python (ms, product then silu_mul -> one pass): 1 row 4.2 -> 3.3, 16 rows 5.2 -> 4.2, 32 rows
 * 8.3 -> 6.8, 64 rows 13.2 -> 12.9; at 64 rows the SiLU itself (its division and exp, about
 * two cycles a value) is most of what is left, 1.3 ms over the product alone. */
#include "amx.h"
#include "convert.h"
#include "kernels.h"

#if HAVE_AMX && defined(__AVX512BF16__)
#include <stdlib.h>
#include <string.h>

#define GROUP 32 /* rows a pass over a column block takes: two A tiles */
#define STEP 1024 /* bfloat16 elements of 32 inputs of a column block (two B tiles) or a group */
/* Steps of the weight asked for into L2 ahead of their tiles' loads: a tile load waits for
 * its memory in order behind the products before it, where a prefetch does not (6-8 steps
 * ahead: 10-15 % faster at 1 to 96 rows, cold weights). */
#define AHEAD 8

/* Whether tile_linear runs here (AMX built and granted): read by kernels/ops.py. */
int tile_linear_tiles(void) { return amx_permitted(); }

/* w [n, k] bfloat16, rows k elements apart, into out in the tile layout above (out holds
 * n and k each rounded up to 32, multiplied). */
void tile_pack(const uint16_t *w, int n, int k, uint16_t *out) {
    const int steps = (k + 31) / 32;
    for (int b = 0; b < (n + 31) / 32; b++)
        for (int s = 0; s < steps; s++)
            for (int t = 0; t < 2; t++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int e = 0; e < 2; e++) {
                            const int row = 32 * b + 16 * t + c, col = 32 * s + 2 * r + e;
                            *out++ = row < n && col < k ? w[(int64_t)row * k + col] : 0;
                        }
}

/* m rows of x (stride elements apart, k inputs) into A tiles: groups of 32 rows, each group's
 * steps of 32 rows x 32 inputs, zero past the last row and input. */
static void pack_rows(const uint16_t *x, int64_t stride, int m, int k, uint16_t *a) {
    const int steps = (k + 31) / 32, groups = (m + GROUP - 1) / GROUP;
    memset(a, 0, sizeof(uint16_t) * STEP * steps * groups);
    for (int i = 0; i < m; i++)
        for (int s = 0; s < steps; s++) {
            const int cols = k - 32 * s < 32 ? k - 32 * s : 32;
            memcpy(a + ((int64_t)(i / GROUP) * steps + s) * STEP + (i % GROUP) * 32,
                   x + i * stride + 32 * s, sizeof(uint16_t) * cols);
        }
}

/* A tile of float32 sums (16 x 16, rows 64 bytes apart) plus bias, rounded into the first
 * `rows` rows and `cols` columns at out. */
static void store_tile(const float *c, int rows, int cols, const uint16_t *bias, uint16_t *out,
                       int64_t stride) {
    const __mmask16 keep = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    __m512 add = _mm512_setzero_ps();
    if (bias)
        add = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias)), 16));
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * r), add);
        _mm256_mask_storeu_epi16(out + r * stride, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* One group of up to 32 rows (a: its packed steps) times one block of 32 columns (b: its
 * packed steps): the float32 sums into c as four 16 x 16 tiles (rows 0-15 by columns 0-15,
 * then 16-31; rows 16-31 likewise), the last two only with more than 16 rows. Tiles: 0-3
 * sums, 4-5 A, 6-7 B. */
static void group_sums(const uint16_t *a, const uint16_t *b, int steps, int rows, float *c) {
    const int two = rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s = 0; s < steps; s++) {
        const char *ahead = (const char *)(b + (s + AHEAD) * STEP); /* into the next block too */
        for (int line = 0; line < STEP * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
        _tile_loadd(6, b + s * STEP, 64);
        _tile_loadd(7, b + s * STEP + STEP / 2, 64);
        _tile_loadd(4, a + s * STEP, 64);
        if (two) _tile_loadd(5, a + s * STEP + STEP / 2, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (!two) return;
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* group_sums' tiles plus bias, rounded into the first `rows` rows and `cols` columns of out
 * (rows `stride` apart). */
static void store_group(const float *c, int rows, int cols, const uint16_t *bias, uint16_t *out,
                        int64_t stride) {
    for (int t = 0; t < (rows > 16 ? 4 : 2); t++) {
        const int half = t / 2, side = t % 2, width = cols - 16 * side;
        if (width <= 0) continue;
        store_tile(c + 256 * t, half ? rows - 16 : (rows < 16 ? rows : 16), width,
                   bias ? bias + 16 * side : NULL, out + half * 16 * stride + 16 * side, stride);
    }
}

/* The sums of a gate block and of its up block (group_sums' layout), each rounded to
 * bfloat16 as the product's output is, into silu(gate) * up (silu_times, as silu_mul makes
 * it) for the first `rows` rows of the block's 32 columns of out (rows `stride` apart). */
static void store_silu(const float *gate, const float *up, int rows, uint16_t *out,
                       int64_t stride) {
    for (int r = 0; r < rows; r++)
        for (int side = 0; side < 2; side++) {
            const int at = 256 * ((r / 16) * 2 + side) + (r % 16) * 16;
            const float *restrict g = gate + at, *restrict u = up + at;
            uint16_t *restrict o = out + r * stride + 16 * side;
            for (int c = 0; c < 16; c++)
                o[c] = to_bf16(silu_times(round_to(g[c], 1), round_to(u[c], 1), 1));
        }
}

/* out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) times the weight packed
 * by tile_pack, plus bias [n] (or NULL), all bfloat16. The threads split the column blocks;
 * each block's weight streams in once and meets every group of rows while in L1. */
void tile_linear(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                 int n, const uint16_t *bias, uint16_t *out, int64_t out_stride, int threads) {
    const int steps = (k + 31) / 32, groups = (m + GROUP - 1) / GROUP, blocks = (n + 31) / 32;
    amx_permitted(); /* the process's tiles, asked for once */
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * STEP * steps * groups);
    pack_rows(x, x_stride, m, k, a);
#pragma omp parallel num_threads(threads)
    {
        float c[1024] __attribute__((aligned(64)));
        amx_configure();
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++)
            for (int g = 0; g < groups; g++) {
                const int rows = m - GROUP * g < GROUP ? m - GROUP * g : GROUP;
                const int cols = n - 32 * b < 32 ? n - 32 * b : 32;
                group_sums(a + (int64_t)g * steps * STEP, packed + (int64_t)b * steps * STEP,
                           steps, rows, c);
                store_group(c, rows, cols, bias ? bias + 32 * b : NULL,
                            out + (int64_t)GROUP * g * out_stride + 32 * b, out_stride);
            }
        _tile_release();
    }
    free(a);
}

/* out [m, inter] (rows out_stride apart) = silu(gate) * up, where [gate | up] = x [m, k] (rows
 * x_stride apart) times the [2 * inter, k] gate|up weight packed by tile_pack: tile_linear
 * and silu_mul in one pass, their bits (each of gate and up rounded to bfloat16 first), with
 * no [m, 2 * inter] product written and read back. inter: a multiple of 32, so that a gate
 * block's columns are its up block's. */
void tile_linear_silu(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                      int inter, uint16_t *out, int64_t out_stride, int threads) {
    const int steps = (k + 31) / 32, groups = (m + GROUP - 1) / GROUP, blocks = inter / 32;
    amx_permitted();
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * STEP * steps * groups);
    pack_rows(x, x_stride, m, k, a);
#pragma omp parallel num_threads(threads)
    {
        float gate[1024] __attribute__((aligned(64))), up[1024] __attribute__((aligned(64)));
        amx_configure();
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++)
            for (int g = 0; g < groups; g++) {
                const int rows = m - GROUP * g < GROUP ? m - GROUP * g : GROUP;
                const uint16_t *rows_a = a + (int64_t)g * steps * STEP;
                group_sums(rows_a, packed + (int64_t)b * steps * STEP, steps, rows, gate);
                group_sums(rows_a, packed + (int64_t)(b + blocks) * steps * STEP, steps, rows, up);
                store_silu(gate, up, rows, out + (int64_t)GROUP * g * out_stride + 32 * b,
                           out_stride);
            }
        _tile_release();
    }
    free(a);
}
#endif

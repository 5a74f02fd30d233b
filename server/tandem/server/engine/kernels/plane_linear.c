/* float32 products on AMX's bfloat16 tiles: each operand as three bfloat16 planes.
 *
 * A float32 holds 24 significant bits, a bfloat16 8: x = x1 + x2 + x3, each x_i the top 16
 * bits of what the planes before it left (truncated, so each remainder is exact). Then
 * x . w = sum over i, j of x_i . w_j, and the six terms with i + j <= 4 (x1w1, x1w2, x2w1,
 * x1w3, x2w2, x3w1) carry everything above 2^-24 of the product, float32's own rounding; the
 * tiles multiply bfloat16 pairs exactly and sum them in float32. So this is a float32 product
 * as exact as an FMA loop's (against float64, 576 to 1,536 inputs: max error 0.6x oneDNN's
 * float32 product's, mean 0.5x), as NVIDIA's float32 emulation on bfloat16 tensor cores is,
 * at six tile products where a bfloat16 product takes one. Why: a 4,096-row prefill of the
 * default model spent half its time in oneDNN's float32 products at ~70 % of the FMA peak;
 * on two cores of a Xeon (KVM model 167) these run 1.6-1.9x faster at the default model's
 * shapes, 4,096 rows, and 1.24-1.9x at 65-1,024. A plane below float32's normal range (inputs
 * under about 2^-110) is lost, as the tiles read bfloat16 subnormals as zero: an error under
 * 2^-125 |w| a product.
 *
 * Layouts. A packed [n, k] weight (plane_pack; n and k rounded up to 32, zero padding): blocks
 * of 32 columns, each block's k / 32 steps, each step its three planes, each plane two B
 * tiles (columns 0-15, 16-31) of 16 rows of 16 columns x 2 inputs: element (row r, column c,
 * e) of tile t of plane p in step s of block b is plane p of w[32b + 16t + c][32s + 2r + e].
 * The rows of x are split per call the same way (split_rows): tiles of 16 rows, each tile's
 * steps, each step's three planes, each plane one A tile of 16 rows x 32 inputs.
 * Its reference is float64's product (tests/engine/test_plane_linear.py).
 */
#include "amx.h"
#include "convert.h"
#include "kernels.h"

#if HAVE_AMX
#include <stdlib.h>
#include <string.h>

#define TILE 512 /* bfloat16 elements of one tile: 16 rows x 64 bytes */
#define GROUP 32 /* rows a block of sums takes: two A tiles */
#define BAND 128 /* rows whose planes stay in L2 while a column block's weight meets them */

/* Whether plane_linear runs here (AMX built and granted): read by kernels/ops.py. */
int plane_linear_tiles(void) { return amx_permitted(); }

/* The three planes of x: each the top 16 bits of what the ones before it left. */
static inline void split16(__m512 x, __m256i planes[3]) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int p = 0; p < 3; p++) {
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(x), top);
        planes[p] = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
        x = _mm512_sub_ps(x, _mm512_castsi512_ps(bits));
    }
}

static uint16_t plane_of(float x, int p) {
    __m256i planes[3];
    split16(_mm512_set1_ps(x), planes);
    return (uint16_t)_mm256_extract_epi16(planes[p], 0);
}

/* w [n, k] float32, rows k elements apart, into out in the layout above (out holds 3 x n and
 * k each rounded up to 32 bfloat16). */
void plane_pack(const float *w, int n, int k, uint16_t *out) {
    const int steps = (k + 31) / 32;
    for (int b = 0; b < (n + 31) / 32; b++)
        for (int s = 0; s < steps; s++)
            for (int p = 0; p < 3; p++)
                for (int t = 0; t < 2; t++)
                    for (int r = 0; r < 16; r++)
                        for (int c = 0; c < 16; c++)
                            for (int e = 0; e < 2; e++) {
                                const int row = 32 * b + 16 * t + c, col = 32 * s + 2 * r + e;
                                *out++ = row < n && col < k ? plane_of(w[(int64_t)row * k + col], p) : 0;
                            }
}

/* Rows tile * 16 .. + 15 of x [m, k] (rows stride apart) into their planes at a (zero past
 * the last row and input). */
static void split_rows(const float *x, int64_t stride, int m, int k, int tile, uint16_t *a) {
    const int steps = (k + 31) / 32;
    for (int s = 0; s < steps; s++) {
        uint16_t *step = a + ((int64_t)tile * steps + s) * 3 * TILE;
        for (int r = 0; r < 16; r++) {
            const int row = tile * 16 + r;
            for (int h = 0; h < 2; h++) {
                const int col = 32 * s + 16 * h, left = row < m ? k - col : 0;
                const __mmask16 keep = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                __m256i planes[3];
                split16(_mm512_maskz_loadu_ps(keep, x + (int64_t)(row < m ? row : 0) * stride + col), planes);
                for (int p = 0; p < 3; p++)
                    _mm256_storeu_si256((__m256i *)(step + p * TILE + r * 32 + 16 * h), planes[p]);
            }
        }
    }
}

/* One group of up to 32 rows (a: its first tile's planes) times one block of 32 columns (b:
 * its packed steps): the float32 sums into c as four 16 x 16 tiles (rows 0-15 by columns
 * 0-15, then 16-31; rows 16-31 likewise), the last two only with more than 16 rows. Each
 * step's six plane products, the smaller terms first; every operand change loads two tiles.
 * Tiles: 0-3 sums, 4-5 B, 6-7 A. */
static void group_sums(const uint16_t *a, const uint16_t *b, int steps, int rows, float *c) {
    const int two = rows > 16;
    const int64_t next = (int64_t)steps * 3 * TILE; /* the second A tile's planes */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
#define LOAD_A(p)                                          \
    _tile_loadd(6, a + s * 3 * TILE + (p) * TILE, 64);   \
    if (two) _tile_loadd(7, a + next + s * 3 * TILE + (p) * TILE, 64)
#define LOAD_B(p)                                                \
    _tile_loadd(4, b + (s * 3 + (p)) * 2 * TILE, 64);            \
    _tile_loadd(5, b + (s * 3 + (p)) * 2 * TILE + TILE, 64)
#define PRODUCTS()                         \
    _tile_dpbf16ps(0, 6, 4);               \
    _tile_dpbf16ps(1, 6, 5);               \
    if (two) {                             \
        _tile_dpbf16ps(2, 7, 4);           \
        _tile_dpbf16ps(3, 7, 5);           \
    }
    for (int s = 0; s < steps; s++) {
        LOAD_A(2);
        LOAD_B(0);
        PRODUCTS(); /* x3 w1 */
        LOAD_A(1);
        PRODUCTS(); /* x2 w1 */
        LOAD_B(1);
        PRODUCTS(); /* x2 w2 */
        LOAD_A(0);
        PRODUCTS(); /* x1 w2 */
        LOAD_B(2);
        PRODUCTS(); /* x1 w3 */
        LOAD_B(0);
        PRODUCTS(); /* x1 w1 */
    }
#undef LOAD_A
#undef LOAD_B
#undef PRODUCTS
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (!two) return;
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* group_sums' tiles plus bias (or NULL) into the first `rows` rows and `cols` columns of out
 * (rows `stride` apart). */
static void store_group(const float *c, int rows, int cols, const float *bias, float *out,
                        int64_t stride) {
    for (int side = 0; side < 2; side++) {
        const int width = cols - 16 * side;
        if (width <= 0) continue;
        const __mmask16 keep = width >= 16 ? 0xffff : (__mmask16)((1u << width) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * side) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 sums = _mm512_loadu_ps(c + 256 * ((r / 16) * 2 + side) + (r % 16) * 16);
            _mm512_mask_storeu_ps(out + r * stride + 16 * side, keep, _mm512_add_ps(sums, add));
        }
    }
}

/* The sums of a gate block and of its up block (group_sums' layout) into silu(gate) * up
 * (silu_times, as silu_mul makes it) for the first `rows` rows of the block's 32 columns of
 * out (rows `stride` apart). */
static void store_silu(const float *gate, const float *up, int rows, float *out, int64_t stride) {
    for (int r = 0; r < rows; r++)
        for (int side = 0; side < 2; side++) {
            const int at = 256 * ((r / 16) * 2 + side) + (r % 16) * 16;
            const float *restrict g = gate + at, *restrict u = up + at;
            float *restrict o = out + r * stride + 16 * side;
            for (int c = 0; c < 16; c++) o[c] = silu_times(g[c], u[c], 0);
        }
}

/* The products, in bands of BAND rows by runs of column blocks (enough items for every
 * thread): a thread splits its band's rows into planes, kept in its L2 while each column
 * block's weight streams in once and meets the band's groups. `gated`: blocks b and b +
 * blocks are a gate|up layer's gate and up, out their silu(gate) * up; else out gets the
 * product plus bias. */
static void products(const float *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                     int blocks, int n, const float *bias, int gated, float *out,
                     int64_t out_stride, int threads) {
    const int steps = (k + 31) / 32, bands = (m + BAND - 1) / BAND;
    const int runs_wanted = (2 * threads + bands - 1) / bands;
    const int runs = runs_wanted < blocks ? runs_wanted : blocks;
    const int64_t block_elems = (int64_t)steps * 6 * TILE, tile_elems = (int64_t)steps * 3 * TILE;
    amx_permitted(); /* the process's tiles, asked for once */
#pragma omp parallel num_threads(threads)
    {
        float c[1024] __attribute__((aligned(64))), up[1024] __attribute__((aligned(64)));
        uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * tile_elems * (BAND / 16));
        amx_configure();
#pragma omp for schedule(dynamic)
        for (int item = 0; item < bands * runs; item++) {
            const int band = item / runs, run = item % runs, r_first = band * BAND;
            const int r_last = m < r_first + BAND ? m : r_first + BAND;
            const int first = (int)((int64_t)blocks * run / runs), last = (int)((int64_t)blocks * (run + 1) / runs);
            const float *xb = x + (int64_t)r_first * x_stride;
            for (int t = 0; t < (r_last - r_first + 15) / 16; t++) split_rows(xb, x_stride, r_last - r_first, k, t, a);
            for (int b = first; b < last; b++)
                for (int r0 = r_first; r0 < r_last; r0 += GROUP) {
                    const int rows = r_last - r0 < GROUP ? r_last - r0 : GROUP;
                    const uint16_t *rows_a = a + (r0 - r_first) / 16 * tile_elems;
                    float *o = out + (int64_t)r0 * out_stride + 32 * b;
                    group_sums(rows_a, packed + b * block_elems, steps, rows, c);
                    if (!gated) {
                        store_group(c, rows, n - 32 * b < 32 ? n - 32 * b : 32,
                                    bias ? bias + 32 * b : NULL, o, out_stride);
                        continue;
                    }
                    group_sums(rows_a, packed + (b + blocks) * block_elems, steps, rows, up);
                    store_silu(c, up, rows, o, out_stride);
                }
        }
        _tile_release();
        free(a);
    }
}

/* out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) times the weight packed
 * by plane_pack, plus bias [n] (or NULL), all float32. */
void plane_linear(const float *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                  const float *bias, float *out, int64_t out_stride, int threads) {
    products(x, x_stride, m, k, packed, (n + 31) / 32, n, bias, 0, out, out_stride, threads);
}

/* out [m, inter] (rows out_stride apart) = silu(gate) * up, where [gate | up] = x [m, k] (rows
 * x_stride apart) times the [2 * inter, k] gate|up weight packed by plane_pack: plane_linear
 * and silu_mul in one pass, with no [m, 2 * inter] product written and read back. inter: a
 * multiple of 32, so that a gate block's columns are its up block's. */
void plane_linear_silu(const float *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                       int inter, float *out, int64_t out_stride, int threads) {
    products(x, x_stride, m, k, packed, inter / 32, inter, NULL, 1, out, out_stride, threads);
}
#endif

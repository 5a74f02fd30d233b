/* float32 products of a decode step's few rows by a weight kept in column panels (AVX-512).
 *
 * oneDNN's packed float32 product ran the default model's 30 layers and lm_head at 33 ms for
 * one row (the weights' 540 MB at memory speed) but 58 ms at 16 rows and 85 ms at 32 on two
 * Emerald Rapids cores: a third of the cores' FMA rate. Here the weight is packed once into
 * panels of 64 output columns, each panel's k inputs in a row of four vectors, so a panel
 * streams in once and up to ROWS rows at a time meet it while it stays in L2: per input, four
 * vector loads and, per row, one broadcast and four FMAs into accumulators that live in
 * registers for the whole panel. Alone, best of five, cold weights, the default model's
 * layers (ms, oneDNN -> panels): 1 row 29.9 -> 21.5, 16 rows 46.6 -> 41.5, 32 rows 63 -> 61,
 * 64 rows 98 -> 90: at par where the FMAs bind; what it buys is a product the decode chain
 * can call, with no Python between the layers.
 *
 * Every output is the sum over the inputs in their order, one FMA each, plus the bias: the
 * same bits whatever other rows share the step (speculation's exactness rests on that). Its
 * reference is the float64 product (tests/engine/test_decode_linear.py). */
#include "kernels.h"

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 64 /* output columns a panel holds: four vectors */
#define ROWS 6    /* rows a pass over a panel takes: 24 accumulators */
#define AHEAD 8   /* inputs a lone pass asks for into L2 ahead of its loads */
#define INLINE static inline __attribute__((always_inline))

/* w [n, k] float32, rows k apart, into panels: panel p holds columns 64p .. 64p + 63 as
 * [k][64] (zero past the last column); out holds n rounded up to 64, times k. */
void panel_pack(const float *w, int n, int k, float *out) {
    for (int p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int i = 0; i < k; i++)
            for (int c = 0; c < PANEL; c++) {
                const int col = PANEL * p + c;
                *out++ = col < n ? w[(int64_t)col * k + i] : 0.0f;
            }
}

/* `rows` (a constant where inlined) rows of x times one panel, plus bias, into out's
 * first `cols` columns. Pass j of `passes` over the panel asks for its share of the 4 k cache
 * lines from `ask` on (NULL: none) into L2, spread evenly over its inputs: 4 / passes a
 * input, the passes together asking for each line once. */
INLINE void rows_panel(const float *x, int64_t x_stride, const float *panel, int k, const int rows,
                       const float *bias, int cols, float *out, int64_t out_stride,
                       const float *ask, int j, int passes) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    int64_t line = (int64_t)j * k * 4 / passes; /* the next line to ask for */
    int due = (int)((int64_t)j * k * 4 % passes); /* passes-ths of a line owed */
    for (int i = 0; i < k; i++) {
        for (due += ask ? 4 : 0; due >= passes; due -= passes)
            _mm_prefetch((const char *)(ask + 16 * line++), _MM_HINT_T1);
        __m512 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(panel + (int64_t)i * PANEL + 16 * v);
        for (int r = 0; r < rows; r++) {
            const __m512 xr = _mm512_set1_ps(x[r * x_stride + i]);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(xr, w[v], acc[r][v]);
        }
    }
    for (int v = 0; v < 4; v++) {
        const int left = cols - 16 * v;
        const __mmask16 keep = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(out + r * out_stride + 16 * v, keep, _mm512_add_ps(acc[r][v], b));
    }
}

/* Up to ROWS rows of x times one panel: the row count made a constant. */
static void group_panel(const float *x, int64_t x_stride, const float *panel, int k, int rows,
                        const float *bias, int cols, float *out, int64_t out_stride,
                        const float *ask, int j, int passes) {
#define ROWS_CASE(R) \
    case R: return rows_panel(x, x_stride, panel, k, R, bias, cols, out, out_stride, ask, j, passes);
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
    }
#undef ROWS_CASE
}

/* Passes g0 .. g1 - 1 over one panel, a group of ROWS rows each. Unless this is the thread's
 * last panel, the passes (one or several) share out asking for the next panel, so it streams
 * in from memory while this one is multiplied from L2; on the thread's last panel a lone
 * pass asks for its own panel AHEAD inputs ahead and several ask for nothing. At 16-32
 * rows the passes after the first ran at the FMA rate and the first at the rate lines came
 * in on demand (default model, 2 threads, FMAs a cycle a thread: 576 -> 3072 at 32 rows
 * 1.34 -> 1.57, lm_head 1.0 -> 1.4-1.7). Spread over all the passes' inputs rather than a
 * line an input in the first four, the asks cost the default model's 30 layers 0.97x the
 * time at 16 rows, 0.91x at 32 and 0.85x at 64 (alternating in one process, 11 runs). */
static void panel_passes(const float *x, int64_t x_stride, int m, int k, const float *panel,
                         int g0, int g1, int last, const float *bias, int cols, float *out,
                         int64_t out_stride) {
    const float *ask = !last ? panel + (int64_t)k * PANEL : g1 - g0 == 1 ? panel + AHEAD * PANEL : NULL;
    for (int g = g0; g < g1; g++)
        group_panel(x + g * ROWS * x_stride, x_stride, panel, k,
                    m - g * ROWS < ROWS ? m - g * ROWS : ROWS, bias, cols,
                    out + g * ROWS * out_stride, out_stride, ask, g - g0, g1 - g0);
}

/* out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) times the weight packed
 * by panel_pack, plus bias [n] (or NULL), float32. The threads split the (panel, pass) pairs
 * into consecutive runs, so each panel streams in once (twice where two threads split it)
 * and meets its groups of ROWS rows while in L2; splitting pairs rather than panels evens
 * out a panel count the threads do not divide (nine for the default model's 576 outputs). */
void panel_linear(const float *x, int64_t x_stride, int m, int k, const float *packed, int n,
                  const float *bias, float *out, int64_t out_stride, int threads) {
    const int panels = (n + PANEL - 1) / PANEL, passes = (m + ROWS - 1) / ROWS;
    const int64_t pairs = (int64_t)panels * passes;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t end = pairs * (t + 1) / nt;
        for (int64_t u = pairs * t / nt; u < end;) {
            const int p = (int)(u / passes), g0 = (int)(u % passes);
            const int g1 = end - (int64_t)p * passes < passes ? (int)(end - (int64_t)p * passes) : passes;
            const int cols = n - PANEL * p < PANEL ? n - PANEL * p : PANEL;
            panel_passes(x, x_stride, m, k, packed + (int64_t)p * k * PANEL, g0, g1,
                         (int64_t)(p + 1) * passes >= end, bias ? bias + PANEL * p : NULL, cols,
                         out + PANEL * p, out_stride);
            u = (int64_t)p * passes + g1;
        }
    }
}
#endif

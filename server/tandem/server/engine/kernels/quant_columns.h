/* The loop over output columns the two block GEMVs (quant_gemv.c, quant_vnni.c) share, with
 * its dispatch to constant rows and type and its OpenMP split. Include it after defining X_T
 * (what a file's dot_rows reads of x) and
 *   dot_rows(const X_T *x, const uint8_t *w, float *out, int K, rows, qtype, block_bytes):
 * out[r] = row r of x . the column whose blocks start at w. */
#pragma once
#include "quant_blocks.h"

/* The columns [n0, n1) of y, with rows and qtype constants where it is inlined. */
INLINE void columns(const X_T *x, const uint8_t *w, int64_t w_stride, void *y, int64_t y_stride,
                    int n0, int n1, int K, const int rows, const int qtype, const int bf16) {
    const int block_bytes = qtype == Q8_0 ? 34 : (qtype == Q4_1 ? 20 : 18);
    float out[MAX_ROWS];
    int n = n0;
#ifdef PAIRS_FOR /* the file has dot_rows_pair: columns two at a time where it pays */
    if (PAIRS_FOR(qtype, rows))
        for (float out1[MAX_ROWS]; n + 1 < n1; n += 2) {
            dot_rows_pair(x, w + (int64_t)n * w_stride, w + (int64_t)(n + 1) * w_stride, out,
                          out1, K, rows, qtype, block_bytes);
            for (int r = 0; r < rows; r++) {
                store(y, (int64_t)r * y_stride + n, out[r], bf16);
                store(y, (int64_t)r * y_stride + n + 1, out1[r], bf16);
            }
        }
#endif
    for (; n < n1; n++) {
        dot_rows(x, w + (int64_t)n * w_stride, out, K, rows, qtype, block_bytes);
        for (int r = 0; r < rows; r++) store(y, (int64_t)r * y_stride + n, out[r], bf16);
    }
}

#define ROWS_CASE(R)                                                                         \
    case R:                                                                                  \
        return columns(x, w, w_stride, y, y_stride, n0, n1, K, R, qtype, bf16);

INLINE void columns_for(const X_T *x, const uint8_t *w, int64_t w_stride, void *y,
                        int64_t y_stride, int n0, int n1, int K, int rows, const int qtype,
                        int bf16) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
}

static void columns_any(const X_T *x, const uint8_t *w, int64_t w_stride, void *y,
                        int64_t y_stride, int n0, int n1, int K, int rows, int qtype, int bf16) {
    if (qtype == Q8_0)
        columns_for(x, w, w_stride, y, y_stride, n0, n1, K, rows, Q8_0, bf16);
    else if (qtype == Q4_0)
        columns_for(x, w, w_stride, y, y_stride, n0, n1, K, rows, Q4_0, bf16);
    else
        columns_for(x, w, w_stride, y, y_stride, n0, n1, K, rows, Q4_1, bf16);
}

/* All N columns: on one thread below PARALLEL_WORK weights (or threads <= 1), else split
 * evenly over `threads` (the caller's choice). */
static void all_columns(const X_T *x, const uint8_t *w, int64_t w_stride, void *y,
                        int64_t y_stride, int rows, int N, int K, int qtype, int bf16,
                        int threads) {
    if ((int64_t)N * K <= PARALLEL_WORK || threads <= 1) {
        columns_any(x, w, w_stride, y, y_stride, 0, N, K, rows, qtype, bf16);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int n0 = (int)((int64_t)N * t / nt), n1 = (int)((int64_t)N * (t + 1) / nt);
        columns_any(x, w, w_stride, y, y_stride, n0, n1, K, rows, qtype, bf16);
    }
}

/* A step's tokens from its logits: greedy sampling's argmax, and the inverse-CDF draw of a row
 * that only a temperature shapes.
 *
 * Argmax, read from the logits in the model's dtype: torch's route for a bfloat16 step was a float32 copy of every row and then max(dim=-1) on
 * one thread: 1.7 ms at 64 rows of the default model's 49,152-token vocabulary on an Emerald
 * Rapids core, a twentieth of the whole decode step. Here each row is read once, sixteen
 * lanes at a time, by as many threads as there are rows to share. The answer is torch's:
 * the first index of the largest value, and NaN for a row that holds one (max propagates it).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>

#include "kernels.h"
#include "vector16.h"

#define PARALLEL_WORK 131072 /* logits below which one thread reads them all */

/* The lanes of the 16 from i that lie below n. */
static inline __mmask16 below(int n, int i) {
    return n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
}

static inline __m512 load16(const char *p, __mmask16 keep, const int bf16) {
    const __m512 none = _mm512_set1_ps(-INFINITY);
    if (!bf16) return _mm512_mask_loadu_ps(none, keep, p);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p));
    return _mm512_mask_blend_ps(keep, none, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}

/* Each lane keeps its largest value and where it first held it; a NaN anywhere is noted. */
static void argmax_row(const char *row, int n, const int bf16, float *best, int64_t *id) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                   10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += 16, index = _mm512_add_epi32(index, sixteen)) {
        const __mmask16 keep = below(n, i);
        const __m512 v = load16(row + (int64_t)i * (bf16 ? 2 : 4), keep, bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
        top = _mm512_mask_mov_ps(top, above, v);
        at = _mm512_mask_mov_epi32(at, above, index);
    }
    if (nan) {
        *best = NAN, *id = 0;
        return;
    }
    const float m = _mm512_reduce_max_ps(top);
    const __mmask16 holds = _mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ);
    *best = m;
    *id = _mm512_mask_reduce_min_epi32(holds, at);
}

/* best [rows] float32, ids [rows] int64: each row's largest logit (NaN where the row holds a
 * NaN) and the first index of it; rows `stride` elements apart, float32 or bfloat16. */
void argmax_rows(const void *logits, int64_t stride, int rows, int vocab, int bf16, int threads,
                 float *best, int64_t *ids) {
    const int64_t row_bytes = stride * (bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * vocab > PARALLEL_WORK)
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)logits + r * row_bytes;
        if (bf16)
            argmax_row(row, vocab, 1, best + r, ids + r);
        else
            argmax_row(row, vocab, 0, best + r, ids + r);
    }
}

/* Weights below e^-87 of the row's largest are 0: exp16 clamps there (a masked token's -inf
 * would otherwise weigh e^-87, and a uniform of 0 would draw it). */
#define NEGLIGIBLE -87.0f
#define BLOCK 256 /* weights a partial sum covers */

/* w = the row divided by its temperature t in float32, as torch divides it; returns w's
 * largest value, NaN where the row holds one. */
static float scale_row(const char *row, int n, const int bf16, float t, float *w) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += 16) {
        const __mmask16 keep = below(n, i);
        const __m512 v = _mm512_div_ps(load16(row + (int64_t)i * (bf16 ? 2 : 4), keep, bf16),
                                       _mm512_set1_ps(t));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
        _mm512_mask_storeu_ps(w + i, keep, v);
    }
    return nan ? NAN : _mm512_reduce_max_ps(top);
}

/* w = exp(w - m) in place, 0 where negligible; sums[b]: the float64 sum of block b's. */
static void weigh(float *w, int n, float m, double *sums) {
    for (int b0 = 0; b0 < n; b0 += BLOCK) {
        __m512d acc = _mm512_setzero_pd();
        for (int i = b0; i < b0 + BLOCK && i < n; i += 16) {
            const __mmask16 keep = below(n, i);
            const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(keep, w + i), _mm512_set1_ps(m));
            const __mmask16 real = keep & _mm512_cmp_ps_mask(d, _mm512_set1_ps(NEGLIGIBLE), _CMP_GT_OQ);
            const __m512 e = _mm512_maskz_mov_ps(real, exp16(d));
            _mm512_mask_storeu_ps(w + i, keep, e);
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        }
        sums[b0 / BLOCK] = _mm512_reduce_add_pd(acc);
    }
}

/* The first index whose running sum of weights exceeds u times their total: the block where
 * the blocks' running sum first does, then its weights one by one from that block's start.
 * Summed in another order than the block's sum, the crossing may not come within the block:
 * then its last weighted index (it holds one: its sum is positive); with no block crossing
 * (u a rounding short of 1), the row's last. A weight of 0 is never drawn. */
static int64_t draw_row(float *w, int n, float m, double u, double *sums) {
    weigh(w, n, m, sums);
    const int blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int b = 0; b < blocks; b++) total += sums[b];
    const double target = u * total;
    double before = 0.0;
    int b = 0;
    while (b < blocks && (sums[b] == 0.0 || before + sums[b] <= target)) before += sums[b++];
    if (b == blocks) b = blocks - 1, before = -INFINITY; /* the scan below keeps the last */
    while (sums[b] == 0.0) b--;
    int last = b * BLOCK;
    const int end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
    for (int i = b * BLOCK; i < end; i++) {
        if (w[i] == 0.0f) continue;
        before += w[i], last = i;
        if (before > target) return i;
    }
    return last;
}

/* A draw from each row's softmax at its temperature (temps [rows], or NULL for 1), with
 * uniforms [rows] in [0, 1) (the row's own generator's), into ids [rows]; best [rows]: the
 * largest logit over the temperature (NaN where the row holds a NaN), and where that is not
 * finite, nothing is drawn (id -1). Logits float32 or bfloat16, rows `stride` elements
 * apart. A row's token depends on its own logits, temperature and uniform alone. */
void draw_rows(const void *logits, int64_t stride, int rows, int vocab, int bf16,
               const float *temps, const double *uniforms, int threads, float *best,
               int64_t *ids) {
    const int64_t row_bytes = stride * (bf16 ? 2 : 4);
#pragma omp parallel num_threads(threads) if ((int64_t)rows * vocab > PARALLEL_WORK)
    {
        float *w = alloc64(sizeof(float) * (size_t)vocab);
        double *sums = malloc(sizeof(double) * (size_t)(vocab / BLOCK + 1));
#pragma omp for
        for (int r = 0; r < rows; r++) {
            const char *row = (const char *)logits + r * row_bytes;
            const float t = temps ? temps[r] : 1.0f;
            best[r] = bf16 ? scale_row(row, vocab, 1, t, w) : scale_row(row, vocab, 0, t, w);
            ids[r] = isfinite(best[r]) ? draw_row(w, vocab, best[r], uniforms[r], sums) : -1;
        }
        free(sums);
        free(w);
    }
}
#endif

/* Greedy sampling's argmax, read from the logits in the model's dtype.
 *
 * torch's route for a bfloat16 step was a float32 copy of every row and then max(dim=-1) on
 * one thread: 1.7 ms at 64 rows of the default model's 49,152-token vocabulary on an Emerald
 * Rapids core, a twentieth of the whole decode step. Here each row is read once, sixteen
 * lanes at a time, by as many threads as there are rows to share. The answer is torch's:
 * the first index of the largest value, and NaN for a row that holds one (max propagates it).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>

#include "kernels.h"

#define PARALLEL_WORK 131072 /* logits below which one thread reads them all */

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
        const __mmask16 keep = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
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
#endif

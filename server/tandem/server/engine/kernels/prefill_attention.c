/* Prefill attention: each query token of one sequence attends to the keys up to its own
 * position, every head, over the step's own K and V (or a sequence's gathered pages). PyTorch's
 * CPU flash attention ran these at 85-135 GFLOP/s on two Zen 4 cores; a long prompt's prefill
 * spent as long in attention as in its linears. This runs bfloat16 at 210-270 GFLOP/s
 * (`vdpbf16ps`, 32 products an instruction) and float32 at 95-165.
 *
 * K and V are first repacked per KV head so that both products run with lanes along a
 * contiguous axis: keys transposed, KEY_BLOCK at a time (lane = key; in bfloat16 a word holds
 * two dimensions of a key, the pairs `vdpbf16ps` multiplies), values in rows (lane =
 * dimension; in bfloat16 a word holds one dimension of two neighbouring keys). A thread takes
 * a chunk of one head's query rows and walks the key blocks, flash-attention style, so each
 * block's K and V stay in cache for all the chunk's rows: per block, scores (up to four rows
 * share each load), a running softmax in float32 (max and sum, the rows' value sums rescaled
 * when the max rises), the unnormalised probabilities in the model's dtype (in bfloat16
 * rounded, as torch's flash attention rounds them), and their product with V in float32; the
 * sum divides once at the end. In bfloat16 its output is within one step of SDPA's (84-100 %
 * of the values the same bits on the shapes tested).
 * Its reference is attention in float64 (tests/engine/test_cpu_kernels.py).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "vector16.h"

#define INLINE static inline __attribute__((always_inline))
#define KEYS 16
#define MAX_ROWS 4
#define KEY_BLOCK 128 /* keys whose packed K and V a chunk of rows walks through at once */
#define CHUNK 64      /* query rows of one head a thread takes at a time */
#define MAX_CHUNKS 16 /* head_dim up to 256 */

/* Whether bfloat16 tensors may be passed (the CPU has AVX512-BF16): read by kernels/ops.py. */
const int prefill_attention_bf16 = HAVE_DPBF16;

/* Where word (bfloat16) or float c of key j lies in a head's packed keys: KEY_BLOCK keys at a
 * time, each block [words][KEY_BLOCK], so a block is contiguous (rows of all keys, as long as
 * the prompt and a power of two apart, fell on the same cache sets). */
INLINE int64_t key_at(int c, int j, int words) {
    return ((int64_t)(j / KEY_BLOCK) * words + c) * KEY_BLOCK + j % KEY_BLOCK;
}

/* One KV head's keys as blocks of [dim / 2][KEY_BLOCK] words and values as [keys / 2][dim]
 * words (bfloat16), or as [dim][KEY_BLOCK] and [keys][dim] floats (float32); padding zero. */
static void pack(const char *k, const char *v, int64_t stride, int len, int padded, int dim,
                 int bf16, void *kt, void *vp) {
    memset(kt, 0, sizeof(float) * (size_t)padded * dim);
    memset(vp, 0, sizeof(float) * (size_t)padded * dim);
    for (int j = 0; j < len; j++) {
        if (bf16) {
            const uint32_t *kw = (const uint32_t *)(k + j * stride * 2);
            for (int p = 0; p < dim / 2; p++) ((uint32_t *)kt)[key_at(p, j, dim / 2)] = kw[p];
            const uint16_t *vr = (const uint16_t *)(v + j * stride * 2);
            uint16_t *half = (uint16_t *)((uint32_t *)vp + (int64_t)(j / 2) * dim) + (j & 1);
            for (int d = 0; d < dim; d++) half[2 * d] = vr[d];
        } else {
            const float *kr = (const float *)(k + j * stride * 4);
            for (int d = 0; d < dim; d++) ((float *)kt)[key_at(d, j, dim)] = kr[d];
            memcpy((float *)vp + (int64_t)j * dim, v + j * stride * 4, sizeof(float) * dim);
        }
    }
}

/* Sixteen keys' scores for `rows` query rows (q rows q_stride elements apart). */
INLINE void scores16(const char *q, int64_t q_stride, const void *kt, int j0,
                     const int rows, const int dim, const int bf16, __m512 acc[MAX_ROWS]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    if (bf16) {
        for (int c = 0; c < dim / 2; c++) {
            __m512i keys = _mm512_loadu_si512((const uint32_t *)kt + key_at(c, j0, dim / 2));
            for (int r = 0; r < rows; r++)
                acc[r] = dot_pairs(acc[r], _mm512_set1_epi32(((const int32_t *)(q + r * q_stride * 2))[c]), keys);
        }
        return;
    }
    for (int d = 0; d < dim; d++) {
        __m512 keys = _mm512_loadu_ps((const float *)kt + key_at(d, j0, dim));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)(q + r * q_stride * 4))[d]),
                                     keys, acc[r]);
    }
}

/* Running softmax of one query row over the key blocks seen so far: max, sum, and the
 * weighted values (dim floats) it scales as the max rises. */
typedef struct {
    float max, sum;
} Running;

/* Keys j0 .. j0 + n - 1 for `rows` query rows (row 0 at `position`; keys after a row's
 * position masked): scores, the running max and sum moved on, the rows' value sums rescaled
 * (acc, rows `dim` floats apart), and the block's probabilities into p in the model's dtype
 * (unnormalised: the sum divides at the end), rows KEY_BLOCK apart. */
INLINE void block_probabilities(const char *q, int64_t q_stride, const void *kt, int j0, int n, int position, const int rows, const int dim,
                                const int bf16, float scale, Running *run, float *acc,
                                float *s, char *p) {
    const int elem = bf16 ? 2 : 4;
    __m512 maxv[MAX_ROWS];
    for (int r = 0; r < rows; r++) maxv[r] = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += KEYS) {
        __m512 dot[MAX_ROWS];
        scores16(q, q_stride, kt, j0 + j, rows, dim, bf16, dot);
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32(j0 + j), _mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (int r = 0; r < rows; r++) {
            __mmask16 seen = _mm512_cmple_epi32_mask(at, _mm512_set1_epi32(position + r));
            __m512 x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY),
                                            _mm512_mul_ps(dot[r], _mm512_set1_ps(scale)));
            _mm512_storeu_ps(s + r * KEY_BLOCK + j, x);
            maxv[r] = _mm512_max_ps(maxv[r], x);
        }
    }
    for (int r = 0; r < rows; r++) {
        float top = _mm512_reduce_max_ps(maxv[r]);
        if (top < run[r].max) top = run[r].max;
        __m512 m = _mm512_set1_ps(top), total = _mm512_setzero_ps();
        for (int j = 0; j < n; j += KEYS) {
            __m512 x = _mm512_loadu_ps(s + r * KEY_BLOCK + j);
            __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, m)));
            total = _mm512_add_ps(total, e);
            store16(p + ((int64_t)r * KEY_BLOCK + j) * elem, e, bf16);
        }
        float alpha = run[r].max == -INFINITY ? 0.0f : exp_approx(run[r].max - top);
        run[r].sum = run[r].sum * alpha + _mm512_reduce_add_ps(total);
        run[r].max = top;
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + r * dim + d,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), _mm512_set1_ps(alpha)));
    }
}

/* acc rows += p (rows x n keys) times the packed values of keys j0 .. j0 + n - 1. */
INLINE void block_values(const char *p, const void *vp, int j0, int n, const int rows,
                         const int chunks, const int bf16, float *acc) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4;
    __m512 sum[MAX_ROWS][MAX_CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) sum[r][c] = _mm512_loadu_ps(acc + r * dim + c * 16);
    for (int j = 0; j < n; j += 1 + bf16) { /* bfloat16: a word holds keys j and j + 1 */
        const char *row = (const char *)vp + (int64_t)((j0 + j) >> bf16) * dim * 4;
        __m512 v[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = _mm512_loadu_ps(row + c * 64);
        for (int r = 0; r < rows; r++) {
            const char *pr = p + ((int64_t)r * KEY_BLOCK + j) * elem;
            for (int c = 0; c < chunks; c++)
                sum[r][c] = bf16 ? dot_pairs(sum[r][c], _mm512_set1_epi32(*(const int32_t *)pr), _mm512_castps_si512(v[c]))
                                 : _mm512_fmadd_ps(_mm512_set1_ps(*(const float *)pr), v[c], sum[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + r * dim + c * 16, sum[r][c]);
}

/* Rows of one head against one key block, inlined for the common shapes. */
static void rows_block(const char *q, int64_t q_stride, const void *kt, const void *vp, int j0, int n, int position, int rows, int chunks, int bf16,
                       float scale, Running *run, float *acc, float *s, char *p) {
#define BLOCK(R, C, B)                                                                         \
    if (rows == R && chunks == C && bf16 == B) {                                               \
        block_probabilities(q, q_stride, kt, j0, n, position, R, C * 16, B, scale,            \
                            run, acc, s, p);                                                   \
        block_values(p, vp, j0, n, R, C, B, acc);                                              \
        return;                                                                                \
    }
    BLOCK(4, 4, 1) BLOCK(2, 8, 1) BLOCK(4, 4, 0) BLOCK(2, 8, 0)
#undef BLOCK
    const int elem = bf16 ? 2 : 4, dim = chunks * 16;
    for (int r = 0; r < rows; r++) {
        block_probabilities(q + r * q_stride * elem, q_stride, kt, j0, n, position + r,
                            1, dim, bf16, scale, run + r, acc + r * dim, s, p);
        block_values(p, vp, j0, n, 1, chunks, bf16, acc + r * dim);
    }
}

/* Query rows i0 .. i0 + rows - 1 of one head (row 0 at `position`), key block by key block:
 * the packed K and V of a block stay in cache for every row of the chunk. */
static void rows_chunk(const char *q, int64_t q_stride, const void *kt, const void *vp,
                       int position, int rows, int chunks, int bf16, float scale,
                       Running *run, float *acc, float *s, char *p, char *out,
                       int64_t out_stride) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4, block = chunks <= 4 ? 4 : 2;
    for (int r = 0; r < rows; r++) run[r] = (Running){-INFINITY, 0.0f};
    memset(acc, 0, sizeof(float) * (size_t)rows * dim);
    int keys = (position + rows - 1 + KEYS) / KEYS * KEYS; /* through the last row's key */
    for (int j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
        int n = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
        for (int r0 = 0; r0 < rows; r0 += block) {
            if (position + r0 + block - 1 < j0) continue; /* a row sees none of the block */
            int part = rows - r0 < block ? rows - r0 : block;
            rows_block(q + (int64_t)r0 * q_stride * elem, q_stride, kt, vp, j0, n,
                       position + r0, part, chunks, bf16, scale, run + r0, acc + r0 * dim, s, p);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / run[r].sum);
        for (int d = 0; d < dim; d += 16)
            store16(out + (r * out_stride + d) * elem,
                    _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), inv), bf16);
    }
}

/* q, out: [q_len, heads, dim] rows q_stride and out_stride elements apart; k, v: [kv_len,
 * kv_heads, dim] rows kv_stride apart; query i sits at position kv_len - q_len + i and attends
 * to keys 0 .. that position. bf16: 1 for bfloat16 tensors (this library built with
 * AVX512-BF16), 0 for float32. dim: a multiple of 32, at most 16 * MAX_CHUNKS. */
void prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                       int64_t kv_stride, void *out, int64_t out_stride, int q_len, int kv_len,
                       int heads, int kv_heads, int dim, float scale, int bf16, int threads) {
    const int group = heads / kv_heads, chunks = dim / 16, elem = bf16 ? 2 : 4;
    const int padded = (kv_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, offset = kv_len - q_len;
    /* chunks of at most CHUNK rows, at least eight a head (a short prompt's few chunks, the
     * later ones much costlier, would leave a thread idle), a multiple of four rows */
    const int chunk = q_len / 8 / 4 * 4 < 4 ? 4 : (q_len / 8 / 4 * 4 > CHUNK ? CHUNK : q_len / 8 / 4 * 4);
    const int parts = (q_len + chunk - 1) / chunk;
    const size_t packed = sizeof(float) * (size_t)padded * dim; /* bytes per head */
    char *kt = malloc(packed * kv_heads), *vp = malloc(packed * kv_heads);
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * MAX_ROWS * KEY_BLOCK);
        char *p = malloc(sizeof(float) * MAX_ROWS * KEY_BLOCK);
        float *acc = malloc(sizeof(float) * CHUNK * (size_t)dim);
        Running *run = malloc(sizeof(Running) * CHUNK);
#pragma omp for
        for (int h = 0; h < kv_heads; h++)
            pack((const char *)k + (int64_t)h * dim * elem, (const char *)v + (int64_t)h * dim * elem,
                 kv_stride, kv_len, padded, dim, bf16, kt + packed * h, vp + packed * h);
        /* the last rows attend to the most keys: handed out first */
#pragma omp for schedule(dynamic)
        for (int item = 0; item < heads * parts; item++) {
            int head = item % heads, i0 = (parts - 1 - item / heads) * chunk;
            int rows = q_len - i0 < chunk ? q_len - i0 : chunk, h = head / group;
            rows_chunk((const char *)q + ((int64_t)i0 * q_stride + head * dim) * elem, q_stride,
                       kt + packed * h, vp + packed * h, offset + i0, rows, chunks, bf16,
                       scale, run, acc, s, p,
                       (char *)out + ((int64_t)i0 * out_stride + head * dim) * elem, out_stride);
        }
        free(s);
        free(p);
        free(acc);
        free(run);
    }
    free(kt);
    free(vp);
}
#endif

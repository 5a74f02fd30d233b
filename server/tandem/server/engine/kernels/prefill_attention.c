/* Prefill attention: each query token of one sequence attends to the keys up to its own
 * position, every head, over the step's own K and V (or a sequence's gathered pages). PyTorch's
 * CPU flash attention ran these at 85-135 GFLOP/s on two Zen 4 cores; a long prompt's prefill
 * spent as long in attention as in its linears. This runs bfloat16 at 210-270 GFLOP/s
 * (`vdpbf16ps`, 32 products an instruction) and float32 at 190-225 (eight rows by 32 keys
 * a step: four rows by sixteen keys, four chains of FMAs, had run at 140-160).
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
 * of the values the same bits on the shapes tested). Where the CPU has AMX (Sapphire Rapids
 * and later), bfloat16 prompts of 16 rows or more take both products as tile products, sixteen
 * query rows a block: 1.6-2.2x the dot pairs on two Emerald Rapids cores. There each row's
 * probabilities are taken against a reference max that moves only when a score rises well
 * above it (RISE), so one pass over the scores does; and for head sizes up to 64 sixteen rows
 * walk all their keys as one pipeline of 32-key steps, the tile products of the next step
 * issued while the vectors take this one's exponentials: 1.3x (512 rows) to 1.75x (3,072).
 * Its reference is attention in float64 (tests/engine/test_cpu_kernels.py).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "convert.h"
#include "kernels.h"
#include "vector16.h"

#define INLINE static inline __attribute__((always_inline))
#define KEYS 16
#define MAX_ROWS 4
/* float32 query rows a block (head sizes up to 64) and vectors of keys a step: six rows by 64
 * keys (24 chains of FMAs, a load of keys or values shared by six rows, a broadcast of q or p by
 * four vectors) ran 1.05-1.1x eight by 32 on one core of an AMX Xeon (KVM model 167). */
#define F32_ROWS 6
#define F32_WIDE 4
#define KEY_BLOCK 128 /* keys whose packed K and V a chunk of rows walks through at once */
#define CHUNK 64      /* query rows of one head a thread takes at a time */
#define MAX_CHUNKS 16 /* head_dim up to 256 */
#define LOG2E 1.44269504088896341f
/* The fewest rows (a chunk's last, fewer than sixteen) that take the AMX pipeline as sixteen,
 * padded with zero rows: below it dot pairs cost less (about 2.5x the pipelined tiles' time a
 * row, bfloat16 on Emerald Rapids). */
#define PADDED_ROWS 6

/* Whether bfloat16 tensors may be passed (the CPU has AVX512-BF16): read by kernels/ops.py. */
const int prefill_attention_bf16 = HAVE_DPBF16;

/* Where word (bfloat16) or float c of key j lies in a head's packed keys: KEY_BLOCK keys at a
 * time, each block [words][KEY_BLOCK], so a block is contiguous (rows of all keys, as long as
 * the prompt and a power of two apart, fell on the same cache sets). */
INLINE int64_t key_at(int c, int j, int words) {
    return ((int64_t)(j / KEY_BLOCK) * words + c) * KEY_BLOCK + j % KEY_BLOCK;
}

/* Key j's row of K and of V into one KV head's packed keys (blocks of [dim / 2][KEY_BLOCK]
 * words in bfloat16, [dim][KEY_BLOCK] floats in float32) and values ([keys / 2][dim] words,
 * [keys][dim] floats). */
INLINE void pack_row(const char *k, const char *v, int j, int dim, int bf16, void *kt, void *vp) {
    if (bf16) {
        const uint32_t *kw = (const uint32_t *)k;
        for (int p = 0; p < dim / 2; p++) ((uint32_t *)kt)[key_at(p, j, dim / 2)] = kw[p];
        const uint16_t *vr = (const uint16_t *)v;
        uint16_t *half = (uint16_t *)((uint32_t *)vp + (int64_t)(j / 2) * dim) + (j & 1);
        for (int d = 0; d < dim; d++) half[2 * d] = vr[d];
    } else {
        const float *kr = (const float *)k;
        for (int d = 0; d < dim; d++) ((float *)kt)[key_at(d, j, dim)] = kr[d];
        memcpy((float *)vp + (int64_t)j * dim, v, sizeof(float) * dim);
    }
}

/* Keys j .. j + 15 (j a multiple of 16; rows `stride` elements apart from k and v) packed as
 * pack_row packs them: K's words sixteen keys by sixteen words transposed, V's pairs of
 * bfloat16 rows interleaved by a two-source permute. */
static void pack16(const char *k, const char *v, int64_t stride, int j, int dim, int bf16,
                   void *kt, void *vp) {
    const int64_t elem = bf16 ? 2 : 4, words = bf16 ? dim / 2 : dim;
    for (int c0 = 0; c0 < words; c0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(k + i * stride * elem + c0 * 4);
        transpose16(r);
        for (int c = 0; c < 16; c++)
            _mm512_storeu_si512((uint32_t *)kt + key_at(c0 + c, j, words), r[c]);
    }
    if (!bf16) {
        for (int i = 0; i < 16; i++) memcpy((float *)vp + (int64_t)(j + i) * dim, v + i * stride * 4, sizeof(float) * dim);
        return;
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < 16; i += 2) {
        const char *a = v + i * stride * 2, *b = a + stride * 2;
        uint32_t *pairs = (uint32_t *)vp + (int64_t)(j + i) / 2 * dim;
        for (int d = 0; d < dim; d += 32) {
            const __m512i x = _mm512_loadu_si512(a + d * 2), y = _mm512_loadu_si512(b + d * 2);
            _mm512_storeu_si512(pairs + d, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(pairs + d + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* What pack_row leaves unwritten past `len` keys, zero: packed K's last block and packed V's
 * rows after the last key (the walks run whole tiles past it). */
static void pack_padding(int len, int padded, int dim, int bf16, void *kt, void *vp) {
    const int64_t words = bf16 ? dim / 2 : dim, last = len / KEY_BLOCK * KEY_BLOCK;
    memset((uint32_t *)kt + last * words, 0, sizeof(uint32_t) * (size_t)((padded - last) * words));
    const int64_t from = bf16 ? (int64_t)(len / 2) * dim : (int64_t)len * dim;
    const int64_t to = bf16 ? (int64_t)padded / 2 * dim : (int64_t)padded * dim;
    memset((uint32_t *)vp + from, 0, sizeof(uint32_t) * (size_t)(to - from));
}

/* One KV head's `len` keys and values, rows `stride` elements apart, packed; padding zero. */
static void pack(const char *k, const char *v, int64_t stride, int len, int padded, int dim,
                 int bf16, void *kt, void *vp) {
    const int64_t elem = bf16 ? 2 : 4;
    pack_padding(len, padded, dim, bf16, kt, vp);
    int j = 0;
    for (; j + 16 <= len; j += 16) pack16(k + j * stride * elem, v + j * stride * elem, stride, j, dim, bf16, kt, vp);
    for (; j < len; j++) pack_row(k + j * stride * elem, v + j * stride * elem, j, dim, bf16, kt, vp);
}

/* Sixteen keys' scores for `rows` query rows (q rows q_stride elements apart). */
INLINE void scores16(const char *q, int64_t q_stride, const void *kt, int j0,
                     const int rows, const int dim, const int bf16, __m512 acc[F32_ROWS]) {
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

/* float32: 16 * `wide` keys' scores (j0 a multiple of that within its block) for `rows` query
 * rows, `wide` vectors of keys a row: rows x wide independent FMA chains, each broadcast of q
 * and each load of keys shared by as many products as the registers hold. */
INLINE void scores_wide(const char *q, int64_t q_stride, const float *kt, int j0, const int rows,
                        const int wide, const int dim, __m512 acc[F32_ROWS][F32_WIDE]) {
    for (int r = 0; r < rows; r++)
        for (int w = 0; w < wide; w++) acc[r][w] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int d = 0; d < dim; d++) {
        const float *at = kt + key_at(d, j0, dim);
        __m512 keys[F32_WIDE];
        for (int w = 0; w < wide; w++) keys[w] = _mm512_loadu_ps(at + 16 * w);
        for (int r = 0; r < rows; r++) {
            const __m512 b = _mm512_set1_ps(((const float *)(q + r * q_stride * 4))[d]);
            for (int w = 0; w < wide; w++) acc[r][w] = _mm512_fmadd_ps(b, keys[w], acc[r][w]);
        }
    }
}

/* Running softmax of one query row over the key blocks seen so far: max (in the AMX rows, the
 * reference the probabilities are taken against: within RISE of the max), the probabilities'
 * sum against it, and the weighted values (dim floats) it scales as it rises. */
typedef struct {
    float max, sum;
} Running;

/* One row's raw masked scores s (n keys; -inf where masked) after its running softmax (`top`:
 * their max): the running max and sum (in scaled units) moved on, the row's value sums (acc)
 * rescaled, and its unnormalised probabilities exp(scale * (s - top)) into p in the model's
 * dtype, taken as 2^(s * scale * log2 e - top * scale * log2 e): one FMA into exp2_16's
 * argument, no pass to scale the scores first. */
INLINE void row_softmax(const float *s, int n, float top, float scale, const int dim,
                        const int bf16, Running *run, float *acc, char *p) {
    const int elem = bf16 ? 2 : 4;
    top *= scale;
    if (top < run->max) top = run->max;
    const __m512 c = _mm512_set1_ps(scale * LOG2E), m = _mm512_set1_ps(top * LOG2E);
    __m512 total = _mm512_setzero_ps();
    for (int j = 0; j < n; j += KEYS) {
        __m512 e = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), c, m));
        total = _mm512_add_ps(total, e);
        store16(p + (int64_t)j * elem, e, bf16);
    }
    if (top > run->max) { /* the max rose: what came before shrinks (by exactly 1 it stays) */
        const float alpha = run->max == -INFINITY ? 0.0f : exp_approx(run->max - top);
        run->sum *= alpha;
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(alpha)));
    }
    run->sum += _mm512_reduce_add_ps(total);
    run->max = top;
}

/* Keys j0 .. j0 + n - 1 for `rows` query rows (row r at `position` + r * `rise`; keys after
 * a row's position masked): scores, the running max and sum moved on, the rows' value sums rescaled
 * (acc, rows `dim` floats apart), and the block's probabilities into p in the model's dtype
 * (unnormalised: the sum divides at the end), rows KEY_BLOCK apart. */
INLINE void block_probabilities(const char *q, int64_t q_stride, const void *kt, int j0, int n, int position, int rise, const int rows, const int dim,
                                const int bf16, float scale, Running *run, float *acc,
                                float *s, char *p) {
    const int elem = bf16 ? 2 : 4;
    __m512 maxv[F32_ROWS];
    for (int r = 0; r < rows; r++) maxv[r] = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n;) {
        __m512 dot[F32_ROWS][F32_WIDE];
        const int wide = bf16 ? 1 : n - j >= F32_WIDE * KEYS ? F32_WIDE : n - j >= 2 * KEYS ? 2 : 1;
        if (wide == F32_WIDE)
            scores_wide(q, q_stride, (const float *)kt, j0 + j, rows, F32_WIDE, dim, dot);
        else if (wide == 2)
            scores_wide(q, q_stride, (const float *)kt, j0 + j, rows, 2, dim, dot);
        else {
            __m512 one[F32_ROWS];
            scores16(q, q_stride, kt, j0 + j, rows, dim, bf16, one);
            for (int r = 0; r < rows; r++) dot[r][0] = one[r];
        }
        if (j0 + j + wide * KEYS - 1 <= position) { /* every row sees every key */
            for (int w = 0; w < wide; w++, j += KEYS)
                for (int r = 0; r < rows; r++) {
                    _mm512_storeu_ps(s + r * KEY_BLOCK + j, dot[r][w]);
                    maxv[r] = _mm512_max_ps(maxv[r], dot[r][w]);
                }
            continue;
        }
        for (int w = 0; w < wide; w++, j += KEYS) {
            __m512i at = _mm512_add_epi32(_mm512_set1_epi32(j0 + j), _mm512_setr_epi32(
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            for (int r = 0; r < rows; r++) {
                __mmask16 seen = _mm512_cmple_epi32_mask(at, _mm512_set1_epi32(position + r * rise));
                __m512 x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), dot[r][w]);
                _mm512_storeu_ps(s + r * KEY_BLOCK + j, x);
                maxv[r] = _mm512_max_ps(maxv[r], x);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        row_softmax(s + r * KEY_BLOCK, n, _mm512_reduce_max_ps(maxv[r]), scale, dim, bf16,
                    run + r, acc + r * dim, p + (int64_t)r * KEY_BLOCK * elem);
}

/* acc rows (dim floats apart) += p (rows x n keys) times the packed values of keys j0 .. j0 + n
 * - 1, `chunks` sixteen dimensions of them from where vp and acc point. */
INLINE void block_values(const char *p, const void *vp, int j0, int n, const int rows,
                         const int chunks, const int dim, const int bf16, float *acc) {
    const int elem = bf16 ? 2 : 4;
    __m512 sum[F32_ROWS][MAX_CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) sum[r][c] = _mm512_loadu_ps(acc + r * dim + c * 16);
#pragma GCC unroll 2
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

#if HAVE_AMX
/* AMX (amx.h): in bfloat16, sixteen query rows of a head at a time meet a key block as tile
 * products, q times the packed keys and the probabilities times the packed
 * values: the packing above is already the tiles' pair layout (a key's two dimensions in a
 * word for q.k, two keys' values of a dimension in a word for p.v). Tiles: 0-3 accumulate,
 * 4 holds A, 5 and 6 B; every tile 16 rows of 64 bytes. */
#define AMX_ROWS 16

/* Sixteen rows' raw scores against keys j0 .. j0 + n - 1 (n a multiple of 16) into s, rows
 * KEY_BLOCK floats apart. */
static void amx_scores(const char *q, int64_t q_stride, const uint32_t *kt, int j0, int n,
                       int dim, float *s) {
    const uint32_t *block = kt + key_at(0, j0, dim / 2);
    for (int g = 0; g < n; g += 32) {
        const int two = g + 16 < n;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < dim / 32; c++) {
            _tile_loadd(4, q + c * 64, q_stride * 2);
            _tile_loadd(5, block + (int64_t)c * 16 * KEY_BLOCK + g, KEY_BLOCK * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (two) {
                _tile_loadd(6, block + (int64_t)c * 16 * KEY_BLOCK + g + 16, KEY_BLOCK * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
        }
        _tile_stored(0, s + g, KEY_BLOCK * 4);
        if (two) _tile_stored(1, s + g + 16, KEY_BLOCK * 4);
    }
}

/* acc (16 rows, dim floats apart) += p (16 rows of n bfloat16 probabilities, KEY_BLOCK apart,
 * zero from n to the next 32) times the packed values of keys j0 .. j0 + n - 1. */
static void amx_values(const char *p, const char *vp, int j0, int n, int dim, float *acc,
                       float *part) {
    for (int d0 = 0; d0 < dim; d0 += 64) {
        const int tiles = (dim - d0) / 16 < 4 ? (dim - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int j = 0; j < n; j += 32) {
            const char *v = vp + (int64_t)((j0 + j) / 2) * dim * 4 + d0 * 4;
            _tile_loadd(4, p + j * 2, KEY_BLOCK * 2);
            _tile_loadd(5, v, dim * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, v + 64, dim * 4);
            _tile_dpbf16ps(1, 4, 6);
            if (tiles > 2) {
                _tile_loadd(5, v + 128, dim * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, v + 192, dim * 4);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, part + d0, dim * 4);
        _tile_stored(1, part + d0 + 16, dim * 4);
        if (tiles > 2) {
            _tile_stored(2, part + d0 + 32, dim * 4);
            _tile_stored(3, part + d0 + 48, dim * 4);
        }
    }
    for (int i = 0; i < AMX_ROWS * dim; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(part + i)));
}

/* How far (log2 units) a row's scores may rise above the reference its probabilities are
 * taken against before the reference moves: a probability then reaches at most 2^RISE, which
 * bfloat16 and the float32 sums hold with room to spare, and a max that creeps up block by block
 * costs neither a rescale of the value sums nor a pass over the scores for the max alone. */
#define RISE 8.0f

/* Score j .. j + 15 of a row whose last key is `last` (-inf past it); at0: the block's key
 * indices j0 + 0 .. 15. */
INLINE __m512 masked16(const float *row, int j, int j0, int last, __m512i at0) {
    __m512 x = _mm512_loadu_ps(row + j);
    if (j0 + j + KEYS - 1 <= last) return x;
    __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_add_epi32(at0, _mm512_set1_epi32(j)),
                                             _mm512_set1_epi32(last));
    return _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
}

/* One row's masked probabilities 2^((s * scale - ref) * log2 e) against the reference ref
 * (scaled units) into p in bfloat16 and their float32 sum into *total, in one pass; returns the
 * row's max raw score. */
INLINE float row_against(const float *row, int n, int j0, int last, __m512i at0, float scale,
                         float ref, __m512 *total, char *p) {
    const __m512 c = _mm512_set1_ps(scale * LOG2E), m = _mm512_set1_ps(ref * LOG2E);
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += KEYS) {
        __m512 x = masked16(row, j, j0, last, at0);
        top = _mm512_max_ps(top, x);
        __m512 e = exp2_bf16(_mm512_fmsub_ps(x, c, m));
        sum = _mm512_add_ps(sum, e);
        store16(p + j * 2, e, 1);
    }
    *total = sum;
    return _mm512_reduce_max_ps(top);
}

/* Sixteen rows' probabilities of one key block (scores s, rows KEY_BLOCK apart; row r's last key
 * `position` + r * `rise`) into p in bfloat16, zero from n to the next 32 keys, each against its
 * running reference (run->max; the sums are relative to it). A row's first block, or one whose
 * max rises more than RISE above the reference, moves the reference to its max (the row's value
 * sums, acc, rescaled) and is taken again. */
static void amx_probabilities(int j0, int n, int position, int rise, int dim, float scale,
                              Running *run, float *acc, const float *s, char *p) {
    const __m512i at0 = _mm512_add_epi32(_mm512_set1_epi32(j0), _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const int padded = (n + 31) / 32 * 32;
    for (int r = 0; r < AMX_ROWS; r++) {
        const float *row = s + r * KEY_BLOCK;
        const int last = position + r * rise;
        char *pr = p + (int64_t)r * KEY_BLOCK * 2;
        Running *u = run + r;
        float ref = u->max;
        if (ref == -INFINITY) { /* the row's first block: its own max */
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < n; j += KEYS) top = _mm512_max_ps(top, masked16(row, j, j0, last, at0));
            ref = _mm512_reduce_max_ps(top) * scale;
        }
        __m512 total;
        const float top = row_against(row, n, j0, last, at0, scale, ref, &total, pr) * scale;
        if (top > ref + RISE / LOG2E) {
            ref = top;
            row_against(row, n, j0, last, at0, scale, ref, &total, pr);
        }
        if (ref != u->max && u->max != -INFINITY) {
            const float alpha = exp_approx(u->max - ref);
            u->sum *= alpha;
            for (int d = 0; d < dim; d += 16)
                _mm512_storeu_ps(acc + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), _mm512_set1_ps(alpha)));
        }
        u->max = ref;
        u->sum += _mm512_reduce_add_ps(total);
        if (padded > n) memset(pr + n * 2, 0, (size_t)(padded - n) * 2);
    }
}

/* Sixteen rows of one head (row r at `position` + r * `rise`) against one key block, in
 * bfloat16. */
static void amx_rows_block(const char *q, int64_t q_stride, const void *kt, const void *vp,
                           int j0, int n, int position, int rise, int dim, float scale, Running *run,
                           float *acc, float *s, char *p, float *part) {
    amx_scores(q, q_stride, kt, j0, n, dim, s);
    amx_probabilities(j0, n, position, rise, dim, scale, run, acc, s, p);
    amx_values(p, vp, j0, n, dim, acc, part);
}

/* Sixteen rows against a key block, for head sizes up to 64, as a pipeline over steps of 32 keys:
 * the tile products of the next step's scores and of the step before's p.v are issued while the
 * vector units take this step's exponentials. One after the other (amx_rows_block), each side
 * waited at every hand-over of a block (tile stores the vectors read, vector stores the tiles
 * load): two-thirds of the cycles of the same work pipelined (1,830 against 2,850 a block on an
 * Emerald Rapids core). Tiles: 0-3 the rows' value sums for the whole block, 4-5 a step's
 * scores, 6 A, 7 B. */
#define STEP 32

/* The value-sum tiles (dim 32 or 64: two or four) out to acc (16 rows, dim floats apart) or in
 * from it. */
INLINE void sums_out(float *acc, int dim) {
    _tile_stored(0, acc, dim * 4);
    _tile_stored(1, acc + 16, dim * 4);
    if (dim > 32) {
        _tile_stored(2, acc + 32, dim * 4);
        _tile_stored(3, acc + 48, dim * 4);
    }
}
INLINE void sums_in(const float *acc, int dim) {
    _tile_loadd(0, acc, dim * 4);
    _tile_loadd(1, acc + 16, dim * 4);
    if (dim > 32) {
        _tile_loadd(2, acc + 32, dim * 4);
        _tile_loadd(3, acc + 48, dim * 4);
    }
}

/* What one step hands the tile unit beside its probabilities: the next step's scores (none
 * when width is 0) and the previous step's p.v (none when p is NULL). */
typedef struct {
    const char *q;
    int64_t q_stride;
    const uint32_t *keys; /* the next step's first key in its block */
    int width;            /* the next step's keys: 0, 16 or 32 */
    float *s;             /* its scores, rows STEP apart */
    const char *p, *v;    /* the previous step's probabilities and its first key pair's values */
} TileWork;

/* Part i (0 .. 7) of a step's tile products: 0-3 the next step's scores (tiles 4-5; stored at
 * 3), 4-7 the previous step's p.v into the value sums (tiles 0-3). */
INLINE void tile_part(const int i, const TileWork *t, int dim) {
    const int chunk = i >> 1, half = i & 1;
    if (i < 4) {
        if (!t->width) return;
        const uint32_t *b = t->keys + (int64_t)chunk * 16 * KEY_BLOCK;
        if (i == 0) {
            _tile_zero(4);
            _tile_zero(5);
        }
        const int used = chunk < dim / 32; /* head size 32: one chunk of q */
        if (used && !half) {
            _tile_loadd(6, t->q + chunk * 64, t->q_stride * 2);
            _tile_loadd(7, b, KEY_BLOCK * 4);
            _tile_dpbf16ps(4, 6, 7);
        } else if (used && t->width > 16) {
            _tile_loadd(7, b + 16, KEY_BLOCK * 4);
            _tile_dpbf16ps(5, 6, 7);
        }
        if (i == 3) {
            _tile_stored(4, t->s, STEP * 4);
            if (t->width > 16) _tile_stored(5, t->s + 16, STEP * 4);
        }
        return;
    }
    if (!t->p || (i > 5 && dim <= 32)) return;
    if (i == 4) _tile_loadd(6, t->p, STEP * 2);
    _tile_loadd(7, t->v + (i - 4) * 64, dim * 4);
    if (i == 4) _tile_dpbf16ps(0, 6, 7);
    if (i == 5) _tile_dpbf16ps(1, 6, 7);
    if (i == 6) _tile_dpbf16ps(2, 6, 7);
    if (i == 7) _tile_dpbf16ps(3, 6, 7);
}

/* One row of a step: its probabilities against its reference into p and its sum; a row whose
 * scores rise more than RISE above the reference moves it and returns the factor its value
 * sums take once the step's tile work is issued (1 when none). */
INLINE float step_row(const float *row, int j, int width, int last, __m512i at0, __m512 c,
                      float scale, Running *u, __m512 *sum, char *p) {
    const __m512 x0 = masked16(row, 0, j, last, at0);
    const __m512 x1 = width > 16 ? masked16(row, 16, j, last, at0) : _mm512_set1_ps(-INFINITY);
    const __m512 top = _mm512_max_ps(x0, x1);
    float alpha = 1.0f;
    if (_mm512_cmp_ps_mask(top, _mm512_set1_ps((u->max + RISE / LOG2E) / scale), _CMP_GT_OQ)) {
        const float high = _mm512_reduce_max_ps(top) * scale;
        if (u->max != -INFINITY) {
            alpha = exp_approx(u->max - high);
            u->sum *= alpha;
            *sum = _mm512_mul_ps(*sum, _mm512_set1_ps(alpha));
        }
        u->max = high;
    }
    const __m512 m = _mm512_set1_ps(u->max * LOG2E);
    const __m512 e0 = exp2_bf16(_mm512_fmsub_ps(x0, c, m));
    const __m512 e1 = width > 16 ? exp2_bf16(_mm512_fmsub_ps(x1, c, m)) : _mm512_setzero_ps();
    *sum = _mm512_add_ps(*sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    return alpha;
}

/* A step's probabilities (16 rows of STEP keys from key j, row r's last key `last` + r * `rise`,
 * each against its reference) into p, zero past `width`, their sums into sums, with the tile
 * work's eight parts issued between its rows, two rows a part. Issued in one run before the
 * rows, the tile products held the reorder window and the vectors waited behind them (tiles
 * alone and vectors alone took 17.6 and 20.8 ms of a 4,096-token prompt's 30 on one core of an
 * AMX Xeon, KVM model 167; interleaved 27). A row whose reference moved has its value sums
 * scaled once every part is issued: the previous step's p.v was taken against the old
 * reference too. */
INLINE void step_interleaved(const float *s, int j, int width, int last, int rise, int dim,
                             float scale, Running *run, __m512 *sums, float *acc, char *p,
                             const TileWork *t) {
    const __m512i at0 = _mm512_add_epi32(_mm512_set1_epi32(j), _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512 c = _mm512_set1_ps(scale * LOG2E);
    float alpha[AMX_ROWS];
    int moved = 0;
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        for (int r = 2 * i; r < 2 * i + 2; r++) {
            alpha[r] = step_row(s + r * STEP, j, width, last + r * rise, at0, c, scale, run + r,
                                sums + r, p + r * STEP * 2);
            moved |= alpha[r] != 1.0f;
        }
        tile_part(i, t, dim);
    }
    if (!moved) return;
    sums_out(acc, dim);
    for (int r = 0; r < AMX_ROWS; r++)
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), _mm512_set1_ps(alpha[r])));
    sums_in(acc, dim);
}

/* Sixteen rows (row r at `position` + r * `rise`) against keys 0 .. n - 1, head size up to 64:
 * the pipeline above, one run through every key block (the value sums in the tiles
 * throughout). s, p: two steps' buffers each. */
static void amx_rows_pipelined(const char *q, int64_t q_stride, const void *kt, const void *vp,
                               int n, int position, int rise, int dim, float scale,
                               Running *run, float *acc, float *s, char *p) {
    const int steps = (n + STEP - 1) / STEP, sbuf = AMX_ROWS * STEP, pbuf = AMX_ROWS * STEP * 2;
    __m512 sums[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) sums[r] = _mm512_setzero_ps();
    sums_in(acc, dim);
    for (int g = -1; g < steps; g++) {
        const int next = (g + 1) * STEP, at = g * STEP;
        TileWork t = {q, q_stride, NULL, 0, s + ((g + 1) & 1) * sbuf, NULL, NULL};
        if (g + 1 < steps) {
            t.keys = (const uint32_t *)kt + key_at(0, next, dim / 2);
            t.width = n - next < STEP ? n - next : STEP;
        }
        if (g > 0) {
            t.p = p + ((g - 1) & 1) * pbuf;
            t.v = (const char *)vp + (int64_t)(at - STEP) / 2 * dim * 4;
        }
        if (g < 0) {
            for (int i = 0; i < 4; i++) tile_part(i, &t, dim);
            continue;
        }
        step_interleaved(s + (g & 1) * sbuf, at, n - at < STEP ? n - at : STEP, position, rise,
                         dim, scale, run, sums, acc, p + (g & 1) * pbuf, &t);
    }
    const TileWork last = {q, q_stride, NULL, 0, NULL, p + ((steps - 1) & 1) * pbuf,
                           (const char *)vp + (int64_t)(steps - 1) * STEP / 2 * dim * 4};
    for (int i = 4; i < 8; i++) tile_part(i, &last, dim);
    sums_out(acc, dim);
    for (int r = 0; r < AMX_ROWS; r++) run[r].sum += _mm512_reduce_add_ps(sums[r]);
}
#else
#define AMX_ROWS MAX_ROWS
static void amx_rows_block(const char *q, int64_t q_stride, const void *kt, const void *vp,
                           int j0, int n, int position, int rise, int dim, float scale,
                           Running *run, float *acc, float *s, char *p, float *part) {} /* never called */
static void amx_rows_pipelined(const char *q, int64_t q_stride, const void *kt, const void *vp,
                               int n, int position, int rise, int dim, float scale,
                               Running *run, float *acc, float *s, char *p) {} /* never called */
#endif

/* Rows of one head against one key block, inlined for the common shapes. */
static void rows_block(const char *q, int64_t q_stride, const void *kt, const void *vp, int j0, int n, int position, int rise, int rows, int chunks, int bf16,
                       float scale, Running *run, float *acc, float *s, char *p) {
#define BLOCK(R, C, B, PARTS)                                                                  \
    if (rows == R && chunks == C && bf16 == B) {                                               \
        block_probabilities(q, q_stride, kt, j0, n, position, rise, R, C * 16, B, scale,      \
                            run, acc, s, p);                                                   \
        for (int c0 = 0; c0 < C; c0 += C / PARTS) /* each part's sums held in registers */     \
            block_values(p, (const char *)vp + c0 * 64, j0, n, R, C / PARTS, C * 16, B,        \
                         acc + c0 * 16);                                                       \
        return;                                                                                \
    }
    BLOCK(4, 4, 1, 1) BLOCK(2, 8, 1, 1) BLOCK(6, 4, 0, 1) BLOCK(4, 8, 0, 2) BLOCK(4, 4, 0, 1)
    BLOCK(2, 8, 0, 1)
#undef BLOCK
    const int elem = bf16 ? 2 : 4, dim = chunks * 16;
    for (int r = 0; r < rows; r++) {
        block_probabilities(q + r * q_stride * elem, q_stride, kt, j0, n, position + r * rise,
                            rise, 1, dim, bf16, scale, run + r, acc + r * dim, s, p);
        block_values(p, vp, j0, n, 1, chunks, dim, bf16, acc + r * dim);
    }
}

#define SCRATCH_ROWS (AMX_ROWS > F32_ROWS ? AMX_ROWS : F32_ROWS) /* rows of scores a block */

/* One thread's buffers for rows_walk, and its tiles configured when it uses them. */
typedef struct {
    float *s, *acc, *part_sums;
    char *p, *padded_q;
    Running *run;
    int amx;
} Scratch;

static Scratch scratch_new(int dim, int amx) {
    Scratch w = {alloc64(sizeof(float) * SCRATCH_ROWS * KEY_BLOCK),
                 alloc64(sizeof(float) * (CHUNK + AMX_ROWS) * (size_t)dim), /* a padded group past a chunk */
                 alloc64(sizeof(float) * AMX_ROWS * (size_t)dim),
                 alloc64(sizeof(float) * SCRATCH_ROWS * KEY_BLOCK),
                 alloc64(sizeof(uint16_t) * AMX_ROWS * (size_t)dim),
                 malloc(sizeof(Running) * (CHUNK + AMX_ROWS)), amx};
    if (amx) amx_configure();
    return w;
}

static void scratch_free(Scratch *w) {
    if (w->amx) _tile_release();
    free(w->s);
    free(w->acc);
    free(w->part_sums);
    free(w->p);
    free(w->padded_q);
    free(w->run);
}

/* Query rows rows_block takes at a time: as many as the registers hold sums for. */
INLINE int block_rows(int bf16, int chunks) {
    return chunks > 4 ? MAX_ROWS / (bf16 ? 2 : 1) : bf16 ? MAX_ROWS : F32_ROWS;
}

/* Query rows of one head (row r at `position` + r * `rise`), key block by key block, into their
 * running softmax (run) and unnormalised value sums (acc, rows dim floats apart): the packed
 * K and V of a block stay in cache for every row. */
static void rows_walk(const char *q, int64_t q_stride, const void *kt, const void *vp,
                      int position, int rise, int rows, int chunks, int bf16, float scale,
                      Scratch *w) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4, amx = w->amx;
    const int block = block_rows(bf16, chunks);
    Running *run = w->run;
    float *acc = w->acc;
    const int pipelined = amx && dim <= 64, held = pipelined ? rows + AMX_ROWS : rows;
    for (int r = 0; r < held; r++) run[r] = (Running){-INFINITY, 0.0f};
    memset(acc, 0, sizeof(float) * (size_t)held * dim);
    int first = 0; /* rows before it walked in one pipeline per sixteen */
    for (; pipelined && rows - first >= AMX_ROWS; first += AMX_ROWS)
        amx_rows_pipelined(q + (int64_t)first * q_stride * elem, q_stride, kt, vp,
                           (position + (first + AMX_ROWS - 1) * rise + KEYS) / KEYS * KEYS,
                           position + first * rise, rise, dim, scale, run + first,
                           acc + first * dim, w->s, w->p);
    if (pipelined && rows - first >= PADDED_ROWS) { /* the rest as sixteen, zero rows after them */
        memset(w->padded_q, 0, sizeof(uint16_t) * AMX_ROWS * dim);
        for (int r = first; r < rows; r++)
            memcpy(w->padded_q + (r - first) * dim * elem, q + (int64_t)r * q_stride * elem, dim * elem);
        amx_rows_pipelined(w->padded_q, dim, kt, vp, (position + (rows - 1) * rise + KEYS) / KEYS * KEYS,
                           position + first * rise, rise, dim, scale, run + first,
                           acc + first * dim, w->s, w->p);
        first = rows;
    }
    int keys = (position + (rows - 1) * rise + KEYS) / KEYS * KEYS; /* through the last row's key */
    for (int j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
        int n = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
        for (int r0 = first, part; r0 < rows; r0 += part) {
            const int tiles = amx && rows - r0 >= AMX_ROWS;
            part = tiles ? AMX_ROWS : (rows - r0 < block ? rows - r0 : block);
            if (position + (r0 + part - 1) * rise < j0) continue; /* no row sees the block */
            const char *qr = q + (int64_t)r0 * q_stride * elem;
            if (tiles)
                amx_rows_block(qr, q_stride, kt, vp, j0, n, position + r0 * rise, rise, dim,
                               scale, run + r0, acc + r0 * dim, w->s, w->p, w->part_sums);
            else
                rows_block(qr, q_stride, kt, vp, j0, n, position + r0 * rise, rise, part, chunks,
                           bf16, scale, run + r0, acc + r0 * dim, w->s, w->p);
        }
    }
}

/* A prompt's rows of one head, causal, normalised into out (rows out_stride elements apart). */
static void rows_chunk(const char *q, int64_t q_stride, const void *kt, const void *vp,
                       int position, int rows, int chunks, int bf16, float scale, Scratch *w,
                       char *out, int64_t out_stride) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4;
    rows_walk(q, q_stride, kt, vp, position, 1, rows, chunks, bf16, scale, w);
    for (int r = 0; r < rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / w->run[r].sum);
        for (int d = 0; d < dim; d += 16)
            store16(out + (r * out_stride + d) * elem,
                    _mm512_mul_ps(_mm512_loadu_ps(w->acc + r * dim + d), inv), bf16);
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
    const int amx = bf16 && q_len >= (dim <= 64 ? PADDED_ROWS : AMX_ROWS) && amx_permitted();
    /* chunks of at most CHUNK rows, at least eight a head (a short prompt's few chunks, the
     * later ones much costlier, would leave a thread idle), a multiple of the rows a block
     * takes (of sixteen, the tiles' rows, with AMX; of four in bfloat16 without) */
    const int unit = amx ? AMX_ROWS : bf16 ? MAX_ROWS : block_rows(bf16, chunks);
    const int even = q_len / 8 / unit * unit, most = CHUNK / unit * unit;
    const int chunk = even < unit ? unit : (even > most ? most : even);
    const int parts = (q_len + chunk - 1) / chunk;
    const size_t packed = sizeof(float) * (size_t)padded * dim; /* bytes per head */
    char *kt = alloc64(packed * kv_heads), *vp = alloc64(packed * kv_heads);
#pragma omp parallel num_threads(threads)
    {
        Scratch w = scratch_new(dim, amx);
#pragma omp for
        for (int h = 0; h < kv_heads; h++)
            pack((const char *)k + (int64_t)h * dim * elem, (const char *)v + (int64_t)h * dim * elem,
                 kv_stride, kv_len, padded, dim, bf16, kt + packed * h, vp + packed * h);
        /* KV head by KV head, so a thread's packed K and V stay in its L2 (bfloat16 on tiles,
         * 4,096 tokens, two threads: 1.1x against every head's chunk in turn); within one,
         * the last rows attend to the most keys: handed out first */
#pragma omp for schedule(dynamic)
        for (int item = 0; item < heads * parts; item++) {
            const int h = item / (group * parts), rest = item % (group * parts);
            const int head = h * group + rest % group, i0 = (parts - 1 - rest / group) * chunk;
            const int rows = q_len - i0 < chunk ? q_len - i0 : chunk;
            rows_chunk((const char *)q + ((int64_t)i0 * q_stride + head * dim) * elem, q_stride,
                       kt + packed * h, vp + packed * h, offset + i0, rows, chunks, bf16,
                       scale, &w, (char *)out + ((int64_t)i0 * out_stride + head * dim) * elem, out_stride);
        }
        scratch_free(&w);
    }
    free(kt);
    free(vp);
}

/* One KV head's keys and values from a layer's pages ([blocks, block_size, kv_heads, dim]),
 * the pages `pages` in order, packed; padding zero. */
static void pack_pages(const char *k, const char *v, const int32_t *pages, int num_pages,
                       int block_size, int kv_heads, int head, int padded, int dim, int bf16,
                       void *kt, void *vp) {
    const int64_t elem = bf16 ? 2 : 4, stride = (int64_t)kv_heads * dim;
    pack_padding(num_pages * block_size, padded, dim, bf16, kt, vp);
    for (int pg = 0; pg < num_pages; pg++) {
        const int64_t at = (((int64_t)pages[pg] * block_size) * kv_heads + head) * dim * elem;
        int slot = 0;
        for (; block_size % 16 == 0 && slot < block_size; slot += 16)
            pack16(k + at + slot * stride * elem, v + at + slot * stride * elem, stride,
                   pg * block_size + slot, dim, bf16, kt, vp);
        for (; slot < block_size; slot++)
            pack_row(k + at + slot * stride * elem, v + at + slot * stride * elem,
                     pg * block_size + slot, dim, bf16, kt, vp);
    }
}

/* Whether shared_attention runs on tiles here (AMX built and granted): read by kernels/ops.py,
 * which has bfloat16 shared pages attended apart only on tiles (without: measured within the
 * noise). */
int shared_attention_tiles(void) { return HAVE_AMX && amx_permitted(); }

/* Decodes that share their leading pages (a common system prompt, a prompt's n > 1 samples)
 * attend to those pages once, together. In bfloat16 on AMX tiles: per KV head, every sequence's
 * query heads are the rows of one prompt, all at the last shared position (nothing masked), so
 * the pages are packed once and each key block meets up to 64 rows, sixteen at a time; else
 * (float32, or fewer than PADDED_ROWS rows) the pages are walked in place (shared_decode,
 * paged_decode.c: packing them cost more than the products it fed). q: [batch, heads,
 * dim], sequences q_stride elements apart; k, v: a layer's pages; out: [batch, heads, dim]
 * float32, normalised; lse: [batch, heads, 2], each row's running max and sum, which
 * merge_attention (paged_decode.c) weighs against the rest of the sequence's pages. */
void shared_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                      const int32_t *pages, int num_pages, int block_size, int batch, int heads,
                      int kv_heads, int dim, float scale, int bf16, int threads, float *out,
                      float *lse) {
    const int group = heads / kv_heads, chunks = dim / 16, elem = bf16 ? 2 : 4;
    const int len = num_pages * block_size, rows = batch * group;
    const int padded = (len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    if (!(bf16 && rows >= (dim <= 64 ? PADDED_ROWS : AMX_ROWS) && amx_permitted()))
        return shared_decode(q, q_stride, k, v, pages, num_pages, block_size, batch, heads,
                             kv_heads, dim, scale, bf16, threads, out, lse);
    const int half = rows / 2 / AMX_ROWS * AMX_ROWS;
    const int chunk = half < AMX_ROWS ? AMX_ROWS : (half > CHUNK ? CHUNK : half);
    const int parts = (rows + chunk - 1) / chunk;
    const size_t packed = sizeof(float) * (size_t)padded * dim, row_bytes = (size_t)dim * elem;
    char *kt = alloc64(packed * kv_heads), *vp = alloc64(packed * kv_heads);
    char *qh = alloc64(row_bytes * rows * kv_heads); /* [kv_heads][batch * group] query rows */
    for (int b = 0; b < batch; b++)
        for (int head = 0; head < heads; head++)
            memcpy(qh + ((int64_t)(head / group) * rows + b * group + head % group) * row_bytes,
                   (const char *)q + (b * q_stride + (int64_t)head * dim) * elem, row_bytes);
#pragma omp parallel num_threads(threads)
    {
        Scratch w = scratch_new(dim, 1);
#pragma omp for
        for (int h = 0; h < kv_heads; h++)
            pack_pages(k, v, pages, num_pages, block_size, kv_heads, h, padded, dim, bf16,
                       kt + packed * h, vp + packed * h);
#pragma omp for schedule(dynamic)
        for (int item = 0; item < kv_heads * parts; item++) {
            int h = item / parts, i0 = item % parts * chunk;
            int n = rows - i0 < chunk ? rows - i0 : chunk;
            rows_walk(qh + ((int64_t)h * rows + i0) * row_bytes, dim, kt + packed * h,
                      vp + packed * h, len - 1, 0, n, chunks, bf16, scale, &w);
            for (int r = 0; r < n; r++) {
                int64_t at = (int64_t)(i0 + r) / group * heads + h * group + (i0 + r) % group;
                __m512 inv = _mm512_set1_ps(1.0f / w.run[r].sum);
                for (int d = 0; d < dim; d += 16)
                    _mm512_storeu_ps(out + at * dim + d, _mm512_mul_ps(_mm512_loadu_ps(w.acc + r * dim + d), inv));
                lse[2 * at] = w.run[r].max;
                lse[2 * at + 1] = w.run[r].sum;
            }
        }
        scratch_free(&w);
    }
    free(qh);
    free(kt);
    free(vp);
}
#endif

/* Decode attention over a paged KV cache, read in place (no gather): one query token per
 * sequence, every query head of a KV head's group at once, float32 accumulation. AVX-512;
 * built without it, the library has no paged_decode and the torch backend gathers instead.
 *
 * Scores are made 16 tokens at a time: each token's products with a query head are summed
 * lane-wise, and the 16 partial vectors are reduced together by a transposing butterfly (15
 * shuffle-and-add steps for 16 tokens instead of 4 per token). The values are then summed into
 * accumulators that stay in registers for the common (group, head_dim) pairs, for which the
 * body below is inlined with both known. On a CPU with AMX, bfloat16 q.k for head dims 64
 * and 128 is instead a tile product per page of 16 tokens (K straight from the page times the
 * group's queries as pairs of dimensions): the default model's decode attention at 64 rows
 * of 228 tokens, 30 layers' cache cold, two threads, alternating in one process, 24.3 -> 21.1
 * ms (1 row of 300: 1.19 -> 1.03; 16 rows of 900: 30.9 -> 26.5). A sequence is taken a span
 * of tokens at a time into a running softmax (attend_heads): a long one's KV heads all
 * together, so that each page is read whole. Its reference is the torch backend's gather +
 * bmm path (tests/test_torch_attention.py). shared_decode, below, attends
 * the pages several decodes begin with once for all of them.
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdlib.h>

#include "amx.h"
#include "convert.h"
#include "kernels.h"
#include "vector16.h"

#define PARALLEL_READ 262144 /* K elements a step reads below which one thread does it all */
#define INLINE static inline __attribute__((always_inline))
#define TILE 16
/* Rows asked for ahead of the one read, into L2: the pages lie scattered, so the hardware's
 * streams stop at each page and a row cold in DRAM stalls the core (a decode step's cache is
 * read once, straight from memory); asking 32 rows ahead doubled bfloat16's rows per second,
 * and 64 took 32 rows of 300 tokens from 15.7 to 14.9 ms (30 layers, AMX Xeon, two threads). */
#define AHEAD 64
/* Fixed-size arrays (not sized by the arguments) so that, with group and chunks known where
 * attend is inlined, the compiler keeps the ones it indexes in registers. */
#define MAX_GROUP 16
#define MAX_CHUNKS 16 /* head_dim up to 256 */
#define SPAN 64 /* tokens attend_heads takes a sequence's KV heads through at a time */
/* A sequence's cached keys (every head) from which attend_heads takes it: below, a head's
 * pass over the whole sequence ran as fast (float32, 8 rows of 1,000 tokens) or faster (300) */
#define LONG_BYTES (1 << 20)


/* Lane i of the result is the sum of the lanes of v[i]. */
INLINE __m512 sum_each(__m512 v[TILE]) {
    static const int32_t steps[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
         {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
        {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
         {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
        {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
         {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}},
    };
    for (int level = 0, n = TILE; level < 4; level++, n /= 2) {
        __m512i lo = _mm512_loadu_si512(steps[level][0]), hi = _mm512_loadu_si512(steps[level][1]);
        for (int i = 0; i < n / 2; i++)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], lo, v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], hi, v[2 * i + 1]));
    }
    return v[0];
}

/* Where token t's row of a head lies: page table[t / block_size], slot t % block_size. */
typedef struct {
    const char *base;
    const int32_t *table;
    int block_size, page, slot;
    int64_t page_bytes, token_bytes;
} Rows;

INLINE const char *row_at(const Rows *r) {
    return r->base + r->table[r->page] * r->page_bytes + r->slot * r->token_bytes;
}

INLINE const char *next_row(Rows *r) {
    const char *row = row_at(r);
    if (++r->slot == r->block_size) r->slot = 0, r->page++;
    return row;
}

/* The first of the next TILE rows of r (one page holds them all: block_size a multiple of
 * TILE), r moved past them. */
INLINE const char *next_tile(Rows *r) {
    const char *row = row_at(r);
    if ((r->slot += TILE) == r->block_size) r->slot = 0, r->page++;
    return row;
}

#if HAVE_AMX
/* bfloat16 q.k of TILE tokens on AMX tiles: scores^T [token][query head] = K [token][32 dims]
 * (tiles 0 and 1 in turn, loaded from the page, rows token_bytes apart) times the group's
 * queries as pairs of dimensions (tiles 2-5, one per 32 dims, made once per (sequence, KV
 * head) by query_tiles), summed in tile 7 and stored to c (16 x 16 floats): column g is
 * query head g's TILE scores. A score's pairs are summed in another order than dot_pairs'
 * lanes and butterfly sum them: the same products, float32 sums. */
INLINE void tile_scores(const char *row, int64_t token_bytes, const int chunks, float *c) {
    _tile_zero(7);
    _tile_loadd(0, row, token_bytes);
    _tile_dpbf16ps(7, 0, 2);
    _tile_loadd(1, row + 64, token_bytes);
    _tile_dpbf16ps(7, 1, 3);
    if (chunks > 4) {
        _tile_loadd(0, row + 128, token_bytes);
        _tile_dpbf16ps(7, 0, 4);
        _tile_loadd(1, row + 192, token_bytes);
        _tile_dpbf16ps(7, 1, 5);
    }
    _tile_stored(7, c, 64);
}

/* The group's query heads (bfloat16, dim apart) as tile_scores' right-hand tiles 2.. (head
 * dims 64 or 128): row r of tile t holds, in column g, dimensions 32t + 2r and 32t + 2r + 1
 * of head g; columns past the group are zero. b: 4 KB of scratch, 64-byte aligned. */
INLINE void query_tiles(const uint16_t *q, const int group, const int chunks, uint16_t *b) {
    memset(b, 0, 1024 * (chunks / 2));
    for (int t = 0; t < chunks / 2; t++)
        for (int r = 0; r < 16; r++)
            for (int g = 0; g < group; g++) {
                const uint16_t *d = q + g * chunks * 16 + 32 * t + 2 * r;
                b[512 * t + r * 32 + 2 * g] = d[0], b[512 * t + r * 32 + 2 * g + 1] = d[1];
            }
    _tile_loadd(2, b, 64);
    _tile_loadd(3, b + 512, 64);
    if (chunks > 4) {
        _tile_loadd(4, b + 1024, 64);
        _tile_loadd(5, b + 1536, 64);
    }
}
#endif

/* The next row of r into L2 (AHEAD), its `bytes` a line at a time. */
INLINE void prefetch_row(Rows *r, int bytes) {
    const char *row = next_row(r);
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
}

/* Where token t of a sequence's rows lies: r moved to it. */
INLINE Rows rows_at(Rows r, int t) {
    r.page = t / r.block_size, r.slot = t % r.block_size;
    return r;
}

/* Running softmax of query heads over the spans of a sequence seen so far: the scores' max,
 * the probabilities' sum against it, the values weighed by them (dim floats a head). */
typedef struct {
    float *top, *sum, *acc;
} Running;

/* One KV head's `group` query heads (`chunks` * 16 values) over `n` cached tokens from where
 * `keys` and `values` point, into their running softmax; rows AHEAD of the one read, up to
 * `rest` (the tokens from here to the sequence's end), asked for into L2 meanwhile, the first
 * AHEAD too where `first`. scores: group rows of `span` (n rounded up to TILE or more)
 * floats; tiles: AMX scratch (bfloat16 q.k as tile products) or NULL. */
INLINE void attend_span(const char *q, Rows keys, Rows values, int n, int rest, int first,
                        const int group, const int chunks, float scale, const int bf16,
                        float *scores, int span, Running run, float *tiles) {
    const int64_t elem = bf16 ? 2 : 4, dim = chunks * 16;
    /* bfloat16 with AVX512-BF16: q.k from the cache's own bits, 32 products an instruction */
    const int pairs = HAVE_DPBF16 && bf16 && chunks % 2 == 0, row_bytes = (int)(dim * elem);
    __m512 qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], maxv[MAX_GROUP];
    __m512i qb[MAX_GROUP][MAX_CHUNKS / 2];
    for (int g = 0; g < group; g++) {
        maxv[g] = _mm512_set1_ps(-INFINITY);
        if (pairs)
            for (int c = 0; c < chunks / 2; c++) qb[g][c] = _mm512_loadu_si512(q + (g * dim + c * 32) * 2);
        else
            for (int c = 0; c < chunks; c++)
                qv[g][c] = _mm512_mul_ps(widen16(q + (g * dim + c * 16) * elem, bf16), _mm512_set1_ps(scale));
    }
#if HAVE_AMX
    if (tiles) query_tiles((const uint16_t *)q, group, chunks, (uint16_t *)(tiles + 256));
#endif
    const int here = keys.page * keys.block_size + keys.slot, skip = first ? 0 : AHEAD;
    Rows keys_ahead = rows_at(keys, here + skip), values_ahead = rows_at(values, here + skip);
    for (int t = skip; t < AHEAD && t < rest; t++) prefetch_row(&keys_ahead, row_bytes);
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int m = n - t0 < TILE ? n - t0 : TILE;
        const __mmask16 real = (__mmask16)((1u << m) - 1);
        for (int t = t0 + AHEAD; t < t0 + AHEAD + TILE && t < rest; t++)
            prefetch_row(&keys_ahead, row_bytes);
#if HAVE_AMX
        if (tiles) {
            tile_scores(next_tile(&keys), keys.token_bytes, chunks, tiles);
            const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144,
                                                      160, 176, 192, 208, 224, 240);
            for (int g = 0; g < group; g++) {
                __m512 s = _mm512_mul_ps(_mm512_i32gather_ps(column, tiles + g, 4), _mm512_set1_ps(scale));
                s = _mm512_mask_blend_ps(real, _mm512_set1_ps(-INFINITY), s);
                _mm512_storeu_ps(scores + g * span + t0, s);
                maxv[g] = _mm512_max_ps(maxv[g], s);
            }
            continue;
        }
#endif
        __m512 k[TILE][MAX_CHUNKS];
        __m512i kb[TILE][MAX_CHUNKS / 2];
        for (int i = 0; i < m; i++) {
            const char *row = next_row(&keys);
            if (pairs)
                for (int c = 0; c < chunks / 2; c++) kb[i][c] = _mm512_loadu_si512(row + c * 64);
            else
                for (int c = 0; c < chunks; c++) k[i][c] = widen16(row + c * 16 * elem, bf16);
        }
        for (int g = 0; g < group; g++) {
            __m512 part[TILE];
            for (int i = 0; i < TILE; i++) {
                part[i] = _mm512_setzero_ps();
                if (i < m && pairs)
                    for (int c = 0; c < chunks / 2; c++) part[i] = dot_pairs(part[i], qb[g][c], kb[i][c]);
                else if (i < m)
                    for (int c = 0; c < chunks; c++) part[i] = _mm512_fmadd_ps(qv[g][c], k[i][c], part[i]);
            }
            __m512 s = sum_each(part);
            if (pairs) s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
            s = _mm512_mask_blend_ps(real, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(scores + g * span + t0, s);
            maxv[g] = _mm512_max_ps(maxv[g], s);
        }
    }
    for (int g = 0; g < group; g++) { /* a higher max shrinks what came before */
        const float most = _mm512_reduce_max_ps(maxv[g]), top = most > run.top[g] ? most : run.top[g];
        const float alpha = run.top[g] == -INFINITY ? 0.0f : exp_approx(run.top[g] - top);
        __m512 mv = _mm512_set1_ps(top), total = _mm512_setzero_ps();
        for (int t = 0; t < n; t += TILE) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + g * span + t), mv));
            _mm512_storeu_ps(scores + g * span + t, e);
            total = _mm512_add_ps(total, e);
        }
        run.sum[g] = run.sum[g] * alpha + _mm512_reduce_add_ps(total);
        run.top[g] = top;
        for (int c = 0; c < chunks; c++)
            acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(run.acc + g * dim + c * 16), _mm512_set1_ps(alpha));
    }
    for (int t = skip; t < AHEAD && t < rest; t++) prefetch_row(&values_ahead, row_bytes);
    for (int t = 0; t < n; t++) {
        if (t + AHEAD < rest) prefetch_row(&values_ahead, row_bytes);
        const char *row = next_row(&values);
        __m512 v[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = widen16(row + c * 16 * elem, bf16);
        for (int g = 0; g < group; g++) {
            __m512 p = _mm512_set1_ps(scores[g * span + t]);
            for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(run.acc + g * dim + c * 16, acc[g][c]);
}

#define SHAPE(G, C)                                                                           \
    if (group == G && chunks == C)                                                            \
        return bf16 ? attend_span(q, keys, values, n, rest, first, G, C, scale, 1, scores,    \
                                  span, run, tiles)                                           \
                    : attend_span(q, keys, values, n, rest, first, G, C, scale, 0, scores,    \
                                  span, run, NULL);

static void span_any(const char *q, Rows keys, Rows values, int n, int rest, int first,
                     int group, int chunks, float scale, int bf16, float *scores, int span,
                     Running run, float *tiles) {
    SHAPE(1, 4) SHAPE(2, 4) SHAPE(3, 4) SHAPE(4, 4) SHAPE(5, 4) SHAPE(6, 4) SHAPE(7, 4) SHAPE(8, 4)
    SHAPE(1, 8) SHAPE(2, 8) SHAPE(3, 8) SHAPE(4, 8) SHAPE(5, 8) SHAPE(6, 8) SHAPE(7, 8) SHAPE(8, 8)
    if (bf16)
        attend_span(q, keys, values, n, rest, first, group, chunks, scale, 1, scores, span, run, tiles);
    else
        attend_span(q, keys, values, n, rest, first, group, chunks, scale, 0, scores, span, run, NULL);
}

/* KV heads h0 .. h1 - 1 of one sequence (`len` tokens; q, out and lse at its first query
 * head, keys and values at its first KV head), `span` tokens at a time, each of those heads
 * before the next span. A page holds its tokens' rows of every KV head interleaved: one head
 * over a whole long sequence reads a third of each page's lines a pass (16 GB/s where the
 * pages read whole ran at 27, two threads), so a long sequence's heads go together, 64
 * tokens at a time, its pages read whole while in L2; a short one's head takes it whole, one
 * span. state: (h1 - h0) * group * (dim + 2) floats of scratch. */
static void attend_heads(const char *q, Rows keys, Rows values, char *out, int len, int h0,
                         int h1, int group, int dim, float scale, int bf16, float *scores,
                         int span, float *state, float *lse, float *tiles) {
    const int64_t elem = bf16 ? 2 : 4, held = (int64_t)(h1 - h0) * group;
    Running run = {state, state + held, state + 2 * held};
    for (int64_t i = 0; i < held; i++) run.top[i] = -INFINITY, run.sum[i] = 0.0f;
    memset(run.acc, 0, sizeof(float) * held * dim);
    for (int t0 = 0; t0 < len; t0 += span) {
        const int n = len - t0 < span ? len - t0 : span;
        for (int h = h0; h < h1; h++) /* a group wider than MAX_GROUP goes in parts */
            for (int g0 = 0; g0 < group; g0 += MAX_GROUP) {
                const int64_t at = (int64_t)(h - h0) * group + g0;
                Rows k = rows_at(keys, t0), v = rows_at(values, t0);
                k.base += h * dim * elem, v.base += h * dim * elem;
                Running part = {run.top + at, run.sum + at, run.acc + at * dim};
                span_any(q + ((int64_t)h * group + g0) * dim * elem, k, v, n, len - t0, t0 == 0,
                         group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP, dim / 16, scale, bf16,
                         scores, span, part, tiles);
            }
    }
    for (int64_t i = 0; i < held; i++) {
        const int64_t head = (int64_t)h0 * group + i;
        const __m512 inv = _mm512_set1_ps(1.0f / run.sum[i]);
        for (int c = 0; c < dim; c += 16)
            store16(out + (head * dim + c) * elem,
                    _mm512_mul_ps(_mm512_loadu_ps(run.acc + i * dim + c), inv), bf16);
        if (lse) lse[2 * head] = run.top[i], lse[2 * head + 1] = run.sum[i];
    }
}

/* q, out: [B, H, D], a sequence's heads contiguous, sequences q_stride and out_stride elements
 * apart; k, v: [blocks, block_size, H_kv, D], contiguous; tables: [B, width] page ids; lens:
 * [B] tokens each sequence attends to (at most max_len); bf16: 1 for bfloat16 tensors, 0 for
 * float32; D a multiple of 16, at most 16 * MAX_CHUNKS; lse: NULL, or [B, H, 2] floats where
 * each row's softmax max and sum go (merge_attention reads them). Work is split over
 * (sequence, KV head) pairs. */
void paged_decode(const void *q, int64_t q_stride, const void *k, const void *v, void *out,
                  int64_t out_stride, const int32_t *tables, int width, const int32_t *lens,
                  int batch, int heads, int kv_heads, int dim, int block_size, int max_len,
                  float scale, int bf16, int threads, float *lse) {
    const int group = heads / kv_heads, stride = (max_len + TILE - 1) / TILE * TILE;
    const int64_t elem = bf16 ? 2 : 4, token_bytes = kv_heads * dim * elem;
    /* A parallel region costs its slowest thread's wake-up: on cores other processes share,
     * a whole scheduler timeslice (7 ms a call measured, against 55 us on one thread), so a
     * step with little to read stays on this thread. */
    const int parallel = (int64_t)batch * kv_heads * max_len * dim > PARALLEL_READ;
    /* q.k on AMX tiles: bfloat16, head dims 64 or 128, whole pages of TILE tokens */
    const int tiles = bf16 && HAVE_AMX && (dim == 64 || dim == 128) && block_size % TILE == 0 &&
                      amx_permitted();
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *scores = malloc(sizeof(float) * MAX_GROUP * (stride > SPAN ? stride : SPAN));
        float *state = malloc(sizeof(float) * (size_t)heads * (dim + 2));
        float *scratch = tiles ? aligned_alloc(64, 1024 + 4096) : NULL; /* scores^T, queries */
        if (tiles) amx_configure();
        /* a sequence's KV heads on one thread: their rows interleave in the pages, so the
         * lines the hardware fetches beside one head's are the next head's (32 rows of 300
         * tokens, 30 layers: 18.5 -> 15.9 ms on two AMX Xeon threads); fewer sequences than
         * threads spread their heads instead (one row of 3,500 tokens, 30 layers, two threads:
         * float32 18.0 -> 11.3 ms, bfloat16 5.7 -> 3.9) */
#pragma omp for schedule(dynamic, batch < threads ? 1 : kv_heads)
        for (int item = 0; item < batch * kv_heads; item++) {
            const int b = item / kv_heads, h = item % kv_heads, len = lens[b];
            const int together = batch >= threads && (int64_t)len * token_bytes >= LONG_BYTES;
            if (together && h > 0) continue; /* the item of head 0 takes them all */
            Rows keys = {(const char *)k, tables + (int64_t)b * width, block_size, 0, 0,
                         block_size * token_bytes, token_bytes};
            Rows values = keys;
            values.base = (const char *)v;
            attend_heads((const char *)q + b * q_stride * elem, keys, values,
                         (char *)out + b * out_stride * elem, len, together ? 0 : h,
                         together ? kv_heads : h + 1, group, dim, scale, bf16, scores,
                         together ? SPAN : (len + TILE - 1) / TILE * TILE, state,
                         lse ? lse + 2 * (int64_t)b * heads : NULL, scratch);
        }
        if (tiles) _tile_release();
        free(scratch);
        free(state);
        free(scores);
    }
}

/* Shared pages (shared_decode): the most queries of one KV head a thread takes at a time, and
 * how many of them meet a tile of keys together (eight chains of FMAs). */
#define PART 32
#define QUERIES 8

/* Where query j of KV head h lies in shared_decode (sequence j / group's query head
 * h * group + j % group): in q ([B, H, D], sequences q_stride apart), or with q_stride
 * heads * dim in the output, or with heads and 1 among lse's pairs. */
INLINE int64_t query_at(int j, int h, int group, int64_t q_stride, int dim) {
    return (int64_t)(j / group) * q_stride + (int64_t)(h * group + j % group) * dim;
}

/* Raw scores of `held` queries (a multiple of QUERIES; qs: scaled, dim floats apart) against
 * the keys of `len` tokens, rows `stride` floats apart: per tile of 16 tokens the keys are
 * transposed once (lane: token), then each query's 16 scores are dim FMAs, QUERIES chains at
 * once. */
INLINE void shared_scores(const float *qs, int held, Rows keys, int len, const int chunks,
                          const int bf16, float *scores, int stride) {
    const int64_t elem = bf16 ? 2 : 4, dim = chunks * 16;
    const int row_bytes = (int)(dim * elem);
    Rows ahead = keys;
    for (int t = 0; t < AHEAD && t < len; t++) prefetch_row(&ahead, row_bytes);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        for (int t = t0 + AHEAD; t < t0 + AHEAD + TILE && t < len; t++) prefetch_row(&ahead, row_bytes);
        const char *rows[TILE]; /* a tile's rows past len repeat its first (masked off) */
        for (int i = 0; i < n; i++) rows[i] = next_row(&keys);
        for (int i = n; i < TILE; i++) rows[i] = rows[0];
        __m512i kt[MAX_CHUNKS][TILE]; /* kt[c][d]: dimension 16 c + d of the 16 tokens */
        for (int c = 0; c < chunks; c++) {
            for (int i = 0; i < TILE; i++) kt[c][i] = _mm512_castps_si512(widen16(rows[i] + c * 16 * elem, bf16));
            transpose16(kt[c]);
        }
        const __mmask16 real = (__mmask16)((1u << n) - 1);
        for (int g0 = 0; g0 < held; g0 += QUERIES) {
            __m512 s[QUERIES];
            for (int r = 0; r < QUERIES; r++) s[r] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++)
                for (int d = 0; d < 16; d++) {
                    const __m512 k = _mm512_castsi512_ps(kt[c][d]);
                    for (int r = 0; r < QUERIES; r++)
                        s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(g0 + r) * dim + 16 * c + d]), k, s[r]);
                }
            for (int r = 0; r < QUERIES; r++)
                _mm512_storeu_ps(scores + (int64_t)(g0 + r) * stride + t0,
                                 _mm512_mask_blend_ps(real, _mm512_set1_ps(-INFINITY), s[r]));
        }
    }
}

/* One query's scores (`width`: their count rounded up to TILE, -inf past it) into
 * probabilities, as attend takes them: its max and sum into lse. */
static void shared_softmax(float *s, int width, float *lse) {
    __m512 maxv = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int t = 0; t < width; t += TILE) maxv = _mm512_max_ps(maxv, _mm512_loadu_ps(s + t));
    const float top = _mm512_reduce_max_ps(maxv);
    for (int t = 0; t < width; t += TILE) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top)));
        _mm512_storeu_ps(s + t, e);
        total = _mm512_add_ps(total, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    lse[0] = top, lse[1] = sum;
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int t = 0; t < width; t += TILE) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
}

/* The probabilities p of `held` queries (rows `stride` apart; held a multiple of QUERIES)
 * times the values of `len` tokens, summed in token order into sums (held rows of dim floats):
 * a tile of 16 tokens is read once and meets every query, a few at a time (up to 16 vectors
 * of sums in registers). */
INLINE void shared_values(const float *p, int held, int stride, Rows values, int len,
                          const int chunks, const int bf16, float *sums) {
    const int64_t elem = bf16 ? 2 : 4, dim = chunks * 16;
    const int row_bytes = (int)(dim * elem);
    const int group = chunks <= 2 ? 8 : chunks <= 4 ? 4 : chunks <= 8 ? 2 : 1; /* divides held */
    memset(sums, 0, sizeof(float) * held * dim);
    Rows ahead = values;
    for (int t = 0; t < AHEAD && t < len; t++) prefetch_row(&ahead, row_bytes);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        for (int t = t0 + AHEAD; t < t0 + AHEAD + TILE && t < len; t++) prefetch_row(&ahead, row_bytes);
        const char *rows[TILE];
        for (int i = 0; i < n; i++) rows[i] = next_row(&values);
        for (int r0 = 0; r0 < held; r0 += group) {
            __m512 acc[QUERIES][MAX_CHUNKS];
            for (int r = 0; r < group; r++)
                for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_loadu_ps(sums + (r0 + r) * dim + 16 * c);
            for (int i = 0; i < n; i++) {
                __m512 v[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) v[c] = widen16(rows[i] + c * 16 * elem, bf16);
                for (int r = 0; r < group; r++) {
                    const __m512 w = _mm512_set1_ps(p[(int64_t)(r0 + r) * stride + t0 + i]);
                    for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
                }
            }
            for (int r = 0; r < group; r++)
                for (int c = 0; c < chunks; c++) _mm512_storeu_ps(sums + (r0 + r) * dim + 16 * c, acc[r][c]);
        }
    }
}

/* Scores, softmax and values of the shared pass, specialised by the caller for its head dim
 * and dtype: the queries' sums overwrite their scaled copies in qs; query j's max and sum go to
 * lse_of[j]. */
INLINE void shared_products(float *qs, int held, int n_q, Rows keys, Rows values, int len,
                            const int chunks, const int bf16, float *scores, int stride,
                            float *const *lse_of) {
    shared_scores(qs, held, keys, len, chunks, bf16, scores, stride);
    for (int j = 0; j < n_q; j++)
        shared_softmax(scores + (int64_t)j * stride, (len + TILE - 1) / TILE * TILE, lse_of[j]);
    shared_values(scores, held, stride, values, len, chunks, bf16, qs);
}

/* The queries j0 .. j0 + n_q - 1 of KV head h against the shared pages: scores (rows `stride`
 * floats apart), softmax, and values, normalised into out ([B, H, D] float32) with each
 * query's max and sum in lse. */
static void shared_part(const char *q, int64_t q_stride, Rows keys, Rows values, int len, int j0,
                        int n_q, int h, int group, int heads, int chunks, float scale, int bf16,
                        float *scores, int stride, float *qs, float *out, float *lse) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4;
    const int held = (n_q + QUERIES - 1) / QUERIES * QUERIES;
    for (int r = 0; r < held; r++) /* queries past n_q: zero, their sums not kept */
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(qs + r * dim + d, r < n_q ? _mm512_mul_ps(widen16(
                q + (query_at(j0 + r, h, group, q_stride, dim) + d) * elem, bf16),
                _mm512_set1_ps(scale)) : _mm512_setzero_ps());
    float *lse_of[PART];
    for (int j = 0; j < n_q; j++)
        lse_of[j] = lse + 2 * query_at(j0 + j, h, group, heads, 1);
    if (chunks == 4)
        bf16 ? shared_products(qs, held, n_q, keys, values, len, 4, 1, scores, stride, lse_of)
             : shared_products(qs, held, n_q, keys, values, len, 4, 0, scores, stride, lse_of);
    else
        bf16 ? shared_products(qs, held, n_q, keys, values, len, chunks, 1, scores, stride, lse_of)
             : shared_products(qs, held, n_q, keys, values, len, chunks, 0, scores, stride, lse_of);
    for (int r = 0; r < n_q; r++)
        memcpy(out + query_at(j0 + r, h, group, (int64_t)heads * dim, dim), qs + r * dim,
               sizeof(float) * dim);
}

/* Decodes that begin with the same pages (a common system prompt, a prompt's n > 1 samples)
 * attend to them once, together, where paged_decode would read them again for every row (from
 * L3 at best). Per KV head, up to PART queries walk the pages a tile of 16 tokens at a time,
 * each tile read once for all of them: its keys transposed (lane: token), so a query's 16
 * scores are dim FMAs, QUERIES chains at once; then, after attend's softmax (q scaled first,
 * exp16, normalised before the values), its values meet the queries a few at a time, their
 * sums in registers. 16 rows sharing 1,024 tokens, the default model's 30 layers cold on two
 * Emerald Rapids cores: 11.3 ms against 17.2 for the packed path shared_attention took before
 * (packing the pages cost more than the products it fed), and with the rows' own 400 tokens
 * 39 against 52 ms for paged_decode reading every row's pages. The output, float32 [B, H, D]
 * normalised, and lse ([B, H, 2], each query's max and sum) are what merge_attention weighs
 * against the rest of each sequence's pages. q, k, v as paged_decode takes them; pages: the
 * num_pages shared page ids. */
void shared_decode(const void *q, int64_t q_stride, const void *k, const void *v,
                   const int32_t *pages, int num_pages, int block_size, int batch, int heads,
                   int kv_heads, int dim, float scale, int bf16, int threads, float *out,
                   float *lse) {
    const int group = heads / kv_heads, rows = batch * group, len = num_pages * block_size;
    const int64_t elem = bf16 ? 2 : 4, token_bytes = (int64_t)kv_heads * dim * elem;
    const int parallel = (int64_t)rows * kv_heads * len * dim > PARALLEL_READ;
    /* at least a part per thread for each KV head (three heads on two threads: six, not three) */
    int parts = (rows + PART - 1) / PART;
    parts = !parallel || parts >= threads ? parts : (threads < rows ? threads : rows);
    /* rows of scores a vector past a multiple of TILE: a part's rows, a power of two apart,
     * would share L1's sets */
    const int part = (rows + parts - 1) / parts, stride = (len + TILE - 1) / TILE * TILE + TILE;
    parts = (rows + part - 1) / part;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        /* the part's scores and its queries, scaled, rounded up to QUERIES rows */
        const int held = (part + QUERIES - 1) / QUERIES * QUERIES;
        float *scores = malloc(sizeof(float) * (size_t)held * stride);
        float *qs = malloc(sizeof(float) * held * (size_t)dim);
#pragma omp for schedule(dynamic)
        for (int item = 0; item < kv_heads * parts; item++) {
            const int h = item % kv_heads, j0 = item / kv_heads * part;
            Rows keys = {(const char *)k + h * dim * elem, pages, block_size, 0, 0,
                         block_size * token_bytes, token_bytes};
            Rows values = keys;
            values.base = (const char *)v + h * dim * elem;
            shared_part((const char *)q, q_stride, keys, values, len, j0,
                        rows - j0 < part ? rows - j0 : part, h, group, heads, dim / 16, scale,
                        bf16, scores, stride, qs, out, lse);
        }
        free(qs);
        free(scores);
    }
}

/* Attention over two spans of each sequence's keys, each normalised on its own, made one: out
 * (the sequence's own pages, by paged_decode, with lse its [B, H, 2] max and sum) and shared
 * (the pages every sequence shares, float32 [B, H, D], by shared_attention, with shared_lse),
 * weighed by their sums at a common max, into out (rows out_stride elements apart). */
void merge_attention(void *out, int64_t out_stride, const float *lse, const float *shared,
                     const float *shared_lse, int batch, int heads, int dim, int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) {
            int64_t at = (int64_t)b * heads + h;
            float top = lse[2 * at] > shared_lse[2 * at] ? lse[2 * at] : shared_lse[2 * at];
            float own = lse[2 * at + 1] * exp_approx(lse[2 * at] - top);
            float common = shared_lse[2 * at + 1] * exp_approx(shared_lse[2 * at] - top);
            __m512 a = _mm512_set1_ps(own / (own + common)), c = _mm512_set1_ps(common / (own + common));
            char *row = (char *)out + (b * out_stride + (int64_t)h * dim) * elem;
            for (int d = 0; d < dim; d += 16)
                store16(row + d * elem, _mm512_fmadd_ps(widen16(row + d * elem, bf16), a,
                        _mm512_mul_ps(_mm512_loadu_ps(shared + at * dim + d), c)), bf16);
        }
}
#endif

/* Every decoder layer of a small decode step in one call: the CPU's answer to a replayed CUDA
 * graph. Called from Python once per step instead of some fifteen torch ops and kernel calls
 * per layer, whose dispatch cost, at one row on a small model, is most of the step.
 *
 * It chains this library's own kernels in the order models/llama.py runs them, storing every
 * result in the model's dtype where the module path does, so its output is the module path's
 * bit for bit: RMSNorm, the q|k|v product (from GGUF blocks, or decode_linear's) plus bias,
 * rotary embedding in place, the new K/V written to their slots, paged attention (the pages
 * every row begins with attended once, merged with each row's own), the output projection
 * and the residual; RMSNorm, gate|up, SiLU * up (one pass with gate|up on AMX tiles), down
 * and the residual. It takes the layouts
 * kernels/ops.py documents for each kernel; the Python side (decode_chain.py) decides when a
 * step qualifies (decode only, few rows, every linear from blocks or packed for its dtype's
 * decode product, no adapter, no q/k norm).
 */
#ifdef __AVX512F__
#include <stdlib.h>

#include "convert.h"
#include "kernels.h"

/* quant_gemv, or quant_gemv_q8 (int8 x) where the engine asked for it: the layer's own choice */
typedef void (*gemv_fn)(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                        void *y, int64_t y_stride, int rows, int N, int K, int qtype, int bf16,
                        int threads);
/* A decode product of a weight packed for it (tile_linear, panel_linear_pairs,
 * panel_linear_bf16, panel_linear), and gate|up with SiLU * up in one pass (tile_linear_silu):
 * kernels/ops.py's decode_kernel. */
typedef void (*linear_fn)(const void *x, int64_t x_stride, int m, int k, const void *packed,
                          int n, const void *bias, void *out, int64_t out_stride, int threads);
typedef void (*silu_fn)(const void *x, int64_t x_stride, int m, int k, const void *packed,
                        int inter, void *out, int64_t out_stride, int threads);

enum { QKV, O, GATE_UP, DOWN };

typedef struct { /* one layer's weights (model dtype) and its pages of the KV cache */
    const void *in_norm, *post_norm, *qkv_bias; /* qkv_bias: NULL without one */
    const uint8_t *blocks[4]; /* QKV, O, GATE_UP, DOWN: GGUF blocks, or decode_pack's copies */
    int64_t block_stride[4];  /* bytes between two output rows' blocks */
    int qtype[4];
    gemv_fn gemv[4];    /* each linear's block kernel (Linear.kernel), with blocks */
    linear_fn linear;   /* with decode_pack's copies; NULL with GGUF blocks */
    silu_fn linear_silu; /* gate|up and SiLU * up in one pass, where the product has one */
    void *k_pages, *v_pages; /* [blocks, block_size, kv_heads, head_dim] */
} chain_layer;

typedef struct { /* the model's shapes and this step's rows */
    int rows, hidden, heads, kv_heads, head_dim, rotary_dim, inter;
    int block_size, width, max_len, bf16, threads;
    float eps, scale;
    const int64_t *slots;         /* [rows] the new token's KV slot */
    const int32_t *tables, *lens; /* [rows, width] pages, [rows] context lengths, both after */
    const void *cos, *sin;        /* [rows, rotary_dim]                      the shared pages */
    const int32_t *shared;        /* [num_shared] pages every row begins with, attended once */
    int num_shared;               /* (shared_attention, as the attention backend does) or 0 */
} chain_step;

/* dst[r, i] = dtype(dst[r, i] + add[r, i]): torch's ``h + x`` in the model's dtype. One loop
 * per dtype, so that each vectorises (a step of 64 rows adds 2.2 M values). */
static void add_rows(void *dst, const void *add, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = dst;
        const uint16_t *a = add;
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(from_bf16(d[i]) + from_bf16(a[i]));
        return;
    }
    float *d = dst;
    const float *a = add;
    for (int64_t i = 0; i < n; i++) d[i] += a[i];
}

/* y [rows, N] = x [rows, K] times linear `which` of the layer (plus bias, or NULL), rounded
 * where the module path rounds: decode_linear's kernels add the bias before rounding, as
 * oneDNN's product does; GGUF blocks after, as Linear adds it to quant_gemv's result. */
static void product(const chain_layer *l, const chain_step *s, int which, const char *x, int K,
                    char *y, int N, const void *bias) {
    if (l->linear) {
        l->linear(x, K, s->rows, K, l->blocks[which], N, bias, y, N, s->threads);
        return;
    }
    l->gemv[which](x, K, l->blocks[which], l->block_stride[which], y, N, s->rows, N, K,
                   l->qtype[which], s->bf16, s->threads);
    if (bias)
        for (int r = 0; r < s->rows; r++) add_rows(y + (int64_t)r * N * (s->bf16 ? 2 : 4), bias, N, s->bf16);
}

/* Every row's attention over its pages: the shared ones once for all rows (shared_attention)
 * merged with each row's own, or each row's all (paged_decode). */
static void attend(const chain_layer *l, const chain_step *s, const char *qkv, int width,
                   char *attn, float *lse, float *shared_out, float *shared_lse) {
    const int q_size = s->heads * s->head_dim, shared = s->num_shared > 0;
    paged_decode(qkv, width, l->k_pages, l->v_pages, attn, q_size, s->tables, s->width, s->lens,
                 s->rows, s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_len,
                 s->scale, s->bf16, s->threads, shared ? lse : NULL);
    if (!shared) return;
    shared_attention(qkv, width, l->k_pages, l->v_pages, s->shared, s->num_shared, s->block_size,
                     s->rows, s->heads, s->kv_heads, s->head_dim, s->scale, s->bf16, s->threads,
                     shared_out, shared_lse);
    merge_attention(attn, q_size, lse, shared_out, shared_lse, s->rows, s->heads, s->head_dim,
                    s->bf16);
}

/* The new tokens' K and V (columns q_size.. of the q|k|v rows) into their slots. */
static void write_kv(const chain_layer *l, const chain_step *s, const char *qkv, int64_t width) {
    int64_t elem = s->bf16 ? 2 : 4, kv = (int64_t)s->kv_heads * s->head_dim;
    int64_t q_size = (int64_t)s->heads * s->head_dim;
    for (int r = 0; r < s->rows; r++) {
        const char *row = qkv + r * width * elem;
        memcpy((char *)l->k_pages + s->slots[r] * kv * elem, row + q_size * elem, kv * elem);
        memcpy((char *)l->v_pages + s->slots[r] * kv * elem, row + (q_size + kv) * elem, kv * elem);
    }
}

static void attention(const chain_layer *l, const chain_step *s, char *h, char *xn, char *qkv,
                      char *attn, char *o, float *lse) {
    const int bf16 = s->bf16, t = s->threads, n = s->rows, H = s->hidden;
    const int q_size = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    const int width = q_size + 2 * kv;
    rms_norm(h, xn, l->in_norm, n, H, H, s->eps, bf16, t);
    product(l, s, QKV, xn, H, qkv, width, l->qkv_bias);
    rope(qkv, s->cos, s->sin, n, s->heads, s->head_dim, s->rotary_dim, width, bf16, t);
    rope(qkv + (int64_t)q_size * (bf16 ? 2 : 4), s->cos, s->sin, n, s->kv_heads, s->head_dim,
         s->rotary_dim, width, bf16, t);
    write_kv(l, s, qkv, width);
    const int64_t heads = (int64_t)n * s->heads; /* lse: [heads][2] own, shared; then shared out */
    attend(l, s, qkv, width, attn, lse, lse + 4 * heads, lse + 2 * heads);
    product(l, s, O, attn, q_size, o, H, NULL);
    add_rows(h, o, (int64_t)n * H, bf16);
}

static void mlp(const chain_layer *l, const chain_step *s, char *h, char *xn, char *gate_up,
                char *act, char *o) {
    const int bf16 = s->bf16, t = s->threads, n = s->rows, H = s->hidden, I = s->inter;
    rms_norm(h, xn, l->post_norm, n, H, H, s->eps, bf16, t);
    if (l->linear_silu && I % 32 == 0) {
        l->linear_silu(xn, H, n, H, l->blocks[GATE_UP], I, act, I, t);
    } else {
        product(l, s, GATE_UP, xn, H, gate_up, 2 * I, NULL);
        silu_mul(gate_up, act, n, I, bf16, t);
    }
    product(l, s, DOWN, act, I, o, H, NULL);
    add_rows(h, o, (int64_t)n * H, bf16);
}

/* h: [rows, hidden] in the model's dtype, the residual stream after the embedding, updated in
 * place to the last layer's output (before the final norm). */
void decode_chain(void *h, const chain_layer *layers, int num_layers, const chain_step *s) {
    const int64_t elem = s->bf16 ? 2 : 4, n = s->rows;
    const int64_t q_size = (int64_t)s->heads * s->head_dim, kv = (int64_t)s->kv_heads * s->head_dim;
    const int64_t widest = (q_size + 2 * kv) > 2 * (int64_t)s->inter ? q_size + 2 * kv : 2 * (int64_t)s->inter;
    char *scratch = malloc(n * elem * (2 * (int64_t)s->hidden + widest + q_size + s->inter));
    char *xn = scratch, *o = xn + n * s->hidden * elem, *wide = o + n * s->hidden * elem;
    char *attn = wide + n * widest * elem, *act = attn + n * q_size * elem;
    /* the shared pages' attention: each row's max and sum, its own, and its output */
    float *lse = s->num_shared ? malloc(sizeof(float) * n * s->heads * (4 + s->head_dim)) : NULL;
    for (int i = 0; i < num_layers; i++) {
        attention(&layers[i], s, h, xn, wide, attn, o, lse);
        mlp(&layers[i], s, h, xn, wide, act, o);
    }
    free(lse);
    free(scratch);
}
#endif

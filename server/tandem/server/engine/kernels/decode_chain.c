/* Every decoder layer of a small decode step in one call: the CPU's answer to a replayed CUDA
 * graph. Called from Python once per step instead of some fifteen torch ops and kernel calls
 * per layer, whose dispatch cost, at one row on a small model, is most of the step.
 *
 * It chains this library's own kernels in the order models/llama.py runs them, storing every
 * result in the model's dtype where the module path does, so its output is the module path's
 * bit for bit: RMSNorm, the q|k|v product from GGUF blocks (plus bias), rotary embedding in
 * place, the new K/V written to their slots, paged attention, the output projection and the
 * residual; RMSNorm, gate|up, SiLU * up, down and the residual. It takes the layouts
 * kernels/ops.py documents for each kernel; the Python side (decode_chain.py) decides when a
 * step qualifies (decode only, few rows, every linear from blocks, no adapter, no q/k norm).
 */
#ifdef __AVX512F__
#include <stdlib.h>

#include "convert.h"

void rms_norm(const void *x, void *out, const void *weight, int rows, int dim, int64_t x_stride,
              float eps, int bf16, int threads);
void silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int threads);
void rope(void *x, const void *cos, const void *sin, int tokens, int heads, int head_dim,
          int rotary_dim, int64_t token_stride, int bf16, int threads);
/* quant_gemv, or quant_gemv_q8 (int8 x) where the engine asked for it: the layer's own choice */
typedef void (*gemv_fn)(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                        void *y, int64_t y_stride, int rows, int N, int K, int qtype, int bf16,
                        int threads);
void paged_decode(const void *q, int64_t q_stride, const void *k, const void *v, void *out,
                  int64_t out_stride, const int32_t *tables, int width, const int32_t *lens,
                  int batch, int heads, int kv_heads, int dim, int block_size, int max_len,
                  float scale, int bf16, int threads, float *lse);

enum { QKV, O, GATE_UP, DOWN };

typedef struct { /* one layer's weights (model dtype) and its pages of the KV cache */
    const void *in_norm, *post_norm, *qkv_bias; /* qkv_bias: NULL without one */
    const uint8_t *blocks[4];                   /* QKV, O, GATE_UP, DOWN */
    int64_t block_stride[4];                    /* bytes between two output rows' blocks */
    int qtype[4];
    gemv_fn gemv[4]; /* each linear's block kernel (Linear.kernel) */
    void *k_pages, *v_pages; /* [blocks, block_size, kv_heads, head_dim] */
} chain_layer;

typedef struct { /* the model's shapes and this step's rows */
    int rows, hidden, heads, kv_heads, head_dim, rotary_dim, inter;
    int block_size, width, max_len, bf16, threads;
    float eps, scale;
    const int64_t *slots;         /* [rows] the new token's KV slot */
    const int32_t *tables, *lens; /* [rows, width] pages, [rows] context lengths */
    const void *cos, *sin;        /* [rows, rotary_dim] */
} chain_step;

/* dst[r, i] = dtype(dst[r, i] + add[r, i]): torch's ``h + x`` in the model's dtype. */
static void add_rows(void *dst, const void *add, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++) store(dst, i, load(dst, i, bf16) + load(add, i, bf16), bf16);
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
                      char *attn, char *o) {
    const int bf16 = s->bf16, t = s->threads, n = s->rows, H = s->hidden;
    const int q_size = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    const int width = q_size + 2 * kv;
    rms_norm(h, xn, l->in_norm, n, H, H, s->eps, bf16, t);
    l->gemv[QKV](xn, H, l->blocks[QKV], l->block_stride[QKV], qkv, width, n, width, H,
               l->qtype[QKV], bf16, t);
    if (l->qkv_bias)
        for (int r = 0; r < n; r++) add_rows(qkv + (int64_t)r * width * (bf16 ? 2 : 4), l->qkv_bias, width, bf16);
    rope(qkv, s->cos, s->sin, n, s->heads, s->head_dim, s->rotary_dim, width, bf16, t);
    rope(qkv + (int64_t)q_size * (bf16 ? 2 : 4), s->cos, s->sin, n, s->kv_heads, s->head_dim,
         s->rotary_dim, width, bf16, t);
    write_kv(l, s, qkv, width);
    paged_decode(qkv, width, l->k_pages, l->v_pages, attn, q_size, s->tables, s->width, s->lens,
                 n, s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_len, s->scale,
                 bf16, t, NULL);
    l->gemv[O](attn, q_size, l->blocks[O], l->block_stride[O], o, H, n, H, q_size, l->qtype[O],
               bf16, t);
    add_rows(h, o, (int64_t)n * H, bf16);
}

static void mlp(const chain_layer *l, const chain_step *s, char *h, char *xn, char *gate_up,
                char *act, char *o) {
    const int bf16 = s->bf16, t = s->threads, n = s->rows, H = s->hidden, I = s->inter;
    rms_norm(h, xn, l->post_norm, n, H, H, s->eps, bf16, t);
    l->gemv[GATE_UP](xn, H, l->blocks[GATE_UP], l->block_stride[GATE_UP], gate_up, 2 * I, n, 2 * I, H,
               l->qtype[GATE_UP], bf16, t);
    silu_mul(gate_up, act, n, I, bf16, t);
    l->gemv[DOWN](act, I, l->blocks[DOWN], l->block_stride[DOWN], o, H, n, H, I, l->qtype[DOWN],
               bf16, t);
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
    for (int i = 0; i < num_layers; i++) {
        attention(&layers[i], s, h, xn, wide, attn, o);
        mlp(&layers[i], s, h, xn, wide, act, o);
    }
    free(scratch);
}
#endif

/* Sixteen floats at a time (AVX-512), for the kernels that need them: exp and 2^x, the store that
 * rounds to bfloat16 as torch does, and bfloat16 dot pairs where the CPU has them. */
#pragma once
#include <immintrin.h>
#include <stdlib.h>

/* Sixteen values of the model's dtype (bfloat16 or float32) from p, as float32. */
static inline __attribute__((always_inline)) __m512 widen16(const char *p, const int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* convert.h's to_bf16 of each lane (nearest even, NaN stays NaN, denormals kept), in the
 * lane's low 16 bits. */
static inline __attribute__((always_inline)) __m512i bf16_bits16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* Rounded to nearest even into bfloat16, as convert.h's to_bf16 (NaN stays NaN); with
 * AVX512-BF16 by the CPU's own conversion, which also flushes denormals to zero. */
static inline __attribute__((always_inline)) void store16(char *p, __m512 x, const int bf16) {
    if (!bf16) return _mm512_storeu_ps(p, x);
#ifdef __AVX512BF16__
    return _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
#endif
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits16(x)));
}

/* Sixteen rows of sixteen 32-bit words transposed in place (row i, word c to row c, word i). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c]: word 4 l + c of rows i .. i + 3 in lane l */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8) /* lanes 0, 2 and 1, 3 of rows h .. h + 7 */
        for (int c = 0; c < 4; c++) {
            t[h + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0xdd);
        }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

/* exp(x) for a vector, Cephes' polynomial as in convert.h, 2^n applied by vscalefps. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* 2^x for a vector, Cephes' exp2f polynomial on [-0.5, 0.5] (~1e-7 relative), 2^n applied
 * by vscalefps. x is clamped to -126 and above: a masked score's -inf gives 2^-126, which no
 * float32 sum of ones and tenths notices, where a result below it would be denormal, and
 * every denormal a microcode assist (the kernel ran 1.3x slower). */
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f)), n);
}

/* Bytes on a 64-byte boundary: a tile's or a vector's rows then never straddle two cache lines
 * (malloc aligns to 16; tile stores and loads across lines ran prefill attention 1.4x slower). */
static inline void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* 2^x for probabilities that are rounded to bfloat16 next: a degree-3 fit on [-0.5, 0.5]
 * (7.7e-5 relative, against the 3.9e-3 of the rounding that follows; three FMAs fewer than
 * exp2_16). Clamped to -125: the fit is 0.99993 at 0, which would take -126 below the normals. */
static inline __attribute__((always_inline)) __m512 exp2_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.508868381e-2f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.426040515e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.932762417e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999289404e-1f)), n);
}

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
/* acc + the pairwise products of a and b, 32 bfloat16 each, summed in float32 per lane pair */
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#else
#define HAVE_DPBF16 0
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) { return acc; } /* never called */
#endif

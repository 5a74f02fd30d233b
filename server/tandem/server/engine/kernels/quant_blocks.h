/* GGUF's block formats as the block GEMVs (quant_gemv.c, quant_vnni.c) name them, and what
 * they share besides (quant_columns.h holds their column loop). */
#pragma once
#include <omp.h>

#include "convert.h"

#define INLINE static inline __attribute__((always_inline))
#define QK 32
#define MAX_ROWS 8
#define PARALLEL_WORK 65536 /* below this many weights one thread does it all */
/* ggml's type ids, as gguf.GGMLQuantizationType numbers them */
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8

/* Products of weights stored in groups of 32 inputs with int8 activation codes, with AVX-512
 * VNNI: a draft's few rows, or every row of an int4 or q8_0 target (each row is computed on its
 * own, so its result never depends on the others).
 *
 * A decode step multiplies one row (a few with trees or several sequences) by every weight of
 * the model, so its time is the bytes of weights streamed. These kernels stream each weight once
 * with its group's scale (and base), and keep the arithmetic small enough that memory, not
 * instructions, bounds it: one VPDPBUSD multiplies 64 unsigned 8-bit weight codes by 64 signed
 * 8-bit activation codes and adds them into 16 int32 sums.
 *
 * Weight layouts (built by specdec.engine.models.group_native): output channels in blocks of 16,
 * inputs in groups of 32, each (block, group) contiguous. Within a group, step t covers inputs
 * 4t..4t+3: byte 4r + c of its 64-byte vector is channel r's code for input 4t + c, so each
 * 32-bit lane r sums channel r.
 *   - int4 (320 bytes): 256 bytes of codes, 8 steps of 32 bytes; in step t, byte j holds in its
 *     low nibble the code for byte j of the vector and in its high nibble the one for byte
 *     j + 32. Then 16 fp16 scales s and 16 fp16 bases b: weight = s * code + b. fp16 rather
 *     than bf16: its 11-bit mantissa keeps a GGUF Q4_K group's scale (fp16 times a 6-bit
 *     integer) to within 2^-11, where bf16 loses 2^-8 (an RMS weight error of 0.07% against
 *     0.5% of the weights).
 *   - q8_0 (544 bytes, GGUF's Q8_0): 512 bytes of codes, 8 steps of 64, each code stored plus
 *     128 (so unsigned); then 16 fp16 scales: weight = s * (stored - 128).
 * Activations: each group of 32 is rounded to int8 with its own scale (max |x| / 127). Per
 * group, channel r gains
 *   int4: s_r * xscale * sum(code * xcode) + b_r * sum(x),
 *   q8_0: s_r * xscale * (sum(stored * xcode) - 128 * sum(xcode)), the integer part exact.
 * Every row is computed on its own in a fixed order, so a row's result never depends on the
 * other rows of the call.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "simd16.h"

#define GROUP 32
#define INT4_BYTES 320
#define Q8_0_BYTES 544
/* Each thread streams its blocks front to back; asking for the bytes this far ahead keeps enough
 * loads in flight that a one-row product runs at the memory's pace rather than one core's miss
 * latency (a draft forward's 97 products: 15 ms with no prefetch, 12 at 2 KiB ahead, about 11 at
 * 16 KiB, slower again at 32 KiB; 2-core Xeon). */
#define PREFETCH_BYTES 16384
#define ROW_TILE 8 /* rows sharing one pass over the weights (two zmm registers each) */

/* Each group of 32 of a row: int8 codes, their scale, the float sum and the codes' sum. */
static void quantize_row(const void *x, int x_bf16, int k, int8_t *codes, float *scales,
                         float *sums, int32_t *code_sums) {
    float v[GROUP];
    for (int g = 0; g < k / GROUP; g++) {
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < GROUP; i += 16)
            _mm512_storeu_ps(v + i, load16(x, g * GROUP + i, 16, x_bf16));
        for (int i = 0; i < GROUP; i++) {
            amax = fmaxf(amax, fabsf(v[i]));
            sum += v[i];
        }
        float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
        int32_t code_sum = 0;
        for (int i = 0; i < GROUP; i++) {
            codes[g * GROUP + i] = (int8_t)lrintf(v[i] * inverse);
            code_sum += codes[g * GROUP + i];
        }
        scales[g] = scale;
        sums[g] = sum;
        code_sums[g] = code_sum;
    }
}

static inline __m512 load_fp16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

enum format { INT4, Q8_0 };

/* The activation sums a group's result needs beside its integer products: the float sums (int4
 * bases) or the codes' sums (q8_0's offset of 128). */
struct row_codes {
    const int32_t *codes; /* 4 codes per int32, rows of k / 4 */
    const float *scales, *sums;
    const int32_t *code_sums;
};

/* One block of 16 channels for `rows` (1..ROW_TILE) rows; always inlined with constant `rows`
 * and `fmt` so the sums stay in registers. */
static inline __attribute__((always_inline)) void block_tile(
    const uint8_t *p, int groups, int rows, enum format fmt, struct row_codes a, int k4,
    __m512 *out) {
    const int bytes = fmt == INT4 ? INT4_BYTES : Q8_0_BYTES;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) out[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++, p += bytes) {
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)p + PREFETCH_BYTES + line, _MM_HINT_T0);
        __m512i acc[ROW_TILE];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            __m512i w;
            if (fmt == INT4) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 32 * t));
                __m256i lo = _mm256_and_si256(raw, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            } else {
                w = _mm512_loadu_si512((const void *)(p + 64 * t));
            }
            for (int m = 0; m < rows; m++)
                acc[m] = _mm512_dpbusd_epi32(
                    acc[m], w, _mm512_set1_epi32(a.codes[(size_t)m * k4 + g * 8 + t]));
        }
        __m512 s = load_fp16(p + (fmt == INT4 ? 256 : 512));
        for (int m = 0; m < rows; m++) {
            __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(a.scales[m * groups + g]));
            if (fmt == Q8_0)
                acc[m] = _mm512_sub_epi32(
                    acc[m], _mm512_set1_epi32(128 * a.code_sums[m * groups + g]));
            out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), step, out[m]);
            if (fmt == INT4)
                out[m] = _mm512_fmadd_ps(load_fp16(p + 288),
                                         _mm512_set1_ps(a.sums[m * groups + g]), out[m]);
        }
    }
}

static void store_tile(const __m512 *out, int rows, int channel, int n, const void *bias,
                       int io_bf16, void *y) {
    int left = n - channel;
    __m512 add = bias ? load16(bias, channel, left, io_bf16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++)
        store16(y, (int64_t)m * n + channel, _mm512_add_ps(out[m], add), left, io_bf16);
}

/* y[rows, n] = x[rows, k] @ W^T (+ bias): W packed in `fmt` with ceil(n / 16) blocks, x, y and
 * bias float32 (io_bf16 = 0) or bfloat16 (io_bf16 = 1), k a multiple of 32. Returns 0, or -1
 * where scratch memory could not be had. */
static int group_linear(enum format fmt, const uint8_t *w, int n, int k, const void *x, int rows,
                        const void *bias, int io_bf16, void *y) {
    int groups = k / GROUP, blocks = (n + 15) / 16;
    size_t element = io_bf16 ? 2 : 4, block_bytes = fmt == INT4 ? INT4_BYTES : Q8_0_BYTES;
    int8_t *codes = malloc((size_t)rows * k);
    float *scales = malloc(sizeof(float) * 3 * (size_t)rows * groups);
    if (!codes || !scales) {
        free(codes);
        free(scales);
        return -1;
    }
    float *sums = scales + (size_t)rows * groups;
    int32_t *code_sums = (int32_t *)(sums + (size_t)rows * groups);
    for (int m = 0; m < rows; m++)
        quantize_row((const char *)x + m * element * k, io_bf16, k, codes + (size_t)m * k,
                     scales + (size_t)m * groups, sums + (size_t)m * groups,
                     code_sums + (size_t)m * groups);
#pragma omp parallel for schedule(static)
    for (int block = 0; block < blocks; block++) {
        const uint8_t *p = w + (size_t)block * groups * block_bytes;
        for (int m0 = 0; m0 < rows; m0 += ROW_TILE) {
            int tile = rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE;
            size_t at = (size_t)m0 * groups;
            struct row_codes a = {(const int32_t *)(codes + (size_t)m0 * k), scales + at,
                                  sums + at, code_sums + at};
            __m512 out[ROW_TILE];
            switch (tile * 2 + (fmt == Q8_0)) {
#define TILE(R)                                                 \
    case 2 * R:                                                 \
        block_tile(p, groups, R, INT4, a, k / 4, out);          \
        break;                                                  \
    case 2 * R + 1:                                             \
        block_tile(p, groups, R, Q8_0, a, k / 4, out);          \
        break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
            }
            store_tile(out, tile, block * 16, n, bias, io_bf16,
                       (char *)y + (size_t)m0 * n * element);
        }
    }
    free(codes);
    free(scales);
    return 0;
}

int int4_linear(const uint8_t *w, int n, int k, const void *x, int rows, const void *bias,
                int io_bf16, void *y) {
    return group_linear(INT4, w, n, k, x, rows, bias, io_bf16, y);
}

int q8_0_linear(const uint8_t *w, int n, int k, const void *x, int rows, const void *bias,
                int io_bf16, void *y) {
    return group_linear(Q8_0, w, n, k, x, rows, bias, io_bf16, y);
}

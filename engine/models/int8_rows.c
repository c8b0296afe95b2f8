/* The int8 target's per-row activation map and its undoing, one call each (see Int8RowScaled in
 * quant.py): each row of x is mapped onto integer codes from 0 (its minimum) to `levels` (its
 * maximum), which the int8 product multiplies as they are; the product's sums are then turned
 * back into the row's output, y = step * (W codes) + (lo * (W 1) + bias).
 *
 * Every row is computed on its own with float32 IEEE operations, the multiply-adds fused where
 * they are written and nowhere else (the library is built with -ffp-contract=off), so a row's
 * codes and output never depend on the other rows: greedy speculative output of the int8 target
 * stays equal to its plain output whichever product kernel the row count picks. The operations
 * are the torch path's (aminmax, a division, round half to even, addcmul, which fuses its
 * multiply-add on the AVX-512 CPUs measured): there the outputs match it bit for bit. Long
 * outputs (the lm_head's) are split over the OpenMP threads.
 */
#include "simd16.h"

#define PARALLEL_VALUES 65536

/* codes[r, i] = round_half_even((x[r, i] - lo[r]) / step[r]), with lo the row's minimum and
 * step = max(hi - lo, FLT_MIN) / levels. */
void int8_row_codes(const void *x, int rows, int k, int bf16, float levels, float *codes,
                    float *lo, float *step) {
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)x + (size_t)r * k * (bf16 ? 2 : 4);
        __m512 first = _mm512_set1_ps(load16(row, 0, 1, bf16)[0]);
        __m512 low = first, high = first;
        for (int i = 0; i < k; i += 16) {
            __mmask16 m = lanes(k - i);
            __m512 v = load16(row, i, k - i, bf16);
            low = _mm512_mask_min_ps(low, m, low, v);
            high = _mm512_mask_max_ps(high, m, high, v);
        }
        float lo_r = _mm512_reduce_min_ps(low), range = _mm512_reduce_max_ps(high) - lo_r;
        float s = (range > 1.17549435e-38f ? range : 1.17549435e-38f) / levels;
        __m512 lo_v = _mm512_set1_ps(lo_r), s_v = _mm512_set1_ps(s);
        float *out = codes + (size_t)r * k;
        for (int i = 0; i < k; i += 16) {
            __m512 q = _mm512_div_ps(_mm512_sub_ps(load16(row, i, k - i, bf16), lo_v), s_v);
            q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm512_mask_storeu_ps(out + i, lanes(k - i), q);
        }
        lo[r] = lo_r;
        step[r] = s;
    }
}

/* y[r, c] = fma(w_codes[r, c], step[r], fma(lo[r], row_sums[c], bias[c])), rounded to y's
 * dtype; bias may be NULL (then lo[r] * row_sums[c] is the inner term). */
void int8_row_output(const float *w_codes, int rows, int n, const float *lo, const float *step,
                     const float *row_sums, const void *bias, int bf16, void *y) {
    size_t element = bf16 ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        const float *in = w_codes + (size_t)r * n;
        char *out = (char *)y + (size_t)r * n * element;
        __m512 lo_v = _mm512_set1_ps(lo[r]), step_v = _mm512_set1_ps(step[r]);
#pragma omp parallel for if (n >= PARALLEL_VALUES)
        for (int c = 0; c < n; c += 16) {
            __mmask16 m = lanes(n - c);
            __m512 sums = _mm512_maskz_loadu_ps(m, row_sums + c);
            __m512 offset = bias ? _mm512_fmadd_ps(lo_v, sums, load16(bias, c, n - c, bf16))
                                 : _mm512_mul_ps(lo_v, sums);
            __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, in + c), step_v, offset);
            store16(out, c, v, n - c, bf16);
        }
    }
}

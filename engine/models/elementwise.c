/* A decoder layer's element-wise work for one call each: RMSNorm (with the residual add folded
 * in), SiLU-and-multiply, rotary embedding. A CPU decode step of a small model is mostly such
 * calls; in torch each of them is several kernels with a few microseconds of dispatch each.
 *
 * Every value is computed in float32 and rounded once to the tensor's dtype (float32 or bf16,
 * round to nearest even), each row on its own: a row's result never depends on the other rows.
 * The rounding differs from the torch layers' (they round between steps), so these serve quantized
 * models, whose numbers are the quantized weights' and not the checkpoint's reference ones. Rows
 * are split across the OpenMP threads once there are enough of them to pay for waking them.
 */
#include <math.h>

#include "simd16.h"

#define PARALLEL_ROWS 8

/* out = weight * v / rms(v) for one row of n values held in `v` (float32). */
static void norm_row(const float *v, const void *weight, int n, float eps, int bf16, void *out) {
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 x = _mm512_maskz_loadu_ps(lanes(n - i), v + i);
        squares = _mm512_fmadd_ps(x, x, squares);
    }
    __m512 inverse = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        __m512 x = _mm512_maskz_loadu_ps(lanes(n - i), v + i);
        __m512 w = load16(weight, i, n - i, bf16);
        store16(out, i, _mm512_mul_ps(_mm512_mul_ps(x, inverse), w), n - i, bf16);
    }
}

/* out[r] = weight * x[r] / rms(x[r]); n <= 16384. */
void rms_norm(const void *x, const void *weight, int rows, int n, float eps, int bf16, void *out) {
    size_t element = bf16 ? 2 : 4;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float v[16384];
        const char *row = (const char *)x + (size_t)r * n * element;
        for (int i = 0; i < n; i += 16)
            _mm512_mask_storeu_ps(v + i, lanes(n - i), load16(row, i, n - i, bf16));
        norm_row(v, weight, n, eps, bf16, (char *)out + (size_t)r * n * element);
    }
}

/* In place: residual[r] += x[r] (rounded to the dtype), then x[r] = norm(residual[r]). */
void add_rms_norm(void *x, void *residual, const void *weight, int rows, int n, float eps,
                  int bf16) {
    size_t element = bf16 ? 2 : 4;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float v[16384];
        char *xr = (char *)x + (size_t)r * n * element;
        char *rr = (char *)residual + (size_t)r * n * element;
        for (int i = 0; i < n; i += 16) {
            __m512 sum = _mm512_add_ps(load16(xr, i, n - i, bf16), load16(rr, i, n - i, bf16));
            store16(rr, i, sum, n - i, bf16);
            _mm512_mask_storeu_ps(v + i, lanes(n - i), load16(rr, i, n - i, bf16));
        }
        norm_row(v, weight, n, eps, bf16, xr);
    }
}

/* exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7
 * (relative error under 2e-7), times 2^n. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]. */
void silu_and_mul(const void *gate_up, int rows, int n, int bf16, void *out) {
    size_t element = bf16 ? 2 : 4;
    const __m512 one = _mm512_set1_ps(1.f);
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const char *in = (const char *)gate_up + (size_t)r * 2 * n * element;
        char *o = (char *)out + (size_t)r * n * element;
        for (int i = 0; i < n; i += 16) {
            __m512 gate = load16(in, i, n - i, bf16), up = load16(in, (size_t)n + i, n - i, bf16);
            __m512 sigmoid = _mm512_div_ps(
                one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
            store16(o, i, _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid), up), n - i, bf16);
        }
    }
}

static void rotate_heads(char *x, int heads, int head_dim, const float *cos, const float *sin,
                         int bf16) {
    size_t element = bf16 ? 2 : 4;
    int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        char *head = x + (size_t)h * head_dim * element;
        for (int i = 0; i < half; i += 16) {
            int left = half - i;
            __m512 c = _mm512_maskz_loadu_ps(lanes(left), cos + i);
            __m512 s = _mm512_maskz_loadu_ps(lanes(left), sin + i);
            __m512 x1 = load16(head, i, left, bf16), x2 = load16(head, (size_t)half + i, left, bf16);
            store16(head, i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), left, bf16);
            store16(head, (size_t)half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), left,
                    bf16);
        }
    }
}

/* In place, rotate-half: q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim], each
 * token `*_stride` elements after the previous, heads contiguous; cos_sin [positions, head_dim]:
 * the cos half, then the sin half. */
void rope(const int64_t *positions, int tokens, void *q, int64_t q_stride, int q_heads, void *k,
          int64_t k_stride, int k_heads, int head_dim, const float *cos_sin, int bf16) {
    size_t element = bf16 ? 2 : 4;
#pragma omp parallel for if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++) {
        const float *cos = cos_sin + positions[t] * head_dim, *sin = cos + head_dim / 2;
        rotate_heads((char *)q + t * q_stride * element, q_heads, head_dim, cos, sin, bf16);
        rotate_heads((char *)k + t * k_stride * element, k_heads, head_dim, cos, sin, bf16);
    }
}

/* Attention of single query rows over paged keys and values, read in place, for the torch
 * backend's rows that are sampled from (decodes, verifies, tree nodes).
 *
 * In the torch backend each such row costs a handful of small torch calls per layer (two page
 * gathers, the dtype view, SDPA): at one row and a few hundred keys their fixed overhead is most
 * of the layer's attention time. This kernel takes every such row of a step in one call per
 * layer and reads the pool's pages where they lie.
 *
 * A row attends over an explicit, ordered list of key positions of its sequence (a chain row
 * over 0..n-1, a tree node over the committed keys and its ancestors), and is computed on its
 * own, in a fixed order, in float32: scores, their maximum, exp(score - max), the weighted sum of
 * values, divided by the weights' sum, rounded once to the model dtype. So a verified or tree row
 * gets bit for bit the result of the plain decode of its position, whose keys are the same
 * values in the same order. exp is a vectorised polynomial of its own (below), so the result
 * does not depend on the C library.
 *
 * Pool layout (the engine's): [blocks, page_size, kv_heads, dim] per layer, float32 or bf16.
 */
#include <math.h>
#include <stdlib.h>

#include "simd16.h"

#define MAX_VECTORS 16 /* head_dim up to 256 */

/* exp(x) for 16 lanes of x <= 0 (scores minus their maximum): 2^k * e^r with |r| <= ln2 / 2,
 * e^r by a degree-7 Taylor polynomial (relative error below 1e-7 there); below -87 it is 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, ln2_hi)), _mm512_mul_ps(k, ln2_lo));
    static const float c[] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f,
                              1.f / 6.f,    0.5f,        1.f,         1.f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c[i]));
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, p, k);
}

/* The address of key position p's row for KV head g: its block, its slot in the block, its head. */
static inline const char *pool_row(const void *cache, const int64_t *blocks, int p, int page_size,
                                   size_t key_stride, size_t head_bytes, int g) {
    return (const char *)cache + ((size_t)blocks[p / page_size] * page_size + p % page_size) * key_stride
           + (size_t)g * head_bytes;
}

/* For each of `n_rows` rows r and each query head h: out[row[r], h] = softmax(scale * q . K) V
 * over the keys at positions keys[key_start[r] .. key_start[r + 1]) of the sequence whose block
 * ids start at pages[page_start[r]]. q and out are [tokens, heads, dim] (contiguous, dim a
 * multiple of 16 up to 16 * MAX_VECTORS), in the pool's dtype (bf16 = 1: bfloat16, else float32). The query heads that
 * share a KV head are computed together, so each key and value row is read and widened once for
 * all of them. Returns 0, or -1 without scratch memory. */
int paged_attention_rows(const void *q, const void *k_cache, const void *v_cache,
                         int page_size, int kv_heads, int heads, int dim,
                         const int64_t *pages, const int32_t *row, const int32_t *page_start,
                         const int32_t *key_start, const int32_t *keys, int n_rows, float scale,
                         int bf16, void *out) {
    const int group = heads / kv_heads, vectors = dim / 16;
    const size_t element = bf16 ? 2 : 4;
    const size_t head_bytes = (size_t)dim * element, key_stride = kv_heads * head_bytes;
    int failed = 0;
#pragma omp parallel
    {
        int capacity = 0;
        float *weights = NULL; /* [group][capacity] */
        float *qf = malloc(sizeof(float) * (size_t)group * dim);
        float *acc = malloc(sizeof(float) * (size_t)group * dim);
        __m512 kv[MAX_VECTORS]; /* one key or value row, widened */
        if (!qf || !acc) failed = 1;
#pragma omp for schedule(dynamic)
        for (int task = 0; task < n_rows * kv_heads; task++) {
            if (failed) continue;
            int r = task / kv_heads, g = task % kv_heads;
            int n = key_start[r + 1] - key_start[r];
            if (n > capacity) {
                float *grown = realloc(weights, sizeof(float) * (size_t)group * n);
                if (!grown) {
                    failed = 1;
                    continue;
                }
                weights = grown;
                capacity = n;
            }
            const int32_t *positions = keys + key_start[r];
            const int64_t *blocks = pages + page_start[r];
            size_t heads_at = ((size_t)row[r] * heads + (size_t)g * group) * dim;
            for (int i = 0; i < group * dim; i += 16)
                _mm512_storeu_ps(qf + i, load16(q, heads_at + i, 16, bf16));
            for (int j = 0; j < n; j++) {
                const char *k_row = pool_row(k_cache, blocks, positions[j], page_size, key_stride,
                                             head_bytes, g);
                for (int i = 0; i < vectors; i++) kv[i] = load16(k_row, 16 * i, 16, bf16);
                for (int h = 0; h < group; h++) {
                    __m512 sum = _mm512_setzero_ps();
                    for (int i = 0; i < vectors; i++)
                        sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * dim + 16 * i), kv[i], sum);
                    weights[(size_t)h * capacity + j] = scale * _mm512_reduce_add_ps(sum);
                }
            }
            float inverse_total[group];
            for (int h = 0; h < group; h++) {
                float *w = weights + (size_t)h * capacity, top = -INFINITY;
                for (int j = 0; j < n; j++) top = w[j] > top ? w[j] : top;
                __m512 sums = _mm512_setzero_ps();
                for (int j = 0; j < n; j += 16) {
                    __mmask16 m = lanes(n - j);
                    __m512 e = exp_nonpositive(
                        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, w + j), _mm512_set1_ps(top)));
                    e = _mm512_maskz_mov_ps(m, e);
                    _mm512_mask_storeu_ps(w + j, m, e);
                    sums = _mm512_add_ps(sums, e);
                }
                inverse_total[h] = 1.f / _mm512_reduce_add_ps(sums);
            }
            for (int i = 0; i < group * dim; i++) acc[i] = 0.f;
            for (int j = 0; j < n; j++) {
                const char *v_row = pool_row(v_cache, blocks, positions[j], page_size, key_stride,
                                             head_bytes, g);
                for (int i = 0; i < vectors; i++) kv[i] = load16(v_row, 16 * i, 16, bf16);
                for (int h = 0; h < group; h++) {
                    __m512 w = _mm512_set1_ps(weights[(size_t)h * capacity + j]);
                    float *a = acc + h * dim;
                    for (int i = 0; i < vectors; i++)
                        _mm512_storeu_ps(a + 16 * i,
                                         _mm512_fmadd_ps(w, kv[i], _mm512_loadu_ps(a + 16 * i)));
                }
            }
            for (int h = 0; h < group; h++) {
                __m512 inverse = _mm512_set1_ps(inverse_total[h]);
                for (int i = 0; i < vectors; i++)
                    store16(out, heads_at + (size_t)h * dim + 16 * i,
                            _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + 16 * i), inverse), 16,
                            bf16);
            }
        }
        free(weights);
        free(qf);
        free(acc);
    }
    return failed ? -1 : 0;
}

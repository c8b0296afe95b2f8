// Counter-based noise of `specdec.engine.noise` (splitmix64 streams, one per key) and the
// exponential race of `specdec.engine.sampling.sample`, fused so that no [rows, n] temporary
// is written: the torch ops make about fifteen passes over int64 temporaries of that size.
//
// Element i of the stream keyed by `key` is mix(key + (i + 1) * GAMMA) in unsigned 64-bit
// arithmetic; its uniform is (top 53 bits + 0.5) * 2^-53 in IEEE double, bit for bit what the
// torch ops compute (the conversion of a 53-bit integer is exact, the addition rounds to nearest,
// the scaling by a power of two is exact). Its exponential is -log(u) rounded to float32, with
// log computed here to a few units in the last place of double, so it equals the torch ops' value
// except where two float64 logs that differ in their last bits round to neighbouring floats
// (about one element in 10^8): "to the rounding of log", as between CPU and CUDA.

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16384  // elements per task: one row splits so that every thread gets work

static const uint64_t GAMMA = 0x9E3779B97F4A7C15ULL;

static inline uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline double uniform_at(uint64_t key, int64_t i) {
    const uint64_t x = mix64(key + (uint64_t)(i + 1) * GAMMA);
    return ((double)(x >> 11) + 0.5) * 0x1p-53;
}

// -log(u) for a normal u in (0, 1): u = 2^e m with m in [sqrt(1/2), sqrt(2)), and
// log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, whose series to s^23 is exact to double
// precision. Branch-free, so the loops that call it vectorise.
static inline float exponential_of(double u) {
    uint64_t bits;
    memcpy(&bits, &u, sizeof bits);
    double e = (double)((int64_t)(bits >> 52) - 1023);
    const uint64_t mantissa = (bits & 0x000FFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL;
    double m;
    memcpy(&m, &mantissa, sizeof m);  // [1, 2)
    const int high = m > 1.4142135623730951;
    m = high ? 0.5 * m : m;
    e = high ? e + 1.0 : e;
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 23.0;
    p = p * s2 + 1.0 / 21.0;
    p = p * s2 + 1.0 / 19.0;
    p = p * s2 + 1.0 / 17.0;
    p = p * s2 + 1.0 / 15.0;
    p = p * s2 + 1.0 / 13.0;
    p = p * s2 + 1.0 / 11.0;
    p = p * s2 + 1.0 / 9.0;
    p = p * s2 + 1.0 / 7.0;
    p = p * s2 + 1.0 / 5.0;
    p = p * s2 + 1.0 / 3.0;
    // ln 2 split so that e * LN2_HI is exact for |e| < 2^11.
    const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
    const double log_u = e * LN2_HI + (2.0 * s + (2.0 * s * s2 * p + e * LN2_LO));
    const float out = (float)-log_u;
    return out < FLT_MIN ? FLT_MIN : out;
}

// keys [rows] (int64 words read as unsigned), out [rows, n] float32 Exp(1) draws, >= FLT_MIN.
void noise_exponentials(const int64_t *keys, int rows, int64_t n, float *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < (int64_t)rows * blocks; b++) {
        const int64_t r = b / blocks, start = (b % blocks) * BLOCK;
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        const uint64_t key = (uint64_t)keys[r];
#pragma omp simd
        for (int64_t i = start; i < end; i++) out[r * n + i] = exponential_of(uniform_at(key, i));
    }
}

// keys [rows], probs [rows, n] float32 (unnormalised, >= 0), out [rows]: argmax_i p_i / E_i,
// the first index among equal maxima (as torch's argmax). Returns 0, or -1 without memory.
int noise_race(const int64_t *keys, int rows, int64_t n, const float *probs, int64_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    float *best = (float *)malloc(sizeof(float) * rows * blocks);
    int64_t *where = (int64_t *)malloc(sizeof(int64_t) * rows * blocks);
    if (best == NULL || where == NULL) {
        free(best);
        free(where);
        return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < (int64_t)rows * blocks; b++) {
        const int64_t r = b / blocks, start = (b % blocks) * BLOCK;
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        const uint64_t key = (uint64_t)keys[r];
        const float *p = probs + r * n;
        float ratio[BLOCK];
#pragma omp simd
        for (int64_t i = start; i < end; i++)
            ratio[i - start] = p[i] / exponential_of(uniform_at(key, i));
        float top = -1.0f;
        int64_t at = start;
        for (int64_t i = start; i < end; i++) {
            if (ratio[i - start] > top) {
                top = ratio[i - start];
                at = i;
            }
        }
        best[b] = top;
        where[b] = at;
    }
    for (int r = 0; r < rows; r++) {
        int64_t b = (int64_t)r * blocks, pick = b;
        for (int64_t c = b + 1; c < b + blocks; c++) pick = best[c] > best[pick] ? c : pick;
        out[r] = where[pick];
    }
    free(best);
    free(where);
    return 0;
}

// out[m, n] = sum_k x[m, k] * w[n, k] for any number of rows against int8 weights
// in groups of 32 along k, one bf16 scale per group: kvchat's CPU weight format.
//
// Why its own kernel: a product with 8 rows does 8 multiply-adds per weight read, so it is bound
// by arithmetic, not by reading the weights. In fp32 each weight is first widened to a float;
// here the activations are rounded to int16 per group of 32 (one fp32 scale each, 15 bits, far
// finer than the weights' 8) and vpdpwssd does 32 integer multiply-adds per instruction.
//
// Layouts (made by int8_rows.py's pack): codes [N/16][K/2][16][2], so one 32-byte load is 16
// outputs by 2 k, which vpdpwssd pairs with a broadcast of the row's 2 k; scales [N/16][K/32][16].
// Each row's sums run in the same order whatever rows share the call: a batch's rows equal the
// rows computed alone, bit for bit.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define KVCHAT_ISA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

static const int TILE = 16, GROUP = 32, ROWS = 8;

KVCHAT_ISA static void quantize(const float* x, int64_t k, int16_t* q, float* scale) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float* v = x + g * GROUP;
        __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        // 32767 / top overflows below about 1e-34: a margin, as the twin's
        __m512 inv = _mm512_set1_ps(top > 1e-30f ? 32767.0f / top : 0.0f);
        // round to nearest even, as torch.round in the twin
        _mm256_storeu_si256((__m256i*)(q + g * GROUP), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
        _mm256_storeu_si256((__m256i*)(q + g * GROUP + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
        scale[g] = top / 32767.0f;
    }
}

template <int R>
KVCHAT_ISA static void tile(const int16_t* q, const float* qs, int64_t k, const int8_t* w, const uint16_t* ws,
                            float* out, int64_t n) {
    const int64_t groups = k / GROUP;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        const int8_t* wg = w + g * GROUP * TILE;
        for (int p = 0; p < GROUP / 2; p++) {
            __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wg + p * 2 * TILE)));
            for (int r = 0; r < R; r++) {
                int32_t xs2;
                __builtin_memcpy(&xs2, q + r * k + g * GROUP + 2 * p, 4);
                sums[r] = _mm512_dpwssd_epi32(sums[r], pair, _mm512_set1_epi32(xs2));
            }
        }
        // bf16 to fp32: the bf16 bits are the float's top half
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(ws + g * TILE))), 16));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(qs[r * groups + g])),
                                     scale, acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

typedef void (*tile_fn)(const int16_t*, const float*, int64_t, const int8_t*, const uint16_t*, float*, int64_t);
static const tile_fn TILES[ROWS + 1] = {0, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

// x [m, k] fp32; w, ws packed as above for n outputs; out [m, n] fp32. k % 32 == 0, n % 16 == 0.
// Returns 0, or 1 when the rows' int16 copy could not be allocated.
extern "C" KVCHAT_ISA int kvchat_int8_rows(const float* x, int64_t m, int64_t k, const int8_t* w, const uint16_t* ws,
                                           int64_t n, float* out, int threads) {
    const int64_t groups = k / GROUP;
    if (m == 0) return 0;  // malloc(0) may be NULL
    int16_t* q = (int16_t*)malloc(sizeof(int16_t) * m * k);
    float* qs = (float*)malloc(sizeof(float) * m * groups);
    if (!q || !qs) {  // out of memory: the caller raises
        free(q);
        free(qs);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (m >= 16)
    for (int64_t r = 0; r < m; r++) quantize(x + r * k, k, q + r * k, qs + r * groups);
    const int64_t blocks = (m + ROWS - 1) / ROWS;
    // tiles outer: a thread's row blocks of one tile find its weights in L1
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n / TILE; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r = b * ROWS, rows = m - r < ROWS ? m - r : ROWS;
            TILES[rows](q + r * k, qs + r * groups, k, w + t * k * TILE, ws + t * groups * TILE,
                        out + r * n + t * TILE, n);
        }
    }
    free(q);
    free(qs);
    return 0;
}

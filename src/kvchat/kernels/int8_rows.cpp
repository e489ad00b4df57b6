// out[m, n] = sum_k x[m, k] * w[n, k] for any number of rows against int8 weights
// in groups of 32 along k, one bf16 scale per group: kvchat's CPU weight format.
//
// Why its own kernel: a product with 8 rows does 8 multiply-adds per weight read, so it is bound
// by arithmetic, not by reading the weights; and one row through inductor's int8-to-float loops
// depends on how the compiler vectorises them (g++ on AVX2 ran them 5x slower than clang). Here
// the activations are rounded to int16 per group of 32 (one fp32 scale each, 15 bits, far finer
// than the weights' 8) and the products are integer multiply-adds.
//
// One kernel per x86-64 instruction set, chosen at run time by the caller (int8_rows.py), as
// ggml-cpu does: AVX-512 VNNI (vpdpwssd on zmm, 16 outputs a register), AVX-VNNI (vpdpwssd on
// ymm) and AVX2 (vpmaddwd + vpaddd on ymm), 8 outputs a register for the last two. Each function
// carries its own target attribute, so one build holds all three whatever the build's flags.
//
// 4-bit weights (kvchat_int4_rows) run on the same rows and dot instructions: codes 0..15 in
// groups of 32 with a bf16 scale and zero each, w = (q - 8) * scale + zero (torch's int4 layout,
// into which a GGUF's Q4_1 blocks are found again), two codes a byte; a row's sum of each group,
// times the zero, adds the zeros' part.
//
// Layouts (made by int8_rows.py's pack): codes [N/16][K/2][16][2], so one 32-byte load is 16
// outputs by 2 k, which the dot instruction pairs with a broadcast of the row's 2 k (a ymm kernel
// takes it as two 16-byte halves: outputs 0-7 and 8-15); scales [N/16][K/32][16]. 4-bit codes
// [N/16][K/4][16][2] bytes: byte (o, t) of chunk c holds k = 4c + t of output o in its low nibble
// and k = 4c + 2 + t in its high one, so one 32-byte load widened to int16 and masked is the int8
// layout's pair 2c, and shifted its pair 2c + 1.
// The integer sums are exact and each lane's float steps are the same in every variant, so the
// three give the same bits; and each row's sums run in the same order whatever rows share the
// call: a batch's rows equal the rows computed alone, bit for bit.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define KVCHAT_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define KVCHAT_AVX2 __attribute__((target("avx2,fma")))
// AVX-VNNI came with GCC 11 and clang 12: an older compiler fills its slot with the AVX2 tiles
// (the same bits), rather than failing the whole build
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define KVCHAT_AVX_VNNI __attribute__((target("avx2,fma,avxvnni")))
#define DOT_AVX_VNNI(sum, w, x) _mm256_dpwssd_avx_epi32(sum, w, x)
#else
#define KVCHAT_AVX_VNNI KVCHAT_AVX2
#define DOT_AVX_VNNI(sum, w, x) DOT_AVX2(sum, w, x)
#endif

enum { ISA_AVX2 = 0, ISA_AVX_VNNI = 1, ISA_AVX512_VNNI = 2 };
static const int TILE = 16, GROUP = 32, ROWS_512 = 8, ROWS_256 = 4;

// 32767 / top overflows below about 1e-34: a margin, as the twin's
static inline float inverse(float top) { return top > 1e-30f ? 32767.0f / top : 0.0f; }

// Each group's plain sum, for the 4-bit zeros: in one order whatever the ISA (the same bits).
static void group_sums(const float* x, int64_t k, float* sums) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        float s = 0.0f;
        for (int i = 0; i < GROUP; i++) s += x[g * GROUP + i];
        sums[g] = s;
    }
}

KVCHAT_AVX512_VNNI static void quantize_512(const float* x, int64_t k, int16_t* q, float* scale) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float* v = x + g * GROUP;
        __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        __m512 inv = _mm512_set1_ps(inverse(top));
        // round to nearest even, as torch.round in the twin
        _mm256_storeu_si256((__m256i*)(q + g * GROUP), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
        _mm256_storeu_si256((__m256i*)(q + g * GROUP + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
        scale[g] = top / 32767.0f;
    }
}

KVCHAT_AVX2 static void quantize_256(const float* x, int64_t k, int16_t* q, float* scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float* v = x + g * GROUP;
        __m256 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(v + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        __m256 inv = _mm256_set1_ps(inverse(top));
        for (int i = 0; i < 4; i += 2) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv)), hi = _mm256_cvtps_epi32(_mm256_mul_ps(a[i + 1], inv));
            // packs works within 128-bit lanes: the permute puts the 16 values back in order
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i*)(q + g * GROUP + 8 * i), packed);
        }
        scale[g] = top / 32767.0f;
    }
}

// A dot instruction waits for its accumulator's last one (about 5 cycles): with one row, one
// chain of them held a core to 19 GB/s of weights. Fewer rows get more chains, summed at the
// group's end (integer sums: the order changes nothing).
#define CHAINS_512(R) ((R) >= 4 ? 1 : (R) >= 2 ? 2 : 4)
#define CHAINS_256(R) ((R) >= 2 ? 1 : 2)

template <int R>
KVCHAT_AVX512_VNNI static void tile_512(const int16_t* q, const float* qs, int64_t k, const int8_t* w,
                                        const uint16_t* ws, float* out, int64_t n) {
    const int64_t groups = k / GROUP;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[R][CHAINS_512(R)];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CHAINS_512(R); c++) sums[r][c] = _mm512_setzero_si512();
        const int8_t* wg = w + g * GROUP * TILE;
        for (int p = 0; p < GROUP / 2; p++) {
            __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wg + p * 2 * TILE)));
            for (int r = 0; r < R; r++) {
                int32_t xs2;
                __builtin_memcpy(&xs2, q + r * k + g * GROUP + 2 * p, 4);
                __m512i& sum = sums[r][p % CHAINS_512(R)];
                sum = _mm512_dpwssd_epi32(sum, pair, _mm512_set1_epi32(xs2));
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 1; c < CHAINS_512(R); c++) sums[r][0] = _mm512_add_epi32(sums[r][0], sums[r][c]);
        // bf16 to fp32: the bf16 bits are the float's top half
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(ws + g * TILE))), 16));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][0]), _mm512_set1_ps(qs[r * groups + g])),
                                     scale, acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

static inline float bf16(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float f;
    __builtin_memcpy(&f, &wide, 4);
    return f;
}

template <int R>
KVCHAT_AVX512_VNNI static void tile4_512(const int16_t* q, const float* qs, const float* xs, int64_t k,
                                         const uint8_t* w, const uint16_t* ws, const uint16_t* wz, float* out,
                                         int64_t n) {
    const int64_t groups = k / GROUP;
    const __m512i low = _mm512_set1_epi16(0x0F), eight = _mm512_set1_epi16(8);
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[R][2];
        for (int r = 0; r < R; r++) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
        const uint8_t* wg = w + g * GROUP * TILE / 2;
        for (int c = 0; c < GROUP / 4; c++) {
            __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wg + c * 2 * TILE)));
            __m512i even = _mm512_sub_epi16(_mm512_and_si512(bytes, low), eight);
            __m512i odd = _mm512_sub_epi16(_mm512_srli_epi16(bytes, 4), eight);
            for (int r = 0; r < R; r++) {
                int32_t x0, x1;
                __builtin_memcpy(&x0, q + r * k + g * GROUP + 4 * c, 4);
                __builtin_memcpy(&x1, q + r * k + g * GROUP + 4 * c + 2, 4);
                sums[r][0] = _mm512_dpwssd_epi32(sums[r][0], even, _mm512_set1_epi32(x0));
                sums[r][1] = _mm512_dpwssd_epi32(sums[r][1], odd, _mm512_set1_epi32(x1));
            }
        }
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(ws + g * TILE))), 16));
        __m512 zero = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wz + g * TILE))), 16));
        for (int r = 0; r < R; r++) {
            __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[r][0], sums[r][1]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dots, _mm512_set1_ps(qs[r * groups + g])), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * groups + g]), zero, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

// a ymm tile's R rows of 16 sums, two registers a row
template <int R>
KVCHAT_AVX2 static inline void store_256(const __m256 acc[][2], float* out, int64_t n) {
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * n, acc[r][0]);
        _mm256_storeu_ps(out + r * n + 8, acc[r][1]);
    }
}

#define TILE4_256(NAME, ISA, DOT)                                                                                 \
    template <int R>                                                                                              \
    ISA static void NAME(const int16_t* q, const float* qs, const float* xs, int64_t k, const uint8_t* w,          \
                         const uint16_t* ws, const uint16_t* wz, float* out, int64_t n) {                         \
        const int64_t groups = k / GROUP;                                                                         \
        const __m256i low = _mm256_set1_epi16(0x0F), eight = _mm256_set1_epi16(8);                                \
        __m256 acc[R][2];                                                                                         \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                  \
        for (int64_t g = 0; g < groups; g++) {                                                                    \
            __m256i sums[R][2][2];                                                                                \
            for (int r = 0; r < R; r++)                                                                           \
                sums[r][0][0] = sums[r][0][1] = sums[r][1][0] = sums[r][1][1] = _mm256_setzero_si256();           \
            const uint8_t* wg = w + g * GROUP * TILE / 2;                                                         \
            for (int c = 0; c < GROUP / 4; c++) {                                                                 \
                for (int h = 0; h < 2; h++) {                                                                     \
                    __m256i bytes = _mm256_cvtepu8_epi16(                                                         \
                        _mm_loadu_si128((const __m128i*)(wg + c * 2 * TILE + h * TILE)));                         \
                    __m256i even = _mm256_sub_epi16(_mm256_and_si256(bytes, low), eight);                         \
                    __m256i odd = _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), eight);                           \
                    for (int r = 0; r < R; r++) {                                                                 \
                        int32_t x0, x1;                                                                           \
                        __builtin_memcpy(&x0, q + r * k + g * GROUP + 4 * c, 4);                                  \
                        __builtin_memcpy(&x1, q + r * k + g * GROUP + 4 * c + 2, 4);                              \
                        sums[r][h][0] = DOT(sums[r][h][0], even, _mm256_set1_epi32(x0));                          \
                        sums[r][h][1] = DOT(sums[r][h][1], odd, _mm256_set1_epi32(x1));                           \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
            for (int h = 0; h < 2; h++) {                                                                         \
                __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(                                             \
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(ws + g * TILE + 8 * h))), 16));        \
                __m256 zero = _mm256_castsi256_ps(_mm256_slli_epi32(                                              \
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wz + g * TILE + 8 * h))), 16));        \
                for (int r = 0; r < R; r++) {                                                                     \
                    __m256 dots = _mm256_cvtepi32_ps(_mm256_add_epi32(sums[r][h][0], sums[r][h][1]));             \
                    acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dots, _mm256_set1_ps(qs[r * groups + g])), scale,   \
                                                acc[r][h]);                                                       \
                    acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xs[r * groups + g]), zero, acc[r][h]);             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        store_256<R>(acc, out, n);                                                                                \
    }

// The ymm kernels differ only in their dot instruction. vpmaddwd's pair sums cannot overflow here
// (weights within +-127), so adding them equals vpdpwssd's fused sum.
#define DOT_AVX2(sum, w, x) _mm256_add_epi32(sum, _mm256_madd_epi16(w, x))
#define TILE_256(NAME, ISA, DOT)                                                                                  \
    template <int R>                                                                                              \
    ISA static void NAME(const int16_t* q, const float* qs, int64_t k, const int8_t* w, const uint16_t* ws,        \
                         float* out, int64_t n) {                                                                 \
        const int64_t groups = k / GROUP;                                                                         \
        __m256 acc[R][2];                                                                                         \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                  \
        for (int64_t g = 0; g < groups; g++) {                                                                    \
            __m256i sums[R][2][CHAINS_256(R)];                                                                    \
            for (int r = 0; r < R; r++)                                                                           \
                for (int c = 0; c < CHAINS_256(R); c++) sums[r][0][c] = sums[r][1][c] = _mm256_setzero_si256();   \
            const int8_t* wg = w + g * GROUP * TILE;                                                              \
            for (int p = 0; p < GROUP / 2; p++) {                                                                 \
                __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wg + p * 2 * TILE)));          \
                __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wg + p * 2 * TILE + TILE)));   \
                const int c = p % CHAINS_256(R);                                                                  \
                for (int r = 0; r < R; r++) {                                                                     \
                    int32_t xs2;                                                                                  \
                    __builtin_memcpy(&xs2, q + r * k + g * GROUP + 2 * p, 4);                                     \
                    __m256i x = _mm256_set1_epi32(xs2);                                                           \
                    sums[r][0][c] = DOT(sums[r][0][c], lo, x);                                                    \
                    sums[r][1][c] = DOT(sums[r][1][c], hi, x);                                                    \
                }                                                                                                 \
            }                                                                                                     \
            for (int r = 0; r < R; r++)                                                                           \
                for (int c = 1; c < CHAINS_256(R); c++)                                                           \
                    for (int h = 0; h < 2; h++) sums[r][h][0] = _mm256_add_epi32(sums[r][h][0], sums[r][h][c]);   \
            for (int h = 0; h < 2; h++) {                                                                         \
                __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(                                             \
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(ws + g * TILE + 8 * h))), 16));        \
                for (int r = 0; r < R; r++)                                                                       \
                    acc[r][h] = _mm256_fmadd_ps(                                                                  \
                        _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][h][0]), _mm256_set1_ps(qs[r * groups + g])), scale, \
                        acc[r][h]);                                                                               \
            }                                                                                                     \
        }                                                                                                         \
        store_256<R>(acc, out, n);                                                                                \
    }

TILE_256(tile_avx2, KVCHAT_AVX2, DOT_AVX2)
TILE_256(tile_avx_vnni, KVCHAT_AVX_VNNI, DOT_AVX_VNNI)
TILE4_256(tile4_avx2, KVCHAT_AVX2, DOT_AVX2)
TILE4_256(tile4_avx_vnni, KVCHAT_AVX_VNNI, DOT_AVX_VNNI)

typedef void (*tile_fn)(const int16_t*, const float*, int64_t, const int8_t*, const uint16_t*, float*, int64_t);
typedef void (*tile4_fn)(const int16_t*, const float*, const float*, int64_t, const uint8_t*, const uint16_t*,
                         const uint16_t*, float*, int64_t);
typedef void (*quantize_fn)(const float*, int64_t, int16_t*, float*);
struct Isa {
    quantize_fn quantize;
    int rows;  // a register block: as many rows as leave the sums and a weight pair in registers
    tile_fn tiles[ROWS_512 + 1];
    tile4_fn tiles4[ROWS_512 + 1];
};
#define FOUR(T) {0, T<1>, T<2>, T<3>, T<4>}
#define EIGHT(T) {0, T<1>, T<2>, T<3>, T<4>, T<5>, T<6>, T<7>, T<8>}
static const Isa ISAS[] = {
    {quantize_256, ROWS_256, FOUR(tile_avx2), FOUR(tile4_avx2)},
    {quantize_256, ROWS_256, FOUR(tile_avx_vnni), FOUR(tile4_avx_vnni)},
    {quantize_512, ROWS_512, EIGHT(tile_512), EIGHT(tile4_512)},
};

// The rows rounded to int16 per group (and, for 4-bit weights, each group's sum), then the tiles
// of n outputs, a block of rows at a time. Returns 0, or 1 when the rows' copy could not be made.
typedef void (*run_fn)(const Isa&, const int16_t*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                       float*, const void*);

static int rows_against(const Isa& f, const float* x, int64_t m, int64_t k, int64_t n, bool sums, int threads,
                        run_fn run, const void* weights, float* out) {
    const int64_t groups = k / GROUP;
    if (m == 0) return 0;  // malloc(0) may be NULL
    int16_t* q = (int16_t*)malloc(sizeof(int16_t) * m * k);
    float* qs = (float*)malloc(sizeof(float) * m * groups * 2);
    if (!q || !qs) {  // out of memory: the caller raises
        free(q);
        free(qs);
        return 1;
    }
    float* xs = qs + m * groups;
#pragma omp parallel for num_threads(threads) schedule(static) if (m >= 16)
    for (int64_t r = 0; r < m; r++) {
        f.quantize(x + r * k, k, q + r * k, qs + r * groups);
        if (sums) group_sums(x + r * k, k, xs + r * groups);
    }
    const int64_t blocks = (m + f.rows - 1) / f.rows;
    // tiles outer: a thread's row blocks of one tile find its weights in L1
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n / TILE; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r = b * f.rows, rows = m - r < f.rows ? m - r : f.rows;
            run(f, q + r * k, qs + r * groups, xs + r * groups, k, n, t, rows, out + r * n + t * TILE, weights);
        }
    }
    free(q);
    free(qs);
    return 0;
}

struct Int8Weights {
    const int8_t* w;
    const uint16_t* ws;
};
struct Int4Weights {
    const uint8_t* w;
    const uint16_t* ws;
    const uint16_t* wz;
};

// tile t of the weights against a block of rows (q, qs, xs and out at the block's first row)
static void run_int8(const Isa& f, const int16_t* q, const float* qs, const float*, int64_t k, int64_t n, int64_t t,
                     int64_t rows, float* out, const void* weights) {
    const Int8Weights& a = *(const Int8Weights*)weights;
    f.tiles[rows](q, qs, k, a.w + t * k * TILE, a.ws + t * (k / GROUP) * TILE, out, n);
}

static void run_int4(const Isa& f, const int16_t* q, const float* qs, const float* xs, int64_t k, int64_t n,
                     int64_t t, int64_t rows, float* out, const void* weights) {
    const Int4Weights& a = *(const Int4Weights*)weights;
    const int64_t groups = k / GROUP;
    f.tiles4[rows](q, qs, xs, k, a.w + t * k * TILE / 2, a.ws + t * groups * TILE, a.wz + t * groups * TILE, out, n);
}

// x [m, k] fp32; w, ws packed as above for n outputs; out [m, n] fp32. k % 32 == 0, n % 16 == 0.
// isa: ISA_AVX2, ISA_AVX_VNNI or ISA_AVX512_VNNI, which the caller checked this CPU runs.
// Returns 0, 1 when the rows' int16 copy could not be allocated, 2 for an unknown isa.
extern "C" int kvchat_int8_rows(const float* x, int64_t m, int64_t k, const int8_t* w, const uint16_t* ws, int64_t n,
                                float* out, int threads, int isa) {
    if (isa < ISA_AVX2 || isa > ISA_AVX512_VNNI) return 2;
    Int8Weights a = {w, ws};
    return rows_against(ISAS[isa], x, m, k, n, false, threads, run_int8, &a, out);
}

// The same for 4-bit codes w (packed as above), bf16 scales ws and zeros wz [N/16][K/32][16].
extern "C" int kvchat_int4_rows(const float* x, int64_t m, int64_t k, const uint8_t* w, const uint16_t* ws,
                                const uint16_t* wz, int64_t n, float* out, int threads, int isa) {
    if (isa < ISA_AVX2 || isa > ISA_AVX512_VNNI) return 2;
    Int4Weights a = {w, ws, wz};
    return rows_against(ISAS[isa], x, m, k, n, true, threads, run_int4, &a, out);
}

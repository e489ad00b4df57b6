// One decode token's attention for each row of a step, over an fp32 pool of paged K/V on the CPU.
//
// Why its own kernel: traced into the compiled step, inductor made one dot product per position
// and query head, each ending in a horizontal sum, and ran the softmax on one thread: 127-135 us a
// layer of the starter at 576 positions (AVX-512 and AVX2 alike), a quarter of a token. Here the
// positions are cut into chunks of 32 spread over the threads, a chunk taking every KV head so its
// blocks are read in order, eight positions' dot products are summed across at once, and each
// chunk keeps its own maximum, sum and weighted V per query head (split-K, as flash decoding does
// on a GPU), merged at the end.
//
// AVX2 and FMA only: every x86-64 CPU the int8 kernels serve runs it, and an AVX-512 CPU gains
// little from wider registers on 64-wide rows. Its torch twin is cpu_attention.twin.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define KVCHAT_ATTN __attribute__((target("avx2,fma")))

static const int64_t CHUNK = 32;

// e^x for x <= 0, as 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor polynomial (relative
// error about 2e-7); below -87 it gives about 1e-38, which the softmax's sum treats as 0.
KVCHAT_ATTN static inline __m256 exp_256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln 2, split for exactness
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

KVCHAT_ATTN static inline float sum_256(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Eight positions' dot products with one query head: eight independent chains of d / 8
// multiply-adds (one chain waits on its last multiply-add), summed across together into
// [sum a0, ..., sum a7].
KVCHAT_ATTN static inline __m256 dot8(const float* q, const float* const k[8], int64_t d) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
        __m256 x = _mm256_loadu_ps(q + j);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + j), a[i]);
    }
    // per 128-bit lane: [a0 a1 a2 a3] from the low halves and from the high halves, then added
    __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

KVCHAT_ATTN static inline float dot1(const float* q, const float* k, int64_t d) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), a);
    return sum_256(a);
}

struct Step {
    const float *q, *k, *v;
    const int64_t* table;
    const int32_t* lengths;
    int64_t table_stride, heads, kv_heads, d, block, window;
    float scale;
};

static inline void span(const Step& s, int64_t row, int64_t* start, int64_t* end) {
    *end = s.lengths[row];
    *start = s.window > 0 && *end > s.window ? *end - s.window : 0;
}

// One chunk of one row's positions for one KV head's query group: each query head's maximum
// score, sum of exponentials and weighted V into part (g: [max, sum, d values]).
KVCHAT_ATTN static void chunk(const Step& s, int64_t row, int64_t kvh, int64_t lo, int64_t hi, float* scores,
                              float* part) {
    const int64_t g_count = s.heads / s.kv_heads, n = hi - lo, d = s.d;
    const float* q = s.q + (row * s.heads + kvh * g_count) * d;
    const int64_t* table = s.table + row * s.table_stride;
    const float *keys[CHUNK], *values[CHUNK];
    int64_t entry = lo / s.block, row_in_block = lo % s.block;  // two divisions a chunk, not a position
    for (int64_t i = 0; i < n; i++) {
        int64_t at = ((table[entry] * s.block + row_in_block) * s.kv_heads + kvh) * d;
        keys[i] = s.k + at;
        values[i] = s.v + at;
        if (++row_in_block == s.block) row_in_block = 0, entry++;
    }
    for (int64_t g = 0; g < g_count; g++) {
        float* sg = scores + g * CHUNK;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(sg + i, _mm256_mul_ps(dot8(q + g * d, keys + i, d), _mm256_set1_ps(s.scale)));
        for (; i < n; i++) sg[i] = dot1(q + g * d, keys[i], d) * s.scale;
    }
    for (int64_t g = 0; g < g_count; g++) {
        float* sg = scores + g * CHUNK;
        float top = sg[0];
        for (int64_t i = 1; i < n; i++) top = sg[i] > top ? sg[i] : top;
        __m256 total = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp_256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sg + i, e);
            total = _mm256_add_ps(total, e);
        }
        float sum = sum_256(total);
        for (; i < n; i++) sum += (sg[i] = expf(sg[i] - top));
        float* out = part + g * (d + 2);
        out[0] = top;
        out[1] = sum;
        // 64 outputs at a time in eight registers, each position adding to all eight: eight
        // independent chains (one register's chain over the positions waited on each add)
        int64_t j0 = 0;
        for (; j0 + 64 <= d; j0 += 64) {
            __m256 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                __m256 e = _mm256_set1_ps(sg[i]);
                for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(e, _mm256_loadu_ps(values[i] + j0 + 8 * r), acc[r]);
            }
            for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + 2 + j0 + 8 * r, acc[r]);
        }
        for (; j0 < d; j0 += 8) {  // a head_dim of 80 or 96: the rest a register at a time
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) acc = _mm256_fmadd_ps(_mm256_set1_ps(sg[i]), _mm256_loadu_ps(values[i] + j0), acc);
            _mm256_storeu_ps(out + 2 + j0, acc);
        }
    }
}

// Row rh / heads, head rh % heads: its chunks' parts merged, each weighted by e^(its max - the
// overall max), into o [d].
KVCHAT_ATTN static void merge(const Step& s, const float* parts, int64_t chunks, int64_t rh, float* o) {
    const int64_t g_count = s.heads / s.kv_heads, d = s.d, part_size = g_count * (d + 2);
    const int64_t r = rh / s.heads, h = rh % s.heads, kvh = h / g_count, g = h % g_count;
    const float* first = parts + (r * s.kv_heads + kvh) * chunks * part_size + g * (d + 2);
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) top = first[c * part_size] > top ? first[c * part_size] : top;
    for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
    if (top == -INFINITY) return;  // no position: zeros, as a padding row wants
    for (int64_t c = 0; c < chunks; c++) {
        const float* p = first + c * part_size;
        if (p[1] == 0.0f) continue;
        float w = expf(p[0] - top);
        total += w * p[1];
        __m256 wv = _mm256_set1_ps(w);
        for (int64_t j = 0; j < d; j += 8)
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(wv, _mm256_loadu_ps(p + 2 + j), _mm256_loadu_ps(o + j)));
    }
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), inv));
}

// q [rows, heads, d]; k, v the pool [blocks, block, kv_heads, d] (v at the same strides); table
// [rows, table_stride] block ids; lengths [rows]: row r attends to positions [max(0, length -
// window), length) (window 0: from 0); out [rows, heads, d]. d % 8 == 0, heads % kv_heads == 0.
// Returns 0, 1 when the scratch could not be allocated, 2 when a length is past its row's table.
extern "C" int kvchat_decode_attention(const float* q, const float* k, const float* v, const int64_t* table,
                                       int64_t table_stride, const int32_t* lengths, int64_t rows, int64_t heads,
                                       int64_t kv_heads, int64_t d, int64_t block, int64_t window, float scale,
                                       float* out, int threads) {
    const Step s = {q, k, v, table, lengths, table_stride, heads, kv_heads, d, block, window, scale};
    const int64_t g_count = heads / kv_heads;
    int64_t chunks = 1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t start, end;
        span(s, r, &start, &end);
        if (end > table_stride * block) return 2;  // it would read past the table and the pool
        int64_t c = (end - start + CHUNK - 1) / CHUNK;
        chunks = c > chunks ? c : chunks;
    }
    const int64_t items = rows * kv_heads * chunks, part_size = g_count * (d + 2);
    float* parts = (float*)malloc(sizeof(float) * items * part_size);
    float* scores = (float*)malloc(sizeof(float) * rows * chunks * g_count * CHUNK);
    if (!parts || !scores) {
        free(parts);
        free(scores);
        return 1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * chunks; item++) {
            // all KV heads of a chunk in one item: the chunk's blocks are read from memory in
            // order once (a head's rows alone are strided), the next heads find them in cache
            int64_t c = item % chunks, r = item / chunks, start, end;
            span(s, r, &start, &end);
            int64_t lo = start + c * CHUNK, hi = lo + CHUNK < end ? lo + CHUNK : end;
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
                float* part = parts + ((r * kv_heads + kvh) * chunks + c) * part_size;
                if (lo < hi)
                    chunk(s, r, kvh, lo, hi, scores + item * g_count * CHUNK, part);
                else  // a row shorter than the longest: this chunk adds nothing
                    for (int64_t g = 0; g < g_count; g++) part[g * (d + 2)] = -INFINITY, part[g * (d + 2) + 1] = 0.0f;
            }
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * heads; rh++) merge(s, parts, chunks, rh, out + rh * d);
    }
    free(parts);
    free(scores);
    return 0;
}

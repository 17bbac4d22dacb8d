/* The CPU backend's compiled paged attention for chains: hal's masking rule read straight from the
 * paged cache, with no gather and no per-op dispatch. One or two query tokens of a request (decode,
 * a short verify) go row by row, one pass per request and KV head; more (prompts, verify and draft
 * blocks) by tiles of 16 query rows, 8 without AVX-512 (see "Prompts and GQA groups"). Built and loaded by
 * hal.backends.cpu.native, prepared once per kind of layer and forward (hal_attention_prepare) and
 * run per layer call (hal_attention_run); held to hal.oracle like the pure-torch kernel.
 *
 * Query row i of request b sits at p = kv_len - q_len + i and sees keys lo..p, lo = max(0, p - W)
 * on a sliding-window layer (W >= 0) and 0 otherwise. Scores and sums are fp32; a sink is one
 * more logit in each row's softmax, with no value. Keys a row does not see are never read, so a
 * NaN there cannot reach it. Plain C11: no torch headers, so the build takes seconds, not minutes. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { HAL_F32 = 0, HAL_BF16 = 1, HAL_F16 = 2 };

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        float f = (float)mantissa * (1.0f / 16777216.0f); /* zero or subnormal: mantissa * 2^-24 */
        return sign ? -f : f;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* n fp16 elements as fp32, by the CPU's vector conversion where it has one: a loop of scalar
 * conversions is not vectorised by GCC 12 and made an fp16 decode call 4x its bf16 time. */
static inline void f16_row_to_f32(const uint16_t *h, int n, float *buf) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) buf[i] = f16_to_float(h[i]);
}

/* A row of n elements as fp32: the row itself when it is fp32, else converted into buf. */
static inline const float *row_f32(const void *row, int dtype, int n, float *buf) {
    if (dtype == HAL_F32) return (const float *)row;
    const uint16_t *h = (const uint16_t *)row;
    if (dtype == HAL_BF16) {
#pragma omp simd
        for (int i = 0; i < n; i++) buf[i] = bf16_to_float(h[i]);
    } else {
        f16_row_to_f32(h, n, buf);
    }
    return buf;
}

/* exp(x) / 2^n for n = round(x / ln2): x less n * ln2 (ln2 in two parts), then a degree-6
 * polynomial on |r| <= ln2/2. A macro: exp_nonpositive's and its lane-wise twin's (a float or a
 * vector of floats; x and n are read more than once). */
#define EXP_REDUCED(x, n, r)                                                                          \
    (r = ((x) - (n) * 0.693359375f) + (n) * 2.12194440e-4f,                                          \
     (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r \
       + 1.6666665459e-1f) * r + 5.0000001201e-1f) * r * r + r + 1.0f)

/* exp(x) for x <= 0 (a score less the row's maximum), in a form the compiler vectorises: 2^n times
 * EXP_REDUCED (within 2 ulp of expf); 0 below -87.3 (where expf is subnormal) and for -inf, NaN
 * for NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.5f ? -87.5f : x; /* -inf (a masked score) too: 0 below, never inf - inf */
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r;
    const float p = EXP_REDUCED(x, n, r);
    const int32_t e = x < -87.3f || x != x ? 0 : (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x != x ? x : p * scale;
}

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE __attribute__((always_inline))
#else
#define ALWAYS_INLINE
#endif

#if !defined(HAL_NO_LANES) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
/* Four dot products of 16-lane vectors, their lanes summed by one transposed reduction (four
 * halvings shared by the four sums) instead of four horizontal sums: the vector extensions GCC
 * (12 on) and Clang share, lowered to whatever vector width the CPU has. */
#define HAL_LANES 1
typedef float lanes16 __attribute__((vector_size(64), aligned(4), may_alias));

/* One load of 16 floats. Not a memcpy: GCC (12, tuned to prefer 256-bit moves) copies 64 bytes as
 * two 32-byte halves through the stack, and the 64-byte reload of the halves waits on both stores
 * (measured: three quarters of a decode call's time). */
static inline lanes16 load16(const float *p) { return *(const lanes16 *)p; }
static inline void store16(float *p, lanes16 v) { *(lanes16 *)p = v; }

static inline void four_dots(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int n, float out[4]) {
    lanes16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int d = 0; d < n; d += 16) {
        const lanes16 qd = load16(q + d);
        a0 += qd * load16(k0 + d), a1 += qd * load16(k1 + d), a2 += qd * load16(k2 + d), a3 += qd * load16(k3 + d);
    }
    /* lanes 0-7: a0's halves summed, 8-15: a1's; then a0..a3 in four lanes each; two; one */
    const lanes16 t01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                      + __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const lanes16 t23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                      + __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const lanes16 u = __builtin_shufflevector(t01, t23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
                    + __builtin_shufflevector(t01, t23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const lanes16 w = __builtin_shufflevector(u, u, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13)
                    + __builtin_shufflevector(u, u, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
    const lanes16 x = __builtin_shufflevector(w, w, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6)
                    + __builtin_shufflevector(w, w, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
    out[0] = x[0], out[1] = x[1], out[2] = x[2], out[3] = x[3];
}

/* acc[g][...] += sum over keys j < n of w[g * w_stride + j] * values[j][...] for `heads` query
 * heads of a GQA group: per 16 value columns, the heads' sums stay in registers across the keys
 * (a pass over the accumulators per key instead costs a load and a store per multiply-add). */
static inline ALWAYS_INLINE void weigh_heads(float *acc, const int v_dim, const float *w, size_t w_stride,
                                             const float *const *values, int n, const int heads) {
    for (int col = 0; col < v_dim; col += 16) {
        lanes16 a[8];
        for (int g = 0; g < heads; g++) a[g] = load16(acc + g * v_dim + col);
        for (int j = 0; j < n; j++) {
            const lanes16 v = load16(values[j] + col);
            for (int g = 0; g < heads; g++) a[g] += w[g * w_stride + j] * v;
        }
        for (int g = 0; g < heads; g++) store16(acc + g * v_dim + col, a[g]);
    }
}

/* weigh_heads over a whole group (v_dim a multiple of 16), eight heads at a time and then 4, 2, 1:
 * a fixed count keeps the sums in registers. */
static void weigh_group(float *acc, int v_dim, int group, const float *w, size_t w_stride, const float *const *values, int n) {
    for (int g = 0; g < group;) {
        const int left = group - g, heads = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        float *a = acc + (size_t)g * v_dim;
        const float *wg = w + (size_t)g * w_stride;
        if (heads == 8) weigh_heads(a, v_dim, wg, w_stride, values, n, 8);
        else if (heads == 4) weigh_heads(a, v_dim, wg, w_stride, values, n, 4);
        else if (heads == 2) weigh_heads(a, v_dim, wg, w_stride, values, n, 2);
        else weigh_heads(a, v_dim, wg, w_stride, values, n, 1);
        g += heads;
    }
}
#endif

/* fp32 -> bf16, rounding to nearest even as torch does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline size_t element_size(int dtype) { return dtype == HAL_F32 ? 4 : 2; }

typedef struct {
    const char *q, *k_cache, *v_cache;
    int64_t q_stride_token, q_stride_head, k_stride_page, k_stride_slot, k_stride_head, v_stride_page, v_stride_slot, v_stride_head;
    int dtype, page_size, q_heads, kv_heads, qk_dim, v_dim, group, max_keys;
    const int32_t *block_table, *kv_lens, *cu_q_lens;
    int64_t table_stride;
    float scaling;
    int window;
    const float *sinks;
    void *out;
    int out_dtype;
} Call;

/* Tiles (below): query rows per tile, keys per softmax block, rows per item of work. */
/* Tiles of sixteen rows where the CPU has 16-lane vectors (AVX-512: twice the multiply-adds per
 * instruction), eight elsewhere (AVX2's sixteen registers hold the 8 x 16 sums, not 16 x 16). */
#ifdef __AVX512F__
#define TILE_ROWS 16
#else
#define TILE_ROWS 8
#endif
/* A request's rows go by tiles from this many on (a tile repeats its last row past them). */
#define MIN_TILE_ROWS 8
enum { KEY_BLOCK = 64, ROWS_PER_ITEM = 256, PREFETCH_KEYS = 8 };

#ifdef HAL_LANES
/* One lane per row of a tile. */
typedef float tile_lanes __attribute__((vector_size(TILE_ROWS * 4), aligned(4), may_alias));
/* Loads and stores of whole vectors (see load16). */
static inline tile_lanes load_tile(const float *p) { return *(const tile_lanes *)p; }
static inline void store_tile(float *p, tile_lanes v) { *(tile_lanes *)p = v; }

/* Softmax steps on whole tile_lanes vectors, written out rather than left to the vectoriser: GCC
 * tunes recent AVX-512 CPUs to vectorise 256 bits wide, half a 16-lane vector. */
typedef int32_t tile_ints __attribute__((vector_size(TILE_ROWS * 4), aligned(4), may_alias));

/* yes where mask (all ones), else no. */
static inline ALWAYS_INLINE tile_lanes select_lanes(tile_ints mask, tile_lanes yes, tile_lanes no) {
    return (tile_lanes)((mask & (tile_ints)yes) | (~mask & (tile_ints)no));
}

/* exp_nonpositive lane by lane: n = round(x / ln2) by adding and taking away 1.5 * 2^23, exact for
 * |x / ln2| < 2^22; the same EXP_REDUCED, and 0 below -87.3, NaN for NaN. */
static inline ALWAYS_INLINE tile_lanes exp_nonpositive_lanes(tile_lanes x) {
    const tile_ints nan = x != x;
    x = select_lanes(x < -87.5f, (tile_lanes){0} - 87.5f, x); /* -inf (a masked score) too */
    const tile_lanes n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    tile_lanes r;
    const tile_lanes p = EXP_REDUCED(x, n, r);
    const tile_ints e = ~((x < -87.3f) | nan) & (__builtin_convertvector(n, tile_ints) + 127);
    return select_lanes(nan, x, p * (tile_lanes)(e << 23));
}

/* Scores s[0..n) -> their softmax with a sink logit (when has_sink: one more logit, no value): the
 * row path's, on tile_lanes vectors. */
static void softmax_lanes(float *s, int n, float sink, int has_sink) {
    enum { W = TILE_ROWS };
    tile_lanes top = (tile_lanes){0} + sink;
    int t = 0;
    for (; t + W <= n; t += W) { /* a NaN score is skipped here and reaches the sum through its exp */
        const tile_lanes score = load_tile(s + t);
        top = select_lanes(score > top, score, top);
    }
    float m = sink;
    for (int i = 0; i < W; i++) m = top[i] > m ? top[i] : m;
    for (int i = t; i < n; i++) m = s[i] > m ? s[i] : m;
    tile_lanes sums = {0};
    for (t = 0; t + W <= n; t += W) {
        const tile_lanes weight = exp_nonpositive_lanes(load_tile(s + t) - m);
        store_tile(s + t, weight);
        sums += weight;
    }
    float total = has_sink ? exp_nonpositive(sink - m) : 0.0f;
    for (int i = t; i < n; i++) total += (s[i] = exp_nonpositive(s[i] - m));
    for (int i = 0; i < W; i++) total += sums[i];
    const float inverse = 1.0f / total;
    for (t = 0; t + W <= n; t += W) store_tile(s + t, load_tile(s + t) * inverse);
    for (int i = t; i < n; i++) s[i] *= inverse;
}
#endif

/* The row path fetches the key and value rows this many bytes ahead of the ones it reads: a decode
 * step's keys are seldom in cache (every layer's are read once per step), and pages are scattered,
 * so the hardware's stream prefetch stops at each page's end. 4 KB: 10-16% off a decode call over
 * 900 keys not in cache, none on keys in cache (measured at 16 query / 2 KV heads of 128 and 4 / 2 of 32). */
enum { ROW_PREFETCH_BYTES = 4096 };

static inline void prefetch_row(const char *row, int bytes) {
    for (int at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
}

/* The same into L2 only: value rows fetched during the score pass, read by the value pass after it. */
static inline void prefetch_row_l2(const char *row, int bytes) {
    for (int at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, 2);
}

/* Keys per block of the row path's value pass: their value rows stay in L1 across its column passes. */
enum { VALUE_BLOCK = 64 };

typedef struct {
    float *scores, *queries, *acc, *rows; /* rows: four rows of row_len floats, for converted K/V rows */
    const char **k_rows, **v_rows;        /* where each key and value row of one (request, head) sits */
    float *value_block;                   /* [VALUE_BLOCK][v_dim]: a block's value rows as fp32, when the cache is not */
    const float **block_values;           /* the block's value rows as fp32 (in the cache, or in value_block) */
    int row_len;
} Scratch;

/* Scratch memory of the calling thread, kept between calls (OpenMP's workers and the caller live
 * on) and grown when a call needs more: no allocation per call. */
typedef struct {
    char *base;
    size_t bytes;
} Arena;

static size_t aligned_bytes(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* Carves the arena into n parts of the given sizes (64-byte aligned); -1 when memory could not be had. */
static int arena_parts(Arena *arena, const size_t *sizes, int n, void **parts) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += aligned_bytes(sizes[i]);
    if (total > arena->bytes) {
        free(arena->base);
        arena->base = aligned_alloc(64, total > 0 ? total : 64);
        arena->bytes = arena->base ? total : 0;
        if (!arena->base) return -1;
    }
    char *at = arena->base;
    for (int i = 0; i < n; i++) parts[i] = at, at += aligned_bytes(sizes[i]);
    return 0;
}

static _Thread_local Arena row_arena;

static int scratch_alloc(const Call *c, Scratch *s) {
    const size_t group = (size_t)c->group, keys = (size_t)c->max_keys;
    s->row_len = c->qk_dim > c->v_dim ? c->qk_dim : c->v_dim;
    const size_t sizes[] = {group * keys * 4, group * (size_t)c->qk_dim * 4, group * (size_t)c->v_dim * 4, 4 * (size_t)s->row_len * 4,
                            keys * sizeof(char *), keys * sizeof(char *), c->dtype == HAL_F32 ? 0 : VALUE_BLOCK * (size_t)c->v_dim * 4,
                            VALUE_BLOCK * sizeof(float *)};
    void *parts[8];
    if (arena_parts(&row_arena, sizes, 8, parts) != 0) return -1;
    s->scores = parts[0], s->queries = parts[1], s->acc = parts[2], s->rows = parts[3], s->k_rows = parts[4], s->v_rows = parts[5];
    s->value_block = parts[6], s->block_values = parts[7];
    return 0;
}

/* k_rows[j] and v_rows[j] for keys first..last of a request (pages: its block-table row) on one
 * head: walked page by page, so no key costs a division, whatever the page size. */
static void locate_rows(const Call *c, const int32_t *pages, int first, int last, int64_t k_head, int64_t v_head, Scratch *s) {
    const size_t esize = element_size(c->dtype);
    const int page_size = c->page_size;
    for (int j = first; j <= last;) {
        const int page = j / page_size, end = (page + 1) * page_size - 1 < last ? (page + 1) * page_size - 1 : last;
        const char *k = c->k_cache + ((int64_t)pages[page] * c->k_stride_page + (int64_t)(j - page * page_size) * c->k_stride_slot + k_head) * esize;
        const char *v = c->v_cache + ((int64_t)pages[page] * c->v_stride_page + (int64_t)(j - page * page_size) * c->v_stride_slot + v_head) * esize;
        const int64_t k_step = c->k_stride_slot * (int64_t)esize, v_step = c->v_stride_slot * (int64_t)esize;
        for (; j <= end; j++, k += k_step, v += v_step) s->k_rows[j] = k, s->v_rows[j] = v;
    }
}

/* Rows j..j+3 (keys or values: located is k_rows or v_rows) as fp32: in place, or converted into
 * the scratch rows. */
static inline void four_rows(const Call *c, const char *const *located, int j, int width, Scratch *s, const float *rows[4]) {
    for (int r = 0; r < 4; r++) rows[r] = row_f32(located[j + r], c->dtype, width, s->rows + r * s->row_len);
}

/* Every query row of request b on KV head h: its group of query heads against the keys it sees.
 * Inlined with the head dims as constants where attend() knows them (loops of known length). */
static inline ALWAYS_INLINE void attend_dims(const Call *c, int b, int h, Scratch *s, const int qk_dim, const int v_dim) {
    const size_t esize = element_size(c->dtype);
    const int group = c->group;
    const int q_len = c->cu_q_lens[b + 1] - c->cu_q_lens[b], kv_len = c->kv_lens[b];
    if (q_len <= 0) return;
    const int32_t *pages = c->block_table + (int64_t)b * c->table_stride;
    const int first_p = kv_len - q_len, first_lo = c->window >= 0 && first_p - c->window > 0 ? first_p - c->window : 0;
    locate_rows(c, pages, first_lo, kv_len - 1, h * c->k_stride_head, h * c->v_stride_head, s);
    const int k_bytes = qk_dim * (int)esize, v_bytes = v_dim * (int)esize;
    const int k_ahead = (ROW_PREFETCH_BYTES / k_bytes + 3) & ~3, v_ahead = (ROW_PREFETCH_BYTES / v_bytes + 3) & ~3; /* whole fours of keys */
    for (int i = 0; i < q_len; i++) {
        const int64_t token = c->cu_q_lens[b] + i;
        const int p = kv_len - q_len + i;
        const int lo = c->window >= 0 && p - c->window > 0 ? p - c->window : 0;
        const int n = p - lo + 1;
        for (int g = 0; g < group; g++) {
            const float *qr = row_f32(c->q + (token * c->q_stride_token + (int64_t)(h * group + g) * c->q_stride_head) * esize,
                                      c->dtype, qk_dim, s->rows);
            for (int d = 0; d < qk_dim; d++) s->queries[g * qk_dim + d] = qr[d] * c->scaling;
        }
        /* keys lo..p, four at a time: four independent sums per query head; each key's row located
         * on its own, so pages of one token (SGLang's) take this path too */
        int j = lo;
        for (; j + 3 <= p; j += 4) {
            if (j + k_ahead + 3 <= p)
                for (int r = 0; r < 4; r++) prefetch_row(s->k_rows[j + k_ahead + r], k_bytes), prefetch_row_l2(s->v_rows[j + k_ahead + r], v_bytes);
            const float *k[4];
            four_rows(c, s->k_rows, j, qk_dim, s, k);
            const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
            for (int g = 0; g < group; g++) {
                const float *qg = s->queries + g * qk_dim;
                float *out = s->scores + (size_t)g * c->max_keys + (j - lo);
#ifdef HAL_LANES
                if (qk_dim % 16 == 0) {
                    four_dots(qg, k0, k1, k2, k3, qk_dim, out);
                    continue;
                }
#endif
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int d = 0; d < qk_dim; d++) d0 += qg[d] * k0[d], d1 += qg[d] * k1[d], d2 += qg[d] * k2[d], d3 += qg[d] * k3[d];
                out[0] = d0, out[1] = d1, out[2] = d2, out[3] = d3;
            }
        }
        for (; j <= p; j++) {
            const float *key = row_f32(s->k_rows[j], c->dtype, qk_dim, s->rows);
            for (int g = 0; g < group; g++) {
                const float *qg = s->queries + g * qk_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < qk_dim; d++) dot += qg[d] * key[d];
                s->scores[(size_t)g * c->max_keys + (j - lo)] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float *sg = s->scores + (size_t)g * c->max_keys;
            const float sink = c->sinks ? c->sinks[h * group + g] : -INFINITY;
#ifdef HAL_LANES
            softmax_lanes(sg, n, sink, c->sinks != NULL);
#else
            float m = sink; /* a NaN score is skipped here and reaches the sum through its exp */
#pragma omp simd reduction(max : m)
            for (int t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
            float total = c->sinks ? exp_nonpositive(sink - m) : 0.0f;
#pragma omp simd reduction(+ : total)
            for (int t = 0; t < n; t++) total += (sg[t] = exp_nonpositive(sg[t] - m));
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int t = 0; t < n; t++) sg[t] *= inverse;
#endif
        }
        memset(s->acc, 0, sizeof(float) * (size_t)group * (size_t)v_dim);
        int weighed = 0; /* whether the values were added below */
#ifdef HAL_LANES
        if (v_dim % 16 == 0) { /* by blocks of keys, the heads' sums in registers (weigh_group) */
            for (int kb = lo; kb <= p; kb += VALUE_BLOCK) {
                const int n_block = p - kb + 1 < VALUE_BLOCK ? p - kb + 1 : VALUE_BLOCK;
                for (int t = 0; t < n_block; t++)
                    s->block_values[t] = row_f32(s->v_rows[kb + t], c->dtype, v_dim, s->value_block + (size_t)t * v_dim);
                weigh_group(s->acc, v_dim, group, s->scores + (kb - lo), (size_t)c->max_keys, s->block_values, n_block);
            }
            weighed = 1;
        }
#endif
        for (j = weighed ? p + 1 : lo; j + 3 <= p; j += 4) { /* four keys at a time: one pass over each accumulator row */
            if (j + v_ahead + 3 <= p)
                for (int r = 0; r < 4; r++) prefetch_row(s->v_rows[j + v_ahead + r], v_bytes);
            const float *v[4];
            four_rows(c, s->v_rows, j, v_dim, s, v);
            const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
            for (int g = 0; g < group; g++) {
                const float *w = s->scores + (size_t)g * c->max_keys + (j - lo);
                const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
                float *ag = s->acc + g * v_dim;
#pragma omp simd
                for (int d = 0; d < v_dim; d++) ag[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
            }
        }
        for (; j <= p; j++) {
            const float *value = row_f32(s->v_rows[j], c->dtype, v_dim, s->rows);
            for (int g = 0; g < group; g++) {
                const float w = s->scores[(size_t)g * c->max_keys + (j - lo)];
                float *ag = s->acc + g * v_dim;
#pragma omp simd
                for (int d = 0; d < v_dim; d++) ag[d] += w * value[d];
            }
        }
        const int64_t first = (token * c->q_heads + h * group) * (int64_t)v_dim;
        if (c->out_dtype == HAL_BF16) {
            uint16_t *out = (uint16_t *)c->out + first;
            for (int e = 0; e < group * v_dim; e++) out[e] = float_to_bf16(s->acc[e]);
        } else {
            memcpy((float *)c->out + first, s->acc, sizeof(float) * (size_t)group * (size_t)v_dim);
        }
    }
}

/* attend_dims with the head dims of common models as constants: about a tenth faster than with
 * dims known only at run time (measured at 32, 64 and 128). */
static void attend(const Call *c, int b, int h, Scratch *s) {
    const int dk = c->qk_dim, dv = c->v_dim;
    if (dk == 128 && dv == 128) attend_dims(c, b, h, s, 128, 128);
    else if (dk == 64 && dv == 64) attend_dims(c, b, h, s, 64, 64);
    else if (dk == 192 && dv == 128) attend_dims(c, b, h, s, 192, 128); /* MiMo-V2-Flash */
    else if (dk == 256 && dv == 256) attend_dims(c, b, h, s, 256, 256);
    else if (dk == 32 && dv == 32) attend_dims(c, b, h, s, 32, 32);
    else attend_dims(c, b, h, s, dk, dv);
}

#ifdef HAL_LANES
/* Prompts and GQA groups: TILE_ROWS query rows of one request and KV head at once (tokens x the
 * query heads of the group, row r = token * group + head), scores with lanes over the rows. Each key
 * is read once per tile instead of once per row, and both products keep their sums in registers:
 * QK^T as 16 keys x TILE_ROWS rows, PV as TILE_ROWS rows x 16 value columns. The softmax runs per block
 * of keys (online: a running maximum and sum per row). A key outside a row's mask gets a -inf
 * score (a select, not arithmetic) and its value is added only to the rows that see it, so a NaN
 * there reaches no row that does not see it. */
typedef float lanes8 __attribute__((vector_size(32), aligned(4), may_alias));
/* Vectors of tile_lanes across 16 value columns. */
#define COLUMN_VECTORS (16 / TILE_ROWS)

/* Loads and stores of whole vectors (see load16). */
static inline lanes8 load8(const float *p) { return *(const lanes8 *)p; }
static inline void store8(float *p, lanes8 v) { *(lanes8 *)p = v; }

typedef struct {
    float *keys;          /* [keys + 15][qk_dim]: the item's keys as fp32, and spare rows */
    float *values;        /* [keys][v_dim]: its values as fp32, when the cache holds another dtype */
    const float **values_f32; /* each key's value row as fp32 (in the cache, or in values) */
    float *queries;       /* [qk_dim][TILE_ROWS]: the tile's query rows, scaled, transposed */
    float *scores;        /* [KEY_BLOCK][TILE_ROWS] */
    float *acc;           /* [TILE_ROWS][v_dim] */
    float *row;           /* one converted query row */
    Scratch located;      /* k_rows, v_rows */
} TileScratch;

static _Thread_local Arena tile_arena;

static int tile_scratch(const Call *c, TileScratch *t) {
    const size_t keys = (size_t)c->max_keys, dk = (size_t)c->qk_dim, dv = (size_t)c->v_dim;
    const size_t sizes[] = {
        (keys + 15) * dk * 4, c->dtype == HAL_F32 ? 0 : keys * dv * 4, keys * sizeof(float *), dk * TILE_ROWS * 4,
        KEY_BLOCK * TILE_ROWS * 4, TILE_ROWS * dv * 4, dk * 4, keys * sizeof(char *), keys * sizeof(char *),
    };
    void *parts[9];
    if (arena_parts(&tile_arena, sizes, 9, parts) != 0) return -1;
    t->keys = parts[0], t->values = parts[1], t->values_f32 = parts[2], t->queries = parts[3], t->scores = parts[4];
    t->acc = parts[5], t->row = parts[6], t->located.k_rows = parts[7], t->located.v_rows = parts[8];
    return 0;
}

/* Scores of the tile's rows against 16 keys (rows of keys, qk_dim apart): 16 x TILE_ROWS sums in
 * registers, each key element broadcast against the rows' query elements. */
static inline ALWAYS_INLINE void scores_16_keys(const float *queries, const float *keys, const int qk_dim, float *scores) {
    tile_lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    tile_lanes a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0}, a14 = {0}, a15 = {0};
    for (int d = 0; d < qk_dim; d++) {
        const tile_lanes q = load_tile(queries + TILE_ROWS * d);
        const float *k = keys + d;
        a0 += q * k[0], a1 += q * k[qk_dim], a2 += q * k[2 * qk_dim], a3 += q * k[3 * qk_dim];
        a4 += q * k[4 * qk_dim], a5 += q * k[5 * qk_dim], a6 += q * k[6 * qk_dim], a7 += q * k[7 * qk_dim];
        a8 += q * k[8 * qk_dim], a9 += q * k[9 * qk_dim], a10 += q * k[10 * qk_dim], a11 += q * k[11 * qk_dim];
        a12 += q * k[12 * qk_dim], a13 += q * k[13 * qk_dim], a14 += q * k[14 * qk_dim], a15 += q * k[15 * qk_dim];
    }
    const tile_lanes sums[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
    for (int j = 0; j < 16; j++) store_tile(scores + TILE_ROWS * j, sums[j]);
}

/* acc[r][col..col+width) = acc * alpha[r] + sum over keys first..last of weights[j][r] * value_j:
 * TILE_ROWS rows x 16 columns (width 16) or 8 (width 8) of sums in registers. */
static inline ALWAYS_INLINE void weigh_values(float *acc, const int v_dim, const int col, const int width,
                                              const float alpha[TILE_ROWS], const float *weights, const float *const *values,
                                              int first, int last) {
    if (width == 16) {
        tile_lanes c[TILE_ROWS][COLUMN_VECTORS];
        for (int r = 0; r < TILE_ROWS; r++)
            for (int u = 0; u < COLUMN_VECTORS; u++) c[r][u] = load_tile(acc + r * v_dim + col + u * TILE_ROWS) * alpha[r];
        for (int j = first; j <= last; j++) {
            const float *v = values[j] + col, *w = weights + TILE_ROWS * j;
            tile_lanes vv[COLUMN_VECTORS];
            for (int u = 0; u < COLUMN_VECTORS; u++) vv[u] = load_tile(v + u * TILE_ROWS);
            for (int r = 0; r < TILE_ROWS; r++)
                for (int u = 0; u < COLUMN_VECTORS; u++) c[r][u] += w[r] * vv[u];
        }
        for (int r = 0; r < TILE_ROWS; r++)
            for (int u = 0; u < COLUMN_VECTORS; u++) store_tile(acc + r * v_dim + col + u * TILE_ROWS, c[r][u]);
    } else {
        lanes8 c[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) c[r] = load8(acc + r * v_dim + col) * alpha[r];
        for (int j = first; j <= last; j++) {
            const lanes8 v0 = load8(values[j] + col);
            const float *w = weights + TILE_ROWS * j;
            for (int r = 0; r < TILE_ROWS; r++) c[r] += w[r] * v0;
        }
        for (int r = 0; r < TILE_ROWS; r++) store8(acc + r * v_dim + col, c[r]);
    }
}

/* acc += weights[TILE_ROWS j] * value_j for keys first..last: one row's keys that not every row of
 * its tile sees. */
static inline ALWAYS_INLINE void add_values(float *acc, const int v_dim, const float *weights, const float *const *values, int first,
                                            int last) {
    for (int j = first; j <= last; j++) {
        const float w = weights[TILE_ROWS * j], *v = values[j];
#pragma omp simd
        for (int d = 0; d < v_dim; d++) acc[d] += w * v[d];
    }
}

/* A row of n elements as fp32 into dst. */
static inline void unpack_row(const char *row, int dtype, int n, float *dst) {
    const float *f = row_f32(row, dtype, n, dst);
    if (f != dst) memcpy(dst, f, sizeof(float) * (size_t)n);
}

/* Rows r0..r1-1 of request b on KV head h (row r: token r / group, query head h * group + r % group). */
static inline ALWAYS_INLINE void attend_tiles_dims(const Call *c, int b, int h, int r0, int r1, TileScratch *t, const int qk_dim,
                                                   const int v_dim) {
    const size_t esize = element_size(c->dtype);
    const int group = c->group, window = c->window;
    const int q_len = c->cu_q_lens[b + 1] - c->cu_q_lens[b], kv_len = c->kv_lens[b], first_p = kv_len - q_len;
    const int32_t *pages = c->block_table + (int64_t)b * c->table_stride;
    /* the keys some row of the item sees: from the first row's lowest to the last row's position */
    const int item_p = first_p + (r1 - 1) / group, item_p0 = first_p + r0 / group;
    const int klo = window >= 0 && item_p0 - window > 0 ? item_p0 - window : 0;
    locate_rows(c, pages, klo, item_p, h * c->k_stride_head, h * c->v_stride_head, &t->located);
    float *keys = t->keys - (int64_t)klo * qk_dim; /* indexed by key position */
    const float **values = t->values_f32 - klo;
    const int k_bytes = qk_dim * (int)esize, v_bytes = v_dim * (int)esize;
    for (int j = klo; j <= item_p; j++) {
        if (j + PREFETCH_KEYS <= item_p) { /* pages are scattered: fetch ahead across their ends */
            const char *k_ahead = t->located.k_rows[j + PREFETCH_KEYS], *v_ahead = t->located.v_rows[j + PREFETCH_KEYS];
            prefetch_row(k_ahead, k_bytes);
            prefetch_row(v_ahead, v_bytes);
        }
        unpack_row(t->located.k_rows[j], c->dtype, qk_dim, keys + (int64_t)j * qk_dim);
        if (c->dtype == HAL_F32) {
            values[j] = (const float *)t->located.v_rows[j];
        } else {
            float *value = t->values + (int64_t)(j - klo) * v_dim;
            unpack_row(t->located.v_rows[j], c->dtype, v_dim, value);
            values[j] = value;
        }
    }
    for (int tile = r0; tile < r1; tile += TILE_ROWS) {
        const int rows = r1 - tile < TILE_ROWS ? r1 - tile : TILE_ROWS;
        tile_ints p, lo; /* each row's last key and first key (vectors: the block mask compares them whole) */
        int head[TILE_ROWS];
        int64_t token[TILE_ROWS];
        float m[TILE_ROWS], l[TILE_ROWS], alpha[TILE_ROWS], base[TILE_ROWS];
        int lo_min = INT32_MAX, lo_max = 0, p_min = INT32_MAX, p_max = 0;
        for (int r = 0; r < TILE_ROWS; r++) { /* rows past the item's repeat its last one, and are not written */
            const int row = tile + (r < rows ? r : rows - 1);
            token[r] = c->cu_q_lens[b] + row / group, head[r] = h * group + row % group;
            p[r] = first_p + row / group, lo[r] = window >= 0 && p[r] - window > 0 ? p[r] - window : 0;
            lo_min = lo[r] < lo_min ? lo[r] : lo_min, lo_max = lo[r] > lo_max ? lo[r] : lo_max;
            p_min = p[r] < p_min ? p[r] : p_min, p_max = p[r] > p_max ? p[r] : p_max;
            const float *qr = row_f32(c->q + (token[r] * c->q_stride_token + (int64_t)head[r] * c->q_stride_head) * esize, c->dtype,
                                      qk_dim, t->row);
            for (int d = 0; d < qk_dim; d++) t->queries[d * TILE_ROWS + r] = qr[d] * c->scaling;
            m[r] = c->sinks ? c->sinks[head[r]] : -INFINITY, l[r] = c->sinks ? 1.0f : 0.0f;
        }
        memset(t->acc, 0, sizeof(float) * TILE_ROWS * (size_t)v_dim);
        for (int kb = lo_min; kb <= p_max; kb += KEY_BLOCK) {
            const int ke = kb + KEY_BLOCK - 1 < p_max ? kb + KEY_BLOCK - 1 : p_max, n = ke - kb + 1;
            float *s = t->scores;
            int j = 0;
            /* sixteen keys at a time, the last group past the block's end too: the key rows are
             * there (tile_scratch's spare rows), and their scores are never read */
            for (; j < n; j += 16) scores_16_keys(t->queries, keys + (int64_t)(kb + j) * qk_dim, qk_dim, s + TILE_ROWS * j);
            if (kb < lo_max || ke > p_min) { /* some row does not see some key of the block */
                for (j = 0; j < n; j++) {
                    const tile_ints unseen = (lo > kb + j) | (p < kb + j);
                    store_tile(s + TILE_ROWS * j, select_lanes(unseen, (tile_lanes){0} - INFINITY, load_tile(s + TILE_ROWS * j)));
                }
            }
            tile_lanes top = load_tile(m);
            for (j = 0; j < n; j++) { /* a NaN score is skipped here and reaches the sum through its exp */
                const tile_lanes score = load_tile(s + TILE_ROWS * j);
                top = select_lanes(score > top, score, top);
            }
            for (int r = 0; r < TILE_ROWS; r++) { /* no key seen yet, no sink: nothing to rescale */
                const int none = top[r] == -INFINITY;
                alpha[r] = none ? 1.0f : exp_nonpositive(m[r] - top[r]), base[r] = none ? 0.0f : top[r];
            }
            const tile_lanes base_lanes = load_tile(base);
            tile_lanes sums = {0};
            for (j = 0; j < n; j++) {
                const tile_lanes weight = exp_nonpositive_lanes(load_tile(s + TILE_ROWS * j) - base_lanes);
                store_tile(s + TILE_ROWS * j, weight);
                sums += weight;
            }
            for (int r = 0; r < TILE_ROWS; r++) l[r] = l[r] * alpha[r] + sums[r], m[r] = top[r];
            /* keys every row sees, all rows at once; then each row's others */
            const int common_lo = kb > lo_max ? kb : lo_max, common_hi = ke < p_min ? ke : p_min;
            const float *weights = s - TILE_ROWS * kb;
            int col = 0;
            for (; col + 16 <= v_dim; col += 16) weigh_values(t->acc, v_dim, col, 16, alpha, weights, values, common_lo, common_hi);
            for (; col < v_dim; col += 8) weigh_values(t->acc, v_dim, col, 8, alpha, weights, values, common_lo, common_hi);
            for (int r = 0; r < rows; r++) {
                const int from = kb > lo[r] ? kb : lo[r], to = ke < p[r] ? ke : p[r];
                float *ar = t->acc + r * v_dim;
                if (common_lo > common_hi) {
                    add_values(ar, v_dim, weights + r, values, from, to);
                } else { /* the row's keys below the common ones, and above them */
                    add_values(ar, v_dim, weights + r, values, from, to < common_lo - 1 ? to : common_lo - 1);
                    add_values(ar, v_dim, weights + r, values, from > common_hi + 1 ? from : common_hi + 1, to);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            const float inverse = 1.0f / l[r], *ar = t->acc + r * v_dim;
            const int64_t first = (token[r] * c->q_heads + head[r]) * (int64_t)v_dim;
            if (c->out_dtype == HAL_BF16) {
                uint16_t *out = (uint16_t *)c->out + first;
                for (int d = 0; d < v_dim; d++) out[d] = float_to_bf16(ar[d] * inverse);
            } else {
                float *out = (float *)c->out + first;
#pragma omp simd
                for (int d = 0; d < v_dim; d++) out[d] = ar[d] * inverse;
            }
        }
    }
}

static void attend_tiles(const Call *c, int b, int h, int r0, int r1, TileScratch *t) {
    const int dk = c->qk_dim, dv = c->v_dim;
    if (dk == 128 && dv == 128) attend_tiles_dims(c, b, h, r0, r1, t, 128, 128);
    else if (dk == 64 && dv == 64) attend_tiles_dims(c, b, h, r0, r1, t, 64, 64);
    else if (dk == 192 && dv == 128) attend_tiles_dims(c, b, h, r0, r1, t, 192, 128);
    else if (dk == 256 && dv == 256) attend_tiles_dims(c, b, h, r0, r1, t, 256, 256);
    else if (dk == 32 && dv == 32) attend_tiles_dims(c, b, h, r0, r1, t, 32, 32);
    else attend_tiles_dims(c, b, h, r0, r1, t, dk, dv);
}
#endif

/* Row i of rows ([n, heads, width], unit stride in width) into slot slots[i] of a cache: the
 * forward's new keys or values, written before any row is read. */
static void write_rows(char *cache, int64_t stride_page, int64_t stride_slot, int64_t stride_head, int page_size,
                       const char *rows, int64_t rows_stride_token, int64_t rows_stride_head, const int64_t *slots, int n,
                       int heads, int width, size_t esize) {
    for (int i = 0; i < n; i++) {
        const int64_t slot = slots[i];
        char *to = cache + ((slot / page_size) * stride_page + (slot % page_size) * stride_slot) * (int64_t)esize;
        for (int h = 0; h < heads; h++)
            memcpy(to + h * stride_head * (int64_t)esize, rows + (i * rows_stride_token + h * rows_stride_head) * (int64_t)esize,
                   (size_t)width * esize);
    }
}

/* One item of a call: rows r0..r1-1 of request b on KV head h by tiles, or (r1 < 0) every row of
 * the request on that head by the row path. */
typedef struct {
    int b, h, r0, r1;
} Item;

/* Whether request b's rows go by tiles: three query tokens or more (a prompt, a verify) making
 * eight rows or more, value rows a whole number of eight lanes, and the vector extensions to build
 * them with. One or two tokens go row by row, which reads each key once per token for the whole
 * GQA group and packs nothing: faster there, most of all with keys not in cache (measured at 900
 * keys, 16 query / 2 KV heads of 128). */
static int by_tiles(const Call *c, int b) {
#ifdef HAL_LANES
    const int q_len = c->cu_q_lens[b + 1] - c->cu_q_lens[b];
    return q_len >= 3 && q_len * c->group >= MIN_TILE_ROWS && c->v_dim % 8 == 0;
#else
    (void)c, (void)b;
    return 0;
#endif
}

/* The call's items, the costliest first within each (request, head) so the last ones handed out
 * are short. NULL when memory could not be had. */
static Item *list_items(const Call *c, int batch, int *count) {
    int n = 0;
    for (int b = 0; b < batch; b++) {
        const int rows = (c->cu_q_lens[b + 1] - c->cu_q_lens[b]) * c->group;
        n += c->kv_heads * (by_tiles(c, b) ? (rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM : 1);
    }
    Item *items = malloc(sizeof(Item) * (size_t)(n > 0 ? n : 1));
    if (!items) return NULL;
    n = 0;
    for (int b = 0; b < batch; b++) {
        const int rows = (c->cu_q_lens[b + 1] - c->cu_q_lens[b]) * c->group;
        for (int h = 0; h < c->kv_heads; h++) {
            if (!by_tiles(c, b)) {
                items[n++] = (Item){b, h, 0, -1};
                continue;
            }
            for (int r1 = rows; r1 > 0; r1 -= ROWS_PER_ITEM)
                items[n++] = (Item){b, h, r1 - ROWS_PER_ITEM > 0 ? r1 - ROWS_PER_ITEM : 0, r1};
        }
    }
    *count = n;
    return items;
}

/* The call's items, with scratch of this thread's own: shared among the team's threads inside a
 * parallel region, all on the calling thread outside one. 0, or -1 when scratch could not be had. */
static int attend_items(const Call *c, const Item *items, int count) {
    Scratch scratch;
    int failed = scratch_alloc(c, &scratch) != 0;
#ifdef HAL_LANES
    TileScratch tiles;
    int tiles_ready = 0; /* 0: not asked for yet, 1: ready, -1: could not be had */
#endif
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < count; i++) {
        const Item it = items[i];
        if (it.r1 < 0) {
            if (!failed) attend(c, it.b, it.h, &scratch);
            continue;
        }
#ifdef HAL_LANES
        if (tiles_ready == 0) tiles_ready = tile_scratch(c, &tiles) == 0 ? 1 : -1;
        if (tiles_ready > 0) attend_tiles(c, it.b, it.h, it.r0, it.r1, &tiles);
        else failed = 1;
#endif
    }
    return failed ? -1 : 0;
}

/* The rows of this build's tiles (16 with AVX-512, else 8), or 0 when it runs prompts row by row
 * (built without the vector extensions). */
int hal_paged_attention_tiles(void) {
#ifdef HAL_LANES
    return TILE_ROWS;
#else
    return 0;
#endif
}

/* Below this many multiply-adds a call runs on the calling thread alone: entering a parallel
 * region costs microseconds even with the workers awake. */
#define MIN_PARALLEL_WORK 2e5

/* One kind of layer's attention for one forward, prepared once: the batch's lengths and block
 * table, the heads, dims, scale and window, and the call's items. Each call names the layer's
 * caches (and sinks). Runs from several threads at once (each run works on its own copy). */
typedef struct {
    Call call;
    Item *items;
    int count, threads;
} Prepared;

/* The prepared call, or NULL when memory could not be had. The items are split across up to
 * `threads` threads of OpenMP: built with -fopenmp and loaded into a process that has torch's
 * libgomp (the soname matches), that is torch's own worker pool, so an engine's threads are reused
 * rather than joined by more. Built without OpenMP it runs on the calling thread. The lengths and
 * block table must outlive it. */
void *hal_attention_prepare(
    int dtype, int page_size, int q_heads, int kv_heads, int qk_dim, int v_dim,
    const int32_t *block_table, int64_t table_stride, const int32_t *kv_lens, const int32_t *cu_q_lens, int batch,
    float scaling, int window, int out_dtype, /* fp32 or bf16 */
    int threads) {
    Prepared *prepared = malloc(sizeof *prepared);
    if (!prepared) return NULL;
    prepared->call = (Call){
        .dtype = dtype, .page_size = page_size, .q_heads = q_heads, .kv_heads = kv_heads, .qk_dim = qk_dim, .v_dim = v_dim,
        .group = q_heads / kv_heads, .max_keys = 1, .block_table = block_table, .kv_lens = kv_lens, .cu_q_lens = cu_q_lens,
        .table_stride = table_stride, .scaling = scaling, .window = window, .out_dtype = out_dtype,
    };
    Call *c = &prepared->call;
    double multiply_adds = 0.0;
    for (int b = 0; b < batch; b++) {
        if (kv_lens[b] > c->max_keys) c->max_keys = kv_lens[b];
        multiply_adds += (double)(cu_q_lens[b + 1] - cu_q_lens[b]) * kv_lens[b] * q_heads * (qk_dim + v_dim);
    }
    prepared->items = list_items(c, batch, &prepared->count);
    if (!prepared->items) {
        free(prepared);
        return NULL;
    }
    if (threads < 1 || multiply_adds < MIN_PARALLEL_WORK) threads = 1;
    if (threads > prepared->count) threads = prepared->count > 0 ? prepared->count : 1;
    prepared->threads = threads;
    return prepared;
}

void hal_attention_release(void *prepared) {
    if (!prepared) return;
    free(((Prepared *)prepared)->items);
    free(prepared);
}

/* Runs a prepared call for one layer: q ([T, Hq, Dk], unit stride in Dk) over the layer's caches
 * (pages x slots x heads x dim, unit stride in dim) into out ([T, Hq, Dv] contiguous, of the
 * prepared dtype). With slots, first writes row i of k_new and v_new ([n_slots, Hkv, Dk|Dv], unit
 * stride in the head dim) at cache slot slots[i] (page slots[i] / page_size), so one call writes
 * the forward's keys and attends. Returns 0, or -1 when scratch memory could not be had (after
 * the write, if any). */
int hal_attention_run(
    const void *prepared, const void *q, int64_t q_stride_token, int64_t q_stride_head, void *out,
    void *k_cache, int64_t k_stride_page, int64_t k_stride_slot, int64_t k_stride_head,
    void *v_cache, int64_t v_stride_page, int64_t v_stride_slot, int64_t v_stride_head,
    const float *sinks, /* [Hq] fp32, or NULL */
    const int64_t *slots, int n_slots, /* NULL, or where the new rows go */
    const void *k_new, int64_t k_new_stride_token, int64_t k_new_stride_head,
    const void *v_new, int64_t v_new_stride_token, int64_t v_new_stride_head) {
    const Prepared *p = prepared;
    Call c = p->call;
    c.q = q, c.q_stride_token = q_stride_token, c.q_stride_head = q_stride_head, c.out = out, c.sinks = sinks;
    c.k_cache = k_cache, c.k_stride_page = k_stride_page, c.k_stride_slot = k_stride_slot, c.k_stride_head = k_stride_head;
    c.v_cache = v_cache, c.v_stride_page = v_stride_page, c.v_stride_slot = v_stride_slot, c.v_stride_head = v_stride_head;
    if (slots) {
        write_rows(k_cache, k_stride_page, k_stride_slot, k_stride_head, c.page_size, k_new, k_new_stride_token, k_new_stride_head,
                   slots, n_slots, c.kv_heads, c.qk_dim, element_size(c.dtype));
        write_rows(v_cache, v_stride_page, v_stride_slot, v_stride_head, c.page_size, v_new, v_new_stride_token, v_new_stride_head,
                   slots, n_slots, c.kv_heads, c.v_dim, element_size(c.dtype));
    }
    int failed = 0;
    if (p->threads == 1) { /* no parallel region at all: even an inactive one costs a microsecond or two */
        failed = attend_items(&c, p->items, p->count) != 0;
    } else {
#pragma omp parallel num_threads(p->threads) reduction(| : failed)
        failed = attend_items(&c, p->items, p->count) != 0;
    }
    return failed ? -1 : 0;
}

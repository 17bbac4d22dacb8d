/* The CPU backend's compiled paged attention for batches of few query rows per request (decode,
 * verify, draft steps) and short prompts: hal's masking rule read straight from the paged cache, one pass per
 * request and KV head, with no gather and no per-op dispatch. Built and loaded by
 * hal.backends.cpu.native; held to hal.oracle like the pure-torch kernel.
 *
 * Query row i of request b sits at p = kv_len - q_len + i and sees keys lo..p, lo = max(0, p - W)
 * on a sliding-window layer (W >= 0) and 0 otherwise. Scores and sums are fp32; a sink is one
 * more logit in each row's softmax, with no value. Keys a row does not see are never read, so a
 * NaN there cannot reach it. Plain C11: no torch headers, so the build takes about a second. */

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

/* A row of n elements as fp32: the row itself when it is fp32, else converted into buf. */
static inline const float *row_f32(const void *row, int dtype, int n, float *buf) {
    if (dtype == HAL_F32) return (const float *)row;
    const uint16_t *h = (const uint16_t *)row;
    if (dtype == HAL_BF16) {
#pragma omp simd
        for (int i = 0; i < n; i++) buf[i] = bf16_to_float(h[i]);
    } else {
        for (int i = 0; i < n; i++) buf[i] = f16_to_float(h[i]);
    }
    return buf;
}

/* exp(x) for x <= 0 (a score less the row's maximum), in a form the compiler vectorises: 2^n times
 * a degree-6 polynomial on |r| <= ln2/2 (within 2 ulp of expf); 0 below -87.3 (where expf is
 * subnormal), NaN for NaN. */
static inline float exp_nonpositive(float x) {
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = x < -87.3f || x != x ? 0 : (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x != x ? x : p * scale;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* Four dot products of 16-lane vectors, their lanes summed by one transposed reduction (four
 * halvings shared by the four sums) instead of four horizontal sums: the vector extensions GCC
 * (12 on) and Clang share, lowered to whatever vector width the CPU has. */
#define HAL_LANES 1
typedef float lanes16 __attribute__((vector_size(64), aligned(4)));

static inline lanes16 load16(const float *p) {
    lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

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
#endif

/* fp32 -> bf16, rounding to nearest even as torch does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline size_t element_size(int dtype) { return dtype == HAL_F32 ? 4 : 2; }

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE __attribute__((always_inline))
#else
#define ALWAYS_INLINE
#endif

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

typedef struct {
    float *scores, *queries, *acc, *rows; /* rows: four rows of row_len floats, for converted K/V rows */
    const char **k_rows, **v_rows;        /* where each key and value row of one (request, head) sits */
    int row_len;
} Scratch;

static int scratch_alloc(const Call *c, Scratch *s) {
    s->scores = malloc(sizeof(float) * (size_t)c->group * (size_t)c->max_keys);
    s->queries = malloc(sizeof(float) * (size_t)c->group * (size_t)c->qk_dim);
    s->acc = malloc(sizeof(float) * (size_t)c->group * (size_t)c->v_dim);
    s->row_len = c->qk_dim > c->v_dim ? c->qk_dim : c->v_dim;
    s->rows = malloc(sizeof(float) * 4 * (size_t)s->row_len);
    s->k_rows = malloc(sizeof(char *) * (size_t)c->max_keys);
    s->v_rows = malloc(sizeof(char *) * (size_t)c->max_keys);
    return s->scores && s->queries && s->acc && s->rows && s->k_rows && s->v_rows ? 0 : -1;
}

static void scratch_free(Scratch *s) {
    free(s->scores), free(s->queries), free(s->acc), free(s->rows), free((void *)s->k_rows), free((void *)s->v_rows);
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
            float m = sink; /* a NaN score is skipped here and reaches the sum through its exp */
#pragma omp simd reduction(max : m)
            for (int t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
            float total = c->sinks ? exp_nonpositive(sink - m) : 0.0f;
#pragma omp simd reduction(+ : total)
            for (int t = 0; t < n; t++) total += (sg[t] = exp_nonpositive(sg[t] - m));
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int t = 0; t < n; t++) sg[t] *= inverse;
        }
        memset(s->acc, 0, sizeof(float) * (size_t)group * (size_t)v_dim);
        for (j = lo; j + 3 <= p; j += 4) { /* four keys at a time: one pass over each accumulator row */
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

/* The (request, KV head) items, with scratch rows of this thread's own: shared among the team's
 * threads inside a parallel region, all on the calling thread outside one. 0, or -1 when the
 * scratch could not be had. */
static int attend_items(const Call *c, int items) {
    Scratch scratch;
    const int failed = scratch_alloc(c, &scratch) != 0;
#pragma omp for schedule(static)
    for (int item = 0; item < items; item++)
        if (!failed) attend(c, item / c->kv_heads, item % c->kv_heads, &scratch);
    scratch_free(&scratch);
    return failed ? -1 : 0;
}

/* Below this many multiply-adds a call runs on the calling thread alone: entering a parallel
 * region costs microseconds even with the workers awake. */
#define MIN_PARALLEL_WORK 2e5

/* Returns 0, or -1 when scratch memory could not be had (after the write, if any). With slots,
 * first writes row i of k_new and v_new ([n_slots, Hkv, Dk|Dv], unit stride in the head dim) at
 * cache slot slots[i] (page slots[i] / page_size), so one call writes the forward's keys and
 * attends. The (request, KV head) items are split across up to `threads` threads of OpenMP:
 * built with -fopenmp and loaded into a process that has torch's libgomp (the soname matches),
 * that is torch's own worker pool, so an engine's threads are reused rather than joined by more.
 * Built without OpenMP it runs on the calling thread. */
int hal_paged_attention(
    const void *q, int64_t q_stride_token, int64_t q_stride_head, /* [T, Hq, Dk], unit stride in Dk */
    void *k_cache, int64_t k_stride_page, int64_t k_stride_slot, int64_t k_stride_head,
    void *v_cache, int64_t v_stride_page, int64_t v_stride_slot, int64_t v_stride_head,
    int dtype, int page_size, int q_heads, int kv_heads, int qk_dim, int v_dim,
    const int32_t *block_table, int64_t table_stride, const int32_t *kv_lens, const int32_t *cu_q_lens, int batch,
    float scaling, int window, const float *sinks, /* [Hq] fp32, or NULL */
    void *out, int out_dtype, /* [T, Hq, Dv] contiguous, fp32 or bf16 */
    int threads,
    const int64_t *slots, int n_slots, /* NULL, or where the new rows go */
    const void *k_new, int64_t k_new_stride_token, int64_t k_new_stride_head,
    const void *v_new, int64_t v_new_stride_token, int64_t v_new_stride_head) {
    if (slots) {
        write_rows(k_cache, k_stride_page, k_stride_slot, k_stride_head, page_size, k_new, k_new_stride_token, k_new_stride_head,
                   slots, n_slots, kv_heads, qk_dim, element_size(dtype));
        write_rows(v_cache, v_stride_page, v_stride_slot, v_stride_head, page_size, v_new, v_new_stride_token, v_new_stride_head,
                   slots, n_slots, kv_heads, v_dim, element_size(dtype));
    }
    Call c = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .q_stride_token = q_stride_token, .q_stride_head = q_stride_head,
        .k_stride_page = k_stride_page, .k_stride_slot = k_stride_slot, .k_stride_head = k_stride_head,
        .v_stride_page = v_stride_page, .v_stride_slot = v_stride_slot, .v_stride_head = v_stride_head,
        .dtype = dtype, .page_size = page_size, .q_heads = q_heads, .kv_heads = kv_heads, .qk_dim = qk_dim, .v_dim = v_dim,
        .group = q_heads / kv_heads, .max_keys = 1, .block_table = block_table, .kv_lens = kv_lens, .cu_q_lens = cu_q_lens,
        .table_stride = table_stride, .scaling = scaling, .window = window, .sinks = sinks, .out = out, .out_dtype = out_dtype,
    };
    double multiply_adds = 0.0;
    for (int b = 0; b < batch; b++) {
        if (kv_lens[b] > c.max_keys) c.max_keys = kv_lens[b];
        multiply_adds += (double)(cu_q_lens[b + 1] - cu_q_lens[b]) * kv_lens[b] * q_heads * (qk_dim + v_dim);
    }
    const int items = batch * kv_heads;
    if (threads < 1 || multiply_adds < MIN_PARALLEL_WORK) threads = 1;
    if (threads > items) threads = items > 0 ? items : 1;
    if (threads == 1) /* no parallel region at all: even an inactive one costs a microsecond or two */
        return attend_items(&c, items);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    failed = attend_items(&c, items) != 0;
    return failed ? -1 : 0;
}

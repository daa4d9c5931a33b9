/* Fused CPU loops of pipesim.kernels (the "native" backend; see native.py).
 *
 * Every kernel walks all tensors of a group in one pass. The caller passes,
 * per operand list, the tensors' data addresses and one dtype code; the
 * threads split the concatenated element range [0, total) by offsets. Each
 * block of BLOCK elements (a few KiB, in L1) is converted to float, computed
 * in float, and converted once to the output dtype: one rounding, and each
 * operand read once and written once from main memory.
 *
 * Numerics, deliberately:
 *  - compiled with -ffp-contract=off: no multiply-add is fused behind our
 *    back, so results do not depend on the compiler's mood;
 *  - axpy and the elastic moves use fmaf explicitly (x + a*y rounded once),
 *    as torch's vectorised add/lerp do on FMA machines;
 *  - Adam's w - (c*m)/(sqrt(v)+eps) is unfused, op by op, as torch's addcdiv;
 *  - float -> bfloat16 rounds to nearest even with integer ops; NaN stays NaN;
 *  - float <-> float16 through _Float16 (F16C instructions where present).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };
enum { AXPY = 0, ADAM = 1, ELASTIC = 2 };

#ifndef BLOCK
#define BLOCK 512
#endif

typedef struct {
    int64_t ntensors;
    const int64_t *numel;  /* elements per tensor */
    const int64_t *start;  /* offset of each tensor in the concatenated range */
    void *const *ptr;      /* nlists * ntensors addresses, list after list */
    const int32_t *dtype;  /* one code per list */
    int32_t nlists;
    int32_t kernel;
    float s0, s1;          /* the kernel's scalars */
    int32_t stream;        /* non-temporal stores for outputs not read by the kernel */
} job;

typedef struct {
    const job *j;
    int64_t lo, hi;
} range;

/* The block of one input operand as float: the tensor's own memory for
 * float32, else converted into buf. */
static const float *load(float *restrict buf, const void *base, int dt, int64_t off, int64_t n) {
    switch (dt) {
    case BF16: {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            memcpy(&buf[i], &u, sizeof u);
        }
        return buf;
    }
    case F16: {
        const _Float16 *s = (const _Float16 *)base + off;
        for (int64_t i = 0; i < n; i++)
            buf[i] = (float)s[i];
        return buf;
    }
    default:
        return (const float *)base + off;
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;  /* keeps sign and payload top, quiet bit set */
    return (uint16_t)(f != f ? quiet_nan : rounded);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC 64
static inline void stream_vec(char *d, const char *s) {
    _mm512_stream_si512((void *)d, _mm512_loadu_si512(s));
}
#elif defined(__AVX__)
#include <immintrin.h>
#define VEC 32
static inline void stream_vec(char *d, const char *s) {
    _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
}
#elif defined(__SSE2__)
#include <emmintrin.h>
#define VEC 16
static inline void stream_vec(char *d, const char *s) {
    _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
}
#endif

/* Copy n bytes with non-temporal stores where the target is VEC-aligned:
 * the written lines are not read first (no read-for-ownership), so a kernel
 * writing a fresh output moves no more bytes than it needs. */
static void put_bytes(char *d, const char *restrict s, int64_t n, int stream) {
    int64_t i = 0;
#ifdef VEC
    if (stream) {
        int64_t head = (int64_t)(-(uintptr_t)d & (VEC - 1));
        for (; i < head && i < n; i++)
            d[i] = s[i];
        for (; i + VEC <= n; i += VEC)
            stream_vec(d + i, s + i);
    }
#else
    (void)stream;
#endif
    for (; i < n; i++)
        d[i] = s[i];
}

static void fence(int stream) {
#ifdef VEC
    if (stream)
        _mm_sfence();  /* streamed stores are weakly ordered: drain them before returning */
#else
    (void)stream;
#endif
}

/* Results are computed into an L1 block and written once, converted. */
static void store(void *base, int dt, int64_t off, const float *restrict src, int64_t n, int stream) {
    uint16_t half[BLOCK];
    switch (dt) {
    case BF16:
        for (int64_t i = 0; i < n; i++)
            half[i] = to_bf16(src[i]);
        put_bytes((char *)((uint16_t *)base + off), (const char *)half, 2 * n, stream);
        break;
    case F16:
        for (int64_t i = 0; i < n; i++) {
            _Float16 h = (_Float16)src[i];
            memcpy(&half[i], &h, sizeof h);
        }
        put_bytes((char *)((uint16_t *)base + off), (const char *)half, 2 * n, stream);
        break;
    default:
        put_bytes((char *)((float *)base + off), (const char *)src, 4 * n, stream);
    }
}

#define PTR(j, list, t) ((j)->ptr[(int64_t)(list) * (j)->ntensors + (t)])
#define LOAD(buf, j, list, t, off, n) load(buf, PTR(j, list, t), (j)->dtype[list], off, n)
#define STORE(j, list, t, off, buf, n, stream) store(PTR(j, list, t), (j)->dtype[list], off, buf, n, stream)

/* Stream the output of tensor t unless it is also input list `in` (in place):
 * then its lines are already in cache and a plain store is cheaper. */
static int streams(const job *j, int64_t t, int in) {
    return j->stream && PTR(j, 0, t) != PTR(j, in, t);
}

/* lists: out, x, y.  out = x + s0*y */
static void axpy_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float xb[BLOCK], yb[BLOCK], o[BLOCK];
    const float a = j->s0;
    const float *x = LOAD(xb, j, 1, t, off, n);
    const float *y = LOAD(yb, j, 2, t, off, n);
    for (int64_t i = 0; i < n; i++)
        o[i] = fmaf(a, y[i], x[i]);
    STORE(j, 0, t, off, o, n, streams(j, t, 1));
}

/* lists: out, w, m, v.  out = w - (s0*m) / (sqrt(v) + s1) */
static void adam_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float wb[BLOCK], mb[BLOCK], vb[BLOCK], o[BLOCK];
    const float c = j->s0, eps = j->s1;
    const float *w = LOAD(wb, j, 1, t, off, n);
    const float *m = LOAD(mb, j, 2, t, off, n);
    const float *v = LOAD(vb, j, 3, t, off, n);
    for (int64_t i = 0; i < n; i++)
        o[i] = w[i] - (c * m[i]) / (sqrtf(v[i]) + eps);
    STORE(j, 0, t, off, o, n, streams(j, t, 1));
}

/* lists: centre, replica 0, replica 1, ...  With d_r = x_r - c from the values
 * before the call: x_r <- x_r - s0*d_r, c <- c + s0*sum_r d_r. The centre is
 * written last, so every d_r sees the old centre. */
static void elastic_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float cb[BLOCK], xb[BLOCK], sum[BLOCK], o[BLOCK];
    const float a = j->s0;
    const float *c = LOAD(cb, j, 0, t, off, n);
    for (int64_t i = 0; i < n; i++)
        sum[i] = 0.0f;
    for (int32_t r = 1; r < j->nlists; r++) {
        const float *x = LOAD(xb, j, r, t, off, n);
        for (int64_t i = 0; i < n; i++) {
            float d = x[i] - c[i];
            sum[i] += d;
            o[i] = fmaf(-a, d, x[i]);
        }
        STORE(j, r, t, off, o, n, 0);
    }
    for (int64_t i = 0; i < n; i++)
        o[i] = fmaf(a, sum[i], c[i]);
    STORE(j, 0, t, off, o, n, 0);
}

static void walk(const job *j, int64_t lo, int64_t hi) {
    void (*block)(const job *, int64_t, int64_t, int64_t) =
        j->kernel == AXPY ? axpy_block : j->kernel == ADAM ? adam_block : elastic_block;
    for (int64_t t = 0; t < j->ntensors && lo < hi; t++) {
        int64_t s = j->start[t], e = s + j->numel[t];
        if (e <= lo)
            continue;
        int64_t a = lo - s, b = (hi < e ? hi : e) - s;
        for (int64_t off = a; off < b; off += BLOCK)
            block(j, t, off, b - off < BLOCK ? b - off : BLOCK);
        lo = s + b;
    }
    fence(j->stream);
}

static void *worker(void *arg) {
    const range *r = arg;
    walk(r->j, r->lo, r->hi);
    return NULL;
}

#define MAX_THREADS 256

/* Run the job on nthreads threads (the caller's included), each on a
 * contiguous slice of the total range cut at multiples of 64 elements. A
 * thread that cannot be created leaves its slice to the caller. */
int pipesim_run(const job *j, int64_t total, int32_t nthreads) {
    if (j->kernel < AXPY || j->kernel > ELASTIC)
        return -1;
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > MAX_THREADS)
        nthreads = MAX_THREADS;
    range parts[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int32_t k = 0; k < nthreads; k++) {
        parts[k].j = j;
        parts[k].lo = k == 0 ? 0 : (total / nthreads * k) & ~(int64_t)63;
        parts[k].hi = total;
        if (k > 0)
            parts[k - 1].hi = parts[k].lo;
    }
    for (int32_t k = 1; k < nthreads; k++)
        started[k] = pthread_create(&tids[k], NULL, worker, &parts[k]) == 0;
    walk(j, parts[0].lo, parts[0].hi);
    for (int32_t k = 1; k < nthreads; k++) {
        if (started[k])
            pthread_join(tids[k], NULL);
        else
            walk(j, parts[k].lo, parts[k].hi);
    }
    return 0;
}

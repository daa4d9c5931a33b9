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

#define BLOCK 512

typedef struct {
    int64_t ntensors;
    const int64_t *numel;  /* elements per tensor */
    const int64_t *start;  /* offset of each tensor in the concatenated range */
    void *const *ptr;      /* nlists * ntensors addresses, list after list */
    const int32_t *dtype;  /* one code per list */
    int32_t nlists;
    int32_t kernel;
    float s0, s1;          /* the kernel's scalars */
} job;

typedef struct {
    const job *j;
    int64_t lo, hi;
} range;

static void load(float *restrict dst, const void *base, int dt, int64_t off, int64_t n) {
    switch (dt) {
    case F32:
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
        break;
    case BF16: {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            memcpy(&dst[i], &u, sizeof u);
        }
        break;
    }
    case F16: {
        const _Float16 *s = (const _Float16 *)base + off;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        break;
    }
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;  /* keeps sign and payload top, quiet bit set */
    return (uint16_t)(f != f ? quiet_nan : rounded);
}

static void store(void *base, int dt, int64_t off, const float *restrict src, int64_t n) {
    switch (dt) {
    case F32:
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
        break;
    case BF16: {
        uint16_t *d = (uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++)
            d[i] = to_bf16(src[i]);
        break;
    }
    case F16: {
        _Float16 *d = (_Float16 *)base + off;
        for (int64_t i = 0; i < n; i++)
            d[i] = (_Float16)src[i];
        break;
    }
    }
}

#define PTR(j, list, t) ((j)->ptr[(int64_t)(list) * (j)->ntensors + (t)])
#define LOAD(buf, j, list, t, off, n) load(buf, PTR(j, list, t), (j)->dtype[list], off, n)
#define STORE(j, list, t, off, buf, n) store(PTR(j, list, t), (j)->dtype[list], off, buf, n)

/* lists: out, x, y.  out = x + s0*y */
static void axpy_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float x[BLOCK], y[BLOCK];
    const float a = j->s0;
    LOAD(x, j, 1, t, off, n);
    LOAD(y, j, 2, t, off, n);
    for (int64_t i = 0; i < n; i++)
        x[i] = fmaf(a, y[i], x[i]);
    STORE(j, 0, t, off, x, n);
}

/* lists: out, w, m, v.  out = w - (s0*m) / (sqrt(v) + s1) */
static void adam_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float w[BLOCK], m[BLOCK], v[BLOCK];
    const float c = j->s0, eps = j->s1;
    LOAD(w, j, 1, t, off, n);
    LOAD(m, j, 2, t, off, n);
    LOAD(v, j, 3, t, off, n);
    for (int64_t i = 0; i < n; i++)
        w[i] = w[i] - (c * m[i]) / (sqrtf(v[i]) + eps);
    STORE(j, 0, t, off, w, n);
}

/* lists: centre, replica 0, replica 1, ...  With d_r = x_r - c from the values
 * before the call: x_r <- x_r - s0*d_r, c <- c + s0*sum_r d_r. The centre is
 * written last, so every d_r sees the old centre. */
static void elastic_block(const job *j, int64_t t, int64_t off, int64_t n) {
    float c[BLOCK], sum[BLOCK], x[BLOCK];
    const float a = j->s0;
    LOAD(c, j, 0, t, off, n);
    for (int64_t i = 0; i < n; i++)
        sum[i] = 0.0f;
    for (int32_t r = 1; r < j->nlists; r++) {
        LOAD(x, j, r, t, off, n);
        for (int64_t i = 0; i < n; i++) {
            float d = x[i] - c[i];
            sum[i] += d;
            x[i] = fmaf(-a, d, x[i]);
        }
        STORE(j, r, t, off, x, n);
    }
    for (int64_t i = 0; i < n; i++)
        c[i] = fmaf(a, sum[i], c[i]);
    STORE(j, 0, t, off, c, n);
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

/*
 * The LSTM time loop of one (layer, direction) in C, float32, AVX-512, GIL released.
 *
 * Why: NumPy pays ~1 us per call and a step of cuDNN's LSTM needs about nine calls,
 * while PyTorch runs oneDNN's fused LSTM (3.4 us a step at B=1, H=128). Here a step is
 * one pass of a register-blocked GEMM whose epilogue applies the gates, so gate
 * pre-activations never leave registers.
 *
 * Layout (built by native/__init__.py): hidden units are grouped in blocks of 16; a
 * weight "panel" of block j is K rows of 64 floats, the i, f, g, o gates of those 16
 * units (cuDNN's gate order), so one row of 4 zmm registers holds every gate of 16
 * units. Projection weights use the same panels, 64 output columns each. Units past H
 * are zero-padded: their gates see 0 and are never stored.
 *
 * Threads own disjoint unit blocks for the whole call, compute their own columns of
 * the input projection (no barrier needed there) and meet once per step (twice with a
 * projection): h of step t is complete before anyone reads it for t + 1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_KERNEL 1
#include <immintrin.h>
#else
#define HAVE_KERNEL 0
#endif

#define NR 64       /* panel width: 4 gates x 16 units, or 64 projection columns */
#define MR 6        /* rows per micro-tile: 6 x 4 accumulators + 4 weight registers */
#define XP_ROWS 384 /* input-projection rows computed ahead, per chunk of time steps */

typedef struct {
    _Atomic int count;
    _Atomic int gen;
    int n;
} barrier_t;

static void barrier_wait(barrier_t *b) {
    if (b->n == 1) return;
    int gen = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->gen, 1, memory_order_release);
        return;
    }
    /* Spin briefly (a step is microseconds), then yield so an oversubscribed host
     * does not starve the thread we are waiting for. */
    for (long spins = 0; atomic_load_explicit(&b->gen, memory_order_acquire) == gen; spins++) {
        if (spins < 2000) {
#if HAVE_KERNEL
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

typedef struct {
    int T, B, I, H, Ho, Hp, nb, npb, threads;
    const float *x;      /* [T, B, I] */
    const float *wx;     /* [nb, I, NR] */
    const float *bx;     /* [nb, NR] */
    const float *wh;     /* [nb, Ho, NR] */
    const float *proj;   /* [npb, H, NR] or NULL */
    const int64_t *active; /* [T], non-increasing */
    float *h;            /* [B, Ho]: h0 in, final h out */
    float *c;            /* [B, H]: c0 in, final c out */
    float *out;          /* [T, B, Ho], zero where inactive */
    float *cs;           /* [B, Hp] scratch */
    float *ms;           /* [B, Hp] scratch: o * tanh(c) before the projection */
    float *xp;           /* [XP chunk rows, nb * NR] */
    int chunk;           /* time steps per input-projection chunk */
    barrier_t bar;
    _Atomic int gate;    /* 0 wait, 1 run, -1 give up (a helper thread failed to start) */
} lstm_job;

#if HAVE_KERNEL
#define KERNEL __attribute__((target("avx512f,avx512dq,fma"))) static inline __attribute__((always_inline))

/* acc[r][q] += sum_k A[r, k] * W[k, 16q:16q+16] for r < mr (a compile-time constant). */
KERNEL void gemm_tile(int mr, int K, const float *A, long lda, const float *W, __m512 acc[MR][4]) {
    for (int k = 0; k < K; k++) {
        const float *w = W + (long)k * NR;
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m512 a = _mm512_set1_ps(A[r * lda + k]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(a, w3, acc[r][3]);
        }
    }
}

/* exp with Cephes' expf polynomial: relative error ~1e-7 over the clamped range. */
KERNEL __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 1 / d for d >= 1: rcp14 plus one Newton step is exact to float rounding. */
KERNEL __m512 recip16(__m512 d) {
    __m512 y = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(2.0f)));
}

KERNEL __m512 sigmoid16(__m512 x) {
    return recip16(_mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): no cancellation for large |x|,
 * absolute error ~1e-7 near 0. */
KERNEL __m512 tanh16(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    __m512 e = exp16(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), recip16(_mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* dst[r, :] = c0[r, :] + A[r, :K] @ W for r < mr; c0 NULL means zeros, ldc0 = 0 repeats one row.
 * A function of its own (not inlined) so the 24 accumulators own the register file. */
KERNEL void gemm_rows(int mr, int K, const float *A, long lda, const float *W,
                      const float *c0, long ldc0, float *dst, long ldd) {
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = c0 ? _mm512_loadu_ps(c0 + i * ldc0 + 16 * q) : _mm512_setzero_ps();
    if (mr <= 2) {
        /* Few rows leave too few independent FMA chains to hide the FMA latency: run the
         * two halves of K on separate accumulators (2x faster at batch 1). */
        __m512 acc2[MR][4];
        int half = K / 2;
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < 4; q++) acc2[i][q] = _mm512_setzero_ps();
        for (int k = 0; k < half; k++) {
            gemm_tile(mr, 1, A + k, lda, W + (long)k * NR, acc);
            gemm_tile(mr, 1, A + half + k, lda, W + (long)(half + k) * NR, acc2);
        }
        if (K % 2) gemm_tile(mr, 1, A + K - 1, lda, W + (long)(K - 1) * NR, acc);
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < 4; q++) acc[i][q] = _mm512_add_ps(acc[i][q], acc2[i][q]);
    } else {
        gemm_tile(mr, K, A, lda, W, acc);
    }
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(dst + i * ldd + 16 * q, acc[i][q]);
}

__attribute__((target("avx512f,avx512dq,fma"), noinline))
static void gemm(int mr, int K, const float *A, long lda, const float *W, const float *c0, long ldc0, float *dst, long ldd) {
    switch (mr) {
    case 6: gemm_rows(6, K, A, lda, W, c0, ldc0, dst, ldd); break;
    case 5: gemm_rows(5, K, A, lda, W, c0, ldc0, dst, ldd); break;
    case 4: gemm_rows(4, K, A, lda, W, c0, ldc0, dst, ldd); break;
    case 3: gemm_rows(3, K, A, lda, W, c0, ldc0, dst, ldd); break;
    case 2: gemm_rows(2, K, A, lda, W, c0, ldc0, dst, ldd); break;
    default: gemm_rows(1, K, A, lda, W, c0, ldc0, dst, ldd);
    }
}

/* One micro-tile of a step: gates of rows [r, r + mr) for unit block j, then the cell. */
__attribute__((target("avx512f,avx512dq,fma")))
static void lstm_tile(const lstm_job *job, int t, int j, int r, int mr, const float *hprev, const float *xp) {
    int Ho = job->Ho, Hp = job->Hp;
    long ldx = (long)job->nb * NR;
    float tile[MR * NR] __attribute__((aligned(64)));
    gemm(mr, Ho, hprev + (long)r * Ho, Ho, job->wh + (long)j * Ho * NR, xp + (long)r * ldx + (long)j * NR, ldx, tile, NR);
    int left = job->H - 16 * j;
    __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    for (int i = 0; i < mr; i++) {
        const float *g = tile + i * NR;
        float *cp = job->cs + (long)(r + i) * Hp + 16 * j;
        __m512 ig = sigmoid16(_mm512_load_ps(g)), fg = sigmoid16(_mm512_load_ps(g + 16));
        __m512 gg = tanh16(_mm512_load_ps(g + 32)), og = sigmoid16(_mm512_load_ps(g + 48));
        __m512 c = _mm512_fmadd_ps(fg, _mm512_loadu_ps(cp), _mm512_mul_ps(ig, gg));
        _mm512_storeu_ps(cp, c);
        __m512 hv = _mm512_mul_ps(og, tanh16(c));
        if (job->proj)
            _mm512_storeu_ps(job->ms + (long)(r + i) * Hp + 16 * j, hv);
        else
            _mm512_mask_storeu_ps(job->out + ((long)t * job->B + r + i) * Ho + 16 * j, keep, hv);
    }
}

/* Projection of rows [r, r + mr) for output panel p: out[t] = ms @ P^T. */
__attribute__((target("avx512f,avx512dq,fma")))
static void proj_tile(const lstm_job *job, int t, int p, int r, int mr) {
    float tile[MR * NR] __attribute__((aligned(64)));
    gemm(mr, job->H, job->ms + (long)r * job->Hp, job->Hp, job->proj + (long)p * job->H * NR, NULL, 0, tile, NR);
    for (int q = 0; q < 4; q++) {
        int left = job->Ho - p * NR - 16 * q;
        if (left <= 0) break;
        __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        for (int i = 0; i < mr; i++)
            _mm512_mask_storeu_ps(job->out + ((long)t * job->B + r + i) * job->Ho + p * NR + 16 * q, keep,
                                  _mm512_load_ps(tile + i * NR + 16 * q));
    }
}

__attribute__((target("avx512f,avx512dq,fma")))
static void lstm_worker(lstm_job *job, int tid) {
    int nt = job->threads;
    int j0 = job->nb * tid / nt, j1 = job->nb * (tid + 1) / nt;
    int p0 = job->npb * tid / nt, p1 = job->npb * (tid + 1) / nt;
    long B = job->B;
    for (int i = 0; i < B; i++)
        for (int u = 16 * j0; u < 16 * j1; u++)
            job->cs[i * job->Hp + u] = u < job->H ? job->c[i * job->H + u] : 0.0f;
    for (int t0 = 0; t0 < job->T; t0 += job->chunk) {
        int t1 = t0 + job->chunk < job->T ? t0 + job->chunk : job->T;
        long r0 = t0 * B, r1 = t1 * B;
        long ldx = (long)job->nb * NR;
        for (int j = j0; j < j1; j++)
            for (long r = r0; r < r1; r += MR)
                gemm(r1 - r < MR ? (int)(r1 - r) : MR, job->I, job->x + r * job->I, job->I,
                     job->wx + (long)j * job->I * NR, job->bx + (long)j * NR, 0, job->xp + (r - r0) * ldx + (long)j * NR, ldx);
        for (int t = t0; t < t1; t++) {
            int n = (int)job->active[t];
            const float *hprev = t == 0 ? job->h : job->out + (long)(t - 1) * B * job->Ho;
            const float *xp = job->xp + (long)(t - t0) * B * job->nb * NR;
            for (int j = j0; j < j1; j++)
                for (int r = 0; r < n; r += MR)
                    lstm_tile(job, t, j, r, n - r < MR ? n - r : MR, hprev, xp);
            if (job->proj) {
                barrier_wait(&job->bar);
                for (int p = p0; p < p1; p++)
                    for (int r = 0; r < n; r += MR)
                        proj_tile(job, t, p, r, n - r < MR ? n - r : MR);
            }
            barrier_wait(&job->bar);
        }
    }
}
#endif /* HAVE_KERNEL */

typedef struct {
    lstm_job *job;
    int tid;
} worker_arg;

static void *worker_main(void *p) {
#if HAVE_KERNEL
    worker_arg *a = (worker_arg *)p;
    int gate;
    while ((gate = atomic_load_explicit(&a->job->gate, memory_order_acquire)) == 0) sched_yield();
    if (gate == 1) lstm_worker(a->job, a->tid);
#endif
    return NULL;
}

static int has_kernel(void) {
#if HAVE_KERNEL
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static PyObject *supported(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(has_kernel());
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t floats, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len != floats * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", name, view->len, floats * (Py_ssize_t)sizeof(float));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *lstm(PyObject *self, PyObject *args) {
    PyObject *ox, *owx, *obx, *owh, *oproj, *oactive, *oh, *oc, *oout;
    int T, B, I, H, Ho, threads;
    if (!PyArg_ParseTuple(args, "iiiiiOOOOOOOOOi", &T, &B, &I, &H, &Ho, &ox, &owx, &obx, &owh, &oproj,
                          &oactive, &oh, &oc, &oout, &threads))
        return NULL;
    if (!has_kernel()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX-512; use the NumPy path");
        return NULL;
    }
    if (T < 1 || B < 1 || I < 1 || H < 1 || Ho < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "sizes and threads must be positive");
        return NULL;
    }
    lstm_job job = {0};
    job.T = T; job.B = B; job.I = I; job.H = H; job.Ho = Ho;
    job.nb = (H + 15) / 16; job.Hp = 16 * job.nb;
    job.npb = oproj == Py_None ? 0 : (Ho + NR - 1) / NR;
    job.threads = threads < job.nb ? threads : job.nb;
    job.bar.n = job.threads;
    job.chunk = XP_ROWS / B > 0 ? XP_ROWS / B : 1;
    if (job.chunk > T) job.chunk = T;

    Py_buffer bufs[9];
    int got = 0, ok = 1;
    PyObject *objs[9] = {ox, owx, obx, owh, oproj, oactive, oh, oc, oout};
    Py_ssize_t sizes[9] = {(Py_ssize_t)T * B * I, (Py_ssize_t)job.nb * I * NR, (Py_ssize_t)job.nb * NR,
                           (Py_ssize_t)job.nb * Ho * NR, (Py_ssize_t)job.npb * H * NR, (Py_ssize_t)T * 2,
                           (Py_ssize_t)B * Ho, (Py_ssize_t)B * H, (Py_ssize_t)T * B * Ho};
    const char *names[9] = {"x", "wx", "bx", "wh", "proj", "active", "h", "c", "out"};
    int writable[9] = {0, 0, 0, 0, 0, 0, 1, 1, 1};
    for (; got < 9; got++) {
        if (got == 4 && oproj == Py_None) { bufs[got].obj = NULL; continue; }
        /* active is int64: 2 floats wide per entry. */
        if (get_buffer(objs[got], &bufs[got], sizes[got], writable[got], names[got]) < 0) { ok = 0; break; }
    }
    if (ok) {
        job.x = bufs[0].buf; job.wx = bufs[1].buf; job.bx = bufs[2].buf; job.wh = bufs[3].buf;
        job.proj = oproj == Py_None ? NULL : bufs[4].buf;
        job.active = bufs[5].buf; job.h = bufs[6].buf; job.c = bufs[7].buf; job.out = bufs[8].buf;
        size_t xp_floats = (size_t)job.chunk * B * job.nb * NR;
        job.xp = aligned_alloc(64, ((xp_floats * sizeof(float)) + 63) / 64 * 64);
        job.cs = aligned_alloc(64, (size_t)B * job.Hp * sizeof(float));
        job.ms = aligned_alloc(64, (size_t)B * job.Hp * sizeof(float));
        if (!job.xp || !job.cs || !job.ms) {
            PyErr_NoMemory();
            ok = 0;
        }
    }
    if (ok) {
        pthread_t tids[64];
        worker_arg wargs[64];
        int started = 1;
        if (job.threads > 64) job.threads = job.bar.n = 64;
        Py_BEGIN_ALLOW_THREADS
        for (int k = 1; k < job.threads; k++) {
            wargs[k].job = &job; wargs[k].tid = k;
            if (pthread_create(&tids[k], NULL, worker_main, &wargs[k]) != 0) break;
            started++;
        }
        atomic_store_explicit(&job.gate, started == job.threads ? 1 : -1, memory_order_release);
        if (started == job.threads) {
            wargs[0].job = &job; wargs[0].tid = 0;
            worker_main(&wargs[0]);
        }
        for (int k = 1; k < started; k++) pthread_join(tids[k], NULL);
        if (started == job.threads) {
            /* Final states: h of each row's last step (rows are sorted by length), its c. */
            int len = T;
            for (int r = 0; r < B; r++) {
                while (len > 0 && job.active[len - 1] <= r) len--;
                memcpy(job.h + (long)r * Ho, job.out + ((long)(len - 1) * B + r) * Ho, (size_t)Ho * sizeof(float));
                memcpy(job.c + (long)r * H, job.cs + (long)r * job.Hp, (size_t)H * sizeof(float));
            }
        }
        Py_END_ALLOW_THREADS
        if (started != job.threads) {
            PyErr_SetString(PyExc_RuntimeError, "could not start the kernel's threads");
            ok = 0;
        }
    }
    free(job.xp); free(job.cs); free(job.ms);
    for (int k = 0; k < got; k++)
        if (bufs[k].obj) PyBuffer_Release(&bufs[k]);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "True when this CPU can run the kernel (x86-64 with AVX-512)."},
    {"lstm", lstm, METH_VARARGS,
     "lstm(T, B, I, H, Ho, x, wx, bx, wh, proj, active, h, c, out, threads): one (layer, direction) of an LSTM."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Compiled LSTM kernel of the reference engine.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }

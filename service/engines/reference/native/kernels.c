/*
 * The time loop of one (layer, direction) of an LSTM or a GRU in C, float32, AVX-512,
 * GIL released.
 *
 * Why: NumPy pays ~1 us per call and a step of cuDNN's LSTM needs about nine calls (a
 * GRU step about twelve), while PyTorch runs oneDNN's fused RNN (3.4 us an LSTM step at
 * B=1, H=128). Here a step is one pass of a register-blocked GEMM whose epilogue applies
 * the gates, so gate pre-activations never leave registers and L1.
 *
 * Layout (built by native/__init__.py): hidden units are grouped in blocks of 16; a
 * weight "panel" of block j is K rows of G x 16 floats, the G gates of those 16 units in
 * cuDNN's gate order (LSTM i, f, g, o; GRU r, z, n), so one row of G zmm registers holds
 * every gate of 16 units. Projection weights use 64-column panels. Units past H are
 * zero-padded: their gates see 0 and are never stored.
 *
 * Threads own disjoint unit blocks for the whole call, compute their own columns of the
 * input projection (no barrier needed there) and meet once per step (twice with a
 * projection): h of step t is complete before anyone reads it for t + 1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: its pyconfig.h defines _GNU_SOURCE, which sched_getcpu needs */

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

#define ACCS 24     /* accumulator registers of a micro-tile; with the weight row and the
                       broadcast that leaves a few of the 32 zmm registers spare */
#define MAX_NQ 4    /* zmm registers per panel row: LSTM 4 gates, GRU 3 */
#define MAX_MR 8    /* rows per micro-tile: ACCS / nq, 6 for the LSTM, 8 for the GRU */
#define PROJ_NQ 4   /* projection panels are 64 columns whatever the cell */
#define XP_ROWS 384 /* input-projection rows computed ahead, per chunk of time steps */
#define MAX_THREADS 64

enum cell { CELL_LSTM, CELL_GRU };

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
    int cell;            /* enum cell */
    int nq;              /* gates = zmm registers per panel row */
    int pw;              /* panel width in floats: 16 * nq */
    int mr;              /* rows per micro-tile: ACCS / nq */
    int T, B, I, H, Ho, Hp, nb, npb, threads;
    const float *x;      /* [T, B, I] */
    const float *wx;     /* [nb, I, pw] */
    const float *bx;     /* [nb, pw]: every bias that sits outside GRU's reset gate */
    const float *wh;     /* [nb, Ho, pw] */
    const float *bh;     /* GRU [nb, pw]: bR_n in the n columns, 0 in r and z; LSTM NULL */
    const float *proj;   /* LSTM [npb, H, 64] or NULL */
    const int64_t *active; /* [T], non-increasing */
    float *h;            /* [B, Ho]: h0 in, final h out */
    float *c;            /* LSTM [B, H]: c0 in, final c out; GRU NULL */
    float *out;          /* [T, B, Ho], zero where inactive */
    float *cs;           /* LSTM [B, Hp] scratch */
    float *ms;           /* LSTM [B, Hp] scratch: o * tanh(c) before the projection */
    float *xp;           /* [XP chunk rows, nb * pw] */
    int chunk;           /* time steps per input-projection chunk */
    barrier_t bar;
    _Atomic int gate;    /* 0 wait, 1 run, -1 give up (a helper thread failed to start) */
} rnn_job;

#if HAVE_KERNEL
#define TARGET __attribute__((target("avx512f,avx512dq,fma")))
#define KERNEL TARGET static inline __attribute__((always_inline))

/* acc[r][q] += sum_k A[r, k] * W[k, 16q:16q+16] for r < mr, q < nq (compile-time constants). */
KERNEL void gemm_tile(int nq, int mr, int K, const float *A, long lda, const float *W,
                      __m512 acc[MAX_MR][MAX_NQ]) {
    for (int k = 0; k < K; k++) {
        const float *w = W + (long)k * 16 * nq;
        __m512 wv[MAX_NQ];
        for (int q = 0; q < nq; q++) wv[q] = _mm512_loadu_ps(w + 16 * q);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m512 a = _mm512_set1_ps(A[r * lda + k]);
            for (int q = 0; q < nq; q++) acc[r][q] = _mm512_fmadd_ps(a, wv[q], acc[r][q]);
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

/* Lanes of a 16-unit block that hold real units (the last block of H may be partial). */
KERNEL __mmask16 unit_mask(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* dst[r, :] = c0[r, :] + A[r, :K] @ W for r < mr, over a panel of nq x 16 columns; c0 NULL
 * means zeros, ldc0 = 0 repeats one row. A function of its own (not inlined into the cell
 * epilogues) so the accumulators own the register file.
 *
 * Every row sums in one order whatever mr is: (c0 + the first half of K + an odd last k)
 * + (the second half of K). A row's tile size depends on the batch around it (rows are
 * tiled mr at a time, the last tile takes the rest), so a fixed order is what keeps a
 * sequence's result the same alone and in any batch, bit for bit. */
KERNEL void gemm_rows(int nq, int mr, int K, const float *A, long lda, const float *W,
                      const float *c0, long ldc0, float *dst, long ldd) {
    __m512 acc[MAX_MR][MAX_NQ];
    int half = K / 2;
    long pw = 16L * nq;
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < nq; q++) acc[i][q] = c0 ? _mm512_loadu_ps(c0 + i * ldc0 + 16 * q) : _mm512_setzero_ps();
    if (mr <= 2) {
        /* Few rows leave too few independent FMA chains to hide the FMA latency: run the
         * two halves of K on separate accumulators at once (2x faster at batch 1). */
        __m512 acc2[MAX_MR][MAX_NQ];
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < nq; q++) acc2[i][q] = _mm512_setzero_ps();
        for (int k = 0; k < half; k++) {
            gemm_tile(nq, mr, 1, A + k, lda, W + k * pw, acc);
            gemm_tile(nq, mr, 1, A + half + k, lda, W + (half + k) * pw, acc2);
        }
        if (K % 2) gemm_tile(nq, mr, 1, A + K - 1, lda, W + (K - 1) * pw, acc);
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < nq; q++) acc[i][q] = _mm512_add_ps(acc[i][q], acc2[i][q]);
    } else {
        /* More rows hide the latency themselves, and two sets of accumulators would not fit
         * the register file: the same sums one half after the other, the first parked in dst. */
        gemm_tile(nq, mr, half, A, lda, W, acc);
        if (K % 2) gemm_tile(nq, mr, 1, A + K - 1, lda, W + (K - 1) * pw, acc);
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < nq; q++) {
                _mm512_storeu_ps(dst + i * ldd + 16 * q, acc[i][q]);
                acc[i][q] = _mm512_setzero_ps();
            }
        gemm_tile(nq, mr, half, A + half, lda, W + half * pw, acc);
        for (int i = 0; i < mr; i++)
            for (int q = 0; q < nq; q++) acc[i][q] = _mm512_add_ps(_mm512_loadu_ps(dst + i * ldd + 16 * q), acc[i][q]);
    }
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < nq; q++) _mm512_storeu_ps(dst + i * ldd + 16 * q, acc[i][q]);
}

#define GEMM_CASE(nq, mr) case mr: gemm_rows(nq, mr, K, A, lda, W, c0, ldc0, dst, ldd); return;

/* gemm_rows with nq (4 or 3) and mr (1..ACCS / nq) turned into compile-time constants. */
TARGET __attribute__((noinline))
static void gemm(int nq, int mr, int K, const float *A, long lda, const float *W, const float *c0, long ldc0,
                 float *dst, long ldd) {
    if (nq == 4) {
        switch (mr) { GEMM_CASE(4, 6) GEMM_CASE(4, 5) GEMM_CASE(4, 4) GEMM_CASE(4, 3) GEMM_CASE(4, 2) GEMM_CASE(4, 1) }
    } else {
        switch (mr) {
            GEMM_CASE(3, 8) GEMM_CASE(3, 7) GEMM_CASE(3, 6) GEMM_CASE(3, 5)
            GEMM_CASE(3, 4) GEMM_CASE(3, 3) GEMM_CASE(3, 2) GEMM_CASE(3, 1)
        }
    }
}

/* One micro-tile of an LSTM step: gates of rows [r, r + mr) for unit block j, then the cell. */
TARGET static void lstm_tile(const rnn_job *job, int t, int j, int r, int mr, const float *hprev, const float *xp) {
    int Ho = job->Ho, Hp = job->Hp, pw = job->pw;
    long ldx = (long)job->nb * pw;
    float tile[MAX_MR * 16 * MAX_NQ] __attribute__((aligned(64)));
    gemm(job->nq, mr, Ho, hprev + (long)r * Ho, Ho, job->wh + (long)j * Ho * pw, xp + (long)r * ldx + (long)j * pw,
         ldx, tile, pw);
    __mmask16 keep = unit_mask(job->H - 16 * j);
    for (int i = 0; i < mr; i++) {
        const float *g = tile + i * pw;
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

/* One micro-tile of a GRU step, cuDNN's reset-after form: n = tanh(xn + r * (R_n h + bR_n)),
 * h' = n + z * (h - n). The GEMM starts from bh, so its n columns already hold R_n h + bR_n
 * and its r, z columns only lack the input part, which xp adds. */
TARGET static void gru_tile(const rnn_job *job, int t, int j, int r, int mr, const float *hprev, const float *xp) {
    int H = job->H, pw = job->pw;
    long ldx = (long)job->nb * pw;
    float tile[MAX_MR * 16 * MAX_NQ] __attribute__((aligned(64)));
    gemm(job->nq, mr, H, hprev + (long)r * H, H, job->wh + (long)j * H * pw, job->bh + (long)j * pw, 0, tile, pw);
    __mmask16 keep = unit_mask(H - 16 * j);
    for (int i = 0; i < mr; i++) {
        const float *g = tile + i * pw, *xg = xp + (long)(r + i) * ldx + (long)j * pw;
        __m512 rg = sigmoid16(_mm512_add_ps(_mm512_load_ps(g), _mm512_loadu_ps(xg)));
        __m512 zg = sigmoid16(_mm512_add_ps(_mm512_load_ps(g + 16), _mm512_loadu_ps(xg + 16)));
        __m512 n = tanh16(_mm512_fmadd_ps(rg, _mm512_load_ps(g + 32), _mm512_loadu_ps(xg + 32)));
        /* Masked: the last row's partial block would read past the end of h0. */
        __m512 hp = _mm512_maskz_loadu_ps(keep, hprev + (long)(r + i) * H + 16 * j);
        _mm512_mask_storeu_ps(job->out + ((long)t * job->B + r + i) * H + 16 * j, keep,
                              _mm512_fmadd_ps(zg, _mm512_sub_ps(hp, n), n));
    }
}

/* Projection of rows [r, r + mr) for output panel p: out[t] = ms @ P^T. */
TARGET static void proj_tile(const rnn_job *job, int t, int p, int r, int mr) {
    float tile[MAX_MR * 16 * MAX_NQ] __attribute__((aligned(64)));
    long pw = 16 * PROJ_NQ;
    gemm(PROJ_NQ, mr, job->H, job->ms + (long)r * job->Hp, job->Hp, job->proj + (long)p * job->H * pw, NULL, 0,
         tile, pw);
    for (int q = 0; q < PROJ_NQ; q++) {
        int left = job->Ho - p * (int)pw - 16 * q;
        if (left <= 0) break;
        for (int i = 0; i < mr; i++)
            _mm512_mask_storeu_ps(job->out + ((long)t * job->B + r + i) * job->Ho + p * pw + 16 * q, unit_mask(left),
                                  _mm512_load_ps(tile + i * pw + 16 * q));
    }
}

/* xp = x @ Wx + bx for the time-major rows [r0, r1) and unit blocks [j0, j1): the input
 * projection of a whole chunk of steps as one GEMM, done by the thread that owns those
 * units, so nothing waits for it. */
TARGET static void input_projection(const rnn_job *job, int j0, int j1, long r0, long r1) {
    long ldx = (long)job->nb * job->pw;
    for (int j = j0; j < j1; j++)
        for (long r = r0; r < r1; r += job->mr)
            gemm(job->nq, r1 - r < job->mr ? (int)(r1 - r) : job->mr, job->I, job->x + r * job->I, job->I,
                 job->wx + (long)j * job->I * job->pw, job->bx + (long)j * job->pw, 0,
                 job->xp + (r - r0) * ldx + (long)j * job->pw, ldx);
}

TARGET static void worker(rnn_job *job, int tid) {
    int nt = job->threads, mr = job->mr;
    int j0 = job->nb * tid / nt, j1 = job->nb * (tid + 1) / nt;
    int p0 = job->npb * tid / nt, p1 = job->npb * (tid + 1) / nt;
    long B = job->B;
    if (job->cell == CELL_LSTM)
        for (int i = 0; i < B; i++)
            for (int u = 16 * j0; u < 16 * j1; u++)
                job->cs[i * job->Hp + u] = u < job->H ? job->c[i * job->H + u] : 0.0f;
    for (int t0 = 0; t0 < job->T; t0 += job->chunk) {
        int t1 = t0 + job->chunk < job->T ? t0 + job->chunk : job->T;
        input_projection(job, j0, j1, t0 * B, t1 * B);
        for (int t = t0; t < t1; t++) {
            int n = (int)job->active[t];
            const float *hprev = t == 0 ? job->h : job->out + (long)(t - 1) * B * job->Ho;
            const float *xp = job->xp + (long)(t - t0) * B * job->nb * job->pw;
            for (int j = j0; j < j1; j++)
                for (int r = 0; r < n; r += mr) {
                    if (job->cell == CELL_LSTM)
                        lstm_tile(job, t, j, r, n - r < mr ? n - r : mr, hprev, xp);
                    else
                        gru_tile(job, t, j, r, n - r < mr ? n - r : mr, hprev, xp);
                }
            if (job->proj) {
                barrier_wait(&job->bar);
                for (int p = p0; p < p1; p++)
                    for (int r = 0; r < n; r += mr)
                        proj_tile(job, t, p, r, n - r < mr ? n - r : mr);
            }
            barrier_wait(&job->bar);
        }
    }
}
#endif /* HAVE_KERNEL */

typedef struct {
    rnn_job *job;
    int tid;
} worker_arg;

static void *worker_main(void *p) {
#if HAVE_KERNEL
    worker_arg *a = (worker_arg *)p;
    int gate;
    while ((gate = atomic_load_explicit(&a->job->gate, memory_order_acquire)) == 0) sched_yield();
    if (gate == 1) worker(a->job, a->tid);
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

/* Attributes that keep helper threads off the caller's CPU. On the 2-vCPU VM the scheduler
 * started the helper on the caller's CPU in about half of the calls made after an idle
 * moment, and the load balancer did not split the two cache-hot threads within a call: the
 * whole call then ran at half speed (B=64, H=128 LSTM: 14.5 ms instead of 7.4). Only the
 * helpers are restricted; the caller (a Python thread) keeps its own mask. Returns NULL where
 * that is not possible (one allowed CPU, not Linux), and the helpers start unrestricted. */
static pthread_attr_t *helper_attr(pthread_attr_t *attr) {
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t mask;
    int me = sched_getcpu();
    if (me < 0 || sched_getaffinity(0, sizeof mask, &mask) != 0 || !CPU_ISSET(me, &mask) || CPU_COUNT(&mask) < 2)
        return NULL;
    CPU_CLR(me, &mask);
    if (pthread_attr_init(attr) != 0) return NULL;
    if (pthread_attr_setaffinity_np(attr, sizeof mask, &mask) != 0) {
        pthread_attr_destroy(attr);
        return NULL;
    }
    return attr;
#else
    (void)attr;
    return NULL;
#endif
}

/* Checks sizes and fills the job's shape; 0, or -1 with a Python error set. */
static int setup_job(rnn_job *job, int cell, int T, int B, int I, int H, int Ho, int threads, int has_proj) {
    if (!has_kernel()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX-512; use the NumPy path");
        return -1;
    }
    if (T < 1 || B < 1 || I < 1 || H < 1 || Ho < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "sizes and threads must be positive");
        return -1;
    }
    job->cell = cell;
    job->nq = cell == CELL_LSTM ? 4 : 3;
    job->pw = 16 * job->nq;
    job->mr = ACCS / job->nq;
    job->T = T; job->B = B; job->I = I; job->H = H; job->Ho = Ho;
    job->nb = (H + 15) / 16; job->Hp = 16 * job->nb;
    job->npb = has_proj ? (Ho + 16 * PROJ_NQ - 1) / (16 * PROJ_NQ) : 0;
    job->threads = threads < job->nb ? threads : job->nb;
    if (job->threads > MAX_THREADS) job->threads = MAX_THREADS;
    job->bar.n = job->threads;
    job->chunk = XP_ROWS / B > 0 ? XP_ROWS / B : 1;
    if (job->chunk > T) job->chunk = T;
    return 0;
}

/* A Python buffer argument: its expected size and where the job keeps its address. */
typedef struct {
    const char *name;
    PyObject *obj;       /* Py_None for an optional buffer left out */
    Py_ssize_t floats;   /* expected size in float32 units (an int64 entry counts 2) */
    int writable;
    Py_buffer view;
} arg_buffer;

static void release_buffers(arg_buffer *bufs, int n) {
    for (int k = 0; k < n; k++)
        if (bufs[k].view.obj) PyBuffer_Release(&bufs[k].view);
}

/* Acquires every buffer as C-contiguous with its exact size; 0, or -1 with an error set. */
static int get_buffers(arg_buffer *bufs, int n) {
    for (int k = 0; k < n; k++) {
        arg_buffer *b = &bufs[k];
        b->view.obj = NULL;
        b->view.buf = NULL;
        if (b->obj == Py_None) continue;
        if (PyObject_GetBuffer(b->obj, &b->view, PyBUF_C_CONTIGUOUS | (b->writable ? PyBUF_WRITABLE : 0)) < 0) {
            b->view.obj = NULL;
            release_buffers(bufs, k);
            return -1;
        }
        if (b->view.len != b->floats * (Py_ssize_t)sizeof(float)) {
            PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", b->name, b->view.len,
                         b->floats * (Py_ssize_t)sizeof(float));
            release_buffers(bufs, k + 1);
            return -1;
        }
    }
    return 0;
}

/* Runs a job whose buffers are set: scratch, helper threads, the time loop, final states.
 * Returns None, or NULL with an error set. */
static PyObject *run_job(rnn_job *job) {
    int ok = 1, lstm = job->cell == CELL_LSTM;
    size_t xp_floats = (size_t)job->chunk * job->B * job->nb * job->pw;
    size_t state_bytes = (size_t)job->B * job->Hp * sizeof(float);
    job->xp = aligned_alloc(64, (xp_floats * sizeof(float) + 63) / 64 * 64);
    job->cs = lstm ? aligned_alloc(64, state_bytes) : NULL;
    job->ms = lstm && job->proj ? aligned_alloc(64, state_bytes) : NULL;
    if (!job->xp || (lstm && !job->cs) || (lstm && job->proj && !job->ms)) {
        PyErr_NoMemory();
        ok = 0;
    }
    if (ok) {
        pthread_t tids[MAX_THREADS];
        worker_arg wargs[MAX_THREADS];
        int started = 1, T = job->T, B = job->B, Ho = job->Ho;
        Py_BEGIN_ALLOW_THREADS
        pthread_attr_t attr_storage, *attr = job->threads > 1 ? helper_attr(&attr_storage) : NULL;
        for (int k = 1; k < job->threads; k++) {
            wargs[k].job = job; wargs[k].tid = k;
            if (pthread_create(&tids[k], attr, worker_main, &wargs[k]) != 0) break;
            started++;
        }
        if (attr) pthread_attr_destroy(attr);
        atomic_store_explicit(&job->gate, started == job->threads ? 1 : -1, memory_order_release);
        if (started == job->threads) {
            wargs[0].job = job; wargs[0].tid = 0;
            worker_main(&wargs[0]);
        }
        for (int k = 1; k < started; k++) pthread_join(tids[k], NULL);
        if (started == job->threads) {
            /* Final states: h of each row's last step (rows are sorted by length), its c. */
            int len = T;
            for (int r = 0; r < B; r++) {
                while (len > 0 && job->active[len - 1] <= r) len--;
                memcpy(job->h + (long)r * Ho, job->out + ((long)(len - 1) * B + r) * Ho, (size_t)Ho * sizeof(float));
                if (lstm)
                    memcpy(job->c + (long)r * job->H, job->cs + (long)r * job->Hp, (size_t)job->H * sizeof(float));
            }
        }
        Py_END_ALLOW_THREADS
        if (started != job->threads) {
            PyErr_SetString(PyExc_RuntimeError, "could not start the kernel's threads");
            ok = 0;
        }
    }
    free(job->xp); free(job->cs); free(job->ms);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *lstm(PyObject *self, PyObject *args) {
    PyObject *ox, *owx, *obx, *owh, *oproj, *oactive, *oh, *oc, *oout;
    int T, B, I, H, Ho, threads;
    if (!PyArg_ParseTuple(args, "iiiiiOOOOOOOOOi", &T, &B, &I, &H, &Ho, &ox, &owx, &obx, &owh, &oproj,
                          &oactive, &oh, &oc, &oout, &threads))
        return NULL;
    rnn_job job = {0};
    if (setup_job(&job, CELL_LSTM, T, B, I, H, Ho, threads, oproj != Py_None) < 0) return NULL;
    Py_ssize_t pw = job.pw;
    arg_buffer bufs[] = {
        {"x", ox, (Py_ssize_t)T * B * I, 0}, {"wx", owx, (Py_ssize_t)job.nb * I * pw, 0},
        {"bx", obx, (Py_ssize_t)job.nb * pw, 0}, {"wh", owh, (Py_ssize_t)job.nb * Ho * pw, 0},
        {"proj", oproj, (Py_ssize_t)job.npb * H * 16 * PROJ_NQ, 0}, {"active", oactive, (Py_ssize_t)T * 2, 0},
        {"h", oh, (Py_ssize_t)B * Ho, 1}, {"c", oc, (Py_ssize_t)B * H, 1}, {"out", oout, (Py_ssize_t)T * B * Ho, 1},
    };
    int n = (int)(sizeof bufs / sizeof bufs[0]);
    if (oc == Py_None) {
        PyErr_SetString(PyExc_ValueError, "c is required");
        return NULL;
    }
    if (get_buffers(bufs, n) < 0) return NULL;
    job.x = bufs[0].view.buf; job.wx = bufs[1].view.buf; job.bx = bufs[2].view.buf; job.wh = bufs[3].view.buf;
    job.proj = bufs[4].view.buf; job.active = bufs[5].view.buf; job.h = bufs[6].view.buf;
    job.c = bufs[7].view.buf; job.out = bufs[8].view.buf;
    PyObject *res = run_job(&job);
    release_buffers(bufs, n);
    return res;
}

static PyObject *gru(PyObject *self, PyObject *args) {
    PyObject *ox, *owx, *obx, *owh, *obh, *oactive, *oh, *oout;
    int T, B, I, H, threads;
    if (!PyArg_ParseTuple(args, "iiiiOOOOOOOOi", &T, &B, &I, &H, &ox, &owx, &obx, &owh, &obh, &oactive, &oh,
                          &oout, &threads))
        return NULL;
    rnn_job job = {0};
    if (setup_job(&job, CELL_GRU, T, B, I, H, H, threads, 0) < 0) return NULL;
    Py_ssize_t pw = job.pw;
    arg_buffer bufs[] = {
        {"x", ox, (Py_ssize_t)T * B * I, 0}, {"wx", owx, (Py_ssize_t)job.nb * I * pw, 0},
        {"bx", obx, (Py_ssize_t)job.nb * pw, 0}, {"wh", owh, (Py_ssize_t)job.nb * H * pw, 0},
        {"bh", obh, (Py_ssize_t)job.nb * pw, 0}, {"active", oactive, (Py_ssize_t)T * 2, 0},
        {"h", oh, (Py_ssize_t)B * H, 1}, {"out", oout, (Py_ssize_t)T * B * H, 1},
    };
    int n = (int)(sizeof bufs / sizeof bufs[0]);
    if (obh == Py_None) {
        PyErr_SetString(PyExc_ValueError, "bh is required");
        return NULL;
    }
    if (get_buffers(bufs, n) < 0) return NULL;
    job.x = bufs[0].view.buf; job.wx = bufs[1].view.buf; job.bx = bufs[2].view.buf; job.wh = bufs[3].view.buf;
    job.bh = bufs[4].view.buf; job.active = bufs[5].view.buf; job.h = bufs[6].view.buf; job.out = bufs[7].view.buf;
    PyObject *res = run_job(&job);
    release_buffers(bufs, n);
    return res;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "True when this CPU can run the kernels (x86-64 with AVX-512)."},
    {"lstm", lstm, METH_VARARGS,
     "lstm(T, B, I, H, Ho, x, wx, bx, wh, proj, active, h, c, out, threads): one (layer, direction) of an LSTM."},
    {"gru", gru, METH_VARARGS,
     "gru(T, B, I, H, x, wx, bx, wh, bh, active, h, out, threads): one (layer, direction) of a reset-after GRU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Compiled LSTM and GRU kernels of the reference engine.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }

/* STREAM-like memory kernels for bench/bandwidth.py: what one decode step's weight reads are
 * measured against. Built by the bench (not a worker kernel): -O3 -march=native -fopenmp. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Sum of n floats read once by `threads` threads, each a contiguous share (the read a GEMV
 * does: every byte once, in order). Four accumulators keep the loads, not the adds, the
 * limit. */
double bw_read(const float *x, int64_t n, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = (n / nt) & ~(int64_t)31, lo = per * t;
        const int64_t hi = t == nt - 1 ? n : lo + per;
        int64_t i = lo;
#if defined(__AVX2__)
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 32 <= hi; i += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (int j = 0; j < 8; j++) total += lanes[j];
#endif
        for (; i < hi; i++) total += x[i];
    }
    return total;
}

/* dst = src, n floats, each thread a contiguous share (STREAM's copy). */
void bw_copy(float *dst, const float *src, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = n / nt, lo = per * t, hi = t == nt - 1 ? n : lo + per;
        memcpy(dst + lo, src + lo, sizeof(float) * (size_t)(hi - lo));
    }
}

/* Seconds per OpenMP barrier of a team of `threads`, over `rounds` barriers. */
double bw_barrier(int rounds, int threads) {
    double seconds = 0.0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
        const double start = omp_get_wtime();
        for (int r = 0; r < rounds; r++) {
#pragma omp barrier
        }
#pragma omp master
        seconds = (omp_get_wtime() - start) / rounds;
    }
    return seconds;
}

/* Seconds per parallel region entered and left (a fork/join) by a team of `threads`. */
double bw_fork_join(int rounds, int threads) {
    const double start = omp_get_wtime();
    for (int r = 0; r < rounds; r++) {
#pragma omp parallel num_threads(threads)
        {
            __asm__ volatile("" ::: "memory");
        }
    }
    return (omp_get_wtime() - start) / rounds;
}

/* Does nothing: the cost of a ctypes call with 12 arguments, as the fused decode step's. */
int bw_noop12(void *a, void *b, int c, void *d, void *e, void *f, int g, void *h, void *i,
              void *j, void *k, int l) {
    (void)a; (void)b; (void)c; (void)d; (void)e; (void)f; (void)g; (void)h; (void)i; (void)j;
    (void)k; (void)l;
    return 0;
}

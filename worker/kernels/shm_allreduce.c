/* The all-reduce of a model split over worker processes on one machine, through shared
 * memory (worker/shm_allreduce.py): each rank copies its part into its own slot, raises its
 * sequence flag, waits for every other rank's flag, and sums all slots in rank order.
 *
 * gloo's all-reduce goes through loopback TCP, hundreds of microseconds for one token's floats,
 * and a decoder layer needs two (docs/performance.md); here it is a copy, a flag and a sum
 * (vLLM's CPU backend does the same for its tensor parallelism).
 *
 * Every rank reads every slot in the same order, so every rank gets the same bits (the
 * replicated hidden state must not drift apart between ranks). Two phases of slots
 * alternate: a rank that finished sum k may write slot k + 1 while a slower one still reads
 * slot k, and it cannot reach k + 2 before that one has raised its flag for k + 1, which it
 * does only after reading slot k.
 */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#define LINE 64
#define HEADER 4096 /* one cache line per rank's flag, at most 64 ranks */
#define SPINS_BEFORE_YIELD 4096
#define PARALLEL_MIN 65536

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t *flag_of(void *base, int rank) {
    return (int64_t *)((char *)base + (int64_t)rank * LINE);
}

static inline float *slot_of(void *base, int phase, int rank, int nranks, int64_t slot_floats) {
    return (float *)((char *)base + HEADER) + ((int64_t)phase * nranks + rank) * slot_floats;
}

/* x (n floats, n <= slot_floats) becomes the sum over ranks of every rank's x. `seq` counts
 * this rank's calls from 1 and is the same on every rank for the same call. */
void loom_shm_allreduce_f32(void *base, int rank, int nranks, int64_t seq, float *x, int64_t n,
                            int64_t slot_floats) {
    const int phase = (int)(seq & 1);
    memcpy(slot_of(base, phase, rank, nranks, slot_floats), x, (size_t)n * sizeof(float));
    __atomic_store_n(flag_of(base, rank), seq, __ATOMIC_RELEASE);
    for (int r = 0; r < nranks; r++) {
        int spins = 0;
        while (__atomic_load_n(flag_of(base, r), __ATOMIC_ACQUIRE) < seq) {
            if (++spins < SPINS_BEFORE_YIELD) {
                cpu_relax();
            } else {  /* the other rank is not running: give it the core */
                sched_yield();
                spins = 0;
            }
        }
    }
    const float *parts[64];
    for (int r = 0; r < nranks; r++) parts[r] = slot_of(base, phase, r, nranks, slot_floats);
#pragma omp parallel for if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float sum = parts[0][i];
        for (int r = 1; r < nranks; r++) sum += parts[r][i];
        x[i] = sum;
    }
}

/* Bytes of the shared region for `nranks` ranks of at most `slot_floats` floats each. */
int64_t loom_shm_allreduce_bytes(int nranks, int64_t slot_floats) {
    return HEADER + 2 * (int64_t)nranks * slot_floats * (int64_t)sizeof(float);
}

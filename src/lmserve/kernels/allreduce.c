/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* ==================================================================================================== *
 * The shared-memory all-reduce in C (shm_all_reduce_f32; the decode stack's ls_all_reduce).              *
 * ==================================================================================================== *
 *
 * The protocol of lmserve/worker/shm_allreduce.py, on the same mapped file, so calls from Python and from C
 * interleave on one sequence: a rank's next call is its own posted flag + 1 (the flag is the rank's call
 * counter, shared by both sides). Call k: wait until every peer posted k - 1, copy x into this rank's slot of
 * buffer k % 2, post k (release), wait until every peer posted k (acquire), then x = slot 0 + slot 1 (+ slot 2
 * ...), left to right, elementwise: the same float additions in the same order as the Python side's torch.add
 * and add_, so both give the same bits. Longer inputs go in slot-sized chunks, one call each (as Python's).
 *
 * Waiting: a rank whose peer is late spins (pause) for spin_us microseconds, then sleeps on a futex on the
 * peer's flag (its low 32 bits, which every post changes) until the peer posts: on a machine where another busy
 * process (the API server) shares the ranks' CPUs, a spinning rank would hold a CPU the late peer or that process
 * needs. A sleeper first raises the peer's `waiters` word (the int64 after its flag, same cache line); a poster
 * that finds it raised clears it and wakes the flag's sleepers (no system call while nobody sleeps). Both sides
 * use sequentially consistent accesses (store, then load the other word): either the sleeper sees the new flag, or
 * the poster sees the raised word; a sleeper whose flag changed in between returns from FUTEX_WAIT at once.
 * Python's posts (worker/shm_allreduce.py) go through shm_post when the kernels are loaded, so they wake too.
 * Sleeps last at most LS_AR_NAP_NS; between them the abort word (set by the owning process's Python watcher
 * thread when its peer is gone: ShmAllReduce.alive) and the deadline (timeout_s from the first sleep) are
 * checked. A rank whose peer died returns LS_AR_ABORTED, one whose peer never came LS_AR_TIMEOUT; the caller
 * raises. */
#define LS_AR_FLAG_STRIDE 8     /* int64s between two ranks' flags (FLAG_STRIDE in shm_allreduce.py) */
#define LS_AR_NAP_NS 5000000LL  /* the longest futex sleep between abort / deadline checks: 5 ms */
enum { LS_AR_ABORTED = -2, LS_AR_TIMEOUT = -3 };

/* Every field 8 bytes (the ctypes Structure in shm_allreduce.py mirrors it). */
struct ls_allreduce {
    int64_t *flags; /* per rank: its flag, then its waiters word; LS_AR_FLAG_STRIDE int64s apart */
    char *data;     /* 2 parities x size ranks x slot_bytes */
    int64_t rank, size, slot_bytes;
    const int64_t *abort; /* nonzero: stop waiting (this process's own word, not shared) */
    double timeout_s;
    int64_t spin_us; /* how long a wait spins before it sleeps (0: sleep at once) */
};

static double ls_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
/* the low half of an int64 flag: the word FUTEX_WAIT compares (little-endian x86-64 only uses this file's
 * shared-memory path: worker/distributed.py) */
static int32_t *ls_low_word(int64_t *flag) { return (int32_t *)flag; }
static void ls_futex_wait(int64_t *flag, int64_t seen) {
    struct timespec t = {0, LS_AR_NAP_NS};
    syscall(SYS_futex, ls_low_word(flag), FUTEX_WAIT, (int32_t)seen, &t, NULL, 0);
}
static void ls_futex_wake(int64_t *flag) {
    syscall(SYS_futex, ls_low_word(flag), FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}
#else
static void ls_futex_wait(int64_t *flag, int64_t seen) {
    (void)flag, (void)seen;
    sched_yield();
}
static void ls_futex_wake(int64_t *flag) { (void)flag; }
#endif

/* Wait until every peer has posted call seq. Returns 0, LS_AR_ABORTED or LS_AR_TIMEOUT. */
static int ls_ar_wait(const struct ls_allreduce *a, int64_t seq) {
    double spin_end = 0.0, deadline = 0.0;
    for (int64_t r = 0; r < a->size; r++) {
        if (r == a->rank) continue;
        int64_t *flag = a->flags + r * LS_AR_FLAG_STRIDE, *waiters = flag + 1;
        for (int64_t checks = 1;; checks++) {
            const int64_t seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
            if (seen >= seq) break;
            if (checks % 64) { /* spin: a clock read every 64 pauses */
#if defined(__x86_64__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            const double now = ls_now();
            if (spin_end == 0.0) spin_end = now + 1e-6 * (double)a->spin_us;
            if (now < spin_end) continue;
            if (__atomic_load_n(a->abort, __ATOMIC_RELAXED)) return LS_AR_ABORTED;
            if (deadline == 0.0) deadline = now + a->timeout_s;
            else if (now > deadline) return LS_AR_TIMEOUT;
            __atomic_store_n(waiters, 1, __ATOMIC_SEQ_CST);
            const int64_t again = __atomic_load_n(flag, __ATOMIC_SEQ_CST);
            if (again >= seq) break;
            ls_futex_wait(flag, again);
        }
    }
    return 0;
}

/* Post call seq: the data written before is visible to a peer that sees the flag (release, TSO); sleepers woken. */
static void ls_ar_post(const struct ls_allreduce *a, int64_t seq) {
    int64_t *mine = a->flags + a->rank * LS_AR_FLAG_STRIDE, *waiters = mine + 1;
    __atomic_store_n(mine, seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(waiters, 0, __ATOMIC_SEQ_CST);
        ls_futex_wake(mine);
    }
}

static int ls_all_reduce(const struct ls_allreduce *a, float *x, int64_t n) {
    const int64_t per = a->slot_bytes / (int64_t)sizeof(float);
    int64_t *mine = a->flags + a->rank * LS_AR_FLAG_STRIDE;
    for (int64_t start = 0; start < n; start += per) {
        const int64_t len = n - start < per ? n - start : per;
        float *xs = x + start;
        const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
        int rc = ls_ar_wait(a, seq - 1); /* every peer is done with this parity's buffer (its call seq - 2) */
        if (rc) return rc;
        char *buf = a->data + (seq % 2) * a->size * a->slot_bytes;
        memcpy(buf + a->rank * a->slot_bytes, xs, sizeof(float) * (size_t)len);
        ls_ar_post(a, seq);
        if ((rc = ls_ar_wait(a, seq))) return rc;
        const float *s0 = (const float *)buf, *s1 = (const float *)(buf + a->slot_bytes);
        for (int64_t i = 0; i < len; i++) xs[i] = s0[i] + s1[i];
        for (int64_t r = 2; r < a->size; r++) {
            const float *sr = (const float *)(buf + r * a->slot_bytes);
            for (int64_t i = 0; i < len; i++) xs[i] += sr[i];
        }
    }
    return 0;
}

/* x (n float32s) summed over the group in place: ShmAllReduce.all_reduce's C path. Returns 0, LS_AR_ABORTED or
 * LS_AR_TIMEOUT. */
int shm_all_reduce_f32(const struct ls_allreduce *a, float *x, int64_t n) { return ls_all_reduce(a, x, n); }

/* The Python side's waits and posts (its gather, other dtypes), so they sleep and wake as the C calls do. */
int shm_wait(const struct ls_allreduce *a, int64_t seq) { return ls_ar_wait(a, seq); }
void shm_post(const struct ls_allreduce *a, int64_t seq) { ls_ar_post(a, seq); }
/* ========================================= end of the shared-memory all-reduce ======================== */

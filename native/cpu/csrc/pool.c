/* A persistent thread pool for back-to-back small jobs (one token calls 100-200 GEMVs).
 *
 * Each worker owns a job counter `seq`: the caller publishes a job by storing the job fields and
 * then bumping `seq` of the workers that take part; a worker runs its part and stores the
 * counter into `done`. An idle worker spins (with pause) for `spin_us`, so the next GEMV of the
 * same token starts within a fraction of a microsecond, then sleeps on a condition variable,
 * so an idle process burns no core. Lost wake-ups are excluded by the order of two seq_cst
 * operations on each side: the worker increments `sleepers` and then re-reads `seq`; the caller
 * stores `seq` and then reads `sleepers` (and broadcasts under the mutex if any sleep).
 *
 * The caller (who holds the library's call lock) runs part 0 itself, then cancels the posts
 * that no worker has claimed yet (a compare-and-swap on `taken` decides who owns each post),
 * and waits only for the workers that did: a task must therefore share its work dynamically,
 * so that every part finishes it alone if need be. After fork() the child has no workers; they
 * are started again at its first job.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "sparse_int4.h"

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

typedef struct {
    _Alignas(64) atomic_uint seq; /* last job posted to this worker */
    _Alignas(64) atomic_uint taken; /* last job claimed, by this worker (to run) or the caller (to cancel) */
    atomic_uint done;              /* last job this worker finished */
    unsigned posted;               /* caller's copy of seq */
    int part;
    pthread_t tid;
} worker_t;

static struct {
    worker_t *w;
    int n_workers;          /* running workers (threads besides the caller) */
    int want_threads;       /* threads including the caller, as set */
    int spin_us;
    atomic_int stop;
    atomic_int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the current job: written before the seq stores that publish it */
    si4_task_fn fn;
    void *arg;
    int n_parts;
    int atfork_registered;
} P = {.want_threads = 1, .spin_us = 200, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* Wait until this worker's seq differs from `seen` (or the pool stops); returns the new seq. */
static unsigned wait_for_job(worker_t *w, unsigned seen) {
    const int spin_us = P.spin_us;
    double start = 0.0;
    for (unsigned it = 0;; it++) {
        unsigned s = atomic_load_explicit(&w->seq, memory_order_acquire);
        if (s != seen || atomic_load_explicit(&P.stop, memory_order_relaxed)) return s;
        CPU_RELAX();
        if ((it & 63) == 0) {
            double t = now_us();
            if (it == 0) start = t;
            else if (t - start > spin_us) break;
        }
    }
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.sleepers, 1);
    unsigned s;
    while ((s = atomic_load(&w->seq)) == seen && !atomic_load(&P.stop)) pthread_cond_wait(&P.cv, &P.mu);
    atomic_fetch_sub(&P.sleepers, 1);
    pthread_mutex_unlock(&P.mu);
    return s;
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals belong to the interpreter's thread */
    unsigned seen = 0; /* seq starts at 0 before the thread exists; a job may already be posted */
    for (;;) {
        unsigned s = wait_for_job(w, seen);
        if (atomic_load(&P.stop)) break;
        seen = s;
        unsigned expected = s - 1;
        if (atomic_compare_exchange_strong(&w->taken, &expected, s)) { /* else the caller cancelled it */
            P.fn(P.arg, w->part, P.n_parts);
            atomic_store_explicit(&w->done, s, memory_order_release);
        }
    }
    return NULL;
}

static void stop_workers(void) {
    if (!P.n_workers) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.w[i].tid, NULL);
    free(P.w);
    P.w = NULL;
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
}

static void after_fork_in_child(void) {
    /* The workers did not survive the fork: forget them (their memory stays allocated). */
    P.w = NULL;
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
    atomic_store(&P.sleepers, 0);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
}

static int start_workers(int n) {
    if (!P.atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        P.atfork_registered = 1;
    }
    if (n <= 0) return 0;
    worker_t *w = NULL;
    if (posix_memalign((void **)&w, 64, sizeof(worker_t) * (size_t)n)) return ENOMEM;
    P.w = w;
    for (int i = 0; i < n; i++) {
        atomic_init(&w[i].seq, 0);
        atomic_init(&w[i].done, 0);
        atomic_init(&w[i].taken, 0);
        w[i].posted = 0;
        w[i].part = i + 1;
        int err = pthread_create(&w[i].tid, NULL, worker_main, &w[i]);
        if (err) {
            P.n_workers = i;
            stop_workers();
            return err;
        }
        P.n_workers = i + 1;
    }
    return 0;
}

int si4_pool_size(void) { return P.want_threads; }

int si4_pool_resize(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    stop_workers();
    P.want_threads = n_threads;
    int err = start_workers(n_threads - 1);
    if (err) P.want_threads = 1 + P.n_workers;
    return err;
}

void si4_pool_set_spin_us(int us) { P.spin_us = us < 0 ? 0 : us; }
int si4_pool_spin_us(void) { return P.spin_us; }

void si4_pool_run(si4_task_fn fn, void *arg, int n_parts) {
    if (P.n_workers != P.want_threads - 1) { /* first use, or first use after fork() */
        stop_workers();
        if (start_workers(P.want_threads - 1)) P.want_threads = 1 + P.n_workers;
    }
    if (n_parts > P.n_workers + 1) n_parts = P.n_workers + 1;
    if (n_parts <= 1) {
        fn(arg, 0, 1);
        return;
    }
    P.fn = fn;
    P.arg = arg;
    P.n_parts = n_parts;
    for (int i = 0; i < n_parts - 1; i++) atomic_store(&P.w[i].seq, ++P.w[i].posted);
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    fn(arg, 0, n_parts);
    for (int i = 0; i < n_parts - 1; i++) {
        /* A worker that has not started yet (asleep, or its core busy elsewhere) is cancelled:
         * the task hands out its work dynamically, so the caller has done that share too. */
        unsigned expected = P.w[i].posted - 1;
        if (atomic_compare_exchange_strong(&P.w[i].taken, &expected, P.w[i].posted)) continue;
        /* the worker is running; yield the core if it was descheduled */
        for (unsigned it = 1; atomic_load_explicit(&P.w[i].done, memory_order_acquire) != P.w[i].posted; it++) {
            CPU_RELAX();
            if ((it & 1023) == 0) sched_yield();
        }
    }
}

int si4_reserve(void **p, size_t *have, size_t need) {
    if (*have >= need) return 0;
    free(*p);
    *have = 0;
    if (!(*p = aligned_alloc(64, (need + 63) / 64 * 64))) return -1;
    *have = need;
    return 0;
}

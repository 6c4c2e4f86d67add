/* cnn.c's threads: a record's work split across a small pool of pthreads, started once and kept.

Why: above a few million multiply-adds a CNN's convolutions are its time, and torch's oneDNN
Graph runs them on the session's two threads; the plan's kernels at one thread lost to that on
the full tier's 224x224 images. Not OpenMP: torch ships its own libgomp, and an OpenMP pool of
ours would be a second set of spinning threads beside it. Not a thread a run: creating one costs
tens of microseconds.

How: the caller posts a job (a record, the part function that runs items [begin, end) of it, the
count of items) and takes part itself; every thread claims a grain of items at a time from one
atomic counter, so a worker the scheduler has not run yet (a busy machine) leaves its share to
the caller instead of holding it: the caller only waits for grains a worker has claimed. Items
are the convolution's chunks of output pixels or the depthwise convolution's rows, each written
by exactly one thread with the same arithmetic as the one-thread run: the outputs are bit for bit
the same. Between jobs a worker spins for SPIN_NS (the next layer's job is usually posted within
it), then sleeps on a condition variable: ONNX Runtime's spinning threads slowed their
neighbours. One run at a time uses the pool (a second run at once runs on its own thread). A
run whose workers took under a fifth of its items (a busy machine: the scheduler seldom ran them)
leaves the pool for the next 4, 8, ... 256 runs, the caller alone, then tries it again
(`pool_ready`, `pool_judge`): at load 4.5 on this 2-vCPU machine two threads had run slower than
one.

The job's state: `generation` odd while a job is open, even while none is; a worker counts
itself `inside` before it reads the generation, and the caller closes a job (even) and waits
for `inside` to be 0 before it writes the next one's fields. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

enum { POOL_MAX = 8 };          /* the most threads a run uses, the caller's among them */
enum { SPIN_NS = 60000 };       /* a worker's spin between jobs before it sleeps */

typedef void (*part_fn)(const int64_t *f, float *A, const float *P, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t lock, owner;  /* owner: held by the run using the pool */
    pthread_cond_t wake;
    _Atomic unsigned generation;
    _Atomic int sleepers;
    _Atomic int64_t inside;
    int started;                  /* workers started (under lock) */
    /* the open job's fields: written by the caller only while no job is open and inside is 0 */
    const int64_t *f;
    float *A;
    const float *P;
    float *const *ext;            /* the caller's edges (an import's or export's part reads them) */
    part_fn fn;
    int64_t items, grain;
    _Atomic int want;             /* workers asked to take part (the run's threads - 1) */
    _Atomic int64_t next, done;
    _Atomic int64_t by_workers;   /* items the workers ran, ever (backplane_cnn_pool_items) */
    _Atomic int64_t all_items;    /* items of every job, ever */
    int64_t alone, strikes;       /* runs left on the caller alone; failed probes in a row */
} team = {.lock = PTHREAD_MUTEX_INITIALIZER, .owner = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static _Thread_local int64_t asked = 1;  /* this thread's runs' threads (backplane_cnn_threads) */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claims and runs grains of the open job until none is left (`worker`: count them). */
static void take_part(int worker) {
    const int64_t items = team.items, grain = team.grain;
    for (;;) {
        const int64_t begin = atomic_fetch_add(&team.next, grain);
        if (begin >= items) return;
        const int64_t end = begin + grain < items ? begin + grain : items;
        team.fn(team.f, team.A, team.P, begin, end);
        if (worker) atomic_fetch_add(&team.by_workers, end - begin);
        atomic_fetch_add(&team.done, end - begin);
    }
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load(&team.generation);
        if (g == seen || !(g & 1)) {  /* no new open job: spin a while, then sleep */
            const int64_t until = now_ns() + SPIN_NS;
            int spins = 0;
            while ((g = atomic_load(&team.generation)) == seen || !(g & 1)) {
                relax();
                if (++spins % 64 == 0 && now_ns() > until) {
                    pthread_mutex_lock(&team.lock);
                    atomic_fetch_add(&team.sleepers, 1);
                    while ((g = atomic_load(&team.generation)) == seen || !(g & 1))
                        pthread_cond_wait(&team.wake, &team.lock);
                    atomic_fetch_sub(&team.sleepers, 1);
                    pthread_mutex_unlock(&team.lock);
                    break;
                }
            }
        }
        seen = g;
        if (index >= atomic_load(&team.want)) continue;
        atomic_fetch_add(&team.inside, 1);
        if (atomic_load(&team.generation) == g) take_part(1);
        atomic_fetch_sub(&team.inside, 1);
    }
    return 0;
}

/* A forked child has none of the parent's workers: it starts its own at its first run. */
static void pool_forked(void) {
    pthread_mutex_init(&team.lock, 0);
    pthread_mutex_init(&team.owner, 0);
    pthread_cond_init(&team.wake, 0);
    atomic_store(&team.inside, 0);
    atomic_store(&team.sleepers, 0);
    if (atomic_load(&team.generation) & 1) atomic_fetch_add(&team.generation, 1);
    team.started = 0;
}

/* Starts workers up to `count` (kept for the process's life); the count running. */
static int pool_workers(int count) {
    static int hooked;
    pthread_mutex_lock(&team.lock);
    if (!hooked) hooked = !pthread_atfork(0, 0, pool_forked);
    while (team.started < count) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)team.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        ++team.started;
    }
    const int started = team.started;
    pthread_mutex_unlock(&team.lock);
    return started;
}

/* Until *at is `value`: spinning for SPIN_NS (a worker's grain is ~10-50 us), then giving the
   CPU up between looks (the worker holding it was preempted: a busy machine). */
static void wait_for(_Atomic int64_t *at, int64_t value) {
    if (atomic_load(at) == value) return;
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 1; atomic_load(at) != value; ++spins)
        if (spins % 64 || now_ns() < until) relax(); else sched_yield();
}

/* Runs items [0, items) of a record through `fn` on the caller and `want` workers, in grains of
   `grain`; returns when every item is done and no worker is inside the job. */
static void pool_run(part_fn fn, const int64_t *f, float *A, const float *P, int64_t items,
                     int64_t grain, int want) {
    team.fn = fn, team.f = f, team.A = A, team.P = P;
    team.items = items, team.grain = grain < 1 ? 1 : grain;
    atomic_store(&team.want, want);
    atomic_store(&team.next, 0);
    atomic_store(&team.done, 0);
    atomic_fetch_add(&team.generation, 1);  /* open */
    if (atomic_load(&team.sleepers)) {
        pthread_mutex_lock(&team.lock);
        pthread_cond_broadcast(&team.wake);
        pthread_mutex_unlock(&team.lock);
    }
    atomic_fetch_add(&team.all_items, items);
    take_part(0);
    wait_for(&team.done, items);  /* a grain a worker claimed, finishing */
    atomic_fetch_add(&team.generation, 1);  /* closed */
    wait_for(&team.inside, 0);
}

/* Whether the run about to start uses the pool (held: team.owner): not while `alone` runs are
   left, which a run whose workers took under a fifth of its items (a busy machine: the scheduler
   seldom ran them, and the caller paid their wake-ups and waits) sets to 4, 8, ... 256 runs
   (doubling while such probes repeat). Returns the counters the run's end reads. */
static int pool_ready(int64_t *workers_before, int64_t *all_before) {
    if (team.alone > 0) {
        --team.alone;
        return 0;
    }
    *workers_before = atomic_load(&team.by_workers);
    *all_before = atomic_load(&team.all_items);
    return 1;
}

static void pool_judge(int64_t workers_before, int64_t all_before) {
    const int64_t by = atomic_load(&team.by_workers) - workers_before,
                  all = atomic_load(&team.all_items) - all_before;
    if (all == 0) return;
    if (5 * by < all) {
        team.strikes = team.strikes < 6 ? team.strikes + 1 : 6;
        team.alone = (int64_t)2 << team.strikes;
    } else
        team.strikes = 0;
}

/* The threads this thread's next runs may use (the session's count, set before each call of a
   plan with split records); the count before. */
int64_t backplane_cnn_threads(int64_t count) {
    const int64_t was = asked;
    asked = count < 1 ? 1 : count > POOL_MAX ? POOL_MAX : count;
    return was;
}

/* The work items the pool's workers have run in this process (the tests' evidence of a split). */
int64_t backplane_cnn_pool_items(void) { return atomic_load(&team.by_workers); }

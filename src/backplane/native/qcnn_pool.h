/* qcnn.c's threads: a record's work split across a small crew of pthreads, started once and kept.

Why: the full tier's int8 CNNs (224x224) run at the session's two threads, where oneDNN's int8
kernels and ONNX Runtime's MLAS use both cores; the plan at one thread lost to them there (the
QDQ MobileNet 5.0 ms against torch's traced int8 3.8 at one thread, ONNX Runtime 3.1 at two).
Not OpenMP: torch ships its own libgomp, and a second OpenMP pool would spin beside it. Not a
thread a run: creating one costs tens of microseconds.

The same design as cnn_pool.h (the float CNN plan's crew, a library of its own: each library
keeps its own workers): the caller posts a job (a record, the part function that runs items
[begin, end) of it, the count of items) and takes part itself; every thread claims a grain of
items at a time from one atomic counter, so a worker the scheduler has not run yet (a busy
machine) leaves its share to the caller instead of holding it: the caller waits only for grains
a worker claimed. Each item is written by one thread with the one-thread run's arithmetic: the
outputs are bit for bit the same. Between jobs a worker spins for CREW_SPIN_NS (the next
record's job is usually posted within it), then sleeps on a condition variable. One run at a
time uses the crew (a second run at once runs on its own thread alone).

The job's state: `generation` odd while a job is open, even while none is; a worker counts
itself `inside` before it reads the generation, and the caller closes a job (even) and waits for
`inside` to be 0 before it writes the next one's fields. Included once by qcnn.c. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

enum { CREW_MAX = 8 };          /* the most threads a run uses, the caller's among them */
enum { CREW_SPIN_NS = 60000 };  /* a worker's spin between jobs before it sleeps */

typedef void (*part_fn)(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                        int64_t end);

static struct {
    pthread_mutex_t lock, owner;  /* owner: held by the run using the crew */
    pthread_cond_t wake;
    _Atomic unsigned generation;
    _Atomic int inside, sleepers;
    int started;                  /* workers started (under lock) */
    const int64_t *r;             /* the open job: written only while none is open, inside 0 */
    const uint8_t *params;
    uint8_t *arena;
    part_fn fn;
    int64_t items, grain;
    _Atomic int want;             /* workers asked to take part (the run's threads - 1) */
    _Atomic int64_t next, done;
    _Atomic int64_t by_workers;   /* items the workers ran, ever (backplane_qcnn_crew_items) */
} crew = {.lock = PTHREAD_MUTEX_INITIALIZER, .owner = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static _Thread_local int64_t crew_asked = 1;  /* this thread's runs' threads */

static inline void crew_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t crew_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claims and runs grains of the open job until none is left (`worker`: count them). */
static void crew_take_part(int worker) {
    const int64_t items = crew.items, grain = crew.grain;
    for (;;) {
        const int64_t begin = atomic_fetch_add(&crew.next, grain);
        if (begin >= items) return;
        const int64_t end = begin + grain < items ? begin + grain : items;
        crew.fn(crew.r, crew.params, crew.arena, begin, end);
        if (worker) atomic_fetch_add(&crew.by_workers, end - begin);
        atomic_fetch_add(&crew.done, end - begin);
    }
}

static void *crew_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load(&crew.generation);
        if (g == seen || !(g & 1)) { /* no new open job: spin a while, then sleep */
            const int64_t until = crew_now_ns() + CREW_SPIN_NS;
            int spins = 0;
            while ((g = atomic_load(&crew.generation)) == seen || !(g & 1)) {
                crew_relax();
                if (++spins % 64 == 0 && crew_now_ns() > until) {
                    pthread_mutex_lock(&crew.lock);
                    atomic_fetch_add(&crew.sleepers, 1);
                    while ((g = atomic_load(&crew.generation)) == seen || !(g & 1))
                        pthread_cond_wait(&crew.wake, &crew.lock);
                    atomic_fetch_sub(&crew.sleepers, 1);
                    pthread_mutex_unlock(&crew.lock);
                    break;
                }
            }
        }
        seen = g;
        if (index >= atomic_load(&crew.want)) continue;
        atomic_fetch_add(&crew.inside, 1);
        if (atomic_load(&crew.generation) == g) crew_take_part(1);
        atomic_fetch_sub(&crew.inside, 1);
    }
    return 0;
}

/* A forked child has none of the parent's workers: it starts its own at its first run. */
static void crew_forked(void) {
    pthread_mutex_init(&crew.lock, 0);
    pthread_mutex_init(&crew.owner, 0);
    pthread_cond_init(&crew.wake, 0);
    atomic_store(&crew.inside, 0);
    atomic_store(&crew.sleepers, 0);
    if (atomic_load(&crew.generation) & 1) atomic_fetch_add(&crew.generation, 1);
    crew.started = 0;
}

/* Starts workers up to `count` (kept for the process's life); the count running. */
static int crew_workers(int count) {
    static int hooked;
    pthread_mutex_lock(&crew.lock);
    if (!hooked) hooked = !pthread_atfork(0, 0, crew_forked);
    while (crew.started < count) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, crew_worker, (void *)(intptr_t)crew.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        ++crew.started;
    }
    const int started = crew.started;
    pthread_mutex_unlock(&crew.lock);
    return started;
}

/* Runs items [0, items) of record r through `fn` on the caller and `want` workers, in grains of
   `grain`; returns when every item is done and no worker is inside the job. */
static void crew_run(part_fn fn, const int64_t *r, const uint8_t *params, uint8_t *arena,
                     int64_t items, int64_t grain, int want) {
    crew.fn = fn, crew.r = r, crew.params = params, crew.arena = arena;
    crew.items = items, crew.grain = grain < 1 ? 1 : grain;
    atomic_store(&crew.want, want);
    atomic_store(&crew.next, 0);
    atomic_store(&crew.done, 0);
    atomic_fetch_add(&crew.generation, 1); /* open */
    if (atomic_load(&crew.sleepers)) {
        pthread_mutex_lock(&crew.lock);
        pthread_cond_broadcast(&crew.wake);
        pthread_mutex_unlock(&crew.lock);
    }
    crew_take_part(0);
    for (int spins = 0; atomic_load(&crew.done) < items; ++spins)
        if (spins > 256) sched_yield(); else crew_relax(); /* a claimed grain, finishing */
    atomic_fetch_add(&crew.generation, 1); /* closed */
    for (int spins = 0; atomic_load(&crew.inside); ++spins)
        if (spins > 256) sched_yield(); else crew_relax();
}

/* The threads this thread's next runs may use (the session's count, asked before each call of a
   plan with split records); the count before. */
int64_t backplane_qcnn_threads(int64_t count) {
    const int64_t was = crew_asked;
    crew_asked = count < 1 ? 1 : count > CREW_MAX ? CREW_MAX : count;
    return was;
}

/* The work items the crew's workers have run in this process (the tests' evidence of a split). */
int64_t backplane_qcnn_crew_items(void) { return atomic_load(&crew.by_workers); }

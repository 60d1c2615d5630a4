/* Allocation-heavy and nothing else (issue 33, item 4): R rounds of N
 * allocations of 16-600 bytes, each freed 64 later, through malloc/free
 * (under memveil run: the preload's allocator) and, in turn, the same through
 * glibc's own __libc_malloc/__libc_free; prints the fastest round of each in
 * ns (a round preempted by another program is slower only), the calls of a
 * round and the rounds: "ours NS glibc NS calls C rounds R". Rounds of
 * 20,000 (0.2-0.4 ms): beside two busy loops rounds of 200,000 (2-4 ms, a
 * time slice) were all preempted in a third of the runs, their fastest 10-26
 * ns a call slower than glibc's where rounds of 20,000 read 4-7, as quiet. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);

static long long now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000ll + t.tv_nsec;
}

#define LIVE 64

static long long run(size_t n, void *(*al)(size_t), void (*fr)(void *)) {
    void *ring[LIVE] = {0};
    long long t0 = now();
    for (size_t i = 0; i < n; i++) {
        void *p = al(16 + (i * 37) % 600);
        if (!p)
            exit(2);
        *(volatile char *)p = (char)i;
        if (ring[i % LIVE])
            fr(ring[i % LIVE]);
        ring[i % LIVE] = p;
    }
    long long t = now() - t0;
    for (int k = 0; k < LIVE; k++)
        if (ring[k])
            fr(ring[k]);
    return t;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoul(argv[1], 0, 0) : 20000;
    int rounds = argc > 2 ? atoi(argv[2]) : 90;
    long long ours = -1, glibc = -1;
    for (int r = 0; r < rounds; r++) {
        long long a = run(n, malloc, free);
        long long b = run(n, __libc_malloc, __libc_free);
        if (ours < 0 || a < ours)
            ours = a;
        if (glibc < 0 || b < glibc)
            glibc = b;
    }
    printf("ours %lld glibc %lld calls %zu rounds %d\n", ours, glibc, 2 * n - LIVE, rounds);
    return 0;
}

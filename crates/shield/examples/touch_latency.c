/* What a fault costs the program, seen from inside it (issue 33, item 4):
 * the wall time of each first touch of a swept page, and of the work right
 * after it, to compare with what `memveil run --stats-json` counts
 * (docs/shield.md, "What the summary's cost is").
 *
 * A ring of PAGES pages, one byte written per iteration, is walked slowly
 * enough (WORK between touches) that a page comes round again after the
 * shortest sweep period: under the shield most rounds find it swept. Between
 * touches the program walks WS bytes of its own (a cache line per step,
 * WORK steps) and, with KPAGES, maps, touches and unmaps KPAGES fresh pages
 * (the kernel's own page faults and mmap_lock, beside the sweep's moves).
 * Prints the distribution of the touches over 2 us (the faults), of the
 * work after them and of all other work, in us.
 *
 *   cc -O2 -o touch_latency crates/shield/examples/touch_latency.c
 *   ./touch_latency 1024 13000 30000 1048576 16            # plain
 *   memveil run --stats-json s.json ./touch_latency 1024 13000 30000 1048576 16
 *   (args: PAGES WORK ITERATIONS WS KPAGES) */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static uint64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void show(const char *name, uint64_t *v, size_t n) {
    if (n == 0) {
        printf("%s n=0\n", name);
        return;
    }
    qsort(v, n, sizeof *v, cmp);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += (double)v[i];
    printf("%s n=%zu mean=%.1f p10=%.1f p50=%.1f p90=%.1f p99=%.1f max=%.1f sum_ms=%.2f\n",
           name, n, sum / 1e3 / (double)n, v[n / 10] / 1e3, v[n / 2] / 1e3,
           v[n * 9 / 10] / 1e3, v[n * 99 / 100] / 1e3, v[n - 1] / 1e3, sum / 1e6);
}

int main(int argc, char **argv) {
    size_t pages = argc > 1 ? strtoul(argv[1], 0, 0) : 1024;
    uint64_t steps = argc > 2 ? strtoull(argv[2], 0, 0) : 13000;
    size_t n = argc > 3 ? strtoul(argv[3], 0, 0) : 30000;
    size_t ws = argc > 4 ? strtoul(argv[4], 0, 0) : 1 << 20;
    size_t kpages = argc > 5 ? strtoul(argv[5], 0, 0) : 0;
    if (pages == 0 || ws < 64 || n == 0) {
        fprintf(stderr, "usage: %s PAGES WORK ITERATIONS WS KPAGES (PAGES, ITERATIONS > 0; WS >= 64)\n", argv[0]);
        return 2;
    }
    char *ring = malloc(pages * 4096);
    volatile uint64_t *wb = malloc(ws);
    uint64_t *touch = malloc(n * 8), *work = malloc(n * 8), *kern = malloc(n * 8);
    uint64_t *a = malloc(n * 8), *o = malloc(n * 8), *slow = malloc(n * 8);
    if (!ring || !wb || !touch || !work || !kern || !a || !o || !slow) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    memset(ring, 1, pages * 4096);
    for (size_t i = 0; i < ws / 8; i++)
        wb[i] = i;
    uint64_t start = now();
    for (size_t i = 0; i < n; i++) {
        uint64_t t0 = now();
        ring[(i % pages) * 4096 + (i / pages) % 4096] += 1;
        uint64_t t1 = now(), x = 0;
        for (uint64_t k = 0; k < steps; k++)
            x += wb[(k * 8) % (ws / 8)];
        wb[0] = x;
        uint64_t t2 = now();
        if (kpages) {
            char *m = (char *)syscall(SYS_mmap, 0, kpages * 4096, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m != MAP_FAILED) {
                for (size_t q = 0; q < kpages; q++)
                    m[q * 4096] = 1;
                syscall(SYS_munmap, m, kpages * 4096);
            }
        }
        touch[i] = t1 - t0;
        work[i] = t2 - t1;
        kern[i] = now() - t2;
    }
    uint64_t wall = now() - start;
    size_t ns = 0, na = 0, no = 0;
    for (size_t k = 0; k < n; k++) {
        if (touch[k] > 2000) {
            slow[ns++] = touch[k];
            a[na++] = work[k];
        } else if (k > 0 && touch[k - 1] <= 2000) {
            o[no++] = work[k];
        }
    }
    printf("wall_ms=%.1f touches=%zu faults(>2us)=%zu\n", wall / 1e6, n, ns);
    show("fault", slow, ns);
    show("work_after_fault", a, na);
    show("work_other", o, no);
    if (kpages)
        show("kernel_faults", kern, n);
    return 0;
}

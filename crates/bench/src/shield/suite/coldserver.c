/* The server of memveil's shield.server_cold_coverage figure: a long-running
 * request loop over a heap of HEAP_MIB MiB of records, all of it written at
 * start (a dataset loaded once), of which HOT_PERMILLE per mille of the
 * pages hold the records its requests touch. Hot records sit in runs of
 * RUN_PAGES pages at random places in the heap (what an allocator hands
 * out together: a slab, an arena of recent keys); the rest is never touched
 * again. Each request picks a hot record (64 bytes) at random, reads it,
 * and updates its counter word.
 *
 * Usage: coldserver HEAP_MIB HOT_PERMILLE RUN_MS [RUN_PAGES]
 * (RUN_PAGES: pages per hot run, 16 by default; 1 scatters the hot pages.)
 * Prints "coldserver HEAP_ADDR HEAP_BYTES" at start, "ready" once the heap
 * is written (the server is up: RUN_MS are counted from here), and
 * "done REQUESTS ELAPSED_MS" at the end (stdout, flushed). A sampler
 * outside counts the heap's pages present in /proc/PID/pagemap. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


static uint64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: coldserver HEAP_MIB HOT_PERMILLE RUN_MS [RUN_PAGES]\n");
        return 2;
    }
    size_t run_pages = argc == 5 ? (size_t)atol(argv[4]) : 16;
    if (run_pages == 0 || run_pages > 4096) {
        fprintf(stderr, "coldserver: RUN_PAGES must be 1-4096\n");
        return 2;
    }
    size_t heap_bytes = (size_t)atol(argv[1]) << 20;
    long permille = atol(argv[2]);
    uint64_t run = (uint64_t)atol(argv[3]);
    size_t pages = heap_bytes / 4096, runs = pages / run_pages;
    size_t hot = runs * (size_t)permille / 1000;
    if (permille <= 0 || permille > 1000 || hot == 0) {
        fprintf(stderr, "coldserver: HOT_PERMILLE must leave at least one hot run\n");
        return 2;
    }
    unsigned char *heap = malloc(heap_bytes);
    uint32_t *hot_runs = malloc(runs * sizeof *hot_runs);
    if (!heap || !hot_runs) {
        fprintf(stderr, "coldserver: out of memory\n");
        return 1;
    }
    printf("coldserver %p %zu\n", (void *)heap, heap_bytes);
    fflush(stdout);
    /* The dataset: every record distinct. */
    for (size_t i = 0; i < heap_bytes / 8; i++)
        ((uint64_t *)heap)[i] = i * 0x9e3779b97f4a7c15ull;
    /* The hot runs: the first `hot` of a random permutation of the runs. */
    for (size_t i = 0; i < runs; i++)
        hot_runs[i] = (uint32_t)i;
    for (size_t i = 0; i < hot; i++) {
        size_t j = i + next() % (runs - i);
        uint32_t t = hot_runs[i];
        hot_runs[i] = hot_runs[j];
        hot_runs[j] = t;
    }
    printf("ready\n");
    fflush(stdout);
    uint64_t start = now_ms(), requests = 0, sum = 0;
    for (;;) {
        for (int k = 0; k < 4096; k++) {
            uint64_t r = next();
            size_t page = (size_t)hot_runs[r % hot] * run_pages + (r >> 32) % run_pages;
            uint64_t *rec = (uint64_t *)(heap + page * 4096 + ((r >> 48) % 64) * 64);
            uint64_t h = rec[0] ^ rec[1] ^ rec[2] ^ rec[3] ^ rec[4] ^ rec[5] ^ rec[6];
            rec[7] += 1 + (h & 1);
            sum += h;
        }
        requests += 4096;
        uint64_t t = now_ms();
        if (t - start >= run) {
            printf("done %llu %llu\n", (unsigned long long)requests, (unsigned long long)(t - start));
            fflush(stdout);
            return (int)(sum & 0);
        }
    }
}

/* The per-fault and per-mmap cost of memveil run's two paths (issue 34),
 * built here twice from this source: dynamically linked (the preload
 * serves it) and with -static (the loader serves it).
 *
 * Usage: pathcost HEAP_MIB ACCESSES MMAPS
 * A heap of HEAP_MIB MiB from malloc, every page written; then ACCESSES
 * reads of one byte of a random page each, timed; then MMAPS cycles of an
 * anonymous 64 KiB mmap, a write to each of its pages and munmap, timed,
 * and the mmap and munmap calls of those cycles alone, timed apart (under
 * the loader each is a round trip to its agent; the touches are faults).
 * Prints "access_ns NS_PER_ACCESS mmap_ns NS_PER_CYCLE SUM calls_ns
 * NS_PER_CYCLE_IN_CALLS". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: pathcost HEAP_MIB ACCESSES MMAPS\n");
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    long accesses = atol(argv[2]), mmaps = atol(argv[3]);
    unsigned char *heap = malloc(bytes);
    if (!heap) {
        fprintf(stderr, "pathcost: out of memory\n");
        return 1;
    }
    memset(heap, 0x5a, bytes);
    size_t pages = bytes / 4096;
    uint64_t x = 0x9e3779b97f4a7c15ull, sum = 0;
    uint64_t t0 = now_ns();
    for (long i = 0; i < accesses; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        sum += ((volatile unsigned char *)heap)[(x % pages) * 4096 + (x >> 52)];
    }
    uint64_t t1 = now_ns(), calls = 0;
    for (long i = 0; i < mmaps; i++) {
        uint64_t a = now_ns();
        unsigned char *p = mmap(NULL, 64 << 10, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        calls += now_ns() - a;
        if (p == MAP_FAILED) {
            perror("pathcost: mmap");
            return 1;
        }
        for (size_t k = 0; k < (64 << 10); k += 4096)
            p[k] = (unsigned char)i;
        sum += p[4096];
        a = now_ns();
        munmap(p, 64 << 10);
        calls += now_ns() - a;
    }
    uint64_t t2 = now_ns();
    double n = (double)(mmaps ? mmaps : 1);
    printf("access_ns %.1f mmap_ns %.1f %llu calls_ns %.1f\n", (double)(t1 - t0) / (double)(accesses ? accesses : 1),
           (double)(t2 - t1) / n, (unsigned long long)sum, (double)calls / n);
    return 0;
}

/* The canary program of memveil's exposure figures: a heap of HEAP_MIB
 * MiB, all of it written, of which it touches a quarter continuously
 * (one word of each page, pages in a new random order every pass), and a
 * 64-byte secret in a page of its own, in the middle of a 1 MiB arena
 * written at start (its key store, say), written once the program has run
 * WARM_MS and read every PERIOD_MS after that (0: continuously, between
 * pages of the hot quarter; -1: never again), until RUN_MS have passed.
 *
 * Usage: canary HEAP_MIB PERIOD_MS WARM_MS RUN_MS
 * Prints "canary SECRET_ADDR SECRET_HEX HEAP_ADDR HEAP_BYTES" at start,
 * "ready" once the secret is written, "done PASSES SECRET_READS" at the
 * end (stdout, flushed). A sampler outside reads the secret's page through
 * /proc/PID/mem at random times: plaintext when it reads the secret. */
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
    if (argc != 5) {
        fprintf(stderr, "usage: canary HEAP_MIB PERIOD_MS WARM_MS RUN_MS\n");
        return 2;
    }
    size_t heap_bytes = (size_t)atol(argv[1]) << 20;
    long period = atol(argv[2]);
    uint64_t warm = (uint64_t)atol(argv[3]), run = (uint64_t)atol(argv[4]);
    size_t pages = heap_bytes / 4096, hot = pages / 4;
    unsigned char *arena = NULL;
    if (posix_memalign((void **)&arena, 4096, 1 << 20) != 0) {
        fprintf(stderr, "canary: out of memory\n");
        return 1;
    }
    memset(arena, 0, 1 << 20);
    unsigned char *secret = arena + (512 << 10);
    unsigned char *heap = malloc(heap_bytes);
    if (!heap) {
        fprintf(stderr, "canary: out of memory\n");
        return 1;
    }
    memset(heap, 0x5a, heap_bytes);
    unsigned char key[64];
    FILE *ur = fopen("/dev/urandom", "rb");
    if (!ur || fread(key, 1, sizeof key, ur) != sizeof key) {
        fprintf(stderr, "canary: /dev/urandom\n");
        return 1;
    }
    fclose(ur);
    rng ^= (uint64_t)key[0] << 8 | key[1];
    printf("canary %p ", (void *)secret);
    for (size_t i = 0; i < sizeof key; i++)
        printf("%02x", key[i]);
    printf(" %p %zu\n", (void *)heap, heap_bytes);
    fflush(stdout);

    uint32_t *order = malloc(hot * sizeof *order);
    if (!order) {
        fprintf(stderr, "canary: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < hot; i++)
        order[i] = (uint32_t)i;
    uint64_t start = now_ms(), written = 0, last_read = 0;
    volatile uint64_t sink = 0;
    unsigned long passes = 0, reads = 0;
    for (;;) {
        /* A new random order of the hot quarter each pass. */
        for (size_t i = hot - 1; i > 0; i--) {
            size_t j = next() % (i + 1);
            uint32_t t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (size_t i = 0; i < hot; i++) {
            volatile uint64_t *w = (volatile uint64_t *)(heap + (size_t)order[i] * 4096 + (passes % 512) * 8);
            *w = *w + 1;
            if (written && period == 0) {
                sink += ((volatile unsigned char *)secret)[i % 64];
                reads++;
            }
            if ((i & 255) != 0)
                continue;
            uint64_t t = now_ms();
            if (!written && t - start >= warm) {
                memcpy(secret, key, sizeof key);
                written = t;
                last_read = t;
                printf("ready\n");
                fflush(stdout);
            } else if (written && period > 0 && t - last_read >= (uint64_t)period) {
                for (size_t k = 0; k < sizeof key; k++)
                    sink += ((volatile unsigned char *)secret)[k];
                last_read = t;
                reads++;
            }
            if (written && t - written >= run) {
                printf("done %lu %lu\n", passes, reads);
                fflush(stdout);
                return (int)(sink & 0);
            }
        }
        passes++;
    }
}

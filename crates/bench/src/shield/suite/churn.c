/* Allocation churn as a server does it: a long-lived cache of 32768 entries
 * (1-4 KiB each, about 80 MiB) touched with a skew (90% of lookups go to the
 * first tenth), and for every request eight short-lived buffers of 64 B to
 * 16 KiB allocated, written, summed and freed. Every 64th request replaces
 * a cache entry (free + malloc of a new size). Prints a checksum, so a run
 * under memveil can be compared with a plain one.
 * usage: churn REQUESTS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t s = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

#define ENTRIES 32768

int main(int argc, char **argv) {
    long requests = argc > 1 ? atol(argv[1]) : 300000;
    static unsigned char *cache[ENTRIES];
    static size_t len[ENTRIES];
    for (int i = 0; i < ENTRIES; i++) {
        len[i] = 1024 + rnd() % 3072;
        cache[i] = malloc(len[i]);
        if (!cache[i]) return 2;
        memset(cache[i], i & 0xff, len[i]);
    }
    uint64_t sum = 0;
    for (long r = 0; r < requests; r++) {
        uint64_t x = rnd();
        int e = (x % 10) ? (int)((x >> 8) % (ENTRIES / 10)) : (int)((x >> 8) % ENTRIES);
        sum += cache[e][(x >> 32) % len[e]];
        cache[e][(x >> 40) % len[e]] ^= (unsigned char)r;
        unsigned char *b[8];
        size_t bl[8];
        for (int k = 0; k < 8; k++) {
            bl[k] = 64u << (rnd() % 9); /* 64 B .. 16 KiB */
            b[k] = malloc(bl[k]);
            if (!b[k]) return 2;
            memset(b[k], (int)(r + k), bl[k]);
        }
        for (int k = 0; k < 8; k++) {
            sum += b[k][bl[k] - 1] + bl[k];
            free(b[k]);
        }
        if (r % 64 == 0) {
            int v = (int)(rnd() % ENTRIES);
            free(cache[v]);
            len[v] = 1024 + rnd() % 3072;
            cache[v] = malloc(len[v]);
            if (!cache[v]) return 2;
            memset(cache[v], (int)r & 0xff, len[v]);
        }
    }
    for (int i = 0; i < ENTRIES; i++) {
        for (size_t j = 0; j < len[i]; j += 512) sum += cache[i][j];
        free(cache[i]);
    }
    printf("%llu\n", (unsigned long long)sum);
    return 0;
}

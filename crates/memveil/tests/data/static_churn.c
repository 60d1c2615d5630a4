/* Heap churn for the static-program tests (built with -static, musl-gcc
 * -static): many small blocks through malloc/free (brk), a few large ones
 * (mmap), realloc growth, one thread; prints a checksum that depends on
 * every byte, so a page that came back wrong changes it.
 * usage: static_churn ROUNDS */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long mix(unsigned long h, unsigned long v) { return (h ^ v) * 0x100000001b3UL; }

static void *worker(void *arg) {
    unsigned long *out = arg, h = 1469598103934665603UL;
    for (int r = 0; r < 50; r++) {
        size_t n = (size_t)(1 + r % 7) << 20;
        unsigned char *b = malloc(n);
        if (!b) return NULL;
        for (size_t i = 0; i < n; i += 512) b[i] = (unsigned char)(i / 512 + r);
        for (size_t i = 0; i < n; i += 4096) h = mix(h, b[i]);
        free(b);
    }
    *out = h;
    return NULL;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 20;
    unsigned long h = 1469598103934665603UL, th = 0;
    pthread_t t;
    if (pthread_create(&t, NULL, worker, &th) != 0) return 3;
    char **keep = calloc(4096, sizeof *keep);
    if (!keep) return 2;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < 4096; i++) {
            size_t n = 16 + (size_t)((i * 7919 + r) % 3000);
            char *p = realloc(keep[i], n);
            if (!p) return 2;
            memset(p, (i + r) & 0xff, n);
            keep[i] = p;
        }
        for (int i = r % 3; i < 4096; i += 3) {
            h = mix(h, (unsigned char)keep[i][0]);
            free(keep[i]);
            keep[i] = NULL;
        }
        char *big = malloc(8 << 20);
        if (!big) return 2;
        memset(big, r, 8 << 20);
        h = mix(h, (unsigned char)big[(size_t)r * 4096]);
        free(big);
    }
    pthread_join(t, NULL);
    printf("churn %d %016lx %016lx\n", rounds, h, th);
    return 0;
}

/* Large blocks of one size allocated, written whole and freed, 100 times
 * over (python3's list arrays and buffers grow and go this way); then a
 * calloc of that size over the last one's dirty pages. Prints the page
 * faults a round took after the first (getrusage), and exits 1 when the
 * calloc'ed block is not all zeros. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define SIZE (768u << 10)
#define ROUNDS 100

static long faults(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt + u.ru_majflt;
}

int main(void) {
    long before = 0;
    for (int i = 0; i <= ROUNDS; i++) {
        if (i == 1)
            before = faults();
        unsigned char *p = malloc(SIZE);
        if (!p)
            return 2;
        memset(p, i + 1, SIZE);
        /* Read back, so that the compiler keeps the writes. */
        for (size_t k = 0; k < SIZE; k += 4096)
            if (((volatile unsigned char *)p)[k] != (unsigned char)(i + 1))
                return 1;
        free(p);
    }
    long per_round = (faults() - before) / ROUNDS;
    unsigned char *z = calloc(1, SIZE);
    if (!z)
        return 2;
    for (size_t i = 0; i < SIZE; i += 256)
        if (z[i]) {
            fprintf(stderr, "calloc: byte %zu is %d\n", i, z[i]);
            return 1;
        }
    free(z);
    printf("faults_per_round %ld\n", per_round);
    return 0;
}

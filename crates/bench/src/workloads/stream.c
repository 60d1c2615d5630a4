/* A STREAM-like triad (McCalpin's kernel a[i] = b[i] + q * c[i]) for the
 * workloads part of memveil bench: three arrays of N doubles from malloc
 * (so under `memveil run` they live in the protected heap), initialised,
 * then REPS timed triads; prints the best rate and a check of the result.
 *
 *   stream N REPS  ->  "triad_gbps <GB/s> check <ok|BAD>"
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: stream N REPS\n");
        return 2;
    }
    long n = atol(argv[1]);
    int reps = atoi(argv[2]);
    if (n < 1024 || reps < 1) {
        fprintf(stderr, "stream: N >= 1024 and REPS >= 1\n");
        return 2;
    }
    double *a = malloc((size_t)n * sizeof(double));
    double *b = malloc((size_t)n * sizeof(double));
    double *c = malloc((size_t)n * sizeof(double));
    if (!a || !b || !c) {
        fprintf(stderr, "stream: out of memory\n");
        return 1;
    }
    for (long i = 0; i < n; i++) {
        a[i] = 0.0;
        b[i] = 2.0;
        c[i] = 0.5 + (double)(i & 7);
    }
    const double q = 3.0;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = now();
        for (long i = 0; i < n; i++)
            a[i] = b[i] + q * c[i];
        t = now() - t;
        if (t < best)
            best = t;
    }
    int ok = 1;
    for (long i = 0; i < n; i++) {
        if (a[i] != 2.0 + q * (0.5 + (double)(i & 7))) {
            ok = 0;
            break;
        }
    }
    printf("triad_gbps %.4f check %s\n", 3.0 * 8.0 * (double)n / best / 1e9, ok ? "ok" : "BAD");
    free(a);
    free(b);
    free(c);
    return ok ? 0 : 1;
}

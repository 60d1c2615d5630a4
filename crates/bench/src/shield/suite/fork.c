/* The cost of fork(2) of a heap of MiB (argv[1]) mebibytes, filled: ROUNDS
 * (argv[2]) forks whose child exits at once, the parent waiting for it;
 * prints "fork_ms <median ms per fork>". Under memveil run each fork brings
 * the parent's evicted pages back (they must not reach the child as
 * ciphertext without a key), and the child starts a shield of its own. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (rounds < 1 || rounds > 100 || mib == 0) return 2;
    size_t chunk = 1 << 20;
    volatile unsigned char **blocks = malloc(mib * sizeof *blocks);
    if (!blocks) return 3;
    for (size_t i = 0; i < mib; i++) {
        blocks[i] = malloc(chunk);
        if (!blocks[i]) return 3;
        for (size_t j = 0; j < chunk; j += 64) blocks[i][j] = (unsigned char)(i + j);
    }
    double ms[100];
    for (int r = 0; r < rounds; r++) {
        double t = now_ms();
        pid_t c = fork();
        if (c < 0) return 4;
        if (c == 0) _exit(0);
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 5;
        ms[r] = now_ms() - t;
        /* touch the heap again, so the next fork finds it evicted as before */
        for (size_t i = 0; i < mib; i++) blocks[i][64] ^= 1;
    }
    qsort(ms, rounds, sizeof ms[0], cmp);
    printf("fork_ms %.3f\n", ms[rounds / 2]);
    return 0;
}

/* Four children forked without exec, each checking the heap it inherited and
 * writing and checking 4 MiB of its own, several times over (far more than a
 * small window), while the parent sweeps its own heap. Under memveil run
 * every child protects its copy with a shield of its own. Prints
 * "children 0 0 0 0 parent-bad 0" when every byte read back is right. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t check(const unsigned char *p, size_t n, unsigned salt) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != (unsigned char)(i * 13 + salt);
    return bad;
}

static void fill(unsigned char *p, size_t n, unsigned salt) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 13 + salt);
}

int main(void) {
    size_t n = 4 << 20;
    unsigned char *heap = malloc(n);
    if (!heap) return 3;
    fill(heap, n, 1);
    fflush(stdout);
    pid_t kids[4];
    for (int k = 0; k < 4; k++) {
        kids[k] = fork();
        if (kids[k] < 0) return 5;
        if (kids[k] == 0) {
            size_t bad = check(heap, n, 1);
            unsigned char *mine = malloc(n);
            if (!mine) _exit(3);
            fill(mine, n, 10 + k);
            for (int pass = 0; pass < 3; pass++) {
                bad += check(mine, n, 10 + k);
                bad += check(heap, n, 1);
            }
            fill(heap, n, 20 + k);
            bad += check(heap, n, 20 + k) + check(mine, n, 10 + k);
            _exit(bad ? 7 : 0);
        }
    }
    size_t bad = 0;
    for (int pass = 0; pass < 2; pass++) bad += check(heap, n, 1);
    fill(heap, n, 3);
    int code[4];
    for (int k = 0; k < 4; k++) {
        int st = 0;
        if (waitpid(kids[k], &st, 0) != kids[k]) return 9;
        code[k] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    bad += check(heap, n, 3);
    printf("children %d %d %d %d parent-bad %zu\n", code[0], code[1], code[2], code[3], bad);
    free(heap);
    return 0;
}

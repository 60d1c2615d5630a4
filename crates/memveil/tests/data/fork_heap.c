/* fork() without exec on a protected heap. The child runs unprotected on a
 * copy of the parent's heap (memveil brings every page back before the fork)
 * and checks it; meanwhile the parent sweeps its own heap, so pages it still
 * shares with the child are evicted (by write-protection: a shared page
 * cannot be moved) and fault back. Both halves must see intact data. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t check(const unsigned char *p, size_t n, unsigned salt) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != (unsigned char)(i * 13 + salt);
    return bad;
}

int main(void) {
    size_t n = 8 << 20;
    unsigned char *heap = malloc(n);
    if (!heap) return 3;
    for (size_t i = 0; i < n; i++) heap[i] = (unsigned char)(i * 13 + 1);
    int go[2];
    if (pipe(go) != 0) return 4;
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) return 5;
    if (child == 0) {
        char c;
        close(go[1]);
        if (read(go[0], &c, 1) != 1) _exit(6);
        size_t bad = check(heap, n, 1);
        for (size_t i = 0; i < n; i++) heap[i] = (unsigned char)(i * 13 + 2);
        bad += check(heap, n, 2);
        _exit(bad ? 7 : 0);
    }
    close(go[0]);
    /* While the child waits, every page is still shared with it. */
    size_t bad = 0;
    for (int pass = 0; pass < 2; pass++) bad += check(heap, n, 1);
    if (write(go[1], "g", 1) != 1) return 8;
    for (size_t i = 0; i < n; i++) heap[i] = (unsigned char)(i * 13 + 3);
    int st = 0;
    if (waitpid(child, &st, 0) != child) return 9;
    bad += check(heap, n, 3);
    printf("child %d parent-bad %zu\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), bad);
    free(heap);
    return 0;
}

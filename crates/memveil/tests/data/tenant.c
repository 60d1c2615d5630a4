/* A tenant for tests/tenants.rs: fills PAGES pages of heap, each page
 * starting with "TENANT-<tag>-PAGE-<n>", prints "ready <address of page 0>"
 * and waits for a line on stdin (while it waits, the test reads its store);
 * then checks every page and prints "ok" (exit 0) or what was wrong (exit 1).
 * With a third argument "daemon" it first forks and its parent exits, as a
 * daemon does (the child, reparented, goes on). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "daemon") == 0)) {
        fprintf(stderr, "usage: tenant TAG PAGES [daemon]\n");
        return 2;
    }
    if (argc == 4) {
        pid_t p = fork();
        if (p < 0) {
            perror("fork");
            return 1;
        }
        if (p > 0)
            _exit(0);
        setsid();
    }
    const char *tag = argv[1];
    long pages = atol(argv[2]);
    char *buf = aligned_alloc(4096, pages * 4096);
    if (!buf) {
        perror("aligned_alloc");
        return 1;
    }
    for (long i = 0; i < pages; i++) {
        char *p = buf + i * 4096;
        memset(p, (int)(i & 0xff), 4096);
        snprintf(p, 64, "TENANT-%s-PAGE-%ld", tag, i);
    }
    printf("ready %p %d\n", (void *)buf, (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) {
        /* stdin closed: check anyway */
    }
    char want[64];
    for (long i = 0; i < pages; i++) {
        char *p = buf + i * 4096;
        snprintf(want, sizeof want, "TENANT-%s-PAGE-%ld", tag, i);
        if (strcmp(p, want) != 0 || (unsigned char)p[4095] != (unsigned char)(i & 0xff)) {
            printf("page %ld wrong\n", i);
            return 1;
        }
    }
    printf("ok\n");
    return 0;
}

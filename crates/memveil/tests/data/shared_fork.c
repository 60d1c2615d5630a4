/* Shared anonymous memory written by four forked children at once, under
 * memory pressure: the parent maps LEN MiB (argv[1], default 64) with
 * MAP_SHARED|MAP_ANONYMOUS and fills it; each child rewrites its own quarter
 * ROUNDS times (argv[2], default 3) and checks it after every round; the
 * parent then checks every quarter holds its child's last round. Prints
 * "shared fork ok" when every check passed. With argv[3] "orphan" the
 * parent instead forks one child, which waits for its parent to die and then
 * reads the memory (printing "child read zeros" if it finds any page
 * zeroed), and the parent kills itself with SIGKILL. "outlive": the
 * parent forks one child, unmaps the memory and exits normally; the child
 * waits for that, checks every page still holds what the parent wrote and
 * prints "child kept its data". "reuse": the parent forks one child, unmaps
 * the memory, maps and fills a new one (the kernel hands out the same
 * address), then lets the child check the old memory and checks the new
 * one: "reuse ok". "many": ROUNDS short-lived children in turn each write
 * one page and exit: "many ok". "holes": the parent writes half of a second
 * mapping and forks; the child maps a file over one page of its view, the
 * parent unmaps the mapping, and the child reads the never-written half as
 * zeros: "holes ok". "nofile": the parent fills its descriptors up to a
 * limit of 64, then forks a child that writes the memory: "nofile ok". */
#include <fcntl.h>
#include <sys/resource.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned char want(int k, int round, size_t i) { return (unsigned char)(k * 31 + round + i / 64); }

int main(int argc, char **argv) {
    size_t len = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    const int kids = 4;
    unsigned char *r = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) { perror("mmap"); return 2; }
    for (size_t i = 0; i < len; i += 4096) memcpy(r + i, "shared-fill", 11);
    if (argc > 3 && !strcmp(argv[3], "orphan")) {
        pid_t parent = getpid();
        fflush(stdout);
        if (fork() == 0) {
            while (getppid() == parent) usleep(1000);
            usleep(200000);
            for (size_t i = 0; i < len; i += 4096)
                if (r[i] == 0) { printf("child read zeros at %zu\n", i); fflush(stdout); _exit(1); }
            printf("child read its data\n");
            _exit(0);
        }
        usleep(100000);
        kill(getpid(), SIGKILL);
    }
    if (argc > 3 && !strcmp(argv[3], "outlive")) {
        pid_t parent = getpid();
        fflush(stdout);
        if (fork() == 0) {
            while (getppid() == parent) usleep(1000);
            for (size_t i = 0; i < len; i += 4096)
                if (memcmp(r + i, "shared-fill", 11)) { printf("child lost page %zu\n", i / 4096); fflush(stdout); _exit(1); }
            printf("child kept its data\n");
            fflush(stdout);
            _exit(0);
        }
        usleep(100000);
        munmap(r, len);
        return 0;
    }
    if (argc > 3 && !strcmp(argv[3], "reuse")) {
        /* A second mapping, written in its first half only: the child's
         * later touches of the second half are first touches. */
        unsigned char *o = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (o == MAP_FAILED) { perror("mmap"); return 2; }
        for (size_t i = 0; i < len / 2; i += 4096) memcpy(o + i, "old-fill", 8);
        int go[2];
        if (pipe(go)) return 2;
        fflush(stdout);
        pid_t c = fork();
        if (c == 0) {
            char b;
            if (read(go[0], &b, 1) != 1) _exit(3);
            for (size_t i = 0; i < len; i += 4096) {
                int ok = i < len / 2 ? !memcmp(o + i, "old-fill", 8) : o[i] == 0 && o[i + 1] == 0;
                if (!ok) { printf("child: old page %zu wrong (%.8s)\n", i / 4096, (char *)o + i); fflush(stdout); _exit(1); }
            }
            _exit(0);
        }
        munmap(o, len);
        unsigned char *n = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (n == MAP_FAILED) { perror("mmap"); return 2; }
        for (size_t i = 0; i < len; i += 4096) memcpy(n + i, "new-fill", 8);
        if (write(go[1], "g", 1) != 1) return 2;
        int st;
        waitpid(c, &st, 0);
        size_t lost = 0;
        for (size_t i = 0; i < len; i += 4096) lost += memcmp(n + i, "new-fill", 8) != 0;
        if (lost || !WIFEXITED(st) || WEXITSTATUS(st)) { printf("reuse: %zu new pages lost, child %d (same address: %d)\n", lost, st, n == o); return 1; }
        printf("reuse ok\n");
        return 0;
    }
    if (argc > 3 && !strcmp(argv[3], "holes")) {
        unsigned char *o = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (o == MAP_FAILED) { perror("mmap"); return 2; }
        for (size_t i = 0; i < len / 2; i += 4096) memcpy(o + i, "old-fill", 8);
        int go[2], ready[2];
        if (pipe(go) || pipe(ready)) return 2;
        fflush(stdout);
        pid_t c = fork();
        if (c == 0) {
            int fd = open("/etc/hostname", O_RDONLY);
            if (fd < 0 || mmap(o, 4096, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0) == MAP_FAILED) _exit(3);
            char b;
            if (write(ready[1], "r", 1) != 1 || read(go[0], &b, 1) != 1) _exit(3);
            for (size_t i = len / 2; i < len; i += 4096)
                if (o[i] != 0) { printf("child: hole %zu not zero\n", i / 4096); fflush(stdout); _exit(1); }
            _exit(0);
        }
        char b;
        if (read(ready[0], &b, 1) != 1) return 2;
        munmap(o, len);
        if (write(go[1], "g", 1) != 1) return 2;
        int st;
        waitpid(c, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { printf("holes: child %d\n", st); return 1; }
        printf("holes ok\n");
        return 0;
    }
    if (argc > 3 && !strcmp(argv[3], "nofile")) {
        struct rlimit rl = { 64, 64 };
        if (setrlimit(RLIMIT_NOFILE, &rl)) { perror("setrlimit"); return 2; }
        while (open("/dev/null", O_RDONLY) >= 0) {}
        fflush(stdout);
        pid_t c = fork();
        if (c < 0) { perror("fork"); return 2; }
        if (c == 0) { for (size_t i = 0; i < len; i += 4096) r[i] = 7; _exit(0); }
        int st;
        waitpid(c, &st, 0);
        for (size_t i = 0; i < len; i += 4096) if (r[i] != 7) { printf("nofile: page %zu\n", i / 4096); return 1; }
        printf("nofile ok\n");
        return 0;
    }
    if (argc > 3 && !strcmp(argv[3], "many")) {
        for (int k = 0; k < rounds; k++) {
            pid_t c = fork();
            if (c < 0) { perror("fork"); return 2; }
            if (c == 0) { r[(size_t)k * 4096 % len] = (unsigned char)k; _exit(0); }
            int st;
            if (waitpid(c, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) { printf("child %d failed\n", k); return 1; }
        }
        printf("many ok\n");
        return 0;
    }
    size_t part = len / kids;
    for (int k = 0; k < kids; k++) {
        pid_t p = fork();
        if (p < 0) { perror("fork"); return 2; }
        if (p == 0) {
            unsigned char *m = r + k * part;
            for (int rd = 0; rd < rounds; rd++) {
                for (size_t i = 0; i < part; i += 64) m[i] = want(k, rd, i);
                for (size_t i = 0; i < part; i += 64)
                    if (m[i] != want(k, rd, i)) { printf("child %d round %d: wrong byte at %zu\n", k, rd, i); fflush(stdout); _exit(1); }
            }
            _exit(0);
        }
    }
    int bad = 0;
    for (int k = 0; k < kids; k++) {
        int st;
        if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) { printf("a child failed (%d)\n", st); bad++; }
    }
    for (int k = 0; k < kids && !bad; k++) {
        unsigned char *m = r + k * part;
        for (size_t i = 0; i < part; i += 64)
            if (m[i] != want(k, rounds - 1, i)) { printf("parent: quarter %d wrong at %zu\n", k, i); bad++; break; }
    }
    if (!bad) printf("shared fork ok\n");
    return bad ? 1 : 0;
}

/* Shared anonymous memory written by four forked children at once, under
 * memory pressure: the parent maps LEN MiB (argv[1], default 64) with
 * MAP_SHARED|MAP_ANONYMOUS and fills it; each child rewrites its own quarter
 * ROUNDS times (argv[2], default 3) and checks it after every round; the
 * parent then checks every quarter holds its child's last round. Prints
 * "shared fork ok" when every check passed. With argv[3] "orphan" the
 * parent instead forks one child, which waits for its parent to die and then
 * reads the memory (printing "child read zeros" if it finds any page
 * zeroed), and the parent kills itself with SIGKILL. */
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
    size_t part = len / kids;
    for (int k = 0; k < kids; k++) {
        pid_t p = fork();
        if (p < 0) { perror("fork"); return 2; }
        if (p == 0) {
            unsigned char *m = r + k * part;
            for (int rd = 0; rd < rounds; rd++) {
                for (size_t i = 0; i < part; i += 64) m[i] = want(k, rd, i);
                for (size_t i = 0; i < part; i += 64)
                    if (m[i] != want(k, rd, i)) { printf("child %d round %d: wrong byte at %zu\n", k, rd, i); _exit(1); }
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

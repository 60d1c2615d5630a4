/* A secret in shared anonymous memory, seen from a forked child. The parent
 * maps 16 MiB with MAP_SHARED|MAP_ANONYMOUS, reads "SECRET MARKER" from
 * stdin straight into it (no copy on a stack or in stdio), spreads SECRET
 * over its first 64 KiB, wipes the input and forks. The child sweeps the
 * other 15 MiB of the shared memory twice, so that under a small window the
 * secret's pages leave it, writes MARKER into the last page (which stays in
 * the window), prints "ready PID" and waits for SIGTERM; the parent waits. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define LEN (16u << 20)

int main(void) {
    unsigned char *r = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) { perror("mmap"); return 2; }
    char *in = (char *)r + LEN - 8192;
    ssize_t got = 0, n;
    while (got < 255 && (n = read(0, in + got, 255 - got)) > 0) got += n;
    char *sp = strchr(in, ' ');
    if (!sp) return 4;
    *sp = 0;
    char *marker = sp + 1;
    char *nl = strchr(marker, '\n');
    if (nl) *nl = 0;
    size_t sl = strlen(in);
    char mk[128] = {0};
    strncpy(mk, marker, sizeof mk - 1);
    for (size_t off = 0; off + sl < 65536; off += sl + 1) memcpy(r + off, in, sl);
    memset(in, 0, 256);
    fflush(stdout);
    pid_t c = fork();
    if (c < 0) return 5;
    if (c == 0) {
        for (int pass = 0; pass < 2; pass++)
            for (size_t i = 65536; i < LEN - 8192; i++) r[i] = (unsigned char)(i * 7 + pass);
        memcpy(r + LEN - 4096, mk, strlen(mk) + 1);
        memset(mk, 0, sizeof mk);
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        for (;;) pause();
    }
    memset(mk, 0, sizeof mk);
    int st = 0;
    waitpid(c, &st, 0);
    return 0;
}

/* A forked child (no exec) keeping a secret in its heap. The parent forks
 * one child and waits for it. The child reads "SECRET MARKER" from stdin
 * straight into the heap (no copy on a stack), spreads SECRET over 64 KiB of
 * whole pages of its own (a window holds pages, not objects: a secret that
 * shares a page with hot allocator data stays as plaintext as that page) and
 * wipes the input, then sweeps 8 MiB of other data twice, so that under a
 * small window the secret's pages leave it; then it writes MARKER into a
 * fresh buffer (which stays in the window), prints "ready PID" and waits for
 * SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
    fflush(stdout);
    pid_t c = fork();
    if (c < 0) return 5;
    if (c == 0) {
        char *in = calloc(1, 256);
        if (!in) _exit(3);
        ssize_t got = 0, r;
        while (got < 255 && (r = read(0, in + got, 255 - got)) > 0) got += r;
        char *sp = strchr(in, ' ');
        if (!sp) _exit(4);
        *sp = 0;
        char *marker = sp + 1;
        char *nl = strchr(marker, '\n');
        if (nl) *nl = 0;
        size_t sl = strlen(in);
        char *fresh = malloc(4096);
        void *sp_ = NULL;
        if (!fresh || sl == 0 || posix_memalign(&sp_, 4096, 65536) != 0) _exit(3);
        char *secret = sp_;
        for (size_t off = 0; off + sl < 65536; off += sl + 1) memcpy(secret + off, in, sl);
        memcpy(fresh, marker, strlen(marker) + 1);
        memset(in, 0, 256);
        unsigned char *fill = malloc(8 << 20);
        if (!fill) _exit(3);
        for (int pass = 0; pass < 2; pass++)
            for (size_t i = 0; i < (8u << 20); i++) fill[i] = (unsigned char)(i * 7 + pass);
        strcpy(fresh + 2048, fresh);
        memset(fresh, 0, 2048);
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        for (;;) pause();
    }
    int st = 0;
    waitpid(c, &st, 0);
    return 0;
}

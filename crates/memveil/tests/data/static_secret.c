/* idle_secret.c for the static-program tests: the same program, but the
 * secret is read with read(2) straight into its heap page (a C library's
 * stdin buffer may live in .data/.bss, which the loader does not cover:
 * musl's does). Reads "SECRET MARKER" from stdin, keeps SECRET in a page of
 * its own in the middle of a 64 KiB arena, fills a 32 MiB heap once, then
 * rewrites MARKER into a 1 MiB working buffer over and over. Prints
 * "ready PID" once all is written, then works until SIGTERM.
 * usage: static_secret */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_term(int s) { (void)s; stop = 1; }

int main(void) {
    signal(SIGTERM, on_term);
    unsigned char *arena = malloc(64 << 10);
    unsigned char *heap = malloc(32 << 20);
    unsigned char *work = malloc(1 << 20);
    if (!arena || !heap || !work) return 2;
    memset(arena, 0, 64 << 10);
    /* 32 KiB in: a page boundary whatever the allocator's header. */
    unsigned char *s = (unsigned char *)(((size_t)arena + (32 << 10)) & ~(size_t)4095);
    size_t got = 0;
    while (got < 511) {
        ssize_t n = read(0, s + got, 511 - got);
        if (n <= 0) break;
        got += (size_t)n;
        if (memchr(s, '\n', got)) break;
    }
    unsigned char *sp = memchr(s, ' ', got);
    if (!sp) return 2;
    size_t ml = (size_t)(s + got - (sp + 1));
    while (ml > 0 && (sp[ml] == '\n' || sp[ml] == '\r')) ml--;
    unsigned char *mk = malloc(ml + 1);
    if (!mk) return 2;
    memcpy(mk, sp + 1, ml);
    memcpy(work, mk, ml);
    /* The marker's bytes leave the secret's page. */
    memset(sp, 0, (size_t)(s + got - sp));
    memset(heap, 0x5a, 32 << 20);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    unsigned long sum = 0;
    while (!stop) {
        for (size_t i = 0; i < (1 << 20); i += 4096)
            sum += work[i]++;
        memcpy(work, mk, ml);
        usleep(1000);
    }
    return (int)(sum & 0);
}

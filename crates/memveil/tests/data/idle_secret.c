/* A program that holds a secret it no longer uses while it works: reads
 * "SECRET MARKER" from stdin, keeps SECRET in a page of its own in the
 * middle of a 64 KiB arena (written at start), fills a 32 MiB heap once,
 * then rewrites MARKER into a 1 MiB working buffer over and over (that
 * page stays in use, so a page image that holds the marker shows the
 * plaintext the program works on). Prints "ready PID" once all is written,
 * then works until SIGTERM.
 * usage: idle_secret */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_term(int s) { (void)s; stop = 1; }

int main(void) {
    char secret[256], marker[256];
    if (scanf("%255s %255s", secret, marker) != 2) return 2;
    signal(SIGTERM, on_term);
    unsigned char *arena = malloc(64 << 10);
    unsigned char *heap = malloc(32 << 20);
    unsigned char *work = malloc(1 << 20);
    if (!arena || !heap || !work) return 2;
    memset(arena, 0, 64 << 10);
    /* 32 KiB in: a page boundary whatever the allocator's header. */
    unsigned char *s = (unsigned char *)(((size_t)arena + (32 << 10)) & ~(size_t)4095);
    memcpy(s, secret, strlen(secret));
    memset(secret, 0, sizeof secret);
    memset(heap, 0x5a, 32 << 20);
    size_t ml = strlen(marker);
    memcpy(work, marker, ml);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    unsigned long sum = 0;
    while (!stop) {
        for (size_t i = 0; i < (1 << 20); i += 4096)
            sum += work[i]++;
        memcpy(work, marker, ml);
        usleep(1000);
    }
    return (int)(sum & 0);
}

/* A program that blocks SIGUSR1 and SIGTERM in its only thread and collects
 * them with sigwait(), as servers with a signal-handling thread do. A
 * process-directed signal must reach it: a thread that memveil adds (the
 * fault handler) must not take the signal and run its default action
 * (terminate) instead. Heap data set before the signals is checked after. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGTERM);
    if (pthread_sigmask(SIG_BLOCK, &set, NULL) != 0) return 2;
    size_t n = 8 << 20;
    unsigned char *heap = malloc(n);
    if (!heap) return 3;
    for (size_t i = 0; i < n; i++) heap[i] = (unsigned char)(i * 7);
    int got = 0;
    for (int round = 0; round < 50; round++) {
        int want = round % 2 ? SIGTERM : SIGUSR1;
        if (kill(getpid(), want) != 0) return 4;
        int sig = 0;
        if (sigwait(&set, &sig) != 0 || sig != want) return 5;
        got++;
    }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += heap[i] != (unsigned char)(i * 7);
    printf("signals %d heap-bad %zu\n", got, bad);
    free(heap);
    return 0;
}

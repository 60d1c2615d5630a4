/* Thread stacks under memveil run. Three modes:
 *   secret:  a worker thread reads "SECRET MARKER" from stdin into its own
 *            stack, spreads SECRET over 64 KiB of it and waits; the main
 *            thread sweeps 8 MiB of heap twice (the worker's stack pages
 *            leave a small window), writes MARKER into a fresh buffer, prints
 *            "ready PID" and waits for SIGTERM.
 *   churn:   3000 threads: joined, detached, ending by pthread_exit, cancelled,
 *            one on a stack of its own; prints "churn ok" when every thread
 *            saw its own stack data intact.
 *   signal:  a worker sleeps; the main thread evicts its stack (8 MiB sweep)
 *            and sends it SIGUSR1, whose handler runs on that stack; prints
 *            "signal ok". */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int stage;
static char marker[128];

static void sweep(void) {
    /* volatile: the compiler may not drop a buffer nobody reads */
    volatile unsigned char *fill = malloc(8 << 20);
    if (!fill) exit(3);
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < (8u << 20); i++) fill[i] = (unsigned char)(i * 7 + pass);
}

static void *secret_worker(void *unused) {
    (void)unused;
    volatile char buf[65536];
    char *in = (char *)buf;
    ssize_t got = 0, r;
    while (got < 255 && (r = read(0, in + got, 255 - got)) > 0) got += r;
    in[got] = 0;
    char *sp = strchr(in, ' ');
    if (!sp) exit(4);
    *sp = 0;
    char *m = sp + 1;
    char *nl = strchr(m, '\n');
    if (nl) *nl = 0;
    strncpy(marker, m, sizeof marker - 1);
    size_t sl = strlen(in);
    memset(m - 1, 0, strlen(m) + 1);
    for (size_t off = sl + 1; off + sl < sizeof buf; off += sl + 1) memcpy((char *)buf + off, in, sl);
    pthread_mutex_lock(&mu);
    stage = 1;
    pthread_cond_broadcast(&cv);
    while (stage < 2) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return (void *)(size_t)buf[0];
}

static void *check_worker(void *arg) {
    size_t k = (size_t)arg;
    volatile unsigned char b[16384];
    for (size_t i = 0; i < sizeof b; i++) b[i] = (unsigned char)(i + k);
    size_t bad = 0;
    for (size_t i = 0; i < sizeof b; i++) bad += b[i] != (unsigned char)(i + k);
    if (k % 7 == 3) pthread_exit((void *)bad);
    if (k % 11 == 5) {
        for (;;) {
            pthread_testcancel();
            usleep(100);
        }
    }
    return (void *)bad;
}

static volatile sig_atomic_t got_signal;
static void on_usr1(int s) {
    (void)s;
    volatile char frame[8192];
    frame[0] = 1;
    frame[8191] = frame[0];
    got_signal = frame[8191];
}

static void *sleeper(void *unused) {
    (void)unused;
    volatile char deep[32768];
    memset((char *)deep, 9, sizeof deep);
    while (!got_signal) {
        struct timespec t = {0, 5000000};
        nanosleep(&t, NULL);
    }
    return (void *)(size_t)(deep[100] == 9 && deep[32767] == 9);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "churn";
    if (!strcmp(mode, "secret")) {
        pthread_t t;
        if (pthread_create(&t, NULL, secret_worker, NULL)) return 5;
        pthread_mutex_lock(&mu);
        while (stage < 1) pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        sweep();
        char *fresh = malloc(4096);
        if (!fresh) return 3;
        strcpy(fresh + 2048, marker);
        memset(marker, 0, sizeof marker);
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(mode, "signal")) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_usr1;
        sigaction(SIGUSR1, &sa, NULL);
        pthread_t t;
        if (pthread_create(&t, NULL, sleeper, NULL)) return 5;
        usleep(20000);
        sweep();
        pthread_kill(t, SIGUSR1);
        void *ok = NULL;
        pthread_join(t, &ok);
        printf("signal %s\n", ok ? "ok" : "bad");
        return 0;
    }
    size_t bad = 0;
    for (size_t k = 0; k < 3000; k++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        void *own = NULL;
        if (k % 5 == 1) pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (k % 13 == 2) pthread_attr_setstacksize(&a, 256 * 1024);
        if (k == 17) {
            own = malloc(1 << 20);
            pthread_attr_setstack(&a, own, 1 << 20);
        }
        int e = pthread_create(&t, &a, check_worker, (void *)k);
        if (e) {
            fprintf(stderr, "thread %zu: pthread_create: %s\n", k, strerror(e));
            return 5;
        }
        pthread_attr_destroy(&a);
        if (k % 11 == 5) pthread_cancel(t);
        if (k % 5 != 1) {
            void *r = NULL;
            pthread_join(t, &r);
            if (r != PTHREAD_CANCELED) bad += (size_t)r;
        }
        if (k % 97 == 0) sweep();
    }
    usleep(100000);
    printf("churn %s\n", bad ? "bad" : "ok");
    return 0;
}

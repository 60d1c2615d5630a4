/* Closes every descriptor it did not open, as daemons and sandboxes do,
 * for the descriptor-guard tests (memveil_sys::fdguard): fills 64 MiB,
 * then closefrom(3), a dup2 of stdout onto every number from 3 to 1099
 * (those the shield holds are refused), closefrom(3) again, or with
 * "raw" one close_range system call that no wrapper sees. Then it sleeps
 * (the shield sweeps the idle pages out), churns 160 MiB and reads the
 * 64 MiB back. Prints the checksum on stdout, what dup2 refused on stderr.
 * usage: close_all [raw] */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    size_t n = 64 << 20;
    unsigned char *a = malloc(n);
    if (!a) return 2;
    for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 2654435761u >> 13);
    if (argc > 1 && strcmp(argv[1], "raw") == 0) {
        syscall(SYS_close_range, 3, ~0U, 0);
    } else {
        closefrom(3);
        int refused = 0;
        for (int fd = 3; fd < 1100; fd++)
            if (dup2(1, fd) < 0) refused++;
        closefrom(3);
        fprintf(stderr, "dup2 refused %d\n", refused);
    }
    sleep(1);
    unsigned long s = 0;
    for (int i = 0; i < 20; i++) {
        unsigned char *b = malloc(8 << 20);
        if (!b) return 2;
        memset(b, i, 8 << 20);
        s += b[100];
        free(b);
    }
    for (size_t i = 0; i < n; i += 61) s = s * 31 + a[i];
    printf("sum %lu\n", s);
    return 0;
}

/* Leaves children running, for the static-program tests: posix_spawns
 * N times `/bin/sh -c SCRIPT` (clone with CLONE_VM, then execve) and exits
 * at once, without waiting. The shells map their libraries, fork and
 * execute while the program ends and after it has gone: under memveil run
 * they need the loader's keeper (without it their notified calls failed
 * with ENOSYS once the program had gone, or waited for ever on a call the
 * agent had received when the program ended).
 * usage: static_daemon N SCRIPT */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>

extern char **environ;

int main(int argc, char **argv) {
    if (argc != 3 || atoi(argv[1]) < 1) {
        fprintf(stderr, "usage: static_daemon N SCRIPT\n");
        return 2;
    }
    int n = atoi(argv[1]);
    char *args[] = {"sh", "-c", argv[2], NULL};
    for (int i = 0; i < n; i++) {
        pid_t pid;
        if (posix_spawn(&pid, "/bin/sh", NULL, NULL, args, environ) != 0) {
            perror("posix_spawn");
            return 1;
        }
    }
    printf("spawned %d\n", n);
    return 0;
}

/* Forks, spawns and its own seccomp filter, for the static-program tests:
 * installs a filter of its own (getpriority fails with EPERM; filters
 * stack with the loader's), allocates after it, tries fork(), then
 * posix_spawn (clone with CLONE_VM) of /bin/echo, then an execve of
 * /bin/echo in place. Prints one line per step.
 * usage: static_fork */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

int main(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getpriority, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog p = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p) != 0) {
        perror("own filter");
        return 2;
    }
    errno = 0;
    int r = getpriority(PRIO_PROCESS, 0);
    printf("own filter %s\n", r == -1 && errno == EPERM ? "works" : "ignored");
    char *b = malloc(16 << 20);
    if (!b) return 2;
    memset(b, 7, 16 << 20);
    printf("malloc after it %d\n", b[12345]);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) _exit(0);
    if (c > 0) {
        waitpid(c, NULL, 0);
        printf("fork ok\n");
    } else {
        printf("fork refused %s\n", errno == EAGAIN ? "EAGAIN" : strerror(errno));
    }
    fflush(stdout);
    char *argv[] = {"echo", "spawned", NULL};
    pid_t s;
    if (posix_spawn(&s, "/bin/echo", NULL, NULL, argv, environ) != 0) {
        printf("posix_spawn failed\n");
        return 1;
    }
    int st;
    waitpid(s, &st, 0);
    printf("spawn exit %d\n", WEXITSTATUS(st));
    fflush(stdout);
    char *again[] = {"echo", "replaced", NULL};
    execv("/bin/echo", again);
    printf("exec refused %s\n", errno == EPERM ? "EPERM" : strerror(errno));
    return 0;
}

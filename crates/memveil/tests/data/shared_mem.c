/* Shared memory under memveil run. Mode anon, memfd or sysv: maps 1 MiB of
 * that kind, forks a child that fills it, and the parent checks what the
 * child wrote; prints "shared MODE ok", or names the call that failed and
 * exits 2. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/wait.h>
#include <unistd.h>

#define LEN (1u << 20)

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "anon";
    unsigned char *p = MAP_FAILED;
    if (!strcmp(mode, "anon")) {
        p = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    } else if (!strcmp(mode, "memfd")) {
        int fd = memfd_create("memveil-test", 0);
        if (fd < 0 || ftruncate(fd, LEN)) {
            perror("memfd_create");
            return 2;
        }
        p = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    } else {
        int id = shmget(IPC_PRIVATE, LEN, IPC_CREAT | 0600);
        if (id < 0) {
            perror("shmget");
            return 2;
        }
        p = shmat(id, NULL, 0);
        shmctl(id, IPC_RMID, NULL);
        if (p == (void *)-1) p = MAP_FAILED;
    }
    if (p == MAP_FAILED) {
        printf("%s: %s\n", mode, strerror(errno));
        return 2;
    }
    pid_t c = fork();
    if (c == 0) {
        for (unsigned i = 0; i < LEN; i++) p[i] = (unsigned char)(i * 13 + 1);
        _exit(0);
    }
    int st = 0;
    waitpid(c, &st, 0);
    for (unsigned i = 0; i < LEN; i++)
        if (p[i] != (unsigned char)(i * 13 + 1)) {
            printf("shared %s: byte %u differs\n", mode, i);
            return 3;
        }
    printf("shared %s ok\n", mode);
    return 0;
}

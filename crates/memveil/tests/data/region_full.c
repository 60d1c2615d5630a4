// Run by tests/shield_run.rs under `memveil run --region-gib 1` (a 512 MiB
// page half): asks for more anonymous memory than the region holds. The
// mapping must be refused with ENOMEM, never handed out unprotected.
#include <errno.h>
#include <stdio.h>
#include <sys/mman.h>

int main(void) {
    void *small = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *big = mmap(NULL, 3UL << 30, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    printf("small %s big %s\n", small == MAP_FAILED ? "failed" : "ok",
           big == MAP_FAILED ? (errno == ENOMEM ? "ENOMEM" : "other-error") : "mapped");
    return 0;
}

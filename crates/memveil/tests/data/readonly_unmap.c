/* What a JIT does with its code buffers: map read-write, write, make the
 * pages read-only and executable (or read-only), read them back, unmap them;
 * 200 rounds of 64 KiB, the memory reused by the next mapping. Also
 * MADV_DONTNEED on a read-only mapping. Prints "readonly ok"; a preload that
 * wipes unmapped pages by writing them would crash here (SIGSEGV). */
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#define LEN (64u << 10)

int main(void) {
    for (int round = 0; round < 200; round++) {
        unsigned char *p = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) { perror("mmap"); return 2; }
        for (unsigned i = 0; i < LEN; i++) {
            if (p[i] != 0) { printf("round %d: fresh memory not zero at %u\n", round, i); return 1; }
            p[i] = (unsigned char)(i * 13 + round);
        }
        int prot = round % 2 ? PROT_READ : PROT_READ | PROT_EXEC;
        if (mprotect(p, LEN, prot)) { perror("mprotect"); return 2; }
        for (unsigned i = 0; i < LEN; i += 97)
            if (p[i] != (unsigned char)(i * 13 + round)) { printf("round %d: wrong byte at %u\n", round, i); return 1; }
        if (round % 50 == 7 && madvise(p, LEN, MADV_DONTNEED)) { perror("madvise"); return 2; }
        if (munmap(p, LEN)) { perror("munmap"); return 2; }
    }
    printf("readonly ok\n");
    return 0;
}

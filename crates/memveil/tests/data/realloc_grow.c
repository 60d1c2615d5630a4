/* A buffer grown by realloc a MiB at a time from 1 to 48 MiB, then shrunk
 * back, its contents checked at every step; and an anonymous mapping grown
 * with mremap without MREMAP_MAYMOVE; a large calloc reads zeros. Prints how often realloc moved the
 * buffer and whether the mremap grew in place. Exit 1 on a content error. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define MIB (1u << 20)

static int check(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i += 4096)
        if (p[i] != (unsigned char)(i / MIB + 1))
            return 0;
    return 1;
}

int main(void) {
    size_t n = MIB;
    unsigned char *p = malloc(n);
    int moved = 0;
    if (!p)
        return 2;
    for (size_t i = 0; i < n; i += 4096)
        p[i] = (unsigned char)(i / MIB + 1);
    for (; n < 48 * MIB; n += MIB) {
        unsigned char *q = realloc(p, n + MIB);
        if (!q)
            return 2;
        moved += q != p;
        p = q;
        if (!check(p, n)) {
            fprintf(stderr, "contents lost growing to %zu\n", n + MIB);
            return 1;
        }
        for (size_t i = n; i < n + MIB; i += 4096)
            p[i] = (unsigned char)(i / MIB + 1);
    }
    unsigned char *q = realloc(p, 2 * MIB);
    if (!q || !check(q, 2 * MIB))
        return 1;
    moved += q != p;
    free(q);
    /* A large calloc over the pages of a freed dirty block reads zeros
     * (the shield skips writing pages it knows to be zero). */
    unsigned char *d = malloc(8 * MIB);
    if (!d)
        return 2;
    memset(d, 0xab, 8 * MIB);
    free(d);
    unsigned char *z = calloc(1, 8 * MIB);
    if (!z)
        return 2;
    for (size_t i = 0; i < 8 * MIB; i += 512)
        if (z[i]) {
            fprintf(stderr, "calloc: byte %zu is %d\n", i, z[i]);
            return 1;
        }
    free(z);
    char *m = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return 2;
    m[0] = 7;
    char *r = mremap(m, MIB, 2 * MIB, 0);
    int in_place = r == m && r[0] == 7 && r[MIB] == 0;
    printf("moved %d mremap_in_place %d\n", moved, in_place);
    return 0;
}

// A program linked against jemalloc that calls the two functions jemalloc
// lacks (reallocarray, pvalloc): built and run by tests/shield_run.rs.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <malloc.h>
int main(void) {
    char *p = malloc(100);
    strcpy(p, "reallocarray keeps this");
    p = reallocarray(p, 64, 100);
    char *q = pvalloc(5000);
    memset(q, 7, 8192);
    size_t u = malloc_usable_size(p);
    printf("%s %d %s\n", p, q[8191], u >= 6400 ? "usable-ok" : "usable-bad");
    free(p); free(q);
    return 0;
}

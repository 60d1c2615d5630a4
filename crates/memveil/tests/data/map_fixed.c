// An allocator's move run by tests/shield_run.rs under `memveil run`: fresh
// anonymous memory mapped with MAP_FIXED over part of a mapping it already
// has. Prints whether the new pages read as zeros, whether the old ones kept
// their data, and whether the new pages still belong to a userfaultfd-
// registered mapping ("um" in VmFlags of /proc/self/smaps): if not, the
// shield could never encrypt them.
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

static int uffd_registered(unsigned long addr) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int in = 0, found = -1;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = addr >= lo && addr < hi;
        } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
            found = strstr(line, " um") != NULL;
        }
    }
    if (f) fclose(f);
    return found;
}

int main(void) {
    size_t len = 1 << 20;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 2;
    memset(p, 'A', len);
    char *q = mmap(p + 65536, 131072, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (q != p + 65536) return 3;
    int zero = 1;
    for (size_t i = 0; i < 131072; i++) zero &= q[i] == 0;
    memset(q, 'B', 131072);
    printf("new-zero %d old-kept %d new-b %d registered %d\n", zero, p[0] == 'A' && p[65536 + 131072] == 'A',
           q[131071] == 'B', uffd_registered((unsigned long)q));
    return 0;
}

/* The client workload of the SoftHSM2 side-by-side proof: loads a PKCS#11
 * module, logs in, imports the AES-256 key given in hex as a session object
 * (then wipes its own copy), starts a multi-part AES-CBC encryption, feeds it
 * 4 KiB, prints READY and waits for a line on stdin (the test takes a core
 * dump meanwhile), then finishes and exits 0.
 * Usage: workload MODULE PIN KEYHEX */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef unsigned long UL;
typedef UL (*fn_t)();
typedef struct { UL type; void *p; UL len; } attr_t;
typedef struct { UL mech; void *p; UL len; } mech_t;

static void *lib;
static fn_t f(const char *n) {
    fn_t p = (fn_t)dlsym(lib, n);
    if (!p) { fprintf(stderr, "no %s\n", n); exit(2); }
    return p;
}
#define CALL(name, ...) do { UL rv_ = f(#name)(__VA_ARGS__); \
    if (rv_) { fprintf(stderr, #name " failed: 0x%lx\n", rv_); exit(1); } } while (0)

int main(int argc, char **argv) {
    if (argc != 4 || strlen(argv[3]) != 64) { fprintf(stderr, "usage: workload MODULE PIN KEYHEX64\n"); return 2; }
    lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    unsigned char *key = malloc(32);
    for (int i = 0; i < 32; i++) sscanf(argv[3] + 2 * i, "%2hhx", &key[i]);

    UL slots[8], n = 8, h = 0, k = 0;
    CALL(C_Initialize, NULL);
    CALL(C_GetSlotList, 1UL, slots, &n);
    if (n == 0) { fprintf(stderr, "no token\n"); return 1; }
    CALL(C_OpenSession, slots[0], 6UL, NULL, NULL, &h);
    CALL(C_Login, h, 1UL, argv[2], (UL)strlen(argv[2]));
    UL class = 4, kt = 0x1f;
    unsigned char t = 1, fl = 0;
    /* CLASS, KEY_TYPE, TOKEN=false, SENSITIVE, EXTRACTABLE=false, ENCRYPT, DECRYPT, VALUE */
    attr_t tmpl[] = {{0x0, &class, 8}, {0x100, &kt, 8}, {0x1, &fl, 1}, {0x103, &t, 1},
                     {0x162, &fl, 1}, {0x104, &t, 1}, {0x105, &t, 1}, {0x11, key, 32}};
    CALL(C_CreateObject, h, tmpl, 8UL, &k);
    explicit_bzero(key, 32);
    free(key);

    unsigned char iv[16] = {0}, data[4096], out[4096 + 16];
    memset(data, 0x61, sizeof data);
    mech_t cbc = {0x1082, iv, 16};
    UL ol = sizeof out;
    CALL(C_EncryptInit, h, &cbc, k);
    CALL(C_EncryptUpdate, h, data, (UL)sizeof data, out, &ol);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* parent gone: finish anyway */ }
    ol = sizeof out;
    CALL(C_EncryptFinal, h, out, &ol);
    CALL(C_CloseSession, h);
    CALL(C_Finalize, NULL);
    return 0;
}

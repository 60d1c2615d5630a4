/* The client workload of the RSA side of the SoftHSM2 proof: loads a PKCS#11
 * module, logs in, finds the private key labelled LABEL, starts a
 * multi-part CKM_SHA256_RSA_PKCS signature and feeds it a message, prints
 * READY and waits for a line on stdin (the test takes a core dump
 * meanwhile), then finishes the signature and exits 0.
 * Usage: sign_workload MODULE PIN LABEL */
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
    if (argc != 4) { fprintf(stderr, "usage: sign_workload MODULE PIN LABEL\n"); return 2; }
    lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    UL slots[8], n = 8, h = 0, k = 0, found = 0;
    CALL(C_Initialize, NULL);
    CALL(C_GetSlotList, 1UL, slots, &n);
    if (n == 0) { fprintf(stderr, "no token\n"); return 1; }
    CALL(C_OpenSession, slots[0], 6UL, NULL, NULL, &h);
    CALL(C_Login, h, 1UL, argv[2], (UL)strlen(argv[2]));
    UL class = 3; /* CKO_PRIVATE_KEY */
    attr_t t[] = {{0x0, &class, 8}, {0x3, argv[3], (UL)strlen(argv[3])}};
    CALL(C_FindObjectsInit, h, t, 2UL);
    CALL(C_FindObjects, h, &k, 1UL, &found);
    CALL(C_FindObjectsFinal, h);
    if (found != 1) { fprintf(stderr, "no private key labelled %s\n", argv[3]); return 1; }
    mech_t m = {0x40 /* CKM_SHA256_RSA_PKCS */, NULL, 0};
    unsigned char msg[1024], sig[1024];
    memset(msg, 0x61, sizeof msg);
    CALL(C_SignInit, h, &m, k);
    CALL(C_SignUpdate, h, msg, (UL)sizeof msg);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* parent gone: finish anyway */ }
    UL sl = sizeof sig;
    CALL(C_SignFinal, h, sig, &sl);
    CALL(C_CloseSession, h);
    CALL(C_Finalize, NULL);
    return 0;
}

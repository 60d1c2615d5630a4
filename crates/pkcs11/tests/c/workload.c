/* The client workload of the SoftHSM2 side-by-side proofs: loads a PKCS#11
 * module and logs in, then either
 *   aes KEYHEX64: imports the AES-256 key given in hex as a session object
 *                 (then wipes its own copy), starts a multi-part AES-CBC
 *                 encryption and feeds it 4 KiB;
 *   rsa LABEL:    finds the private key labelled LABEL, starts a multi-part
 *                 CKM_SHA256_RSA_PKCS signature and feeds it 1 KiB;
 * prints READY and waits for a line on stdin (the test takes a core dump
 * meanwhile), then finishes the operation and exits 0.
 * Usage: workload MODULE PIN aes KEYHEX64 | workload MODULE PIN rsa LABEL */
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

static void wait_for_dump(void) {
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* parent gone: finish anyway */ }
}

int main(int argc, char **argv) {
    int aes = argc == 5 && strcmp(argv[3], "aes") == 0 && strlen(argv[4]) == 64;
    int rsa = argc == 5 && strcmp(argv[3], "rsa") == 0;
    if (!aes && !rsa) {
        fprintf(stderr, "usage: workload MODULE PIN aes KEYHEX64 | workload MODULE PIN rsa LABEL\n");
        return 2;
    }
    lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    UL slots[8], n = 8, h = 0, k = 0;
    CALL(C_Initialize, NULL);
    CALL(C_GetSlotList, 1UL, slots, &n);
    if (n == 0) { fprintf(stderr, "no token\n"); return 1; }
    CALL(C_OpenSession, slots[0], 6UL, NULL, NULL, &h);
    CALL(C_Login, h, 1UL, argv[2], (UL)strlen(argv[2]));
    if (aes) {
        unsigned char *key = malloc(32);
        for (int i = 0; i < 32; i++) sscanf(argv[4] + 2 * i, "%2hhx", &key[i]);
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
        wait_for_dump();
        ol = sizeof out;
        CALL(C_EncryptFinal, h, out, &ol);
    } else {
        UL class = 3, found = 0; /* CKO_PRIVATE_KEY */
        attr_t t[] = {{0x0, &class, 8}, {0x3, argv[4], (UL)strlen(argv[4])}};
        CALL(C_FindObjectsInit, h, t, 2UL);
        CALL(C_FindObjects, h, &k, 1UL, &found);
        CALL(C_FindObjectsFinal, h);
        if (found != 1) { fprintf(stderr, "no private key labelled %s\n", argv[4]); return 1; }
        mech_t m = {0x40 /* CKM_SHA256_RSA_PKCS */, NULL, 0};
        unsigned char msg[1024], sig[1024];
        memset(msg, 0x61, sizeof msg);
        CALL(C_SignInit, h, &m, k);
        CALL(C_SignUpdate, h, msg, (UL)sizeof msg);
        wait_for_dump();
        UL sl = sizeof sig;
        CALL(C_SignFinal, h, sig, &sl);
    }
    CALL(C_CloseSession, h);
    CALL(C_Finalize, NULL);
    return 0;
}

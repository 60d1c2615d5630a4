/* What a host such as nginx (through libp11) relies on, with the module
 * loaded by dlopen as they load it:
 *
 *  fork: a parent that initialised the module and signs with a token key
 *  forks; the child gets CKR_CRYPTOKI_NOT_INITIALIZED until it calls
 *  C_Initialize (libp11 does on a pid change), then finds the key again and
 *  signs with its own vault connection; the parent keeps signing.
 *
 *  panic: with MEMVEIL_PKCS11_PANIC_TEST=1 every entry point panics inside
 *  the module; each answers CKR_GENERAL_ERROR and this process lives on
 *  (the library unwinds; built with panic = "abort" it would die of SIGABRT).
 *
 * usage: fork_panic MODULE LABEL    (LABEL: an RSA private key on the token)
 * Prints one line per check and ends with "N checks, F failed".
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef unsigned long CK_ULONG;
typedef CK_ULONG CK_RV;
typedef unsigned char CK_BYTE;

#define CKR_OK 0x0UL
#define CKR_GENERAL_ERROR 0x5UL
#define CKR_CRYPTOKI_NOT_INITIALIZED 0x190UL
#define CKF_SERIAL_SESSION 0x4UL
#define CKA_CLASS 0x0UL
#define CKA_LABEL 0x3UL
#define CKO_PRIVATE_KEY 3UL
#define CKM_SHA256_RSA_PKCS 0x40UL

typedef struct { CK_ULONG type; void *value; CK_ULONG len; } attr_t;
typedef struct { CK_ULONG mech; void *param; CK_ULONG len; } mech_t;
typedef struct { CK_BYTE major, minor; } version_t;

/* The CK_FUNCTION_LIST prefix this program uses, in the standard's order. */
typedef struct {
    version_t version;
    CK_RV (*Initialize)(void *);
    CK_RV (*Finalize)(void *);
    CK_RV (*GetInfo)(void *);
    CK_RV (*GetFunctionList)(void *);
    CK_RV (*GetSlotList)(CK_BYTE, CK_ULONG *, CK_ULONG *);
    void *GetSlotInfo, *GetTokenInfo, *GetMechanismList, *GetMechanismInfo;
    void *InitToken, *InitPIN, *SetPIN;
    CK_RV (*OpenSession)(CK_ULONG, CK_ULONG, void *, void *, CK_ULONG *);
    CK_RV (*CloseSession)(CK_ULONG);
    void *CloseAllSessions, *GetSessionInfo, *GetOperationState, *SetOperationState;
    void *Login, *Logout, *CreateObject, *CopyObject, *DestroyObject, *GetObjectSize;
    void *GetAttributeValue, *SetAttributeValue;
    CK_RV (*FindObjectsInit)(CK_ULONG, attr_t *, CK_ULONG);
    CK_RV (*FindObjects)(CK_ULONG, CK_ULONG *, CK_ULONG, CK_ULONG *);
    CK_RV (*FindObjectsFinal)(CK_ULONG);
    void *EncryptInit, *Encrypt, *EncryptUpdate, *EncryptFinal;
    void *DecryptInit, *Decrypt, *DecryptUpdate, *DecryptFinal;
    void *DigestInit, *Digest, *DigestUpdate, *DigestKey, *DigestFinal;
    CK_RV (*SignInit)(CK_ULONG, mech_t *, CK_ULONG);
    CK_RV (*Sign)(CK_ULONG, CK_BYTE *, CK_ULONG, CK_BYTE *, CK_ULONG *);
} fns_t;

static int checks, failed;

static void check(const char *what, CK_RV got, CK_RV want) {
    checks++;
    if (got != want) {
        failed++;
        printf("FAIL %s: 0x%lx, want 0x%lx\n", what, got, want);
    } else {
        printf("ok   %s\n", what);
    }
}

static CK_ULONG find_key(fns_t *f, CK_ULONG s, const char *label) {
    CK_ULONG class = CKO_PRIVATE_KEY, obj = 0, n = 0;
    attr_t t[2] = {{CKA_CLASS, &class, sizeof class}, {CKA_LABEL, (void *)label, strlen(label)}};
    check("C_FindObjectsInit", f->FindObjectsInit(s, t, 2), CKR_OK);
    check("C_FindObjects", f->FindObjects(s, &obj, 1, &n), CKR_OK);
    check("C_FindObjectsFinal", f->FindObjectsFinal(s), CKR_OK);
    return n == 1 ? obj : 0;
}

static CK_RV sign(fns_t *f, CK_ULONG s, CK_ULONG key) {
    mech_t m = {CKM_SHA256_RSA_PKCS, NULL, 0};
    CK_BYTE sig[512];
    CK_ULONG n = sizeof sig;
    CK_RV rv = f->SignInit(s, &m, key);
    if (rv != CKR_OK)
        return rv;
    return f->Sign(s, (CK_BYTE *)"memveil", 7, sig, &n);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODULE LABEL\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    CK_RV (*get)(fns_t **) = (CK_RV(*)(fns_t **))dlsym(lib, "C_GetFunctionList");
    fns_t *f = NULL;
    if (!get || get(&f) != CKR_OK) {
        fprintf(stderr, "C_GetFunctionList failed\n");
        return 2;
    }

    /* fork */
    check("parent C_Initialize", f->Initialize(NULL), CKR_OK);
    CK_ULONG s = 0;
    check("parent C_OpenSession", f->OpenSession(0, CKF_SERIAL_SESSION, NULL, NULL, &s), CKR_OK);
    CK_ULONG key = find_key(f, s, argv[2]);
    check("parent finds the key", key != 0 ? CKR_OK : 1, CKR_OK);
    check("parent signs", sign(f, s, key), CKR_OK);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        check("child: inherited session refused", sign(f, s, key), CKR_CRYPTOKI_NOT_INITIALIZED);
        check("child C_Initialize", f->Initialize(NULL), CKR_OK);
        CK_ULONG cs = 0;
        check("child C_OpenSession", f->OpenSession(0, CKF_SERIAL_SESSION, NULL, NULL, &cs), CKR_OK);
        CK_ULONG ck = find_key(f, cs, argv[2]);
        check("child finds the key", ck != 0 ? CKR_OK : 1, CKR_OK);
        check("child signs", sign(f, cs, ck), CKR_OK);
        check("child C_Finalize", f->Finalize(NULL), CKR_OK);
        fflush(stdout);
        _exit(failed ? 1 : 0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    check("child exited cleanly", WIFEXITED(st) && WEXITSTATUS(st) == 0 ? CKR_OK : 1, CKR_OK);
    check("parent signs after the child", sign(f, s, key), CKR_OK);
    check("parent C_Finalize", f->Finalize(NULL), CKR_OK);

    /* panic */
    setenv("MEMVEIL_PKCS11_PANIC_TEST", "1", 1);
    check("C_Initialize (panic test on)", f->Initialize(NULL), CKR_OK);
    check("C_GetInfo panics: CKR_GENERAL_ERROR", f->GetInfo(NULL), CKR_GENERAL_ERROR);
    CK_ULONG slots = 0;
    check("C_GetSlotList panics: CKR_GENERAL_ERROR", f->GetSlotList(0, NULL, &slots), CKR_GENERAL_ERROR);
    check("C_OpenSession panics: CKR_GENERAL_ERROR",
          f->OpenSession(0, CKF_SERIAL_SESSION, NULL, NULL, &s), CKR_GENERAL_ERROR);
    unsetenv("MEMVEIL_PKCS11_PANIC_TEST");
    check("C_Finalize ends the panic test", f->Finalize(NULL), CKR_OK);
    check("C_Initialize again", f->Initialize(NULL), CKR_OK);
    check("C_OpenSession works again", f->OpenSession(0, CKF_SERIAL_SESSION, NULL, NULL, &s), CKR_OK);
    check("C_Finalize", f->Finalize(NULL), CKR_OK);
    printf("%d checks, %d failed\n", checks, failed);
    return failed ? 1 : 0;
}

/* A hostile C caller of libmemveil_pkcs11.so: every entry point with NULL
 * pointers, short buffers, closed sessions and wrong handles, each call
 * checked against the CKR_ code PKCS#11 names. Exits 0 when every check
 * held; a crash of the module would end this process instead.
 * Usage: robust /path/to/libmemveil_pkcs11.so   (MEMVEIL_VAULT_SOCKET set) */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef unsigned long UL;
typedef UL (*fn_t)();

#define CKR_OK 0x0UL
#define CKR_ARGUMENTS_BAD 0x7UL
#define CKR_ATTRIBUTE_SENSITIVE 0x11UL
#define CKR_ATTRIBUTE_TYPE_INVALID 0x12UL
#define CKR_ATTRIBUTE_VALUE_INVALID 0x13UL
#define CKR_FUNCTION_NOT_SUPPORTED 0x54UL
#define CKR_KEY_HANDLE_INVALID 0x60UL
#define CKR_MECHANISM_INVALID 0x70UL
#define CKR_MECHANISM_PARAM_INVALID 0x71UL
#define CKR_OBJECT_HANDLE_INVALID 0x82UL
#define CKR_OPERATION_ACTIVE 0x90UL
#define CKR_OPERATION_NOT_INITIALIZED 0x91UL
#define CKR_SESSION_HANDLE_INVALID 0xB3UL
#define CKR_SESSION_PARALLEL_NOT_SUPPORTED 0xB4UL
#define CKR_SIGNATURE_LEN_RANGE 0xC1UL
#define CKR_SLOT_ID_INVALID 0x3UL
#define CKR_TEMPLATE_INCOMPLETE 0xD0UL
#define CKR_USER_ALREADY_LOGGED_IN 0x100UL
#define CKR_USER_NOT_LOGGED_IN 0x101UL
#define CKR_USER_TYPE_INVALID 0x103UL
#define CKR_BUFFER_TOO_SMALL 0x150UL
#define CKR_CRYPTOKI_NOT_INITIALIZED 0x190UL
#define CKR_CRYPTOKI_ALREADY_INITIALIZED 0x191UL
#define CKR_DATA_LEN_RANGE 0x21UL

#define CKF_RW_SESSION 2UL
#define CKF_SERIAL_SESSION 4UL
#define CKF_OS_LOCKING_OK 2UL
#define CKA_CLASS 0x0UL
#define CKA_TOKEN 0x1UL
#define CKA_LABEL 0x3UL
#define CKA_VALUE 0x11UL
#define CKA_KEY_TYPE 0x100UL
#define CKA_VALUE_LEN 0x161UL
#define CKO_SECRET_KEY 4UL
#define CKK_AES 0x1FUL
#define CKM_AES_KEY_GEN 0x1080UL
#define CKM_AES_ECB 0x1081UL
#define CKM_AES_CBC 0x1082UL
#define CKM_AES_CTR 0x1086UL
#define CKM_AES_GCM 0x1087UL
#define CKM_AES_CMAC 0x108AUL
#define CKM_SHA256 0x250UL
#define CKM_MD5 0x210UL
#define CKR_KEY_INDIGESTIBLE 0x67UL
#define CKU_USER 1UL
#define UNAVAILABLE (~0UL)

typedef struct { UL type; void *p; UL len; } attr_t;
typedef struct { UL mech; void *p; UL len; } mech_t;
typedef struct { void *c, *d, *l, *u; UL flags; void *reserved; } init_t;
typedef struct { unsigned char *iv; UL iv_len, iv_bits; unsigned char *aad; UL aad_len, tag_bits; } gcm_t;
typedef struct { UL bits; unsigned char cb[16]; } ctr_t;

static void *lib;
static int failures, checks;

static fn_t f(const char *name) {
    fn_t p = (fn_t)dlsym(lib, name);
    if (!p) { printf("FAIL %s not exported\n", name); exit(2); }
    return p;
}

static void expect(const char *what, UL got, UL want) {
    checks++;
    if (got != want) {
        failures++;
        printf("FAIL %s: got 0x%lx, want 0x%lx\n", what, got, want);
    }
}

#define CHECK(want, name, ...) expect(#name "(" #__VA_ARGS__ ")", f(#name)(__VA_ARGS__), want)

/* Entry points whose first argument is a session handle. */
static const char *session_fns[] = {
    "C_GetSessionInfo", "C_GetOperationState", "C_SetOperationState", "C_Login",
    "C_Logout", "C_CreateObject", "C_CopyObject", "C_DestroyObject", "C_GetObjectSize",
    "C_GetAttributeValue", "C_SetAttributeValue", "C_FindObjectsInit", "C_FindObjects",
    "C_FindObjectsFinal", "C_EncryptInit", "C_Encrypt", "C_EncryptUpdate", "C_EncryptFinal",
    "C_DecryptInit", "C_Decrypt", "C_DecryptUpdate", "C_DecryptFinal", "C_DigestInit",
    "C_Digest", "C_DigestUpdate", "C_DigestKey", "C_DigestFinal", "C_SignInit", "C_Sign",
    "C_SignUpdate", "C_SignFinal", "C_SignRecoverInit", "C_SignRecover", "C_VerifyInit",
    "C_Verify", "C_VerifyUpdate", "C_VerifyFinal", "C_VerifyRecoverInit", "C_VerifyRecover",
    "C_DigestEncryptUpdate", "C_DecryptDigestUpdate", "C_SignEncryptUpdate",
    "C_DecryptVerifyUpdate", "C_GenerateKey", "C_GenerateKeyPair", "C_WrapKey",
    "C_UnwrapKey", "C_DeriveKey", "C_SeedRandom", "C_GenerateRandom",
    "C_GetFunctionStatus", "C_CancelFunction", "C_InitPIN", "C_SetPIN", NULL};

static const char *other_fns[] = {
    "C_GetInfo", "C_GetSlotList", "C_GetSlotInfo", "C_GetTokenInfo", "C_GetMechanismList",
    "C_GetMechanismInfo", "C_InitToken", "C_OpenSession", "C_CloseSession",
    "C_CloseAllSessions", "C_WaitForSlotEvent", "C_Finalize", NULL};

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: robust MODULE\n"); return 2; }
    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { printf("FAIL dlopen: %s\n", dlerror()); return 2; }

    UL n = 0, h = 0, h2 = 0, key = 0, slots[4], mechs[16];
    unsigned char buf[256], out[256], small[4];
    memset(buf, 0x42, sizeof buf);

    /* Before C_Initialize: every entry point says so. */
    for (int i = 0; session_fns[i]; i++) expect(session_fns[i], f(session_fns[i])(1UL, 0, 0, 0, 0, 0, 0, 0), CKR_CRYPTOKI_NOT_INITIALIZED);
    for (int i = 0; other_fns[i]; i++) expect(other_fns[i], f(other_fns[i])(0UL, 0, 0, 0, 0, 0), CKR_CRYPTOKI_NOT_INITIALIZED);
    CHECK(CKR_ARGUMENTS_BAD, C_GetFunctionList, NULL);

    /* C_Initialize's arguments. */
    init_t bad_reserved = {0, 0, 0, 0, CKF_OS_LOCKING_OK, (void *)1};
    CHECK(CKR_ARGUMENTS_BAD, C_Initialize, &bad_reserved);
    init_t half_mutex = {(void *)f("C_GetInfo"), 0, 0, 0, CKF_OS_LOCKING_OK, 0};
    CHECK(CKR_ARGUMENTS_BAD, C_Initialize, &half_mutex);
    init_t ok = {0, 0, 0, 0, CKF_OS_LOCKING_OK, 0};
    CHECK(CKR_OK, C_Initialize, &ok);
    CHECK(CKR_CRYPTOKI_ALREADY_INITIALIZED, C_Initialize, NULL);

    /* Slots, tokens, mechanisms. */
    CHECK(CKR_ARGUMENTS_BAD, C_GetInfo, NULL);
    CHECK(CKR_ARGUMENTS_BAD, C_GetSlotList, 0, NULL, NULL);
    n = 0;
    CHECK(CKR_BUFFER_TOO_SMALL, C_GetSlotList, 1, slots, &n);
    expect("slot count after BUFFER_TOO_SMALL", n, 1);
    n = 4;
    CHECK(CKR_OK, C_GetSlotList, 1, slots, &n);
    expect("slot count", n, 1);
    CHECK(CKR_SLOT_ID_INVALID, C_GetSlotInfo, 99UL, buf);
    CHECK(CKR_ARGUMENTS_BAD, C_GetSlotInfo, 0UL, NULL);
    CHECK(CKR_ARGUMENTS_BAD, C_GetTokenInfo, 0UL, NULL);
    CHECK(CKR_SLOT_ID_INVALID, C_GetTokenInfo, 7UL, buf);
    n = 2;
    CHECK(CKR_BUFFER_TOO_SMALL, C_GetMechanismList, 0UL, mechs, &n);
    expect("mechanism count", n, 43);
    CHECK(CKR_ARGUMENTS_BAD, C_GetMechanismList, 0UL, mechs, NULL);
    CHECK(CKR_MECHANISM_INVALID, C_GetMechanismInfo, 0UL, CKM_MD5, buf);
    CHECK(CKR_ARGUMENTS_BAD, C_GetMechanismInfo, 0UL, CKM_AES_GCM, NULL);
    CHECK(CKR_FUNCTION_NOT_SUPPORTED, C_InitToken, 0UL, NULL, 0UL, NULL);

    /* Sessions. */
    CHECK(CKR_SESSION_PARALLEL_NOT_SUPPORTED, C_OpenSession, 0UL, 0UL, NULL, NULL, &h);
    CHECK(CKR_ARGUMENTS_BAD, C_OpenSession, 0UL, CKF_SERIAL_SESSION, NULL, NULL, NULL);
    CHECK(CKR_SLOT_ID_INVALID, C_OpenSession, 5UL, CKF_SERIAL_SESSION, NULL, NULL, &h);
    CHECK(CKR_OK, C_OpenSession, 0UL, CKF_SERIAL_SESSION | CKF_RW_SESSION, NULL, NULL, &h);
    CHECK(CKR_OK, C_OpenSession, 0UL, CKF_SERIAL_SESSION, NULL, NULL, &h2);
    CHECK(CKR_ARGUMENTS_BAD, C_GetSessionInfo, h, NULL);
    CHECK(CKR_SESSION_HANDLE_INVALID, C_GetSessionInfo, 0xabcdefUL, buf);
    CHECK(CKR_USER_TYPE_INVALID, C_Login, h, 7UL, "1234", 4UL);
    CHECK(CKR_ARGUMENTS_BAD, C_Login, h, CKU_USER, NULL, 4UL);
    CHECK(CKR_OK, C_Login, h, CKU_USER, "1234", 4UL);
    CHECK(CKR_USER_ALREADY_LOGGED_IN, C_Login, h, CKU_USER, "1234", 4UL);
    CHECK(CKR_OK, C_Logout, h);
    CHECK(CKR_USER_NOT_LOGGED_IN, C_Logout, h);

    /* Objects. */
    UL class = CKO_SECRET_KEY, kt = CKK_AES, len24 = 24, len32 = 32;
    unsigned char fal = 0, value[32];
    memset(value, 0x5c, sizeof value);
    attr_t imp[] = {{CKA_CLASS, &class, 8}, {CKA_KEY_TYPE, &kt, 8}, {CKA_TOKEN, &fal, 1},
                    {CKA_LABEL, "robust", 6}, {CKA_VALUE, value, 32}};
    attr_t null_value[] = {{CKA_CLASS, &class, 8}, {CKA_KEY_TYPE, &kt, 8}, {CKA_VALUE, NULL, 32}};
    attr_t no_class[] = {{CKA_KEY_TYPE, &kt, 8}, {CKA_VALUE, value, 32}};
    attr_t bad_len[] = {{CKA_CLASS, &class, 8}, {CKA_KEY_TYPE, &kt, 8}, {CKA_VALUE, value, 24}};
    CHECK(CKR_ARGUMENTS_BAD, C_CreateObject, h, NULL, 3UL, &key);
    CHECK(CKR_ARGUMENTS_BAD, C_CreateObject, h, null_value, 3UL, &key);
    CHECK(CKR_ARGUMENTS_BAD, C_CreateObject, h, imp, 5UL, NULL);
    CHECK(CKR_TEMPLATE_INCOMPLETE, C_CreateObject, h, no_class, 2UL, &key);
    CHECK(CKR_ATTRIBUTE_VALUE_INVALID, C_CreateObject, h, bad_len, 3UL, &key);
    CHECK(CKR_OK, C_CreateObject, h, imp, 5UL, &key);

    attr_t get = {CKA_VALUE, out, sizeof out};
    CHECK(CKR_ATTRIBUTE_SENSITIVE, C_GetAttributeValue, h, key, &get, 1UL);
    expect("CKA_VALUE length after refusal", get.len, UNAVAILABLE);
    attr_t lab = {CKA_LABEL, small, 1};
    CHECK(CKR_BUFFER_TOO_SMALL, C_GetAttributeValue, h, key, &lab, 1UL);
    expect("label length after BUFFER_TOO_SMALL", lab.len, UNAVAILABLE);
    attr_t lab_len = {CKA_LABEL, NULL, 0};
    CHECK(CKR_OK, C_GetAttributeValue, h, key, &lab_len, 1UL);
    expect("label length query", lab_len.len, 6);
    attr_t unknown = {0x7fff0000UL, out, sizeof out};
    CHECK(CKR_ATTRIBUTE_TYPE_INVALID, C_GetAttributeValue, h, key, &unknown, 1UL);
    CHECK(CKR_ARGUMENTS_BAD, C_GetAttributeValue, h, key, NULL, 1UL);
    CHECK(CKR_OBJECT_HANDLE_INVALID, C_GetAttributeValue, h, 0xdeadUL, &lab_len, 1UL);
    CHECK(CKR_ARGUMENTS_BAD, C_GetObjectSize, h, key, NULL);

    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_FindObjects, h, mechs, 1UL, &n);
    CHECK(CKR_ARGUMENTS_BAD, C_FindObjectsInit, h, NULL, 1UL);
    CHECK(CKR_OK, C_FindObjectsInit, h, NULL, 0UL);
    CHECK(CKR_OPERATION_ACTIVE, C_FindObjectsInit, h, NULL, 0UL);
    CHECK(CKR_ARGUMENTS_BAD, C_FindObjects, h, NULL, 1UL, &n);
    CHECK(CKR_ARGUMENTS_BAD, C_FindObjects, h, mechs, 1UL, NULL);
    CHECK(CKR_OK, C_FindObjectsFinal, h);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_FindObjectsFinal, h);

    /* Encryption. */
    unsigned char iv[16] = {0};
    mech_t ecb = {CKM_AES_ECB, NULL, 0}, cbc_null = {CKM_AES_CBC, NULL, 16};
    mech_t sha = {CKM_SHA256, NULL, 0};
    gcm_t g_null_iv = {NULL, 12, 96, NULL, 0, 128}, g_short_tag = {iv, 12, 96, NULL, 0, 64};
    mech_t gcm1 = {CKM_AES_GCM, &g_null_iv, sizeof g_null_iv}, gcm2 = {CKM_AES_GCM, &g_short_tag, sizeof g_short_tag};
    mech_t gcm_len = {CKM_AES_GCM, &g_short_tag, 7};
    ctr_t c0 = {0, {0}};
    mech_t ctr0 = {CKM_AES_CTR, &c0, sizeof c0};
    CHECK(CKR_ARGUMENTS_BAD, C_EncryptInit, h, NULL, key);
    CHECK(CKR_ARGUMENTS_BAD, C_EncryptInit, h, &cbc_null, key);
    CHECK(CKR_MECHANISM_INVALID, C_EncryptInit, h, &sha, key);
    CHECK(CKR_ARGUMENTS_BAD, C_EncryptInit, h, &gcm1, key);
    CHECK(CKR_MECHANISM_PARAM_INVALID, C_DecryptInit, h, &gcm2, key);
    CHECK(CKR_MECHANISM_PARAM_INVALID, C_EncryptInit, h, &gcm_len, key);
    CHECK(CKR_MECHANISM_PARAM_INVALID, C_EncryptInit, h, &ctr0, key);
    CHECK(CKR_KEY_HANDLE_INVALID, C_EncryptInit, h, &ecb, 0xbeefUL);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_Encrypt, h, buf, 16UL, out, &n);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_DecryptFinal, h, out, &n);
    CHECK(CKR_OK, C_EncryptInit, h, &ecb, key);
    CHECK(CKR_OPERATION_ACTIVE, C_EncryptInit, h, &ecb, key);
    n = 8;
    CHECK(CKR_BUFFER_TOO_SMALL, C_Encrypt, h, buf, 32UL, out, &n);
    expect("length after BUFFER_TOO_SMALL", n, 32);
    CHECK(CKR_ARGUMENTS_BAD, C_Encrypt, h, NULL, 32UL, out, &n);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_Encrypt, h, buf, 32UL, out, &n);
    CHECK(CKR_OK, C_EncryptInit, h, &ecb, key);
    CHECK(CKR_ARGUMENTS_BAD, C_EncryptUpdate, h, buf, 16UL, out, NULL);
    CHECK(CKR_OK, C_EncryptInit, h, &ecb, key);
    n = sizeof out;
    CHECK(CKR_OK, C_EncryptUpdate, h, buf, 15UL, out, &n);
    expect("output of a partial block", n, 0);
    n = sizeof out;
    CHECK(CKR_DATA_LEN_RANGE, C_EncryptFinal, h, out, &n);

    /* CMAC. */
    mech_t cmac = {CKM_AES_CMAC, NULL, 0};
    CHECK(CKR_MECHANISM_INVALID, C_SignInit, h, &ecb, key);
    CHECK(CKR_OK, C_SignInit, h, &cmac, key);
    CHECK(CKR_ARGUMENTS_BAD, C_Sign, h, buf, 16UL, out, NULL);
    CHECK(CKR_OK, C_SignInit, h, &cmac, key);
    n = 4;
    CHECK(CKR_BUFFER_TOO_SMALL, C_Sign, h, buf, 16UL, small, &n);
    expect("CMAC length", n, 16);
    n = 16;
    CHECK(CKR_OK, C_Sign, h, buf, 16UL, out, &n);
    CHECK(CKR_OK, C_VerifyInit, h, &cmac, key);
    CHECK(CKR_SIGNATURE_LEN_RANGE, C_Verify, h, buf, 16UL, out, 15UL);
    CHECK(CKR_OK, C_VerifyInit, h, &cmac, key);
    CHECK(CKR_ARGUMENTS_BAD, C_Verify, h, buf, 16UL, NULL, 16UL);
    CHECK(CKR_OK, C_VerifyInit, h, &cmac, key);
    CHECK(CKR_OK, C_Verify, h, buf, 16UL, out, 16UL);

    /* Keys and random. */
    mech_t gen = {CKM_AES_KEY_GEN, NULL, 0};
    attr_t gt[] = {{CKA_VALUE_LEN, &len32, 8}, {CKA_TOKEN, &fal, 1}};
    attr_t gt24[] = {{CKA_VALUE_LEN, &len24, 8}};
    UL gk = 0;
    CHECK(CKR_ARGUMENTS_BAD, C_GenerateKey, h, NULL, gt, 2UL, &gk);
    CHECK(CKR_MECHANISM_INVALID, C_GenerateKey, h, &ecb, gt, 2UL, &gk);
    CHECK(CKR_ARGUMENTS_BAD, C_GenerateKey, h, &gen, gt, 2UL, NULL);
    CHECK(CKR_TEMPLATE_INCOMPLETE, C_GenerateKey, h, &gen, NULL, 0UL, &gk);
    CHECK(CKR_ATTRIBUTE_VALUE_INVALID, C_GenerateKey, h, &gen, gt24, 1UL, &gk);
    CHECK(CKR_OK, C_GenerateKey, h, &gen, gt, 2UL, &gk);
    CHECK(CKR_ARGUMENTS_BAD, C_GenerateRandom, h, NULL, 16UL);
    CHECK(CKR_OK, C_GenerateRandom, h, NULL, 0UL);
    CHECK(CKR_OK, C_GenerateRandom, h, out, 64UL);
    CHECK(CKR_OBJECT_HANDLE_INVALID, C_DestroyObject, h, 0xdeadUL);
    CHECK(CKR_OK, C_DestroyObject, h, gk);
    CHECK(CKR_OBJECT_HANDLE_INVALID, C_DestroyObject, h, gk);
    /* Digests (issue 36): in the module; MD5 refused; an AES key is not
     * digested (the vault keeps its schedule, not its bytes). */
    mech_t md5 = {CKM_MD5, NULL, 0};
    CHECK(CKR_ARGUMENTS_BAD, C_DigestInit, h, NULL);
    CHECK(CKR_MECHANISM_INVALID, C_DigestInit, h, &md5);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_DigestUpdate, h, buf, 16UL);
    CHECK(CKR_OK, C_DigestInit, h, &sha);
    CHECK(CKR_OPERATION_ACTIVE, C_DigestInit, h, &sha);
    n = 4;
    CHECK(CKR_BUFFER_TOO_SMALL, C_Digest, h, buf, 16UL, small, &n);
    expect("SHA-256 length", n, 32);
    CHECK(CKR_OK, C_Digest, h, buf, 16UL, NULL, &n);
    expect("SHA-256 length query", n, 32);
    CHECK(CKR_OK, C_Digest, h, buf, 16UL, out, &n);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_DigestFinal, h, out, &n);
    CHECK(CKR_OK, C_DigestInit, h, &sha);
    CHECK(CKR_ARGUMENTS_BAD, C_DigestUpdate, h, NULL, 16UL);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_DigestFinal, h, out, &n);
    CHECK(CKR_OK, C_DigestInit, h, &sha);
    CHECK(CKR_KEY_HANDLE_INVALID, C_DigestKey, h, 0xdeadUL);
    CHECK(CKR_KEY_INDIGESTIBLE, C_DigestKey, h, key);
    CHECK(CKR_OPERATION_NOT_INITIALIZED, C_DigestFinal, h, out, &n);
    CHECK(CKR_ARGUMENTS_BAD, C_SeedRandom, h, NULL, 1UL);
    CHECK(CKR_FUNCTION_NOT_SUPPORTED, C_WrapKey, h, &ecb, key, key, out, &n);
    CHECK(CKR_ARGUMENTS_BAD, C_GenerateKeyPair, h, &gen, NULL, 0UL, NULL, 0UL, NULL, NULL);
    CHECK(CKR_ARGUMENTS_BAD, C_GenerateKeyPair, h, NULL, NULL, 0UL, NULL, 0UL, &gk, &gk);
    CHECK(CKR_MECHANISM_INVALID, C_GenerateKeyPair, h, &gen, NULL, 0UL, NULL, 0UL, &gk, &gk);
    CHECK(CKR_ARGUMENTS_BAD, C_DeriveKey, h, NULL, key, NULL, 0UL, &gk);
    CHECK(CKR_MECHANISM_INVALID, C_DeriveKey, h, &gen, key, NULL, 0UL, &gk);

    /* fork: the child is not initialised until it calls C_Initialize, and
     * whatever it does leaves the parent's session and keys alone. */
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        failures = 0;
        UL ch = 0;
        CHECK(CKR_CRYPTOKI_NOT_INITIALIZED, C_GetInfo, buf);
        CHECK(CKR_CRYPTOKI_NOT_INITIALIZED, C_GenerateRandom, h, out, 16UL);
        CHECK(CKR_CRYPTOKI_NOT_INITIALIZED, C_Finalize, NULL);
        CHECK(CKR_OK, C_Initialize, NULL);
        CHECK(CKR_SESSION_HANDLE_INVALID, C_GetSessionInfo, h, buf);
        CHECK(CKR_OK, C_OpenSession, 0UL, CKF_SERIAL_SESSION, NULL, NULL, &ch);
        CHECK(CKR_OK, C_GenerateRandom, ch, out, 16UL);
        CHECK(CKR_OK, C_Finalize, NULL);
        fflush(stdout);
        _exit(failures ? 1 : 0);
    }
    int st = 0;
    waitpid(child, &st, 0);
    expect("forked child's checks (exit status)", (UL)st, 0);
    CHECK(CKR_OK, C_GetAttributeValue, h, key, &lab_len, 1UL);
    CHECK(CKR_OK, C_SignInit, h, &cmac, key);
    n = 16;
    CHECK(CKR_OK, C_Sign, h, buf, 16UL, out, &n);

    /* A closed session: every session entry point, with NULL everywhere. */
    CHECK(CKR_OK, C_CloseSession, h);
    CHECK(CKR_SESSION_HANDLE_INVALID, C_CloseSession, h);
    for (int i = 0; session_fns[i]; i++) expect(session_fns[i], f(session_fns[i])(h, 0, 0, 0, 0, 0, 0, 0), CKR_SESSION_HANDLE_INVALID);
    /* The session object went with its session. */
    CHECK(CKR_OBJECT_HANDLE_INVALID, C_GetAttributeValue, h2, key, &lab_len, 1UL);

    CHECK(CKR_ARGUMENTS_BAD, C_Finalize, (void *)1);
    CHECK(CKR_OK, C_Finalize, NULL);
    CHECK(CKR_CRYPTOKI_NOT_INITIALIZED, C_GetInfo, buf);
    CHECK(CKR_CRYPTOKI_NOT_INITIALIZED, C_Finalize, NULL);

    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}

"""Every mechanism of libmemveil_pkcs11.so through python-pkcs11, against
NIST vectors (CAVP ECB/CBC/GCM files, RFC 3686 CTR, SP 800-38B CMAC), with
imported keys, single-part and multi-part, from 8 threads at once (one
session each). Prints counts per mechanism; exits 1 on any mismatch.

Usage: nist_threads.py MODULE CIPHER_VECTOR_DIR CMAC_FILE [STRIDE]
(STRIDE > 1 takes every STRIDE-th case of the large files.)"""

import os
import sys
import threading
from collections import Counter

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11.exceptions import EncryptedDataInvalid, SignatureInvalid
from pkcs11.mechanisms import CTRParams, GCMParams

THREADS = 8


def rsp(path):
    """Cases of a CAVP .rsp / RFC 3686 .txt file: dicts with 'dir', 'fail', 'sect'."""
    cases, cur, direction, sect = [], {}, "ENCRYPT", {}
    for line in open(path, encoding="ascii"):
        line = line.strip()
        if not line or line.startswith("#"):
            if cur:
                cases.append(cur)
                cur = {}
            continue
        if line.startswith("["):
            body = line.strip("[]")
            if body in ("ENCRYPT", "DECRYPT"):
                direction = body
            elif "=" in body:
                k, v = (x.strip() for x in body.split("=", 1))
                sect = dict(sect, **{k.upper(): v})
            continue
        if line == "FAIL":
            cur["fail"] = True
            continue
        if "=" in line:
            k, v = (x.strip() for x in line.split("=", 1))
            if not cur:
                cur = {"dir": direction, "fail": False, "sect": dict(sect)}
            cur[k.upper()] = v
    if cur:
        cases.append(cur)
    return cases


def h(case, k):
    return bytes.fromhex(case.get(k, ""))


def chunks(b, n=7):
    return [b[i:i + n] for i in range(0, len(b), n)] or [b""]


def joined(gen):
    return b"".join(gen)


def jobs(vdir, cmac_file, stride):
    out = []
    for bits in (128, 256):
        for mode in ("ECB", "CBC"):
            for kind in ("GFSbox", "KeySbox", "MMT"):
                for c in rsp(f"{vdir}/{mode}{kind}{bits}.rsp"):
                    out.append((mode, c))
                    if mode == "CBC" and kind == "MMT":
                        out.append(("CBC_PAD", c))
        for c in rsp(f"{vdir}/aes-{bits}-ctr.txt"):
            out.append(("CTR", c))
        for i, c in enumerate(rsp(f"{vdir}/gcmEncryptExtIV{bits}.rsp")):
            if i % stride == 0 and len(h(c, "IV")) == 12:
                out.append(("GCM", c))
        for i, c in enumerate(rsp(f"{vdir}/gcmDecrypt{bits}.rsp")):
            if i % stride == 0 and len(h(c, "IV")) == 12 and len(h(c, "TAG")) == 16:
                out.append(("GCM", dict(c, dir="DECRYPT")))
    for line in open(cmac_file, encoding="ascii"):
        line = line.strip()
        if line and not line.startswith("#"):
            k, m, t = line.split(":")
            out.append(("CMAC", {"KEY": k, "MSG": m, "MAC": t, "dir": "SIGN", "fail": False}))
    return out


def run(session, mode, c):
    """Runs one case single-part and multi-part; returns a list of errors."""
    key = session.create_object({
        Attribute.CLASS: ObjectClass.SECRET_KEY,
        Attribute.KEY_TYPE: KeyType.AES,
        Attribute.VALUE: h(c, "KEY"),
        Attribute.TOKEN: False,
    })
    errs = []
    try:
        if mode == "CMAC":
            msg, mac = h(c, "MSG"), h(c, "MAC")
            for how, got in (("single", key.sign(msg, mechanism=Mechanism.AES_CMAC)),
                             ("multi", key.sign(chunks(msg), mechanism=Mechanism.AES_CMAC))):
                if got != mac:
                    errs.append(f"CMAC {how}")
            if not key.verify(msg, mac, mechanism=Mechanism.AES_CMAC):
                errs.append("CMAC verify")
            if key.verify(msg, bytes([mac[0] ^ 1]) + mac[1:], mechanism=Mechanism.AES_CMAC):
                errs.append("CMAC verify accepted a wrong tag")
            return errs
        if mode == "GCM":
            iv, aad, tag = h(c, "IV"), h(c, "AAD"), h(c, "TAG")
            ct, pt = h(c, "CT"), h(c, "PT")
            prm = GCMParams(iv, aad or None, 128)
            if c["dir"] == "ENCRYPT":
                for how, got in (("single", key.encrypt(pt, mechanism=Mechanism.AES_GCM, mechanism_param=prm)),
                                 ("multi", joined(key.encrypt(chunks(pt), mechanism=Mechanism.AES_GCM, mechanism_param=prm)))):
                    if got[:len(ct)] != ct or got[len(ct):len(ct) + len(tag)] != tag:
                        errs.append(f"GCM enc {how} {c.get('COUNT')}")
                return errs
            for how in ("single", "multi"):
                try:
                    if how == "single":
                        got = key.decrypt(ct + tag, mechanism=Mechanism.AES_GCM, mechanism_param=prm)
                    else:
                        got = joined(key.decrypt(chunks(ct + tag), mechanism=Mechanism.AES_GCM, mechanism_param=prm))
                    if c["fail"]:
                        errs.append(f"GCM {how}: FAIL case accepted {c.get('COUNT')}")
                    elif got != pt:
                        errs.append(f"GCM dec {how} {c.get('COUNT')}")
                except EncryptedDataInvalid:
                    if c["fail"]:
                        errs.append("rejected")
                    else:
                        errs.append(f"GCM {how}: valid tag refused {c.get('COUNT')}")
            return errs
        pt, ct = h(c, "PLAINTEXT"), h(c, "CIPHERTEXT")
        mech, prm = {
            "ECB": (Mechanism.AES_ECB, None),
            "CBC": (Mechanism.AES_CBC, h(c, "IV")),
            "CBC_PAD": (Mechanism.AES_CBC_PAD, h(c, "IV")),
            "CTR": (Mechanism.AES_CTR, CTRParams(h(c, "IV")[:12]) if mode == "CTR" else None),
        }[mode]
        if mode == "CTR" and h(c, "IV")[12:] != b"\x00\x00\x00\x01":
            return [f"CTR vector with a counter python-pkcs11 cannot express {c.get('COUNT')}"]
        enc = lambda d: key.encrypt(d, mechanism=mech, mechanism_param=prm)
        dec = lambda d: key.decrypt(d, mechanism=mech, mechanism_param=prm)
        encm = lambda d: joined(key.encrypt(chunks(d), mechanism=mech, mechanism_param=prm))
        decm = lambda d: joined(key.decrypt(chunks(d), mechanism=mech, mechanism_param=prm))
        if mode == "CBC_PAD":
            # CBC_PAD(P) = CBC(P) || CBC of the padding block.
            for how, got in (("single", enc(pt)), ("multi", encm(pt))):
                if got[:len(ct)] != ct or len(got) != len(pt) + 16 or dec(got) != pt or decm(got) != pt:
                    errs.append(f"CBC_PAD {how} {c.get('COUNT')}")
            return errs
        if c["dir"] == "ENCRYPT":
            for how, f in (("single", enc), ("multi", encm)):
                if f(pt) != ct:
                    errs.append(f"{mode} enc {how} {c.get('COUNT')}")
        else:
            for how, f in (("single", dec), ("multi", decm)):
                if f(ct) != pt:
                    errs.append(f"{mode} dec {how} {c.get('COUNT')}")
        return errs
    finally:
        key.destroy()


def main():
    module, vdir, cmac_file = sys.argv[1:4]
    stride = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    lib = pkcs11.lib(module)
    token = lib.get_token(token_label="memveil vault")
    work = jobs(vdir, cmac_file, stride)
    counts, errors, lock = Counter(), [], threading.Lock()
    started = Counter()

    def worker(n):
        with token.open(rw=True) as s:
            for mode, c in work[n::THREADS]:
                try:
                    e = run(s, mode, c)
                except Exception as x:  # noqa: BLE001 - reported as a failure
                    e = [f"{mode} {c.get('COUNT')}: {type(x).__name__}: {x}"]
                with lock:
                    counts[mode] += 1
                    started[n] += 1
                    counts["rejected"] += e.count("rejected")
                    errors.extend(x for x in e if x != "rejected")

    ts = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    busy = sum(1 for n in range(THREADS) if started[n] > 0)
    print(f"threads {busy} of {THREADS} ran cases")
    for mode in ("ECB", "CBC", "CBC_PAD", "CTR", "GCM", "CMAC"):
        print(f"{mode} {counts[mode]}")
    print(f"GCM FAIL cases rejected {counts['rejected']}")
    for e in errors[:20]:
        print("ERROR", e)
    print(f"errors {len(errors)}")
    sys.exit(1 if errors or busy != THREADS or min(counts[m] for m in ("ECB", "CBC", "CBC_PAD", "CTR", "GCM", "CMAC")) == 0 else 0)


if __name__ == "__main__":
    main()

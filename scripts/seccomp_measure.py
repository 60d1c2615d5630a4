#!/usr/bin/env python3
"""Measures what the memveil daemons call outside their seccomp allowlists.

Run as root while a test suite runs with MEMVEIL_SECCOMP=measure (each
daemon installs only memveil_sys::seccomp::BASE, in SECCOMP_RET_LOG mode) or
MEMVEIL_SECCOMP=log (its whole list, in log mode):

    python3 scripts/seccomp_measure.py OUT.txt &
    MEMVEIL_SECCOMP=measure cargo test --release -p memveil --test key_cli
    kill %1; sort -u OUT.txt

It reads the kernel's audit multicast group (NETLINK_AUDIT, group
AUDIT_NLGRP_READLOG: no auditd needed, not rate-limited like the printk
fallback) and writes one line per daemon and system call seen:
`<daemon> <syscall number> <name>`. The daemon is told from the calling
process's command line (vault, agent, rng serve, disk serve, probe --serve).
"""
import re
import socket
import struct
import sys

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_SECCOMP = 1326


def syscall_names():
    """Numbers to names from the kernel headers of this machine."""
    names = {}
    for path in ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
                 "/usr/include/asm/unistd_64.h",
                 "/usr/include/asm-generic/unistd.h"):
        try:
            for line in open(path):
                m = re.match(r"#define __NR_(\w+)\s+(\d+)", line)
                if m:
                    names.setdefault(int(m.group(2)), m.group(1))
        except OSError:
            pass
    return names


def daemon_of(pid, cache):
    if pid in cache:
        return cache[pid]
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        argv = [a.decode(errors="replace") for a in argv if a]
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        env = dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)
    except OSError:
        return "?"
    kind = "?"
    name = argv[0].rsplit("/", 1)[-1] if argv else ""
    verb = argv[1:3]
    if name == "memveil-vault" or verb == ["vault", "serve"]:
        kind = "vault"
    elif verb[:1] == ["agent"]:
        kind = "agent"
    elif verb in (["rng", "serve"], ["disk", "serve"]):
        kind = verb[0]
    elif verb[:1] == ["probe"] and "--serve" in argv:
        kind = "probe"
    else:
        # A test binary's child running a daemon in-process (crates/disk's
        # tests run the vault so): its role is in the environment.
        for v in env.values():
            if v in ("vault", "disk", "agent", "rng", "probe"):
                kind = v
                break
    cache[pid] = kind
    return kind


def main():
    out = open(sys.argv[1], "a", buffering=1)
    names = syscall_names()
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
    s.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    seen, cache = set(), {}
    while True:
        data = s.recv(1 << 16)
        off = 0
        while off + 16 <= len(data):
            ln, ty = struct.unpack_from("=IH", data, off)
            body = data[off + 16:off + ln].decode(errors="replace")
            off += (ln + 3) & ~3
            if ln == 0:
                break
            if ty != AUDIT_SECCOMP:
                continue
            pid = re.search(r"\bpid=(\d+)", body)
            nr = re.search(r"\bsyscall=(\d+)", body)
            if not (pid and nr):
                continue
            key = (daemon_of(int(pid.group(1)), cache), int(nr.group(1)))
            if key not in seen:
                seen.add(key)
                out.write(f"{key[0]} {key[1]} {names.get(key[1], '?')}\n")


if __name__ == "__main__":
    main()

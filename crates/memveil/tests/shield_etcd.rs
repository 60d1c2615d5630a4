// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! etcd (Debian's etcd-server, a Go program) under `memveil run` (issue 34):
//! etcdctl's put, get and txn answer as they do plainly, the copies of a
//! secret value in the server's anonymous memory are ciphertext after 54 s
//! of idleness, but for a page etcd brings back now and then (the same
//! scans find them all in the plain server, idle beside it on the same
//! schedule: the positive control), and the server stops cleanly on SIGTERM
//! with its data intact on disk.
//!
//! The database file etcd maps (bbolt's `member/snap/db`) is the data on
//! disk, shared with the page cache: it is not anonymous memory and not
//! the shield's to protect (memveil disk is), so the scan leaves file
//! mappings out on both sides.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use memveil_bench::shield::etcd::{clean_stop, Server};
use memveil_testkit::{skip, Need};

const MEMVEIL: &str = env!("CARGO_BIN_EXE_memveil");

fn which(prog: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// A directory removed with everything in it when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn random_hex() -> String {
    let mut b = [0u8; 24];
    File::open("/dev/urandom")
        .and_then(|f| f.read_exact_at(&mut b, 0))
        .expect("read /dev/urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs etcdctl against the server; its trimmed standard output.
fn etcdctl(port: u16, args: &[&str], stdin: Option<&str>) -> String {
    use std::io::Write as _;
    let mut c = Command::new("etcdctl");
    c.env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("etcdctl");
    if let Some(s) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(s.as_bytes())
            .expect("etcdctl stdin");
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().expect("etcdctl");
    assert!(
        out.status.success(),
        "etcdctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The process running etcd: `pid` itself (plain) or the child of `memveil
/// run` that does (the program itself or the shield's loader running it).
fn etcd_pid(pid: u32, protected: bool) -> u32 {
    if !protected {
        return pid;
    }
    let kids =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    kids.split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| {
                e.file_name()
                    .is_some_and(|n| n == "etcd" || n == "memveil-shield-loader")
            })
        })
        .expect("etcd's process under memveil run")
}

/// Occurrences of `needle` in the anonymous (not file-backed) readable
/// mappings of `pid`, in the pages present in memory (`/proc/PID/pagemap`:
/// an evicted page is not, and reads as an error from another process; a
/// page never touched holds nothing), and how many pages were read. Reading
/// every page of the shield's region instead (16 GiB, mostly untouched)
/// took 12-25 s a sample.
fn anonymous_hits(pid: u32, needle: &[u8]) -> (usize, u64) {
    const PAGE: u64 = 4096;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mem = File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem");
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).expect("/proc/PID/pagemap");
    let (mut hits, mut pages) = (0, 0u64);
    let mut entries = vec![0u8; 8 << 16];
    let mut page = vec![0u8; 4096];
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let anonymous = f.len() < 6 || f[5] == "[heap]" || f[5] == "[stack]";
        if f.len() < 2 || !f[1].starts_with('r') || !anonymous {
            continue;
        }
        let Some((a, b)) = f[0].split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let mut at = a;
        while at < b {
            let n = ((b - at) / PAGE).min(1 << 16);
            let raw = &mut entries[..usize::try_from(n * 8).expect("entries")];
            if pagemap.read_exact_at(raw, at / PAGE * 8).is_err() {
                at += n * PAGE;
                continue;
            }
            for (k, e) in raw.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                let p = at + k as u64 * PAGE;
                if e >> 63 == 0 || mem.read_exact_at(&mut page, p).is_err() {
                    continue;
                }
                pages += 1;
                for h in memchr::memmem::find_iter(&page, needle) {
                    eprintln!("hit at {:#x} in {line}", p + h as u64);
                    hits += 1;
                }
            }
            at += n * PAGE;
        }
    }
    (hits, pages)
}

/// Seconds of idleness after which an idle server's heap is all
/// ciphertext. A page etcd used hard during the workload sits at one of
/// the longest sweep periods (6.4 s, 12.8 s), where a due page may wait
/// for its block's probe (at most 12.8 s: `sweep::probe_out_ms`) and, at
/// the top, once for a closed level (`sweep::pass_over_to`): the longest
/// chain ends four top periods after it last came in (51.2 s); and 3 s for
/// the sweep. Seen: the last copies gone at 42-44 s.
const IDLE_BOUND_S: u64 = 54;
/// When the samples that must find no copy are taken (s of idleness).
const AFTER_S: [u64; 5] = [
    IDLE_BOUND_S,
    IDLE_BOUND_S + 3,
    IDLE_BOUND_S + 6,
    IDLE_BOUND_S + 9,
    IDLE_BOUND_S + 12,
];

/// One server after its workload, idle from `idle` on.
struct Idle {
    tag: &'static str,
    server: Server,
    data: PathBuf,
    secret: String,
    pid: u32,
    idle: std::time::Instant,
}

/// Starts one server and runs the workload on it: the secret put and read
/// back, 50 other keys, a txn.
fn start_and_load(dir: &Path, protected: bool) -> Idle {
    let tag = if protected { "protected" } else { "plain" };
    let data = dir.join(format!("data-{tag}"));
    let log = dir.join(format!("etcd-{tag}.log"));
    // Alone on a host of its own (a private ledger of the host's budget):
    // the property is a lone server's at the defaults, whatever else of
    // this machine draws on its shield.
    let host = format!("MEMVEIL_SHIELD_DIR={}", dir.join("host").display());
    let args = ["env", host.as_str(), MEMVEIL, "run", "--quiet", "--"];
    let wrap: Vec<&std::ffi::OsStr> = if protected {
        args.iter().map(std::ffi::OsStr::new).collect()
    } else {
        Vec::new()
    };
    let server = Server::start(&wrap, &data, &log).unwrap_or_else(|e| panic!("{tag}: {e}"));
    let port = server.port;
    let secret = random_hex();
    assert_eq!(etcdctl(port, &["put", "secret/key", &secret], None), "OK");
    assert_eq!(
        etcdctl(port, &["get", "secret/key", "--print-value-only"], None),
        secret,
        "{tag}: get"
    );
    for i in 0..50 {
        assert_eq!(
            etcdctl(
                port,
                &["put", &format!("other/{i:02}"), &format!("v{i}")],
                None
            ),
            "OK"
        );
    }
    assert_eq!(
        etcdctl(port, &["get", "other/", "--prefix", "--keys-only"], None)
            .lines()
            .filter(|l| !l.is_empty())
            .count(),
        50,
        "{tag}: the keys under other/"
    );
    let txn = "value(\"other/07\") = \"v7\"\n\nput other/flag yes\n\nput other/flag no\n\n";
    let answer = etcdctl(port, &["txn"], Some(txn));
    assert!(answer.starts_with("SUCCESS"), "{tag}: txn said {answer:?}");
    assert_eq!(
        etcdctl(port, &["get", "other/flag", "--print-value-only"], None),
        "yes",
        "{tag}: the txn's branch"
    );
    let pid = etcd_pid(server.pid(), protected);
    Idle {
        tag,
        server,
        data,
        secret,
        pid,
        idle: std::time::Instant::now(),
    }
}

impl Idle {
    /// The scans of the idle server on the schedule (s of its own
    /// idleness): every page of the heap is ciphertext within IDLE_BOUND
    /// (see there); the samples before it show how the copies go. The
    /// secret's hits in anonymous memory in each sample of [`AFTER_S`].
    fn samples(&self) -> Vec<usize> {
        let mut after = Vec::new();
        for at in [8, 20, 34, 44].into_iter().chain(AFTER_S) {
            let wait = Duration::from_secs(at).saturating_sub(self.idle.elapsed());
            std::thread::sleep(wait);
            let (h, pages) = anonymous_hits(self.pid, self.secret.as_bytes());
            eprintln!(
                "{}: idle {:.1} s: {h} hit(s) of the secret in {pages} readable anonymous pages",
                self.tag,
                self.idle.elapsed().as_secs_f64()
            );
            if AFTER_S.contains(&at) {
                after.push(h);
            }
        }
        after
    }

    /// Stops the server and reads the data back through a plain one.
    fn stop_and_read_back(self, dir: &Path) {
        let tag = self.tag;
        let st = self.server.stop();
        assert!(
            st.is_some_and(clean_stop),
            "{tag}: etcd did not stop cleanly on SIGTERM ({st:?})"
        );
        // The data on disk, read back by a plain server.
        let again = Server::start(&[], &self.data, &dir.join(format!("etcd-{tag}-again.log")))
            .unwrap_or_else(|e| panic!("{tag}: restarting on its data: {e}"));
        assert_eq!(
            etcdctl(
                again.port,
                &["get", "secret/key", "--print-value-only"],
                None
            ),
            self.secret,
            "{tag}: the value on disk after the stop"
        );
        assert_eq!(
            etcdctl(
                again.port,
                &["get", "other/flag", "--print-value-only"],
                None
            ),
            "yes"
        );
    }
}

#[test]
fn etcd_answers_as_plainly_keeps_a_secret_value_out_of_its_heap_and_stops_cleanly() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            Need::Root,
            "memveil run needs userfaultfd for kernel-side faults",
        );
        return;
    }
    for tool in ["etcd", "etcdctl"] {
        if which(tool).is_none() {
            skip(
                Need::Installed(if tool == "etcd" { "etcd-server" } else { "etcd-client" }),
                format!("{tool} not found (scripts/install.sh --deps installs etcd-server and etcd-client)"),
            );
            return;
        }
    }
    let dir = TempDir(std::env::temp_dir().join(format!("memveil-etcd-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    // The two servers idle side by side (66 s each, which one after the
    // other made this the longest test binary): the plain one's workload
    // first, then the protected one's, so nothing but the plain server's
    // scans (a few hundred pages each, moments) runs beside the protected
    // server's idle; both stop and are read back after the last sample.
    // Each server's samples are on its own idle clock, as before.
    let plain = start_and_load(&dir.0, false);
    let protected = start_and_load(&dir.0, true);
    let (plain_after, protected_after) = std::thread::scope(|s| {
        let p = s.spawn(|| plain.samples());
        let q = protected.samples();
        (p.join().expect("the plain server's samples"), q)
    });
    plain.stop_and_read_back(&dir.0);
    protected.stop_and_read_back(&dir.0);
    let (plain, protected) = (plain_after, protected_after);
    assert!(
        plain.iter().all(|&h| h > 0),
        "positive control failed: the plain etcd's anonymous memory does not hold the secret value \
         after {IDLE_BOUND_S} s idle ({plain:?} copies), so the protected scan would prove nothing"
    );
    // Every page at rest is ciphertext by then, the ones etcd used hard
    // during its workload too: a sample finds none. Before, two pages of
    // Go's small-object spans holding the put request and its raft entries
    // stayed plaintext about 60 s into the idle: at the longest period they
    // waited four such periods for their block's probe, and a closed top
    // level passed them over 7 times in 8. Not yet every sample: etcd,
    // idle, still brings back now and then a page holding a copy (seen: one
    // page at 34 s and again at 57-60 s of idleness, plaintext 3 s or
    // more each time; docs/shield.md), so a sample may find that one.
    assert!(
        protected.contains(&0) && protected.iter().all(|&h| h <= 2),
        "the protected etcd's anonymous memory holds {protected:?} copies of the secret value \
         after {IDLE_BOUND_S} s idle (the plain server's: {plain:?}): its heap was not swept"
    );
}

// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! `memveil run` on real, unmodified programs (issue 5, "Proof"):
//!
//! - correctness: python3 running a real workload, sqlite3 on a real database
//!   and redis-server under redis-benchmark give the same output (and exit
//!   status) with and without `memveil run`, with windows small enough that
//!   pages are evicted and faulted back all the time (checked in the
//!   `--stats-json` figures);
//! - protection, with a positive control: a secret set through redis-cli is
//!   found in a `gcore` dump of a plain redis-server, and not found in the
//!   protected one once it left the window; the protected dump is shown not
//!   to be empty (a marker set just before the dump is found in it); no AES
//!   key schedule is found in the protected server's memory or dump, while
//!   one stored as a value is found in the plain server's;
//! - refusal: an unprivileged user is refused, naming
//!   `vm.unprivileged_userfaultfd`, and the program is not run.
//!
//! Every test that needs a tool this host lacks says so and what to install
//! (scripts/packages.txt installs them all, as CI does). Daemons run in their
//! own process group and are killed when the test ends, passed or not.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::FileExt as _;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use memveil_testkit::{skip, Need};

mod common;

use common::{root, which, TempDir};

const MEMVEIL: &str = env!("CARGO_BIN_EXE_memveil");
const WORKLOAD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/shield_workload.py");
const PRELOAD: &str = "libmemveil_shield_preload.so";

// ---------------------------------------------------------------- helpers --

/// Whether every tool is present; prints what is missing (and why the test
/// is skipped) otherwise.
fn have(test: &str, tools: &[&'static str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| which(t).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    skip(
        Need::Installed(missing[0]),
        format!(
            "{test}: {} not installed (scripts/install.sh --deps installs them from scripts/packages.txt)",
            missing.join(", ")
        ),
    );
    false
}

/// The preload library must sit next to the memveil binary under test.
fn preload_built() {
    let dir = Path::new(MEMVEIL).parent().expect("binary directory");
    assert!(
        dir.join(PRELOAD).is_file(),
        "{PRELOAD} is not next to {MEMVEIL}: build it with `cargo build --release -p memveil-shield-preload` \
         (with the same CARGO_TARGET_DIR), or run the tests with --workspace"
    );
}

/// python3 from Debian when present (a pyenv or other shim on PATH would run
/// shell scripts under the shield as well, and take much longer).
fn python3() -> PathBuf {
    which("/usr/bin/python3")
        .or_else(|| which("python3"))
        .expect("python3")
}

fn send_group_signal(pgid: u32, sig: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    // SAFETY: kill(2) takes no pointers; a negative pid names the process
    // group that `spawn_group` created with this leader, which has not been
    // reaped yet (callers only signal before `wait` succeeded), so the id
    // cannot have been reused.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Starts `cmd` as the leader of a new process group, so that the whole
/// group (memveil run and the program under it) can be killed at once.
fn spawn_group(cmd: &mut Command) -> Child {
    cmd.process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"))
}

/// Waits for `child` at most `limit`; kills its process group and returns
/// None on timeout.
fn wait_for(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return Some(st);
        }
        if start.elapsed() > limit {
            send_group_signal(child.id(), libc::SIGKILL);
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `cmd` with `input` on stdin, collecting its output; kills it (and
/// its process group) after `limit`.
fn run(cmd: &mut Command, input: &[u8], limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = spawn_group(
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let ereader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = wait_for(&mut child, limit);
    let _ = writer.join();
    let stdout = reader.join().unwrap_or_default();
    let stderr = ereader.join().unwrap_or_default();
    let Some(status) = status else {
        panic!(
            "{what} did not finish within {limit:?}; stderr:\n{}",
            String::from_utf8_lossy(&stderr)
        );
    };
    Output {
        status,
        stdout,
        stderr,
    }
}

/// The exit status the way `memveil run` passes it on: the code, or 128+N
/// for death by signal N.
fn code(st: ExitStatus) -> i32 {
    st.code()
        .or_else(|| st.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `memveil run --quiet --stats-json STATS --window W [extra] -- prog...`.
fn shielded(window: u32, stats: &Path, extra: &[&str], prog: &Path) -> Command {
    let mut c = Command::new(MEMVEIL);
    c.args(["run", "--quiet", "--window", &window.to_string()])
        .arg("--stats-json")
        .arg(stats)
        .args(extra)
        .arg("--")
        .arg(prog);
    c
}

/// The `--stats-json` figures of a finished run; asserts that the program
/// really ran protected and that the window forced evictions.
fn assert_protected(stats: &Path, what: &str) -> serde_json::Value {
    let s = std::fs::read_to_string(stats)
        .unwrap_or_else(|e| panic!("{what}: no --stats-json at {}: {e}", stats.display()));
    let j: serde_json::Value = serde_json::from_str(&s).expect("stats JSON");
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    assert!(
        n("processes") >= 1,
        "{what}: no process reported statistics (preload not loaded): {s}"
    );
    assert!(
        n("pages_protected") > 0 && n("faults") > 0 && n("evictions") > 0,
        "{what}: the window forced no evictions, the run proves nothing: {s}"
    );
    eprintln!(
        "{what}: faults {}, evictions {}, plaintext fraction {:.3}, max resident {}",
        n("faults"),
        n("evictions"),
        j["plaintext_fraction"].as_f64().unwrap_or(f64::NAN),
        n("max_resident")
    );
    j
}

/// A deterministic 64-bit generator (PCG's LCG step), for test data.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// 48 random hex characters from the kernel's generator.
fn random_secret() -> String {
    let mut b = [0u8; 24];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("read /dev/urandom");
    hex(&b)
}

/// Compiles `tests/data/NAME.c` (with `extra` arguments after the source)
/// into `dir`; the executable's path.
/// The prologue of a test that runs a C program of `tests/data` under
/// `memveil run`: the compiler and root present (else it prints why it
/// skips), the preload built, the program compiled into a fresh directory.
fn c_test(test: &str, name: &str, extra: &[&str]) -> Option<(TempDir, PathBuf)> {
    if !have(test, &["cc"]) || !root(test) {
        return None;
    }
    preload_built();
    let dir = TempDir::new(test);
    let exe = compile_c(&dir, name, extra);
    Some((dir, exe))
}

fn compile_c(dir: &TempDir, name: &str, extra: &[&str]) -> PathBuf {
    let exe = dir.path(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/{name}.c"));
    let o = run(
        Command::new("cc")
            .args(["-O1", "-o"])
            .arg(&exe)
            .arg(src)
            .args(extra),
        b"",
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "cc {name}.c: {}", text(&o.stderr));
    exe
}

// -------------------------------------------------------- a: python3 -----

#[test]
fn python3_workload_same_output_and_exit_status() {
    if !have("python3_workload", &["python3"]) || !root("python3_workload") {
        return;
    }
    preload_built();
    let py = python3();
    let dir = TempDir::new("py");
    let limit = Duration::from_secs(120);
    let args = [WORKLOAD, "6000", "48"];

    let plain = run(Command::new(&py).args(args), b"", limit);
    assert!(
        plain.status.success(),
        "plain python3 failed: {}",
        text(&plain.stderr)
    );
    let stats = dir.path("py.json");
    let prot = run(shielded(256, &stats, &[], &py).args(args), b"", limit);
    assert_eq!(
        code(prot.status),
        0,
        "python3 under memveil run failed: {}",
        text(&prot.stderr)
    );
    assert_eq!(
        text(&prot.stdout),
        text(&plain.stdout),
        "python3 output differs under memveil run"
    );
    assert!(
        text(&plain.stdout).lines().count() >= 11,
        "{}",
        text(&plain.stdout)
    );
    assert_protected(&stats, "python3 workload (window 256)");

    // stdin passes through, byte for byte.
    let mut input = Vec::with_capacity(1 << 20);
    let mut g = Lcg(7);
    while input.len() < 1 << 20 {
        input.extend_from_slice(&g.next().to_le_bytes());
    }
    let digest = "import sys, hashlib; d = sys.stdin.buffer.read(); print(len(d), hashlib.sha256(d).hexdigest())";
    let plain = run(Command::new(&py).args(["-c", digest]), &input, limit);
    let prot = run(
        shielded(64, &dir.path("stdin.json"), &[], &py).args(["-c", digest]),
        &input,
        limit,
    );
    assert!(plain.status.success() && prot.status.success());
    assert_eq!(text(&prot.stdout), text(&plain.stdout));

    // Exit status passes through: a code, and death by a signal (128+N).
    for (prog, want) in [
        ("import sys; sys.exit(7)", 7),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            128 + 9,
        ),
    ] {
        let plain = run(Command::new(&py).args(["-c", prog]), b"", limit);
        assert_eq!(code(plain.status), want, "plain: {prog}");
        let mut c = Command::new(MEMVEIL);
        c.args(["run", "--quiet", "--window", "256", "--"])
            .arg(&py)
            .args(["-c", prog]);
        let prot = run(&mut c, b"", limit);
        assert_eq!(
            code(prot.status),
            want,
            "memveil run did not pass on the status of {prog}: {}",
            text(&prot.stderr)
        );
    }
}

// --------------------------------------------------------- b: sqlite3 -----

/// A database of 3000 customers and 40000 orders, as one SQL script. The
/// page cache is kept small so that sqlite reads pages with read(2) into
/// (protected) buffers all the time.
#[test]
fn window_flags_bound_the_plaintext_and_the_summary_advises() {
    // Flags that contradict each other, or a bound that is no bound, are
    // refused before anything runs.
    let both = run(
        Command::new(MEMVEIL).args([
            "run",
            "--window",
            "64",
            "--max-plaintext",
            "25%",
            "--",
            "true",
        ]),
        b"",
        Duration::from_secs(20),
    );
    assert_eq!(code(both.status), 2, "{}", text(&both.stderr));
    assert_stderr_has(&both, "cannot be used with");
    let zero = run(
        Command::new(MEMVEIL).args(["run", "--max-plaintext", "0%", "--", "true"]),
        b"",
        Duration::from_secs(20),
    );
    assert_eq!(code(zero.status), 2, "{}", text(&zero.stderr));
    assert_stderr_has(&zero, "bad plaintext bound");
    if !have("window_flags", &["python3"]) || !root("window_flags") {
        return;
    }
    preload_built();
    // A bound of 1 MiB (256 pages) over python3's ~10 MB heap: the adaptive
    // window never holds more, however the program faults, and the summary
    // says faults dominated and which setting would help.
    let py = python3();
    let dir = TempDir::new("bound");
    let stats = dir.path("bound.json");
    let limit = Duration::from_secs(120);
    let args = [WORKLOAD, "6000", "48"];
    let plain = run(Command::new(&py).args(args), b"", limit);
    assert!(
        plain.status.success(),
        "plain python3 failed: {}",
        text(&plain.stderr)
    );
    let mut c = Command::new(MEMVEIL);
    c.args(["run", "--max-plaintext", "1M", "--stats-json"])
        .arg(&stats)
        .arg("--")
        .arg(&py)
        .args(args);
    let prot = run(&mut c, b"", limit);
    assert_eq!(code(prot.status), 0, "{}", text(&prot.stderr));
    assert_eq!(
        text(&prot.stdout),
        text(&plain.stdout),
        "output differs under a 1 MiB bound"
    );
    let j = assert_protected(&stats, "python3, --max-plaintext 1M");
    let n = |k: &str| j[k].as_u64().unwrap_or(u64::MAX);
    assert_eq!(n("adaptive"), 1, "{j}");
    assert_eq!(n("bound"), 256, "{j}");
    assert!(
        n("max_window") <= 256 && n("max_resident") <= 256,
        "the bound was exceeded: {j}"
    );
    let err = text(&prot.stderr);
    assert!(err.contains("(adaptive, at most"), "{err}");
    assert!(
        err.contains("faults took about"),
        "no advice although faults dominated: {err}"
    );
    // The advice comes from the refault ages: every decrypting fault is
    // counted in one bucket, and the line names a measured setting.
    let ages: u64 = j["refault_ages"]
        .as_array()
        .map_or(0, |a| a.iter().filter_map(serde_json::Value::as_u64).sum());
    assert_eq!(ages, n("faults_in"), "refault ages do not add up: {j}");
    assert!(n("max_data") > 256, "{j}");
    assert!(
        (err.contains("--max-plaintext ") && err.contains("of the pages that came back"))
            || err.contains("only a window holding all of it")
            || err.contains("first touches of fresh memory"),
        "the advice names no measured setting: {err}"
    );
    assert!(!err.contains("--cpu N"), "{err}");
}

fn sqlite_create_script() -> String {
    let mut g = Lcg(12345);
    let mut s = String::from(
        "PRAGMA cache_size=-128;\nPRAGMA journal_mode=OFF;\nBEGIN;\n\
         CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT, city TEXT);\n\
         CREATE TABLE orders(id INTEGER PRIMARY KEY, customer INTEGER, amount INTEGER, note TEXT);\n",
    );
    let customers: Vec<String> = (0..3000)
        .map(|i| format!("({i},'cust{i:05}','city{}')", g.next() % 50))
        .collect();
    for c in customers.chunks(250) {
        s += &format!("INSERT INTO customers VALUES{};\n", c.join(","));
    }
    let orders: Vec<String> = (0..40000)
        .map(|i| {
            let (c, a, n) = (g.next() % 3000, g.next() % 100_000, g.next());
            format!("({i},{c},{a},'note-{n:x}')")
        })
        .collect();
    for c in orders.chunks(250) {
        s += &format!("INSERT INTO orders VALUES{};\n", c.join(","));
    }
    s += "CREATE INDEX orders_customer ON orders(customer);\n\
          CREATE INDEX orders_amount ON orders(amount);\nCOMMIT;\n";
    s
}

const SQLITE_QUERIES: &str = "PRAGMA cache_size=-128;
SELECT count(*), sum(amount), min(amount), max(amount) FROM orders;
SELECT c.city, count(*), sum(o.amount) FROM orders o JOIN customers c ON c.id = o.customer GROUP BY c.city ORDER BY c.city;
SELECT c.name, sum(o.amount) AS t FROM customers c JOIN orders o ON o.customer = c.id GROUP BY c.id ORDER BY t DESC, c.name LIMIT 20;
SELECT count(*), avg(amount) FROM orders WHERE amount BETWEEN 1000 AND 2000;
SELECT customer, group_concat(id) FROM (SELECT * FROM orders WHERE customer < 20 ORDER BY id) GROUP BY customer;
SELECT note FROM orders ORDER BY note LIMIT 5 OFFSET 20000;
SELECT city, count(DISTINCT customer) FROM orders o JOIN customers c ON c.id = o.customer WHERE amount > 90000 GROUP BY city ORDER BY 2 DESC, 1 LIMIT 10;
PRAGMA integrity_check;
.sha3sum
";

#[test]
fn sqlite3_database_same_output() {
    if !have("sqlite3_database", &["sqlite3"]) || !root("sqlite3_database") {
        return;
    }
    preload_built();
    let dir = TempDir::new("sqlite");
    let sqlite = which("sqlite3").expect("sqlite3");
    let limit = Duration::from_secs(120);
    let create = sqlite_create_script();
    let (plain_db, prot_db) = (dir.path("plain.db"), dir.path("prot.db"));

    // The same database built twice: plainly, and under memveil run.
    let o = run(
        Command::new(&sqlite).arg(&plain_db),
        create.as_bytes(),
        limit,
    );
    assert!(o.status.success(), "sqlite3: {}", text(&o.stderr));
    let stats = dir.path("create.json");
    let o = run(
        shielded(128, &stats, &[], &sqlite).arg(&prot_db),
        create.as_bytes(),
        limit,
    );
    assert_eq!(
        code(o.status),
        0,
        "sqlite3 under memveil run: {}",
        text(&o.stderr)
    );
    assert_protected(&stats, "sqlite3 create (window 128)");

    // The same queries on each: same answers, same content hash.
    let plain = run(
        Command::new(&sqlite).arg(&plain_db),
        SQLITE_QUERIES.as_bytes(),
        limit,
    );
    assert!(plain.status.success(), "sqlite3: {}", text(&plain.stderr));
    let stats = dir.path("query.json");
    let prot = run(
        shielded(128, &stats, &[], &sqlite).arg(&prot_db),
        SQLITE_QUERIES.as_bytes(),
        limit,
    );
    assert_eq!(
        code(prot.status),
        0,
        "sqlite3 under memveil run: {}",
        text(&prot.stderr)
    );
    let out = text(&plain.stdout);
    assert!(
        out.starts_with("40000|") && out.contains("\nok\n"),
        "unexpected plain answers:\n{out}"
    );
    assert_eq!(
        text(&prot.stdout),
        out,
        "sqlite3 answers differ under memveil run"
    );
    assert_protected(&stats, "sqlite3 queries (window 128)");
}

// ----------------------------------------------------------- redis -------

/// A redis-server (plain, or under `memveil run`) in its own process group,
/// listening on a free TCP port and a unix socket in a temp dir; killed with
/// its whole group when dropped.
struct Redis {
    child: Option<Child>,
    sock: PathBuf,
    log: PathBuf,
    tag: &'static str,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl Redis {
    /// `shield`: None for a plain server, or the `memveil run` flags.
    fn start(dir: &TempDir, tag: &'static str, shield: Option<&[&str]>) -> Redis {
        let sock = dir.path(&format!("{tag}.sock"));
        let log = dir.path(&format!("{tag}.log"));
        let server = which("redis-server").expect("redis-server");
        let mut cmd = match shield {
            Some(flags) => {
                let mut c = Command::new(MEMVEIL);
                c.arg("run").args(flags).arg("--").arg(server);
                c
            }
            None => Command::new(server),
        };
        cmd.args(["--port", &free_port().to_string(), "--bind", "127.0.0.1"])
            .arg("--unixsocket")
            .arg(&sock)
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
            ])
            .arg(&dir.0)
            .stdin(Stdio::null())
            .stdout(File::create(&log).expect("log"))
            .stderr(File::create(&log).expect("log"));
        let mut r = Redis {
            child: Some(spawn_group(&mut cmd)),
            sock,
            log,
            tag,
        };
        let start = Instant::now();
        loop {
            if r.sock.exists() && r.cli(&["PING"]).trim() == "PONG" {
                return r;
            }
            let exited = r.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none() && start.elapsed() < Duration::from_secs(30),
                "redis-server ({tag}) did not come up ({exited:?}); log:\n{}",
                r.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn cli_cmd(&self) -> Command {
        let mut c = Command::new("redis-cli");
        c.arg("-s").arg(&self.sock);
        c
    }

    /// One redis-cli command; its output (raw, as when not on a terminal).
    fn cli(&self, args: &[&str]) -> String {
        let o = run(self.cli_cmd().args(args), b"", Duration::from_secs(60));
        text(&o.stdout)
    }

    /// A script of commands, one a line, through one redis-cli.
    fn script(&self, commands: &str) -> String {
        let o = run(
            &mut self.cli_cmd(),
            commands.as_bytes(),
            Duration::from_secs(120),
        );
        assert!(o.status.success(), "redis-cli: {}", text(&o.stderr));
        text(&o.stdout)
    }

    /// Raw protocol through `redis-cli --pipe` (bulk loading).
    fn pipe(&self, resp: &[u8]) {
        let o = run(self.cli_cmd().arg("--pipe"), resp, Duration::from_secs(120));
        let out = text(&o.stdout);
        assert!(
            o.status.success() && out.contains("errors: 0"),
            "redis-cli --pipe ({}): {out}{}",
            self.tag,
            text(&o.stderr)
        );
    }

    /// The server's own pid (under memveil run, not memveil's).
    fn server_pid(&self) -> u32 {
        let info = self.cli(&["INFO", "server"]);
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("no process_id in INFO: {info}"))
    }

    /// SHUTDOWN NOSAVE, then the exit status of the group leader (memveil run
    /// passes on redis-server's).
    fn shutdown(&mut self) -> i32 {
        let _ = self.cli(&["SHUTDOWN", "NOSAVE"]);
        let mut child = self.child.take().expect("running");
        let st = wait_for(&mut child, Duration::from_secs(30));
        code(st.unwrap_or_else(|| {
            panic!(
                "redis-server ({}) did not stop after SHUTDOWN; log:\n{}",
                self.tag,
                self.log_text()
            )
        }))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if matches!(child.try_wait(), Ok(None)) {
                send_group_signal(child.id(), libc::SIGTERM);
                if wait_for(&mut child, Duration::from_secs(5)).is_none() {
                    eprintln!("redis-server ({}) killed", self.tag);
                }
            }
            let _ = child.wait();
        }
    }
}

/// The deterministic command script of the comparison, and a read-only
/// script that checks the same data later.
fn redis_scripts() -> (String, String) {
    let mut g = Lcg(99);
    let mut w = String::new();
    let mut r = String::new();
    for i in 0..400u64 {
        let v = g.next();
        w += &format!("SET str:{i} value-{i}-{v:x}\n");
        w += &format!("INCRBY ctr:{} {}\n", i % 17, v % 1000);
        w += &format!("LPUSH list:{} item-{i}-{}\n", i % 23, v % 77);
        w += &format!("HSET hash:{} field-{i} {v}\n", i % 29);
        if i % 7 == 0 {
            w += &format!(
                "APPEND str:{i} -appended-{}\n",
                "x".repeat(usize::try_from(v % 300).unwrap_or(0))
            );
        }
        if i % 11 == 0 {
            w += &format!("DEL str:{}\n", i / 2);
        }
    }
    // A value that spans several pages.
    let big: String = (0..6000)
        .map(|i| char::from(b'a' + u8::try_from(i % 26).unwrap_or(0)))
        .collect();
    w += &format!("SET big {big}\nSTRLEN big\nGETRANGE big 4090 4110\n");
    for i in 0..400u64 {
        r += &format!("GET str:{i}\n");
    }
    for j in 0..17 {
        r += &format!("GET ctr:{j}\nINCR ctr:{j}\n");
    }
    for j in 0..23 {
        r += &format!("LLEN list:{j}\nLRANGE list:{j} 0 -1\n");
    }
    for j in 0..29 {
        r += &format!("HLEN hash:{j}\nHGETALL hash:{j}\n");
    }
    r += "GET big\nEXISTS str:0 str:1 str:399 nokey\n";
    w += &r;
    (w, r)
}

/// `redis-benchmark` against the server; its summary lines.
fn benchmark(r: &Redis, extra: &[&str]) -> String {
    let o = run(
        Command::new("redis-benchmark")
            .arg("-s")
            .arg(&r.sock)
            .args(["-n", "20000", "-q", "-t", "set,get"])
            .args(extra),
        b"",
        Duration::from_secs(120),
    );
    let out = text(&o.stdout).replace('\r', "\n");
    let summary: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("requests per second"))
        .collect();
    assert!(
        o.status.success()
            && summary.len() == 2
            && summary[0].starts_with("SET:")
            && summary[1].starts_with("GET:")
            && !out.contains("ERR")
            && !out.to_lowercase().contains("error"),
        "redis-benchmark {extra:?} failed ({:?}):\n{out}\n{}\nserver log:\n{}",
        o.status,
        text(&o.stderr),
        r.log_text()
    );
    summary.join("; ")
}

#[test]
fn redis_under_benchmark_same_answers() {
    if !have(
        "redis_under_benchmark",
        &["redis-server", "redis-cli", "redis-benchmark"],
    ) || !root("redis_under_benchmark")
    {
        return;
    }
    preload_built();
    let dir = TempDir::new("redis");
    let stats = dir.path("stats.json");
    let stats_arg = stats.to_str().expect("utf-8 temp path");
    let plain = Redis::start(&dir, "plain", None);
    let mut prot = Redis::start(
        &dir,
        "shielded",
        Some(&["--quiet", "--window", "512", "--stats-json", stats_arg]),
    );
    let (write, read) = redis_scripts();
    let want = plain.script(&write);
    assert!(want.lines().count() > 2500, "{want}");
    assert_eq!(
        prot.script(&write),
        want,
        "redis answers differ under memveil run"
    );

    let small = benchmark(&prot, &[]);
    let large = benchmark(&prot, &["-r", "10000", "-d", "512"]);
    eprintln!("redis-benchmark under memveil run --window 512: {small} | -r 10000 -d 512: {large}");
    let keys: u64 = prot.cli(&["DBSIZE"]).trim().parse().expect("DBSIZE");
    assert!(keys > 5000, "benchmark keys missing: {keys}");

    // The data written before the benchmark is intact after it.
    assert_eq!(
        prot.script(&read),
        plain.script(&read),
        "redis data changed under memveil run"
    );
    let st = prot.shutdown();
    assert_eq!(
        st,
        0,
        "memveil run redis-server exit status; log:\n{}",
        prot.log_text()
    );
    assert_protected(&stats, "redis-server (window 512)");
}

// ------------------------------------------- d: protection proof (redis) --

/// `memveil keyfind SOURCE --pattern HEX --json`: (exit code, pattern hits,
/// key schedules found).
fn keyfind(source: &[&str], pattern: &str) -> (i32, usize, usize) {
    let o = run(
        Command::new(MEMVEIL)
            .arg("keyfind")
            .args(source)
            .args(["--pattern", pattern, "--json"]),
        b"",
        Duration::from_secs(300),
    );
    let c = code(o.status);
    assert!(
        c == 0 || c == 3,
        "memveil keyfind {source:?} failed ({c}): {}",
        text(&o.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("keyfind JSON");
    let len = |k: &str| j[k].as_array().map_or(0, Vec::len);
    (c, len("pattern_hits"), len("keys"))
}

/// `gcore` of a live process; the core file and its size.
fn gcore(dir: &TempDir, tag: &str, pid: u32) -> (PathBuf, u64) {
    let prefix = dir.path(&format!("core-{tag}"));
    let o = run(
        Command::new("gcore")
            .arg("-o")
            .arg(&prefix)
            .arg(pid.to_string()),
        b"",
        Duration::from_secs(300),
    );
    let core = dir.path(&format!("core-{tag}.{pid}"));
    assert!(
        o.status.success() && core.is_file(),
        "gcore {pid} ({tag}) failed: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let size = std::fs::metadata(&core).expect("core").len();
    (core, size)
}

/// Everything readable in the process, page by page, as a raw image (zero
/// pages left out). Unlike gcore, which reads in large chunks and writes
/// zeros for a whole chunk when one page in it cannot be read (an evicted
/// page of the protected region), this keeps every page the process has in
/// plaintext: the image the protection is judged on.
fn page_image(pid: u32, out: &Path) -> (u64, u64) {
    let mut img = std::io::BufWriter::new(File::create(out).expect("image"));
    let mut kept = 0u64;
    let unreadable = common::each_page(pid, |p| {
        img.write_all(p).expect("write image");
        kept += 1;
    });
    img.flush().expect("flush image");
    (kept, unreadable)
}

/// 5000 values of 1 KiB, as raw protocol for `redis-cli --pipe`: the data
/// that pushes the secret out of the window.
fn fill_resp() -> Vec<u8> {
    let mut v = Vec::new();
    for i in 0..5000 {
        let key = format!("fill:{i}");
        let val = format!("{i:08}").repeat(128);
        v.extend_from_slice(
            format!(
                "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n{val}\r\n",
                key.len(),
                val.len()
            )
            .as_bytes(),
        );
    }
    v
}

/// The value stored under "secret": the secret, padded to the size of the
/// fill values. An allocator with size classes (redis's jemalloc, which
/// `memveil run` keeps) puts a value in a slab page with others of its
/// size; a short secret would share a page with small objects redis touches
/// all the time, which keeps that page in the working set (and so in
/// plaintext, by design). Of the fill's size, it leaves the window as the
/// fill goes through.
fn secret_value(secret: &str) -> String {
    format!("{secret}-{}", "p".repeat(1023 - secret.len()))
}

/// `SET schedule V` as raw protocol, V of the fill's size holding the
/// AES-128 schedule of a random key four times, at offsets 0, 181, 362 and
/// 543: whatever redis's string header, one copy is 4-byte aligned in
/// memory, where the finder looks.
fn schedule_resp() -> Vec<u8> {
    let key = &random_secret().into_bytes()[..16];
    let s = memveil_keyfind::expand(key).expect("AES-128 schedule");
    let mut v = vec![b's'; 1024];
    for i in 0..4 {
        v[181 * i..181 * i + s.len()].copy_from_slice(&s);
    }
    let mut resp = b"*3\r\n$3\r\nSET\r\n$8\r\nschedule\r\n$1024\r\n".to_vec();
    resp.extend_from_slice(&v);
    resp.extend_from_slice(b"\r\n");
    resp
}

#[test]
fn redis_secret_leaves_the_window_positive_control() {
    if !have(
        "redis_secret_proof",
        &["redis-server", "redis-cli", "gcore"],
    ) || !root("redis_secret_proof")
    {
        return;
    }
    preload_built();
    let dir = TempDir::new("proof");
    let fill = fill_resp();

    // Positive control: a plain redis-server, the same steps.
    let secret = random_secret();
    let mut plain = Redis::start(&dir, "plain", None);
    assert_eq!(
        plain.cli(&["SET", "secret", &secret_value(&secret)]).trim(),
        "OK"
    );
    plain.pipe(&schedule_resp());
    plain.pipe(&fill);
    let pid = plain.server_pid();
    let (core, size) = gcore(&dir, "plain", pid);
    let (c, hits, _) = keyfind(
        &["--core", core.to_str().expect("utf-8")],
        &hex(secret.as_bytes()),
    );
    assert!(
        c == 3 && hits > 0,
        "positive control failed: the secret is not found in the gcore dump ({size} bytes) of a plain redis-server"
    );
    std::fs::remove_file(&core).expect("remove core");
    let image = dir.path("plain.img");
    page_image(pid, &image);
    let (c, hits, keys) = keyfind(&[image.to_str().expect("utf-8")], &hex(secret.as_bytes()));
    assert!(
        c == 3 && hits > 0,
        "positive control failed: the secret is not in the page image of a plain redis-server"
    );
    assert!(
        keys > 0,
        "positive control failed: the key schedule stored in a plain redis-server is not in its page image"
    );
    std::fs::remove_file(&image).expect("remove image");
    assert_eq!(plain.shutdown(), 0);

    // Protected: the secret, then enough other data that its page leaves a
    // 64-page window, then a fresh marker (still in the window).
    let secret = random_secret();
    let marker = format!("marker-{}", random_secret());
    let stats = dir.path("stats.json");
    let mut prot = Redis::start(
        &dir,
        "shielded",
        Some(&[
            "--quiet",
            "--window",
            "64",
            "--region-gib",
            "1",
            "--stats-json",
            stats.to_str().expect("utf-8"),
        ]),
    );
    assert_eq!(
        prot.cli(&["SET", "secret", &secret_value(&secret)]).trim(),
        "OK"
    );
    prot.pipe(&schedule_resp());
    prot.pipe(&fill);
    let pid = prot.server_pid();
    assert_eq!(prot.cli(&["SET", "marker", &marker]).trim(), "OK");
    // Read back just before the image: its page is in the window now
    // (nothing faults while the image is read).
    assert_eq!(prot.cli(&["GET", "marker"]).trim(), marker);

    let image = dir.path("shielded.img");
    let (kept, unreadable) = page_image(pid, &image);
    let img = image.to_str().expect("utf-8");
    let (c, marker_hits, _) = keyfind(&[img], &hex(marker.as_bytes()));
    assert!(
        c == 3 && marker_hits > 0,
        "the page image of the protected redis-server ({kept} pages kept, {unreadable} evicted) lacks the marker \
         set just before it: the image does not show the plaintext window, so it would prove nothing"
    );
    let (_, hits, keys) = keyfind(&[img], &hex(secret.as_bytes()));
    assert_eq!(
        hits, 0,
        "the secret is readable in the protected redis-server's memory after 5 MB of other values of its size went through \
         a 64-page window ({kept} pages readable, {unreadable} evicted)"
    );
    assert_eq!(
        keys, 0,
        "AES key schedules in the page image of the protected redis-server (the stored one left the window; \
         the shield's keys live in secret memory): key material outside secret memory"
    );
    eprintln!(
        "page image of the protected redis-server: {kept} non-zero pages readable, {unreadable} evicted; \
         marker found, secret not found, {keys} AES key schedule(s)"
    );

    let (core, size) = gcore(&dir, "shielded", pid);
    assert!(
        size > 16 << 20,
        "the gcore dump of the protected redis-server is only {size} bytes"
    );
    let core_s = core.to_str().expect("utf-8");
    let (_, hits, keys) = keyfind(&["--core", core_s], &hex(secret.as_bytes()));
    assert_eq!(
        hits, 0,
        "the secret is in the gcore dump of the protected redis-server"
    );
    assert_eq!(
        keys, 0,
        "AES key schedules in the gcore dump of the protected redis-server"
    );
    let (_, marker_hits, _) = keyfind(&["--core", core_s], &hex(marker.as_bytes()));
    eprintln!(
        "gcore dump of the protected redis-server: {size} bytes, secret not found; the marker (in the window) {}",
        if marker_hits > 0 {
            "found"
        } else {
            "not found either: gcore writes zeros for the protected region (chunks with an evicted page fail to read), \
             so the page image above is the real proof"
        }
    );
    std::fs::remove_file(&core).expect("remove core");

    // The program still works after the dump.
    assert_eq!(prot.cli(&["GET", "secret"]).trim(), secret_value(&secret));
    assert_eq!(
        prot.cli(&["GET", "fill:4999"]).trim(),
        format!("{:08}", 4999).repeat(128)
    );
    assert_eq!(prot.shutdown(), 0, "log:\n{}", prot.log_text());
    assert_protected(&stats, "redis-server (window 64)");
}

// ------------------------------------------------ e: non-root refusal -----

#[test]
fn unprivileged_user_is_refused_naming_the_sysctl() {
    if !have("unprivileged_refusal", &["setpriv"]) || !root("unprivileged_refusal") {
        return;
    }
    preload_built();
    let sysctl =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    if sysctl.trim() != "0" {
        skip(
            Need::HostSetting("vm.unprivileged_userfaultfd=0"),
            format!(
                "vm.unprivileged_userfaultfd is {:?} here, so unprivileged users are allowed",
                sysctl.trim()
            ),
        );
        return;
    }
    if let Ok(m) = std::fs::metadata("/dev/userfaultfd") {
        use std::os::unix::fs::PermissionsExt as _;
        if m.permissions().mode() & 0o006 != 0 {
            skip(
                Need::HostSetting("/dev/userfaultfd root-only"),
                "/dev/userfaultfd is open to everyone here",
            );
            return;
        }
    }
    // A copy nobody can reach (the build directory may not be), with the
    // preload next to it.
    let dir = TempDir::new("nobody");
    let bin = dir.path("memveil");
    std::fs::copy(MEMVEIL, &bin).expect("copy memveil");
    let lib = Path::new(MEMVEIL).parent().expect("dir").join(PRELOAD);
    std::fs::copy(lib, dir.path(PRELOAD)).expect("copy preload");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let o = run(
        Command::new("setpriv")
            .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
            .arg(&bin)
            .args(["run", "--", "/bin/sh", "-c", "echo THE-PROGRAM-RAN"]),
        b"",
        Duration::from_secs(60),
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(code(o.status), 1, "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("unprivileged_userfaultfd"),
        "the refusal does not name vm.unprivileged_userfaultfd: {err}"
    );
    assert!(
        !out.contains("THE-PROGRAM-RAN"),
        "the program ran although memveil refused: {out}"
    );
}

// ------------------------------------------------------------ f: --cpu -----

#[test]
fn cpu_option_pins_the_program_or_refuses() {
    if !have("cpu_option", &["grep"]) || !root("cpu_option") {
        return;
    }
    preload_built();
    let limit = Duration::from_secs(60);
    let o = run(
        Command::new(MEMVEIL).args([
            "run",
            "--quiet",
            "--cpu",
            "0",
            "--",
            "grep",
            "Cpus_allowed_list",
            "/proc/self/status",
        ]),
        b"",
        limit,
    );
    assert_eq!(code(o.status), 0, "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout).split_whitespace().last(),
        Some("0"),
        "the program is not pinned to CPU 0: {}",
        text(&o.stdout)
    );
    // A CPU this process may not use: refused, the program not run.
    let o = run(
        Command::new(MEMVEIL).args([
            "run",
            "--cpu",
            "1023",
            "--",
            "/bin/sh",
            "-c",
            "echo THE-PROGRAM-RAN",
        ]),
        b"",
        limit,
    );
    assert_eq!(code(o.status), 1, "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("--cpu 1023") && !text(&o.stdout).contains("THE-PROGRAM-RAN"),
        "stdout: {}\nstderr: {}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

// ------------------------------------ g: a program's own allocator kept ----

const JEMALLOC: &str = "/lib/x86_64-linux-gnu/libjemalloc.so.2";

#[test]
fn own_allocator_is_kept_and_protected() {
    if !have("own_allocator", &["cc"]) || !root("own_allocator") {
        return;
    }
    if !Path::new(JEMALLOC).is_file() {
        skip(
            Need::Installed("libjemalloc2"),
            format!(
                "{JEMALLOC} missing (Debian package libjemalloc2, which redis-server pulls in)"
            ),
        );
        return;
    }
    preload_built();
    let dir = TempDir::new("alloc");
    let exe = compile_c(&dir, "own_allocator", &[JEMALLOC]);
    let want = "reallocarray keeps this 7 usable-ok\n";
    for (allocator, named) in [("auto", "libjemalloc.so.2"), ("memveil", "memveil")] {
        let stats = dir.path(&format!("{allocator}.json"));
        let o = run(
            &mut shielded(64, &stats, &["--allocator", allocator], &exe),
            b"",
            Duration::from_secs(60),
        );
        assert_eq!(
            code(o.status),
            0,
            "--allocator {allocator}: {}",
            text(&o.stderr)
        );
        assert_eq!(text(&o.stdout), want, "--allocator {allocator}");
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
        assert_eq!(j["allocator"], named, "--allocator {allocator}");
        assert!(
            j["zero_fills"].as_u64().unwrap_or(0) > 0,
            "--allocator {allocator}: the program's memory did not come from the protected region: {j}"
        );
    }
}

// ------------------------------------- h: MAP_FIXED over the region -------

#[test]
fn map_fixed_over_the_region_stays_protected() {
    let Some((_dir, exe)) = c_test("map_fixed", "map_fixed", &[]) else {
        return;
    };
    // Control: plainly, the new pages are an ordinary mapping (no "um").
    let plain = run(&mut Command::new(&exe), b"", Duration::from_secs(30));
    assert_eq!(
        text(&plain.stdout),
        "new-zero 1 old-kept 1 new-b 1 registered 0\n"
    );
    // Under memveil run the replacement happens inside the protected
    // mapping: same contents, and the pages stay registered. Under a bound
    // (the region registered at start; under the default budget alone a
    // chunk is registered only once its data has been held 100 ms).
    let prot = run(
        Command::new(MEMVEIL)
            .args(["run", "--quiet", "--window", "4096", "--"])
            .arg(&exe),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(code(prot.status), 0, "{}", text(&prot.stderr));
    assert_eq!(
        text(&prot.stdout),
        "new-zero 1 old-kept 1 new-b 1 registered 1\n",
        "MAP_FIXED over the region left pages outside the shield's mapping"
    );
}

// ------------------------------------------ i: the region full -------------

#[test]
fn region_full_refuses_rather_than_maps_unprotected() {
    let Some((_dir, exe)) = c_test("region_full", "region_full", &[]) else {
        return;
    };
    // Control: plainly, the kernel maps the 3 GiB (MAP_NORESERVE).
    let plain = run(&mut Command::new(&exe), b"", Duration::from_secs(30));
    assert_eq!(text(&plain.stdout), "small ok big mapped\n");
    let prot = run(
        Command::new(MEMVEIL)
            .args(["run", "--quiet", "--region-gib", "1", "--"])
            .arg(&exe),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(code(prot.status), 0, "{}", text(&prot.stderr));
    assert_eq!(text(&prot.stdout), "small ok big ENOMEM\n");
    assert!(
        text(&prot.stderr).contains("--region-gib"),
        "the refusal does not say how to fix it: {}",
        text(&prot.stderr)
    );
}

/// Runs a compiled test program plainly (the control) and under `memveil
/// run --window 64`: both must exit 0 and print `expected`; `why` says what
/// a failed protected run means. The protected run's `--stats-json`.
fn plain_then_protected(
    dir: &TempDir,
    exe: &Path,
    expected: &str,
    what: &str,
    why: &str,
) -> serde_json::Value {
    let plain = run(&mut Command::new(exe), b"", Duration::from_secs(30));
    assert_eq!(
        code(plain.status),
        0,
        "{what}, plain: {}",
        text(&plain.stderr)
    );
    assert_eq!(text(&plain.stdout), expected, "{what}, plain");
    let stats = dir.path("stats.json");
    let prot = run(
        &mut shielded(64, &stats, &[], exe),
        b"",
        Duration::from_secs(60),
    );
    assert_eq!(
        code(prot.status),
        0,
        "{what}: {why}: {}",
        text(&prot.stderr)
    );
    assert_eq!(text(&prot.stdout), expected, "{what}: {why}");
    assert_protected(&stats, what)
}

#[test]
fn forked_children_each_run_with_a_shield_of_their_own() {
    let Some((dir, exe)) = c_test("fork_children", "fork_children", &[]) else {
        return;
    };
    let j = plain_then_protected(
        &dir,
        &exe,
        "children 0 0 0 0 parent-bad 0\n",
        "fork_children",
        "a heap changed across four forks",
    );
    // Every child reported counters: each protected its copy of the heap.
    assert_eq!(
        j["processes"].as_u64(),
        Some(5),
        "the forked children did not run protected: {j}"
    );
    // Each child's own 4 MiB, checked three times, went through its 64-page
    // window (1024 pages each at least).
    assert!(
        j["evictions"].as_u64().unwrap_or(0) > 5 * 1024,
        "too few evictions for five processes sweeping 4 MiB each: {j}"
    );
}

/// bash forking after a failed `enable -f` (pyenv's `python3` shim does
/// both): glibc keeps a failed `dlopen`'s error string, allocated in the
/// protected heap, until the next `dl*` call frees it. The child's fork
/// handler called `dlsym` (registering its thread) while it still held the
/// allocator's lock taken before the fork; the free through the preload's
/// `free` spun on that lock forever, and the command substitution never
/// returned. Positive control: the same script runs plainly first.
#[test]
fn bash_forks_after_a_failed_dlopen_without_hanging() {
    let test = "bash_forks_after_a_failed_dlopen_without_hanging";
    if !have(test, &["bash"]) || !root(test) {
        return;
    }
    preload_built();
    let dir = TempDir::new("dlerror-fork");
    let script = dir.path("shim.sh");
    std::fs::write(
        &script,
        "set -e\n\
         enable -f /nonexistent/memveil-no-such-builtin.so realpath 2>/dev/null || true\n\
         x=$(echo sub)\n\
         y=$(echo \"$x\" | tr a-z A-Z)\n\
         echo \"$x $y\"\n",
    )
    .expect("write script");
    let expected = "sub SUB\n";
    let bash = which("bash").expect("bash");
    let plain = run(
        Command::new(&bash).arg(&script),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(code(plain.status), 0, "plain: {}", text(&plain.stderr));
    assert_eq!(text(&plain.stdout), expected, "plain");
    let stats = dir.path("stats.json");
    // `run` panics when the program is not done in time (it hung here).
    let prot = run(
        shielded(64, &stats, &[], &bash).arg(&script),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(code(prot.status), 0, "protected: {}", text(&prot.stderr));
    assert_eq!(text(&prot.stdout), expected, "protected");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON");
    // bash, its command-substitution children and `tr`: each protected.
    assert!(
        j["processes"].as_u64().unwrap_or(0) >= 3,
        "the forked children did not run protected: {j}"
    );
}

/// What a scan of a program's page image found: the program reads
/// "SECRET MARKER" from stdin, spreads the secret, pushes it out of a
/// 64-page window, writes the marker last and prints "ready PID" (PID: the
/// process to scan).
struct SecretScan {
    kept: u64,
    unreadable: u64,
    secret_hits: usize,
    marker_hits: usize,
    /// The `--stats-json` of a protected run.
    stats: Option<serde_json::Value>,
}

/// Runs `exe` plain (`flags` `None`) or under `memveil run` with `flags`
/// added to the small-window defaults, and scans the page image of the
/// process that prints `ready PID`.
fn scan_for_secret(dir: &TempDir, exe: &Path, args: &[&str], flags: Option<&[&str]>) -> SecretScan {
    let flags = flags.map(|f| [&["--window", "64", "--region-gib", "1"], f].concat());
    scan_with(dir, exe, args, flags.as_deref(), Duration::ZERO)
}

/// Runs `exe` plain (`flags` `None`) or under `memveil run FLAGS`, and
/// scans the page image of the process that prints `ready PID`, `settle`
/// after it did.
fn scan_with(
    dir: &TempDir,
    exe: &Path,
    args: &[&str],
    flags: Option<&[&str]>,
    settle: Duration,
) -> SecretScan {
    let protected = flags.is_some();
    let secret = random_secret();
    let marker = format!("marker-{}", random_secret());
    let tag = if protected { "protected" } else { "plain" };
    let stats = dir.path(&format!("{tag}-stats.json"));
    let mut cmd = if protected {
        let mut c = Command::new(MEMVEIL);
        c.args(["run", "--quiet"])
            .args(flags.unwrap_or_default())
            .arg("--stats-json")
            .arg(&stats)
            .arg("--")
            .arg(exe);
        c
    } else {
        Command::new(exe)
    };
    let mut top = spawn_group(
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    );
    {
        let mut stdin = top.stdin.take().expect("stdin");
        stdin
            .write_all(format!("{secret} {marker}\n").as_bytes())
            .expect("write secret");
    }
    let mut line = String::new();
    let mut out = std::io::BufReader::new(top.stdout.take().expect("stdout"));
    let ready = std::io::BufRead::read_line(&mut out, &mut line);
    let pid: Option<u32> = line
        .trim()
        .strip_prefix("ready ")
        .and_then(|p| p.parse().ok());
    let Some(pid) = pid.filter(|_| ready.is_ok()) else {
        send_group_signal(top.id(), libc::SIGKILL);
        let _ = top.wait();
        panic!("{tag}: the program did not get ready: {line:?}");
    };
    std::thread::sleep(settle);
    let image = dir.path(&format!("{tag}.img"));
    let (kept, unreadable) = page_image(pid, &image);
    let img = image.to_str().expect("utf-8");
    let (_, secret_hits, _) = keyfind(&[img], &hex(secret.as_bytes()));
    let (_, marker_hits, _) = keyfind(&[img], &hex(marker.as_bytes()));
    send_group_signal(top.id(), libc::SIGTERM);
    let st = wait_for(&mut top, Duration::from_secs(30));
    assert!(st.is_some(), "{tag}: did not exit on SIGTERM");
    let stats = protected.then(|| {
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON")
    });
    SecretScan {
        kept,
        unreadable,
        secret_hits,
        marker_hits,
        stats,
    }
}

/// The protected half of a secret test: the marker (written last) is in the
/// image, so the image shows the plaintext window; the secret is not.
fn assert_secret_left_the_window(what: &str, s: &SecretScan) {
    let (kept, unreadable) = (s.kept, s.unreadable);
    assert!(
        s.marker_hits > 0,
        "{what}: the page image ({kept} pages readable, {unreadable} not) lacks the marker written last: \
         the image does not show the plaintext window, so it would prove nothing"
    );
    assert_eq!(
        s.secret_hits, 0,
        "{what}: the secret is readable after 8 MiB went through a 64-page window \
         ({kept} pages readable, {unreadable} evicted)"
    );
    eprintln!("{what}: {kept} pages readable, {unreadable} evicted; marker found, secret not");
}

#[test]
fn a_forked_childs_secret_leaves_its_window() {
    let Some((dir, exe)) = c_test("fork_secret", "fork_secret", &[]) else {
        return;
    };
    let plain = scan_for_secret(&dir, &exe, &[], None);
    assert!(
        plain.secret_hits > 0,
        "positive control failed: the secret is not in the page image of the plain child ({} pages)",
        plain.kept
    );
    let prot = scan_for_secret(&dir, &exe, &[], Some(&[]));
    assert_secret_left_the_window("forked child under memveil run", &prot);
    let j = prot.stats.expect("stats");
    assert_eq!(j["processes"].as_u64(), Some(2), "{j}");
}

/// Runs `exe arg` under `memveil run FLAGS --stats-json F`: its output and
/// the statistics it wrote.
fn run_with_stats(
    dir: &TempDir,
    flags: &[&str],
    exe: &Path,
    arg: &str,
) -> (Output, serde_json::Value) {
    let stats = dir.path(&format!("{arg}-stats.json"));
    let out = Command::new(MEMVEIL)
        .arg("run")
        .args(flags)
        .arg("--stats-json")
        .arg(&stats)
        .arg("--")
        .arg(exe)
        .arg(arg)
        .output()
        .expect("run protected");
    let j = std::fs::read_to_string(&stats)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    (out, j)
}

// ------------------------------------------------ k: thread stacks --

#[test]
fn a_secret_on_a_threads_stack_leaves_the_window() {
    let Some((dir, exe)) = c_test("thread_stacks", "thread_stacks", &["-pthread"]) else {
        return;
    };
    let plain = scan_for_secret(&dir, &exe, &["secret"], None);
    assert!(
        plain.secret_hits > 0,
        "positive control failed: the secret is not in the page image of the plain program ({} pages)",
        plain.kept
    );
    let prot = scan_for_secret(&dir, &exe, &["secret"], Some(&[]));
    assert_secret_left_the_window("a worker thread's stack under memveil run", &prot);
}

#[test]
fn threads_created_joined_detached_cancelled_keep_their_stacks() {
    let Some((dir, exe)) = c_test("thread_churn", "thread_stacks", &["-pthread"]) else {
        return;
    };
    for (mode, want) in [("churn", "churn ok"), ("signal", "signal ok")] {
        let plain = Command::new(&exe).arg(mode).output().expect("run plain");
        assert_eq!(text(&plain.stdout).trim(), want, "plain {mode}: {plain:?}");
        let (prot, j) = run_with_stats(
            &dir,
            &["--quiet", "--window", "64", "--region-gib", "1"],
            &exe,
            mode,
        );
        assert_eq!(
            text(&prot.stdout).trim(),
            want,
            "{mode} under memveil run: {}",
            text(&prot.stderr)
        );
        assert!(prot.status.success(), "{mode}: {prot:?}");
        // The threads' stacks went through the window: pages came back
        // decrypted, and the plaintext stayed within it.
        assert!(j["faults_in"].as_u64().unwrap_or(0) > 0, "{mode}: {j}");
        assert!(
            j["max_resident"].as_u64().unwrap_or(u64::MAX) <= 64,
            "{mode}: {j}"
        );
    }
}

// --------------------------------- j: signals reach the program's threads --

#[test]
fn process_signals_reach_the_program_not_the_fault_handler() {
    let Some((dir, exe)) = c_test("signals", "sigwait_blocked", &["-pthread"]) else {
        return;
    };
    // The program collects its 50 signals plainly; protected, with its heap
    // evicted, a handler thread that left the signals unblocked would take
    // them and die of SIGUSR1 (exit 138) instead.
    plain_then_protected(
        &dir,
        &exe,
        "signals 50 heap-bad 0\n",
        "signals",
        "a process-directed signal did not reach the program's sigwait",
    );
}

#[test]
fn stats_json_and_live_still_sample_the_run_while_it_runs() {
    // memveil run reads the program's statistics while it runs only for
    // --stats-json (a sample every 50 ms) and --live (issue 33: 18 runs
    // reading them every 50 ms took 1.5% of the host's CPU time); both
    // still see the run as it goes.
    let test = "stats_json_and_live_still_sample_the_run_while_it_runs";
    if !root(test) {
        return;
    }
    preload_built();
    let dir = TempDir::new("samples");
    let stats = dir.path("stats.json");
    let o = Command::new(MEMVEIL)
        .args(["run", "--live", "0.2", "--stats-json"])
        .arg(&stats)
        .args(["--", "sleep", "1"])
        .output()
        .expect("memveil run");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&stats).expect("stats")).expect("json");
    let samples = j["samples"].as_array().map_or(0, Vec::len);
    assert!(samples >= 10, "{samples} samples in 1 s: {j}");
    let live = text(&o.stderr).matches("memveil run: [").count();
    assert!(live >= 3, "{live} --live lines in 1 s: {}", text(&o.stderr));
}

// ------------------------------------------- k: fork without exec --------

#[test]
fn fork_without_exec_keeps_both_heaps_intact() {
    let Some((dir, exe)) = c_test("fork", "fork_heap", &[]) else {
        return;
    };
    let j = plain_then_protected(
        &dir,
        &exe,
        "child 0 parent-bad 0\n",
        "fork",
        "a heap changed across fork",
    );
    // The parent's sweeps while the child held its pages went through the
    // write-protect eviction (a page shared with the child cannot be moved).
    assert!(
        j["wp_evictions"].as_u64().unwrap_or(0) > 0,
        "no page shared with the child was evicted; the test proves nothing: {j}"
    );
}

// ------------------------------------------------ l: shared memory --

#[test]
fn shared_memory_is_refused_or_reported_unprotected() {
    let Some((dir, exe)) = c_test("shared_mem", "shared_mem", &[]) else {
        return;
    };
    for mode in ["anon", "memfd", "sysv"] {
        let want = format!("shared {mode} ok");
        let plain = Command::new(&exe).arg(mode).output().expect("run plain");
        assert_eq!(text(&plain.stdout).trim(), want, "plain {mode}: {plain:?}");
        // The default refuses, naming the flag that lets it through.
        let refused = Command::new(MEMVEIL)
            .args(["run", "--quiet", "--"])
            .arg(&exe)
            .arg(mode)
            .output()
            .expect("run protected");
        assert_eq!(refused.status.code(), Some(2), "{mode}: {refused:?}");
        let err = text(&refused.stderr);
        assert!(
            err.contains("--shared-memory unprotected") && err.contains("refused"),
            "{mode}: {err}"
        );
        // Accepted: the same output, and the summary counts it.
        let (let_through, j) =
            run_with_stats(&dir, &["--shared-memory", "unprotected"], &exe, mode);
        assert_eq!(
            text(&let_through.stdout).trim(),
            want,
            "{mode}: {let_through:?}"
        );
        assert!(
            text(&let_through.stderr).contains("shared memory NOT protected: 1024 KiB"),
            "{mode}: {}",
            text(&let_through.stderr)
        );
        assert_eq!(
            j["shared_unprotected_bytes"].as_u64(),
            Some(1 << 20),
            "{mode}: {j}"
        );
        // Under `protected`, the kinds other processes may attach are
        // refused unless an override lets them through as plaintext.
        if mode != "anon" {
            let kind = if mode == "sysv" { "sysv" } else { "memfd" };
            let (refused, _) = run_with_stats(&dir, &SHARED_PROTECTED, &exe, mode);
            assert_eq!(refused.status.code(), Some(2), "{mode}: {refused:?}");
            let over = format!("protected,{kind}=unprotected");
            let (through, j) = run_with_stats(
                &dir,
                &["--shared-memory", &over, "--accept-unwiped-free"],
                &exe,
                mode,
            );
            assert_eq!(text(&through.stdout).trim(), want, "{mode}: {through:?}");
            assert_eq!(j["shared_unprotected_bytes"].as_u64(), Some(1 << 20), "{j}");
        }
    }
    // Asking to protect what cannot be is refused before the program runs.
    let bad = Command::new(MEMVEIL)
        .args(["run", "--shared-memory", "protected,sysv=protected", "--"])
        .arg(&exe)
        .arg("sysv")
        .output()
        .expect("run");
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert_stderr_has(&bad, "cannot be protected");
}

#[test]
fn read_only_pages_a_jit_unmaps_are_wiped_without_a_crash() {
    let Some((_dir, exe)) = c_test("readonly_unmap", "readonly_unmap", &[]) else {
        return;
    };
    let plain = Command::new(&exe).output().expect("run plain");
    assert_eq!(
        text(&plain.stdout).trim(),
        "readonly ok",
        "plain: {plain:?}"
    );
    // A small window so that read-only pages are also evicted and return.
    let o = Command::new(MEMVEIL)
        .args(["run", "--quiet", "--window", "16", "--"])
        .arg(&exe)
        .output()
        .expect("run protected");
    assert_eq!(text(&o.stdout).trim(), "readonly ok", "protected: {o:?}");
    assert!(o.status.success(), "{o:?}");
}

/// Asserts that `o`'s stderr contains `needle` (showing it when not).
fn assert_stderr_has(o: &Output, needle: &str) {
    let err = text(&o.stderr);
    assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
}

/// `memveil run --shared-memory protected`, as the tests use it.
const SHARED_PROTECTED: [&str; 3] = ["--shared-memory", "protected", "--accept-unwiped-free"];

#[test]
fn shared_memory_written_by_four_forked_children_stays_right_and_is_evicted() {
    let Some((dir, exe)) = c_test("shared_fork", "shared_fork", &[]) else {
        return;
    };
    let plain = Command::new(&exe)
        .args(["64", "3"])
        .output()
        .expect("run plain");
    assert_eq!(
        text(&plain.stdout).trim(),
        "shared fork ok",
        "plain: {plain:?}"
    );
    // Protected only when the unwiped frames are accepted, and said so.
    let refused = Command::new(MEMVEIL)
        .args(["run", "--quiet", "--shared-memory", "protected", "--"])
        .arg(&exe)
        .output()
        .expect("run");
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert_stderr_has(&refused, "--accept-unwiped-free");
    let stats = dir.path("shared-fork.json");
    let o = Command::new(MEMVEIL)
        .args(["run", "--window", "256"])
        .args(SHARED_PROTECTED)
        .arg("--stats-json")
        .arg(&stats)
        .arg("--")
        .arg(&exe)
        .args(["64", "3"])
        .output()
        .expect("run protected");
    assert_eq!(text(&o.stdout).trim(), "shared fork ok", "protected: {o:?}");
    assert!(o.status.success(), "{o:?}");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON");
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    assert_eq!(n("shared_protected_bytes"), 64 << 20, "{j}");
    assert!(
        n("shared_views") >= 5,
        "parent and four children served: {j}"
    );
    // 64 MiB through a 256-page window: most of it left as ciphertext and
    // came back on faults, in the children's views as well as the parent's.
    assert!(
        n("shared_evictions") > 10_000 && n("shared_faults_in") > 10_000,
        "{j}"
    );
    assert_eq!(n("shared_unprotected_bytes"), 0, "{j}");
    assert_stderr_has(&o, "shared memory protected: 65536 KiB");
}

#[test]
fn a_secret_in_shared_memory_leaves_the_window_of_a_forked_child() {
    let Some((dir, exe)) = c_test("shared_secret", "shared_secret", &[]) else {
        return;
    };
    let plain = scan_for_secret(&dir, &exe, &[], None);
    assert!(
        plain.secret_hits > 0,
        "positive control failed: the secret is not in the page image of the plain child ({} pages)",
        plain.kept
    );
    let prot = scan_for_secret(&dir, &exe, &[], Some(&SHARED_PROTECTED));
    assert_secret_left_the_window("shared memory, forked child", &prot);
    let j = prot.stats.as_ref().expect("stats");
    assert!(j["shared_evictions"].as_u64().unwrap_or(0) > 0, "{j}");
}

/// Runs `shared_fork 16 ROUNDS MODE` under `--shared-memory protected` with
/// a 64-page window, in a shell that first sets `ulimit -n NOFILE`.
fn shared_fork_mode(exe: &Path, rounds: &str, mode: &str, nofile: u32) -> Output {
    let script = format!(
        "ulimit -n {nofile} && exec \"$0\" run --quiet --window 64 --shared-memory protected \
         --accept-unwiped-free -- \"$1\" 16 {rounds} {mode}"
    );
    run(
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg(MEMVEIL)
            .arg(exe),
        b"",
        Duration::from_secs(120),
    )
}

/// `shared_fork 16 1 MODE` prints "MODE ok" plainly and under
/// `--shared-memory protected` (64-page window).
fn plain_and_protected_agree(test: &str, mode: &str) {
    let Some((_dir, exe)) = c_test(test, "shared_fork", &[]) else {
        return;
    };
    let want = format!("{mode} ok");
    let plain = Command::new(&exe)
        .args(["16", "1", mode])
        .output()
        .expect("plain");
    assert_eq!(text(&plain.stdout).trim(), want, "plain: {plain:?}");
    let o = shared_fork_mode(&exe, "1", mode, 1024);
    assert_eq!(text(&o.stdout).trim(), want, "{o:?}");
}

#[test]
fn a_child_keeps_its_shared_data_after_its_creator_unmaps_it_and_exits() {
    let Some((_dir, exe)) = c_test("shared_outlive", "shared_fork", &[]) else {
        return;
    };
    let o = shared_fork_mode(&exe, "1", "outlive", 1024);
    assert!(text(&o.stdout).contains("child kept its data"), "{o:?}");
    assert!(
        text(&o.stderr).contains("wrote back the shared memory")
            && text(&o.stderr).contains("1 other process(es) still map"),
        "{o:?}"
    );
}

#[test]
fn a_new_shared_mapping_at_a_released_address_keeps_both_contents() {
    plain_and_protected_agree("shared_reuse", "reuse");
}

#[test]
fn a_child_reads_holes_of_a_released_mapping_it_partly_mapped_over() {
    // Before: the range stayed registered in the child's view (the kernel
    // refused to unregister it across the file mapping) and its first
    // touches faulted forever.
    plain_and_protected_agree("shared_holes", "holes");
}

#[test]
fn a_single_threaded_creator_at_its_open_files_limit_can_fork() {
    // The fork event needs a descriptor in the creator: the handler gives
    // up its reserve (before, the fork waited forever).
    plain_and_protected_agree("shared_nofile", "nofile");
}

#[test]
fn many_short_lived_children_under_a_small_open_files_limit_are_served() {
    let Some((_dir, exe)) = c_test("shared_many", "shared_fork", &[]) else {
        return;
    };
    // 200 children in turn, each a view of the creator's shared memory,
    // and 64 descriptors: the views of children gone must be given back.
    let o = shared_fork_mode(&exe, "200", "many", 64);
    assert_eq!(text(&o.stdout).trim(), "many ok", "{o:?}");
    assert!(o.status.success(), "{o:?}");
}

#[test]
fn a_child_whose_shared_memory_creator_died_is_stopped_not_left_reading_zeros() {
    let Some((_dir, exe)) = c_test("shared_orphan", "shared_fork", &[]) else {
        return;
    };
    let o = Command::new(MEMVEIL)
        .args(["run", "--quiet", "--window", "64"])
        .args(SHARED_PROTECTED)
        .arg("--")
        .arg(&exe)
        .args(["16", "1", "orphan"])
        .output()
        .expect("run");
    let err = text(&o.stderr);
    assert!(
        err.contains("died holding the keys of shared memory") && err.contains("exit status 125"),
        "{o:?}"
    );
    assert!(!text(&o.stdout).contains("zeros"), "{o:?}");
}

// ------------------------------------------------ m: nginx workers --

/// Fetches `path` over plain HTTP/1.0 from `port` (the whole response).
fn http_get(port: u16, path: &str) -> usize {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("request");
    let mut body = Vec::new();
    s.read_to_end(&mut body).expect("response");
    body.len()
}

#[test]
fn nginx_workers_are_protected_and_the_tls_key_leaves_their_window() {
    if !have("nginx", &["nginx", "openssl", "gcore"]) || !root("nginx") {
        return;
    }
    preload_built();
    let dir = TempDir::new("nginx");
    let site = memveil_bench::nginx::Site::prepare(&dir.path("site"), 2).expect("site");
    for protected in [false, true] {
        let tag = if protected { "protected" } else { "plain" };
        let stats = dir.path("nginx-stats.json");
        let mut cmd = if protected {
            let mut c = Command::new(MEMVEIL);
            c.args(["run", "--quiet", "--window", "64", "--region-gib", "1"])
                .args(["--shared-memory", "unprotected", "--stats-json"])
                .arg(&stats)
                .args(["--", "nginx"]);
            c
        } else {
            Command::new("nginx")
        };
        let mut server = spawn_group(
            cmd.args(site.nginx_args())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit()),
        );
        site.wait_ready(&mut server, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        // TLS handshakes (the workers use the key), then requests that
        // read a 1 MiB file through each worker's heap.
        let rate = memveil_bench::nginx::s_time(site.tls_port, false, 1)
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        for _ in 0..24 {
            assert!(
                http_get(site.http_port, "/big.bin") > 1 << 20,
                "{tag}: short response"
            );
        }
        let workers = site.worker_pids();
        assert_eq!(workers.len(), 2, "{tag}: workers {workers:?}");
        let (mut prime_hits, mut aes_keys) = (Vec::new(), Vec::new());
        for &w in &workers {
            if protected {
                let smaps = std::fs::read_to_string(format!("/proc/{w}/smaps")).expect("smaps");
                let um = smaps
                    .lines()
                    .filter(|l| l.starts_with("VmFlags:") && l.contains(" um"))
                    .count();
                assert!(
                    um > 0,
                    "worker {w} has no userfaultfd-registered mapping: its heap is not protected"
                );
            }
            let (core, _) = gcore(&dir, tag, w);
            let c = core.to_str().expect("utf-8");
            let (_, hits, keys) = keyfind(&[c], &site.prime_pattern);
            prime_hits.push(hits);
            aes_keys.push(keys);
            let _ = std::fs::remove_file(&core);
        }
        site.stop(&mut server);
        eprintln!(
            "nginx {tag}: {rate:.0} TLS handshakes/s; workers {workers:?}: RSA prime found {prime_hits:?} times, \
             AES key schedules (session-ticket keys) {aes_keys:?}"
        );
        if protected {
            assert!(
                prime_hits.iter().all(|&h| h == 0),
                "the server key's prime is readable in a protected worker's core: {prime_hits:?}"
            );
            assert!(
                aes_keys.iter().all(|&k| k == 0),
                "an AES key schedule is readable in a protected worker's core: {aes_keys:?}"
            );
            let j: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats"))
                    .expect("JSON");
            assert_eq!(
                j["processes"].as_u64(),
                Some(3),
                "master and two workers report: {j}"
            );
            assert!(
                j["shared_unprotected_bytes"].as_u64().unwrap_or(0) > 0,
                "{j}"
            );
        } else {
            assert!(
                prime_hits.iter().all(|&h| h > 0),
                "positive control failed: the key's prime is not in every plain worker's core: {prime_hits:?}"
            );
            assert!(
                aes_keys.iter().all(|&k| k > 0),
                "positive control failed: no AES key schedule in a plain worker's core: {aes_keys:?}"
            );
        }
    }
}

// ------------------------------------------------ n: --user --

/// A copy of the preload library that every user can read (the build
/// directory may not be reachable), for `--preload`; `dir` is opened up too.
fn preload_for_everyone(dir: &TempDir) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let lib = Path::new(MEMVEIL).parent().expect("dir").join(PRELOAD);
    let copy = dir.path(PRELOAD);
    std::fs::copy(lib, &copy).expect("copy preload");
    copy
}

/// `id -u NAME`.
fn uid_of(name: &str) -> String {
    let o = Command::new("id").args(["-u", name]).output().expect("id");
    assert!(o.status.success(), "no user {name}: {o:?}");
    text(&o.stdout).trim().to_owned()
}

/// Whether `vm.unprivileged_userfaultfd` is 0 (a user's handler then needs
/// CAP_SYS_PTRACE, which `--user` keeps).
fn uffd_needs_ptrace() -> bool {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").is_ok_and(|s| s.trim() == "0")
}

/// Regression: a program that became another user itself (`memveil run --
/// setpriv --reuid USER ...`) could not create its `PID.stats` in the
/// counters directory memveil run had made as root, and exited 125
/// ("Permission denied"); the flag did not exist. `--user` switches before
/// the program starts: it runs as the user, protected, with CAP_SYS_PTRACE
/// alone, and its counters reach --stats-json (a file in a directory only
/// root may write).
#[test]
fn run_as_another_user_is_protected_and_counted() {
    let Some((dir, exe)) = c_test("run_as_user", "fork_secret", &[]) else {
        return;
    };
    let preload = preload_for_everyone(&dir);
    let pre = preload.to_str().expect("utf-8");
    let user = ["--user", "nobody", "--preload", pre];
    let stats = dir.path("user-stats.json");
    let o = run(
        Command::new(MEMVEIL)
            .args(["run", "--quiet"])
            .args(user)
            .arg("--stats-json")
            .arg(&stats)
            .args(["--", "/bin/sh", "-c"])
            .arg("id -u; grep -E '^Cap(Eff|Amb)' /proc/self/status"),
        b"",
        Duration::from_secs(60),
    );
    let out = text(&o.stdout);
    assert_eq!(code(o.status), 0, "{out}{}", text(&o.stderr));
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(uid_of("nobody").as_str()), "{out}");
    // Only CAP_SYS_PTRACE, and only when the sysctl makes it needed.
    let want = if uffd_needs_ptrace() {
        "0000000000080000"
    } else {
        "0000000000000000"
    };
    for cap in ["CapEff", "CapAmb"] {
        let got = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{cap}:")))
            .map(str::trim);
        assert_eq!(got, Some(want), "{cap}: {out}");
    }
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON");
    // sh, id and grep each protected and counted.
    assert!(j["processes"].as_u64().unwrap_or(0) >= 3, "{j}");
    // The secret test as that user: its heap is protected as root's is.
    let plain = scan_for_secret(&dir, &exe, &[], None);
    assert!(
        plain.secret_hits > 0,
        "positive control failed: the secret is not in the plain child's page image ({} pages)",
        plain.kept
    );
    let prot = scan_for_secret(&dir, &exe, &[], Some(&user));
    assert_secret_left_the_window("forked child run as nobody", &prot);
    let j = prot.stats.expect("stats");
    assert_eq!(j["processes"].as_u64(), Some(2), "{j}");
}

#[test]
fn run_as_a_user_that_does_not_exist_is_refused() {
    if !root("no_such_user") {
        return;
    }
    preload_built();
    let o = run(
        Command::new(MEMVEIL).args([
            "run",
            "--user",
            "memveil-no-such-user",
            "--",
            "/bin/sh",
            "-c",
            "echo THE-PROGRAM-RAN",
        ]),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(code(o.status), 1, "{o:?}");
    assert!(text(&o.stderr).contains("no such user"), "{o:?}");
    assert!(!text(&o.stdout).contains("THE-PROGRAM-RAN"), "{o:?}");
}

// ------------------------------------------------ o: PostgreSQL --

/// Debian 12's PostgreSQL server programs.
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// `--shared-memory` of the protected PostgreSQL run. Its shared buffers
/// live in one `MAP_SHARED|MAP_ANONYMOUS` segment, protected; its one-page
/// System V segment (a header, no data) cannot be and is let through.
const PG_SHARED_MEMORY: &str = "protected,sysv=unprotected";

/// A PostgreSQL server of a fresh cluster in a directory of its own, run as
/// user `postgres` (it refuses root), reachable only through a Unix socket
/// in that directory. Dropped, it is killed (its whole process group) and
/// its System V segment removed, so that a failing test leaves nothing.
struct Postgres {
    server: Option<Child>,
    data: PathBuf,
    sock: PathBuf,
    log: PathBuf,
    tag: &'static str,
}

impl Postgres {
    /// `initdb`, then the server: plain, or under `memveil run` with `shield`
    /// flags (which `--user postgres` is added to). Waits until it answers.
    fn start(dir: &TempDir, tag: &'static str, shield: Option<&[&str]>) -> Self {
        let root = dir.path(tag);
        let (data, sock) = (root.join("data"), root.join("sock"));
        for d in [&root, &sock] {
            std::fs::create_dir_all(d).expect("mkdir");
            std::os::unix::fs::chown(d, Some(pg_uid()), None).expect("chown to postgres");
        }
        let o = run(
            as_postgres(&Path::new(PG_BIN).join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "--locale=C"])
                .args(["-E", "UTF8"]),
            b"",
            Duration::from_secs(120),
        );
        assert!(o.status.success(), "{tag}: initdb: {}", text(&o.stderr));
        let postgres = Path::new(PG_BIN).join("postgres");
        let mut cmd = match shield {
            Some(flags) => {
                let mut c = Command::new(MEMVEIL);
                c.args(["run", "--user", "postgres"])
                    .args(flags)
                    .arg("--")
                    .arg(&postgres);
                c
            }
            None => as_postgres(&postgres),
        };
        let log = root.join("log");
        cmd.arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(&sock)
            // Only the socket: no TCP port to collide with anything.
            .args(["-p", "5432", "-c", "listen_addresses="])
            .args(["-c", "shared_buffers=64MB", "-c", "huge_pages=off"])
            // Dynamic segments as files of the data directory (posix's
            // /dev/shm files would outlive a killed server).
            .args(["-c", "dynamic_shared_memory_type=mmap"])
            .args(["-c", "max_parallel_workers_per_gather=0"])
            // LLVM's JIT on (it unmaps code it made read-only/executable,
            // which crashed a protected backend before b615a0a).
            .args(["-c", "jit=on", "-c", "jit_above_cost=0"])
            .args(["-c", "fsync=off", "-c", "max_wal_size=1GB"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log"));
        let mut pg = Postgres {
            server: Some(spawn_group(&mut cmd)),
            data,
            sock,
            log,
            tag,
        };
        let start = Instant::now();
        loop {
            let o = pg.psql_output("select 1");
            if o.status.success() {
                break;
            }
            let gone = pg.server.as_mut().and_then(|c| c.try_wait().ok().flatten());
            assert!(
                gone.is_none() && start.elapsed() < Duration::from_secs(60),
                "{tag}: the server did not start ({gone:?}): {}",
                pg.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        pg
    }

    fn psql_output(&self, sql: &str) -> Output {
        let psql = which("psql").expect("psql");
        run(
            Command::new(psql)
                .arg("-h")
                .arg(&self.sock)
                .args(["-p", "5432", "-U", "postgres", "-X", "-Atq"])
                .args(["-v", "ON_ERROR_STOP=1", "-d", "postgres"]),
            sql.as_bytes(),
            Duration::from_secs(600),
        )
    }

    /// The output of `sql` through psql (it must succeed).
    fn psql(&self, sql: &str) -> String {
        let o = self.psql_output(sql);
        assert!(
            o.status.success(),
            "{}: psql failed: {}\nserver log: {}",
            self.tag,
            text(&o.stderr),
            self.log_text()
        );
        text(&o.stdout)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The postmaster's pid (first line of postmaster.pid) and its children's.
    fn pids(&self) -> Vec<u32> {
        let pidfile = std::fs::read_to_string(self.data.join("postmaster.pid")).expect("pidfile");
        let pm: u32 = pidfile
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .expect("postmaster pid");
        let mut pids = vec![pm];
        for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // The parent pid is the second field after the ")" ending the name.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(pm) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Stops the server (SIGINT to the postmaster: fast shutdown; memveil
    /// run, when there, ends with it) and returns its exit status (or
    /// memveil run's, the same).
    fn stop(&mut self) -> i32 {
        let postmaster = self.pids()[0];
        let mut child = self.server.take().expect("running");
        let _ = memveil_sys::process::send_signal(postmaster, libc::SIGINT);
        let st = wait_for(&mut child, Duration::from_secs(120));
        let st = st.unwrap_or_else(|| panic!("{}: no shutdown: {}", self.tag, self.log_text()));
        code(st)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            send_group_signal(child.id(), libc::SIGKILL);
            let _ = child.wait();
        }
        // A killed server leaves its System V segment: postmaster.pid's
        // last line holds its key and id.
        let id = std::fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()
            .and_then(|p| {
                p.lines()
                    .nth(6)
                    .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
            });
        if let Some(id) = id {
            let _ = Command::new("ipcrm")
                .args(["-m", &id])
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn pg_uid() -> u32 {
    uid_of("postgres").parse().expect("uid")
}

/// `setpriv` running `prog` as user postgres (its groups too).
fn as_postgres(prog: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid",
        "postgres",
        "--regid",
        "postgres",
        "--init-groups",
        "--",
    ])
    .arg(prog);
    c
}

/// Occurrences of `needle` in the shared anonymous mappings of `pid` (shown
/// as `/dev/zero (deleted)` in its maps: PostgreSQL's main segment, the
/// shared buffers) and the pages that could not be read.
fn shared_anon_hits(pid: u32, needle: &[u8]) -> (usize, u64) {
    // A helper process may have ended since it was listed.
    let (Ok(maps), Ok(mem)) = (
        std::fs::read_to_string(format!("/proc/{pid}/maps")),
        File::open(format!("/proc/{pid}/mem")),
    ) else {
        return (0, 0);
    };
    let (mut hits, mut unreadable) = (0, 0u64);
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        // Shared anonymous memory: the kernel's (`/dev/zero`) plainly, the
        // shield's memfd under --shared-memory protected.
        let anon = line.ends_with("/dev/zero (deleted)")
            || line.ends_with("/memfd:memveil-shared (deleted)");
        if !perms.starts_with("rw-s") || !anon {
            continue;
        }
        let (a, b) = range.split_once('-').expect("range");
        let a = u64::from_str_radix(a, 16).expect("start");
        let b = u64::from_str_radix(b, 16).expect("end");
        let mut seg = vec![0u8; usize::try_from(b - a).expect("size")];
        for (i, page) in seg.chunks_mut(4096).enumerate() {
            let off = a + 4096 * u64::try_from(i).expect("page");
            if mem.read_exact_at(page, off).is_err() {
                page.fill(0);
                unreadable += 1;
            }
        }
        hits += seg.windows(needle.len()).filter(|w| *w == needle).count();
    }
    (hits, unreadable)
}

/// Whether the shared buffers of any of `pids` hold `needle` as plaintext:
/// the occurrences per process, and the unreadable pages seen.
fn shared_buffers_hold(pids: &[u32], needle: &str) -> (Vec<usize>, u64) {
    let mut per = Vec::new();
    let mut unreadable = 0;
    for &p in pids {
        let (h, u) = shared_anon_hits(p, needle.as_bytes());
        per.push(h);
        unreadable += u;
    }
    (per, unreadable)
}

/// The workload: a secret in a small table, then 300k rows and an index
/// (about 40 MB through 64 MB of shared buffers, far more than the
/// protected run's window), aggregates, an index scan, the secret read back,
/// a scan of the whole table through its index (random access to every heap
/// page through the buffer pool: a sequential scan would only cycle a small
/// ring of buffers), and a marker written last. Deterministic output.
fn pg_workload(secret: &str, marker: &str) -> String {
    format!(
        "create table s(id int primary key, v text);
insert into s values (1, 'SECRET-{secret}');
create table t(id int, h text, k int);
insert into t select g, md5(g::text), (g::bigint * 7919) % 1000 from generate_series(1, 300000) g;
create index t_h on t(h);
select count(*), sum(k), count(distinct k), min(h), max(h) from t;
select k, count(*), sum(id) from t group by k order by k limit 5;
select id, h from t where h like 'abc%' order by h limit 3;
select count(*) from t a join t b on a.id = b.id + 1 where a.k < 10;
select v from s;
set enable_seqscan = off;
set enable_bitmapscan = off;
select count(*), sum(k) from t where h >= 'e';
reset enable_seqscan;
reset enable_bitmapscan;
create table m(v text);
insert into m values ('MARKER-{marker}');
select v from m;
"
    )
}

/// Issue 16: PostgreSQL (Debian's server, run as user postgres through
/// `memveil run --user postgres`) gives the same answers with and without
/// the shield, its backends run protected, and its shared buffers are
/// checked for a secret: found in the plain server's (positive control);
/// with PG_SHARED_MEMORY "unprotected" they are plaintext and the summary
/// counts them; once protected, the secret must be gone from them.
#[test]
fn postgresql_same_answers_and_its_shared_buffers_checked() {
    let test = "postgresql";
    if !root(test) || !have(test, &["psql", "setpriv", "ipcrm"]) {
        return;
    }
    if !Path::new(PG_BIN).join("postgres").is_file() {
        skip(
            Need::Installed("postgresql"),
            format!("{test}: {PG_BIN}/postgres missing (scripts/packages.txt: postgresql)"),
        );
        return;
    }
    preload_built();
    let dir = TempDir::new(test);
    let preload = preload_for_everyone(&dir);
    let secret = random_secret();
    let marker = random_secret();
    let sql = pg_workload(&secret, &marker);
    let stats = dir.path("pg-stats.json");
    let flags = [
        "--quiet",
        "--window",
        "1024",
        "--preload",
        preload.to_str().expect("utf-8"),
        "--shared-memory",
        PG_SHARED_MEMORY,
        "--accept-unwiped-free",
        "--stats-json",
        stats.to_str().expect("utf-8"),
    ];
    let mut answers = Vec::new();
    for (tag, shield) in [("plain", None), ("protected", Some(&flags[..]))] {
        let mut pg = Postgres::start(&dir, tag, shield);
        let t = Instant::now();
        answers.push(pg.psql(&sql));
        let secs = t.elapsed().as_secs_f64();
        let pids = pg.pids();
        let (secret_hits, unreadable) = shared_buffers_hold(&pids, &format!("SECRET-{secret}"));
        let (marker_hits, _) = shared_buffers_hold(&pids, &format!("MARKER-{marker}"));
        eprintln!(
            "postgresql {tag}: workload {secs:.1} s; pids {pids:?}: secret in shared buffers \
             {secret_hits:?}, marker {marker_hits:?}, {unreadable} pages unreadable"
        );
        // The scan sees the shared buffers: the marker written last is there.
        assert!(
            marker_hits.iter().any(|&h| h > 0),
            "{tag}: the marker written last is not in the shared buffers: the scan proves nothing"
        );
        let secret_seen = secret_hits.iter().any(|&h| h > 0);
        if shield.is_none() || PG_SHARED_MEMORY == "unprotected" {
            assert!(
                secret_seen,
                "{tag}: the secret is not in the plaintext shared buffers (positive control)"
            );
        } else {
            assert!(
                !secret_seen,
                "{tag}: the secret is readable in the protected shared buffers: {secret_hits:?}"
            );
        }
        if shield.is_some() {
            let backends: Vec<u32> = pids[1..].to_vec();
            let um = backends.iter().any(|p| {
                std::fs::read_to_string(format!("/proc/{p}/smaps")).is_ok_and(|s| {
                    s.lines()
                        .any(|l| l.starts_with("VmFlags:") && l.contains(" um"))
                })
            });
            assert!(
                um,
                "no PostgreSQL process has a userfaultfd-registered mapping: {pids:?}"
            );
        }
        assert_eq!(pg.stop(), 0, "{tag}: shutdown: {}", pg.log_text());
    }
    assert_eq!(
        answers[0], answers[1],
        "PostgreSQL answered differently under memveil run"
    );
    assert!(
        answers[0].contains(&format!("SECRET-{secret}")),
        "{}",
        answers[0]
    );
    let j = assert_protected(&stats, "postgresql");
    assert!(
        j["processes"].as_u64().unwrap_or(0) >= 5,
        "postmaster, its helpers and the backend report: {j}"
    );
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    if PG_SHARED_MEMORY == "unprotected" {
        assert!(n("shared_unprotected_bytes") > 0, "{j}");
    } else {
        // The buffer cache (64 MiB and more) protected for the postmaster
        // and every backend, and through a 1024-page window evicted and
        // brought back; only the System V header page let through.
        assert!(n("shared_protected_bytes") >= 64 << 20, "{j}");
        assert!(n("shared_views") >= 5, "{j}");
        assert!(
            n("shared_evictions") > 1000 && n("shared_faults_in") > 0,
            "{j}"
        );
        assert!(n("shared_unprotected_bytes") <= 1 << 16, "{j}");
    }
}

// ------------------------------------- n: the cost budget (issue 26) --

#[test]
fn under_the_default_budget_an_idle_secret_leaves_and_the_summary_names_the_guarantee() {
    let Some((dir, exe)) = c_test("budget_idle", "idle_secret", &[]) else {
        return;
    };
    // Positive control: plainly, the secret is in the page image.
    let plain = scan_with(&dir, &exe, &[], None, Duration::from_millis(500));
    assert!(
        plain.secret_hits > 0 && plain.marker_hits > 0,
        "positive control failed: secret {} / marker {} hits in the plain program's image ({} pages)",
        plain.secret_hits,
        plain.marker_hits,
        plain.kept
    );
    // At the defaults (no bound: a budget of 10%), a page idle past its
    // sweep period leaves however large the heap; the page the program
    // works on (the marker's) stays.
    let prot = scan_with(
        &dir,
        &exe,
        &[],
        Some(&["--region-gib", "1"]),
        Duration::from_secs(2),
    );
    assert!(
        prot.marker_hits > 0,
        "the image ({} pages readable) lacks the marker the program keeps rewriting: it proves nothing",
        prot.kept
    );
    assert_eq!(
        prot.secret_hits, 0,
        "the idle secret is readable 2 s in under the default budget ({} pages readable, {} evicted)",
        prot.kept, prot.unreadable
    );
    let j = prot.stats.expect("stats");
    assert_eq!(j["guarantee"], "budget", "{j}");
    assert_eq!(j["budget_percent"].as_u64(), Some(10), "{j}");
    assert_eq!(j["lazy"].as_u64(), Some(1), "{j}");
    assert!(
        j["swept"].as_u64().unwrap_or(0) > 1000,
        "the 32 MiB heap was not swept: {j}"
    );
    let t = j["time_plaintext_fraction"]
        .as_f64()
        .expect("time-weighted fraction");
    assert!(
        t > 0.0 && t < 1.0,
        "time-weighted plaintext fraction {t}: {j}"
    );
    assert!(
        j["budget_met"].is_boolean() && j["cost_fraction"].is_number(),
        "{j}"
    );
    assert_eq!(j["window"].as_u64(), Some(0), "no bound, no window: {j}");
}

#[test]
fn a_growing_large_buffer_is_resized_in_place_not_copied_and_wiped() {
    let Some((_dir, exe)) = c_test("realloc_grow", "realloc_grow", &[]) else {
        return;
    };
    let o = run(
        Command::new(MEMVEIL)
            .args(["run", "--quiet", "--"])
            .arg(&exe),
        b"",
        Duration::from_secs(60),
    );
    assert_eq!(code(o.status), 0, "{}", text(&o.stderr));
    // Each move was a copy of the whole buffer, a wipe of the old pages on
    // the program's thread and their faults again on reuse (python3's JSON
    // writer and lists grow this way).
    assert_eq!(
        text(&o.stdout).trim(),
        "moved 0 mremap_in_place 1",
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn a_freed_large_block_is_kept_for_the_next_one_not_wiped_and_faulted_in_again() {
    let Some((_dir, exe)) = c_test("large_reuse", "large_reuse", &[]) else {
        return;
    };
    let o = run(
        Command::new(MEMVEIL)
            .args(["run", "--quiet", "--max-overhead", "1", "--"])
            .arg(&exe),
        b"",
        Duration::from_secs(60),
    );
    assert_eq!(code(o.status), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let per_round: u64 = out
        .trim()
        .strip_prefix("faults_per_round ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {out:?}"));
    // Plain (glibc keeps a freed block of that size in its heap): 0 faults
    // a round. Giving each block back wiped its 192 pages on the program's
    // thread and faulted all of them in again in the next round.
    assert!(
        per_round < 8,
        "{per_round} page faults a round for a 768 KiB block freed and allocated again"
    );
}

/// Allocates, fills and frees 8 MiB buffers (python3's large blocks are
/// whole pages of the region: each free wipes its pages on the program's
/// thread before the frames go back to the kernel).
const FREE_HEAVY: &str = "import sys\n\
for i in range(int(sys.argv[1])):\n    \
b = bytearray(8 << 20); b[::4096] = bytes([i % 251 + 1]) * len(b[::4096]); del b\n\
print('done')\n";

#[test]
fn the_summary_cost_counts_the_shield_threads_and_the_wipes_of_freed_memory() {
    if !have("cost_counts", &["python3"]) || !root("cost_counts") {
        return;
    }
    preload_built();
    let dir = TempDir::new("cost");
    let stats = dir.path("cost.json");
    let o = run(
        Command::new(MEMVEIL)
            .args(["run", "--max-overhead", "1", "--stats-json"])
            .arg(&stats)
            .arg("--")
            .arg(python3())
            .args(["-c", FREE_HEAVY, "64"]),
        b"",
        Duration::from_secs(120),
    );
    assert_eq!(code(o.status), 0, "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).trim(), "done");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON");
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    // 64 x 8 MiB wiped on the program's thread: counted, and in the cost.
    assert!(n("program_ns") > 0 && n("shield_cpu_ns") > 0, "{j}");
    assert!(
        n("host_cost_ns")
            >= n("program_ns") + n("shield_cpu_ns") + n("handoffs") * n("fault_floor_ns"),
        "the host's cost leaves out a part: {j}"
    );
    // What the program lost: its own thread's wipes and the hand-offs in
    // full, never more than the host's cost.
    assert!(
        n("cost_ns") >= n("program_ns") + n("handoffs") * n("fault_floor_ns")
            && n("cost_ns") <= n("host_cost_ns"),
        "the program's loss leaves out a part: {j}"
    );
    let line = text(&o.stderr);
    assert!(
        line.contains("ms on the program's threads wiping what it freed")
            && line.contains("ms its threads' CPU"),
        "the summary does not say what the cost holds: {line}"
    );
}

#[test]
fn the_budget_and_a_bound_together_the_bound_wins_and_bad_budgets_are_refused() {
    let Some((dir, exe)) = c_test("budget_bound", "idle_secret", &[]) else {
        return;
    };
    for bad in ["0", "101%", "x", "-5"] {
        let o = run(
            Command::new(MEMVEIL).args(["run", "--max-overhead", bad, "--", "true"]),
            b"",
            Duration::from_secs(30),
        );
        assert_eq!(
            code(o.status),
            2,
            "--max-overhead {bad}: {}",
            text(&o.stderr)
        );
        assert!(
            text(&o.stderr).contains("overhead budget"),
            "--max-overhead {bad}: {}",
            text(&o.stderr)
        );
    }
    let prot = scan_with(
        &dir,
        &exe,
        &[],
        Some(&[
            "--region-gib",
            "1",
            "--max-overhead",
            "20",
            "--window",
            "256",
        ]),
        Duration::from_millis(500),
    );
    assert_eq!(prot.secret_hits, 0, "the secret left a 256-page window");
    let j = prot.stats.expect("stats");
    assert_eq!(j["guarantee"], "bound+budget", "{j}");
    assert_eq!(j["budget_percent"].as_u64(), Some(20), "{j}");
    assert_eq!(
        j["lazy"].as_u64(),
        Some(0),
        "a bound registers everything: {j}"
    );
    let max = j["max_resident"].as_u64().expect("max_resident");
    assert!(
        max <= 256,
        "the bound was exceeded ({max} pages) to meet the budget: {j}"
    );
}

/// `memveil run --quiet --region-gib 1 --` on a private ledger of the
/// host's budget in `dir` (`env MEMVEIL_SHIELD_DIR=...`): a lone program's
/// behaviour at the defaults, whatever the other tests of this binary
/// running beside it draw on the host's real ledger.
fn on_a_host_of_its_own(dir: &TempDir) -> Vec<std::ffi::OsString> {
    let host = format!("MEMVEIL_SHIELD_DIR={}", dir.path("host").display());
    [
        "env",
        &host,
        MEMVEIL,
        "run",
        "--quiet",
        "--region-gib",
        "1",
        "--",
    ]
    .iter()
    .map(std::ffi::OsString::from)
    .collect()
}

/// The canary plainly (the positive control: the sampler finds its secret
/// in every sample) and under `memveil run` at the defaults, reading its
/// secret at `period`; `None` after a skip line.
fn canary_plain_and_protected(
    name: &str,
    period: memveil_bench::shield::suite::exposure::Period,
    run: Duration,
) -> Option<(
    memveil_bench::shield::suite::exposure::Exposure,
    memveil_bench::shield::suite::exposure::Exposure,
)> {
    use memveil_bench::shield::suite::{compile_canary, exposure};
    if !have(name, &["cc"]) || !root(name) {
        return None;
    }
    preload_built();
    let dir = TempDir::new(name);
    let exe = compile_canary(&dir.0).expect("canary");
    let warm = Duration::from_secs(2);
    let plain = exposure::measure(&exe, &[], 64, period, warm, run).expect("plain canary");
    assert!(plain.samples > 20, "{plain:?}");
    assert_eq!(
        plain.plaintext, plain.samples,
        "positive control: the sampler must find the plain canary's secret every time: {plain:?}"
    );
    // The canary alone on a host of its own (a private ledger of the host's
    // budget): the property is a lone program's exposure at the defaults.
    // On the real ledger, the other tests of this binary running beside it
    // drew on the same 5% of the host, and below half of it only the
    // coldest bid on the host sweeps: the secret's quick sweep waited
    // behind their pages (85 of 193 samples plaintext, once, in CI).
    let args = on_a_host_of_its_own(&dir);
    let wrap: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsString::as_os_str).collect();
    let prot = exposure::measure(&exe, &wrap, 64, period, warm, run).expect("protected canary");
    Some((plain, prot))
}

#[test]
fn exposure_of_an_idle_secret_measured_from_outside_with_a_positive_control() {
    use memveil_bench::shield::suite::exposure::Period;
    let Some((_, prot)) =
        canary_plain_and_protected("exposure", Period::Once, Duration::from_secs(3))
    else {
        return;
    };
    // The secret is written 2 s in and never read again: at the defaults it
    // leaves within the first sampling fraction (0.998 in the bench's 10 s;
    // lenient here for a loaded CI machine).
    assert!(
        prot.encrypted_fraction() >= 0.8,
        "an idle secret was plaintext in {} of {} samples under the default budget: {prot:?}",
        prot.plaintext,
        prot.samples
    );
}

#[test]
fn a_secret_read_every_100_ms_is_plaintext_only_moments_after_each_read() {
    use memveil_bench::shield::suite::exposure::Period;
    let Some((_, prot)) = canary_plain_and_protected(
        "exposure_100ms",
        Period::EveryMs(100),
        Duration::from_secs(4),
    ) else {
        return;
    };
    assert!(prot.secret_reads >= 30, "{prot:?}");
    // A known quiet page leaves QUICK_MS after each read: ciphertext about
    // 0.97 of the time at the defaults (0.74 when it stayed the shortest
    // period, 25 ms; lenient here for a loaded CI machine).
    assert!(
        prot.encrypted_fraction() >= 0.88,
        "a secret read every 100 ms was plaintext in {} of {} samples under the default budget: {prot:?}",
        prot.plaintext,
        prot.samples
    );
}

#[test]
fn a_cold_server_heap_is_swept_while_it_serves_with_a_positive_control() {
    use memveil_bench::shield::suite::{compile_coldserver, exposure};
    if !have("coldserver", &["cc"]) || !root("coldserver") {
        return;
    }
    preload_built();
    let dir = TempDir::new("coldserver");
    let exe = compile_coldserver(&dir.0).expect("coldserver");
    let run = Duration::from_secs(4);
    let plain = exposure::serve(&exe, &[], 64, 50, 16, run).expect("plain server");
    assert!(
        plain.coverage < 0.01 && plain.rate > 0.0,
        "positive control: the plain server's heap is all present: {plain:?}"
    );
    // A host of its own (a private ledger), as the canaries have: on the
    // real ledger the other tests of this binary running beside it drew on
    // the same 5% of the host, and the server's sweep waited behind them
    // (failed once with the host under a load average of 10).
    let args = on_a_host_of_its_own(&dir);
    let wrap: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsString::as_os_str).collect();
    let prot = exposure::serve(&exe, &wrap, 64, 50, 16, run).expect("protected server");
    // 95% of the 64 MiB is cold: most of it leaves within the run.
    assert!(
        prot.coverage_at_end > 0.8 && prot.rate > 0.0,
        "the cold heap stayed plaintext under the default budget: {prot:?}"
    );
}

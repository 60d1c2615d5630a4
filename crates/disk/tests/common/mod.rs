//! Test harness of the disk server's end-to-end tests: a vault and a disk
//! server as real processes (this test binary run again in a child mode, so
//! the code under test is always the code just built), scratch directories,
//! and the checks that say why a test skips.
//!
//! Every test file declares `#[test] fn child() { common::child_main() }`:
//! a no-op in a normal run; with `MEMVEIL_DISK_CHILD` set it becomes the
//! vault (`memveil vault serve`'s code) or the disk server
//! (`memveil disk serve`'s code) and never returns.
#![allow(dead_code)]

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use memveil_testkit::{skip, Need};

const CHILD: &str = "MEMVEIL_DISK_CHILD";
const ARGS: &str = "MEMVEIL_DISK_CHILD_ARGS";
/// Test only: the disk child acknowledges this write request (counted
/// from one) without storing it (`ServeOpts::test_drop_write`). Read here,
/// in the test harness, and nowhere else.
pub const DROP_WRITE: &str = "MEMVEIL_DISK_TEST_DROP_WRITE";

#[derive(clap::Parser)]
struct VaultCli {
    #[command(flatten)]
    args: memveil_vault::cli::Args,
}

/// The child modes. Returns at once unless `MEMVEIL_DISK_CHILD` is set.
pub fn child_main() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let args: Vec<String> = std::env::var(ARGS)
        .unwrap_or_default()
        .split('\n')
        .map(str::to_owned)
        .collect();
    let code = match mode.as_str() {
        "vault" => {
            use clap::Parser as _;
            let cli = VaultCli::parse_from(std::iter::once("memveil-vault".to_owned()).chain(args));
            match memveil_vault::cli::run(cli.args) {
                Ok(c) => i32::from(c),
                Err(e) => {
                    eprintln!("vault child: {e}");
                    1
                }
            }
        }
        "disk" => disk_child(&args),
        other => {
            eprintln!("unknown child mode {other}");
            2
        }
    };
    std::process::exit(code);
}

/// `memveil disk serve IMAGE --mount M [--vault S] [--no-loop]` in
/// miniature: args are image, mount, vault ("" for none), "loop"/"noloop".
fn disk_child(a: &[String]) -> i32 {
    use std::io::Write as _;
    let stop = memveil_sys::stopflag::stop_on_interrupt().expect("signal handlers");
    let vault = (!a[2].is_empty()).then(|| PathBuf::from(&a[2]));
    let mut o = memveil_disk::ServeOpts::new(PathBuf::from(&a[0]), vault, PathBuf::from(&a[1]));
    o.attach_loop = a[3] == "loop";
    o.lanes_per_thread = a.get(4).and_then(|l| l.parse().ok()).unwrap_or(1);
    o.grace = Duration::from_secs(5);
    o.test_drop_write = std::env::var(DROP_WRITE).ok().and_then(|n| n.parse().ok());
    let r = memveil_disk::serve(&o, stop, |r| {
        // As `memveil disk serve`: these tests run the server under its filter.
        use memveil_sys::seccomp;
        let mode = seccomp::mode(false).expect("MEMVEIL_SECCOMP");
        seccomp::lock_down(
            "disk child",
            &[seccomp::BASE, memveil_disk::seccomp::DISK_SERVE],
            mode,
        )
        .expect("seccomp");
        for line in &r.recovered {
            eprintln!("recovered: {line}");
        }
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "ready device={} file={} level={} pid={}",
            r.device
                .as_ref()
                .map_or_else(|| "none".into(), |d| d.display().to_string()),
            r.file.display(),
            r.level,
            std::process::id()
        );
        let _ = out.flush();
    });
    match r {
        Ok(s) => {
            eprintln!("disk child stopped: {s:?}");
            i32::from(!s.teardown.problems.is_empty())
        }
        Err(e) => {
            eprintln!("disk child: {e}");
            1
        }
    }
}

/// A test's directory: removed, after unmounting and detaching whatever is
/// left in it, when dropped (also when the test fails). Declare it before
/// the servers, so it is dropped after them.
pub struct Scratch(pub PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        cleanup(&self.0);
    }
}

/// A fresh directory for one test.
pub fn scratch(tag: &str) -> Scratch {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "memveil-disk-test-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    Scratch(d)
}

/// Whether we are root; says why the test skips when not.
pub fn root_or_skip() -> bool {
    if memveil_sys::probe::euid() == 0 {
        return true;
    }
    skip(
        Need::Root,
        "mounting FUSE and attaching a loop device need root",
    );
    false
}

/// Whether `/dev/fuse` and loop devices are there; says why not.
pub fn devices_or_skip(want_loop: bool) -> bool {
    match memveil_disk::host::check(want_loop) {
        Ok(()) => true,
        Err(e) => {
            skip(Need::HostSetting("FUSE or loop devices"), e);
            false
        }
    }
}

/// Whether `prog` runs; says which Debian package provides it when not.
pub fn tool_or_skip(prog: &str, package: &'static str) -> bool {
    if Command::new(prog)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
    {
        return true;
    }
    skip(
        Need::Installed(package),
        format!("{prog} not runnable; scripts/install.sh installs Debian's {package}"),
    );
    false
}

/// A child process of this binary that printed a ready line.
pub struct Proc {
    pub child: Option<Child>,
    pub ready: String,
    pub errlog: PathBuf,
}

impl Proc {
    fn start(
        mode: &str,
        args: &[String],
        env: &[(&str, String)],
        errlog: PathBuf,
        want: &str,
    ) -> Result<Proc, String> {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args(["child", "--exact", "--nocapture", "--test-threads=1"])
            .env_remove(DROP_WRITE)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(CHILD, mode)
            .env(ARGS, args.join("\n"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&errlog).expect("stderr log"))
            .spawn()
            .map_err(|e| format!("spawn: {e}"))?;
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let want = want.to_owned();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            // The harness prints its own lines first ("running 1 test").
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line.contains(&want) => {
                        let _ = tx.send(line.clone());
                        break;
                    }
                    Ok(_) => {}
                }
            }
            let mut sink = String::new();
            while r.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => Ok(Proc {
                child: Some(child),
                ready: line.trim().to_owned(),
                errlog,
            }),
            Err(_) => {
                let _ = child.kill();
                let st = child.wait().ok();
                Err(format!(
                    "{mode} did not start: exit {st:?}; stderr:\n{}",
                    std::fs::read_to_string(&errlog).unwrap_or_default()
                ))
            }
        }
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// A `key=value` field of the ready line.
    pub fn field(&self, k: &str) -> String {
        self.ready
            .split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_owned()
    }

    /// What it wrote to stderr.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.errlog).unwrap_or_default()
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then the exit status (SIGKILL after `limit`).
    pub fn term(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = memveil_sys::process::send_signal(c.id(), libc::SIGTERM);
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.term(Duration::from_secs(15));
    }
}

/// A vault in `dir` (socket `dir/vault.sock`).
pub fn vault(dir: &Path) -> Proc {
    let sock = dir.join("vault.sock");
    Proc::start(
        "vault",
        &[
            "serve".into(),
            "--socket".into(),
            sock.display().to_string(),
            "--allow-level".into(),
            "locked".into(),
        ],
        &[],
        dir.join("vault.err"),
        "memveil-vault ready",
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A disk server for `image` at `mount`.
pub fn disk(image: &Path, mount: &Path, vault: Option<&Path>, attach_loop: bool) -> Proc {
    try_disk(image, mount, vault, attach_loop).unwrap_or_else(|e| panic!("{e}"))
}

/// A disk server, or why it did not start.
pub fn try_disk(
    image: &Path,
    mount: &Path,
    vault: Option<&Path>,
    attach_loop: bool,
) -> Result<Proc, String> {
    try_disk_lanes(image, mount, vault, attach_loop, 1)
}

/// [`try_disk`] with `lanes` vault lanes per FUSE worker.
pub fn try_disk_lanes(
    image: &Path,
    mount: &Path,
    vault: Option<&Path>,
    attach_loop: bool,
    lanes: usize,
) -> Result<Proc, String> {
    try_disk_env(image, mount, vault, attach_loop, lanes, &[])
}

/// [`try_disk_lanes`] with environment variables for the child
/// ([`DROP_WRITE`]).
pub fn try_disk_env(
    image: &Path,
    mount: &Path,
    vault: Option<&Path>,
    attach_loop: bool,
    lanes: usize,
    env: &[(&str, String)],
) -> Result<Proc, String> {
    // A dead server's mount point cannot be created (ENOTCONN): the server
    // cleans it up.
    let _ = std::fs::create_dir_all(mount);
    static N: AtomicU32 = AtomicU32::new(0);
    let errlog = image.with_extension(format!("disk-err.{}", N.fetch_add(1, Ordering::SeqCst)));
    Proc::start(
        "disk",
        &[
            image.display().to_string(),
            mount.display().to_string(),
            vault.map(|v| v.display().to_string()).unwrap_or_default(),
            if attach_loop { "loop" } else { "noloop" }.into(),
            lanes.to_string(),
        ],
        env,
        errlog,
        "ready device=",
    )
}

/// What `memveil disk create` makes by default: a new xts128 key made in
/// the vault, 512-byte sectors; tests change fields with `..image_opts(…)`.
pub fn image_opts(image: &Path, sock: &Path, key: &str, size: u64) -> memveil_disk::CreateOpts {
    memveil_disk::CreateOpts {
        image: image.to_owned(),
        size: Some(size),
        cipher: memveil_disk::Cipher::AesXtsPlain64,
        vault: Some(sock.to_owned()),
        key: key.to_owned(),
        source: memveil_disk::KeySource::New,
        key_kind: memveil_vault::proto::KeyKind::Xts128,
        persistent: false,
        sector_size: 512,
        iv_large_sectors: false,
    }
}

/// Runs a command, panicking with its output when it fails.
pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Whether `path` is a mount point now.
pub fn mounted(path: &Path) -> bool {
    memveil_disk::host::mounts().is_ok_and(|ms| ms.iter().any(|m| m.mount_point == path))
}

/// Loop devices backed by a file under `dir`.
pub fn loops_under(dir: &Path) -> usize {
    memveil_disk::host::loops_under(dir).len()
}

/// Removes a test directory after unmounting whatever is left in it.
fn cleanup(dir: &Path) {
    if let Ok(ms) = memveil_disk::host::mounts() {
        let mut left: Vec<PathBuf> = ms
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(dir))
            .collect();
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in left {
            let _ = memveil_sys::mount::unmount(&p, true);
        }
    }
    for l in memveil_disk::host::loops_under(dir) {
        let _ = Command::new("losetup").arg("-d").arg(&l.path).status();
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A small deterministic generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

//! `memveil run`: run an unmodified program with its heap kept as
//! ciphertext outside a bounded plaintext window (memveil-shield through the
//! preload library for a dynamically linked program, through the
//! memveil-shield-loader ELF loader for a statically linked one: Go, musl,
//! glibc `-static`).

use std::ffi::OsString;
use std::io::Write as _;
use std::os::unix::fs::DirBuilderExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use memveil_shield::{Mechanism, StatsFile, KEYIDS};

use super::run_cgroup::{self, Program, ProgramCgroup};
use super::run_keyid::{self, HostKeyId};
use super::run_report::{advice, guarantee_line, summary, Guarantee};

const PRELOAD: &str = "libmemveil_shield_preload.so";
const LOADER: &str = "memveil-shield-loader";

/// `memveil run --help`, after the options: what the command does, what it
/// needs, its exit statuses and examples.
const AFTER_LONG_HELP: &str = "\
The program's heap (malloc, calloc, realloc, ..., its anonymous private read-write
mmaps and sbrk) is kept as AES-XTS ciphertext. By default within a cost budget
(--max-overhead, 10% of its time): every page idle longer than its sweep period is
encrypted, however large the heap. With --window or --max-plaintext a plaintext bound
is never exceeded, whatever it costs. Pages come back on touch through userfaultfd,
also when the kernel touches them inside read(2), write(2), recv(2); a fault that
continues a sequential scan brings in a run of up to 64 pages. At exit a summary line
gives the counters, a line the guarantee in force and what it achieved, and a line
of advice on what more protection (or less cost) would take.

The program runs in a cgroup v2 of its own (memveil-run-PID, under memveil run's): all
of it is killed when memveil run is killed, even with SIGKILL (a guardian process does
it); what it leaves running after a normal end (a daemon) goes on. Where no cgroup v2 is writable
memveil run says why at start and runs the program without; MEMVEIL_RUN_CGROUP=off turns
it off.

A statically linked program (Go, musl, glibc -static, static-pie) runs through
memveil-shield-loader: an ELF loader that maps it, starts the shield and an agent
thread in its process, and serves its mmap/munmap/mremap/brk/madvise/mprotect calls
from the protected region (seccomp user notification). What it cannot cover is named
at start: the program's .data/.bss and initial stack, the programs it executes; a
fork (without CLONE_VM) is refused with EAGAIN.

Needs: Linux 5.7+ (6.8+ for wiped eviction; 5.19+ for a static program), userfaultfd
permitted (root, or vm.unprivileged_userfaultfd=1, or access to /dev/userfaultfd).

Exit status: the program's (128+N when killed by signal N); 1 when memveil refuses to
start it; 125 when the shield failed inside the program before it ran; 123 when the
program was stopped because its host KeyID (--keyid) was cleared or programmed again,
or the vault holding it went away.

Examples:
  memveil run -- python3 job.py                   # a cost budget of 10% of its time
  memveil run --max-overhead 20 -- ./server       # more protection, at up to 20%
  memveil run --window 4096 -- redis-server       # a fixed 16 MiB window: security first
  memveil run --max-plaintext 64M --stats-json s.json -- sqlite3 db.sqlite 'select 1'
  memveil run --keyid 5 -- ./server               # a tenant of host KeyID 5 (memveil key)
  memveil run --user postgres --shared-memory protected,sysv=unprotected \\
      --accept-unwiped-free -- /usr/lib/postgresql/15/bin/postgres -D DATA

See docs/shield.md.";

/// Flags of `memveil run`.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// Cost budget: at most this % of the time on faults (default 10)
    ///
    /// The cost budget, the default guarantee: the most of the program's
    /// time faults and evictions may take (default 10%). Within it every
    /// page idle longer than its sweep period (25 ms for a page used
    /// rarely, up to 12.8 s for one in constant use) is ciphertext, however
    /// large the heap; a page in use stays plaintext, so a heap in constant
    /// use may stay mostly plaintext (the summary reports the time-weighted
    /// plaintext fraction). With --window or --max-plaintext the bound
    /// applies too, and wins: it is never exceeded to meet the budget.
    #[arg(long, value_name = "PERCENT", value_parser = parse_overhead, allow_negative_numbers = true,
          help_heading = "Protection", verbatim_doc_comment)]
    max_overhead: Option<u8>,
    /// Fixed plaintext bound: PAGES pages per process
    ///
    /// Keep exactly this many pages of the heap (at most) as plaintext, per
    /// process: the fixed, security-first bound (4096 pages = 16 MiB is a
    /// good start), whatever it costs. Alone it replaces the budget; with
    /// --max-overhead both apply.
    #[arg(long, value_name = "PAGES", conflicts_with = "max_plaintext",
          value_parser = clap::value_parser!(u64).range(1..=(1 << 30)),
          help_heading = "Protection", verbatim_doc_comment)]
    window: Option<u64>,
    /// Adaptive plaintext bound (% of data, or a size)
    ///
    /// A security-first bound that adapts: the most plaintext a window may
    /// keep, per process, as a percentage of the pages holding data (never
    /// below 4096 pages) or a size (bytes, or with K, M, G). The window
    /// starts at 4096 pages (or the size, if smaller), grows when the program
    /// faults on pages it evicted very recently, gives pages back in quiet
    /// seconds, and never exceeds this bound, whatever it costs. Alone it
    /// replaces the budget; with --max-overhead both apply.
    #[arg(long, value_name = "SIZE|PERCENT", value_parser = parse_bound,
          help_heading = "Protection", verbatim_doc_comment)]
    max_plaintext: Option<memveil_shield::Bound>,
    /// Run as a tenant of host KeyID N, with the KeyID's page key
    ///
    /// Run as a tenant under KeyID N of the host key table the vault holds
    /// (`memveil key program`): every process of the program encrypts its
    /// heap and shared memory under the KeyID's page key, which the vault
    /// derives from the KeyID's key and this command passes to the program in
    /// a memfd_secret file. Programs under one KeyID share a key; clearing or
    /// reprogramming it stops them (exit status 123). Needs a uid that may
    /// program KeyIDs (root, the vault's owner, --key-admin); --user then
    /// runs the program as another user. Without --keyid each process draws
    /// fresh random keys of its own.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(0..i64::from(KEYIDS)),
          help_heading = "Keys", verbatim_doc_comment)]
    keyid: Option<u16>,
    /// The vault holding the host key table (with --keyid)
    ///
    /// The vault holding the host key table (default: $MEMVEIL_VAULT_SOCKET
    /// or /run/memveil/vault.sock).
    #[arg(
        long,
        value_name = "SOCKET",
        requires = "keyid",
        help_heading = "Keys",
        verbatim_doc_comment
    )]
    vault: Option<PathBuf>,
    /// Accept a no-encrypt KeyID: the program runs unprotected
    ///
    /// Run the program under a no-encrypt KeyID (KEYID_NO_ENCRYPT): its
    /// memory stays plaintext, and the summary says so. Refused without this.
    #[arg(long, requires = "keyid", help_heading = "Keys", verbatim_doc_comment)]
    accept_no_encrypt: bool,
    /// Print a statistics line to stderr every SECS seconds
    #[arg(long, value_name = "SECS", help_heading = "Reporting")]
    live: Option<f64>,
    /// Write the final statistics and the plaintext fraction over time as JSON
    #[arg(long, value_name = "FILE", help_heading = "Reporting")]
    stats_json: Option<PathBuf>,
    /// No summary line at exit
    #[arg(long, help_heading = "Reporting")]
    quiet: bool,
    /// Microseconds the fault handler polls before sleeping
    ///
    /// Microseconds the fault handler polls for the next fault before sleeping
    /// (0: sleep at once, measured fastest on this VM).
    #[arg(
        long,
        value_name = "US",
        default_value_t = 0,
        help_heading = "Advanced",
        verbatim_doc_comment
    )]
    spin_us: u64,
    /// Accept mlock-ed memory for keys
    ///
    /// Accept a weaker home for the keys when memfd_secret is unavailable
    /// ("locked": mlock-ed memory, readable by root), as `memveil vault
    /// serve --allow-level`.
    #[arg(long, value_name = "LEVEL", value_parser = ["secret", "locked"],
          help_heading = "Keys", verbatim_doc_comment)]
    allow_level: Option<String>,
    /// Accept eviction by write-protection: frames freed unwiped
    ///
    /// Accept evicting by write-protection on kernels without UFFDIO_MOVE
    /// (frames go back to the kernel unwiped; boot with init_on_free=1).
    /// --shared-memory protected needs it too.
    #[arg(long, help_heading = "Protection", verbatim_doc_comment)]
    accept_unwiped_free: bool,
    /// Shared memory: refuse|protected|unprotected
    ///
    /// Shared memory: MODE[,KIND=MODE...] (kinds: anonymous, memfd, sysv).
    /// "refuse" fails those mappings with ENOMEM and a message;
    /// "protected" keeps MAP_SHARED|MAP_ANONYMOUS memory as ciphertext for
    /// the program and every process it forks (needs --accept-unwiped-free:
    /// evicted shared frames go back to the kernel unwiped), and refuses the
    /// kinds any process may attach (memfd, System V) unless an override
    /// lets them through, e.g. "protected,sysv=unprotected" (PostgreSQL);
    /// "unprotected" lets them through as plaintext. The summary reports
    /// both.
    #[arg(long, value_name = "POLICY", value_parser = shared_policy, default_value = "refuse",
          help_heading = "Protection", verbatim_doc_comment)]
    shared_memory: String,
    /// The preload library (default: beside memveil, else the package's)
    ///
    /// The preload library (default: next to this executable, else where the
    /// memveil package puts it, /usr/lib/x86_64-linux-gnu/memveil/).
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "Advanced",
        verbatim_doc_comment
    )]
    preload: Option<PathBuf>,
    /// How the shield reaches the program: loader or preload (expert)
    ///
    /// How the shield reaches the program (default: the preload for a
    /// dynamically linked program, the loader for a statically linked one;
    /// the loader runs dynamically linked ones too, with their own malloc).
    #[arg(long, value_name = "HOW", value_enum, hide = true)]
    via: Option<Via>,
    /// Size of the protected region the heap lives in, GiB
    ///
    /// Size of the protected region the heap lives in, GiB (address space:
    /// a full region refuses further memory with ENOMEM).
    #[arg(long, value_name = "GIB", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024),
          help_heading = "Advanced", verbatim_doc_comment)]
    region_gib: u64,
    /// Run the program and its fault handler on this one CPU
    ///
    /// Run the program, and so its fault handler, on this one CPU (as
    /// `taskset -c N`): the fault hand-off then never crosses CPUs, where a
    /// wake-up costs tens of microseconds on a VM. Without it the handler
    /// runs at SCHED_IDLE (so the scheduler keeps the woken thread on the
    /// handler's CPU) and follows the thread that faults (its CPU read on
    /// every fault). Default: wherever the scheduler puts the program.
    #[arg(
        long,
        value_name = "N",
        help_heading = "Advanced",
        verbatim_doc_comment
    )]
    cpu: Option<usize>,
    /// Whose malloc to use
    ///
    /// Whose malloc the program uses. auto: a program linked against its
    /// own allocator (jemalloc, tcmalloc, mimalloc, snmalloc) keeps it, loaded
    /// ahead of memveil's library, and every page that allocator maps comes
    /// from the protected region (redis: its size-class slabs keep hot
    /// metadata apart from cold values, 1.4-2.6x the throughput of memveil's
    /// allocator here); any other program gets memveil's allocator in place
    /// of the C library's. memveil: always memveil's.
    #[arg(long, value_name = "WHICH", value_enum, default_value_t = Allocator::Auto, help_heading = "Advanced",
          verbatim_doc_comment)]
    allocator: Allocator,
    /// Run as this user, keeping only CAP_SYS_PTRACE
    ///
    /// Run as this user (for servers that refuse root, such as PostgreSQL):
    /// memveil run, as root, opens --stats-json, then becomes USER for good
    /// (its groups, uid and gid) keeping of root's capabilities only
    /// CAP_SYS_PTRACE, as an ambient capability the program inherits: with
    /// vm.unprivileged_userfaultfd=0 the fault handler needs it to serve
    /// faults taken inside system calls (with the sysctl at 1 nothing is
    /// kept). The counters and the program then belong to USER alone.
    #[arg(
        long,
        value_name = "USER",
        help_heading = "Advanced",
        verbatim_doc_comment
    )]
    user: Option<String>,
    /// The program and its arguments
    ///
    /// The program and its arguments. memveil run's own options come before
    /// the program (an unknown one is refused, with the close one named);
    /// everything from the program on is the program's (`--` before it is
    /// optional).
    #[arg(
        required = true,
        trailing_var_arg = true,
        value_name = "PROGRAM",
        verbatim_doc_comment
    )]
    command: Vec<OsString>,
}

fn parse_bound(s: &str) -> Result<memveil_shield::Bound, String> {
    memveil_shield::Bound::parse(s)
}

fn parse_overhead(s: &str) -> Result<u8, String> {
    memveil_shield::Budget::parse_percent(s)
}

impl Args {
    /// The program and its arguments, as given.
    #[cfg(test)]
    pub(crate) fn program_and_args(&self) -> &[OsString] {
        &self.command
    }

    /// The guarantee asked for.
    fn guarantee(&self) -> Guarantee {
        Guarantee {
            budget: self.budget(),
            window: self.window,
            max_plaintext: self.max_plaintext,
        }
    }

    /// The budget in force, in percent: the one asked for, or the default
    /// when no plaintext bound replaces it.
    fn budget(&self) -> Option<u8> {
        match (self.max_overhead, self.window, self.max_plaintext) {
            (Some(p), _, _) => Some(p),
            (None, None, None) => Some(memveil_shield::Budget::DEFAULT_PERCENT),
            _ => None,
        }
    }
}

/// `--via`: how the shield reaches the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Via {
    /// memveil-shield-loader (statically linked programs).
    Loader,
    /// The LD_PRELOAD library (dynamically linked programs).
    Preload,
}

/// `--allocator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Allocator {
    Auto,
    Memveil,
}

/// Where `memveil run` looks for the preload library, in order: next to
/// the executable (target/release), the Debian package's place relative to
/// it (`/usr/bin/memveil` → `/usr/lib/x86_64-linux-gnu/memveil/`, so a
/// package unpacked under another root works too), `../lib/memveil`, the
/// parent directory, then the absolute Debian paths.
fn preload_candidates(exe_dir: &Path) -> Vec<PathBuf> {
    let multiarch = format!("{}-linux-gnu", std::env::consts::ARCH);
    vec![
        exe_dir.join(PRELOAD),
        exe_dir
            .join("../lib")
            .join(&multiarch)
            .join("memveil")
            .join(PRELOAD),
        exe_dir.join("../lib/memveil").join(PRELOAD),
        exe_dir.join("..").join(PRELOAD),
        Path::new("/usr/lib")
            .join(&multiarch)
            .join("memveil")
            .join(PRELOAD),
        Path::new("/usr/lib/memveil").join(PRELOAD),
    ]
}

fn find_preload(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        anyhow::ensure!(p.is_file(), "preload library {} not found", p.display());
        return Ok(p.to_path_buf());
    }
    let exe = std::env::current_exe().context("locating the memveil executable")?;
    let candidates = preload_candidates(exe.parent().unwrap_or(Path::new(".")));
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    let searched: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "{PRELOAD} not found; searched {}: install the memveil package (scripts/install.sh), \
         build it with `cargo build --release -p memveil-shield-preload`, or pass --preload PATH",
        searched.join(", ")
    )
}

/// Where `memveil run` looks for memveil-shield-loader: next to the
/// executable (target/release, /usr/bin), then beside the preload library's
/// places (the Debian package's `/usr/lib/x86_64-linux-gnu/memveil/`).
fn find_loader() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the memveil executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates: Vec<PathBuf> = std::iter::once(dir.join(LOADER))
        .chain(
            preload_candidates(dir)
                .iter()
                .filter_map(|p| p.parent().map(|d| d.join(LOADER))),
        )
        .collect();
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    let searched: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "{LOADER} (which runs statically linked programs) not found; searched {}: install the \
         memveil package (scripts/install.sh) or build it with \
         `cargo build --release -p memveil-shield-loader`",
        searched.join(", ")
    )
}

/// What a statically linked program run through the loader leaves
/// unprotected, said at start.
fn loader_limits(program: &str, dynamic: bool, go: bool) -> String {
    let how = if go {
        format!(
            "is a dynamically linked Go program (Go maps its heap by raw system call, which a \
             preload library cannot see): it runs through {LOADER}"
        )
    } else if dynamic {
        format!("is dynamically linked, run through {LOADER} as --via loader asks")
    } else {
        format!("is statically linked: it runs through {LOADER}")
    };
    format!(
        "{program} {how}, its memory calls served from \
         the protected region; not covered: its .data/.bss, its initial stack and the thread \
         stacks a C library maps (MAP_STACK), and the programs \
         it executes (they run unprotected; what it leaves running works on after it ends, \
         its calls let through by a process memveil-keeper); a fork without CLONE_VM is \
         refused (EAGAIN), \
         and so is an execve in place (EPERM); \
         /proc/PID/exe names the loader"
    )
}

fn resolve(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return Some(program.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

/// What `memveil run` needs to know of an executable: whether it asks for a
/// dynamic loader (PT_INTERP; only then does LD_PRELOAD take effect;
/// scripts, `#!`, are dynamic through their interpreter) and the libraries
/// it names (DT_NEEDED), and whether Go's linker built it.
pub(super) struct Elf {
    dynamic: bool,
    needed: Vec<String>,
    /// A `#!` script (dynamic through its interpreter).
    script: bool,
    /// Built by Go's linker ([`super::run_go::is_go`]).
    pub(super) go: bool,
}

fn elf_info(path: &Path) -> anyhow::Result<Elf> {
    // Only the parts it needs are read (the header, the program headers,
    // the dynamic section and the names it points at): a whole read of
    // python3 (6.8 MB) took memveil run 6 ms of CPU, every run.
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let head = FileBytes(&file)
        .bytes_at(0, 64)
        .with_context(|| format!("reading {}", path.display()))?;
    if head.starts_with(b"#!") {
        return Ok(Elf {
            dynamic: true,
            needed: Vec::new(),
            script: true,
            go: false,
        });
    }
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 {
        bail!(
            "{} is not a 64-bit ELF executable or a script",
            path.display()
        );
    }
    Ok(parse_elf(&FileBytes(&file)))
}

/// Bytes of a file by offset, as [`parse_elf`] reads them.
pub(super) trait BytesAt {
    /// Up to `n` bytes from offset `off` (fewer at the end of the file;
    /// an error past it).
    fn bytes_at(&self, off: u64, n: usize) -> std::io::Result<Vec<u8>>;
}

impl BytesAt for [u8] {
    fn bytes_at(&self, off: u64, n: usize) -> std::io::Result<Vec<u8>> {
        let rest = usize::try_from(off)
            .ok()
            .and_then(|o| self.get(o..))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        Ok(rest[..n.min(rest.len())].to_vec())
    }
}

/// An open file read with `pread(2)`.
pub(super) struct FileBytes<'a>(pub(super) &'a std::fs::File);

impl BytesAt for FileBytes<'_> {
    fn bytes_at(&self, off: u64, n: usize) -> std::io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt as _;
        let mut buf = vec![0u8; n];
        let mut got = 0;
        while got < n {
            let at = off
                .checked_add(got as u64)
                .ok_or(std::io::ErrorKind::UnexpectedEof)?;
            match self.0.read_at(&mut buf[got..], at) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if got == 0 && n > 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.truncate(got);
        Ok(buf)
    }
}

/// The most [`parse_elf`] reads in one piece (the program headers, the
/// dynamic section): more is a malformed file, whose rest is ignored.
const ELF_PIECE_MAX: u64 = 1 << 20;

/// The `n`-byte (at most 8) little-endian field at `at` of `b`, if `b`
/// holds it.
pub(super) fn field(b: &[u8], at: u64, n: usize) -> Option<u64> {
    let o = usize::try_from(at).ok()?;
    let b = b.get(o..o.checked_add(n)?)?;
    let mut v = [0u8; 8];
    v.get_mut(..n)?.copy_from_slice(b);
    Some(u64::from_le_bytes(v))
}

/// [`elf_info`] on a 64-bit little-endian ELF file, reading only the parts
/// it needs. Every offset comes from the file, so every sum is checked: a
/// malformed file yields fewer headers or names, never a panic.
pub(super) fn parse_elf(file: &(impl BytesAt + ?Sized)) -> Elf {
    // `len` bytes from `off` (capped), or nothing.
    let piece = |off: u64, len: u64| {
        file.bytes_at(off, usize::try_from(len.min(ELF_PIECE_MAX)).unwrap_or(0))
            .unwrap_or_default()
    };
    let head = piece(0, 64);
    let phoff = field(&head, 0x20, 8).unwrap_or(0);
    let phentsize = field(&head, 0x36, 2).unwrap_or(0);
    let phnum = field(&head, 0x38, 2).unwrap_or(0);
    // (type, file offset, virtual address, file size) of each program
    // header, from the table read in one piece.
    let table = piece(phoff, phnum.saturating_mul(phentsize).saturating_add(0x28));
    let headers: Vec<(u64, u64, u64, u64)> = (0..phnum)
        .filter_map(|i| {
            let h = i.checked_mul(phentsize)?;
            Some((
                field(&table, h, 4)?,
                field(&table, h.checked_add(0x08)?, 8)?,
                field(&table, h.checked_add(0x10)?, 8)?,
                field(&table, h.checked_add(0x20)?, 8)?,
            ))
        })
        .collect();
    let dynamic = headers.iter().any(|h| h.0 == 3);
    // DT_NEEDED names: offsets into the string table DT_STRTAB points at
    // (a virtual address, mapped to the file through the PT_LOAD headers).
    let mut needed_off = Vec::new();
    let mut strtab = None;
    if let Some(&(_, off, _, size)) = headers.iter().find(|h| h.0 == 2) {
        let section = piece(off, size);
        for k in 0..size / 16 {
            let (Some(tag), Some(val)) =
                (field(&section, 16 * k, 8), field(&section, 16 * k + 8, 8))
            else {
                break;
            };
            match tag {
                0 => break,
                1 => needed_off.push(val),
                5 => strtab = Some(val),
                _ => {}
            }
        }
    }
    let strtab_file = strtab.and_then(|va| {
        headers
            .iter()
            .find(|h| h.0 == 1 && va >= h.2 && va - h.2 < h.3)
            .and_then(|h| (va - h.2).checked_add(h.1))
    });
    let needed = strtab_file.map_or_else(Vec::new, |base| {
        needed_off
            .iter()
            .filter_map(|&o| {
                // A library's name, up to its NUL within a page.
                let rest = piece(base.checked_add(o)?, 4096);
                let end = rest.iter().position(|&b| b == 0)?;
                std::str::from_utf8(&rest[..end]).ok().map(str::to_owned)
            })
            .collect()
    });
    // PT_NOTE segments: where Go's build-id note would be.
    let notes: Vec<(u64, u64)> = headers
        .iter()
        .filter(|h| h.0 == 4)
        .map(|h| (h.1, h.3))
        .collect();
    Elf {
        dynamic,
        needed,
        script: false,
        go: super::run_go::is_go(file, &head, &notes),
    }
}

/// The malloc implementations a program may bring (DT_NEEDED name prefixes).
const OWN_ALLOCATORS: [&str; 5] = [
    "libjemalloc.so",
    "libtcmalloc.so",
    "libtcmalloc_minimal.so",
    "libmimalloc.so",
    "libsnmalloc",
];

/// The allocator library the program links, if it is one memveil keeps.
fn own_allocator(needed: &[String]) -> Option<&str> {
    needed
        .iter()
        .find(|n| OWN_ALLOCATORS.iter().any(|a| n.starts_with(a)))
        .map(String::as_str)
}

/// Checks a `--shared-memory` setting (the preload parses the same words).
fn shared_policy(s: &str) -> Result<String, String> {
    memveil_shield::parse_shared_policy(s).map(|_| s.to_owned())
}

/// Runs `memveil run`.
pub fn run(a: Args) -> anyhow::Result<u8> {
    let _ = RUN_START.set((Instant::now(), time_since_exec_ns()));
    let program = PathBuf::from(&a.command[0]);
    let Some(path) = resolve(&program) else {
        bail!("{}: command not found in PATH", program.display());
    };
    let elf = elf_info(&path)?;
    // Go maps its heap by raw system call, out of a preload library's
    // sight, even in a dynamically linked (cgo) Go program.
    let go = elf.dynamic && elf.go;
    let via = match (a.via, elf.dynamic) {
        (Some(Via::Preload), true) if go => bail!(
            "--via preload: {} is a Go program: Go maps its heap by raw system call, which a \
             preload library cannot see, so it would run unprotected; drop --via to use the loader",
            path.display()
        ),
        (Some(Via::Loader), true) if elf.script => bail!(
            "--via loader: {} is a script: the loader runs ELF executables only; run its \
             interpreter with --via loader, or drop --via",
            path.display()
        ),
        (Some(Via::Preload), false) => bail!(
            "--via preload: {} is statically linked: a preload library cannot reach its \
             allocator, so it would run unprotected; drop --via to use the loader",
            path.display()
        ),
        (Some(v), _) => v,
        (None, true) if !go => Via::Preload,
        (None, _) => Via::Loader,
    };
    let shim = match via {
        Via::Preload => find_preload(a.preload.as_deref())?,
        Via::Loader => find_loader()?,
    };
    if via == Via::Loader {
        eprintln!(
            "memveil run: {}",
            loader_limits(&path.display().to_string(), elf.dynamic, go)
        );
    }
    // Opened before --user gives up root, so it may name a place only root
    // can write.
    let json_out = a
        .stats_json
        .as_deref()
        .map(|p| std::fs::File::create(p).with_context(|| format!("creating {}", p.display())))
        .transpose()?;
    // Before --user gives up root: the cgroup's files are opened and its
    // guardian started as the operator. Before the KeyID's key file exists:
    // the guardian, forked here, never holds it (it closes what it inherits,
    // but a program that ended before it did found it holding the key, and
    // memveil run then stayed a second for it).
    let mut cgroup = run_cgroup::setup(&a.command[0].to_string_lossy());
    // Asked for as the operator, before --user gives that up.
    let mut host = match a.keyid {
        Some(k) => Some(HostKeyId::fetch(
            &a.vault
                .clone()
                .unwrap_or_else(memveil_vault::cli::default_socket),
            k,
            a.accept_no_encrypt,
            key_policy(&a),
        )?),
        None => None,
    };
    // The host's budget and registry, opened and made as the operator too.
    let host_budget = match a.budget() {
        Some(_) => super::shield::join_host(),
        None => Err("a plaintext bound alone (no cost budget to share)".to_owned()),
    };
    let runs = super::shield::runs_dir();
    if let Some(name) = &a.user {
        switch_user(name)?;
        // The loader skips a preload library it cannot read, with a mere
        // warning: the program would run unprotected.
        std::fs::File::open(&shim).with_context(|| {
            format!(
                "--user {name}: the user cannot read {} (the loader would skip it and run the \
                 program unprotected): install memveil where every user can read it \
                 (scripts/install.sh), or pass --preload PATH",
                shim.display()
            )
        })?;
    }
    if let Some(h) = host.as_mut() {
        h.watch()?;
    }
    // As the user, with what it kept: the check proves that its fault
    // handler may serve faults inside system calls.
    let mechanism = memveil_shield::check()?;
    if mechanism == Mechanism::WriteProtect && !a.accept_unwiped_free {
        bail!(memveil_shield::ShieldError::UnwipedEviction);
    }
    let shared = memveil_shield::parse_shared_policy(&a.shared_memory).map_err(|e| anyhow!(e))?;
    if shared[memveil_shield::SharedKind::Anonymous as usize] == memveil_shield::SharedMode::Protect
        && !a.accept_unwiped_free
    {
        bail!(
            "--shared-memory protected: evicted pages of shared memory go back to the kernel \
             unwiped (no process can wipe a frame another process may be reading at that \
             moment); pass --accept-unwiped-free to accept it (and boot with init_on_free=1 so \
             the kernel wipes them), or use --shared-memory refuse"
        );
    }
    // The run's entry in the host's registry (made by the user it runs as,
    // readable by all: `memveil shield status`) is its statistics
    // directory; where there is none, a private temporary one.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let info = super::shield::RunJson {
        pid: std::process::id(),
        start_ticks: super::shield::proc_start(std::process::id()).map_or(0, |s| s.0),
        command: a
            .command
            .iter()
            .map(|c| c.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
        keyid: a.keyid,
        guarantee: a.guarantee().label(),
        budget_percent: a.budget(),
        start_unix: now.as_secs(),
        host_budget: match &host_budget {
            Ok((_, v)) => {
                format!("joined {}", super::shield::ledger_path().display())
                    + &format!(" ({} ns of CPU per s)", v.rate_ns_per_s)
            }
            Err(e) => format!("own budget only: {e}"),
        },
    };
    let listed = runs.and_then(|r| super::shield::register(&r, &info));
    let stats_dir = match &listed {
        Ok(d) => d.clone(),
        Err(_) => {
            let d = std::env::temp_dir().join(format!(
                "memveil-run-{}-{}",
                std::process::id(),
                now.subsec_nanos()
            ));
            // The program's own (created by the user it runs as), private to it.
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&d)
                .with_context(|| format!("creating {}", d.display()))?;
            d
        }
    };
    let shared = Host {
        budget: host_budget,
        listed: listed.map(|_| ()),
    };
    let keep = match a.allocator {
        Allocator::Auto => own_allocator(&elf.needed).map(str::to_owned),
        Allocator::Memveil => None,
    };
    let r = supervise(
        &a,
        (via, &shim),
        keep.as_deref(),
        &stats_dir,
        json_out,
        host.as_ref(),
        &shared,
        &mut cgroup,
    );
    if let Ok(cg) = cgroup {
        // Removed now when empty, else by the guardian once it is (which
        // says so when it cannot).
        let _ = cg.finish();
    }
    let _ = std::fs::remove_dir_all(&stats_dir);
    r
}

/// The weakest home for keys `--allow-level` accepts.
fn key_policy(a: &Args) -> memveil_secmem::Policy {
    if a.allow_level.as_deref() == Some("locked") {
        memveil_secmem::Policy::allow(memveil_secmem::Level::Locked)
    } else {
        memveil_secmem::Policy::secret_only()
    }
}

/// `--user NAME`: this process becomes the user for good, keeping
/// CAP_SYS_PTRACE (ambient, so the program inherits it) unless
/// `vm.unprivileged_userfaultfd=1` makes it needless.
fn switch_user(name: &str) -> anyhow::Result<()> {
    use memveil_sys::process;
    let user = process::lookup_user(name)
        .with_context(|| format!("--user {name}: looking up the user"))?
        .with_context(|| format!("--user {name}: no such user"))?;
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd");
    let keep = match sysctl.as_deref().map(str::trim) {
        Ok("1") => None,
        _ => Some(process::CAP_SYS_PTRACE),
    };
    process::become_user(&user, keep).with_context(|| {
        format!(
            "--user {name}: becoming uid {} gid {} (memveil run must start as root)",
            user.uid, user.gid
        )
    })
}

/// The host's shield as this run found it: the budget it draws on (the
/// ledger, open, with the budget it named) or why not, and whether it is
/// listed in the registry (`memveil shield status`) or why not.
struct Host {
    budget: Result<(std::fs::File, memveil_shield::host::LedgerView), String>,
    listed: Result<(), String>,
}

impl Host {
    /// The summary's `host:` line.
    fn line(&self, s: &memveil_shield::Snapshot) -> String {
        let budget = match &self.budget {
            Ok((_, v)) if s.host_joined > 0 => format!(
                "drew on the host's budget ({}: {}) and its own{}; held back {} sweep step(s) for \
                 the host and {} for colder pages of other programs",
                super::shield::ledger_path().display(),
                host_rate(v),
                if s.host_joined < s.processes {
                    format!(" ({} of {} processes)", s.host_joined, s.processes)
                } else {
                    String::new()
                },
                s.host_waits,
                s.host_colder
            ),
            Ok(_) => "own budget only: no process joined the host's budget (see the \
                      memveil-shield messages above)"
                .to_owned(),
            Err(why) => format!("own budget only: {why}"),
        };
        let listed = match &self.listed {
            Ok(()) => "listed in `memveil shield status`".to_owned(),
            Err(why) => format!("not listed in `memveil shield status`: {why}"),
        };
        format!("host: {budget}; {listed}")
    }

    /// `--stats-json`'s `host_budget`.
    fn json(&self, s: &memveil_shield::Snapshot) -> serde_json::Value {
        serde_json::json!({
            "joined": self.budget.is_ok() && s.host_joined > 0,
            "processes_joined": s.host_joined,
            "ledger": super::shield::ledger_path(),
            "budget_ns_per_s": self.budget.as_ref().ok().map(|(_, v)| v.rate_ns_per_s),
            "why_not": self.budget.as_ref().err(),
            "host_waits": s.host_waits,
            "host_colder": s.host_colder,
            "listed": self.listed.is_ok(),
            "why_not_listed": self.listed.as_ref().err(),
        })
    }
}

/// A host budget in words.
fn host_rate(v: &memveil_shield::host::LedgerView) -> String {
    #[allow(clippy::cast_precision_loss)]
    let ms = v.rate_ns_per_s as f64 / 1e6;
    format!(
        "{ms:.1} ms of CPU per s, {:.1}% of {} CPUs",
        v.budget_fraction() * 100.0,
        v.cpus
    )
}

/// Runs the program with the preload (after `keep`, the program's own
/// allocator library, when given) or through the loader, and reports.
#[allow(clippy::too_many_arguments)]
fn supervise(
    a: &Args,
    (via, shim): (Via, &Path),
    keep: Option<&str>,
    stats_dir: &Path,
    json_out: Option<std::fs::File>,
    host: Option<&HostKeyId>,
    shared: &Host,
    cgroup: &mut Result<ProgramCgroup, String>,
) -> anyhow::Result<u8> {
    let mut ld = OsString::new();
    if let Some(lib) = keep {
        // A bare soname: the loader finds it as it finds DT_NEEDED entries.
        ld.push(lib);
        ld.push(":");
    }
    ld.push(shim.as_os_str());
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    let flag = |b: bool| if b { "1" } else { "0" };
    let mut cmd = Command::new(&a.command[0]);
    if host.is_some_and(HostKeyId::no_encrypt) {
        // KEYID_NO_ENCRYPT, accepted: the program runs as it is.
    } else if via == Via::Loader {
        // The loader is the process and enters the program; a preload
        // library inherited from outside would replace the loader's malloc.
        cmd = Command::new(shim);
        cmd.arg(&a.command[0]).env_remove("LD_PRELOAD");
    } else {
        cmd.env("LD_PRELOAD", ld);
    }
    match host.and_then(HostKeyId::fd) {
        Some(fd) => {
            cmd.env("MEMVEIL_SHIELD_KEY_FD", fd.to_string())
                .env("MEMVEIL_SHIELD_SUPERVISOR", std::process::id().to_string());
        }
        // A memveil run inside a tenant: fresh keys, not the outer tenant's.
        None => {
            cmd.env_remove("MEMVEIL_SHIELD_KEY_FD")
                .env_remove("MEMVEIL_SHIELD_SUPERVISOR");
        }
    }
    cmd.args(&a.command[1..])
        .env(
            "MEMVEIL_SHIELD_KEYID",
            host.map_or(1, HostKeyId::keyid).to_string(),
        )
        .env("MEMVEIL_SHIELD_STATS_DIR", stats_dir)
        .env("MEMVEIL_SHIELD_SPIN_US", a.spin_us.to_string())
        .env("MEMVEIL_SHIELD_REGION_GIB", a.region_gib.to_string())
        .env(
            "MEMVEIL_SHIELD_ALLOW_LOCKED",
            flag(a.allow_level.as_deref() == Some("locked")),
        )
        .env("MEMVEIL_SHIELD_ACCEPT_UNWIPED", flag(a.accept_unwiped_free))
        .env("MEMVEIL_SHIELD_SHARED", &a.shared_memory);
    // The guarantee: a budget, a bound, or both (the preload reads what is
    // set; nothing inherited from an outer memveil run may stay).
    match a.window {
        Some(w) => cmd.env("MEMVEIL_SHIELD_WINDOW", w.to_string()),
        None => cmd.env_remove("MEMVEIL_SHIELD_WINDOW"),
    };
    match a.max_plaintext {
        Some(b) => cmd.env("MEMVEIL_SHIELD_MAX_PLAINTEXT", b.to_arg()),
        None => cmd.env_remove("MEMVEIL_SHIELD_MAX_PLAINTEXT"),
    };
    // The host's budget (nothing inherited from an outer memveil run).
    match &shared.budget {
        Ok((f, _)) => cmd.env(
            "MEMVEIL_SHIELD_HOST_FD",
            std::os::fd::AsRawFd::as_raw_fd(f).to_string(),
        ),
        Err(_) => cmd.env_remove("MEMVEIL_SHIELD_HOST_FD"),
    };
    match a.budget() {
        Some(p) => {
            let ns = super::run_calibrate::handoff_ns();
            cmd.env("MEMVEIL_SHIELD_MAX_OVERHEAD", p.to_string())
                .env("MEMVEIL_SHIELD_FAULT_NS", ns.to_string())
        }
        None => cmd
            .env_remove("MEMVEIL_SHIELD_MAX_OVERHEAD")
            .env_remove("MEMVEIL_SHIELD_FAULT_NS"),
    };
    if let Some(cpu) = a.cpu {
        // Inherited by the program through fork and exec.
        memveil_sys::process::pin_to_cpu(cpu).with_context(|| {
            format!("--cpu {cpu}: this process may not run on CPU {cpu} (see `taskset -p $$` for the CPUs allowed)")
        })?;
    }
    // Interrupts reach the program (same process group); memveil stays to
    // report, and passes SIGTERM on.
    let stop = memveil_sys::stopflag::stop_on_interrupt().context("installing signal handlers")?;
    // The program is born in its cgroup: started there by clone3, or else
    // this process steps in for the fork.
    let mut spawned = None;
    if let Ok(cg) = cgroup.as_mut() {
        spawned = cg.spawn_into(&cmd).map(|r| r.map(Program::Into));
        if spawned.is_none() {
            match cg.enter() {
                Ok(()) => {
                    spawned = Some(cmd.spawn().map(Program::Std));
                    cg.leave();
                }
                // Dropped: its guardian removes it.
                Err(why) => *cgroup = Err(why),
            }
        }
    }
    let spawned = match (spawned, &*cgroup) {
        (Some(r), _) => r,
        (None, Err(why)) => {
            eprintln!(
                "memveil run: no cgroup of its own for {}: {why}; if memveil run is killed, the \
                 program keeps running",
                a.command[0].to_string_lossy()
            );
            cmd.spawn().map(Program::Std)
        }
        (None, Ok(_)) => cmd.spawn().map(Program::Std),
    };
    let mut child =
        spawned.with_context(|| format!("starting {}", a.command[0].to_string_lossy()))?;
    let started = Instant::now();
    // The loop below wakes at once when the program ends, so the run's time
    // is the program's, not rounded up to a sample (a 0.2 s program measured
    // up to 25% slower on average before), and at once when the vault says
    // the KeyID's key is gone. It samples the statistics every 50 ms for
    // --stats-json and --live alone; otherwise it only looks every 250 ms
    // (18 tenants' runs reading their statistics every 50 ms took 1.5% of
    // the host's CPU time).
    let ended = memveil_sys::process::PidFd::open(child.id()).ok().flatten();
    let sampling = a.stats_json.is_some() || a.live.is_some();
    let tick = Duration::from_millis(if sampling { 50 } else { 250 });
    let mut samples = Vec::new();
    let mut last_live = Instant::now();
    let mut forwarded = false;
    let mut key_gone = None;
    let mut waited_for_daemons = false;
    let mut exited = None;
    let mut looked = Instant::now();
    let mut left = Vec::new();
    let status = loop {
        if exited.is_none() {
            exited = child.try_wait().context("waiting for the program")?;
        }
        // A tenant's daemons (a double fork, or anything that inherited the
        // key file) hold its KeyID's key: this process stays, so that a
        // clear still stops them, until they end (looked for once a second).
        if let (Some(st), true) = (
            exited,
            left.is_empty() || looked.elapsed() >= Duration::from_secs(1),
        ) {
            looked = Instant::now();
            left = host
                .filter(|h| !h.no_encrypt())
                .map(|h| {
                    let among = cgroup.as_ref().ok().and_then(ProgramCgroup::pids);
                    run_keyid::left_running(stats_dir, h.file_id().as_ref(), among.as_deref())
                })
                .unwrap_or_default();
            if left.is_empty() {
                break st;
            }
            if !waited_for_daemons {
                waited_for_daemons = true;
                eprintln!(
                    "memveil run: {} exited; {} process(es) it left running (pid {left:?}) hold \
                     its KeyID's key: staying until they end, so a clear of the KeyID still \
                     stops them",
                    a.command[0].to_string_lossy(),
                    left.len()
                );
            }
        }
        if let Some(why) = host.and_then(HostKeyId::stop_reason) {
            // Everything in the cgroup (a process the preload never reached
            // included), then whatever holds the key outside it.
            let in_cgroup = cgroup.as_mut().ok().map(ProgramCgroup::kill);
            let n = run_keyid::kill_program(
                exited.is_none().then(|| child.id()),
                stats_dir,
                host.and_then(HostKeyId::file_id).as_ref(),
            );
            let st = match exited {
                Some(st) => st,
                None => child.wait().context("waiting for the stopped program")?,
            };
            eprintln!(
                "memveil run: stopped {} ({}): {why}; its evicted pages cannot be decrypted any \
                 more",
                a.command[0].to_string_lossy(),
                in_cgroup.map_or_else(
                    || format!("{n} process(es), SIGKILL"),
                    |m| format!("SIGKILL: {m} process(es) in its cgroup, {n} by pid")
                )
            );
            key_gone = Some(why);
            break st;
        }
        if stop.load(Ordering::Relaxed) && !forwarded {
            // To the program, or once it is reaped (its pid may be another's
            // by now) to the processes it left holding the key.
            let to = if exited.is_none() {
                vec![child.id()]
            } else {
                left.clone()
            };
            for pid in to {
                let _ = memveil_sys::process::send_signal(pid, libc::SIGTERM);
            }
            forwarded = true;
        }
        if sampling {
            let s = StatsFile::read_dir(stats_dir).unwrap_or_default();
            let t = started.elapsed().as_secs_f64();
            if a.stats_json.is_some() && samples.len() < 100_000 {
                samples.push(serde_json::json!({
                    "t": t,
                    "plaintext_fraction": s.plaintext_fraction(),
                    "resident_pages": s.resident_pages,
                    "evicted_pages": s.evicted_pages,
                    "faults": s.faults(),
                    "evictions": s.evictions,
                }));
            }
            if let Some(every) = a.live {
                if last_live.elapsed().as_secs_f64() >= every {
                    last_live = Instant::now();
                    eprintln!(
                        "memveil run: [{t:7.1}s] {}; {}",
                        summary(&s),
                        guarantee_line(&a.guarantee(), &s)
                    );
                }
            }
        }
        // What wakes the loop: the program's end (without a pidfd, looked
        // for every 50 ms), the vault's stop notice, a signal.
        let mut wakes = Vec::with_capacity(2);
        if exited.is_none() {
            wakes.extend(ended.as_ref().map(std::os::fd::AsFd::as_fd));
        }
        wakes.extend(host.and_then(HostKeyId::woken));
        let wait = if exited.is_none() && ended.is_none() {
            tick.min(Duration::from_millis(50))
        } else {
            tick
        };
        if wakes.is_empty() {
            std::thread::sleep(wait);
        } else {
            let _ = memveil_sys::process::wait_readable(&wakes, Some(wait));
        }
    };
    // What the program left running (a daemon) goes on, as it did before
    // the cgroup: only memveil run killed takes the cgroup with it.
    let left = cgroup.as_ref().map_or(0, ProgramCgroup::count);
    let s = StatsFile::read_dir(stats_dir).unwrap_or_default();
    let code = match (status.code(), status.signal()) {
        _ if key_gone.is_some() => run_keyid::EXIT_KEY_GONE,
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(255),
        _ => 1,
    };
    let plain = host.is_some_and(HostKeyId::no_encrypt);
    if !a.quiet && plain {
        if let Some(h) = host {
            eprintln!("memveil run: keys: {}", h.describe());
        }
    } else if !a.quiet {
        let how = match status.signal() {
            _ if key_gone.is_some() => {
                format!("stopped, exit status {code}: its KeyID's key is gone")
            }
            Some(sig) => format!("killed by signal {sig}"),
            None => format!("exit status {code}"),
        };
        eprintln!(
            "memveil run: {} ({how}, {:.2} s): {}",
            a.command[0].to_string_lossy(),
            started.elapsed().as_secs_f64(),
            summary(&s)
        );
        eprintln!(
            "memveil run: allocator: {}",
            match (via, keep) {
                (Via::Loader, _) =>
                    format!("the program's own, its pages from the protected region ({LOADER})"),
                (Via::Preload, None) => "memveil's (in place of the C library's malloc)".to_owned(),
                (Via::Preload, Some(l)) =>
                    format!("the program's own {l}, its pages from the protected region"),
            }
        );
        eprintln!("memveil run: {}", guarantee_line(&a.guarantee(), &s));
        eprintln!("memveil run: {}", shared.line(&s));
        if let Some(line) = advice(&a.guarantee(), &s, started.elapsed().as_secs_f64()) {
            eprintln!("memveil run: {line}");
        }
        if let Some(h) = host {
            eprintln!("memveil run: keys: {}", h.describe());
        }
        if s.processes == 0 && via == Via::Loader {
            eprintln!(
                "memveil run: warning: no process reported statistics: {LOADER} did not start \
                 the shield (see its message above)"
            );
        } else if s.processes == 0 {
            eprintln!(
                "memveil run: warning: no process reported statistics: the preload library was not \
                 loaded (setuid program, or a loader that ignores LD_PRELOAD)"
            );
        }
    }
    if !a.quiet {
        eprintln!(
            "memveil run: cgroup: {}",
            run_cgroup::describe(cgroup, left)
        );
    }
    if let (Some(path), Some(mut f)) = (&a.stats_json, json_out) {
        let mut j = serde_json::to_value(s).context("encoding statistics")?;
        j["faults"] = s.faults().into();
        j["plaintext_fraction"] = s.plaintext_fraction().into();
        j["mechanism"] = s.mechanism_name().into();
        j["key_level"] = s.level_name().into();
        j["allocator"] = match via {
            Via::Loader => "static",
            Via::Preload => keep.unwrap_or("memveil"),
        }
        .into();
        j["via"] = match via {
            Via::Loader => "loader",
            Via::Preload => "preload",
        }
        .into();
        let g = a.guarantee();
        j["guarantee"] = g.name().into();
        j["time_plaintext_fraction"] = s.time_plaintext_fraction().into();
        let outside = outside_ns(&s);
        j["run_overhead_ns"] = outside.into();
        j["program_cost_fraction"] = s.cost_fraction().into();
        j["cost_fraction"] = run_cost_fraction(&s, outside).into();
        j["host_cost_fraction"] = s.host_cost_fraction().into();
        j["budget_met"] = match (g.budget, s.cost_fraction()) {
            (Some(p), Some(c)) => super::run_report::budget_met(p, c).into(),
            _ => serde_json::Value::Null,
        };
        j["host_keyid"] = host.map_or(serde_json::Value::Null, HostKeyId::json);
        j["stopped_key_gone"] = key_gone.clone().into();
        j["cgroup"] = run_cgroup::json(cgroup, left);
        j["host_budget"] = shared.json(&s);
        j["exit_code"] = code.into();
        j["seconds"] = started.elapsed().as_secs_f64().into();
        j["samples"] = samples.into();
        writeln!(f, "{}", serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(code)
}

/// When [`run`] began, and the time this process had taken until then
/// (from its exec: the dynamic linker, libssl and libcrypto among its
/// libraries, its relocations, the command line), for [`outside_ns`].
static RUN_START: std::sync::OnceLock<(Instant, u64)> = std::sync::OnceLock::new();

/// The main thread's time since it was made, on a CPU or waiting for one
/// (`/proc/self/schedstat`, the thread group leader's: run time and run
/// delay), in ns; 0 where the kernel keeps no schedstat. Read first thing
/// in [`run`], on the main thread while it is the process's only one: its
/// start until then. Not `/proc/thread-self`: an entry looked up under
/// `/proc/PID/task` stays until the process's `wait4` tears it down, which
/// costs the waiter (the tenants' test on the shield's threads).
fn time_since_exec_ns() -> u64 {
    std::fs::read_to_string("/proc/self/schedstat")
        .ok()
        .and_then(|t| memveil_sys::process::parse_schedstat(&t))
        .map_or(0, |(cpu, delay)| cpu.saturating_add(delay))
}

/// What the run cost outside the shielded process's life so far, in ns:
/// memveil run's own start (before [`run`] and after it up to the
/// program's start), the preload's start before the shield's clock began,
/// the program's end until memveil run saw it, and the summary's making:
/// memveil run's time since its exec less the time the shield protected
/// the process (`alive_ms`). A plain run pays none of it but the program's
/// own exec and exit (about a millisecond), so it is what the run loses
/// beyond the shield's cost in the process (issue 33 item 4). Only for one
/// process (0 for several, whose lives overlap and are summed).
fn outside_ns(s: &memveil_shield::Snapshot) -> u64 {
    let Some((t, before)) = RUN_START.get() else {
        return 0;
    };
    if s.processes != 1 {
        return 0;
    }
    let wall = before.saturating_add(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
    wall.saturating_sub(s.alive_ms.saturating_mul(1_000_000))
}

/// The share of the whole run the program lost: the shield's cost in the
/// process and the run's time `outside` it (see [`outside_ns`]) over the
/// process's life and that time (`None` before any was measured).
fn run_cost_fraction(s: &memveil_shield::Snapshot, outside: u64) -> Option<f64> {
    let alive = s.alive_ms.saturating_mul(1_000_000);
    (alive > 0)
        .then(|| s.cost_ns.saturating_add(outside) as f64 / alive.saturating_add(outside) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runs_cost_counts_what_it_spent_outside_the_process() {
        let s = memveil_shield::Snapshot {
            processes: 1,
            alive_ms: 300,
            cost_ns: 6_000_000,
            ..Default::default()
        };
        // 6 ms of 300 ms in the process; 10 ms of memveil run's own start
        // and end around it: 16 of 310 ms.
        let f = run_cost_fraction(&s, 10_000_000).expect("a share");
        assert!((f - 16.0 / 310.0).abs() < 1e-9, "{f}");
        assert!((run_cost_fraction(&s, 0).expect("a share") - 0.02).abs() < 1e-9);
        assert_eq!(
            run_cost_fraction(&memveil_shield::Snapshot::default(), 5),
            None
        );
        // Its start is read once, from this process's own schedstat.
        let _ = RUN_START.set((Instant::now(), time_since_exec_ns()));
        let several = memveil_shield::Snapshot { processes: 2, ..s };
        assert_eq!(
            outside_ns(&several),
            0,
            "lives of several processes overlap"
        );
        let long = memveil_shield::Snapshot {
            alive_ms: u64::MAX / 2_000_000,
            ..s
        };
        assert_eq!(outside_ns(&long), 0, "never below nothing");
    }

    #[test]
    fn elf_names_its_loader_and_libraries() {
        let e = elf_info(Path::new("/bin/true")).expect("/bin/true");
        assert!(e.dynamic);
        assert!(e.needed.iter().any(|n| n == "libc.so.6"), "{:?}", e.needed);
        assert_eq!(own_allocator(&e.needed), None);
        let needed = vec!["libm.so.6".to_owned(), "libjemalloc.so.2".to_owned()];
        assert_eq!(own_allocator(&needed), Some("libjemalloc.so.2"));
    }

    #[test]
    fn elf_read_in_pieces_names_what_the_whole_file_names() {
        let exe = std::env::current_exe().expect("test binary");
        for path in [Path::new("/bin/true"), Path::new("/usr/bin/python3"), &exe] {
            let Ok(whole) = std::fs::read(path) else {
                continue;
            };
            let pieces = elf_info(path).expect("an ELF file");
            let bytes = parse_elf(&whole[..]);
            assert_eq!(
                (pieces.dynamic, &pieces.needed),
                (bytes.dynamic, &bytes.needed),
                "{}",
                path.display()
            );
            assert!(!pieces.needed.is_empty(), "{}", path.display());
        }
    }

    #[test]
    fn malformed_elf_yields_nothing_and_never_panics() {
        // A header whose program-header table sits at the end of the
        // address space, with many large entries.
        let mut data = [0u8; 64];
        data[..5].copy_from_slice(b"\x7fELF\x02");
        data[0x20..0x28].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
        data[0x36..0x38].copy_from_slice(&0xffffu16.to_le_bytes());
        data[0x38..0x3a].copy_from_slice(&0xffffu16.to_le_bytes());
        let e = parse_elf(&data[..]);
        assert!(!e.dynamic && e.needed.is_empty());
        // A PT_DYNAMIC header whose entries lie past the end of the file.
        let mut data = [0u8; 64 + 56];
        data[..5].copy_from_slice(b"\x7fELF\x02");
        data[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        data[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        data[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        data[64..68].copy_from_slice(&2u32.to_le_bytes());
        data[64 + 8..64 + 16].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        data[64 + 0x20..64 + 0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_elf(&data[..]);
        assert!(!e.dynamic && e.needed.is_empty());
    }
}

//! The `disk` part: fio on ext4 over `memveil disk` (every sector through
//! the vault) against, in the same run, the same server with encryption off
//! (`plain_fuse`: the ratio is the cost of the cipher and the vault),
//! gocryptfs (the same fio jobs on its mount), and a loop device over a file
//! on tmpfs (the price of FUSE here).
//!
//! The disk servers run in this process (`memveil_disk::serve` on a thread
//! each), the vault as its own process. Jobs run in rounds, each round every
//! job on every stack in turn, so a slow spell of the shared machine hits all
//! stacks alike; a figure is each stack's best round, and the spread of the
//! rounds is reported beside it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memveil_disk::{Cipher, CreateOpts, KeySource, ServeOpts};
use memveil_vault::proto::KeyKind;

use crate::{BenchError, BenchOpts, Figure, Section};

fn fail(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "disk",
        msg: msg.into(),
    }
}

fn run_cmd(cmd: &mut Command) -> Result<String, BenchError> {
    let o = cmd
        .output()
        .map_err(|e| fail(format!("{cmd:?}: {e} (scripts/install.sh installs it)")))?;
    if !o.status.success() {
        return Err(fail(format!(
            "{cmd:?}: {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// A disk server on a thread of this process.
struct Served {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<memveil_disk::Summary, memveil_disk::DiskError>>>,
    device: PathBuf,
}

impl Served {
    fn start(image: &Path, vault: Option<&Path>, mount: &Path) -> Result<Served, BenchError> {
        std::fs::create_dir_all(mount).map_err(|e| fail(format!("{}: {e}", mount.display())))?;
        let stop = Arc::new(AtomicBool::new(false));
        let o = ServeOpts::new(
            image.to_owned(),
            vault.map(Path::to_owned),
            mount.to_owned(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            memveil_disk::serve(&o, &s, |r| {
                let _ = tx.send(r.device.clone());
            })
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(device)) => Ok(Served {
                stop,
                thread: Some(thread),
                device,
            }),
            _ => {
                stop.store(true, Ordering::SeqCst);
                let why = match thread.join() {
                    Ok(Err(e)) => e.to_string(),
                    _ => "no loop device".into(),
                };
                Err(fail(format!("serving {}: {why}", image.display())))
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // The server unmounts the filesystem on its device, detaches it and
        // unmounts FUSE.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What fio runs on: a directory, and what to take down afterwards.
struct Stack {
    name: &'static str,
    dir: PathBuf,
    served: Option<Served>,
    /// A loop device this part attached itself (tmpfs stack).
    own_loop: Option<String>,
    /// Mounts to take down, innermost first.
    mounts: Vec<PathBuf>,
    gocryptfs: Option<Child>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for m in &self.mounts {
            let _ = memveil_sys::mount::unmount(m, false)
                .or_else(|_| memveil_sys::mount::unmount(m, true));
            if let (Some(l), true) = (&self.own_loop, m == &self.dir) {
                let _ = Command::new("losetup").arg("-d").arg(l).status();
            }
        }
        if let Some(mut g) = self.gocryptfs.take() {
            let _ = g.kill();
            let _ = g.wait();
        }
        self.served.take();
    }
}

fn ext4_on(dev: &Path, at: &Path) -> Result<(), BenchError> {
    std::fs::create_dir_all(at).map_err(|e| fail(format!("{}: {e}", at.display())))?;
    run_cmd(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(dev))?;
    run_cmd(Command::new("mount").arg(dev).arg(at))?;
    Ok(())
}

/// ext4 on `memveil disk` over an image of `size` (encrypted with `vault`,
/// plain without).
fn fuse_stack(
    name: &'static str,
    work: &Path,
    vault: Option<&Path>,
    size: u64,
    sector_size: u32,
) -> Result<Stack, BenchError> {
    let image = work.join(format!("{name}.img"));
    memveil_disk::create(&CreateOpts {
        image: image.clone(),
        size: Some(size),
        cipher: if vault.is_some() {
            Cipher::AesXtsPlain64
        } else {
            Cipher::Plain
        },
        vault: vault.map(Path::to_owned),
        key: if vault.is_some() {
            format!("bench-disk-{name}-{}", std::process::id())
        } else {
            String::new()
        },
        source: KeySource::New,
        key_kind: KeyKind::Xts128,
        persistent: false,
        sector_size,
        iv_large_sectors: false,
    })
    .map_err(|e| fail(e.to_string()))?;
    let served = Served::start(&image, vault, &work.join(format!("{name}.fuse")))?;
    let dir = work.join(format!("{name}.ext4"));
    let mut st = Stack {
        name,
        dir: dir.clone(),
        served: None,
        own_loop: None,
        mounts: Vec::new(),
        gocryptfs: None,
    };
    ext4_on(&served.device, &dir)?;
    // The server unmounts it too; the stack only when the server did not.
    st.served = Some(served);
    Ok(st)
}

/// ext4 on a loop device over a file on tmpfs.
fn tmpfs_stack(work: &Path, size: u64) -> Result<Stack, BenchError> {
    let t = work.join("tmpfs");
    std::fs::create_dir_all(&t).map_err(|e| fail(e.to_string()))?;
    run_cmd(
        Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={}", size + (16 << 20)))
            .arg("memveil-bench")
            .arg(&t),
    )?;
    let mut st = Stack {
        name: "loop_tmpfs",
        dir: work.join("loop_tmpfs.ext4"),
        served: None,
        own_loop: None,
        mounts: vec![t.clone()],
        gocryptfs: None,
    };
    let file = t.join("disk.img");
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(size))
        .map_err(|e| fail(e.to_string()))?;
    let dev = run_cmd(
        Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&file),
    )?
    .trim()
    .to_owned();
    st.own_loop = Some(dev.clone());
    st.mounts.insert(0, st.dir.clone());
    ext4_on(Path::new(&dev), &st.dir)?;
    Ok(st)
}

/// A gocryptfs mount (its cipher directory under `work`).
fn gocryptfs_stack(work: &Path) -> Result<Stack, BenchError> {
    let c = work.join("gocryptfs.cipher");
    let p = work.join("gocryptfs.plain");
    for d in [&c, &p] {
        std::fs::create_dir_all(d).map_err(|e| fail(e.to_string()))?;
    }
    run_cmd(
        Command::new("gocryptfs")
            .args(["-init", "-q", "-extpass", "echo bench", "-scryptn", "10"])
            .arg(&c),
    )?;
    let child = Command::new("gocryptfs")
        .args(["-fg", "-q", "-extpass", "echo bench"])
        .arg(&c)
        .arg(&p)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("gocryptfs: {e} (scripts/install.sh installs it)")))?;
    let mut st = Stack {
        name: "gocryptfs",
        dir: p.clone(),
        served: None,
        own_loop: None,
        mounts: vec![p.clone()],
        gocryptfs: Some(child),
    };
    let t0 = Instant::now();
    while !memveil_disk::host::mounts().is_ok_and(|ms| ms.iter().any(|m| m.mount_point == p)) {
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(fail("gocryptfs did not mount within 30 s"));
        }
        if let Some(g) = st.gocryptfs.as_mut() {
            if let Ok(Some(s)) = g.try_wait() {
                return Err(fail(format!("gocryptfs exited: {s}")));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(st)
}

/// One fio job.
#[derive(Clone, Copy)]
struct Job {
    id: &'static str,
    rw: &'static str,
    bs: &'static str,
    depth: u32,
    /// IOPS rather than MB/s.
    iops: bool,
}

const JOBS: [Job; 3] = [
    Job {
        id: "seq_read",
        rw: "read",
        bs: "1M",
        depth: 4,
        iops: false,
    },
    Job {
        id: "seq_write",
        rw: "write",
        bs: "1M",
        depth: 4,
        iops: false,
    },
    Job {
        id: "rand4k_read",
        rw: "randread",
        bs: "4k",
        depth: 16,
        iops: true,
    },
];

/// Runs `job` in `dir` for `secs`; MB/s or IOPS.
fn fio(dir: &Path, job: Job, file_mib: u64, secs: u32) -> Result<f64, BenchError> {
    let out = run_cmd(
        Command::new("fio")
            .current_dir(dir)
            .args([
                "--name=bench",
                "--direct=1",
                "--ioengine=libaio",
                "--fallocate=none",
                "--time_based",
                "--output-format=json",
                "--randrepeat=0",
            ])
            .arg(format!("--rw={}", job.rw))
            .arg(format!("--bs={}", job.bs))
            .arg(format!("--iodepth={}", job.depth))
            .arg(format!("--size={file_mib}M"))
            .arg(format!("--runtime={secs}")),
    )?;
    // fio may print lines before the JSON.
    let start = out.find('{').ok_or_else(|| fail("fio printed no JSON"))?;
    let v: serde_json::Value =
        serde_json::from_str(&out[start..]).map_err(|e| fail(format!("fio JSON: {e}")))?;
    let j = &v["jobs"][0];
    let side = if job.rw.contains("write") {
        &j["write"]
    } else {
        &j["read"]
    };
    let x = if job.iops {
        side["iops"].as_f64()
    } else {
        side["bw_bytes"].as_f64().map(|b| b / 1e6)
    };
    x.filter(|x| *x > 0.0)
        .ok_or_else(|| fail(format!("fio reported no {} figure", job.id)))
}

/// What bounds the encrypted stack on this CPU, measured beside fio: GB/s
/// of (vault) 1 MiB of 512-byte sectors decrypted through a vault lane as
/// one ring entry, as the disk server sends them; (in-process) the same
/// `Xts::decrypt_units` call in this process; (copy) a 1 MiB memory copy
/// out of 64 MiB (larger than the caches, as the page cache is), what the
/// plain stack does twice per read (page cache to the slot, slot to FUSE).
/// Rounds alternate; each figure is its best round.
struct Rates {
    vault: f64,
    inproc: f64,
    copy: f64,
}

fn sector_rates(socket: &Path, rounds: usize) -> Result<Rates, BenchError> {
    use memveil_vault::proto::Mode;
    use memveil_vault::ring::{status, Entry, Op};
    const MIB: usize = 1 << 20;
    let vf = |e: memveil_vault::client::ClientError| fail(format!("vault: {e}"));
    let key: Vec<u8> = (0..32u8)
        .map(|i| i.wrapping_mul(29).wrapping_add(3))
        .collect();
    let xts = memveil_cipher::Xts::from_combined(&key).map_err(|e| fail(e.to_string()))?;
    let mut c = memveil_vault::Client::connect(socket).map_err(vf)?;
    let name = format!("bench-disk-rates-{}", std::process::id());
    let id = c
        .import_key(&name, KeyKind::Xts128, false, &key)
        .map_err(vf)?
        .id;
    let (sess, mut lanes) = c.session(MIB, 1).map_err(vf)?;
    let lane = &mut lanes[0];
    let e = Entry {
        op: Op::Decrypt,
        mode: Mode::Xts,
        key: id,
        version: 0,
        buffer: lane.buffer(),
        offset: 0,
        len: MIB as u64,
        iv: memveil_disk::geometry::plain64(2048),
        tag: [0; 16],
        aad_offset: 0,
        aad_len: 0,
        unit: 512,
        step: 1,
    };
    const COPY_SRC: usize = 64 << 20;
    let mut a = vec![0x5Au8; MIB];
    let mut b = vec![0xA5u8; MIB];
    let src = vec![0x3Cu8; COPY_SRC];
    let mut turn = 0usize;
    let window = Duration::from_millis(200);
    let timed = |f: &mut dyn FnMut() -> Result<(), BenchError>| {
        let (t0, mut n) = (Instant::now(), 0usize);
        while t0.elapsed() < window {
            f()?;
            n += MIB;
        }
        Ok::<f64, BenchError>(crate::timing::gbps(n, t0.elapsed()))
    };
    let mut r = Rates {
        vault: 0.0,
        inproc: 0.0,
        copy: 0.0,
    };
    for _ in 0..rounds.max(1) * 3 {
        let v = timed(&mut || match lane.run(&[e]).map_err(vf)?[0].status {
            status::OK => Ok(()),
            st => Err(fail(format!("vault: {}", status::describe(st)))),
        })?;
        let i = timed(&mut || {
            xts.decrypt_units(2048, 1, 512, &mut a)
                .map_err(|e| fail(e.to_string()))
        })?;
        let k = timed(&mut || {
            // From a source larger than the caches, as the page cache is.
            let at = (turn % (COPY_SRC / MIB)) * MIB;
            turn += 1;
            b.copy_from_slice(std::hint::black_box(&src[at..at + MIB]));
            std::hint::black_box(&mut b);
            Ok(())
        })?;
        r.vault = r.vault.max(v);
        r.inproc = r.inproc.max(i);
        r.copy = r.copy.max(k);
    }
    drop(lanes);
    drop(sess);
    let _ = c.destroy_key(&name);
    Ok(r)
}

/// Runs the disk part.
///
/// # Errors
/// Not root, no FUSE or loop devices, a tool missing (fio, mkfs.ext4,
/// gocryptfs, losetup), the vault not starting.
#[allow(clippy::too_many_lines)]
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    memveil_disk::host::check(true).map_err(|e| fail(e.to_string()))?;
    let size: u64 = opts.pick(512 << 20, 2 << 30);
    let file_mib: u64 = opts.pick(256, 1024);
    let secs: u32 = opts.pick(4, 15);
    let rounds: usize = opts.pick(2, 3);
    let work = std::env::temp_dir().join(format!("memveil-bench-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| fail(format!("{}: {e}", work.display())))?;
    let r = (|| {
        let daemon = crate::vault::start_daemon().map_err(|e| fail(e.to_string()))?;
        opts.say(
            "disk: setting up the stacks (ext4 on memveil disk, plain, tmpfs loop; gocryptfs)",
        );
        let stacks = vec![
            fuse_stack("vault", &work, Some(&daemon.socket), size, 512)?,
            fuse_stack("plain_fuse", &work, None, size, 512)?,
            gocryptfs_stack(&work)?,
            tmpfs_stack(&work, size)?,
            fuse_stack("vault_4096", &work, Some(&daemon.socket), size, 4096)?,
        ];
        // best[stack][job], all[stack][job] = every round.
        let mut all = vec![vec![Vec::new(); JOBS.len()]; stacks.len()];
        for round in 0..rounds {
            for (j, job) in JOBS.iter().enumerate() {
                for (s, st) in stacks.iter().enumerate() {
                    if st.name == "loop_tmpfs" && job.id != "rand4k_read" {
                        continue;
                    }
                    let x = fio(&st.dir, *job, file_mib, secs)?;
                    opts.say(&format!(
                        "disk: round {} {} on {}: {x:.1} {}",
                        round + 1,
                        job.id,
                        st.name,
                        if job.iops { "IOPS" } else { "MB/s" }
                    ));
                    all[s][j].push(x);
                }
            }
        }
        drop(stacks);
        opts.say("disk: vault XTS rate over 512-byte sectors, in-process rate, memory copy");
        let rates = sector_rates(&daemon.socket, rounds)?;
        drop(daemon);
        Ok::<_, BenchError>((all, rates))
    })();
    let _ = std::fs::remove_dir_all(&work);
    let (all, rates) = r?;
    let best = |s: usize, j: usize| all[s][j].iter().copied().fold(0.0f64, f64::max);
    let spread = |s: usize, j: usize| {
        let v = &all[s][j];
        let lo = v.iter().copied().fold(f64::MAX, f64::min);
        let hi = v.iter().copied().fold(0.0f64, f64::max);
        if hi > 0.0 {
            (hi - lo) / hi
        } else {
            0.0
        }
    };
    let mut figs = Vec::new();
    let mut md = format!(
        "fio (libaio, O_DIRECT, {file_mib} MiB file, {secs} s a job, best of {rounds} rounds, \
         rounds interleaved across stacks) on ext4 over: `memveil disk` with every sector \
         through the vault (`vault`), the same server with encryption off (`plain_fuse`), a \
         loop device over a file on tmpfs (`loop_tmpfs`); and on a gocryptfs mount \
         (`gocryptfs`, the same jobs on its files); and `vault_4096`, `memveil disk` with \
         4096-byte sectors (`--sector-size 4096`: 8 times fewer XTS data units; both send a \
         request's sectors as one vault ring entry per lane). Sequential jobs: 1 MiB blocks, depth 4; random: 4 KiB reads, depth 16.\n\n\
         | job | unit | vault | plain_fuse | gocryptfs | loop_tmpfs | vault_4096 |\n|---|---|---|---|---|---|---|\n"
    );
    for (j, job) in JOBS.iter().enumerate() {
        let cell = |s: usize| {
            if all[s][j].is_empty() {
                "—".to_owned()
            } else {
                format!("{:.1} (spread {:.0}%)", best(s, j), 100.0 * spread(s, j))
            }
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            job.id,
            if job.iops { "IOPS" } else { "MB/s" },
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            cell(4)
        ));
        let unit = if job.iops { "IOPS" } else { "MB/s" };
        figs.push(
            Figure::vs(
                &format!("disk.{}_vs_plain_fuse", job.id),
                best(0, j),
                best(1, j),
                unit,
                &format!(
                    "fio {} on ext4 over memveil disk (aes-xts-plain64 through the vault) vs the same server with encryption off",
                    job.id
                ),
            )
            .target(">= 0.90"),
        );
        figs.push(
            Figure::vs(
                &format!("disk.{}_vs_gocryptfs", job.id),
                best(0, j),
                best(2, j),
                unit,
                &format!(
                    "fio {} on ext4 over memveil disk vs the same job on gocryptfs",
                    job.id
                ),
            )
            .target(">= 1.0"),
        );
        figs.push(Figure::vs(
            &format!("disk.sector4096.{}_vs_plain_fuse", job.id),
            best(4, j),
            best(1, j),
            unit,
            &format!(
                "fio {} on ext4 over memveil disk with 4096-byte sectors vs the same server with encryption off (reported)",
                job.id
            ),
        ));
    }
    let j = 2;
    figs.push(Figure::vs(
        "disk.rand4k_read_vs_loop_tmpfs",
        best(0, j),
        best(3, j),
        "IOPS",
        "fio 4 KiB random reads on ext4 over memveil disk vs ext4 on a loop device over a tmpfs file (reported: the price of FUSE here)",
    ));
    md.push_str(&format!(
        "\nWhat bounds it on this CPU (same run, best of {} rounds of 0.2 s): 1 MiB of \
         512-byte sectors decrypted through a vault lane as one ring entry {:.2} GB/s; the \
         same `Xts::decrypt_units` in-process {:.2} GB/s; a 1 MiB memory copy out of 64 MiB \
         (the plain stack does two per read) {:.2} GB/s.\n",
        rounds.max(1) * 3,
        rates.vault,
        rates.inproc,
        rates.copy
    ));
    figs.push(Figure::vs(
        "disk.vault_xts_sectors_vs_inproc",
        rates.vault,
        rates.inproc,
        "GB/s",
        "1 MiB of 512-byte XTS sectors decrypted through a vault lane as one ring entry vs the same Xts::decrypt_units in-process (reported)",
    ));
    figs.push(Figure::vs(
        "disk.vault_xts_sectors_vs_copy",
        rates.vault,
        rates.copy,
        "GB/s",
        "1 MiB of 512-byte XTS sectors decrypted through a vault lane vs a 1 MiB memory copy, what the plain stack does twice per read (reported)",
    ));
    Ok(Section {
        part: "disk".into(),
        title: "Disk: aes-xts-plain64 through FUSE, a loop device and the vault".into(),
        markdown: md,
        figures: figs,
        plots: Vec::new(),
    })
}

//! What the host must offer (FUSE, loop devices, root), the loop device the
//! server attaches, and the mounts it takes down: through `losetup` and
//! `/proc/self/mountinfo`, never touching a loop device whose backing file
//! is not the server's own.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::DiskError;

/// The source name the server's FUSE mounts carry in `mountinfo`.
pub const FSNAME: &str = "memveil-disk";

/// Checks that FUSE (and, with `want_loop`, loop devices and the rights to
/// attach one) are there; the error names what is missing and the fix.
///
/// # Errors
/// [`DiskError::Host`].
pub fn check(want_loop: bool) -> Result<(), DiskError> {
    check_in(Path::new("/dev"), memveil_sys::probe::euid(), want_loop)?;
    if want_loop && Command::new("losetup").arg("--version").output().is_err() {
        return Err(DiskError::Host(
            "losetup not found: install util-linux (Debian: `apt-get install util-linux`)".into(),
        ));
    }
    Ok(())
}

/// [`check`] against the device nodes under `dev` and the effective uid
/// `euid`.
fn check_in(dev: &Path, euid: u32, want_loop: bool) -> Result<(), DiskError> {
    if !dev.join("fuse").exists() {
        return Err(DiskError::Host(
            "FUSE is not available: /dev/fuse is missing (load the module: `modprobe fuse`; \
             in a container, pass the device through, e.g. `--device /dev/fuse`)"
                .into(),
        ));
    }
    if !want_loop {
        return Ok(());
    }
    if !dev.join("loop-control").exists() {
        return Err(DiskError::Host(
            "loop devices are not available: /dev/loop-control is missing (load the module: \
             `modprobe loop`; in a container, pass /dev/loop-control and the /dev/loopN devices \
             through), or serve the file alone with --no-loop"
                .into(),
        ));
    }
    if euid != 0 {
        return Err(DiskError::Host(
            "attaching a loop device needs root (CAP_SYS_ADMIN): run as root, or serve the \
             file alone with --no-loop"
                .into(),
        ));
    }
    Ok(())
}

/// One mount, as `/proc/self/mountinfo` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Device numbers of the mounted filesystem (`major:minor`).
    pub dev: (u32, u32),
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Filesystem type.
    pub fstype: String,
    /// Source (a device path, or a FUSE server's name).
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let d = &b[i + 1..i + 4];
            if d.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = u32::from(d[0] - b'0') * 64
                    + u32::from(d[1] - b'0') * 8
                    + u32::from(d[2] - b'0');
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `/proc/self/mountinfo` (lines it cannot read are skipped).
#[must_use]
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    let mut v = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let Some(dash) = f.iter().position(|x| *x == "-") else {
            continue;
        };
        if dash < 6 || f.len() < dash + 3 {
            continue;
        }
        let Some((ma, mi)) = f[2].split_once(':') else {
            continue;
        };
        let (Ok(ma), Ok(mi)) = (ma.parse(), mi.parse()) else {
            continue;
        };
        v.push(MountEntry {
            dev: (ma, mi),
            mount_point: PathBuf::from(unescape(f[4])),
            fstype: unescape(f[dash + 1]),
            source: unescape(f[dash + 2]),
        });
    }
    v
}

/// The mounts of this namespace now.
///
/// # Errors
/// Reading `/proc/self/mountinfo`.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// A loop device this server attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDev {
    /// `/dev/loopN`.
    pub path: PathBuf,
    /// `loopN`.
    pub name: String,
    /// Device numbers.
    pub dev: (u32, u32),
    /// The file it was attached to.
    pub backing: PathBuf,
}

fn sys(name: &str, rest: &str) -> PathBuf {
    Path::new("/sys/block").join(name).join(rest)
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

impl LoopDev {
    /// The device `loopN` with its numbers, when it is attached to `backing`.
    fn probe(name: &str, backing: &Path) -> Option<LoopDev> {
        let b = read_trim(&sys(name, "loop/backing_file"))?;
        if Path::new(&b) != backing {
            return None;
        }
        let dev = read_trim(&sys(name, "dev"))?;
        let (ma, mi) = dev.split_once(':')?;
        Some(LoopDev {
            path: Path::new("/dev").join(name),
            name: name.to_owned(),
            dev: (ma.parse().ok()?, mi.parse().ok()?),
            backing: backing.to_owned(),
        })
    }

    /// Whether the loop device uses direct I/O on its backing file.
    #[must_use]
    pub fn direct_io(&self) -> bool {
        read_trim(&sys(&self.name, "loop/dio")).as_deref() == Some("1")
    }

    /// Whether the device is still attached to our file.
    #[must_use]
    pub fn attached(&self) -> bool {
        Self::probe(&self.name, &self.backing).is_some()
    }
}

/// Attaches `file` to a free loop device with direct I/O and the given
/// logical sector size (`losetup --find --show`).
///
/// # Errors
/// [`DiskError::Host`] with losetup's words.
pub fn attach(file: &Path, sector_size: u32) -> Result<LoopDev, DiskError> {
    let out = Command::new("losetup")
        .args(["--find", "--show", "--direct-io=on", "--sector-size"])
        .arg(sector_size.to_string())
        .arg(file)
        .output()
        .map_err(|e| DiskError::Host(format!("running losetup: {e}")))?;
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || !dev.starts_with("/dev/loop") {
        return Err(DiskError::Host(format!(
            "losetup could not attach {}: {} (are loop devices free? `losetup -a` lists them)",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let name = dev.trim_start_matches("/dev/").to_owned();
    LoopDev::probe(&name, file).ok_or_else(|| {
        DiskError::Host(format!(
            "losetup said {dev}, but /sys/block/{name}/loop/backing_file does not name {}",
            file.display()
        ))
    })
}

/// Loop devices whose backing file lies under `dir` (left by a server that
/// was killed).
#[must_use]
pub fn loops_under(dir: &Path) -> Vec<LoopDev> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Some(b) = read_trim(&sys(&name, "loop/backing_file")) {
            // A dead FUSE mount's file shows with the mount's path.
            let b = PathBuf::from(b.trim_end_matches(" (deleted)"));
            if b.starts_with(dir) {
                if let Some(l) = LoopDev::probe(&name, &b) {
                    v.push(l);
                }
            }
        }
    }
    v
}

/// Unmounts `path`, retrying while it is busy for up to `wait`; then
/// detaches it lazily. Returns whether it had to be lazy.
///
/// # Errors
/// An unmount that fails for another reason than `EBUSY`.
pub fn unmount_patiently(path: &Path, wait: Duration) -> io::Result<bool> {
    let t0 = Instant::now();
    loop {
        match memveil_sys::mount::unmount(path, false) {
            Ok(()) => return Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && t0.elapsed() < wait => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                memveil_sys::mount::unmount(path, true)?;
                return Ok(true);
            }
            Err(e) => return Err(e),
        }
    }
}

/// What taking down a device did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Teardown {
    /// Filesystems unmounted from the device.
    pub unmounted: Vec<PathBuf>,
    /// Of those, the ones only detached lazily (still busy after the wait).
    pub lazy: Vec<PathBuf>,
    /// Whether the loop device was detached.
    pub detached: bool,
    /// Problems met, in words.
    pub problems: Vec<String>,
}

/// Unmounts every filesystem mounted from `l`, then detaches it and waits
/// (up to `wait`) until the kernel has let go of the backing file.
#[must_use]
pub fn take_down(l: &LoopDev, wait: Duration) -> Teardown {
    let mut t = Teardown::default();
    match mounts() {
        Ok(ms) => {
            // Deepest first, should anything be mounted inside.
            let mut on: Vec<PathBuf> = ms
                .into_iter()
                .filter(|m| m.dev == l.dev)
                .map(|m| m.mount_point)
                .collect();
            on.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for p in on {
                match unmount_patiently(&p, wait) {
                    Ok(lazy) => {
                        if lazy {
                            t.lazy.push(p.clone());
                        }
                        t.unmounted.push(p);
                    }
                    Err(e) => t.problems.push(format!("unmounting {}: {e}", p.display())),
                }
            }
        }
        Err(e) => t.problems.push(format!("reading mountinfo: {e}")),
    }
    if !l.attached() {
        return t;
    }
    // The ioctl of `losetup -d`, not the program: the server runs under a
    // seccomp filter without execve by now.
    if let Err(e) = memveil_sys::mount::loop_detach(&l.path) {
        t.problems
            .push(format!("detaching {} (LOOP_CLR_FD): {e}", l.path.display()));
    }
    let t0 = Instant::now();
    while l.attached() && t0.elapsed() < wait {
        std::thread::sleep(Duration::from_millis(20));
    }
    t.detached = !l.attached();
    if !t.detached {
        t.problems.push(format!(
            "{} is still open by someone; the kernel detaches it when it is closed",
            l.path.display()
        ));
    }
    t
}

/// A FUSE mount of this server at `mount` whose server is gone (reading it
/// gives `ENOTCONN`).
#[must_use]
pub fn is_dead_mount(mount: &Path) -> bool {
    let ours = mounts().is_ok_and(|ms| {
        ms.iter()
            .any(|m| m.mount_point == mount && m.source == FSNAME && m.fstype.starts_with("fuse"))
    });
    ours && std::fs::metadata(mount).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse_with_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - ext4 /dev/loop3 rw\n\
                    40 36 0:52 / /run/x rw,nosuid - fuse memveil-disk rw,user_id=0\n\
                    garbage line\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].dev, (98, 0));
        assert_eq!(m[0].mount_point, Path::new("/mnt/a b"));
        assert_eq!(m[0].fstype, "ext4");
        assert_eq!(m[0].source, "/dev/loop3");
        assert_eq!(m[1].source, FSNAME);
        assert_eq!(unescape("a\\134b\\"), "a\\b\\");
    }

    #[test]
    fn missing_fuse_or_loop_devices_are_refused_naming_the_fix() {
        let d = std::env::temp_dir().join(format!("memveil-disk-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        let says = |want_loop: bool, euid: u32| match check_in(&d, euid, want_loop) {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        };
        assert!(
            says(false, 0).contains("modprobe fuse"),
            "{}",
            says(false, 0)
        );
        std::fs::write(d.join("fuse"), b"").expect("node");
        assert_eq!(says(false, 1000), "");
        let e = says(true, 0);
        assert!(
            e.contains("modprobe loop") && e.contains("--no-loop"),
            "{e}"
        );
        std::fs::write(d.join("loop-control"), b"").expect("node");
        assert!(says(true, 1000).contains("needs root"));
        assert_eq!(says(true, 0), "");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn this_process_sees_its_root_mount() {
        let m = mounts().expect("mountinfo");
        assert!(m.iter().any(|e| e.mount_point == Path::new("/")), "{m:?}");
    }
}

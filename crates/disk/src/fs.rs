//! The FUSE filesystem: one directory holding one file, the decrypted image.
//!
//! The file is opened with `FOPEN_DIRECT_IO`, so the kernel keeps no page
//! cache of it (the filesystem on the loop device above caches) and every
//! write reaches this server before the writer sees it complete: a write
//! acknowledged to the loop device is on the backing file, and `flush` and
//! `fsync` are `fsync(2)` of the backing file. Requests over different
//! sectors run in parallel (`FOPEN_PARALLEL_DIRECT_WRITES`); a write holds
//! every sector it touches until it is on the image ([`SectorLocks`]), so a
//! write that does not cover whole sectors (a read-modify-write of its edge
//! sectors) never puts back bytes that another write replaced meanwhile. A
//! failed write-back of the image reaches the next `fsync` or `flush` of
//! every handle open when it was found ([`WritebackErrors`]). The size
//! cannot change.

use std::ffi::OsStr;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};

use crate::order::{SectorLocks, WritebackErrors};
use crate::sectors::{IoError, Sectors, MAX_IO};

const FILE_INO: INodeNo = INodeNo(2);
const TTL: Duration = Duration::from_secs(3600);

/// Counters of the served file.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Bytes written.
    pub written_bytes: AtomicU64,
    /// `fsync`/`flush` calls served.
    pub syncs: AtomicU64,
    /// Requests answered with `EIO`.
    pub errors: AtomicU64,
}

/// The filesystem.
pub(crate) struct DiskFs {
    name: String,
    file: File,
    sectors: Sectors,
    locks: SectorLocks,
    wb_errors: WritebackErrors,
    /// Test only ([`crate::ServeOpts::test_drop_write`]): the write request
    /// (counted from 1) to acknowledge without storing it.
    drop_write: Option<u64>,
    writes: AtomicU64,
    uid: u32,
    gid: u32,
    started: SystemTime,
    pub(crate) counters: std::sync::Arc<Counters>,
}

impl DiskFs {
    pub(crate) fn new(
        name: String,
        file: File,
        sectors: Sectors,
        counters: std::sync::Arc<Counters>,
        drop_write: Option<u64>,
    ) -> Self {
        Self {
            name,
            file,
            sectors,
            locks: SectorLocks::default(),
            wb_errors: WritebackErrors::default(),
            drop_write,
            writes: AtomicU64::new(0),
            uid: memveil_sys::probe::euid(),
            gid: 0,
            started: SystemTime::now(),
            counters,
        }
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o755, 0, 2),
            FILE_INO => (
                FileType::RegularFile,
                0o600,
                self.sectors.geometry().size,
                1,
            ),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: self.sectors.geometry().sector_size,
            flags: 0,
        })
    }

    fn fail(&self, what: &str, e: &IoError) -> Errno {
        // Say the first few; a vault that went away would say it for
        // every request.
        if self.counters.errors.fetch_add(1, Ordering::Relaxed) < 8 {
            eprintln!("memveil disk: {what}: {e}");
        }
        Errno::EIO
    }

    /// Reads `size` bytes at `offset` and hands them to `reply`.
    fn do_read(&self, offset: u64, size: u32, reply: ReplyData) {
        let g = self.sectors.geometry();
        let Some((start, end)) = g.cover(offset, u64::from(size)) else {
            reply.data(&[]);
            return;
        };
        let want = usize::try_from(end.min(offset + u64::from(size)) - offset).unwrap_or(0);
        let len = usize::try_from(end - start).unwrap_or(usize::MAX);
        if len > self.sectors.capacity() {
            reply.error(Errno::EINVAL);
            return;
        }
        let skip = usize::try_from(offset - start).unwrap_or(0);
        let mut reply = Some(reply);
        let _sectors = self.locks.lock(start, end, false);
        let r = self.sectors.with_slot(|slot| {
            self.sectors.load(slot, &self.file, start, len)?;
            self.sectors.with_buf(slot, skip, want, |b| {
                if let Some(r) = reply.take() {
                    r.data(b);
                }
            })
        });
        match (r, reply) {
            (Ok(()), None) => {
                self.counters
                    .read_bytes
                    .fetch_add(want as u64, Ordering::Relaxed);
            }
            (Err(e), Some(reply)) => reply.error(self.fail("read", &e)),
            (Ok(()), Some(reply)) => reply.error(Errno::EIO),
            (Err(e), None) => {
                self.fail("read", &e);
            }
        }
    }

    fn do_write(&self, offset: u64, data: &[u8]) -> Result<usize, Errno> {
        let g = self.sectors.geometry();
        if offset >= g.size && !data.is_empty() {
            return Err(Errno::ENOSPC);
        }
        let Some((start, end)) = g.cover(offset, data.len() as u64) else {
            return Ok(0);
        };
        // Bytes past the end of the image are not written.
        let n = usize::try_from(end.min(offset + data.len() as u64) - offset).unwrap_or(0);
        let data = &data[..n];
        let len = usize::try_from(end - start).unwrap_or(usize::MAX);
        if len > self.sectors.capacity() {
            return Err(Errno::EINVAL);
        }
        let skip = usize::try_from(offset - start).unwrap_or(0);
        let partial = !g.aligned(offset, n as u64);
        if self.drop_write.is_some() && self.dropped(offset, n) {
            return Ok(n);
        }
        // Every write, whole sectors or not: a full-sector write racing the
        // read-modify-write of a partial one would otherwise be undone by
        // the partial one's store of the sector it read before.
        let _sectors = self.locks.lock(start, end, true);
        let r = self.sectors.with_slot(|slot| {
            if partial {
                self.sectors.load(slot, &self.file, start, len)?;
            }
            self.sectors
                .with_buf(slot, skip, n, |b| b.copy_from_slice(data))?;
            self.sectors.store(slot, &self.file, start, len)
        });
        match r {
            Ok(()) => {
                self.counters
                    .written_bytes
                    .fetch_add(n as u64, Ordering::Relaxed);
                Ok(n)
            }
            Err(e) => Err(self.fail("write", &e)),
        }
    }

    /// Test only: whether this write is the one to acknowledge and drop.
    fn dropped(&self, offset: u64, n: usize) -> bool {
        let nth = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if self.drop_write != Some(nth) {
            return false;
        }
        eprintln!(
            "memveil disk: TEST SWITCH: write #{nth} at byte {offset} ({n} bytes) acknowledged \
             and not stored"
        );
        true
    }

    /// `fsync(2)` of the image for handle `fh`; fails also when an earlier
    /// sync failed and `fh` has not heard of it ([`WritebackErrors`]).
    fn sync(&self, fh: FileHandle, data_only: bool) -> Result<(), Errno> {
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        let (r, found) = self.wb_errors.sync(fh.0, || {
            if data_only {
                self.file.sync_data()
            } else {
                self.file.sync_all()
            }
        });
        if let Some(e) = found {
            self.fail(
                "fsync of the image (every open handle's next fsync or flush fails with it)",
                &IoError::File(e),
            );
        }
        r.map_err(Errno::from_i32)
    }
}

impl Filesystem for DiskFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(u32::try_from(MAX_IO).unwrap_or(u32::MAX));
        // Direct I/O from the loop device arrives asynchronously, several
        // requests at once, when the kernel may send it so.
        if config.capabilities().contains(InitFlags::FUSE_ASYNC_DIO) {
            let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        }
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent, self.attr(FILE_INO)) {
            (INodeNo::ROOT, Some(a)) if name == OsStr::new(&self.name) => {
                reply.entry(&TTL, &a, fuser::Generation(0));
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        match self.attr(ino) {
            // The image keeps its size (an O_TRUNC open or a truncate to
            // another size is refused); times and modes are not stored.
            Some(a) if size.is_none_or(|s| s == a.size) => reply.attr(&TTL, &a),
            Some(_) => reply.error(Errno::EPERM),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            reply.error(Errno::EISDIR);
            return;
        }
        reply.opened(
            FileHandle(self.wb_errors.open()),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        );
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            reply.error(Errno::EISDIR);
            return;
        }
        self.do_read(offset, size, reply);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE_INO {
            reply.error(Errno::EISDIR);
            return;
        }
        match self.do_write(offset, data) {
            Ok(n) => reply.written(u32::try_from(n).unwrap_or(0)),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        match self.sync(fh, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.sync(fh, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.wb_errors.release(fh.0);
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            reply.error(Errno::ENOTDIR);
            return;
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, self.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries
            .iter()
            .enumerate()
            .skip(usize::try_from(offset).unwrap_or(usize::MAX))
        {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        // Discards (the loop device turns them into hole punches) are not
        // passed down, as dm-crypt does not by default: a hole reads as
        // zeros, which would decrypt to garbage and show which sectors are
        // free.
        reply.error(Errno::from_i32(libc::EOPNOTSUPP));
    }
}

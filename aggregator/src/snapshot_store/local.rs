//! Local files, written a piece at a time: `file://` objects (deltas,
//! bases) and downloads for a restore go to disk [`LOCAL_PIECE`] by
//! [`LOCAL_PIECE`], each piece flushed (`fdatasync`) before the next. One
//! fsync of a hundred megabytes of dirty pages at the end would make every
//! other fsync on the disk wait behind it: NATS's per-message syncs stalled
//! 200-260 ms behind a 400 MB write ending in one fsync, and 67 ms at most
//! when it was flushed 8 MiB at a time (`docs/BENCHMARKS.md`, "Freshness,
//! stage by stage"); a checkpoint's delta at 200,000 impressions/s is about
//! 100 MB. Pieces of 1 MiB wrote 100 MiB in 106-133 ms where pieces of
//! 8 MiB took 257-446 ms, with the same 4 KiB fsyncs beside them
//! ("Checkpoints in the background").

use std::path::{Path, PathBuf};

use adspend_common::error::{Error, Result};

use super::Checksum;

/// Bytes written between two `fdatasync`s of a local file.
pub(super) const LOCAL_PIECE: usize = 1024 * 1024;

/// Copy `range` of a local object's open file into `dest` (fsynced), in
/// [`LOCAL_PIECE`]s, checksumming on the way; returns (size, checksum).
pub(super) fn copy_local(
    mut file: std::fs::File,
    source: &Path,
    range: std::ops::Range<u64>,
    dest: &Path,
) -> Result<(u64, String)> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(range.start))
        .map_err(Error::io("seek", source))?;
    let input = file.take(range.end - range.start);
    let out = std::fs::File::create(dest).map_err(Error::io("create", dest))?;
    let mut out = Paced::new(out, dest);
    let copied = copy_chunks(input, source, &mut out, || {})?;
    out.finish()?;
    Ok(copied)
}

/// Copy the local file `source` into the `file://` object at `dest`;
/// returns (size, checksum).
pub(super) fn copy_into_local(source: &Path, dest: &Path) -> Result<(u64, String)> {
    let input = std::fs::File::open(source).map_err(Error::io("open", source))?;
    write_local(dest, |out| {
        copy_chunks(input, source, out, || {
            // Part of the object is written, the upload not completed.
            adspend_common::failpoint::hit("aggregator.mid_upload");
        })
    })
}

/// Read `input` to its end in [`LOCAL_PIECE`]s into `out`, checksumming on the
/// way and calling `each` after every piece; returns (size, checksum).
fn copy_chunks(
    mut input: impl std::io::Read,
    source: &Path,
    out: &mut Paced,
    mut each: impl FnMut(),
) -> Result<(u64, String)> {
    let mut buf = vec![0u8; LOCAL_PIECE];
    let mut checksum = Checksum::default();
    let mut size = 0u64;
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("read", source)(e)),
        };
        checksum.update(&buf[..n]);
        size += n as u64;
        out.write(&buf[..n])?;
        each();
    }
    Ok((size, checksum.finish()))
}

/// Write the `file://` object at `dest` as `object_store` does: into a
/// staged `<name>#<n>` beside it (which its listings skip), renamed into
/// place once complete and fsynced, then the directory fsynced; returns
/// what `fill` returned. A failure removes the staged file.
pub(super) fn write_local<T>(dest: &Path, fill: impl FnOnce(&mut Paced) -> Result<T>) -> Result<T> {
    let parent = dest
        .parent()
        .ok_or_else(|| Error::io("write", dest)(std::io::ErrorKind::InvalidInput.into()))?;
    std::fs::create_dir_all(parent).map_err(Error::io("create", parent))?;
    let (file, staged) = (1u64..)
        .find_map(|n| {
            let mut staged = dest.as_os_str().to_owned();
            staged.push(format!("#{n}"));
            let staged = PathBuf::from(staged);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&staged)
            {
                Ok(file) => Some(Ok((file, staged))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                Err(e) => Some(Err(Error::io("create", &staged)(e))),
            }
        })
        .expect("some staged name is free")?;
    let mut out = Paced::new(file, &staged);
    let written = fill(&mut out).and_then(|filled| {
        out.finish()?;
        std::fs::rename(&staged, dest).map_err(Error::io("rename into", dest))?;
        Ok(filled)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&staged);
    }
    let filled = written?;
    crate::store::fsync_dir(parent)?;
    Ok(filled)
}

/// A file written and flushed to disk [`LOCAL_PIECE`] by [`LOCAL_PIECE`] (see the
/// module's note); [`Paced::finish`] syncs the rest and the metadata.
pub(super) struct Paced {
    file: std::fs::File,
    path: PathBuf,
    unsynced: usize,
}

impl Paced {
    fn new(file: std::fs::File, path: &Path) -> Self {
        Paced {
            file,
            path: path.to_path_buf(),
            unsynced: 0,
        }
    }

    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        self.file
            .write_all(bytes)
            .map_err(Error::io("write", &self.path))?;
        self.unsynced += bytes.len();
        if self.unsynced >= LOCAL_PIECE {
            self.file
                .sync_data()
                .map_err(Error::io("fsync", &self.path))?;
            self.unsynced = 0;
        }
        Ok(())
    }

    fn finish(self) -> Result<()> {
        self.file.sync_all().map_err(Error::io("fsync", &self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_local_write_leaves_no_object_and_no_staged_file() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("shard/x.mdb");
        let err = write_local::<()>(&dest, |out| {
            out.write(&vec![1u8; LOCAL_PIECE + 1])?;
            Err(Error::io("read", Path::new("source"))(
                std::io::Error::other("gone"),
            ))
        })
        .unwrap_err();
        assert!(err.to_string().contains("source"), "{err}");
        assert!(!dest.exists());
        assert!(std::fs::read_dir(dir.path().join("shard"))
            .unwrap()
            .next()
            .is_none());
    }
}

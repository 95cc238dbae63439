//! Snapshot objects through `object_store`: `file:///dir` or
//! `s3://bucket/prefix` (credentials and endpoint from the `AWS_*`
//! environment). Uploads are multipart, so an object is complete or absent;
//! on a local filesystem the result is also fsynced. Every transfer computes
//! an xxh3-128 checksum on the way.
//! Local files (`file://` objects, downloads) are written by [`local`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetResultPayload, ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use adspend_common::error::{Error, Result};

use crate::config::SnapshotUrl;

mod bucket;
mod local;

pub(crate) use bucket::Created;
use local::{copy_into_local, copy_local, write_local, LOCAL_PIECE};

const CHUNK: usize = 8 * 1024 * 1024;

#[derive(Clone)]
pub struct SnapshotStore {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
    /// Root directory for `file://` stores, to fsync what was written.
    local_root: Option<PathBuf>,
    /// The bucket of an `s3://` store, to create it again if it is lost.
    bucket: Option<Arc<bucket::S3Bucket>>,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

/// Streaming checksum in the format stored in checkpoint records.
#[derive(Default)]
pub struct Checksum(xxhash_rust::xxh3::Xxh3);

impl Checksum {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> String {
        format!("xxh3-128:{:032x}", self.0.digest128())
    }
}

/// The `object_store` error inside one of ours, if that is what it is.
fn object_store_error(error: &Error) -> Option<&object_store::Error> {
    match error {
        Error::ObjectStore { source, .. } => source.downcast_ref::<object_store::Error>(),
        _ => None,
    }
}

/// The store answered that the object is not there (S3: no such key, or
/// no such bucket; `file://`: no such file), as opposed to not answering.
pub(crate) fn is_not_found(error: &Error) -> bool {
    matches!(
        object_store_error(error),
        Some(object_store::Error::NotFound { .. })
    )
}

/// S3 answered that the bucket itself does not exist (a store that
/// restarted empty, or a bucket deleted).
pub(crate) fn is_bucket_missing(error: &Error) -> bool {
    object_store_error(error).is_some_and(|e| {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(c) = cause {
            if c.to_string().contains("NoSuchBucket") {
                return true;
            }
            cause = c.source();
        }
        false
    })
}

impl SnapshotStore {
    /// [`SnapshotUrl::parse`] and [`SnapshotStore::open`].
    pub fn from_url(url: &str) -> Result<Self> {
        Self::open(&SnapshotUrl::parse(url)?)
    }

    /// The store at `url`: a `file://` directory is created; an `s3://`
    /// client takes its credentials and endpoint from `AWS_*`. Errors name
    /// the setting.
    pub(crate) fn open(url: &SnapshotUrl) -> Result<Self> {
        let bad = |reason: String| SnapshotUrl::bad(url.as_str(), reason);
        match url {
            SnapshotUrl::File { url, dir } => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| bad(format!("cannot create directory: {e}")))?;
                let root = dir
                    .canonicalize()
                    .map_err(|e| bad(format!("cannot resolve directory: {e}")))?;
                let store = object_store::local::LocalFileSystem::new_with_prefix(&root)
                    .map_err(|e| bad(e.to_string()))?;
                Ok(SnapshotStore {
                    store: Arc::new(store),
                    prefix: ObjectPath::default(),
                    url: url.clone(),
                    local_root: Some(root),
                    bucket: None,
                })
            }
            SnapshotUrl::S3 {
                url,
                bucket,
                prefix,
            } => {
                let builder =
                    object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
                let store = builder.clone().build().map_err(|e| bad(e.to_string()))?;
                let bucket = bucket::S3Bucket::new(bucket, &builder, store.credentials().clone())
                    .map_err(bad)?;
                Ok(SnapshotStore {
                    store: Arc::new(store),
                    prefix: ObjectPath::from(prefix.as_str()),
                    url: url.clone(),
                    local_root: None,
                    bucket: Some(Arc::new(bucket)),
                })
            }
        }
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The S3 bucket, for an `s3://` store.
    pub(crate) fn bucket(&self) -> Option<&str> {
        self.bucket.as_deref().map(bucket::S3Bucket::name)
    }

    /// Create the `s3://` store's bucket again, after S3 answered that it
    /// does not exist. `Ok(None)` for a `file://` store, whose directories
    /// are created as objects are written.
    pub(crate) async fn create_bucket(&self) -> std::result::Result<Option<Created>, String> {
        match &self.bucket {
            Some(bucket) => bucket.create().await.map(Some),
            None => Ok(None),
        }
    }

    fn path(&self, key: &str) -> ObjectPath {
        let mut parts: Vec<String> = self
            .prefix
            .parts()
            .map(|p| p.as_ref().to_string())
            .collect();
        parts.extend(key.split('/').filter(|s| !s.is_empty()).map(str::to_string));
        ObjectPath::from_iter(parts)
    }

    fn err(&self, op: &'static str, key: &str) -> impl FnOnce(object_store::Error) -> Error {
        let url = self.url.clone();
        let key = key.to_string();
        move |source| Error::ObjectStore {
            url,
            op,
            key,
            source: Box::new(source),
        }
    }

    /// Upload `pieces`, one after the other, as `key` in one request
    /// (complete or absent, as a single PUT is); on `file://` written by a
    /// low-priority thread ([`crate::background`]) and fsynced. Returns
    /// (size, checksum).
    pub(crate) async fn put(&self, key: &str, pieces: Vec<Bytes>) -> Result<(u64, String)> {
        let path = self.path(key);
        let mut checksum = Checksum::default();
        let mut size = 0u64;
        for piece in &pieces {
            checksum.update(piece);
            size += piece.len() as u64;
        }
        if let Some(dest) = self.local_path(&path) {
            let written = dest.clone();
            crate::background::run("put", move || {
                write_local(&dest, |out| {
                    pieces
                        .iter()
                        .flat_map(|piece| piece.chunks(LOCAL_PIECE))
                        .try_for_each(|part| out.write(part))
                })
            })
            .await
            .map_err(Error::io("write", &written))??;
        } else {
            self.store
                .put(&path, PutPayload::from_iter(pieces))
                .await
                .map_err(self.err("upload", key))?;
        }
        Ok((size, checksum.finish()))
    }

    /// Where the object at `path` lives on a `file://` store.
    fn local_path(&self, path: &ObjectPath) -> Option<PathBuf> {
        self.local_root
            .as_ref()
            .map(|root| root.join(path.as_ref()))
    }

    /// Upload a local file as `key`; returns (size, checksum).
    pub(crate) async fn upload(&self, key: &str, file: &Path) -> Result<(u64, String)> {
        let path = self.path(key);
        if let Some(dest) = self.local_path(&path) {
            let source = file.to_path_buf();
            return crate::background::run("upload", move || copy_into_local(&source, &dest))
                .await
                .map_err(Error::io("upload", file))?;
        }
        let mut input = tokio::fs::File::open(file)
            .await
            .map_err(Error::io("open", file))?;
        let upload = self
            .store
            .put_multipart(&path)
            .await
            .map_err(self.err("start upload of", key))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, CHUNK);
        let mut checksum = Checksum::default();
        let mut size = 0u64;
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match input.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let _ = writer.abort().await;
                    return Err(Error::io("read", file)(e));
                }
            };
            checksum.update(&buf[..n]);
            size += n as u64;
            if let Err(e) = writer.wait_for_capacity(4).await {
                return Err(self.err("upload", key)(e));
            }
            writer.write(&buf[..n]);
            // Part of the object is in flight, the upload not completed.
            adspend_common::failpoint::hit("aggregator.mid_upload");
        }
        writer
            .finish()
            .await
            .map_err(self.err("finish upload of", key))?;
        Ok((size, checksum.finish()))
    }

    /// Download `key` into `dest` (fsynced); returns (size, checksum).
    ///
    /// Written in [`CHUNK`]s: the object's own stream comes in pieces of a
    /// few KiB (8 KiB from a `file://` store, one blocking-pool trip each)
    /// and a gigabyte base would cost a quarter of a million such trips.
    pub(crate) async fn download(&self, key: &str, dest: &Path) -> Result<(u64, String)> {
        let result = self
            .store
            .get(&self.path(key))
            .await
            .map_err(self.err("download", key))?;
        let range = result.range.clone();
        match result.payload {
            GetResultPayload::File(file, source) => {
                let into = dest.to_path_buf();
                tokio::task::spawn_blocking(move || copy_local(file, &source, range, &into))
                    .await
                    .map_err(|e| Error::io("copy into", dest)(std::io::Error::other(e)))?
            }
            GetResultPayload::Stream(mut stream) => {
                let file = tokio::fs::File::create(dest)
                    .await
                    .map_err(Error::io("create", dest))?;
                let mut out = tokio::io::BufWriter::with_capacity(CHUNK, file);
                let mut checksum = Checksum::default();
                let mut size = 0u64;
                let mut unsynced = 0;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(self.err("download", key))?;
                    checksum.update(&chunk);
                    size += chunk.len() as u64;
                    out.write_all(&chunk)
                        .await
                        .map_err(Error::io("write", dest))?;
                    unsynced += chunk.len();
                    if unsynced >= LOCAL_PIECE {
                        // A piece at a time (see `local`).
                        out.flush().await.map_err(Error::io("write", dest))?;
                        out.get_ref()
                            .sync_data()
                            .await
                            .map_err(Error::io("fsync", dest))?;
                        unsynced = 0;
                    }
                }
                out.flush().await.map_err(Error::io("write", dest))?;
                out.into_inner()
                    .sync_all()
                    .await
                    .map_err(Error::io("fsync", dest))?;
                Ok((size, checksum.finish()))
            }
        }
    }

    /// The whole object `key` in memory, with its checksum: for deltas,
    /// which are applied from memory, so no local file or fsync.
    pub(crate) async fn get(&self, key: &str) -> Result<(bytes::Bytes, String)> {
        let bytes = self
            .store
            .get(&self.path(key))
            .await
            .map_err(self.err("download", key))?
            .bytes()
            .await
            .map_err(self.err("download", key))?;
        let mut checksum = Checksum::default();
        checksum.update(&bytes);
        Ok((bytes, checksum.finish()))
    }

    /// Keys under `dir` (relative to the store prefix), sorted.
    pub(crate) async fn list(&self, dir: &str) -> Result<Vec<String>> {
        let base = self.path(dir);
        let prefix_len = self.prefix.parts().count();
        let mut keys = Vec::new();
        let mut stream = self.store.list(Some(&base));
        while let Some(meta) = stream.next().await {
            let meta = meta.map_err(self.err("list", dir))?;
            let key: Vec<String> = meta
                .location
                .parts()
                .skip(prefix_len)
                .map(|p| p.as_ref().to_string())
                .collect();
            keys.push(key.join("/"));
        }
        keys.sort();
        Ok(keys)
    }

    pub(crate) async fn delete(&self, key: &str) -> Result<()> {
        match self.store.delete(&self.path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", key)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::env;

    #[tokio::test]
    async fn file_store_roundtrip_with_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/objects", dir.path().display());
        let store = SnapshotStore::from_url(&url).unwrap();
        let src = dir.path().join("src.bin");
        let data: Vec<u8> = (0..(CHUNK + 12345)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let (size, sum) = store.upload("shard/a.mdb", &src).await.unwrap();
        assert_eq!(size, data.len() as u64);
        let dest = dir.path().join("dest.bin");
        let (size2, sum2) = store.download("shard/a.mdb", &dest).await.unwrap();
        assert_eq!((size, &sum), (size2, &sum2));
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert_eq!(
            store.list("shard").await.unwrap(),
            vec!["shard/a.mdb".to_string()]
        );
        store.delete("shard/a.mdb").await.unwrap();
        assert!(store.list("shard").await.unwrap().is_empty());
        let err = store
            .download("shard/a.mdb", &dest)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("shard/a.mdb"), "{err}");
    }

    /// Files in `dir` whose names carry a staged upload's `#`.
    fn staged_files(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains('#'))
            .collect()
    }

    #[tokio::test]
    async fn a_local_put_lands_whole_beside_a_leftover_staged_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("objects");
        let store = SnapshotStore::from_url(&format!("file://{}", root.display())).unwrap();
        // A crash mid-upload left a staged file with the first name: it is
        // neither listed nor overwritten.
        std::fs::create_dir_all(root.join("shard")).unwrap();
        std::fs::write(root.join("shard/d.delta#1"), b"partial").unwrap();
        let data: Vec<u8> = (0..(2 * CHUNK + 7)).map(|i| (i % 253) as u8).collect();
        // In pieces of uneven sizes, as a delta's are: the object is their
        // concatenation, and so is its checksum.
        let pieces = [0..5, 5..LOCAL_PIECE + 3, LOCAL_PIECE + 3..data.len()]
            .map(|range| Bytes::copy_from_slice(&data[range]))
            .to_vec();
        let (size, sum) = store.put("shard/d.delta", pieces).await.unwrap();
        assert_eq!(size, data.len() as u64);
        let (bytes, sum2) = store.get("shard/d.delta").await.unwrap();
        assert_eq!((bytes.as_ref(), &sum2), (data.as_slice(), &sum));
        assert_eq!(
            store.list("shard").await.unwrap(),
            vec!["shard/d.delta".to_string()]
        );
        assert_eq!(staged_files(&root.join("shard")), vec!["d.delta#1"]);
        assert_eq!(
            std::fs::read(root.join("shard/d.delta#1")).unwrap(),
            b"partial"
        );
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in ["http://x", "file://", "s3://"] {
            let err = SnapshotStore::from_url(url).unwrap_err().to_string();
            assert!(err.contains(env::OBJECT_STORE_URL), "{err}");
        }
    }
}

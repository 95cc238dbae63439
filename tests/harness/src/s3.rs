//! An S3-compatible server (moto) for one test, and an S3 client for it:
//! object_store's, as the services use.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};
use tempfile::TempDir;

use super::ports::free_port;
use super::process::clean_env;
use super::scratch::scratch_dir;
use super::server::{Server, ServerSpec};
use super::tools::tool_path;
use super::wait::http_client;

/// moto accepts any credentials; these only have to be consistent.
const ACCESS_KEY: &str = "test";
const SECRET_KEY: &str = "test";
const REGION: &str = "us-east-1";

/// object_store has no bucket API. moto parses, but never verifies, SigV4
/// headers, so the one request this harness writes itself carries a
/// well-formed header with a dummy signature and acts as the `test` user.
const DUMMY_SIGV4: &str = "AWS4-HMAC-SHA256 \
    Credential=test/20240101/us-east-1/s3/aws4_request, \
    SignedHeaders=host, Signature=0000";

/// An S3-compatible endpoint (moto_server) on a free loopback port.
///
/// moto keeps buckets and objects in memory only: `kill()`, `stop()` and
/// `restart()` lose everything, buckets included. To take S3 away from a
/// service without losing data, use `pause()` / `resume()` (uploads then
/// hang instead of failing).
///
/// Killed on `Drop`.
pub type S3Server = Server<S3Spec>;

impl Server<S3Spec> {
    /// Starts moto and returns once it answers HTTP.
    ///
    /// # Panics
    ///
    /// If `moto_server` is missing or does not start; the message carries
    /// its log tail.
    pub async fn start() -> S3Server {
        let dir = scratch_dir("s3");
        let spec = S3Spec {
            binary: tool_path("moto_server"),
            log_path: dir.path().join("moto_server.log"),
            port: 0,
            stores: Mutex::default(),
            _dir: dir,
        };
        Server::launch(spec).await
    }

    /// `http://127.0.0.1:PORT`; stable across restarts.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port())
    }

    /// The variables an S3 client (object_store, the AWS SDKs) needs to talk
    /// to this server instead of AWS; pass them to a [`super::ServiceProcess`].
    pub fn env(&self) -> Vec<(String, String)> {
        let endpoint = self.endpoint();
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", REGION),
            ("AWS_DEFAULT_REGION", REGION),
            ("AWS_ENDPOINT", endpoint.as_str()),
            ("AWS_ENDPOINT_URL", endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
    }

    /// An object_store client for `bucket` on this server, configured as the
    /// services' own (path-style requests, plain HTTP), but without retries:
    /// a test sees the first failure. Kept for the server's lifetime; the
    /// port survives restarts.
    ///
    /// # Errors
    ///
    /// If object_store refuses the configuration.
    pub fn store(&self, bucket: &str) -> anyhow::Result<Arc<AmazonS3>> {
        let mut stores = self.spec().stores.lock().expect("S3 client cache");
        if let Some(store) = stores.get(bucket) {
            return Ok(store.clone());
        }
        // Without an explicit type moto's web framework treats the body as a
        // form and stores nothing. The proxy is never used: every request
        // goes to loopback, which it excludes; setting it keeps a
        // developer's HTTP_PROXY from intercepting loopback traffic.
        let options = ClientOptions::new()
            .with_allow_http(true)
            .with_default_content_type("application/octet-stream")
            .with_proxy_url("http://127.0.0.1:9")
            .with_proxy_excludes("127.0.0.1");
        let store = AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_region(REGION)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_bucket_name(bucket)
            .with_client_options(options)
            .with_retry(RetryConfig {
                max_retries: 0,
                ..RetryConfig::default()
            })
            .build()
            .with_context(|| format!("S3 client for bucket {bucket}"))?;
        let store = Arc::new(store);
        stores.insert(bucket.to_owned(), store.clone());
        Ok(store)
    }

    /// Creates `bucket`; creating an existing bucket succeeds.
    ///
    /// # Errors
    ///
    /// If the server is unreachable or refuses.
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let url = format!("{}/{bucket}", self.endpoint());
        let response = http_client()
            .put(&url)
            .header(reqwest::header::AUTHORIZATION, DUMMY_SIGV4)
            .send()
            .await
            .with_context(|| format!("PUT {url}"))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            anyhow::bail!("PUT {url}: {status}: {text}");
        }
        Ok(())
    }

    /// Writes an object, for tests that seed or damage what a service reads.
    ///
    /// # Errors
    ///
    /// If the server is unreachable or refuses (no such bucket).
    pub async fn put_object(
        &self,
        bucket: &str,
        key: &str,
        body: impl Into<Bytes>,
    ) -> anyhow::Result<()> {
        self.store(bucket)?
            .put(&object_path(key)?, body.into().into())
            .await
            .with_context(|| format!("PUT s3://{bucket}/{key}"))?;
        Ok(())
    }

    /// Reads an object; `None` if the key does not exist, so a test can
    /// poll for a service's upload.
    ///
    /// # Errors
    ///
    /// If the server is unreachable, the bucket does not exist, or it refuses.
    pub async fn get_object(&self, bucket: &str, key: &str) -> anyhow::Result<Option<Bytes>> {
        let what = || format!("GET s3://{bucket}/{key}");
        match self.store(bucket)?.get(&object_path(key)?).await {
            Ok(object) => object.bytes().await.with_context(what).map(Some),
            // A missing bucket is a 404 too, and an error here.
            Err(object_store::Error::NotFound { source, .. })
                if source.to_string().contains("NoSuchKey") =>
            {
                Ok(None)
            }
            Err(err) => Err(err).with_context(what),
        }
    }

    /// Deletes an object; deleting a missing key succeeds, as in S3.
    ///
    /// # Errors
    ///
    /// If the server is unreachable, the bucket does not exist, or it refuses.
    pub async fn delete_object(&self, bucket: &str, key: &str) -> anyhow::Result<()> {
        self.store(bucket)?
            .delete(&object_path(key)?)
            .await
            .with_context(|| format!("DELETE s3://{bucket}/{key}"))
    }

    /// Every key in `bucket` that starts with `prefix`, in lexicographic
    /// order, so a test can assert on exactly which files a service wrote.
    ///
    /// # Errors
    ///
    /// If the server is unreachable, the bucket does not exist, or the
    /// listing cannot be read.
    pub async fn list_keys(&self, bucket: &str, prefix: &str) -> anyhow::Result<Vec<String>> {
        // object_store lists whole directories: list the one the prefix
        // ends in, then keep the keys that start with all of it.
        let dir = match prefix.rsplit_once('/') {
            Some((dir, _)) => Some(object_path(dir)?),
            None => None,
        };
        let mut keys: Vec<String> = self
            .store(bucket)?
            .list(dir.as_ref())
            .map_ok(|object| object.location.to_string())
            .try_collect()
            .await
            .with_context(|| format!("LIST s3://{bucket}/{prefix}"))?;
        keys.retain(|key| key.starts_with(prefix));
        keys.sort_unstable();
        Ok(keys)
    }
}

/// `key` exactly as given: object_store's `Path::from` would percent-encode
/// characters such as `?` and `<` into the stored key itself.
fn object_path(key: &str) -> anyhow::Result<ObjectPath> {
    ObjectPath::parse(key).with_context(|| format!("S3 key {key:?}"))
}

/// How [`S3Server`] starts and probes moto, and its clients.
pub struct S3Spec {
    binary: PathBuf,
    log_path: PathBuf,
    port: u16,
    /// Bucket → client, see `S3Server::store`.
    stores: Mutex<HashMap<String, Arc<AmazonS3>>>,
    /// Holds the log; last so it is removed last.
    _dir: TempDir,
}

impl S3Spec {
    async fn answers(&self) -> bool {
        let url = format!("http://127.0.0.1:{}/", self.port);
        http_client().get(&url).send().await.is_ok()
    }
}

impl ServerSpec for S3Spec {
    const NAME: &'static str = "moto_server";

    fn pick_ports(&mut self) {
        self.port = free_port();
    }

    fn port(&self) -> u16 {
        self.port
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        clean_env(&mut command);
        command
            .arg("-H")
            .arg("127.0.0.1")
            .arg("-p")
            .arg(self.port.to_string());
        command
    }

    fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn probe(&self) -> impl Future<Output = bool> + '_ {
        self.answers()
    }
}

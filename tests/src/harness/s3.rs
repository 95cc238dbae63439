//! An S3-compatible server (moto) for one test.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use bytes::Bytes;
use nix::sys::signal::Signal;
use reqwest::{RequestBuilder, StatusCode};
use tempfile::TempDir;

use super::ports::free_port;
use super::process::clean_env;
use super::scratch::scratch_dir;
use super::server::{ServerCore, ServerSpec};
use super::tools::tool_path;
use super::wait::http_client;

/// moto accepts any credentials; these only have to be consistent.
const ACCESS_KEY: &str = "test";
const SECRET_KEY: &str = "test";
const REGION: &str = "us-east-1";

/// moto answers 403 to anonymous reads (writes pass). It parses, but never
/// verifies, SigV4 headers, so every harness request carries a well-formed
/// header with a dummy signature and acts as the `test` user.
const DUMMY_SIGV4: &str = "AWS4-HMAC-SHA256 \
    Credential=test/20240101/us-east-1/s3/aws4_request, \
    SignedHeaders=host, Signature=0000";

/// An S3-compatible endpoint (moto_server) on a free loopback port.
///
/// moto keeps buckets and objects in memory only: `kill()` and `restart()`
/// lose everything, buckets included. To take S3 away from a service
/// without losing data, use `pause()` / `resume()`.
///
/// Killed on `Drop`.
pub struct S3Server {
    core: ServerCore<S3Spec>,
}

impl S3Server {
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
            _dir: dir,
        };
        S3Server {
            core: ServerCore::start(spec).await,
        }
    }

    /// `http://127.0.0.1:PORT`; stable across restarts.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.core.spec().port)
    }

    /// The port alone, for configs that take host and port apart.
    pub fn port(&self) -> u16 {
        self.core.spec().port
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

    /// One line per request, kept across restarts: shows what a service
    /// actually sent.
    pub fn log_path(&self) -> &Path {
        &self.core.spec().log_path
    }

    /// `None` while the server is down.
    pub fn pid(&self) -> Option<u32> {
        self.core.pid()
    }

    /// Whether the process is alive; a paused one counts. Reaps it if it
    /// died, hence `&mut`.
    pub fn is_running(&mut self) -> bool {
        self.core.is_running()
    }

    /// Crashes the server (SIGKILL); all buckets and objects are lost.
    /// No-op if already down.
    pub fn kill(&mut self) {
        self.core.kill();
    }

    /// Shuts the server down (SIGTERM); all buckets and objects are lost.
    ///
    /// # Panics
    ///
    /// If it is still running after 30 s (it is then killed).
    pub fn stop(&mut self) {
        self.core.stop();
    }

    /// Freezes the server (SIGSTOP): uploads hang instead of failing, and
    /// nothing stored is lost.
    ///
    /// # Panics
    ///
    /// If the server is not running.
    pub fn pause(&mut self) {
        self.core.signal(Signal::SIGSTOP);
    }

    /// Undoes [`S3Server::pause`].
    ///
    /// # Panics
    ///
    /// If the server is not running.
    pub fn resume(&mut self) {
        self.core.signal(Signal::SIGCONT);
    }

    /// Starts the server again on the same port, empty: moto does not
    /// persist anything, so buckets must be created again.
    ///
    /// # Panics
    ///
    /// If the server is still running (`kill()` or `stop()` it first), or
    /// does not start.
    pub async fn restart(&mut self) {
        self.core.restart().await;
    }

    /// The last log lines (one per request), for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        self.core.log_tail(lines)
    }

    /// Creates `bucket`; creating an existing bucket succeeds.
    ///
    /// # Errors
    ///
    /// If the server is unreachable or refuses.
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let url = format!("{}/{bucket}", self.endpoint());
        let response = send(signed(http_client().put(&url))).await?;
        expect_success(response, "PUT", &url).await.map(drop)
    }

    /// Writes an object, for tests that seed what a service will read.
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
        let url = self.object_url(bucket, key);
        // Without an explicit type moto's web framework treats the body as a
        // form and stores nothing.
        let request = http_client()
            .put(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body.into());
        let response = send(signed(request)).await?;
        expect_success(response, "PUT", &url).await.map(drop)
    }

    /// Reads an object; `None` if the key does not exist, so a test can
    /// poll for a service's upload.
    ///
    /// # Errors
    ///
    /// If the server is unreachable, the bucket does not exist, or it refuses.
    pub async fn get_object(&self, bucket: &str, key: &str) -> anyhow::Result<Option<Bytes>> {
        let url = self.object_url(bucket, key);
        let response = send(signed(http_client().get(&url))).await?;
        if response.status() == StatusCode::NOT_FOUND {
            let text = response.text().await.unwrap_or_default();
            if text.contains("<Code>NoSuchKey</Code>") {
                return Ok(None);
            }
            bail!("GET {url}: 404: {text}");
        }
        let response = expect_success(response, "GET", &url).await?;
        response
            .bytes()
            .await
            .with_context(|| format!("GET {url}: read body"))
            .map(Some)
    }

    /// Every key in `bucket` under `prefix`, in S3's (lexicographic) order,
    /// so a test can assert on exactly which files a service wrote.
    ///
    /// # Errors
    ///
    /// If the server is unreachable, the bucket does not exist, or the
    /// listing cannot be read.
    pub async fn list_keys(&self, bucket: &str, prefix: &str) -> anyhow::Result<Vec<String>> {
        let url = format!("{}/{bucket}", self.endpoint());
        let mut keys = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let mut query = vec![("list-type", "2".to_owned()), ("prefix", prefix.to_owned())];
            if let Some(token) = continuation.take() {
                query.push(("continuation-token", token));
            }
            let request = signed(http_client().get(&url).query(&query));
            let response = expect_success(send(request).await?, "GET", &url).await?;
            let listing = response.text().await.context("read bucket listing")?;
            keys.extend(xml_values(&listing, "Key"));
            if xml_values(&listing, "IsTruncated")
                .first()
                .map(String::as_str)
                != Some("true")
            {
                return Ok(keys);
            }
            continuation = xml_values(&listing, "NextContinuationToken")
                .into_iter()
                .next();
            if continuation.is_none() {
                bail!("GET {url}: truncated listing without a continuation token");
            }
        }
    }

    /// Keys are percent-encoded per segment so `/` keeps separating
    /// "directories" while spaces and `?` stay part of the key.
    fn object_url(&self, bucket: &str, key: &str) -> String {
        let encoded: Vec<String> = key.split('/').map(percent_encode).collect();
        format!("{}/{bucket}/{}", self.endpoint(), encoded.join("/"))
    }
}

fn signed(request: RequestBuilder) -> RequestBuilder {
    request.header(reqwest::header::AUTHORIZATION, DUMMY_SIGV4)
}

async fn send(request: RequestBuilder) -> anyhow::Result<reqwest::Response> {
    request.send().await.context("S3 request failed")
}

async fn expect_success(
    response: reqwest::Response,
    method: &str,
    url: &str,
) -> anyhow::Result<reqwest::Response> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = response.text().await.unwrap_or_default();
    bail!("{method} {url}: {status}: {text}");
}

fn percent_encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The text of every `<tag>…</tag>` in `xml`, unescaped. S3 listings are
/// flat and regular enough that this beats pulling in an XML parser.
fn xml_values(xml: &str, tag: &str) -> Vec<String> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let mut values = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after_open = &rest[start + open.len()..];
        let Some(end) = after_open.find(&close) else {
            break;
        };
        values.push(xml_unescape(&after_open[..end]));
        rest = &after_open[end + close.len()..];
    }
    values
}

fn xml_unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

struct S3Spec {
    binary: PathBuf,
    log_path: PathBuf,
    port: u16,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_values_reads_every_occurrence_unescaped() {
        let xml = "<R><Key>a&amp;b</Key><Size>1</Size><Key>c/d</Key></R>";
        assert_eq!(xml_values(xml, "Key"), ["a&b", "c/d"]);
        assert!(xml_values(xml, "Missing").is_empty());
    }

    #[test]
    fn percent_encode_keeps_unreserved_bytes() {
        assert_eq!(percent_encode("a b?c"), "a%20b%3Fc");
        assert_eq!(percent_encode("day=2024-01-01.bin"), "day%3D2024-01-01.bin");
    }
}

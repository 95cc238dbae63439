//! Polling helpers: the harness never sleeps a fixed time and hopes.

use std::future::Future;
use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::bail;
use tokio::net::TcpStream;
use tokio::time::{sleep, timeout_at, Instant};

/// Polls `condition` until it returns true.
///
/// Tests wait on eventually-true facts (a consumer caught up, a file landed
/// in S3) instead of sleeping a guessed time, so they are neither slow nor
/// flaky. A poll that hangs is cut off at the deadline, so the timeout holds
/// even if `condition` never returns. Add context with
/// [`anyhow::Context`] to say what was awaited.
///
/// # Errors
///
/// If `condition` is still false after `timeout`.
pub async fn wait_until<F, Fut>(
    timeout: Duration,
    poll_interval: Duration,
    mut condition: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    let mut polls = 0_u32;
    loop {
        polls += 1;
        if let Ok(true) = timeout_at(deadline, condition()).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("condition still false after {timeout:?} ({polls} polls)");
        }
        sleep(poll_interval).await;
    }
}

/// Polls `attempt` until it succeeds and returns its value.
///
/// For waits where the reason for not-yet matters: the timeout error carries
/// the last failure ("404 NoSuchKey", "connection refused") instead of just
/// "still false".
///
/// # Errors
///
/// If `attempt` has not succeeded after `timeout`.
pub async fn wait_until_ok<T, F, Fut>(
    timeout: Duration,
    poll_interval: Duration,
    mut attempt: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut polls = 0_u32;
    let mut last_error: Option<anyhow::Error> = None;
    loop {
        polls += 1;
        match timeout_at(deadline, attempt()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(err)) => last_error = Some(err),
            // Cut off at the deadline: the attempt before says why waiting
            // failed, if there was one.
            Err(_) => {
                last_error = Some(match last_error.take() {
                    Some(err) => err.context("the last attempt was still running at the deadline"),
                    None => anyhow::anyhow!("the attempt itself was still running at the deadline"),
                })
            }
        }
        if Instant::now() >= deadline {
            let err = last_error.expect("an attempt ended in an error or at the deadline");
            return Err(err.context(format!("still failing after {timeout:?} ({polls} polls)")));
        }
        sleep(poll_interval).await;
    }
}

/// An HTTP client for the harness's own probes and requests.
///
/// Built per use rather than shared: each `#[tokio::test]` has its own
/// runtime, and a pooled connection from a runtime that has shut down fails
/// the next request. Proxies are off because a developer's `HTTP_PROXY` must
/// not intercept loopback traffic.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("build a plain-HTTP reqwest client")
}

/// Whether something accepts TCP connections on `127.0.0.1:port`.
pub(crate) async fn accepts_tcp(port: u16) -> bool {
    let connect = TcpStream::connect((Ipv4Addr::LOCALHOST, port));
    matches!(
        tokio::time::timeout(Duration::from_secs(1), connect).await,
        Ok(Ok(_))
    )
}

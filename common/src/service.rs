//! The one shape of every service's `main`: parse the settings, validate
//! them once, bind the listeners, run until SIGTERM or SIGINT, then give
//! the tracked tasks [`SHUTDOWN_GRACE`] to finish.
//!
//! How a service ends:
//! - exit 0: stopped by SIGTERM or SIGINT (work in hand finished or safely
//!   abandoned); `--help` and `--version`.
//! - exit 64 ([`EXIT_BAD_SETTING`], `EX_USAGE`): a setting is wrong, whether
//!   it does not parse as its type, is out of range or fails validation.
//!   Restarting will not help.
//! - exit 1 ([`EXIT_FAILURE`]): anything else, such as NATS, etcd or the
//!   object store unreachable at start, a port taken, data that must not be
//!   read on. A supervisor may restart the service.
//!
//! Every failure is one line on stderr: `<service>: error: <what>`.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, EXIT_BAD_SETTING, EXIT_FAILURE};
use crate::{shutdown, telemetry};

/// How long, once shutdown is signalled, the service's `run` and then every
/// task it tracked may take to finish. Past it they are abandoned, as a
/// crash would abandon them (which loses nothing), with a warning.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Longest a `/metrics` request may take, from its first byte to the answer.
const METRICS_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head read on the metrics listener.
const METRICS_MAX_HEAD: usize = 8 * 1024;

/// An error that decides how the process ends: a common error by its own
/// code (a bad setting exits 64), anything a service adds to it exits 1.
/// The services' errors only say which of theirs is a common one.
pub trait Failure: std::error::Error {
    /// The common error this one is, if it is one.
    fn common(&self) -> Option<&Error>;

    /// How the process ends when this error reaches `main`.
    fn exit_code(&self) -> u8 {
        self.common().map_or(EXIT_FAILURE, Error::exit_code)
    }
}

impl Failure for Error {
    fn common(&self) -> Option<&Error> {
        Some(self)
    }
}

/// What `run` is handed besides its settings and listeners.
#[derive(Clone, Debug)]
pub struct Context {
    /// Cancelled on SIGTERM or SIGINT (or when `run` returns).
    pub shutdown: CancellationToken,
    /// Tasks that must finish before the process exits; waited for (up to
    /// [`SHUTDOWN_GRACE`]) after `run` returns.
    pub tasks: TaskTracker,
}

impl Context {
    /// A context of its own, for tests and tools that run a service in
    /// process.
    pub fn new() -> Self {
        Context {
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }
}

impl Default for Context {
    fn default() -> Self {
        Context::new()
    }
}

/// A service: its validated settings, which know how to bind and run.
pub trait Service: Sized + Send + 'static {
    /// The name in the error line and the logs.
    const NAME: &'static str;
    /// The service's histograms with their bucket bounds (its telemetry
    /// module's): the recorder needs them before the first sample, or it
    /// exports a summary.
    const HISTOGRAMS: telemetry::Histograms;
    /// The settings as parsed from flags and `ADSPEND_*` variables.
    type Config: Parser;
    /// The sockets the service serves on, besides `/metrics`.
    type Listeners: Send;
    type Error: Failure + From<Error> + Send + 'static;

    /// Everything that can be checked before binding or connecting, done
    /// once; every value is parsed here and kept in `Self`.
    fn validate(config: Self::Config) -> Result<Self, Self::Error>;

    /// Where `/metrics` is served.
    fn metrics_addr(&self) -> SocketAddr;

    /// Bind the service's own listeners.
    fn bind(&self) -> impl Future<Output = Result<Self::Listeners, Self::Error>> + Send;

    /// Serve until `context.shutdown` is cancelled or a fatal error.
    fn run(
        self,
        listeners: Self::Listeners,
        context: Context,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The whole `main` of a service.
pub fn main<S: Service>() -> ExitCode {
    let config = match S::Config::try_parse() {
        Ok(config) => config,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{}: error: {}", S::NAME, usage_line::<S::Config>(&e));
            return ExitCode::from(EXIT_BAD_SETTING);
        }
    };
    telemetry::init_tracing();
    let service = match S::validate(config) {
        Ok(service) => service,
        Err(e) => return failed::<S>(&e),
    };
    let workers = match worker_threads() {
        Ok(workers) => workers,
        Err(e) => return failed::<S>(&S::Error::from(e)),
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    let runtime = match builder.enable_all().thread_name(S::NAME).build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{}: error: cannot start the async runtime: {e}", S::NAME);
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    // On the runtime's workers, not the main thread: whatever the service
    // does inside its own future is then shared out like the rest.
    let served = runtime.spawn(serve(service));
    let result = runtime.block_on(served);
    // Whatever was not tracked (a blocking read in flight) is abandoned.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => failed::<S>(&e),
        Err(e) => {
            eprintln!("{}: error: the service's task ended: {e}", S::NAME);
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// `ADSPEND_WORKER_THREADS`: the async runtime's worker threads, `None`
/// for one per core.
fn worker_threads() -> Result<Option<usize>, Error> {
    let Ok(value) = std::env::var(crate::env::WORKER_THREADS) else {
        return Ok(None);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(Some(n)),
        _ => Err(Error::Config {
            name: crate::env::WORKER_THREADS,
            value,
            reason: "a number of threads, 1..=1024".into(),
        }),
    }
}

fn failed<S: Service>(error: &S::Error) -> ExitCode {
    eprintln!("{}: error: {error}", S::NAME);
    ExitCode::from(error.exit_code())
}

async fn serve<S: Service>(service: S) -> Result<(), S::Error> {
    // First, so that a signal during start-up is a clean stop too.
    let shutdown = shutdown::on_signals().map_err(Error::io("install handler of", "SIGTERM"))?;
    let metrics = bind("metrics listener", service.metrics_addr()).await?;
    let listeners = service.bind().await?;
    let context = Context {
        shutdown: shutdown.clone(),
        tasks: TaskTracker::new(),
    };
    let tasks = context.tasks.clone();
    tasks.spawn(serve_metrics(
        metrics,
        telemetry::install_metrics(S::HISTOGRAMS),
        shutdown.clone(),
        tasks.clone(),
    ));

    let run = service.run(listeners, context);
    tokio::pin!(run);
    let (result, deadline) = tokio::select! {
        result = &mut run => (result, Instant::now() + SHUTDOWN_GRACE),
        _ = shutdown.cancelled() => {
            let deadline = Instant::now() + SHUTDOWN_GRACE;
            match tokio::time::timeout_at(deadline, &mut run).await {
                Ok(result) => (result, deadline),
                Err(_) => {
                    tracing::warn!(
                        grace_ms = SHUTDOWN_GRACE.as_millis() as u64,
                        "still stopping after the shutdown grace; abandoning the work in hand"
                    );
                    (Ok(()), deadline)
                }
            }
        }
    };
    shutdown.cancel();
    tasks.close();
    if tokio::time::timeout_at(deadline, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            tasks = tasks.len(),
            grace_ms = SHUTDOWN_GRACE.as_millis() as u64,
            "tasks still running after the shutdown grace; abandoning them"
        );
    }
    tracing::info!(service = S::NAME, "stopped");
    result
}

/// Bind `addr`, naming `what` in the error.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind {
        what,
        addr: addr.to_string(),
        source,
    })
}

/// clap's message on one line, with the environment variable behind the
/// flag it names (a value from the environment is reported by its flag).
fn usage_line<C: CommandFactory>(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let line = first.strip_prefix("error: ").unwrap_or(first).to_string();
    let Some(ContextValue::String(arg)) = error.get(ContextKind::InvalidArg) else {
        return line;
    };
    let Some(long) = arg
        .strip_prefix("--")
        .and_then(|rest| rest.split([' ', '=']).next())
    else {
        return line;
    };
    let command = C::command();
    let env = command
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env())
        .map(|env| env.to_string_lossy().into_owned());
    match env {
        Some(env) => format!("{line} (--{long} or {env})"),
        None => line,
    }
}

/// `/metrics` (any path) on `listener`, one request per connection, until
/// shutdown.
async fn serve_metrics(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: pause, not spin.
                    tracing::warn!(error = %e, "metrics listener accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let handle = handle.clone();
        tasks.spawn(async move {
            let answer = answer_metrics(stream, &handle);
            let _ = tokio::time::timeout(METRICS_REQUEST_TIMEOUT, answer).await;
        });
    }
}

async fn answer_metrics(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() + n > METRICS_MAX_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let (status, body) = if head.starts_with(b"GET ") {
        ("200 OK", handle.render())
    } else {
        ("405 Method Not Allowed", String::new())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser, Debug)]
    struct Settings {
        /// Number of partitions.
        #[arg(long, env = "ADSPEND_TEST_PARTITIONS", default_value_t = 1,
              value_parser = clap::value_parser!(u32).range(1..=8))]
        partitions: u32,
    }

    fn parse_error(args: &[&str]) -> clap::Error {
        let mut all = vec!["test"];
        all.extend_from_slice(args);
        Settings::try_parse_from(all).unwrap_err()
    }

    #[test]
    fn a_parse_error_is_one_line_naming_flag_and_variable() {
        for args in [&["--partitions=abc"][..], &["--partitions=9"]] {
            let line = usage_line::<Settings>(&parse_error(args));
            assert!(!line.contains('\n'), "{line}");
            assert!(!line.starts_with("error:"), "{line}");
            assert!(line.contains("--partitions"), "{line}");
            assert!(
                line.ends_with("(--partitions or ADSPEND_TEST_PARTITIONS)"),
                "{line}"
            );
        }
        let unknown = usage_line::<Settings>(&parse_error(&["--nope"]));
        assert!(unknown.contains("--nope"), "{unknown}");
    }

    #[tokio::test]
    async fn metrics_are_served_on_a_listener_bound_by_the_caller() {
        let listener = bind("metrics listener", "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!("adspend_test_total").increment(3);
        });
        let (shutdown, tasks) = (CancellationToken::new(), TaskTracker::new());
        tasks.spawn(serve_metrics(
            listener,
            handle,
            shutdown.clone(),
            tasks.clone(),
        ));
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.contains("adspend_test_total 3"), "{response}");
        shutdown.cancel();
        tasks.close();
        tasks.wait().await;
    }

    #[tokio::test]
    async fn a_taken_port_is_a_bind_error_that_exits_1() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let error = bind("metrics listener", taken.local_addr().unwrap())
            .await
            .unwrap_err();
        assert!(matches!(error, Error::Bind { .. }), "{error}");
        assert!(std::error::Error::source(&error).is_some());
        assert_eq!(error.exit_code(), EXIT_FAILURE);
    }
}

//! Serving HTTP so that slow or stuck clients cannot starve the bidders:
//!
//! - a cap on open connections: at the cap the listener stops accepting and
//!   new connections wait in the kernel's backlog (HTTP/1, one request at a
//!   time per connection, so this also caps concurrent requests);
//! - a cap on open connections per client address ([`PerAddr`]; an IPv6
//!   client counts by its /64): a connection past it is answered 429 (JSON)
//!   and closed as soon as it is accepted, so one host holding or
//!   reconnecting many slow connections takes at most its share of the
//!   places and the other addresses keep being served;
//! - deadlines on every connection ([`Deadlines`]): a request's head must
//!   arrive within the request timeout of its first byte (of the accept, for
//!   a connection's first request), a keep-alive connection may sit idle for
//!   the idle timeout, and a response write may stall no longer than the
//!   request timeout; past any of these the connection is closed, which
//!   frees its place under the cap;
//! - once the head is in, the handler, body reading included, has the
//!   request timeout: past it the answer is 408 (JSON) and the connection
//!   closes.
//!
//! axum's `serve` sets no hyper timer, so hyper's own header timeout is off;
//! the deadlines here stand in for it.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use adspend_common::telemetry::PACER_HTTP_REFUSED_TOTAL;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::reply::error;

/// Limits of one HTTP listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub request_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// Open connections one client address may hold (at most
    /// `max_connections` in effect).
    pub max_connections_per_addr: usize,
}

/// Serve `app` on `listener` under `limits` until `shutdown`; in-flight
/// requests are finished first.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let listener = Capped {
        permits: Arc::new(Semaphore::new(limits.max_connections)),
        per_addr: Arc::new(PerAddr::new(limits.max_connections_per_addr)),
        listener,
        limits,
    };
    let app = app.layer(axum::middleware::from_fn_with_state(
        limits.request_timeout,
        request_deadline,
    ));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// The handler's deadline (body reading included): 408 past it.
async fn request_deadline(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => {
            metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "timeout").increment(1);
            let mut response = error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request not completed within {} ms (ADSPEND_PACER_REQUEST_TIMEOUT_MS)",
                    timeout.as_millis()
                ),
            );
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}

/// A TCP listener that holds at most `max_connections` open connections,
/// and at most `max_connections_per_addr` of them from one address.
struct Capped {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    per_addr: Arc<PerAddr>,
    limits: HttpLimits,
}

impl axum::serve::Listener for Capped {
    type Io = Deadlines<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Wait for a place before accepting: the connections over the
            // cap stay in the backlog rather than holding a descriptor each.
            let permit = self
                .permits
                .clone()
                .acquire_owned()
                .await
                .expect("the connection semaphore is never closed");
            let (stream, addr) = axum::serve::Listener::accept(&mut self.listener).await;
            let Some(slot) = PerAddr::take(&self.per_addr, addr.ip()) else {
                // Its place goes back with `permit` at once.
                refuse(stream, addr.ip(), self.per_addr.max);
                continue;
            };
            // Small JSON answers on the bidder's hot path: no Nagle delay.
            let _ = stream.set_nodelay(true);
            return (Deadlines::new(stream, permit, slot, self.limits), addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// The environment variable of the per-address cap, for the refusal.
const PER_ADDR_SETTING: &str = crate::config::PACER_MAX_CONNECTIONS_PER_ADDR;

/// A connection past its address's cap: 429 if the socket takes it without
/// waiting (a fresh one does), then closed. No task and no wait, so a flood
/// of them costs an accept and a write each.
fn refuse(stream: TcpStream, ip: IpAddr, max: usize) {
    metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "connections_per_addr").increment(1);
    let body = format!(
        "{{\"error\":\"too many connections from {ip}: at most {max} ({PER_ADDR_SETTING})\"}}"
    );
    let response = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(response.as_bytes());
}

/// Open connections per client address. One host (an IPv6 client by its
/// /64, which one subscriber usually holds whole) counts as one address;
/// the table holds only addresses with a connection open, so it is never
/// larger than the connection cap.
pub(crate) struct PerAddr {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// A connection's place under its address's cap, given back on drop.
pub(crate) struct AddrSlot {
    table: Arc<PerAddr>,
    key: IpAddr,
}

impl PerAddr {
    fn new(max: usize) -> Self {
        PerAddr {
            max,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A place for a connection from `ip`, unless its address is at the cap.
    fn take(table: &Arc<PerAddr>, ip: IpAddr) -> Option<AddrSlot> {
        let key = addr_key(ip);
        let mut open = table.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(key).or_insert(0);
        if *count >= table.max {
            return None;
        }
        *count += 1;
        Some(AddrSlot {
            table: table.clone(),
            key,
        })
    }

    /// Connections open from `ip`'s address.
    #[cfg(test)]
    fn open(&self, ip: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.get(&addr_key(ip)).copied().unwrap_or(0)
    }
}

impl Drop for AddrSlot {
    fn drop(&mut self) {
        let mut open = self.table.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// The address a client is counted under: IPv4 as is (an IPv4-mapped IPv6
/// address too), IPv6 by its /64.
fn addr_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        },
    }
}

/// Where a connection is in its request/response cycle, as seen from the
/// bytes going through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before a request's first byte (after accept, or after a response).
    Waiting,
    /// Reading a request head (up to its blank line).
    Head(HeadScan),
    /// The head is in: the handler (and its timeout) has the request.
    Handling,
}

/// Finds the blank line that ends a request head, across reads; leading
/// blank lines (which HTTP/1 servers skip) do not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HeadScan {
    seen_content: bool,
    at_line_start: bool,
}

impl HeadScan {
    fn new() -> Self {
        HeadScan {
            seen_content: false,
            at_line_start: true,
        }
    }

    /// Feed bytes; true once the head is complete.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            match b {
                b'\n' => {
                    if self.seen_content && self.at_line_start {
                        return true;
                    }
                    self.at_line_start = true;
                }
                b'\r' => {}
                _ => {
                    self.seen_content = true;
                    self.at_line_start = false;
                }
            }
        }
        false
    }
}

/// A connection with the deadlines of the module docs, holding its place
/// under the connection cap until dropped.
pub struct Deadlines<T> {
    inner: T,
    _permit: Option<OwnedSemaphorePermit>,
    _slot: Option<AddrSlot>,
    limits: HttpLimits,
    phase: Phase,
    /// The read deadline is for a connection's first request (armed at accept).
    first: bool,
    read_deadline: Pin<Box<Sleep>>,
    read_armed: bool,
    write_deadline: Pin<Box<Sleep>>,
    write_armed: bool,
}

fn timed_out(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what)
}

impl<T> Deadlines<T> {
    fn new(inner: T, permit: OwnedSemaphorePermit, slot: AddrSlot, limits: HttpLimits) -> Self {
        let mut conn = Self::with_permit(inner, Some(permit), limits);
        conn._slot = Some(slot);
        conn
    }

    fn with_permit(inner: T, permit: Option<OwnedSemaphorePermit>, limits: HttpLimits) -> Self {
        let now = Instant::now();
        Deadlines {
            inner,
            _permit: permit,
            _slot: None,
            limits,
            phase: Phase::Waiting,
            first: true,
            read_deadline: Box::pin(tokio::time::sleep_until(now + limits.request_timeout)),
            read_armed: true,
            write_deadline: Box::pin(tokio::time::sleep_until(now + limits.request_timeout)),
            write_armed: false,
        }
    }

    fn arm_read(&mut self, after: Duration) {
        self.read_deadline.as_mut().reset(Instant::now() + after);
        self.read_armed = true;
    }

    fn on_read(&mut self, bytes: &[u8]) {
        if self.phase == Phase::Waiting {
            self.phase = Phase::Head(HeadScan::new());
            // A first request keeps the deadline of its accept.
            if !self.first {
                self.arm_read(self.limits.request_timeout);
            }
        }
        if let Phase::Head(scan) = &mut self.phase {
            if scan.feed(bytes) {
                self.phase = Phase::Handling;
                self.read_armed = false;
            }
        }
    }

    fn on_written(&mut self) {
        self.write_armed = false;
        if self.phase != Phase::Waiting {
            // A response is going out: the next request may take its time,
            // up to the idle timeout.
            self.phase = Phase::Waiting;
            self.first = false;
            self.arm_read(self.limits.idle_timeout);
        }
    }

    /// On a write that cannot proceed: the stall deadline, armed once.
    fn poll_write_stall(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if !self.write_armed {
            self.write_deadline
                .as_mut()
                .reset(Instant::now() + self.limits.request_timeout);
            self.write_armed = true;
        }
        match self.write_deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(timed_out("response write stalled")),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Deadlines<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Checked before reading too: a client trickling bytes is never
        // Pending for long.
        if this.read_armed && this.read_deadline.is_elapsed() {
            return Poll::Ready(Err(timed_out("request deadline passed")));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.on_read(&buf.filled()[before..]);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if this.read_armed && this.read_deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(timed_out("request deadline passed")));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Deadlines<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    this.on_written();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_write_stall(cx).map(Err),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    this.on_written();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_write_stall(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending => this.poll_write_stall(cx).map(Err),
            ready => {
                this.write_armed = false;
                ready
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMITS: HttpLimits = HttpLimits {
        request_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(2_000),
        max_connections: 1,
        max_connections_per_addr: 1,
    };

    #[test]
    fn each_address_has_its_own_count_and_gets_its_places_back() {
        let table = Arc::new(PerAddr::new(2));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let first = PerAddr::take(&table, a).expect("first of a");
        let second = PerAddr::take(&table, a).expect("second of a");
        assert!(PerAddr::take(&table, a).is_none(), "a is at its cap");
        assert!(PerAddr::take(&table, b).is_some(), "b is not");
        assert_eq!(table.open(a), 2);
        drop(first);
        assert_eq!(table.open(a), 1);
        let third = PerAddr::take(&table, a).expect("a place freed");
        drop((second, third));
        assert_eq!(table.open(a), 0);
        assert!(
            table.open.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }

    #[test]
    fn ipv6_clients_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let table = Arc::new(PerAddr::new(1));
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let _held = PerAddr::take(&table, one).unwrap();
        assert!(PerAddr::take(&table, same_64).is_none());
        assert!(PerAddr::take(&table, other_64).is_some());
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        let _v4 = PerAddr::take(&table, v4).unwrap();
        assert!(PerAddr::take(&table, mapped).is_none());
    }

    #[test]
    fn the_head_ends_at_its_first_blank_line_across_reads() {
        let mut scan = HeadScan::new();
        assert!(!scan.feed(b"\r\n"), "leading blank lines are skipped");
        assert!(!scan.feed(b"GET / HTTP/1.1\r\nHost: x\r"));
        assert!(!scan.feed(b"\n"));
        assert!(scan.feed(b"\r\n{\"body\"}"));
        let mut bare = HeadScan::new();
        assert!(bare.feed(b"GET / HTTP/1.1\nHost: x\n\n"));
    }

    #[tokio::test]
    async fn a_trickled_head_fails_at_the_request_deadline() {
        let (client, server) = tokio::io::duplex(1024);
        let mut conn = Deadlines::with_permit(server, None, LIMITS);
        let mut client = client;
        let trickle = tokio::spawn(async move {
            for byte in b"GET / HTTP/1.1\r\nX-Slow: " {
                if client.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Never finishes the head; keeps the connection open.
            tokio::time::sleep(Duration::from_secs(3600)).await;
        });
        let start = Instant::now();
        let mut buf = [0u8; 64];
        let error = loop {
            match conn.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= LIMITS.request_timeout);
        assert!(
            !trickle.is_finished(),
            "the client was still sending its head"
        );
        trickle.abort();
    }

    #[tokio::test]
    async fn a_new_connection_that_sends_nothing_is_closed_at_the_request_deadline() {
        let (_client, server) = tokio::io::duplex(1024);
        let mut conn = Deadlines::with_permit(server, None, LIMITS);
        let start = Instant::now();
        let error = conn.read(&mut [0u8; 16]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= LIMITS.request_timeout);
        assert!(
            start.elapsed() < LIMITS.idle_timeout,
            "a first request does not get the idle timeout"
        );
    }

    #[tokio::test]
    async fn a_handled_request_has_no_read_deadline_then_the_idle_one() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = Deadlines::with_permit(server, None, LIMITS);
        client
            .write_all(b"POST /v1/decisions HTTP/1.1\r\nContent-Length: 2\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0);
        assert_eq!(conn.phase, Phase::Handling);
        // The handler's own timeout governs now: a slow body is its to judge.
        tokio::time::sleep(LIMITS.request_timeout * 2).await;
        client.write_all(b"{}").await.unwrap();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 2);
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        assert_eq!(conn.phase, Phase::Waiting);
        // Idle: closed after the idle timeout, not the request timeout.
        let start = Instant::now();
        let error = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= LIMITS.idle_timeout);
    }
}

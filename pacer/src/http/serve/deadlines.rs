//! Deadlines on a connection's reads and writes, driven by where it is in
//! its request/response cycle (the module docs of [`super`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use super::per_addr::AddrSlot;
use super::HttpLimits;

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
pub(crate) struct Deadlines<T> {
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
    pub(super) fn new(
        inner: T,
        permit: OwnedSemaphorePermit,
        slot: AddrSlot,
        limits: HttpLimits,
    ) -> Self {
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

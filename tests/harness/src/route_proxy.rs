//! A TCP proxy in the test process between two NATS servers' cluster
//! ports, so a test can cut the route between them and heal it again while
//! both servers keep running.
//!
//! A cut closes every connection through the proxy (both directions, at
//! once: each side sees the other hang up) and closes each new one as soon
//! as it is accepted, until [`RouteProxy::heal`]. A real partition drops
//! packets instead, and a server notices it only when its pings go
//! unanswered; the proxy's cut is the fast end of that.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One listening port forwarding to `target`'s current value.
///
/// The proxy's task stops on `Drop`; so do its connections, with the
/// runtime that ran them.
pub(crate) struct RouteProxy {
    port: u16,
    cut: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl RouteProxy {
    /// Listens on a free loopback port and forwards each connection to
    /// 127.0.0.1:`target`, read when the connection comes in: a server
    /// that moved to other ports before its first start is still reached.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, or if no loopback port can be bound.
    pub(crate) async fn start(target: Arc<AtomicU16>) -> RouteProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|err| panic!("route proxy: cannot bind a port: {err}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|err| panic!("route proxy: cannot read its port: {err}"))
            .port();
        let (cut, watching) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, target, watching));
        RouteProxy { port, cut, task }
    }

    /// Where the dialing server connects.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy and refuses new ones.
    pub(crate) fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Lets connections through again.
    pub(crate) fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for RouteProxy {
    fn drop(&mut self) {
        self.cut.send_replace(true);
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, target: Arc<AtomicU16>, cut: watch::Receiver<bool>) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        if *cut.borrow() {
            // Closed at once: the dialer sees its route fail and retries.
            drop(inbound);
            continue;
        }
        let target = target.load(Ordering::Relaxed);
        tokio::spawn(forward(inbound, target, cut.clone()));
    }
}

/// Copies both ways until either side closes or the proxy is cut.
async fn forward(mut inbound: TcpStream, target: u16, mut cut: watch::Receiver<bool>) {
    let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    tokio::select! {
        _ = copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = cut.wait_for(|cut| *cut) => {}
    }
}

//! Free loopback ports.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Mutex, OnceLock};

/// Ports already given to a server in this process. The kernel may hand the
/// same just-released port to two `bind(:0)` calls in a row, and a server
/// that is down between `kill()` and `restart()` must get its port back, so
/// no port is ever handed out twice by one test process.
fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// A port on 127.0.0.1 that was free a moment ago.
///
/// Another process can still take it before the server binds, which is why
/// the servers in this harness retry their first start on new ports.
///
/// # Panics
///
/// If no free port can be bound at all (the loopback interface is unusable).
pub fn free_port() -> u16 {
    for _ in 0..100 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|err| panic!("cannot bind a port on 127.0.0.1: {err}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|err| panic!("cannot read a bound port: {err}"))
            .port();
        drop(listener);
        let fresh = handed_out()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(port);
        if fresh {
            return port;
        }
    }
    panic!("the kernel kept returning ports this test process already uses");
}

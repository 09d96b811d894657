//! Ports for the few servers a test must name a port to before they start: the workers the
//! planner's `local` connector spawns from `ports_from`, a worker restarted where it was.
//! Every other server in the suites binds port 0 and reports the port it got.
//!
//! These ports come from below the system's ephemeral range (`ip_local_port_range`), which the
//! kernel never hands out on its own, neither for a bind to port 0 nor for an outgoing
//! connection; so only another explicit bind could take one. Within a process each run is
//! handed out once, runs start at an offset of the process id (two test processes rarely
//! overlap), and a run with any port already bound is skipped.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const FLOOR: u32 = 10_000;

/// The first port of `n` consecutive ports nothing listens on, none of which the kernel assigns
/// by itself and none handed out before in this process.
pub fn reserved_run(n: u16) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let floor = ephemeral_floor();
    assert!(floor > FLOOR + 2_000, "the ephemeral range starts at {floor}: no room below it for reserved ports");
    let ceiling = floor - 1;
    let span = ceiling - FLOOR;
    let offset = (std::process::id() % 16) * (span / 16);
    loop {
        let at = NEXT.fetch_add(u32::from(n), Ordering::Relaxed);
        assert!(at < span, "no run of {n} free ports left below {ceiling}");
        let first = FLOOR + (offset + at) % (span - u32::from(n));
        let first = u16::try_from(first).expect("below the ephemeral range");
        if (first..first + n).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return first;
        }
    }
}

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_floor() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(32_768)
}

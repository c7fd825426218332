//! Free loopback ports for tests, benchmarks and demos that start buses on fixed ports.
//!
//! Asking the kernel for port 0 and releasing it races: the port comes from the
//! ephemeral range, which is also where every outgoing connection's local port comes
//! from, so a connection opened by anything else in the process (a bus link, an HTTP
//! client) can take it before the bus binds it. Ports here come from *below* that
//! range, which the kernel never hands out on its own, at a random start per process,
//! each checked by binding it.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out: above the well-known and common service ports.
const FLOOR: u32 = 10_000;
/// Linux's default first ephemeral port, used when the kernel's setting is unreadable.
const DEFAULT_EPHEMERAL_LOW: u32 = 32_768;

/// `n` distinct loopback ports that were free a moment ago and that the kernel does not
/// hand out as ephemeral ports. Fails when the range below the ephemeral ports has too
/// few free ones.
pub fn free_loopback_ports(n: usize) -> io::Result<Vec<u16>> {
    let ceiling = ephemeral_low().clamp(FLOOR + 1_000, u32::from(u16::MAX));
    let span = ceiling - FLOOR;
    let mut held = Vec::with_capacity(n);
    for _ in 0..span {
        if held.len() == n {
            break;
        }
        let port = FLOOR + next_offset() % span;
        let Ok(port) = u16::try_from(port) else { continue };
        if let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            held.push(listener);
        }
    }
    if held.len() < n {
        return Err(io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!("only {} of {n} free loopback ports between {FLOOR} and {ceiling}", held.len()),
        ));
    }
    held.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

/// Successive offsets from a random start, shared by every caller in the process so two
/// callers never pick the same port.
fn next_offset() -> u32 {
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU32::new(RandomState::new().hash_one(std::process::id()) as u32));
    next.fetch_add(1, Ordering::Relaxed)
}

fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|low| low.parse().ok()))
        .unwrap_or(DEFAULT_EPHEMERAL_LOW)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports = free_loopback_ports(64).expect("free ports");
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 64);
        for port in ports {
            assert!(u32::from(port) >= FLOOR && u32::from(port) < ephemeral_low().max(FLOOR + 1_000), "{port}");
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("a returned port binds");
        }
    }
}

//! Which hosts of a topology run on this machine, so that the paths they name (model
//! directory, kernel libraries) can be checked here. The rule: a host runs here when this
//! machine can bind its bus address's IP — loopback and unspecified addresses always,
//! otherwise an address of one of this machine's interfaces. A host on another machine
//! cannot bind there, so its paths are left to that machine. A host written as a DNS
//! name runs here when the name resolves to such an address now.

use std::net::{IpAddr, SocketAddr, UdpSocket};

use crate::Endpoint;

/// Whether the host at `endpoint` runs on this machine; a name that does not resolve
/// (yet) is taken as another machine's.
pub(crate) fn endpoint_is_local(endpoint: &Endpoint) -> bool {
    match endpoint.ip() {
        Some(ip) => is_local(ip),
        None => endpoint.is_loopback() || endpoint.resolve().is_ok_and(|addr| is_local(addr.ip())),
    }
}

/// Whether `ip` belongs to this machine. Binding a UDP socket to an ephemeral port of
/// `ip` asks the kernel without sending anything; the socket is closed at once.
pub(crate) fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_unspecified_are_local_and_a_documentation_address_is_not() {
        let table: &[(&str, bool)] = &[
            ("127.0.0.1", true),
            ("127.0.0.2", true),
            ("::1", true),
            ("0.0.0.0", true),
            ("::", true),
            // TEST-NET-1 (RFC 5737) and the IPv6 documentation prefix (RFC 3849) are
            // assigned to no machine.
            ("192.0.2.1", false),
            ("2001:db8::1", false),
        ];
        for (ip, local) in table {
            let ip: IpAddr = ip.parse().unwrap_or(IpAddr::from([255, 255, 255, 255]));
            assert_eq!(is_local(ip), *local, "{ip}");
        }
    }
}

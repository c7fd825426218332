//! Which hosts of a topology run on this machine, so that the paths they name (model
//! directory, kernel libraries) can be checked here. The rule: a host runs here when this
//! machine can bind its bus address's IP — loopback and unspecified addresses always,
//! otherwise an address of one of this machine's interfaces. A host on another machine
//! cannot bind there, so its paths are left to that machine.

use std::net::{IpAddr, SocketAddr, UdpSocket};

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

//! A host's socket address as the topology writes it: an IP address or a DNS name, and a
//! port. A name is kept as written, never pinned to the address it had when the file was
//! read: whoever connects resolves it then, and again on every reconnect, because the
//! machine behind a name can change (a Kubernetes pod that is rescheduled keeps its DNS
//! name and gets a new IP address).

use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The host part of an [`Endpoint`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostAddr {
    Ip(IpAddr),
    /// A DNS name (RFC 1123 labels), resolved when connecting.
    Name(String),
}

/// `host:port`, the host an IP address or a DNS name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: HostAddr,
    pub port: u16,
}

/// A name that did not resolve to any address.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot resolve `{endpoint}`: {reason}")]
pub struct ResolveError {
    pub endpoint: String,
    pub reason: String,
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Endpoint {
        Endpoint { host: HostAddr::Ip(addr.ip()), port: addr.port() }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostAddr::Ip(ip) => write!(f, "{}", SocketAddr::new(*ip, self.port)),
            HostAddr::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;
    fn from_str(text: &str) -> Result<Endpoint, String> {
        Endpoint::parse(text)
    }
}

impl Endpoint {
    /// `host:port` or `tcp://host:port`; the host an IP address (IPv6 in brackets) or a
    /// DNS name; the port not 0, since other hosts need a fixed port to connect to.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let bare = match text.split_once("://") {
            Some(("tcp", rest)) => rest,
            Some((scheme, _)) => return Err(format!("`{text}`: only tcp:// addresses are supported, not {scheme}://")),
            None => text,
        };
        let example = "such as \"127.0.0.1:7400\" or \"node-0.tessera.svc:7400\"";
        let endpoint = match bare.parse::<SocketAddr>() {
            Ok(addr) => Endpoint::from(addr),
            Err(_) => {
                let (host, port) =
                    bare.rsplit_once(':').ok_or_else(|| format!("`{text}` is not a HOST:PORT address {example}"))?;
                let port: u16 =
                    port.parse().map_err(|_| format!("`{text}`: `{port}` is not a port number (1..=65535)"))?;
                check_dns_name(host).map_err(|why| format!("`{text}`: {why}; write a HOST:PORT address {example}"))?;
                Endpoint { host: HostAddr::Name(host.to_ascii_lowercase()), port }
            }
        };
        if endpoint.port == 0 {
            return Err(format!("`{text}`: port 0 is not allowed; other hosts need a fixed port to connect to"));
        }
        Ok(endpoint)
    }

    /// The IP address, when the host is written as one.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.host {
            HostAddr::Ip(ip) => Some(ip),
            HostAddr::Name(_) => None,
        }
    }

    /// The same host on another port.
    pub fn with_port(&self, port: u16) -> Endpoint {
        Endpoint { host: self.host.clone(), port }
    }

    /// A loopback IP address, or the name `localhost`.
    pub fn is_loopback(&self) -> bool {
        match &self.host {
            HostAddr::Ip(ip) => ip.is_loopback(),
            HostAddr::Name(name) => name == "localhost",
        }
    }

    /// The address to connect to or bind now: the IP address as written, or the first
    /// address the system resolver gives for the name (hosts file, then DNS). Blocking.
    pub fn resolve(&self) -> Result<SocketAddr, ResolveError> {
        let name = match &self.host {
            HostAddr::Ip(ip) => return Ok(SocketAddr::new(*ip, self.port)),
            HostAddr::Name(name) => name,
        };
        let failed = |reason: String| ResolveError { endpoint: self.to_string(), reason };
        let mut addrs = (name.as_str(), self.port).to_socket_addrs().map_err(|e| failed(e.to_string()))?;
        addrs.next().ok_or_else(|| failed("the name has no address".to_owned()))
    }

    /// [`Endpoint::resolve`], retried every `every` until `within` has passed: at start-up
    /// the name of a peer that is starting too may not be published yet.
    pub fn resolve_within(&self, within: Duration, every: Duration) -> Result<SocketAddr, ResolveError> {
        let deadline = Instant::now() + within;
        loop {
            match self.resolve() {
                Ok(addr) => return Ok(addr),
                Err(e) if Instant::now() + every > deadline => {
                    return Err(ResolveError {
                        endpoint: e.endpoint,
                        reason: format!("{} (still, after {} ms of retries)", e.reason, within.as_millis()),
                    });
                }
                Err(_) => std::thread::sleep(every),
            }
        }
    }
}

/// An RFC 1123 host name: dot-separated labels of ASCII letters, digits and '-', each
/// 1..=63 long and not starting or ending with '-', 253 characters at most.
fn check_dns_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the host is empty".to_owned());
    }
    if name.len() > 253 {
        return Err(format!("the host name is {} characters long; DNS allows 253", name.len()));
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    for label in name.split('.') {
        let bad = label.is_empty()
            || label.len() > 63
            || label.starts_with('-')
            || label.ends_with('-')
            || !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if bad {
            return Err(format!(
                "`{name}` is neither an IP address nor a DNS name (labels of letters, digits and '-', \
                 1 to 63 long, joined by dots)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_as_ip_or_name_and_bad_ones_say_why() {
        let ip = |s: &str| HostAddr::Ip(s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])));
        let name = |s: &str| HostAddr::Name(s.to_owned());
        let good: &[(&str, HostAddr, u16)] = &[
            ("127.0.0.1:7400", ip("127.0.0.1"), 7400),
            ("tcp://10.0.0.2:1", ip("10.0.0.2"), 1),
            ("[::1]:7400", ip("::1"), 7400),
            ("localhost:9", name("localhost"), 9),
            (
                "tessera-h0-0.tessera-bus.default.svc.cluster.local:7400",
                name("tessera-h0-0.tessera-bus.default.svc.cluster.local"),
                7400,
            ),
            ("Node-A:80", name("node-a"), 80),
        ];
        for (text, host, port) in good {
            assert_eq!(Endpoint::parse(text), Ok(Endpoint { host: host.clone(), port: *port }), "{text}");
        }
        let bad: &[(&str, &str)] = &[
            ("h0", "not a HOST:PORT"),
            ("h0:0", "port 0"),
            ("h0:70000", "not a port number"),
            ("under_score:80", "neither an IP address nor a DNS name"),
            ("-bad.example:80", "neither an IP address nor a DNS name"),
            ("a..b:80", "neither an IP address nor a DNS name"),
            (":80", "the host is empty"),
            ("udp://h0:80", "only tcp://"),
        ];
        for (text, phrase) in bad {
            let err = Endpoint::parse(text).expect_err(text);
            assert!(err.contains(phrase), "{text}: {err}");
        }
    }

    #[test]
    fn an_ip_resolves_to_itself_and_localhost_to_loopback() {
        let e = Endpoint::parse("10.1.2.3:7400").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.resolve().ok(), Some("10.1.2.3:7400".parse().unwrap()));
        let local = Endpoint::parse("localhost:7400").unwrap_or_else(|e| panic!("{e}"));
        let addr = local.resolve().unwrap_or_else(|e| panic!("{e}"));
        assert!(addr.ip().is_loopback() && addr.port() == 7400, "{addr}");
        assert!(local.is_loopback());
    }

    #[test]
    fn a_name_that_does_not_resolve_is_an_error_naming_it() {
        // `.invalid` is reserved never to resolve (RFC 6761); the hosts file answers first.
        let e = Endpoint::parse("nowhere.invalid:7400").unwrap_or_else(|e| panic!("{e}"));
        let err = e.resolve_within(Duration::from_millis(30), Duration::from_millis(10)).expect_err("resolved");
        assert_eq!(err.endpoint, "nowhere.invalid:7400");
        assert!(err.to_string().contains("cannot resolve `nowhere.invalid:7400`"), "{err}");
    }
}

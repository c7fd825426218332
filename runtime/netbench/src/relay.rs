//! `tessera bench relay`: an added-latency link in user space, for kernels without the
//! netem qdisc. Every TCP connection accepted on a listen address is forwarded to its
//! target, and every byte, in each direction, is written out `delay` after it was read.
//!
//! The bytes in flight per direction are bounded (`window_bytes`), as a TCP window
//! bounds them on a long link: a sender that fills the window waits, so a bulk transfer
//! through the relay runs at most `window / delay`, not at memory speed. End of stream
//! is forwarded after the bytes before it (a half-close stays a half-close); an error
//! on either side closes both.
//!
//! Put the relay in a path with address translation (nftables `dnat` to the relay in each
//! host's namespace), so that every address a host learns of a peer (bus names, the KV
//! engine's advertised address) still crosses it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;

/// Largest read forwarded as one piece.
const PIECE_BYTES: usize = 64 << 10;
/// A target that does not accept within this is given up (the client is closed).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("relay: cannot listen on {at}: {source}")]
    Listen { at: SocketAddr, source: std::io::Error },
    #[error("relay: {0}")]
    Invalid(String),
    #[error("relay I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// One listen address and where its connections go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub listen: SocketAddr,
    pub target: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct RelayOptions {
    pub routes: Vec<Route>,
    /// Added to every byte, in each direction (a round trip gains twice this).
    pub delay: Duration,
    /// Bytes read but not yet written, per direction of a connection.
    pub window_bytes: usize,
}

impl RelayOptions {
    fn validate(&self) -> Result<(), RelayError> {
        if self.routes.is_empty() {
            return Err(RelayError::Invalid("no route: give at least one listen address and target".into()));
        }
        if self.window_bytes == 0 {
            return Err(RelayError::Invalid("the window must be at least 1 byte".into()));
        }
        // Semaphore permits are counted in u32.
        if self.window_bytes > u32::MAX as usize {
            return Err(RelayError::Invalid(format!("a window of {} bytes is over 4 GiB", self.window_bytes)));
        }
        Ok(())
    }
}

/// Binds every route, reports the bound routes through `ready`, then relays until
/// `stop` resolves (connections in progress are dropped with it).
pub async fn serve(
    opts: &RelayOptions,
    stop: impl std::future::Future<Output = ()>,
    ready: impl FnOnce(&[Route]),
) -> Result<(), RelayError> {
    opts.validate()?;
    let mut bound = Vec::with_capacity(opts.routes.len());
    let mut listeners = Vec::with_capacity(opts.routes.len());
    for route in &opts.routes {
        let listener =
            TcpListener::bind(route.listen).await.map_err(|source| RelayError::Listen { at: route.listen, source })?;
        bound.push(Route { listen: listener.local_addr()?, target: route.target });
        listeners.push(listener);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (listener, route) in listeners.into_iter().zip(&bound) {
        tasks.spawn(accept_loop(listener, route.target, opts.delay, opts.window_bytes));
    }
    ready(&bound);
    stop.await;
    tasks.shutdown().await;
    Ok(())
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, delay: Duration, window: usize) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        // Reap finished connections as we go, so the set stays small.
        while connections.try_join_next().is_some() {}
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(e) => {
                tracing::warn!("relay to {target}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        connections.spawn(async move {
            if let Err(e) = relay_connection(client, target, delay, window).await {
                tracing::debug!("relay to {target}: connection ended: {e}");
            }
        });
    }
}

async fn relay_connection(
    client: TcpStream,
    target: SocketAddr,
    delay: Duration,
    window: usize,
) -> std::io::Result<()> {
    let upstream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connecting to {target}")))??;
    client.set_nodelay(true)?;
    upstream.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    // Either direction failing ends the connection (both halves are dropped).
    tokio::try_join!(
        direction(client_read, upstream_write, delay, window),
        direction(upstream_read, client_write, delay, window)
    )?;
    Ok(())
}

/// A piece read at `at`, holding its share of the window until it is written.
struct Piece {
    due: Instant,
    bytes: Vec<u8>,
    _window: OwnedSemaphorePermit,
}

/// Moves one direction: a reader stamps each piece, a writer holds it until it is due.
async fn direction(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    delay: Duration,
    window: usize,
) -> std::io::Result<()> {
    let window = Arc::new(Semaphore::new(window));
    let (tx, mut rx) = mpsc::unbounded_channel::<Piece>();
    let cap = PIECE_BYTES.min(window.available_permits());
    let reader = async move {
        loop {
            let mut bytes = vec![0u8; cap];
            // Wait for room before reading: a full window stops the sender, as TCP's does.
            let permit = window.clone().acquire_many_owned(cap as u32).await.map_err(std::io::Error::other)?;
            let n = from.read(&mut bytes).await?;
            if n == 0 {
                // End of stream: the writer half-closes after what came before.
                return Ok::<(), std::io::Error>(());
            }
            bytes.truncate(n);
            let mut permit = permit;
            // Give back what this piece does not use.
            drop(permit.split(cap - n));
            if tx.send(Piece { due: Instant::now() + delay, bytes, _window: permit }).is_err() {
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some(piece) = rx.recv().await {
            tokio::time::sleep_until(piece.due).await;
            to.write_all(&piece.bytes).await?;
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    /// An echo server; returns its address.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind((LOCAL, 0)).await.expect("bind");
        let at = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        at
    }

    /// Starts a relay in front of `target`; returns its address and the stop switch.
    async fn relay(
        target: SocketAddr,
        delay: Duration,
        window_bytes: usize,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (at_tx, at_rx) = tokio::sync::oneshot::channel();
        let opts =
            RelayOptions { routes: vec![Route { listen: SocketAddr::new(LOCAL, 0), target }], delay, window_bytes };
        tokio::spawn(async move {
            let result = serve(&opts, async { drop(stop_rx.await) }, |bound| {
                let _ = at_tx.send(bound[0].listen);
            })
            .await;
            result.expect("relay");
        });
        (at_rx.await.expect("relay bound"), stop_tx)
    }

    #[tokio::test]
    async fn a_round_trip_through_the_relay_takes_at_least_twice_the_delay() {
        let delay = Duration::from_millis(20);
        let (at, _stop) = relay(echo_server().await, delay, 1 << 20).await;
        let mut stream = TcpStream::connect(at).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        for round in 0..3u8 {
            let t = std::time::Instant::now();
            stream.write_all(&[round; 100]).await.expect("write");
            let mut back = [0u8; 100];
            stream.read_exact(&mut back).await.expect("read");
            assert_eq!(back, [round; 100]);
            assert!(t.elapsed() >= 2 * delay, "round trip {round} took {:?}, under twice {delay:?}", t.elapsed());
        }
    }

    #[tokio::test]
    async fn bulk_bytes_pass_whole_and_in_order_through_a_small_window_and_eof_follows() {
        let (at, _stop) = relay(echo_server().await, Duration::from_millis(1), 10_000).await;
        let sent: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let stream = TcpStream::connect(at).await.expect("connect");
        let (mut r, mut w) = stream.into_split();
        let body = sent.clone();
        let writer = tokio::spawn(async move {
            w.write_all(&body).await.expect("write");
            // The half-close travels through both relay directions and the echo server.
            w.shutdown().await.expect("shutdown");
        });
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut got))
            .await
            .expect("EOF in time")
            .expect("read");
        writer.await.expect("writer");
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "bytes differ after the relay");
    }

    #[tokio::test]
    async fn a_target_that_refuses_closes_the_client_and_bad_options_are_refused() {
        // A port nobody listens on: bind one, note it, drop it.
        let gone = TcpListener::bind((LOCAL, 0)).await.expect("bind").local_addr().expect("addr");
        let (at, _stop) = relay(gone, Duration::ZERO, 1 << 16).await;
        let mut stream = TcpStream::connect(at).await.expect("connect");
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await.expect("closed in time");
        assert!(matches!(n, Ok(0) | Err(_)), "the client was not closed: {n:?}");

        let none = RelayOptions { routes: vec![], delay: Duration::ZERO, window_bytes: 1 };
        let err = serve(&none, async {}, |_| {}).await.expect_err("no routes");
        assert!(err.to_string().contains("no route"), "{err}");
        let route = Route { listen: SocketAddr::new(LOCAL, 0), target: gone };
        let zero = RelayOptions { routes: vec![route], delay: Duration::ZERO, window_bytes: 0 };
        assert!(serve(&zero, async {}, |_| {}).await.expect_err("zero window").to_string().contains("window"));
    }
}

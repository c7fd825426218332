//! The data plane's TCP connections on a secured cluster (KV transfers, and the stage
//! links of pipeline instances across hosts): the same Noise handshake and host keys as
//! the bus (`security::noise`), then every byte in sealed records.
//!
//! ```text
//! handshake:  u16 length | handshake frame        (Hello ->, <- HelloReply, HelloDone ->)
//! records:    u32 length | sealed frame           (security::frame, kind Data)
//! ```
//! The server answers the reader's last handshake message with a Welcome (or a Refused)
//! handshake frame, so a reader whose key is not listed learns it at connect time.
//! The reader (initiator) grants two keys in its last handshake message: the first seals
//! its requests, the second the server's responses. A record holds at most
//! [`MAX_RECORD_BYTES`] of plaintext. A record that does not open (tampered, replayed,
//! from a key not granted) ends the connection; nothing from it reaches a region.
//! Partial records survive read timeouts, so a server waiting between requests with
//! short timeouts never loses its place in the stream.
#![forbid(unsafe_code)]

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::security::PlaneSecurity;
use crate::security::aead::TAG_BYTES;
use crate::security::frame::{self, HEADER_BYTES, Kind, Opener, Sealer};
use crate::security::noise::{self, Grant, GrantKind, Initiator, Responder};

/// Plaintext per record: large enough that the tag and header cost nothing, small
/// enough to bound a receiver's buffer.
pub(crate) const MAX_RECORD_BYTES: usize = 256 * 1024;
const MAX_HANDSHAKE_BYTES: usize = 4096;

/// A data-plane connection: plain, or sealed after a handshake.
pub(crate) enum Link {
    Plain(TcpStream),
    Sealed(Box<SealedStream>),
}

impl Link {
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Sealed(s) => s.tcp(),
        }
    }

    pub(crate) fn is_sealed(&self) -> bool {
        matches!(self, Link::Sealed(_))
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Sealed(s) => s.rx.read_opened(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.write(buf),
            Link::Sealed(s) => s.tx.seal_and_write(&[IoSlice::new(buf)]),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.write_vectored(bufs),
            Link::Sealed(s) => s.tx.seal_and_write(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp().flush()
    }
}

pub struct SealedStream {
    rx: SealedReader,
    tx: SealedWriter,
}

/// The receiving half of a sealed connection: opens records as they arrive.
pub struct SealedReader {
    tcp: TcpStream,
    sec: PlaneSecurity,
    opener: Opener,
    /// The record being received: its bytes so far (length prefix first).
    partial: Vec<u8>,
    /// The last record opened, its unread plaintext at `partial[at..end]` (the record
    /// is decrypted where it was received).
    at: usize,
    end: usize,
}

/// The sending half of a sealed connection: seals what it is given into records.
pub struct SealedWriter {
    tcp: TcpStream,
    sealer: Sealer,
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn write_handshake(tcp: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    let len = u16::try_from(frame.len()).map_err(|_| invalid("handshake message too long"))?;
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(frame);
    tcp.write_all(&out)
}

fn read_handshake(tcp: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    tcp.read_exact(&mut len)?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > MAX_HANDSHAKE_BYTES {
        return Err(invalid(format!("handshake message of {len} bytes")));
    }
    let mut frame = vec![0u8; len];
    tcp.read_exact(&mut frame)?;
    Ok(frame)
}

fn handshake_error(e: noise::HandshakeError) -> io::Error {
    let outcome = e.outcome();
    metrics::counter!("tessera_transfer_handshakes_total", "outcome" => outcome).increment(1);
    io::Error::new(io::ErrorKind::PermissionDenied, format!("transfer handshake {outcome}: {e}"))
}

impl SealedStream {
    fn new(tcp: TcpStream, sec: &PlaneSecurity, send: &Grant, receive: &Grant) -> io::Result<SealedStream> {
        let mut opener = Opener::new();
        opener.install(sec.cipher, receive.epoch, &receive.key);
        metrics::counter!("tessera_transfer_handshakes_total", "outcome" => "ok").increment(1);
        Ok(SealedStream {
            tx: SealedWriter {
                sealer: Sealer::new(sec.mode, sec.cipher, 0, send.epoch, &send.key),
                tcp: tcp.try_clone()?,
            },
            rx: SealedReader { tcp, sec: sec.clone(), opener, partial: Vec::new(), at: 0, end: 0 },
        })
    }

    /// The connection's two halves, for a reader and a writer that run apart.
    pub fn split(self) -> (SealedReader, SealedWriter) {
        (self.rx, self.tx)
    }

    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.rx.tcp
    }

    /// The reader's side: proves both keys within `timeout`, grants the two keys.
    pub fn connect(mut tcp: TcpStream, sec: &PlaneSecurity, timeout: Duration) -> io::Result<SealedStream> {
        let restore = tcp.read_timeout()?;
        tcp.set_read_timeout(Some(timeout))?;
        let (initiator, hello) = Initiator::start(&sec.identity, sec.mode, sec.cipher).map_err(handshake_error)?;
        write_handshake(&mut tcp, &hello)?;
        let reply = read_handshake(&mut tcp)?;
        let fresh = |epoch| Grant::fresh(GrantKind::Direct, epoch).map_err(io::Error::other);
        let (up, down) = (fresh(0)?, fresh(1)?);
        // Any listed host may serve regions; which one is the bus's business.
        let done =
            initiator.finish(&reply, &sec.keyring, None, &[up.clone(), down.clone()]).map_err(handshake_error)?;
        write_handshake(&mut tcp, &done)?;
        let answer = read_handshake(&mut tcp)?;
        match frame::kind_of(&answer) {
            Some(Kind::Welcome) => {}
            Some(Kind::Refused) => {
                return Err(handshake_error(noise::HandshakeError::UnknownKey {
                    key: "ours (the server refused it: is this host's .pub in its keys directory?)".into(),
                }));
            }
            _ => return Err(invalid("no answer to the transfer handshake")),
        }
        tcp.set_read_timeout(restore)?;
        SealedStream::new(tcp, sec, &up, &down)
    }

    /// The server's side: the reader must prove a listed key within `timeout`.
    pub fn accept(mut tcp: TcpStream, sec: &PlaneSecurity, timeout: Duration) -> io::Result<SealedStream> {
        let restore = tcp.read_timeout()?;
        tcp.set_read_timeout(Some(timeout))?;
        let hello = read_handshake(&mut tcp)?;
        let (responder, reply) =
            Responder::reply(&sec.identity, sec.mode, sec.cipher, &hello).map_err(handshake_error)?;
        write_handshake(&mut tcp, &reply)?;
        let done = read_handshake(&mut tcp)?;
        let (_, grants) = match responder.accept(&done, &sec.keyring) {
            Ok(accepted) => accepted,
            Err(e) => {
                let _ = write_handshake(&mut tcp, &noise::refused_frame(sec.mode));
                return Err(handshake_error(e));
            }
        };
        let [up, down] = grants.as_slice() else { return Err(invalid("expected two key grants")) };
        write_handshake(&mut tcp, &frame::handshake_frame(Kind::Welcome, sec.mode, &[]))?;
        tcp.set_read_timeout(restore)?;
        SealedStream::new(tcp, sec, down, up)
    }
}

impl SealedWriter {
    /// Seals `bufs` as records of up to [`MAX_RECORD_BYTES`], each written as soon as it
    /// is sealed (the next one is sealed while the kernel sends it).
    fn seal_and_write(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let (mut buf_i, mut buf_at) = (0, 0);
        let mut out = Vec::with_capacity(4 + HEADER_BYTES + total.min(MAX_RECORD_BYTES) + TAG_BYTES);
        let mut left = total;
        while left > 0 {
            if self.sealer.needs_rekey() {
                // A connection lives far shorter than a key's share; start a new one.
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "transfer link key used up"));
            }
            let record = left.min(MAX_RECORD_BYTES);
            out.clear();
            out.extend_from_slice(&[0; 4]);
            self.sealer.seal_append(Kind::Data, &mut out, |out| {
                let mut want = record;
                while want > 0 {
                    let buf = &bufs[buf_i][buf_at..];
                    let take = buf.len().min(want);
                    out.extend_from_slice(&buf[..take]);
                    want -= take;
                    buf_at += take;
                    if buf_at == bufs[buf_i].len() {
                        (buf_i, buf_at) = (buf_i + 1, 0);
                    }
                }
            });
            let len = (out.len() - 4) as u32;
            out[..4].copy_from_slice(&len.to_be_bytes());
            self.tcp.write_all(&out)?;
            left -= record;
        }
        Ok(total)
    }
}

impl SealedReader {
    /// Reads (the rest of) one record and opens it; keeps what arrived on a timeout.
    fn next_record(&mut self) -> io::Result<bool> {
        let max = 4 + HEADER_BYTES + MAX_RECORD_BYTES + TAG_BYTES;
        loop {
            let want = if self.partial.len() < 4 {
                4
            } else {
                let len = u32::from_be_bytes([self.partial[0], self.partial[1], self.partial[2], self.partial[3]]);
                let len = len as usize + 4;
                if len > max {
                    return Err(invalid(format!("transfer record of {len} bytes (limit {max})")));
                }
                len
            };
            if self.partial.len() == want && want > 4 {
                break;
            }
            let have = self.partial.len();
            self.partial.resize(want, 0);
            match self.tcp.read(&mut self.partial[have..]) {
                Ok(0) => {
                    self.partial.truncate(have);
                    if have == 0 {
                        return Ok(false);
                    }
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "transfer record cut short"));
                }
                Ok(n) => self.partial.truncate(have + n),
                Err(e) => {
                    self.partial.truncate(have);
                    return Err(e);
                }
            }
        }
        let (_, body) = self.opener.open_in_place(self.sec.mode, &mut self.partial[4..]).map_err(|r| {
            metrics::counter!("tessera_transfer_errors_total", "reason" => r.reason()).increment(1);
            invalid(format!("transfer record refused: {r}"))
        })?;
        (self.at, self.end) = (4 + body.start, 4 + body.end);
        Ok(true)
    }

    fn read_opened(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.at == self.end {
            if self.end > 0 {
                // The last record is read out: receive the next one from the start.
                self.partial.clear();
                (self.at, self.end) = (0, 0);
            }
            if !self.next_record()? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.end - self.at);
        buf[..n].copy_from_slice(&self.partial[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Read for SealedReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_opened(buf)
    }
}

impl Write for SealedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.seal_and_write(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

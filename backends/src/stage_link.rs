//! A pipeline stage on another host: the link between an instance and the stage server
//! of the host that holds one of its stages.
//!
//! An instance lives on the host of its first stage; a stage whose chips are on another
//! host is loaded and run there by that host's stage server, and the instance reaches
//! it through one TCP connection per stage. Each micro-batch's chunks and input
//! activations go out in one frame, and the stage's output activations (or, for the
//! last stage, logits rows) come back in one; the KV of the stage's layers stays on its
//! host. The connection is the stage's lifetime: the server drops the stage when it
//! closes, and the instance fails (and is restarted by its chip's supervisor) when the
//! connection breaks, so a dead stage host loses no request.
//!
//! A frame is a little-endian `u32` header length, a JSON header, a little-endian `u64`
//! payload length and the payload: f32 values, little-endian. Headers are small and
//! self-describing (old and new fields tolerated); bulk values never go through JSON.
//!
//! On a secured cluster the node hands both ends a [`LinkSeal`], which runs a handshake
//! on the new connection and seals every byte after it; this crate knows no keys.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::compat::CompatInfo;
use crate::error::{BackendError, Result};
use crate::instance::{InstanceSpec, ShardedModel};
use crate::model::{LogitsWanted, SeqChunk};

/// The link's protocol version; a server refuses a client of another.
pub const STAGE_LINK_VERSION: u32 = 1;
/// A header longer than this is refused (headers carry block tables, not tensors).
const MAX_HEADER_BYTES: u32 = 64 << 20;
/// A payload larger than this is refused before anything is allocated for it.
const MAX_PAYLOAD_BYTES: u64 = 8 << 30;
/// How long a client keeps trying to connect to a stage server: the hosts of a cluster
/// start together, and the stage's host may be a moment behind the instance's.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One sequence's chunk of a micro-batch, as it crosses the link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireChunk {
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub block_table: Vec<u32>,
    pub slots: Vec<i32>,
    pub logits: LogitsWanted,
}

impl WireChunk {
    pub fn of(c: &SeqChunk<'_>) -> WireChunk {
        WireChunk {
            tokens: c.tokens.to_vec(),
            start_pos: c.start_pos,
            block_table: c.block_table.to_vec(),
            slots: c.slots.to_vec(),
            logits: c.logits,
        }
    }

    pub fn view(&self) -> SeqChunk<'_> {
        SeqChunk {
            tokens: &self.tokens,
            start_pos: self.start_pos,
            block_table: &self.block_table,
            slots: &self.slots,
            logits: self.logits,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    /// Load stage `stage` of instance `instance`, which the client resolved to
    /// `layers`; the server resolves it from its own topology and must agree.
    Load {
        version: u32,
        instance: String,
        stage: usize,
        layers: Range<usize>,
    },
    MakeKv {
        num_blocks: usize,
    },
    /// Payload: the input activations (none for the model's first stage).
    Forward {
        chunks: Vec<WireChunk>,
    },
    CopyBlocks {
        pairs: Vec<(u32, u32)>,
    },
    /// Payload: `values` K values, then `values` V values.
    WriteTokens {
        layer: usize,
        values: usize,
        slots: Vec<i32>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
enum Reply {
    Loaded {
        weight_bytes: u64,
        max_blocks: usize,
        compat: CompatInfo,
        weight_format: String,
    },
    Done,
    /// Payload: the stage's output rows.
    Rows {
        compute_us: u64,
    },
    Failed {
        error: String,
    },
}

/// What a loaded remote stage reports.
#[derive(Debug, Clone)]
pub struct RemoteLoaded {
    pub weight_bytes: u64,
    /// The most KV blocks every shard of the stage can hold.
    pub max_blocks: usize,
    pub compat: CompatInfo,
    pub weight_format: String,
}

fn write_frame(w: &mut impl Write, header: &impl Serialize, payload: &[&[f32]]) -> std::io::Result<()> {
    let header = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    w.write_all(&(header.len() as u32).to_le_bytes())?;
    w.write_all(&header)?;
    let values: usize = payload.iter().map(|p| p.len()).sum();
    w.write_all(&(values as u64 * 4).to_le_bytes())?;
    let mut bytes = Vec::with_capacity(values * 4);
    for part in payload {
        bytes.extend(part.iter().flat_map(|x| x.to_le_bytes()));
    }
    w.write_all(&bytes)?;
    w.flush()
}

/// A frame, or why it is not one. `Ok(None)`: the peer closed the connection cleanly
/// between frames.
fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> std::result::Result<Option<(T, Vec<f32>)>, String> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let header_len = u32::from_le_bytes(len);
    if header_len > MAX_HEADER_BYTES {
        return Err(format!("a frame header of {header_len} bytes (at most {MAX_HEADER_BYTES})"));
    }
    let mut header = vec![0u8; header_len as usize];
    r.read_exact(&mut header).map_err(|e| e.to_string())?;
    let header: T = serde_json::from_slice(&header).map_err(|e| format!("a frame header that does not parse: {e}"))?;
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|e| e.to_string())?;
    let payload_len = u64::from_le_bytes(len);
    if payload_len > MAX_PAYLOAD_BYTES || payload_len % 4 != 0 {
        return Err(format!("a payload of {payload_len} bytes (f32 values, at most {MAX_PAYLOAD_BYTES} bytes)"));
    }
    let mut bytes = vec![0u8; payload_len as usize];
    r.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    let values = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Ok(Some((header, values)))
}

/// A connection's reading and writing ends.
pub type LinkHalves = (Box<dyn Read + Send>, Box<dyn Write + Send>);

/// Secures a stage link's connection: a handshake as soon as it is open, then every
/// byte sealed. The client end proves its host to the server and the server to it.
pub trait LinkSeal: Send + Sync + std::fmt::Debug {
    fn client(&self, tcp: TcpStream) -> std::io::Result<LinkHalves>;
    fn server(&self, tcp: TcpStream) -> std::io::Result<LinkHalves>;
}

/// The halves of a connection in clear, or sealed by `seal`.
fn halves(tcp: TcpStream, seal: Option<&dyn LinkSeal>, server: bool) -> std::io::Result<LinkHalves> {
    match seal {
        Some(seal) if server => seal.server(tcp),
        Some(seal) => seal.client(tcp),
        None => Ok((Box::new(tcp.try_clone()?), Box::new(tcp))),
    }
}

/// The instance's end of a link to one remote stage.
pub struct StageClient {
    addr: SocketAddr,
    reader: BufReader<Box<dyn Read + Send>>,
    writer: BufWriter<Box<dyn Write + Send>>,
}

impl StageClient {
    /// Connects to the stage server at `addr` (sealing the link with `seal` where
    /// given) and loads stage `stage` (`layers`) of `instance` there. `timeout` bounds
    /// every later wait for a reply.
    pub fn connect(
        addr: SocketAddr,
        instance: &str,
        stage: usize,
        layers: Range<usize>,
        timeout: Duration,
        seal: Option<&dyn LinkSeal>,
    ) -> Result<(StageClient, RemoteLoaded)> {
        let err = |reason: String| BackendError::StageLink { addr: addr.to_string(), reason };
        let deadline = std::time::Instant::now() + CONNECT_TIMEOUT;
        let stream = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(100))) {
                Ok(stream) => break stream,
                Err(e) if left.is_zero() => {
                    return Err(err(format!("cannot connect to the stage server within {CONNECT_TIMEOUT:?}: {e}")));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(timeout)).map_err(|e| err(e.to_string()))?;
        let (reader, writer) = halves(stream, seal, false).map_err(|e| err(e.to_string()))?;
        let mut client = StageClient { addr, reader: BufReader::new(reader), writer: BufWriter::new(writer) };
        let load = Request::Load { version: STAGE_LINK_VERSION, instance: instance.to_string(), stage, layers };
        match client.call(&load, &[])? {
            (Reply::Loaded { weight_bytes, max_blocks, compat, weight_format }, _) => {
                Ok((client, RemoteLoaded { weight_bytes, max_blocks, compat, weight_format }))
            }
            (other, _) => Err(client.unexpected(&other)),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn err(&self, reason: String) -> BackendError {
        BackendError::StageLink { addr: self.addr.to_string(), reason }
    }

    fn unexpected(&self, reply: &Reply) -> BackendError {
        self.err(format!("the stage server answered {reply:?}"))
    }

    /// Sends `req`, waits for its reply; a `Failed` reply is the stage's error.
    fn call(&mut self, req: &Request, payload: &[&[f32]]) -> Result<(Reply, Vec<f32>)> {
        write_frame(&mut self.writer, req, payload).map_err(|e| self.err(format!("the link broke: {e}")))?;
        match read_frame::<Reply>(&mut self.reader) {
            Ok(Some((Reply::Failed { error }, _))) => Err(self.err(format!("the stage failed: {error}"))),
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(self.err("the stage server closed the link".into())),
            Err(e) => Err(self.err(format!("the link broke: {e}"))),
        }
    }

    fn done(&mut self, req: &Request, payload: &[&[f32]]) -> Result<()> {
        match self.call(req, payload)? {
            (Reply::Done, _) => Ok(()),
            (other, _) => Err(self.unexpected(&other)),
        }
    }

    pub fn make_kv(&mut self, num_blocks: usize) -> Result<()> {
        self.done(&Request::MakeKv { num_blocks }, &[])
    }

    /// The stage's output rows for one micro-batch, and the stage's compute time.
    pub fn forward(&mut self, chunks: Vec<WireChunk>, input: Option<&[f32]>) -> Result<(Vec<f32>, Duration)> {
        match self.call(&Request::Forward { chunks }, &[input.unwrap_or(&[])])? {
            (Reply::Rows { compute_us }, rows) => Ok((rows, Duration::from_micros(compute_us))),
            (other, _) => Err(self.unexpected(&other)),
        }
    }

    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        self.done(&Request::CopyBlocks { pairs: pairs.to_vec() }, &[])
    }

    pub fn write_tokens(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], slots: &[i32]) -> Result<()> {
        if k_rows.len() != v_rows.len() {
            return Err(BackendError::KvCache(format!("{} K values but {} V values", k_rows.len(), v_rows.len())));
        }
        let req = Request::WriteTokens { layer, values: k_rows.len(), slots: slots.to_vec() };
        self.done(&req, &[k_rows, v_rows])
    }
}

/// How a stage server finds what to load: stage `stage` of instance `instance` as an
/// instance spec of that one stage (its layers and this host's devices), or why this
/// host holds no such stage.
pub type ResolveStage<'a> = dyn Fn(&str, usize) -> Result<InstanceSpec> + 'a;

/// Serves one connection of a stage server until the client closes it: loads the stage
/// asked for, then runs its steps. The stage is dropped (its memory freed) when the
/// connection ends. Errors of a request go back to the client; an error of the
/// connection itself ends it and is returned.
pub fn serve_connection(stream: TcpStream, resolve: &ResolveStage<'_>, seal: Option<&dyn LinkSeal>) -> Result<()> {
    let peer = stream.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
    let err = |reason: String| BackendError::StageLink { addr: peer.clone(), reason };
    let _ = stream.set_nodelay(true);
    let (reader, writer) = halves(stream, seal, true).map_err(|e| err(e.to_string()))?;
    let mut reader = BufReader::new(reader);
    let mut writer = BufWriter::new(writer);
    let mut reply = |r: &Reply, payload: &[f32]| {
        write_frame(&mut writer, r, &[payload]).map_err(|e| err(format!("cannot answer: {e}")))
    };
    let mut stage: Option<ShardedModel> = None;
    loop {
        let (req, payload) = match read_frame::<Request>(&mut reader) {
            Ok(Some(frame)) => frame,
            Ok(None) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let outcome: Result<(Reply, Vec<f32>)> = match (req, stage.as_mut()) {
            (Request::Load { version, instance, stage: s, layers }, None) => {
                load_stage(version, &instance, s, layers, resolve).map(|(model, loaded)| {
                    stage = Some(model);
                    (loaded, Vec::new())
                })
            }
            (Request::Load { .. }, Some(_)) => Err(BackendError::Shard("this link already holds a stage".into())),
            (_, None) => Err(BackendError::Shard("no stage is loaded on this link yet".into())),
            (Request::MakeKv { num_blocks }, Some(model)) => model.make_kv(num_blocks).map(|()| (Reply::Done, vec![])),
            (Request::Forward { chunks }, Some(model)) => {
                let started = std::time::Instant::now();
                let views: Vec<SeqChunk<'_>> = chunks.iter().map(WireChunk::view).collect();
                let input = (!payload.is_empty()).then_some(payload.as_slice());
                model
                    .forward_part(&views, input)
                    .map(|rows| (Reply::Rows { compute_us: started.elapsed().as_micros() as u64 }, rows))
            }
            (Request::CopyBlocks { pairs }, Some(model)) => model.copy_blocks(&pairs).map(|()| (Reply::Done, vec![])),
            (Request::WriteTokens { layer, values, slots }, Some(model)) => {
                if payload.len() != 2 * values {
                    Err(BackendError::KvCache(format!("{} values for {values} K and {values} V", payload.len())))
                } else {
                    let (k, v) = payload.split_at(values);
                    model.write_tokens(layer, k, v, &slots).map(|()| (Reply::Done, vec![]))
                }
            }
        };
        match outcome {
            Ok((r, rows)) => reply(&r, &rows)?,
            Err(e) => reply(&Reply::Failed { error: e.to_string() }, &[])?,
        }
    }
}

fn load_stage(
    version: u32,
    instance: &str,
    stage: usize,
    layers: Range<usize>,
    resolve: &ResolveStage<'_>,
) -> Result<(ShardedModel, Reply)> {
    if version != STAGE_LINK_VERSION {
        return Err(BackendError::Shard(format!(
            "the instance speaks stage link version {version}, this host {STAGE_LINK_VERSION}: run one release on \
             every host"
        )));
    }
    let spec = resolve(instance, stage)?;
    let here: Vec<Range<usize>> = spec.stages.iter().map(|s| s.layers.clone()).collect();
    if here != [layers.clone()] {
        return Err(BackendError::Shard(format!(
            "instance `{instance}` stage {stage}: the instance resolved layers {layers:?}, this host {here:?}; the \
             hosts' topology files or models differ"
        )));
    }
    let (model, max_blocks) = ShardedModel::load_part(&spec)?;
    let loaded = Reply::Loaded {
        weight_bytes: model.weight_bytes(),
        max_blocks,
        compat: model.compat_info(),
        weight_format: model.weight_format().to_string(),
    };
    Ok((model, loaded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_refused() {
        let mut buf = Vec::new();
        let req = Request::WriteTokens { layer: 3, values: 2, slots: vec![5, -1] };
        write_frame(&mut buf, &req, &[&[1.5, -2.0], &[0.25, 1e-30]]).unwrap();
        let (back, payload) = read_frame::<Request>(&mut buf.as_slice()).unwrap().unwrap();
        assert!(matches!(back, Request::WriteTokens { layer: 3, values: 2, ref slots } if *slots == [5, -1]));
        assert_eq!(payload, [1.5, -2.0, 0.25, 1e-30]);

        assert!(read_frame::<Request>(&mut [].as_slice()).unwrap().is_none(), "a clean close");
        let cut = &buf[..buf.len() - 3];
        assert!(read_frame::<Request>(&mut &cut[..]).is_err(), "a frame cut short");
        let mut huge = (MAX_HEADER_BYTES + 1).to_le_bytes().to_vec();
        huge.extend([0; 8]);
        let e = read_frame::<Request>(&mut huge.as_slice()).unwrap_err();
        assert!(e.contains("frame header of"), "{e}");
        let mut junk = 4u32.to_le_bytes().to_vec();
        junk.extend(b"{no}");
        let e = read_frame::<Request>(&mut junk.as_slice()).unwrap_err();
        assert!(e.contains("does not parse"), "{e}");
    }
}

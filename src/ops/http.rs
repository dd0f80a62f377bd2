//! A small blocking HTTP/1.1 server for `/metrics`, `/status`, `/healthz` and `/`.
//!
//! It cannot be stalled by a slow or hostile client:
//!
//! - every connection has **one deadline for its whole answer** ([`HttpLimits::answer_deadline`],
//!   counted from the accept, covering the request and every write of the answer; a client
//!   that reads slowly but steadily is cut off when it runs out), and a shorter one for
//!   sending its request head ([`HttpLimits::read_deadline`]);
//! - request heads are capped in size ([`MAX_REQUEST`]);
//! - at most [`HttpLimits::max_answers`] answers other than `/healthz` are served at once,
//!   and [`HttpLimits::health_reserve`] more connections are open only for reading a request
//!   and answering `/healthz`: slow readers of `/status` cannot make the health check fail;
//! - one client address holds at most [`HttpLimits::max_per_client`] connections.
//!
//! Refused connections get a `503` written without blocking and are closed; each refusal and
//! each cut-off answer is counted (`grasp_sync_http_refused_total`, `grasp_sync_http_cut_total`
//! in `/metrics`) and logged at debug level. Only `GET` and `HEAD` are served; each answer
//! closes the connection.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use parking_lot::Mutex;

use crate::engine::Status;
use crate::ops::render;

/// Answers other than `/healthz` served at once, by default.
pub const MAX_CONNECTIONS: usize = 16;
/// Connections beyond [`MAX_CONNECTIONS`] that may only read a request and answer `/healthz`.
pub const HEALTH_RESERVE: usize = 4;
/// Connections one client address may hold at once, by default.
pub const MAX_PER_CLIENT: usize = 4;
/// The longest request head read.
pub const MAX_REQUEST: usize = 8 * 1024;
/// Deadline for receiving a request head, from the accept.
pub const IO_DEADLINE: Duration = Duration::from_secs(5);
/// Deadline for a whole answer, from the accept to its last byte written.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(15);
/// Bytes written per call, so every call gets the time that is left of the answer's deadline.
const WRITE_CHUNK: usize = 64 * 1024;

/// The listener's bounds; [`HttpLimits::default`] holds the constants of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Answers other than `/healthz` served at once; more are answered `503`.
    pub max_answers: usize,
    /// Connections beyond `max_answers` that may read a request and answer only `/healthz`.
    pub health_reserve: usize,
    /// Connections one client address may hold at once; more are answered `503`.
    pub max_per_client: usize,
    /// Deadline for receiving the request head, from the accept.
    pub read_deadline: Duration,
    /// Deadline for the whole answer, from the accept to the last byte written.
    pub answer_deadline: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_answers: MAX_CONNECTIONS,
            health_reserve: HEALTH_RESERVE,
            max_per_client: MAX_PER_CLIENT,
            read_deadline: IO_DEADLINE,
            answer_deadline: ANSWER_DEADLINE,
        }
    }
}

/// What the listener refused or cut off since it started.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections refused because every slot was taken (or, for an answer other than
    /// `/healthz`, every answer slot).
    pub refused_busy: AtomicU64,
    /// Connections refused because their client address held `max_per_client` already.
    pub refused_client: AtomicU64,
    /// Connections closed at a deadline: a request head not received in time, or an answer
    /// not read in time.
    pub cut: AtomicU64,
}

/// What the server shows: a running engine ([`crate::SyncHandle`] implements it).
pub trait StatusSource: Send + Sync + 'static {
    /// A snapshot of the engine.
    fn status(&self) -> Status;
    /// `Ok` when the engine is healthy, else why not (for `/healthz`).
    fn health(&self) -> Result<(), String>;
}

impl StatusSource for crate::SyncHandle {
    fn status(&self) -> Status {
        crate::SyncHandle::status(self)
    }

    fn health(&self) -> Result<(), String> {
        crate::SyncHandle::health(self)
    }
}

/// A running server; dropping it stops it.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counters: Arc<HttpCounters>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// The address it listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it refused or cut off so far.
    pub fn counters(&self) -> &HttpCounters {
        &self.counters
    }

    /// Stops accepting and joins the accept thread.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                warn!("metrics listener thread panicked");
            }
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds `addr` and serves `source` on a thread of its own, within [`HttpLimits::default`].
pub fn serve(addr: SocketAddr, source: Arc<dyn StatusSource>) -> io::Result<HttpServer> {
    serve_with(addr, source, HttpLimits::default())
}

/// Binds `addr` and serves `source` on a thread of its own, within `limits`.
pub fn serve_with(
    addr: SocketAddr,
    source: Arc<dyn StatusSource>,
    limits: HttpLimits,
) -> io::Result<HttpServer> {
    let listener = TcpListener::bind(addr)?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(HttpCounters::default());
    let shared = Shared {
        source,
        limits,
        counters: counters.clone(),
        slots: Mutex::new(Slots::default()),
    };
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || accept_loop(listener, Arc::new(shared), stop2))?;
    info!("metrics and status on http://{addr}/ (/metrics, /status, /healthz)");
    Ok(HttpServer {
        addr,
        stop,
        counters,
        thread: Some(thread),
    })
}

/// What every connection thread shares.
struct Shared {
    source: Arc<dyn StatusSource>,
    limits: HttpLimits,
    counters: Arc<HttpCounters>,
    slots: Mutex<Slots>,
}

/// Connections open (in total and per client address) and answers being served.
#[derive(Debug, Default)]
struct Slots {
    open: usize,
    answering: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Busy,
    Client,
}

impl Slots {
    /// Admits a connection from `ip`: below the total of answer slots and health reserve, and
    /// below the per-client cap.
    fn admit(&mut self, ip: IpAddr, limits: &HttpLimits) -> Result<(), Refusal> {
        if self.open >= limits.max_answers + limits.health_reserve {
            return Err(Refusal::Busy);
        }
        let n = self.per_client.entry(ip).or_insert(0);
        if *n >= limits.max_per_client {
            return Err(Refusal::Client);
        }
        *n += 1;
        self.open += 1;
        Ok(())
    }

    fn release(&mut self, ip: IpAddr) {
        self.open -= 1;
        if let Some(n) = self.per_client.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&ip);
            }
        }
    }
}

/// An admitted connection; dropping it gives its slots back.
struct Admitted {
    shared: Arc<Shared>,
    ip: IpAddr,
    answering: bool,
}

impl Admitted {
    /// Takes an answer slot (for anything but `/healthz`); `false` when all are taken.
    fn answer_slot(&mut self) -> bool {
        let mut slots = self.shared.slots.lock();
        if slots.answering >= self.shared.limits.max_answers {
            return false;
        }
        slots.answering += 1;
        self.answering = true;
        true
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut slots = self.shared.slots.lock();
        if self.answering {
            slots.answering -= 1;
        }
        slots.release(self.ip);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let refusing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match conn.and_then(|s| s.peer_addr().map(|p| (s, p))) {
            Ok(s) => s,
            Err(e) => {
                debug!("metrics listener: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let accepted = Instant::now();
        let admitted = shared.slots.lock().admit(peer.ip(), &shared.limits);
        if let Err(why) = admitted {
            let (counter, text) = match why {
                Refusal::Busy => (&shared.counters.refused_busy, "every slot is taken"),
                Refusal::Client => (
                    &shared.counters.refused_client,
                    "this client address holds its share of slots",
                ),
            };
            counter.fetch_add(1, Ordering::Relaxed);
            debug!("metrics listener: refused {peer}: {text}");
            refuse(stream, &refusing);
            continue;
        }
        let admitted = Admitted {
            shared: shared.clone(),
            ip: peer.ip(),
            answering: false,
        };
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                let mut admitted = admitted;
                let mut stream = stream;
                if let Err(e) = handle(&mut stream, &mut admitted, accepted) {
                    if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock
                    {
                        admitted.shared.counters.cut.fetch_add(1, Ordering::Relaxed);
                    }
                    debug!("metrics listener: connection from {peer} ended: {e}");
                }
            });
        if let Err(e) = spawned {
            warn!("metrics listener: cannot start a connection thread: {e}");
        }
    }
}

/// Refusals answered at once on threads of their own; beyond it a refused connection gets
/// its `503` only if the request is already there.
const MAX_REFUSING: usize = 8;
/// How long a refused connection may take to send its request head, and then to read the
/// `503`.
const REFUSAL_DEADLINE: Duration = Duration::from_millis(500);

/// Answers `503` and closes, never blocking the accept loop. The request head is read first
/// (briefly, on a thread of its own, at most [`MAX_REFUSING`] at once) so that the close does
/// not reset the connection before the client reads the answer.
fn refuse(mut stream: TcpStream, refusing: &Arc<std::sync::atomic::AtomicUsize>) {
    let answer = response(503, "text/plain", b"busy\n", false);
    if refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        refusing.fetch_sub(1, Ordering::SeqCst);
        if stream.set_nonblocking(true).is_ok() {
            let _ = stream.write(&answer);
        }
        return;
    }
    let refusing2 = refusing.clone();
    let spawned = std::thread::Builder::new()
        .name("metrics-refuse".into())
        .spawn(move || {
            let _ = read_head(&mut stream, Instant::now() + REFUSAL_DEADLINE);
            let _ = write_until(&mut stream, &answer, Instant::now() + REFUSAL_DEADLINE);
            let _ = stream.shutdown(std::net::Shutdown::Write);
            refusing2.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        refusing.fetch_sub(1, Ordering::SeqCst);
        debug!("metrics listener: cannot start a thread to refuse a connection: {e}");
    }
}

/// Reads a request head until `end` and at most [`MAX_REQUEST`] bytes.
fn read_head(stream: &mut TcpStream, end: Instant) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request too slow"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(buf);
        }
        if buf.len() > MAX_REQUEST {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request too long",
            ));
        }
    }
}

fn handle(stream: &mut TcpStream, admitted: &mut Admitted, accepted: Instant) -> io::Result<()> {
    let limits = admitted.shared.limits;
    let end = accepted + limits.answer_deadline;
    let head = match read_head(stream, end.min(accepted + limits.read_deadline)) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            write_until(
                stream,
                &response(431, "text/plain", b"request too long\n", false),
                end,
            )?;
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let text = String::from_utf8_lossy(&head);
    let line = text.lines().next().unwrap_or("");
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return write_until(
            stream,
            &response(405, "text/plain", b"only GET and HEAD\n", head_only),
            end,
        );
    }
    let path = target.split('?').next().unwrap_or("");
    if path != "/healthz" && !admitted.answer_slot() {
        admitted
            .shared
            .counters
            .refused_busy
            .fetch_add(1, Ordering::Relaxed);
        debug!("metrics listener: every answer slot is taken, {path} answered 503");
        return write_until(
            stream,
            &response(503, "text/plain", b"busy\n", head_only),
            end,
        );
    }
    let source = admitted.shared.source.as_ref();
    let answer = match path {
        "/metrics" => {
            let mut text = render::prometheus(&source.status());
            render::prometheus_http(&mut text, &admitted.shared.counters);
            response(
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.as_bytes(),
                head_only,
            )
        }
        "/status" => {
            let body = serde_json::to_vec_pretty(&render::status_json(&source.status()))
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
            response(200, "application/json", &body, head_only)
        }
        "/healthz" => match source.health() {
            Ok(()) => response(200, "text/plain", b"ok\n", head_only),
            Err(why) => response(503, "text/plain", format!("{why}\n").as_bytes(), head_only),
        },
        "/" => response(
            200,
            "text/html; charset=utf-8",
            render::html(&source.status()).as_bytes(),
            head_only,
        ),
        _ => response(404, "text/plain", b"not found\n", head_only),
    };
    write_until(stream, &answer, end)
}

/// Writes `bytes` in chunks, each call given only the time left until `end`.
fn write_until(stream: &mut TcpStream, bytes: &[u8], end: Instant) -> io::Result<()> {
    for chunk in bytes.chunks(WRITE_CHUNK) {
        let mut rest = chunk;
        while !rest.is_empty() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "answer not read before its deadline",
                ));
            }
            stream.set_write_timeout(Some(left))?;
            match stream.write(rest) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "closed")),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    stream.flush()
}

fn response(code: u16, content_type: &str, body: &[u8], head_only: bool) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// A blocking `GET` of `path` from `addr` with a total deadline: the client side of
/// `grasp-sync status`. Returns the status code and the body.
pub fn get(addr: SocketAddr, path: &str, deadline: Duration) -> io::Result<(u16, String)> {
    let end = Instant::now() + deadline;
    let mut stream = TcpStream::connect_timeout(&addr, deadline)?;
    stream.set_write_timeout(Some(deadline))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
        if body.len() > 64 << 20 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "answer too long",
            ));
        }
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an HTTP answer"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no status code"))?;
    Ok((code, rest.to_string()))
}

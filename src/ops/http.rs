//! A small blocking HTTP/1.1 server for `/metrics`, `/status`, `/healthz` and `/`.
//!
//! It cannot be stalled by a slow or hostile client: every connection has one total
//! deadline for reading its request and one for writing the answer, requests are capped in
//! size, and at most [`MAX_CONNECTIONS`] are served at once (more are answered `503` and
//! closed at once). Only `GET` and `HEAD` are served; each answer closes the connection.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};

use crate::engine::Status;
use crate::ops::render;

/// Connections served at once; more are answered `503` and closed.
pub const MAX_CONNECTIONS: usize = 16;
/// The longest request head read.
pub const MAX_REQUEST: usize = 8 * 1024;
/// Deadline for reading a request, and (separately) for writing its answer.
pub const IO_DEADLINE: Duration = Duration::from_secs(5);

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
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// The address it listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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

/// Binds `addr` and serves `source` on a thread of its own.
pub fn serve(addr: SocketAddr, source: Arc<dyn StatusSource>) -> io::Result<HttpServer> {
    let listener = TcpListener::bind(addr)?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || accept_loop(listener, source, stop2))?;
    info!("metrics and status on http://{addr}/ (/metrics, /status, /healthz)");
    Ok(HttpServer {
        addr,
        stop,
        thread: Some(thread),
    })
}

fn accept_loop(listener: TcpListener, source: Arc<dyn StatusSource>, stop: Arc<AtomicBool>) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let mut stream = match conn {
            Ok(s) => s,
            Err(e) => {
                debug!("metrics listener: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = stream.write_all(&response(503, "text/plain", b"busy\n", false));
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let source = source.clone();
        let active2 = active.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                if let Err(e) = handle(&mut stream, source.as_ref()) {
                    debug!("metrics listener: connection ended: {e}");
                }
                active2.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::SeqCst);
            warn!("metrics listener: cannot start a connection thread: {e}");
        }
    }
}

/// Reads a request head within [`IO_DEADLINE`] and at most [`MAX_REQUEST`] bytes.
fn read_head(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let end = Instant::now() + IO_DEADLINE;
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

fn handle(stream: &mut TcpStream, source: &dyn StatusSource) -> io::Result<()> {
    let head = match read_head(stream) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            write_all(
                stream,
                &response(431, "text/plain", b"request too long\n", false),
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
        return write_all(
            stream,
            &response(405, "text/plain", b"only GET and HEAD\n", head_only),
        );
    }
    let path = target.split('?').next().unwrap_or("");
    let answer = match path {
        "/metrics" => response(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            render::prometheus(&source.status()).as_bytes(),
            head_only,
        ),
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
    write_all(stream, &answer)
}

fn write_all(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    stream.set_write_timeout(Some(IO_DEADLINE))?;
    stream.write_all(bytes)?;
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

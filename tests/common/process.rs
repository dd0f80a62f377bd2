//! Helpers of the tests that run relay processes (nostr-rs-relay, ngit-grasp): finding the
//! binary, a free port and a temp dir, the NIP-11 document, websocket reads, the log.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// A plain websocket client of a relay process.
pub type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

pub fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
        .unwrap_or(false)
}

/// `$var` (only that, when set), else `default`, else `name` on `PATH`.
pub fn find_binary(var: &str, default: &str, name: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{var}={} does not exist", p.display()))
        };
    }
    let mut candidates = vec![PathBuf::from(default)];
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join(name)));
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{var} unset, and not found at {default} nor on PATH"))
}

pub fn unique_temp_dir(what: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!(
        "grasp-sync-{what}-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// The NIP-11 document served on `port`, if it answers with one.
pub fn fetch_nip11(port: u16) -> io::Result<Value> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: application/nostr+json\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let (Some(start), Some(end)) = (body.find('{'), body.rfind('}')) else {
        return Err(io::Error::other(format!("no JSON in {text:.200}")));
    };
    serde_json::from_str(&body[start..=end]).map_err(io::Error::other)
}

/// The next text frame as JSON, or `None` at `end`.
pub fn read_json(ws: &mut Ws, end: Instant) -> Option<Value> {
    loop {
        match ws.read() {
            Ok(Message::Text(t)) => {
                return Some(serde_json::from_str(t.as_str()).expect("relay sent JSON"));
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("websocket read: {e}"),
        }
        if Instant::now() >= end {
            return None;
        }
    }
}

/// The last `lines` lines of the log at `path`, without ANSI colours.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let raw = fs::read_to_string(path).unwrap_or_default();
    let mut log = String::with_capacity(raw.len());
    let mut in_escape = false;
    for c in raw.chars() {
        match (in_escape, c) {
            (false, '\u{1b}') => in_escape = true,
            (false, c) => log.push(c),
            (true, 'm') => in_escape = false,
            (true, _) => {}
        }
    }
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

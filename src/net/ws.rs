//! A blocking websocket connector with a deadline on every step.
//!
//! `tungstenite::connect` has no connect timeout, so this resolves the host, connects with
//! [`TcpStream::connect_timeout`], sets a read timeout *before* the TLS and websocket
//! handshakes (a silent server then fails instead of hanging), and finally switches the
//! socket to a short read timeout that the relay loop uses as its tick.
//!
//! TLS uses rustls with the *ring* crypto provider chosen explicitly and the webpki root
//! certificates, so the first `wss://` connect cannot panic for want of a process-level
//! `CryptoProvider`.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Connector, WebSocket};

use crate::net::url::RelayUrl;

/// A websocket to a relay.
pub type Socket = WebSocket<MaybeTlsStream<TcpStream>>;

/// Limits and deadlines of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WsOptions {
    /// Deadline for TCP connect, TLS and websocket handshakes together.
    pub connect_timeout: Duration,
    /// Read timeout after the handshake: the loop's tick.
    pub tick: Duration,
    /// Soft cap: the largest text message handled. A larger one (below the hard cap) is
    /// dropped and counted, and the connection is kept, so one oversized stored event cannot
    /// make a relay flap for ever (it would be fetched again on every reconnect).
    pub max_event_size: usize,
    /// Hard cap: the largest message tungstenite reads; a larger one ends the connection.
    pub max_message_size: usize,
    /// Hard cap on one frame (as `max_message_size`).
    pub max_frame_size: usize,
    /// Read buffer per connection (tungstenite's default is 128 KiB).
    pub read_buffer_size: usize,
    /// Write buffer per connection before a flush.
    pub write_buffer_size: usize,
}

impl Default for WsOptions {
    fn default() -> Self {
        WsOptions {
            connect_timeout: Duration::from_secs(10),
            tick: Duration::from_millis(50),
            max_event_size: 1 << 20,
            max_message_size: 16 << 20,
            max_frame_size: 16 << 20,
            read_buffer_size: 16 * 1024,
            write_buffer_size: 16 * 1024,
        }
    }
}

impl WsOptions {
    /// The tungstenite configuration for these limits.
    pub fn websocket_config(&self) -> WebSocketConfig {
        WebSocketConfig::default()
            .read_buffer_size(self.read_buffer_size)
            .write_buffer_size(self.write_buffer_size)
            .max_write_buffer_size(self.write_buffer_size.max(self.max_event_size) * 4)
            .max_message_size(Some(self.max_message_size))
            .max_frame_size(Some(self.max_frame_size))
    }
}

/// Why a connection could not be opened.
#[derive(Debug)]
pub enum ConnectError {
    /// The host name did not resolve.
    Resolve(io::Error),
    /// TCP connect failed or timed out (for every resolved address).
    Tcp(io::Error),
    /// TLS or websocket handshake failed.
    Handshake(String),
    /// The deadline passed during the handshake.
    Timeout,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Resolve(e) => write!(f, "cannot resolve host: {e}"),
            ConnectError::Tcp(e) => write!(f, "TCP connect failed: {e}"),
            ConnectError::Handshake(e) => write!(f, "handshake failed: {e}"),
            ConnectError::Timeout => write!(f, "connect deadline passed during the handshake"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// The shared rustls client configuration (ring provider, webpki roots).
pub fn tls_config() -> Arc<rustls::ClientConfig> {
    static CONFIG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map(|b| b.with_root_certificates(roots).with_no_client_auth());
            match config {
                Ok(c) => Arc::new(c),
                // The ring provider supports the default protocol versions; this is a build
                // configuration error, not something a peer can cause.
                Err(e) => panic!("rustls ring provider rejected default protocol versions: {e}"),
            }
        })
        .clone()
}

fn resolve(url: &RelayUrl) -> Result<Vec<SocketAddr>, ConnectError> {
    let addrs: Vec<SocketAddr> = (url.host_for_resolve(), url.port())
        .to_socket_addrs()
        .map_err(ConnectError::Resolve)?
        .collect();
    if addrs.is_empty() {
        return Err(ConnectError::Resolve(io::Error::new(
            io::ErrorKind::NotFound,
            "no address",
        )));
    }
    Ok(addrs)
}

/// Opens a TCP stream to the relay's host and port within `timeout`.
pub fn connect_tcp(url: &RelayUrl, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let deadline = Instant::now() + timeout;
    let mut last = io::Error::new(io::ErrorKind::TimedOut, "no address tried");
    for addr in resolve(url)? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(ConnectError::Tcp(last))
}

/// Connects a websocket to `url` within `opts.connect_timeout`, then sets the read timeout
/// to `opts.tick`.
pub fn connect(url: &RelayUrl, opts: &WsOptions) -> Result<Socket, ConnectError> {
    let start = Instant::now();
    let tcp = connect_tcp(url, opts.connect_timeout)?;
    let _ = tcp.set_nodelay(true);
    let left = opts
        .connect_timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(10));
    tcp.set_read_timeout(Some(left))
        .map_err(ConnectError::Tcp)?;
    tcp.set_write_timeout(Some(left))
        .map_err(ConnectError::Tcp)?;
    let request = url
        .as_str()
        .into_client_request()
        .map_err(|e| ConnectError::Handshake(e.to_string()))?;
    let connector = if url.is_tls() {
        Connector::Rustls(tls_config())
    } else {
        Connector::Plain
    };
    let (socket, _response) = match tungstenite::client_tls_with_config(
        request,
        tcp,
        Some(opts.websocket_config()),
        Some(connector),
    ) {
        Ok(ok) => ok,
        Err(tungstenite::HandshakeError::Interrupted(_)) => return Err(ConnectError::Timeout),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Io(e)))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(ConnectError::Timeout)
        }
        Err(tungstenite::HandshakeError::Failure(e)) => {
            return Err(ConnectError::Handshake(e.to_string()))
        }
    };
    let tcp = tcp_of(&socket);
    tcp.set_read_timeout(Some(opts.tick))
        .map_err(ConnectError::Tcp)?;
    tcp.set_write_timeout(Some(opts.connect_timeout))
        .map_err(ConnectError::Tcp)?;
    Ok(socket)
}

/// The TCP stream under a websocket (plain or TLS).
pub fn tcp_of(socket: &Socket) -> &TcpStream {
    match socket.get_ref() {
        MaybeTlsStream::Plain(s) => s,
        MaybeTlsStream::Rustls(s) => s.get_ref(),
        // MaybeTlsStream is non-exhaustive; only the variants above are enabled.
        _ => unreachable!("only plain and rustls streams are enabled"),
    }
}

/// True for the error a read timeout produces (the loop's tick).
pub fn is_timeout(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(io) if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn tls_config_builds_without_a_process_provider() {
        let c = tls_config();
        assert!(Arc::strong_count(&c) >= 1);
    }

    #[test]
    fn silent_server_times_out_instead_of_hanging() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}")).unwrap();
        let opts = WsOptions {
            connect_timeout: Duration::from_millis(300),
            ..WsOptions::default()
        };
        let started = Instant::now();
        let err = connect(&url, &opts).unwrap_err();
        assert!(matches!(err, ConnectError::Timeout), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(listener);
    }

    #[test]
    fn refused_port_is_a_tcp_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}")).unwrap();
        assert!(matches!(
            connect(&url, &WsOptions::default()),
            Err(ConnectError::Tcp(_))
        ));
    }
}

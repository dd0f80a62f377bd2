//! A blocking websocket connector with a deadline on every step.
//!
//! `tungstenite::connect` has no connect timeout, so this resolves the host on a helper thread
//! with a deadline ([`resolve`]), checks each address (the address policy, for relays
//! discovered from events) and connects to it with [`TcpStream::connect_timeout`], runs the
//! TLS and websocket handshakes over a [`DeadlineStream`] (one total deadline, however slowly
//! the server sends), and finally switches the socket to a short read timeout that the relay
//! loop uses as its tick.
//!
//! TLS uses rustls with the *ring* crypto provider chosen explicitly and the webpki root
//! certificates, so the first `wss://` connect cannot panic for want of a process-level
//! `CryptoProvider`.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Connector, WebSocket};

use crate::net::inbound::Inbound;
use crate::shared::Refusal;
use crate::shared::RelayUrl;

/// A websocket to a relay.
pub(crate) type Socket = WebSocket<MaybeTlsStream<DeadlineStream>>;

/// Most DNS look-ups running at once on helper threads; more wait for a free slot (within
/// their deadline). A look-up that outlives its deadline keeps its thread until the system
/// resolver returns, so this bounds the threads a slow resolver can pile up.
pub(crate) const MAX_DNS_IN_FLIGHT: usize = 32;

/// A TCP stream with an optional overall deadline on every read and write.
///
/// During the TLS and websocket handshakes the deadline is set: each read or write gets only
/// the time left, and once it has passed they fail with `TimedOut`. A server that trickles
/// one byte at a time therefore cannot hold a thread beyond the connect deadline (a read
/// timeout alone restarts with every byte). After the handshake the deadline is cleared and
/// the stream is a plain `TcpStream`.
#[derive(Debug)]
pub(crate) struct DeadlineStream {
    tcp: TcpStream,
    deadline: Option<Instant>,
    /// Set by [`read_on_helper_thread`]: reads come from a pump thread and never block.
    inbound: Option<Inbound>,
    /// Most bytes one read of the TCP stream takes (0: as many as the caller asks for);
    /// see [`WsOptions::max_read`].
    max_read: usize,
    /// While the peer sends faster than `max_read`-sized reads take it: bytes read from the
    /// socket in one system call, handed out `max_read` at a time ([`Burst`]).
    burst: Option<Burst>,
}

/// Bytes one socket read takes at most during a burst ([`DeadlineStream`]).
pub(crate) const BURST_READ: usize = 16 * 1024;

/// A buffer that exists only while a connection receives a burst: a capped read that came
/// back full (more is waiting) makes the next socket reads take up to [`BURST_READ`] bytes
/// at once, handed to the websocket layer `max_read` bytes at a time, so a stream of small
/// frames costs one system call per 16 KiB instead of one per KiB, while the websocket
/// layer's own buffer stays as small as the cap keeps it. The buffer is freed once a socket
/// read comes back less than half full and its bytes are handed out, or on a read timeout:
/// an idle connection holds none (decision 0066).
#[derive(Debug)]
struct Burst {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The last socket read came back less than half full: free the buffer once it is
    /// handed out.
    last: bool,
}

impl DeadlineStream {
    /// Wraps `tcp` with an overall `deadline` (none: a plain stream).
    pub(crate) fn new(tcp: TcpStream, deadline: Option<Instant>) -> DeadlineStream {
        DeadlineStream {
            tcp,
            deadline,
            inbound: None,
            max_read: 0,
            burst: None,
        }
    }

    /// True while a burst buffer is held.
    #[cfg(test)]
    pub(crate) fn in_burst(&self) -> bool {
        self.burst.is_some()
    }

    /// Sets the most bytes one read of the TCP stream takes (0: no cap).
    pub(crate) fn set_max_read(&mut self, max_read: usize) {
        self.max_read = max_read;
    }

    /// The TCP stream.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Sets or clears the deadline.
    pub(crate) fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// The time left before the deadline (an error once it has passed).
    fn left(&self) -> io::Result<Option<Duration>> {
        match self.deadline {
            None => Ok(None),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
                } else {
                    Ok(Some(left))
                }
            }
        }
    }
}

impl io::Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(inbound) = &mut self.inbound {
            return inbound.read(buf);
        }
        if let Some(left) = self.left()? {
            self.tcp.set_read_timeout(Some(left))?;
        }
        let n = match self.max_read {
            0 if self.burst.is_none() => return self.tcp.read(buf),
            0 => buf.len(),
            max => buf.len().min(max),
        };
        if let Some(b) = &mut self.burst {
            if b.start == b.end {
                if b.last {
                    self.burst = None;
                    return self.capped_read(&mut buf[..n]);
                }
                let got = match io::Read::read(&mut self.tcp, &mut b.buf) {
                    Ok(got) => got,
                    Err(e) => {
                        // A timeout (a quiet moment) or an error: the burst is over.
                        self.burst = None;
                        return Err(e);
                    }
                };
                if got == 0 {
                    self.burst = None;
                    return Ok(0);
                }
                b.start = 0;
                b.end = got;
                b.last = got < b.buf.len() / 2;
            }
            let k = n.min(b.end - b.start);
            buf[..k].copy_from_slice(&b.buf[b.start..b.start + k]);
            b.start += k;
            if b.start == b.end && b.last {
                self.burst = None;
            }
            return Ok(k);
        }
        self.capped_read(&mut buf[..n])
    }
}

impl DeadlineStream {
    /// One socket read of at most `buf.len()` (the cap) bytes; a read that fills it starts a
    /// [`Burst`].
    fn capped_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let got = io::Read::read(&mut self.tcp, buf)?;
        if got == buf.len() && got > 0 {
            self.burst = Some(Burst {
                buf: vec![0u8; BURST_READ].into_boxed_slice(),
                start: 0,
                end: 0,
                last: false,
            });
        }
        Ok(got)
    }
}

impl io::Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(left) = self.left()? {
            self.tcp.set_write_timeout(Some(left))?;
        }
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

/// Limits and deadlines of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WsOptions {
    /// Deadline for TCP connect, TLS and websocket handshakes together.
    pub connect_timeout: Duration,
    /// Read timeout after the handshake while the connection is busy: the loop's tick.
    pub tick: Duration,
    /// The longer tick of a connection that has been quiet (no frame, no command) this long
    /// (the relay loop picks its tick from these three); a command then waits up to this long.
    /// At or below `tick`: no growth.
    pub idle_tick: Duration,
    /// The still longer tick of a connection quiet for `quiet_after` (at or below
    /// `idle_tick`: none): a command to a relay quiet that long waits up to this long.
    pub quiet_tick: Duration,
    /// How long a connection is quiet (no work) before it ticks every `quiet_tick`.
    pub quiet_after: Duration,
    /// Soft cap: the largest text message handled. A larger one (up to the hard cap,
    /// [`WsOptions::hard_cap`]) is dropped unparsed and counted, and the connection is kept,
    /// so one oversized stored event cannot make a relay flap for ever (it would be fetched
    /// again on every reconnect). The hard caps on a message and on one frame follow from it:
    /// raising it raises them.
    pub max_event_size: usize,
    /// Read buffer per connection (tungstenite's default is 128 KiB), and the most one socket
    /// read takes. tungstenite zero-fills it before every read, so all of it stays resident in
    /// every connection, busy or idle; a frame larger than it grows the buffer to the frame.
    pub read_buffer_size: usize,
    /// Bytes of outgoing frames buffered before `write` starts writing them to the socket
    /// (a threshold: nothing is allocated up front).
    pub write_buffer_size: usize,
    /// Most bytes one socket read takes on a connected `ws://` socket (0: up to the free
    /// read buffer). tungstenite reserves a whole frame's length on top of the bytes it
    /// holds whenever it parses a frame header, and doubles its read buffer when that does
    /// not fit behind the consumed part; reads that fill the buffer made idle connections
    /// keep 8–32 KiB buffers after their first burst of small frames. With reads of at most a
    /// quarter of `read_buffer_size`, frames up to half of it never grow the buffer. Not
    /// applied to `wss://` (rustls reads the socket, tungstenite reads rustls) nor during
    /// the handshakes.
    pub max_read: usize,
}

impl Default for WsOptions {
    fn default() -> Self {
        WsOptions {
            connect_timeout: Duration::from_secs(10),
            tick: Duration::from_millis(50),
            idle_tick: Duration::from_secs(2),
            quiet_tick: Duration::from_secs(10),
            quiet_after: Duration::from_secs(10),
            max_event_size: 1 << 20,
            read_buffer_size: 4 * 1024,
            write_buffer_size: 16 * 1024,
            max_read: 1024,
        }
    }
}

/// How far the hard cap on a message or frame lies above the soft cap
/// ([`WsOptions::hard_cap`]): room to recognise a slightly oversized event (and drop it
/// without losing the connection), not room to park megabytes.
pub(crate) const HARD_CAP_MARGIN: usize = 64 * 1024;

impl WsOptions {
    /// Hard cap: the largest message, and the largest frame, tungstenite reads
    /// (`max_event_size` + 64 KiB); a larger one ends the connection. A
    /// fragmented message is bounded by it too while it is being assembled: tungstenite
    /// ends the connection as soon as the fragments so far pass it.
    pub fn hard_cap(&self) -> usize {
        self.max_event_size.saturating_add(HARD_CAP_MARGIN)
    }

    /// The tungstenite configuration for these limits.
    pub fn websocket_config(&self) -> WebSocketConfig {
        WebSocketConfig::default()
            .read_buffer_size(self.read_buffer_size)
            .write_buffer_size(self.write_buffer_size)
            .max_write_buffer_size(self.write_buffer_size.max(self.max_event_size) * 4)
            .max_message_size(Some(self.hard_cap()))
            .max_frame_size(Some(self.hard_cap()))
    }
}

/// Why a connection could not be opened.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// The host name did not resolve.
    Resolve(io::Error),
    /// TCP connect failed or timed out (for every resolved address).
    Tcp(io::Error),
    /// TLS or websocket handshake failed.
    Handshake(String),
    /// The deadline passed during the handshake.
    Timeout,
    /// The address policy refused every resolved address (no TCP connect was made).
    Refused(Refusal),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Resolve(e) => write!(f, "cannot resolve host: {e}"),
            ConnectError::Tcp(e) => write!(f, "TCP connect failed: {e}"),
            ConnectError::Handshake(e) => write!(f, "handshake failed: {e}"),
            ConnectError::Timeout => write!(f, "connect deadline passed during the handshake"),
            ConnectError::Refused(e) => write!(f, "refused by the address policy: {e}"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// The default rustls client configuration (ring provider, webpki roots); operators add
/// roots with [`crate::net::tls::client_config`].
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

/// Resolves `url`'s host within `timeout`. An IP literal needs no look-up; a name is looked up
/// on a helper thread ([`resolve_with`]).
pub(crate) fn resolve(url: &RelayUrl, timeout: Duration) -> Result<Vec<SocketAddr>, ConnectError> {
    let host = url.host_for_resolve();
    let port = url.port();
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let host = host.to_string();
    resolve_with(timeout, move || {
        (host.as_str(), port).to_socket_addrs().map(|a| a.collect())
    })
}

/// Runs the look-up `lookup` on a helper thread and waits for it at most `timeout`: the
/// system resolver has no deadline of its own. At most [`MAX_DNS_IN_FLIGHT`] look-ups run at
/// once (a look-up that timed out still holds its slot until the resolver returns); a caller
/// waits for a free slot within the same deadline. The answer of a look-up that timed out is
/// dropped.
pub(crate) fn resolve_with(
    timeout: Duration,
    lookup: impl FnOnce() -> io::Result<Vec<SocketAddr>> + Send + 'static,
) -> Result<Vec<SocketAddr>, ConnectError> {
    resolve_in(dns_slots(), timeout, lookup)
}

/// [`resolve_with`] taking its slot from `slots` (the process-wide pool, or a test's own).
fn resolve_in(
    slots: &'static Slots,
    timeout: Duration,
    lookup: impl FnOnce() -> io::Result<Vec<SocketAddr>> + Send + 'static,
) -> Result<Vec<SocketAddr>, ConnectError> {
    let deadline = Instant::now() + timeout;
    if !slots.acquire(deadline) {
        return Err(ConnectError::Resolve(io::Error::new(
            io::ErrorKind::TimedOut,
            "DNS look-up deadline passed waiting for a free resolver slot",
        )));
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    let spawned = std::thread::Builder::new()
        .name("dns".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            let _ = tx.send(lookup());
            slots.release();
        });
    if let Err(e) = spawned {
        slots.release();
        return Err(ConnectError::Resolve(e));
    }
    let addrs = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Ok(addrs)) => addrs,
        Ok(Err(e)) => return Err(ConnectError::Resolve(e)),
        Err(_) => {
            return Err(ConnectError::Resolve(io::Error::new(
                io::ErrorKind::TimedOut,
                "DNS look-up deadline passed",
            )))
        }
    };
    if addrs.is_empty() {
        return Err(ConnectError::Resolve(io::Error::new(
            io::ErrorKind::NotFound,
            "no address",
        )));
    }
    Ok(addrs)
}

/// Checks one resolved address right before the TCP connect to it (`Err`: the reason it is
/// refused). See [`crate::net::policy::AddressPolicy::check_addr`].
pub(crate) type AddrCheck<'a> = &'a dyn Fn(SocketAddr) -> Result<(), Refusal>;

/// A counting semaphore bounding the DNS helper threads.
struct Slots {
    used: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    /// Takes a slot, waiting until `deadline` at most. False when none became free.
    fn acquire(&self, deadline: Instant) -> bool {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while *used >= MAX_DNS_IN_FLIGHT {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            used = self
                .freed
                .wait_timeout(used, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *used += 1;
        true
    }

    fn release(&self) {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(1);
        self.freed.notify_one();
    }
}

impl Slots {
    const fn new() -> Slots {
        Slots {
            used: Mutex::new(0),
            freed: Condvar::new(),
        }
    }
}

fn dns_slots() -> &'static Slots {
    static SLOTS: Slots = Slots::new();
    &SLOTS
}

/// Opens a TCP stream to the relay's host and port within `timeout`, checking each resolved address with `check` right before connecting to
/// that same address (resolve, check, connect: a DNS answer cannot change in between).
/// When `check` refuses every address, no connection is attempted and the result is
/// [`ConnectError::Refused`].
pub(crate) fn connect_tcp_checked(
    url: &RelayUrl,
    timeout: Duration,
    check: AddrCheck<'_>,
) -> Result<TcpStream, ConnectError> {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    let mut refused = Vec::new();
    for addr in resolve(url, timeout)? {
        if let Err(reason) = check(addr) {
            refused.push(reason);
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    match last {
        Some(e) => Err(ConnectError::Tcp(e)),
        None => match Refusal::every(refused) {
            Some(r) => Err(ConnectError::Refused(r)),
            None => Err(ConnectError::Tcp(io::Error::new(
                io::ErrorKind::TimedOut,
                "no address tried",
            ))),
        },
    }
}

/// Connects a websocket to `url` within `opts.connect_timeout`, then sets the read timeout
/// to `opts.tick`.
#[cfg(test)]
pub(crate) fn connect(url: &RelayUrl, opts: &WsOptions) -> Result<Socket, ConnectError> {
    connect_checked(url, opts, &tls_config(), &|_| Ok(()))
}

/// Connects a websocket to `url` within `opts.connect_timeout` (then sets the read timeout to
/// `opts.tick`), every resolved address checked right before the TCP connect
/// ([`connect_tcp_checked`]).
/// `tls` is the trust for `wss://` ([`crate::net::tls::client_config`]; [`tls_config`] is the
/// default).
pub(crate) fn connect_checked(
    url: &RelayUrl,
    opts: &WsOptions,
    tls: &Arc<rustls::ClientConfig>,
    check: AddrCheck<'_>,
) -> Result<Socket, ConnectError> {
    let deadline = Instant::now() + opts.connect_timeout;
    let tcp = connect_tcp_checked(url, opts.connect_timeout, check)?;
    let _ = tcp.set_nodelay(true);
    // One deadline for TLS and websocket handshakes together, however the peer paces bytes.
    let tcp = DeadlineStream::new(tcp, Some(deadline));
    let request = url
        .as_str()
        .into_client_request()
        .map_err(|e| ConnectError::Handshake(e.to_string()))?;
    let connector = if url.is_tls() {
        Connector::Rustls(tls.clone())
    } else {
        Connector::Plain
    };
    let (mut socket, _response) = match tungstenite::client_tls_with_config(
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
    match socket.get_mut() {
        MaybeTlsStream::Plain(s) => {
            s.set_deadline(None);
            s.set_max_read(opts.max_read);
        }
        MaybeTlsStream::Rustls(s) => s.sock.set_deadline(None),
        _ => unreachable!("only plain and rustls streams are enabled"),
    }
    let tcp = tcp_of(&socket);
    tcp.set_read_timeout(Some(opts.tick))
        .map_err(ConnectError::Tcp)?;
    tcp.set_write_timeout(Some(opts.connect_timeout))
        .map_err(ConnectError::Tcp)?;
    Ok(socket)
}

/// The TCP stream under a websocket (plain or TLS).
pub(crate) fn tcp_of(socket: &Socket) -> &TcpStream {
    match socket.get_ref() {
        MaybeTlsStream::Plain(s) => s.tcp(),
        MaybeTlsStream::Rustls(s) => s.get_ref().tcp(),
        // MaybeTlsStream is non-exhaustive; only the variants above are enabled.
        _ => unreachable!("only plain and rustls streams are enabled"),
    }
}

/// Ends a relay thread's blocking socket read from another thread: the thread registers a
/// clone of its connection's TCP stream while connected (`SocketWaker::set`); `wake`
/// shuts its read side down, so a read blocked for up to the quiet tick returns at once (end
/// of file). Used when the engine stops or forgets a relay: a quiet connection would notice
/// its `Shutdown` only at its next tick (decision 0067).
#[derive(Debug, Clone, Default)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct SocketWaker(Arc<parking_lot::Mutex<Option<TcpStream>>>);

impl SocketWaker {
    /// Registers the connection's socket (`None`: no connection).
    pub(crate) fn set(&self, tcp: Option<TcpStream>) {
        *self.0.lock() = tcp;
    }

    /// Registers a clone of `socket`'s TCP stream; an error (no file descriptor left) only
    /// means the thread is woken by its tick instead.
    pub(crate) fn set_socket(&self, socket: &Socket) {
        self.set(tcp_of(socket).try_clone().ok());
    }

    /// Ends a blocked read of the registered socket; the connection is not usable after it.
    pub(crate) fn wake(&self) {
        if let Some(tcp) = self.0.lock().take() {
            let _ = tcp.shutdown(std::net::Shutdown::Read);
        }
    }
}

fn stream_mut(socket: &mut Socket) -> &mut DeadlineStream {
    match socket.get_mut() {
        MaybeTlsStream::Plain(s) => s,
        MaybeTlsStream::Rustls(s) => &mut s.sock,
        _ => unreachable!("only plain and rustls streams are enabled"),
    }
}

fn stream_of(socket: &Socket) -> &DeadlineStream {
    match socket.get_ref() {
        MaybeTlsStream::Plain(s) => s,
        MaybeTlsStream::Rustls(s) => s.get_ref(),
        _ => unreachable!("only plain and rustls streams are enabled"),
    }
}

/// Moves the socket's reads to a helper thread named `name` (`Inbound`): from now on
/// `socket.read()` never blocks (a websocket read with nothing complete fails with
/// `WouldBlock`, which [`is_timeout`] accepts), and [`inbound`] gives what to wait on
/// together with the caller's channels, so input and channel items are both handled the
/// moment they arrive. Writes are unchanged (blocking, with the write timeout). TLS works
/// alike: the helper moves encrypted bytes, rustls stays in the caller's thread. The read
/// timeout ([`set_tick`]) no longer applies. The helper waits `linger` after each read that
/// drained the socket (`Inbound::start_lingering`; zero: never). Idempotent.
pub(crate) fn read_on_helper_thread(
    socket: &mut Socket,
    name: String,
    linger: Duration,
) -> io::Result<()> {
    let stream = stream_mut(socket);
    if stream.inbound.is_none() {
        stream.inbound = Some(Inbound::start_lingering(&stream.tcp, name, linger)?);
    }
    Ok(())
}

/// The helper-thread reader of a socket after [`read_on_helper_thread`].
pub(crate) fn inbound(socket: &Socket) -> Option<&Inbound> {
    stream_of(socket).inbound.as_ref()
}

/// Sets the socket's read timeout (the loop's tick).
pub(crate) fn set_tick(socket: &Socket, tick: Duration) -> io::Result<()> {
    tcp_of(socket).set_read_timeout(Some(tick))
}

/// True for the error a read timeout produces (the loop's tick).
pub(crate) fn is_timeout(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(io) if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::Ordering;

    #[test]
    fn every_address_refused_is_a_typed_refusal_without_a_connect() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}")).unwrap();
        let check = |addr: SocketAddr| Err(Refusal::OwnRelay { addr });
        match connect_tcp_checked(&url, Duration::from_secs(2), &check) {
            Err(ConnectError::Refused(r)) => {
                assert_eq!(r.label(), "own_relay");
                assert_eq!(
                    r.to_string(),
                    format!("127.0.0.1:{port} is the own relay's address")
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(listener.accept().is_err(), "no TCP connect was made");
    }

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

    /// Connects to a server that accepts and then sends a well-formed response head that never
    /// ends, `chunk` bytes every `interval` (each within the read timeout). Returns what
    /// `connect` gave, or `None` if it did not return within 30 s.
    fn connect_to_trickler(
        chunk: usize,
        interval: Duration,
        connect_timeout: Duration,
    ) -> Option<Result<(), ConnectError>> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let server = std::thread::spawn(move || {
            use std::io::Write;
            let (mut s, _) = listener.accept().unwrap();
            let mut head = b"HTTP/1.1 101 Switching Protocols\r\n".to_vec();
            for i in 0..20_000 {
                head.extend_from_slice(format!("X-Slow-{i}: a\r\n").as_bytes());
            }
            for piece in head.chunks(chunk) {
                if stop2.load(Ordering::SeqCst) || s.write_all(piece).is_err() {
                    break;
                }
                std::thread::sleep(interval);
            }
        });
        let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}")).unwrap();
        let opts = WsOptions {
            connect_timeout,
            ..WsOptions::default()
        };
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = tx.send(connect(&url, &opts).map(|_| ()));
        });
        let result = rx.recv_timeout(Duration::from_secs(30)).ok();
        stop.store(true, Ordering::SeqCst);
        let _ = server.join();
        result
    }

    /// Issue 7 item 7: the deadline used to be per read, so a server trickling bytes (each
    /// within the read timeout) held the thread until tungstenite's own header checks gave
    /// up (64 s at one byte per second, about 50 s for 200-byte pieces every 150 ms). The
    /// handshake now has one total deadline.
    #[test]
    fn trickling_server_fails_within_the_connect_deadline() {
        for (chunk, interval, deadline) in [
            (1, Duration::from_secs(1), Duration::from_secs(3)),
            (200, Duration::from_millis(150), Duration::from_secs(1)),
        ] {
            match connect_to_trickler(chunk, interval, deadline) {
                Some(Err(ConnectError::Timeout)) => {}
                other => panic!(
                    "{chunk} bytes every {interval:?}: expected a connect timeout, got {other:?}"
                ),
            }
        }
    }

    #[test]
    fn dns_lookup_has_a_deadline() {
        let (release, blocked) = crossbeam_channel::bounded::<()>(1);
        let err = resolve_with(Duration::from_millis(100), move || {
            let _ = blocked.recv();
            Ok(vec!["127.0.0.1:1".parse().unwrap()])
        })
        .unwrap_err();
        // The look-up is still blocked: the answer came from the deadline.
        assert!(
            matches!(&err, ConnectError::Resolve(e) if e.kind() == io::ErrorKind::TimedOut),
            "{err}"
        );
        drop(release);
        let ok = resolve_with(Duration::from_secs(30), || {
            Ok(vec!["127.0.0.1:1".parse().unwrap()])
        });
        assert_eq!(ok.unwrap().len(), 1);
        let none = resolve_with(Duration::from_secs(30), || Ok(vec![]));
        assert!(matches!(none, Err(ConnectError::Resolve(_))));
    }

    #[test]
    fn dns_lookups_beyond_the_limit_wait_for_a_slot_within_their_deadline() {
        // A pool of its own: other tests resolve names through the process-wide one.
        static POOL: Slots = Slots::new();
        // Fill every slot with look-ups that block until released.
        let (release, blocked) = crossbeam_channel::unbounded::<()>();
        let mut waiting = Vec::new();
        for _ in 0..MAX_DNS_IN_FLIGHT {
            let blocked = blocked.clone();
            waiting.push(std::thread::spawn(move || {
                resolve_in(&POOL, Duration::from_secs(30), move || {
                    let _ = blocked.recv();
                    Ok(vec!["127.0.0.1:1".parse().unwrap()])
                })
            }));
        }
        let end = Instant::now() + Duration::from_secs(30);
        while *POOL.used.lock().unwrap() < MAX_DNS_IN_FLIGHT {
            assert!(Instant::now() < end, "the look-ups did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        // No slot: the deadline passes without a look-up being started.
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = started.clone();
        let err = resolve_in(&POOL, Duration::from_millis(50), move || {
            s2.store(true, Ordering::SeqCst);
            Ok(vec![])
        })
        .unwrap_err();
        assert!(matches!(err, ConnectError::Resolve(ref e) if e.kind() == io::ErrorKind::TimedOut));
        assert!(!started.load(Ordering::SeqCst));
        // A slot frees up: a waiting look-up goes ahead.
        let late = std::thread::spawn(|| {
            resolve_in(&POOL, Duration::from_secs(30), || {
                Ok(vec!["127.0.0.1:2".parse().unwrap()])
            })
        });
        for _ in 0..MAX_DNS_IN_FLIGHT {
            release.send(()).unwrap();
        }
        for w in waiting {
            assert!(w.join().unwrap().is_ok());
        }
        assert!(late.join().unwrap().is_ok());
    }

    /// A connected `ws://` socket's reads are cut at `max_read` (so tungstenite's read buffer
    /// stays at its size: see `WsOptions::max_read`); without a cap a read takes all it can.
    #[test]
    fn reads_are_cut_at_max_read() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        std::io::Write::write_all(&mut client, &[7u8; 3000]).unwrap();
        let mut stream = DeadlineStream::new(server, None);
        stream.set_max_read(1024);
        let mut buf = [0u8; 8192];
        let mut got = 0;
        while got < 3000 {
            let n = io::Read::read(&mut stream, &mut buf).unwrap();
            assert!((1..=1024).contains(&n), "{n}");
            got += n;
        }
        std::io::Write::write_all(&mut client, &[7u8; 3000]).unwrap();
        stream.set_max_read(0);
        std::thread::sleep(Duration::from_millis(50));
        let n = io::Read::read(&mut stream, &mut buf).unwrap();
        assert!(n > 1024, "{n}");
    }

    /// A burst (reads that come back full) is read 16 KiB per system call and handed out
    /// `max_read` bytes at a time, every byte in order; the burst buffer is gone once the
    /// peer is quiet, and a trickle of small frames never gets one (decision 0066).
    #[test]
    fn a_burst_is_read_in_large_reads_and_handed_out_capped_then_freed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut stream = DeadlineStream::new(server, None);
        stream.set_max_read(1024);
        let mut buf = [0u8; 4096];
        // A trickle: reads come back short, no burst buffer.
        std::io::Write::write_all(&mut client, &[1u8; 300]).unwrap();
        assert_eq!(io::Read::read(&mut stream, &mut buf).unwrap(), 300);
        assert!(!stream.in_burst());
        // A burst of 100 KiB, in order.
        let sent: Vec<u8> = (0..100 * 1024).map(|i| (i % 251) as u8).collect();
        let writer = {
            let sent = sent.clone();
            let mut client = client.try_clone().unwrap();
            std::thread::spawn(move || std::io::Write::write_all(&mut client, &sent).unwrap())
        };
        let mut got = Vec::new();
        let mut bursting = false;
        while got.len() < sent.len() {
            let n = io::Read::read(&mut stream, &mut buf).unwrap();
            assert!((1..=1024).contains(&n), "{n}");
            got.extend_from_slice(&buf[..n]);
            bursting |= stream.in_burst();
        }
        writer.join().unwrap();
        assert!(got == sent, "every byte, in order");
        assert!(bursting, "full capped reads start a burst");
        // The peer is quiet: the next read times out and the buffer is freed.
        let e = io::Read::read(&mut stream, &mut buf).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{e}"
        );
        assert!(!stream.in_burst());
        // Bytes held in a burst are not skipped when the cap is lifted: two capped reads (the
        // first starts a burst, the second fills its buffer and hands out 1 KiB of it), then
        // uncapped reads for the rest.
        std::io::Write::write_all(&mut client, &[9u8; 8000]).unwrap();
        let mut total = 0;
        while total < 2048 {
            let n = io::Read::read(&mut stream, &mut buf).unwrap();
            assert!((1..=1024).contains(&n), "{n}");
            total += n;
        }
        stream.set_max_read(0);
        while total < 8000 {
            let n = io::Read::read(&mut stream, &mut buf).unwrap();
            assert!(n > 0 && buf[..n].iter().all(|&b| b == 9));
            total += n;
        }
        assert_eq!(total, 8000, "nothing skipped, nothing extra");
    }

    #[test]
    fn ip_literals_need_no_lookup() {
        let u = RelayUrl::parse("ws://[::1]:7").unwrap();
        assert_eq!(
            resolve(&u, Duration::ZERO).unwrap(),
            vec!["[::1]:7".parse::<SocketAddr>().unwrap()]
        );
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

    /// A raw websocket frame from a server (unmasked): `fin`, `opcode`, `payload`.
    fn raw_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![if fin { 0x80 } else { 0 } | opcode];
        match payload.len() {
            n if n < 126 => out.push(n as u8),
            n if n <= 0xffff => {
                out.push(126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(payload);
        out
    }

    /// A websocket server on 127.0.0.1 that accepts `n` connections (tungstenite's
    /// handshake) and hands each raw TCP stream to `serve`.
    fn raw_server(
        n: usize,
        serve: impl Fn(TcpStream) + Send + Sync + 'static,
    ) -> (RelayUrl, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = RelayUrl::parse(&format!("ws://{}", listener.local_addr().unwrap())).unwrap();
        let serve = Arc::new(serve);
        let server = std::thread::spawn(move || {
            let mut threads = Vec::new();
            for _ in 0..n {
                let (tcp, _) = listener.accept().unwrap();
                let ws = tungstenite::accept(tcp).unwrap();
                let tcp = ws.into_inner();
                let serve = serve.clone();
                threads.push(std::thread::spawn(move || serve(tcp)));
            }
            for t in threads {
                let _ = t.join();
            }
        });
        (url, server)
    }

    /// Reads `socket` until a text message arrives or the connection fails (ticks skipped).
    fn read_message(socket: &mut Socket) -> Result<String, tungstenite::Error> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "nothing arrived");
            match socket.read() {
                Ok(tungstenite::Message::Text(t)) => return Ok(t.to_string()),
                Ok(_) => {}
                Err(e) if is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn too_long(r: &Result<String, tungstenite::Error>) -> bool {
        matches!(
            r,
            Err(tungstenite::Error::Capacity(
                tungstenite::error::CapacityError::MessageTooLong { .. }
            ))
        )
    }

    #[test]
    fn the_hard_caps_follow_the_soft_cap() {
        let opts = WsOptions::default();
        assert_eq!(opts.hard_cap(), (1 << 20) + 64 * 1024);
        let config = opts.websocket_config();
        assert_eq!(config.max_message_size, Some(opts.hard_cap()));
        assert_eq!(config.max_frame_size, Some(opts.hard_cap()));
        let raised = WsOptions {
            max_event_size: 4 << 20,
            ..opts
        };
        assert_eq!(
            raised.websocket_config().max_message_size,
            Some((4 << 20) + 64 * 1024)
        );
    }

    /// One frame above the hard cap ends the connection; one just below it is read (the
    /// session drops it as oversized and keeps the connection).
    #[test]
    fn a_frame_above_the_hard_cap_ends_the_connection() {
        let opts = WsOptions::default();
        let cap = opts.hard_cap();
        let (url, server) = raw_server(1, move |mut tcp| {
            let _ = io::Write::write_all(&mut tcp, &raw_frame(true, 1, &vec![b'x'; cap]));
            let _ = io::Write::write_all(&mut tcp, &raw_frame(true, 1, &vec![b'x'; cap + 1]));
            std::thread::sleep(Duration::from_secs(1));
        });
        let mut socket = connect(&url, &opts).unwrap();
        assert_eq!(read_message(&mut socket).unwrap().len(), cap);
        assert!(too_long(&read_message(&mut socket)));
        drop(socket);
        server.join().unwrap();
    }

    /// A message in many small fragments (each far below the cap) whose total passes the hard
    /// cap ends the connection as soon as the fragments so far pass it: the incomplete message
    /// is bounded by the hard cap, not by its end.
    #[test]
    fn fragments_passing_the_hard_cap_end_the_connection() {
        let opts = WsOptions::default();
        let cap = opts.hard_cap();
        let (url, server) = raw_server(1, move |mut tcp| {
            let piece = vec![b'x'; 4096];
            let mut sent = 0;
            let mut first = true;
            // Fragments up to twice the cap, then the final one.
            while sent < 2 * cap {
                let opcode = if first { 1 } else { 0 };
                first = false;
                if io::Write::write_all(&mut tcp, &raw_frame(false, opcode, &piece)).is_err() {
                    return;
                }
                sent += piece.len();
            }
            let _ = io::Write::write_all(&mut tcp, &raw_frame(true, 0, b"x"));
        });
        let mut socket = connect(&url, &opts).unwrap();
        assert!(too_long(&read_message(&mut socket)));
        drop(socket);
        server.join().unwrap();
    }

    /// A fragmented message that is never finished can hold at most the hard cap: the
    /// fragment that passes it ends the connection, however slowly the fragments come (here
    /// with pings between them, which do not reset anything).
    #[test]
    fn an_unfinished_fragmented_message_holds_at_most_the_hard_cap() {
        let opts = WsOptions::default();
        let cap = opts.hard_cap();
        let (url, server) = raw_server(1, move |mut tcp| {
            let mut w = |b: Vec<u8>| io::Write::write_all(&mut tcp, &b).is_ok();
            // A fragment just below the cap, never finished ...
            if !w(raw_frame(false, 1, &vec![b'x'; cap - 100])) {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
            let _ = w(raw_frame(true, 9, b"ping"));
            // ... a continuation that stays within it ...
            let _ = w(raw_frame(false, 0, &[b'x'; 100]));
            std::thread::sleep(Duration::from_millis(200));
            // ... and one byte more.
            let _ = w(raw_frame(false, 0, b"x"));
            std::thread::sleep(Duration::from_secs(1));
        });
        let mut socket = connect(&url, &opts).unwrap();
        let got = read_message(&mut socket);
        assert!(too_long(&got), "{:?}", got.map(|t| t.len()));
        drop(socket);
        server.join().unwrap();
    }

    /// The resident memory of this process, from `/proc/self/status` (`VmRSS`, bytes).
    fn rss() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// Measures what a connection costs with the default caps: `GRASP_MEM_N` (default 100)
    /// `ws://` connections on the relay connector, each sent one EVENT frame just below the
    /// hard cap. Prints the resident memory per connection while every connection holds its
    /// message (the worst case: each relay thread handling its frame at once) and after the
    /// messages are dropped. Run alone:
    /// `cargo test --all-features --lib net::ws::tests::memory_per_connection -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement: prints figures, run alone"]
    fn memory_per_connection_with_frames_just_below_the_hard_cap() {
        let n: usize = std::env::var("GRASP_MEM_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100);
        let opts = WsOptions::default();
        let cap = opts.hard_cap();
        let head = format!(
            "[\"EVENT\",\"s\",{{\"id\":\"{}\",\"content\":\"",
            "ab".repeat(32)
        );
        let mut text = head.into_bytes();
        text.resize(cap - 3, b'x');
        text.extend_from_slice(b"\"}]");
        let frame = Arc::new(raw_frame(true, 1, &text));
        drop(text);
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(0);
        let go_rx = Arc::new(Mutex::new(go_rx));
        let (url, server) = raw_server(n, move |mut tcp| {
            // Wait for the word (every connection open), then send the shared frame.
            let _ = go_rx.lock().unwrap().recv();
            let _ = io::Write::write_all(&mut tcp, &frame);
            // Until the client closes.
            let _ = io::Read::read(&mut tcp, &mut [0u8; 64]);
        });
        let base = rss();
        let mut sockets: Vec<Socket> = (0..n).map(|_| connect(&url, &opts).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        let idle = rss();
        for _ in 0..n {
            go_tx.send(()).unwrap();
        }
        // The messages as tungstenite hands them over (their bytes are the read buffer's).
        let held: Vec<tungstenite::Message> = sockets
            .iter_mut()
            .map(|s| loop {
                match s.read() {
                    Ok(m @ tungstenite::Message::Text(_)) => break m,
                    Ok(_) => {}
                    Err(e) if is_timeout(&e) => {}
                    Err(e) => panic!("{e}"),
                }
            })
            .collect();
        assert!(held.iter().all(|m| m.len() == cap));
        let peak = rss();
        drop(held);
        // What dropping the messages freed: fresh blocks of the same size reuse freed memory
        // (the resident size barely grows) but not memory a read buffer kept.
        let fresh: Vec<Vec<u8>> = (0..n).map(|_| vec![1u8; cap]).collect();
        let reuse = rss();
        let kept = (peak + n * cap).saturating_sub(reuse);
        drop(fresh);
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        println!(
            "{n} connections, hard cap {cap} bytes: base {:.1} MiB, idle {:.1} MiB \
             ({:.1} KiB per connection), every connection holding its message {:.1} MiB \
             ({:.2} MiB per connection); after the messages are dropped, {:.2} MiB per \
             connection still held by the connections",
            mib(base),
            mib(idle),
            idle.saturating_sub(base) as f64 / 1024.0 / n as f64,
            mib(peak),
            mib(peak.saturating_sub(base)) / n as f64,
            mib(peak.saturating_sub(base).saturating_sub(kept.min(peak))) / n as f64,
        );
        drop(sockets);
        server.join().unwrap();
    }
}

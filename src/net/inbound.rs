//! Reads of a socket moved to a helper thread, so that the thread owning the socket can wait
//! for its input *and* its channels at once, without a polling tick.
//!
//! A blocking socket read cannot be woken by a channel, and a read timeout used as a tick
//! delays whatever arrives on the channel by up to one tick. [`Inbound::start_lingering`] spawns a
//! small pump thread that blocks in `read` on a clone of the TCP stream and passes each
//! chunk of bytes over a bounded channel. The owner reads from [`Inbound::read`] (never
//! blocking: `WouldBlock` when nothing is there) and waits on the chunk channel together with
//! its other channels ([`Inbound::register`], a `crossbeam_channel::Select`). TLS and
//! websocket framing stay with the owner: the pump moves raw bytes only, so the websocket and
//! rustls state is never shared between threads.
//!
//! Bounds: at most [`CHUNKS`] chunks of at most [`CHUNK_SIZE`] bytes wait in the channel; a
//! pump facing a full channel stops reading, so the kernel's TCP window pushes back on the
//! peer as before. The pump ends on end of file, on a read error (passed on to the owner) or
//! when the [`Inbound`] is dropped (it shuts the socket's read side down, which ends a
//! blocked read).

use std::io;
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use crossbeam_channel::{Receiver, Select, TryRecvError};
use log::debug;

/// Bytes the pump reads at most at once.
pub(crate) const CHUNK_SIZE: usize = 16 * 1024;
/// Chunks waiting for the owner at most.
pub(crate) const CHUNKS: usize = 16;
/// Stack of a pump thread (it only reads and sends).
const PUMP_STACK: usize = 64 * 1024;

/// The input side of a socket, read by a helper thread.
#[derive(Debug)]
pub(crate) struct Inbound {
    chunks: Receiver<io::Result<Vec<u8>>>,
    current: Vec<u8>,
    pos: usize,
    /// A read error from the pump, reported once; later reads see end of file.
    ended: bool,
    /// A clone of the socket, to end the pump.
    tcp: TcpStream,
}

impl Inbound {
    /// Starts the pump thread (named `name`) reading a clone of `tcp`. From now on only the
    /// pump reads the socket: its read timeout is cleared (the pump blocks until data, end of
    /// file, an error or [`Drop`]); writes go on through `tcp` as before.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn start(tcp: &TcpStream, name: String) -> io::Result<Inbound> {
        Inbound::start_lingering(tcp, name, Duration::ZERO)
    }

    /// Starts the pump thread (named `name`) reading a clone of `tcp`, as `Inbound::start` (tests)
    /// does, with a pump that, after a read that drained the socket, waits
    /// `linger` before reading again, so that a stream of small frames (an `OK` per event
    /// from a relay that stores a batch) reaches the owner in a few chunks instead of one
    /// chunk, and two thread wake-ups, per frame. The first bytes after a quiet moment are
    /// passed on at once; only the bytes right behind them wait, at most `linger`.
    pub(crate) fn start_lingering(
        tcp: &TcpStream,
        name: String,
        linger: Duration,
    ) -> io::Result<Inbound> {
        let mut reader = tcp.try_clone()?;
        let tcp = tcp.try_clone()?;
        tcp.set_read_timeout(None)?;
        let (tx, rx) = crossbeam_channel::bounded(CHUNKS);
        std::thread::Builder::new()
            .name(name)
            .stack_size(PUMP_STACK)
            .spawn(move || {
                use std::io::Read;
                let mut buf = vec![0u8; CHUNK_SIZE];
                loop {
                    match reader.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if tx.send(Ok(buf[..n].to_vec())).is_err() {
                                break;
                            }
                            if n < buf.len() && !linger.is_zero() {
                                std::thread::sleep(linger);
                            }
                        }
                        // A read timeout set on the shared socket by someone else: keep
                        // blocking (the owner never waits on it).
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::Interrupted
                                    | io::ErrorKind::WouldBlock
                                    | io::ErrorKind::TimedOut
                            ) => {}
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            break;
                        }
                    }
                }
                debug!("socket reader ends");
            })?;
        Ok(Inbound {
            chunks: rx,
            current: Vec::new(),
            pos: 0,
            ended: false,
            tcp,
        })
    }

    /// Copies received bytes into `buf`: `Ok(0)` at end of file, the pump's read error once,
    /// `WouldBlock` when nothing has arrived yet.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.pos < self.current.len() {
                let n = buf.len().min(self.current.len() - self.pos);
                buf[..n].copy_from_slice(&self.current[self.pos..self.pos + n]);
                self.pos += n;
                return Ok(n);
            }
            if self.ended {
                return Ok(0);
            }
            match self.chunks.try_recv() {
                Ok(Ok(chunk)) => {
                    self.current = chunk;
                    self.pos = 0;
                }
                Ok(Err(e)) => {
                    self.ended = true;
                    return Err(e);
                }
                Err(TryRecvError::Empty) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "no input yet (wait on Inbound::register)",
                    ))
                }
                Err(TryRecvError::Disconnected) => {
                    self.ended = true;
                    return Ok(0);
                }
            }
        }
    }

    /// Adds "input arrived, or the input ended" to `select`; returns the operation's index.
    /// It only waits: the bytes stay queued for [`Inbound::read`] (use `Select::ready`, not
    /// `Select::select`). Bytes already taken into this reader's buffer, or into a websocket or
    /// TLS layer above it, do not make it ready: read until `WouldBlock` before waiting.
    pub(crate) fn register<'a>(&'a self, select: &mut Select<'a>) -> usize {
        select.recv(&self.chunks)
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        // Ends a read blocked in the pump; the socket closes once both copies are dropped.
        let _ = self.tcp.shutdown(Shutdown::Read);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Instant;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    fn wait_ready(inbound: &Inbound, timeout: Duration) -> bool {
        let mut sel = Select::new();
        let i = inbound.register(&mut sel);
        matches!(sel.ready_timeout(timeout), Ok(r) if r == i)
    }

    #[test]
    fn bytes_wake_the_waiter_and_are_read_in_order() {
        let (client, mut server) = pair();
        let mut inbound = Inbound::start(&client, "test-reader".into()).unwrap();
        let mut buf = [0u8; 4];
        let e = inbound.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        server.write_all(b"hello").unwrap();
        assert!(wait_ready(&inbound, Duration::from_secs(30)));
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(30);
        while got.len() < 5 {
            match inbound.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < end, "bytes lost");
                    wait_ready(&inbound, Duration::from_millis(100));
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, b"hello");
        // The peer closes: the waiter wakes and the read says end of file.
        drop(server);
        assert!(wait_ready(&inbound, Duration::from_secs(30)));
        assert_eq!(inbound.read(&mut buf).unwrap(), 0);
        assert_eq!(inbound.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn a_lingering_pump_passes_a_stream_of_small_writes_on_in_few_chunks() {
        let (client, mut server) = pair();
        let inbound =
            Inbound::start_lingering(&client, "test-reader".into(), Duration::from_millis(200))
                .unwrap();
        let chunk = |what: &str| {
            inbound
                .chunks
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("{what}"))
                .unwrap()
        };
        // The first bytes after a quiet moment are passed on at once…
        server.write_all(b"first;").unwrap();
        assert_eq!(chunk("the first write"), b"first;");
        // …the ones right behind them (here 5 ms apart: without the linger, one chunk and
        // one wake-up each) wait for the linger and come together.
        let mut want = Vec::new();
        for i in 0..10 {
            let frame = format!("frame {i};");
            server.write_all(frame.as_bytes()).unwrap();
            want.extend_from_slice(frame.as_bytes());
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut got = Vec::new();
        let mut chunks = 0;
        while got.len() < want.len() {
            got.extend(chunk("the later writes"));
            chunks += 1;
        }
        assert_eq!(got, want, "every byte, in order");
        assert!(chunks < 10, "{chunks} chunks for 10 writes");
    }

    #[test]
    fn dropping_the_reader_ends_the_pump_and_frees_the_connection() {
        let (client, mut server) = pair();
        let inbound = Inbound::start(&client, "test-reader".into()).unwrap();
        drop(inbound);
        drop(client);
        // Both copies of the client socket are closed: the server sees end of file.
        server
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut buf = [0u8; 1];
        use std::io::Read;
        assert_eq!(server.read(&mut buf).unwrap(), 0);
    }
}

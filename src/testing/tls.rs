//! TLS for tests: a certificate authority made on the spot ([`TestCa`]) and a TLS-terminating
//! proxy ([`TlsProxy`]) that puts `wss://` (and NIP-11 over `https://`) in front of a plain
//! [`TestRelay`](crate::testing::TestRelay) on 127.0.0.1.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use log::debug;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A certificate authority for one test.
pub struct TestCa {
    key: KeyPair,
    params: CertificateParams,
    pem: String,
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}

impl TestCa {
    /// A new CA with a fresh key.
    pub fn new() -> TestCa {
        let key = KeyPair::generate().expect("generate a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "grasp-sync test CA");
        let pem = params.self_signed(&key).expect("self-sign the CA").pem();
        TestCa { key, params, pem }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Writes the CA certificate as PEM to `path` (for `--ca-file`).
    pub fn write_pem(&self, path: &Path) -> io::Result<()> {
        std::fs::write(path, &self.pem)
    }

    /// A server configuration whose certificate this CA signed, valid for `localhost` and
    /// 127.0.0.1.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let key = KeyPair::generate().expect("generate a server key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string()]).expect("server parameters");
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .expect("sign the server cert");
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(chain, der)
            .expect("server certificate");
        Arc::new(config)
    }
}

/// A TLS-terminating proxy on 127.0.0.1: each connection is decrypted and its bytes copied
/// to and from `127.0.0.1:<backend port>`. Dropping it stops accepting.
pub struct TlsProxy {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TlsProxy {
    /// Listens on a free port in front of `backend_port`.
    pub fn start(backend_port: u16, config: Arc<rustls::ServerConfig>) -> TlsProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the TLS proxy");
        let port = listener.local_addr().expect("local addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let config = config.clone();
                let stop3 = stop2.clone();
                std::thread::spawn(move || {
                    if let Err(e) = pipe(client, backend_port, config, &stop3) {
                        debug!("TLS proxy connection ended: {e}");
                    }
                });
            }
        });
        TlsProxy {
            port,
            stop,
            thread: Some(thread),
        }
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `wss://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("wss://127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn pipe(
    client: TcpStream,
    backend_port: u16,
    config: Arc<rustls::ServerConfig>,
    stop: &AtomicBool,
) -> io::Result<()> {
    let tick = Some(Duration::from_millis(2));
    client.set_read_timeout(tick)?;
    let mut backend = TcpStream::connect(("127.0.0.1", backend_port))?;
    backend.set_read_timeout(tick)?;
    let conn = rustls::ServerConnection::new(config).map_err(io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, client);
    let mut buf = vec![0u8; 64 * 1024];
    while !stop.load(Ordering::SeqCst) {
        match tls.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => backend.write_all(&buf[..n])?,
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e),
        }
        match backend.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => {
                tls.write_all(&buf[..n])?;
                tls.flush()?;
            }
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

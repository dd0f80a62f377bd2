//! TLS trust for `wss://` relays (and NIP-11 over `https://`): rustls with the *ring*
//! provider chosen explicitly, trusting the webpki roots by default, plus CA files an
//! operator names (`--ca-file`, e.g. an internal CA in front of the own relay) and, on
//! request, the system's trust store (`--system-roots`).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// Which certificates a `wss://` connection trusts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustOptions {
    /// PEM files whose certificates are trusted as roots, besides the others.
    pub ca_files: Vec<PathBuf>,
    /// Also trust the operating system's certificate store.
    pub system_roots: bool,
    /// Do not trust the built-in webpki (Mozilla) roots; only `ca_files` and, if set, the
    /// system store.
    pub no_webpki_roots: bool,
}

/// What went wrong building the trust store.
#[derive(Debug)]
#[non_exhaustive]
pub enum TlsError {
    /// A CA file could not be read or holds no certificate.
    CaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The system store could not be loaded.
    SystemRoots(String),
    /// Nothing is trusted at all.
    NoRoots,
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TlsError::CaFile { path, reason } => write!(
                f,
                "--ca-file {}: {reason} (expected PEM certificates: -----BEGIN CERTIFICATE-----)",
                path.display()
            ),
            TlsError::SystemRoots(e) => write!(
                f,
                "--system-roots: the system certificate store could not be loaded: {e}"
            ),
            TlsError::NoRoots => write!(
                f,
                "no trusted certificates: give --ca-file or --system-roots"
            ),
        }
    }
}

impl std::error::Error for TlsError {}

/// Builds the rustls client configuration for `trust`.
pub fn client_config(trust: &TrustOptions) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    if !trust.no_webpki_roots {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for path in &trust.ca_files {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| TlsError::CaFile {
                path: path.clone(),
                reason: format!("cannot read it: {e}"),
            })?;
        if certs.is_empty() {
            return Err(TlsError::CaFile {
                path: path.clone(),
                reason: "it holds no certificate".into(),
            });
        }
        for c in certs {
            roots.add(c).map_err(|e| TlsError::CaFile {
                path: path.clone(),
                reason: format!("a certificate is not usable as a root: {e}"),
            })?;
        }
    }
    if trust.system_roots {
        let found = rustls_native_certs::load_native_certs();
        if found.certs.is_empty() {
            let why = found
                .errors
                .first()
                .map_or("no certificates found".to_string(), |e| e.to_string());
            return Err(TlsError::SystemRoots(why));
        }
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        log::info!(
            "trusting {added} certificates of the system store ({ignored} unusable ones ignored)"
        );
    }
    if roots.is_empty() {
        return Err(TlsError::NoRoots);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth());
    match config {
        Ok(c) => Ok(Arc::new(c)),
        // The ring provider supports the default protocol versions; this is a build
        // configuration error, not something a peer or an operator can cause.
        Err(e) => panic!("rustls ring provider rejected default protocol versions: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_trust_the_webpki_roots() {
        assert!(client_config(&TrustOptions::default()).is_ok());
        let none = TrustOptions {
            no_webpki_roots: true,
            ..TrustOptions::default()
        };
        assert!(matches!(client_config(&none), Err(TlsError::NoRoots)));
    }

    #[test]
    fn a_bad_ca_file_is_a_clear_error() {
        let p = std::env::temp_dir().join(format!("grasp-sync-ca-{}.pem", std::process::id()));
        std::fs::write(&p, "not a certificate").unwrap();
        let t = TrustOptions {
            ca_files: vec![p.clone()],
            ..TrustOptions::default()
        };
        let e = client_config(&t).unwrap_err().to_string();
        assert!(
            e.contains("--ca-file") && e.contains("no certificate"),
            "{e}"
        );
        let t = TrustOptions {
            ca_files: vec!["/nonexistent/ca.pem".into()],
            ..TrustOptions::default()
        };
        let e = client_config(&t).unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/ca.pem") && e.contains("cannot read"),
            "{e}"
        );
    }
}

//! TLS settings: the listener's certificate and key, and the clients'
//! trusted roots (a CA file, or the system's roots). rustls with the ring
//! provider, TLS 1.2 and 1.3.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS settings could not be made; each names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{what} {}: {message}", path.display())]
    Pem {
        /// What the file was for.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// rustls refused the settings (e.g. a key that does not match the
    /// certificate).
    #[error("TLS settings refused: {0}")]
    Rustls(#[from] rustls::Error),
    /// No trusted root at all.
    #[error("no trusted CA certificates: {0}")]
    NoRoots(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |message: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        message,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into()
        ));
    }
    Ok(certs)
}

/// The listener's TLS settings from a PEM certificate chain and a PEM
/// private key (PKCS#8, PKCS#1 or SEC1).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certs("TLS certificate", cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Pem {
        what: "TLS private key",
        path: key.to_path_buf(),
        message: e.to_string(),
    })?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(Arc::new(config))
}

/// A client's TLS settings: trust the certificates of `ca_file` (PEM) if
/// given, else the system's roots.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for c in certs("CA file", path)? {
                roots.add(c).map_err(|e| TlsError::Pem {
                    what: "CA file",
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map_or_else(|| "none found".to_string(), ToString::to_string);
                return Err(TlsError::NoRoots(format!(
                    "the system has none ({why}); give a CA file (--ca-file or PHUB_CA_FILE)"
                )));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The environment variable that names a CA file for HTTPS clients
/// (phubctl, the worker library) when none is given otherwise.
pub const CA_FILE_ENV: &str = "PHUB_CA_FILE";

/// A ureq agent for `url` from `builder`: for an `https` URL, one that
/// trusts `ca_file`, else the file `$PHUB_CA_FILE` names, else the
/// system's roots; for `http`, `builder` as it is.
pub fn agent(
    url: &str,
    ca_file: Option<&Path>,
    builder: ureq::AgentBuilder,
) -> Result<ureq::Agent, TlsError> {
    if !url.trim_start().to_ascii_lowercase().starts_with("https://") {
        return Ok(builder.build());
    }
    let env = std::env::var_os(CA_FILE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let ca = ca_file.map(Path::to_path_buf).or(env);
    Ok(builder.tls_config(client_config(ca.as_deref())?).build())
}

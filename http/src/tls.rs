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
    /// The listener's certificate is not valid now: every client would
    /// refuse it.
    #[error(
        "TLS certificate {}: {why} (valid from {not_before} to {not_after}, UTC); renew it, or start \
         without TLS on loopback",
        path.display()
    )]
    NotValidNow {
        /// The file.
        path: PathBuf,
        /// "expired 3 days ago", "not valid for another 2 hours".
        why: String,
        /// Its validity, as the certificate says (RFC 2822).
        not_before: String,
        /// Its validity's end (RFC 2822).
        not_after: String,
    },
}

/// A listener's certificate closer than this to its end is warned about
/// at start.
const EXPIRY_WARNING_SECS: i64 = 7 * 24 * 3600;

/// Refuses a listener's certificate (the chain's first, in `path`) that is
/// not valid at `now` (seconds since the Unix epoch), and warns of one that
/// ends within a week.
fn check_validity(path: &Path, cert: &CertificateDer<'_>, now: i64) -> Result<(), TlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| TlsError::Pem {
        what: "TLS certificate",
        path: path.to_path_buf(),
        message: format!("not a readable X.509 certificate: {e}"),
    })?;
    let v = parsed.validity();
    let (from, to) = (v.not_before.timestamp(), v.not_after.timestamp());
    let ago = |secs: i64| {
        let h = secs / 3600;
        if h >= 48 {
            format!("{} days", h / 24)
        } else if h >= 1 {
            format!("{h} hours")
        } else {
            format!("{} minutes", secs / 60)
        }
    };
    let why = if now > to {
        Some(format!("expired {} ago", ago(now - to)))
    } else if now < from {
        Some(format!("not valid for another {}", ago(from - now)))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(TlsError::NotValidNow {
            path: path.to_path_buf(),
            why,
            not_before: v.not_before.to_rfc2822().unwrap_or_default(),
            not_after: v.not_after.to_rfc2822().unwrap_or_default(),
        });
    }
    if to - now < EXPIRY_WARNING_SECS {
        log::warn!(
            "TLS certificate {} expires in {} ({}): renew it before clients refuse it",
            path.display(),
            ago(to - now),
            v.not_after.to_rfc2822().unwrap_or_default()
        );
    }
    Ok(())
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
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
    check_validity(cert, &chain[0], unix_now())?;
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
    client_config_with_identity(ca_file, None)
}

/// [`client_config`], presenting the certificate chain and private key of
/// `identity` (PEM files: certificate, key) when the server asks for one
/// (mutual TLS).
pub fn client_config_with_identity(
    ca_file: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
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
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certs("client certificate", cert)?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Pem {
                what: "client private key",
                path: key.to_path_buf(),
                message: e.to_string(),
            })?;
            builder.with_client_auth_cert(chain, key)?
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for `localhost` valid from `from` to `to`
    /// (year, month, day), and its key, written into a fresh directory.
    fn cert_valid(name: &str, from: (i32, u8, u8), to: (i32, u8, u8)) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("phub-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    /// Issue 36: phub-control started with an expired `--tls-cert`
    /// without a word (every client then refused it). Now the listener's
    /// settings are refused, naming the file and the dates.
    #[test]
    fn a_certificate_that_is_not_valid_now_is_refused() {
        let (c, k) = cert_valid("expired", (2020, 1, 1), (2021, 1, 1));
        let e = server_config(&c, &k).unwrap_err().to_string();
        assert!(
            e.contains("expired") && e.contains("days ago") && e.contains("2021"),
            "{e}"
        );
        assert!(e.contains(&c.display().to_string()), "{e}");
        let (c, k) = cert_valid("future", (2999, 1, 1), (3000, 1, 1));
        let e = server_config(&c, &k).unwrap_err().to_string();
        assert!(e.contains("not valid for another"), "{e}");
        let (c, k) = cert_valid("valid", (2020, 1, 1), (4000, 1, 1));
        server_config(&c, &k).unwrap();
        let _ = std::fs::remove_dir_all(c.parent().unwrap());
    }
}

//! `phub-setup`'s steps (feature `setup`): the TLS CA and server
//! certificate of phub-control, the dataplane's management token file made
//! readable by the user phub-control runs as, and DPDK's hugepages and NIC
//! binding through DPDK's own tools. Each step is safe to run again: it
//! keeps what exists unless asked to replace it. `bind-nic` checks every
//! address before it changes anything.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a setup step failed; each names the file, user or tool.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Reading or writing a file failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// rcgen refused to make a key or certificate.
    #[error("making the {what}: {source}")]
    Cert {
        /// Which certificate or key.
        what: &'static str,
        /// The error.
        source: rcgen::Error,
    },
    /// The user to give a file to does not exist.
    #[error(
        "no user {0:?} in /etc/passwd (the package's postinst creates `phub`; give --owner root otherwise)"
    )]
    NoUser(String),
    /// A configuration file lacks what the step needs.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An external tool is missing or failed.
    #[error("{tool}: {message}")]
    Tool {
        /// The tool.
        tool: String,
        /// What happened and what to do.
        message: String,
    },
    /// A PCI address given to `bind-nic` is malformed, names no device,
    /// names a device that is not a NIC, or was not bound.
    #[error("PCI address {addr:?}: {message}")]
    Pci {
        /// The address as given.
        addr: String,
        /// What is wrong and what to do.
        message: String,
    },
}

/// What `phub-setup tls` writes, under one directory.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate: what workers and phubctl trust ($PHUB_CA_FILE).
    pub ca_cert: PathBuf,
    /// The CA's private key (root only; needed only to sign again).
    pub ca_key: PathBuf,
    /// phub-control's certificate (`tls-cert`).
    pub server_cert: PathBuf,
    /// phub-control's private key (`tls-key`), owned by the daemon's user.
    pub server_key: PathBuf,
}

impl TlsFiles {
    /// The four files in `dir`: ca.crt, ca.key, server.crt, server.key.
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
        }
    }
}

/// What `tls` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsOutcome {
    /// The files exist already and were kept.
    Kept,
    /// A new CA and server certificate were written.
    Made,
}

/// Makes a self-signed CA (ECDSA P-256; rcgen's validity, 1975 to 4096:
/// rotate by running it again with `force`) and a server certificate
/// it signs for `names` (DNS names or IP addresses), in `files`; keys are
/// mode 0600, the server key owned by `owner` (a user name), the CA key by
/// the caller. Keeps existing files unless `force`.
pub fn tls(
    files: &TlsFiles,
    names: &[String],
    owner: Option<&str>,
    force: bool,
) -> Result<TlsOutcome, SetupError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };
    let all = [
        &files.ca_cert,
        &files.ca_key,
        &files.server_cert,
        &files.server_key,
    ];
    if !force && all.iter().all(|p| p.exists()) {
        return Ok(TlsOutcome::Kept);
    }
    let owner = owner.map(user_ids).transpose()?;
    let cert_err = |what| move |source| SetupError::Cert { what, source };

    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA certificate"))?;
    ca.distinguished_name
        .push(DnType::CommonName, format!("phub appliance CA ({})", hostname()));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(cert_err("CA key"))?;
    let ca_cert = ca.self_signed(&ca_key).map_err(cert_err("CA certificate"))?;

    let mut server = CertificateParams::new(names.to_vec()).map_err(cert_err("server certificate"))?;
    server.distinguished_name.push(DnType::CommonName, hostname());
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let server_key = KeyPair::generate().map_err(cert_err("server key"))?;
    let server_cert = server
        .signed_by(&server_key, &ca_cert, &ca_key)
        .map_err(cert_err("server certificate"))?;

    if let Some(dir) = files.ca_cert.parent() {
        std::fs::create_dir_all(dir).map_err(|source| SetupError::Io {
            what: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    write_file(&files.ca_key, &ca_key.serialize_pem(), 0o600, None)?;
    write_file(&files.ca_cert, &ca_cert.pem(), 0o644, None)?;
    write_file(&files.server_key, &server_key.serialize_pem(), 0o600, owner)?;
    write_file(&files.server_cert, &server_cert.pem(), 0o644, None)?;
    Ok(TlsOutcome::Made)
}

/// The names a server certificate gets by default: this host's name, its
/// fully qualified name when /etc/hosts or the resolver says one (not
/// looked up here), localhost and the loopback addresses.
pub fn default_names() -> Vec<String> {
    let mut names = vec![hostname(), "localhost".into(), "127.0.0.1".into(), "::1".into()];
    names.dedup();
    names
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Writes `text` to `path` through a temporary file, with `mode` and, if
/// given, the (uid, gid) owner; replaces the file atomically.
fn write_file(path: &Path, text: &str, mode: u32, owner: Option<(u32, u32)>) -> Result<(), SetupError> {
    let io = |what| {
        move |source| SetupError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io("creating"))?;
    f.write_all(text.as_bytes()).map_err(io("writing"))?;
    f.sync_all().map_err(io("writing"))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(io("chmod"))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&tmp, Some(uid), Some(gid)).map_err(io("chown"))?;
    }
    std::fs::rename(&tmp, path).map_err(io("renaming into"))
}

/// The uid and primary gid of `user`, from /etc/passwd.
pub fn user_ids(user: &str) -> Result<(u32, u32), SetupError> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(|source| SetupError::Io {
        what: "reading",
        path: "/etc/passwd".into(),
        source,
    })?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 4 && f[0] == user)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .ok_or_else(|| SetupError::NoUser(user.to_string()))
}

/// The dataplane's `mgmt-token-file` as its configuration file sets it.
pub fn token_path_from(config: &Path) -> Result<PathBuf, SetupError> {
    let err = |message: String| SetupError::Config {
        path: config.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(config).map_err(|source| SetupError::Io {
        what: "reading",
        path: config.to_path_buf(),
        source,
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| err(e.to_string()))?;
    match table.get("mgmt-token-file") {
        Some(toml::Value::String(s)) => Ok(PathBuf::from(s)),
        Some(v) => Err(err(format!("`mgmt-token-file` = {v}: expected a path string"))),
        None => Err(err(
            "sets no `mgmt-token-file`: phub-setup token needs it to know where the dataplane and control \
             look (the packaged file sets /run/phub/dataplane-7800.token)"
                .into(),
        )),
    }
}

/// Makes the management token file `path` if missing or empty (a random
/// 64-hex-digit token, mode 0600) and gives it to `owner`, so that
/// phub-control running as that user can read it and the dataplane (root)
/// reads it too. Returns whether it made a new token.
pub fn token(path: &Path, owner: Option<&str>) -> Result<bool, SetupError> {
    let ids = owner.map(user_ids).transpose()?;
    let io = |what| {
        move |source| SetupError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    };
    let made = match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => false,
        _ => {
            let mut raw = [0u8; 32];
            let mut rng = std::fs::File::open("/dev/urandom").map_err(|source| SetupError::Io {
                what: "reading",
                path: "/dev/urandom".into(),
                source,
            })?;
            std::io::Read::read_exact(&mut rng, &mut raw).map_err(|source| SetupError::Io {
                what: "reading",
                path: "/dev/urandom".into(),
                source,
            })?;
            let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io("creating the directory of"))?;
            }
            write_file(path, &format!("{hex}\n"), 0o600, None)?;
            true
        }
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io("chmod"))?;
    if let Some((uid, gid)) = ids {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io("chown"))?;
    }
    Ok(made)
}

/// Runs one of DPDK's tools (`dpdk-hugepages.py`, `dpdk-devbind.py`,
/// from Debian's `dpdk` package), saying what it runs.
pub fn dpdk_tool(tool: &str, args: &[String]) -> Result<(), SetupError> {
    println!("phub-setup: {tool} {}", args.join(" "));
    let status = Command::new(tool)
        .args(args)
        .status()
        .map_err(|e| SetupError::Tool {
            tool: tool.to_string(),
            message: if e.kind() == std::io::ErrorKind::NotFound {
                "not found: install DPDK's tools (`apt install dpdk`)".into()
            } else {
                e.to_string()
            },
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(SetupError::Tool {
            tool: tool.to_string(),
            message: format!("failed ({status})"),
        })
    }
}

/// Where DPDK's tools (and systemd's `dev-hugepages.mount`) mount hugetlbfs.
pub const HUGEPAGES_MOUNT: &str = "/dev/hugepages";

/// Reserves `size` of hugepages of `pagesize` and mounts hugetlbfs at
/// [`HUGEPAGES_MOUNT`] with DPDK's dpdk-hugepages.py, making the mount
/// point first where nothing did (a machine without systemd's
/// `dev-hugepages.mount`: the tool does not make it, and its failed mount
/// does not fail it); then checks the mount and shows the reservation.
pub fn hugepages(size: &str, pagesize: &str) -> Result<(), SetupError> {
    let dir = Path::new(HUGEPAGES_MOUNT);
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|source| SetupError::Io {
            what: "making the hugetlbfs mount point",
            path: dir.to_path_buf(),
            source,
        })?;
        println!("phub-setup: made {HUGEPAGES_MOUNT}");
    }
    dpdk_tool(
        "dpdk-hugepages.py",
        &[
            "--pagesize".into(),
            pagesize.into(),
            "--setup".into(),
            size.into(),
        ],
    )?;
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(|source| SetupError::Io {
        what: "reading",
        path: "/proc/mounts".into(),
        source,
    })?;
    if !hugetlbfs_mounted_at(&mounts, HUGEPAGES_MOUNT) {
        return Err(SetupError::Tool {
            tool: "dpdk-hugepages.py".into(),
            message: format!(
                "the pages are reserved but hugetlbfs is not mounted at {HUGEPAGES_MOUNT} (its output \
                 above says why); mount it (`mount -t hugetlbfs nodev {HUGEPAGES_MOUNT}`) and run again"
            ),
        });
    }
    dpdk_tool("dpdk-hugepages.py", &["--show".into()])
}

/// Whether `/proc/mounts` (its text) has hugetlbfs mounted at `at`.
pub fn hugetlbfs_mounted_at(mounts: &str, at: &str) -> bool {
    mounts.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.len() > 2 && f[1] == at && f[2] == "hugetlbfs"
    })
}

/// Where the kernel lists PCI devices (`<address>/class`, `<address>/driver`).
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// The driver DPDK's backend needs the NIC bound to.
const VFIO_PCI: &str = "vfio-pci";

/// `addr` as the kernel names it (`DDDD:BB:DD.F`, lower case; the domain
/// `0000` added when left out, as dpdk-devbind.py does).
pub fn pci_address(addr: &str) -> Result<String, SetupError> {
    let bad = |why: &str| SetupError::Pci {
        addr: addr.to_string(),
        message: format!(
            "{why}: expected DDDD:BB:DD.F or BB:DD.F in hexadecimal, e.g. 0000:3b:00.0 \
             (`dpdk-devbind.py --status` lists the NICs)"
        ),
    };
    let full = match addr.matches(':').count() {
        1 => format!("0000:{addr}"),
        2 => addr.to_string(),
        _ => return Err(bad("not a PCI address")),
    }
    .to_ascii_lowercase();
    let (rest, function) = full.split_once('.').ok_or_else(|| bad("no function (.F)"))?;
    let parts: Vec<&str> = rest.split(':').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let function_ok = function.len() == 1 && matches!(function.as_bytes()[0], b'0'..=b'7');
    if !(hex(parts[0], 4) && hex(parts[1], 2) && hex(parts[2], 2) && function_ok) {
        return Err(bad("not a PCI address"));
    }
    Ok(full)
}

/// The driver `addr` (a normalised address) is bound to under `devices`
/// ([`PCI_DEVICES`]), if any.
pub fn pci_driver(devices: &Path, addr: &str) -> Option<String> {
    let link = std::fs::read_link(devices.join(addr).join("driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// Checks that `addr` names a network controller (PCI class 0x02) under
/// `devices` ([`PCI_DEVICES`]), and returns its normalised address.
pub fn check_nic(devices: &Path, addr: &str) -> Result<String, SetupError> {
    let full = pci_address(addr)?;
    let class_file = devices.join(&full).join("class");
    let class = std::fs::read_to_string(&class_file).map_err(|e| SetupError::Pci {
        addr: addr.to_string(),
        message: if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "no such PCI device on this machine ({} does not exist); \
                 `dpdk-devbind.py --status` lists the NICs",
                devices.join(&full).display()
            )
        } else {
            format!("cannot read {}: {e}", class_file.display())
        },
    })?;
    let class = class.trim();
    if !class.starts_with("0x02") {
        return Err(SetupError::Pci {
            addr: addr.to_string(),
            message: format!(
                "not a network controller (PCI class {class}, a NIC's is 0x02....); \
                 `dpdk-devbind.py --status` lists the NICs"
            ),
        });
    }
    Ok(full)
}

/// `phub-setup bind-nic`: binds the NICs at `pci` to vfio-pci with DPDK's
/// dpdk-devbind.py. Every address is checked first (a NIC under
/// [`PCI_DEVICES`]), so that a wrong one changes nothing; vfio-pci is
/// loaded only when it is not already; NICs on vfio-pci already are left
/// as they are; afterwards each must be on vfio-pci (dpdk-devbind.py
/// skips, with a warning, an interface that is up with routes).
pub fn bind_nic(pci: &[String]) -> Result<(), SetupError> {
    let devices = Path::new(PCI_DEVICES);
    let nics = pci
        .iter()
        .map(|a| check_nic(devices, a))
        .collect::<Result<Vec<_>, _>>()?;
    let todo: Vec<String> = nics
        .iter()
        .filter(|a| pci_driver(devices, a).as_deref() != Some(VFIO_PCI))
        .cloned()
        .collect();
    if todo.is_empty() {
        println!("phub-setup: {} on {VFIO_PCI} already", nics.join(", "));
        return Ok(());
    }
    if !Path::new("/sys/bus/pci/drivers").join(VFIO_PCI).exists() {
        dpdk_tool("modprobe", &[VFIO_PCI.into()])?;
    }
    let mut args = vec![format!("--bind={VFIO_PCI}")];
    args.extend(todo.iter().cloned());
    dpdk_tool("dpdk-devbind.py", &args)?;
    for a in &todo {
        let now = pci_driver(devices, a);
        if now.as_deref() != Some(VFIO_PCI) {
            return Err(SetupError::Pci {
                addr: a.clone(),
                message: format!(
                    "still on {} after dpdk-devbind.py: it leaves an interface that is up \
                     with routes (the management interface?) as it is; if this NIC is not \
                     that one, `ip link set <if> down` and run again",
                    now.as_deref().unwrap_or("no driver")
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_checked_before_anything_is_bound() {
        assert_eq!(pci_address("0000:3B:00.0").unwrap(), "0000:3b:00.0");
        assert_eq!(pci_address("3b:00.1").unwrap(), "0000:3b:00.1");
        for bad in [
            "eth0",
            "3b:00",
            "0000:3b:00.8",
            "00:3b:00.0",
            "0000:3g:00.0",
            "a:b:c:d.0",
            "",
        ] {
            let e = pci_address(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("DDDD:BB:DD.F"),
                "{e}"
            );
        }
        // A fake sysfs: a NIC, a host bridge, and nothing else.
        let dir = std::env::temp_dir().join(format!("phub-setup-pci-{}", std::process::id()));
        for (addr, class) in [("0000:3b:00.0", "0x020000"), ("0000:00:00.0", "0x060000")] {
            std::fs::create_dir_all(dir.join(addr)).unwrap();
            std::fs::write(dir.join(addr).join("class"), format!("{class}\n")).unwrap();
        }
        assert_eq!(check_nic(&dir, "3b:00.0").unwrap(), "0000:3b:00.0");
        assert_eq!(pci_driver(&dir, "0000:3b:00.0"), None);
        let e = check_nic(&dir, "0000:00:00.0").unwrap_err().to_string();
        assert!(
            e.contains("not a network controller") && e.contains("0x060000"),
            "{e}"
        );
        let e = check_nic(&dir, "0000:ff:1f.7").unwrap_err().to_string();
        assert!(
            e.contains("no such PCI device") && e.contains("0000:ff:1f.7"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_ca_signs_a_server_certificate_and_keys_are_owner_only() {
        let dir = std::env::temp_dir().join(format!("phub-setup-test-{}", std::process::id()));
        let files = TlsFiles::in_dir(&dir);
        assert_eq!(
            tls(&files, &default_names(), None, false).unwrap(),
            TlsOutcome::Made
        );
        let before = std::fs::read_to_string(&files.server_cert).unwrap();
        assert!(before.contains("BEGIN CERTIFICATE"));
        for key in [&files.ca_key, &files.server_key] {
            let mode = std::fs::metadata(key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
        // Kept unless forced.
        assert_eq!(
            tls(&files, &default_names(), None, false).unwrap(),
            TlsOutcome::Kept
        );
        assert_eq!(std::fs::read_to_string(&files.server_cert).unwrap(), before);
        assert_eq!(
            tls(&files, &default_names(), None, true).unwrap(),
            TlsOutcome::Made
        );
        assert_ne!(std::fs::read_to_string(&files.server_cert).unwrap(), before);
        // Tokens: made once, kept after.
        let t = dir.join("run/dataplane-7800.token");
        assert!(token(&t, None).unwrap());
        let first = std::fs::read_to_string(&t).unwrap();
        assert_eq!(first.trim().len(), 64);
        assert!(!token(&t, None).unwrap());
        assert_eq!(std::fs::read_to_string(&t).unwrap(), first);
        assert!(matches!(
            token(&t, Some("no-such-user-phub")),
            Err(SetupError::NoUser(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

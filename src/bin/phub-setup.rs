//! phub-setup: the one-time steps of an installed appliance (see
//! `phub_appliance::setup` and docs/OPERATING.md): `tls`, `token`,
//! `hugepages`, `bind-nic`. The package runs `tls` at install time and the
//! dataplane's unit runs `token` before each start.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use phub_appliance::setup::{self, TlsFiles, TlsOutcome};

/// phub-setup: one-time steps of a phub appliance.
#[derive(Debug, Parser)]
#[command(name = "phub-setup", version)]
struct Args {
    #[command(subcommand)]
    step: Step,
}

#[derive(Debug, Subcommand)]
enum Step {
    /// Make phub-control's TLS files: a self-signed CA (ca.crt, ca.key) and
    /// a server certificate it signs (server.crt, server.key). Existing
    /// files are kept unless --force. Give workers and phubctl ca.crt
    /// ($PHUB_CA_FILE).
    Tls {
        /// Directory of the four files.
        #[arg(long, default_value = "/etc/phub/tls")]
        dir: PathBuf,
        /// A DNS name or IP address workers use to reach control (repeat
        /// for several); added to this host's name, localhost, 127.0.0.1
        /// and ::1.
        #[arg(long)]
        san: Vec<String>,
        /// The user that gets server.key (the user phub-control runs as).
        #[arg(long, default_value = "phub")]
        owner: String,
        /// Replace existing files (a new CA: workers need the new ca.crt).
        #[arg(long)]
        force: bool,
    },
    /// Make the dataplane's management token file (where the dataplane's
    /// configuration file's `mgmt-token-file` says) if missing, owned by
    /// the user phub-control runs as, mode 0600.
    Token {
        /// The dataplane's configuration file.
        #[arg(long, default_value = "/etc/phub/dataplane.toml")]
        config: PathBuf,
        /// The user that gets the file.
        #[arg(long, default_value = "phub")]
        owner: String,
    },
    /// Reserve hugepages for the DPDK backend with DPDK's
    /// dpdk-hugepages.py (mounts hugetlbfs at /dev/hugepages).
    Hugepages {
        /// Total memory to reserve, e.g. 2G or 8G.
        #[arg(default_value = "2G")]
        size: String,
        /// Page size, e.g. 2M or 1G.
        #[arg(long, default_value = "2M")]
        pagesize: String,
    },
    /// Bind NICs to vfio-pci for the DPDK backend with DPDK's
    /// dpdk-devbind.py (loads the vfio-pci module first). Each address
    /// must name a NIC on this machine, or nothing is changed. The NIC
    /// leaves the kernel: never bind the management interface.
    BindNic {
        /// PCI addresses, e.g. 0000:3b:00.0 (`dpdk-devbind.py --status`
        /// lists them).
        #[arg(required = true)]
        pci: Vec<String>,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    let r: Result<(), Box<dyn std::error::Error>> = (|| {
        match args.step {
            Step::Tls {
                dir,
                san,
                owner,
                force,
            } => {
                let files = TlsFiles::in_dir(&dir);
                let mut names = setup::default_names();
                names.extend(san);
                match setup::tls(&files, &names, Some(&owner), force)? {
                    TlsOutcome::Kept => println!(
                        "phub-setup: {} holds a CA and server certificate already; kept (--force replaces them)",
                        dir.display()
                    ),
                    TlsOutcome::Made => println!(
                        "phub-setup: made a CA ({}) and a server certificate for {} ({}, key owned by {owner}); \
                         workers and phubctl trust it with PHUB_CA_FILE={}",
                        files.ca_cert.display(),
                        names.join(", "),
                        files.server_cert.display(),
                        files.ca_cert.display()
                    ),
                }
            }
            Step::Token { config, owner } => {
                let path = setup::token_path_from(&config)?;
                if setup::token(&path, Some(&owner))? {
                    println!(
                        "phub-setup: made the management token {} (owner {owner})",
                        path.display()
                    );
                }
            }
            Step::Hugepages { size, pagesize } => setup::hugepages(&size, &pagesize)?,
            Step::BindNic { pci } => setup::bind_nic(&pci)?,
        }
        Ok(())
    })();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phub-setup: {e}");
            ExitCode::FAILURE
        }
    }
}

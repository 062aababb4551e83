//! The Environment Abstraction Layer: initialised once per process with the
//! arguments the operator passed through, never again (DPDK cannot), and
//! cleaned up once at the very end.
//!
//! The thread that initialises the EAL becomes its main lcore; EAL pins it
//! to the main lcore's CPUs, and threads started from it afterwards inherit
//! that set.

use std::ffi::{c_char, CString};
use std::sync::Mutex;

use crate::error::{strerror, Error};
use crate::ring::Ring;
use crate::{sys, Result};

/// What became of the one `rte_eal_init` of this process.
enum State {
    Uninit,
    Up(Vec<String>),
    Failed(Error),
    Cleaned,
}

static STATE: Mutex<State> = Mutex::new(State::Uninit);

/// Rings handed to ports made with [`Eal::port_from_rings`]: such a port
/// reads and writes them for as long as the process runs, so they are kept
/// alive here and never freed.
static RING_PORT_RINGS: Mutex<Vec<Ring>> = Mutex::new(Vec::new());

/// Proof that the EAL is initialised: every constructor of a DPDK object
/// takes one. `Copy`; valid until [`cleanup`].
#[derive(Debug, Clone, Copy)]
pub struct Eal(());

/// EAL options under which the EAL writes nothing in its runtime directory
/// (no other process can join it).
const NO_SHARED_CONFIG: &[&str] = &["--no-shconf", "--in-memory"];

/// EAL options under which no hugepage file outlives the process.
pub const NO_HUGEPAGE_FILES: &[&str] = &["--no-huge", "--in-memory", "--huge-unlink"];

/// EAL arguments for a process that runs on its own, as tests and
/// benchmarks do: no hugepages (`megabytes` of ordinary memory instead), no
/// PCI devices, no shared configuration or telemetry, warnings only, its
/// files under `prefix`, and `lcores` in EAL's `--lcores` syntax.
pub fn standalone_args(prefix: &str, megabytes: u32, lcores: &str) -> Vec<String> {
    let mb = megabytes.to_string();
    [
        "--no-huge",
        "-m",
        &mb,
        "--no-pci",
        "--no-shconf",
        "--no-telemetry",
        "--file-prefix",
        prefix,
        "--lcores",
        lcores,
        "--log-level",
        "warning",
    ]
    .map(String::from)
    .to_vec()
}

/// Whether `args` (EAL arguments) hold any of the options `names`, alone
/// or as `name=value`.
pub fn has_option(args: &[String], names: &[&str]) -> bool {
    args.iter()
        .any(|a| names.iter().any(|n| a == n || a.starts_with(&format!("{n}="))))
}

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Initialises the EAL with `args` (what would follow the program name on a
/// DPDK application's command line), or returns the EAL that is already up.
/// When it is already up with other arguments, those stay in force (DPDK
/// cannot initialise twice) and this is logged. A failed initialisation is
/// final for the process and is returned again on every later call.
pub fn init<S: AsRef<str>>(args: &[S]) -> Result<Eal> {
    let args: Vec<String> = args.iter().map(|a| a.as_ref().to_string()).collect();
    let mut st = state();
    match &*st {
        State::Up(prev) => {
            if *prev != args {
                log::info!("DPDK EAL already initialised with {prev:?}; not re-initialising with {args:?}");
            }
            return Ok(Eal(()));
        }
        State::Failed(e) => return Err(e.clone()),
        State::Cleaned => return Err(Error::NoEal),
        State::Uninit => {}
    }
    let mut owned = Vec::with_capacity(args.len() + 1);
    for a in std::iter::once("phub").chain(args.iter().map(String::as_str)) {
        match CString::new(a) {
            Ok(c) => owned.push(c),
            Err(_) => return Err(Error::Invalid(format!("EAL argument {a:?} contains a NUL byte"))),
        }
    }
    // EAL may keep pointers into argv (it permutes it with getopt and keeps
    // some option values): the strings and the array live for the process.
    let strings: &'static mut [CString] = Vec::leak(owned);
    let argv: &'static mut [*mut c_char] = Vec::leak(
        strings
            .iter_mut()
            .map(|c| c.as_ptr() as *mut c_char)
            .chain(std::iter::once(std::ptr::null_mut()))
            .collect(),
    );
    let argc = i32::try_from(argv.len() - 1)
        .map_err(|_| Error::Invalid(format!("{} EAL arguments: at most {}", argv.len() - 1, i32::MAX)))?;
    // SAFETY: argv holds argc valid NUL-terminated strings followed by a
    // NULL, all leaked ('static); STATE's lock makes this the only call of
    // rte_eal_init in the process.
    let rc = unsafe { sys::rte_eal_init(argc, argv.as_mut_ptr()) };
    if rc < 0 {
        // SAFETY: reads this thread's rte_errno.
        let code = unsafe { sys::phub_errno() };
        let e = Error::EalInit {
            args,
            reason: strerror(code),
        };
        *st = State::Failed(e.clone());
        return Err(e);
    }
    log::info!("DPDK {} EAL up with {args:?}", crate::DPDK_VERSION);
    // Without shared config (--no-shconf, --in-memory) EAL writes nothing in
    // its runtime directory: remove it now so none is left behind, even if
    // the process never gets to cleanup().
    if has_option(&args, NO_SHARED_CONFIG) {
        remove_runtime_dir();
    }
    *st = State::Up(args);
    Ok(Eal(()))
}

/// The arguments the EAL was initialised with, if it is up.
pub fn args() -> Option<Vec<String>> {
    match &*state() {
        State::Up(a) => Some(a.clone()),
        _ => None,
    }
}

/// The EAL, if it is initialised (and not cleaned up).
pub fn get() -> Option<Eal> {
    matches!(&*state(), State::Up(_)).then_some(Eal(()))
}

/// Releases the EAL's resources (hugepage files, shared config, driver
/// state). Does nothing when the EAL was never initialised.
///
/// A primary whose runtime other processes could join (shared config, no
/// `--in-memory`) leaves its config and memory maps in the runtime
/// directory, and (with hugepages, without `--huge-unlink`) its hugepage
/// files, after rte_eal_cleanup; it is leaving, and no other primary can
/// hold the same prefix, so they go too (a secondary still attached keeps
/// its mappings). Otherwise the directory goes only if empty (it may be
/// another process's), and a secondary leaves the files to its primary.
///
/// # Safety
///
/// No DPDK object of this process may be used during or after the call:
/// every port, queue, pool, ring and mbuf is dropped, and no lcore is
/// running a launched function. Later calls to [`init`] fail.
pub unsafe fn cleanup() -> Result<()> {
    let mut st = state();
    let State::Up(args) = &*st else {
        return Ok(());
    };
    let primary = Eal(()).is_primary();
    let joinable = primary && !has_option(args, NO_SHARED_CONFIG);
    let leftovers = if primary {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        hugepage_files(args, &mounts)
    } else {
        Vec::new()
    };
    *st = State::Cleaned;
    let dir = runtime_dir();
    // SAFETY: the EAL is up, and the caller guarantees nothing uses it any
    // more.
    let rc = unsafe { sys::rte_eal_cleanup() };
    if let Some(d) = dir {
        // The telemetry socket is unlinked only at process exit; this
        // process is done with it. Then the directory, only if empty: one
        // still holding files is another process's (same --file-prefix).
        if let Ok(entries) = std::fs::read_dir(&d) {
            use std::os::unix::fs::FileTypeExt;
            for e in entries.flatten() {
                let name = e.file_name();
                let telemetry = name.to_string_lossy().starts_with("dpdk_telemetry");
                if telemetry && e.file_type().is_ok_and(|t| t.is_socket()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let removed = if joinable {
            std::fs::remove_dir_all(&d)
        } else {
            std::fs::remove_dir(&d)
        };
        if let Err(e) = removed {
            log::debug!("EAL runtime directory {}: {e}", d.display());
        }
    }
    for f in leftovers {
        if let Err(e) = std::fs::remove_file(&f) {
            log::warn!("hugepage file {}: {e}", f.display());
        }
    }
    if rc < 0 {
        return Err(Error::call("rte_eal_cleanup", rc));
    }
    Ok(())
}

/// The hugepage files the EAL started with `args` leaves behind, given the
/// system's mount table: none under [`NO_HUGEPAGE_FILES`]; otherwise
/// `<dir>/<file-prefix>map_*` in `--huge-dir` or every hugetlbfs mount.
fn hugepage_files(args: &[String], mounts: &str) -> Vec<std::path::PathBuf> {
    if has_option(args, NO_HUGEPAGE_FILES) {
        return Vec::new();
    }
    let value = |name: &str| {
        args.iter().enumerate().find_map(|(i, a)| {
            a.strip_prefix(&format!("{name}="))
                .map(str::to_string)
                .or_else(|| (a == name).then(|| args.get(i + 1).cloned()).flatten())
        })
    };
    let prefix = value("--file-prefix").unwrap_or_else(|| "rte".into());
    let dirs: Vec<String> = match value("--huge-dir") {
        Some(d) => vec![d],
        None => mounts
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() > 2 && f[2] == "hugetlbfs").then(|| f[1].to_string())
            })
            .collect(),
    };
    let lead = format!("{prefix}map_");
    dirs.iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|rd| rd.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&lead))
        .map(|e| e.path())
        .collect()
}

/// The EAL's runtime directory (`/var/run/dpdk/<file-prefix>` as root).
fn runtime_dir() -> Option<std::path::PathBuf> {
    // SAFETY: returns a pointer to a static NUL-terminated string inside
    // EAL's configuration, valid while the EAL is up (callers hold STATE).
    let p = unsafe { sys::rte_eal_get_runtime_dir() };
    if p.is_null() {
        return None;
    }
    // SAFETY: as above; copied at once.
    let s = unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned();
    (!s.is_empty()).then(|| s.into())
}

fn remove_runtime_dir() {
    if let Some(d) = runtime_dir() {
        if let Err(e) = std::fs::remove_dir(&d) {
            log::debug!("EAL runtime directory {}: {e}", d.display());
        }
    }
}

impl Eal {
    /// Whether this process is its DPDK runtime's primary (not a secondary
    /// attached to another process's memory).
    pub fn is_primary(self) -> bool {
        // SAFETY: the EAL is up (self proves it); a plain read of its
        // configuration.
        unsafe { sys::rte_eal_process_type() == sys::RTE_PROC_PRIMARY }
    }

    /// The main lcore (the thread that initialised the EAL).
    pub fn main_lcore(self) -> u32 {
        // SAFETY: the EAL is up (self proves it).
        unsafe { sys::rte_get_main_lcore() }
    }

    /// Every enabled lcore other than the main one, in id order: where
    /// functions can be launched.
    pub fn worker_lcores(self) -> Vec<u32> {
        let main = self.main_lcore();
        (0..sys::RTE_MAX_LCORE)
            // SAFETY: the EAL is up; any id below RTE_MAX_LCORE is accepted.
            .filter(|&l| l != main && unsafe { sys::rte_lcore_is_enabled(l) } != 0)
            .collect()
    }

    /// The NUMA socket of an lcore.
    pub fn lcore_socket(self, lcore: u32) -> u32 {
        // SAFETY: the EAL is up; out-of-range ids return an error value.
        unsafe { sys::rte_lcore_to_socket_id(lcore) }
    }

    /// Whether the EAL runs on hugepages (false with `--no-huge`: its heap
    /// is then the fixed `-m` area of normal memory).
    pub fn has_hugepages(self) -> bool {
        // SAFETY: the EAL is up.
        unsafe { sys::rte_eal_has_hugepages() != 0 }
    }

    /// Number of ports the EAL found (PCI devices and `--vdev`s).
    pub fn port_count(self) -> u16 {
        // SAFETY: the EAL is up.
        unsafe { sys::rte_eth_dev_count_avail() }
    }

    /// Whether `port` names a port.
    pub fn port_exists(self, port: u16) -> bool {
        // SAFETY: the EAL is up; any id is accepted.
        unsafe { sys::rte_eth_dev_is_valid_port(port) != 0 }
    }

    /// The id of the port with this device name (e.g. `net_af_packet0`).
    pub fn port_by_name(self, name: &str) -> Option<u16> {
        let c = CString::new(name).ok()?;
        let mut id = 0u16;
        // SAFETY: c is NUL-terminated and id a valid out pointer.
        let rc = unsafe { sys::rte_eth_dev_get_port_by_name(c.as_ptr(), &mut id) };
        (rc == 0).then_some(id)
    }

    /// Makes a port whose RX queue i reads `rx[i]` and whose TX queue i
    /// writes `tx[i]` (the ring PMD): a test injects frames into a chosen RX
    /// queue and reads what the port sends. The rings are kept alive for
    /// the rest of the process.
    pub fn port_from_rings(self, name: &str, rx: &[Ring], tx: &[Ring], socket: u32) -> Result<u16> {
        let c = CString::new(name).map_err(|_| Error::Invalid(format!("port name {name:?} contains NUL")))?;
        let rxp: Vec<*mut sys::rte_ring> = rx.iter().map(Ring::as_ptr).collect();
        let txp: Vec<*mut sys::rte_ring> = tx.iter().map(Ring::as_ptr).collect();
        let count = |n: usize| {
            u32::try_from(n)
                .map_err(|_| Error::Invalid(format!("port {name}: {n} rings, at most {}", u32::MAX)))
        };
        let (nrx, ntx) = (count(rxp.len())?, count(txp.len())?);
        // SAFETY: the ring pointers are live rings (kept alive for the
        // process just below); the arrays hold the stated counts.
        let rc = unsafe { sys::rte_eth_from_rings(c.as_ptr(), rxp.as_ptr(), nrx, txp.as_ptr(), ntx, socket) };
        let Ok(id) = u16::try_from(rc) else {
            return Err(Error::call(format!("rte_eth_from_rings({name})"), 0));
        };
        let mut keep = RING_PORT_RINGS.lock().unwrap_or_else(|p| p.into_inner());
        keep.extend(rx.iter().cloned());
        keep.extend(tx.iter().cloned());
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugepage_files_left_behind_are_the_prefixs_own() {
        let dir = std::env::temp_dir().join(format!("phub-huge-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["dpmap_0", "dpmap_12", "othermap_0", "dp_other"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let mounts = format!(
            "proc /proc proc rw 0 0\nnodev {} hugetlbfs rw 0 0\n",
            dir.display()
        );
        let args = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        let mut got = hugepage_files(&args("--no-pci --file-prefix dp"), &mounts);
        got.sort();
        assert_eq!(got, [dir.join("dpmap_0"), dir.join("dpmap_12")]);
        assert_eq!(
            hugepage_files(&args("--file-prefix=other"), &mounts),
            [dir.join("othermap_0")]
        );
        let explicit = format!("--file-prefix dp --huge-dir {}", dir.display());
        assert_eq!(
            hugepage_files(&args(&explicit), "").len(),
            2,
            "--huge-dir without a mount table"
        );
        for kept in ["--no-huge", "--in-memory", "--huge-unlink"] {
            assert!(hugepage_files(&args(&format!("--file-prefix dp {kept}")), &mounts).is_empty());
        }
        assert!(
            hugepage_files(&args("--file-prefix dp"), "").is_empty(),
            "no hugetlbfs mounted"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

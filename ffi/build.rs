//! Finds DPDK with pkg-config, generates bindings with bindgen (named
//! allowlists only) and compiles the C shim for DPDK's static inline
//! functions. Writes only to OUT_DIR. Links dynamically: EAL then loads its
//! drivers from the distribution's driver directory by itself.

use std::path::PathBuf;
use std::process::{exit, Command};

const PACKAGE_HINT: &str = "install the Debian/Ubuntu package `libdpdk-dev` (tools/setup.sh does)";

fn pkg_config(args: &[&str]) -> Option<String> {
    let prog = std::env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let out = Command::new(prog).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Stops the build with one line saying what to install.
fn fail(line: &str) -> ! {
    eprintln!("{line}");
    exit(1);
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=shim.h");
    println!("cargo:rerun-if-changed=shim.c");
    for v in [
        "PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
        "PKG_CONFIG_SYSROOT_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    if pkg_config(&["--version"]).is_none() {
        fail("phub-ffi: pkg-config not found: install the package `pkg-config` and `libdpdk-dev` (tools/setup.sh does)");
    }
    if pkg_config(&["--exists", "libdpdk"]).is_none() {
        fail(&format!(
            "phub-ffi: DPDK not found by pkg-config (libdpdk): {PACKAGE_HINT}"
        ));
    }
    if pkg_config(&["--atleast-version=22.11", "libdpdk"]).is_none() {
        let v = pkg_config(&["--modversion", "libdpdk"]).unwrap_or_default();
        fail(&format!(
            "phub-ffi: DPDK {v} is too old (22.11 or newer needed): {PACKAGE_HINT}"
        ));
    }
    let version = pkg_config(&["--modversion", "libdpdk"]).unwrap_or_default();
    let cflags = pkg_config(&["--cflags", "libdpdk"]).unwrap_or_default();
    let libs = pkg_config(&["--libs", "libdpdk"]).unwrap_or_default();
    let cflags: Vec<&str> = cflags.split_whitespace().collect();
    println!("cargo:rustc-env=PHUB_DPDK_VERSION={version}");
    println!("cargo:version={version}");

    // Link: every -L and -l pkg-config names (rustc links --as-needed, so
    // only the libraries actually used stay), plus the ring PMD, whose
    // rte_eth_from_rings builds test ports out of rings.
    for tok in libs.split_whitespace() {
        if let Some(dir) = tok.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        } else if let Some(lib) = tok.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
    println!("cargo:rustc-link-lib=dylib=rte_net_ring");

    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    let mut cc = cc::Build::new();
    cc.file("shim.c").include(".").warnings(true).opt_level(2);
    for f in &cflags {
        cc.flag(f);
    }
    cc.out_dir(&out).compile("phub_shim");

    // bindgen panics when libclang is missing: turn that into one line.
    std::panic::set_hook(Box::new(|_| {}));
    let generated = std::panic::catch_unwind(|| bindings(&cflags));
    let _ = std::panic::take_hook();
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => fail(&format!("phub-ffi: bindgen failed on the DPDK {version} headers: {e}")),
        Err(_) => fail("phub-ffi: bindgen could not load libclang: install the package `libclang-dev` (tools/setup.sh does)"),
    };
    bindings
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("phub-ffi: writing bindings: {e}")));
}

fn bindings(cflags: &[&str]) -> Result<bindgen::Bindings, bindgen::BindgenError> {
    let functions = [
        // EAL, lcores, errors.
        "rte_eal_init",
        "rte_eal_cleanup",
        "rte_eal_remote_launch",
        "rte_eal_wait_lcore",
        "rte_lcore_count",
        "rte_get_main_lcore",
        "rte_lcore_is_enabled",
        "rte_lcore_to_socket_id",
        "rte_socket_id",
        "rte_strerror",
        "rte_eal_get_runtime_dir",
        "rte_eal_process_type",
        // Ports.
        "rte_eth_dev_count_avail",
        "rte_eth_dev_is_valid_port",
        "rte_eth_dev_get_port_by_name",
        "rte_eth_dev_get_name_by_port",
        "rte_eth_dev_info_get",
        "rte_eth_dev_configure",
        "rte_eth_dev_adjust_nb_rx_tx_desc",
        "rte_eth_rx_queue_setup",
        "rte_eth_tx_queue_setup",
        "rte_eth_dev_start",
        "rte_eth_dev_stop",
        "rte_eth_dev_close",
        "rte_eth_dev_socket_id",
        "rte_eth_dev_get_mtu",
        "rte_eth_macaddr_get",
        "rte_eth_promiscuous_enable",
        "rte_eth_stats_get",
        "rte_eth_from_rings",
        "rte_flow_flush",
        // Memory.
        "rte_pktmbuf_pool_create",
        "rte_mempool_free",
        "rte_mempool_avail_count",
        "rte_mempool_in_use_count",
        "rte_pktmbuf_free_bulk",
        "rte_ring_create",
        "rte_ring_free",
        "rte_ring_lookup",
        "rte_malloc_socket",
        "rte_zmalloc_socket",
        "rte_free",
        "rte_malloc_get_socket_stats",
        "rte_eal_has_hugepages",
        // The shim.
        "phub_.*",
    ];
    let types = [
        "rte_mbuf",
        "rte_eth_conf",
        "rte_eth_dev_info",
        "rte_eth_rxconf",
        "rte_eth_txconf",
        "rte_eth_stats",
        "rte_ether_addr",
        "rte_flow_error",
        "rte_malloc_socket_stats",
    ];
    let vars = [
        "RTE_MAX_LCORE",
        "RTE_MAX_ETHPORTS",
        "RTE_PKTMBUF_HEADROOM",
        "RTE_MBUF_DEFAULT_BUF_SIZE",
        "SOCKET_ID_ANY",
        "RING_F_.*",
        "RTE_ETHDEV_QUEUE_STAT_CNTRS",
        "RTE_MBUF_F_INDIRECT",
        "RTE_MBUF_F_EXTERNAL",
    ];
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_args(cflags.iter().copied())
        .clang_arg("-I.")
        .use_core()
        .layout_tests(false)
        .generate_comments(false)
        .derive_default(true)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        // Unused, and its bitfield layout trips bindgen.
        .opaque_type("rte_gtp_psc_generic_hdr")
        .opaque_type("rte_mempool")
        .opaque_type("rte_ring")
        .opaque_type("rte_flow")
        .allowlist_type("rte_eth_rx_mq_mode")
        .allowlist_type("rte_eth_tx_mq_mode");
    for f in functions {
        b = b.allowlist_function(f);
    }
    for t in types {
        b = b.allowlist_type(t);
    }
    for v in vars {
        b = b.allowlist_var(v);
    }
    b.generate()
}

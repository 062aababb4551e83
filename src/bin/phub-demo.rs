//! `phub-demo`: train a small model through a local appliance (see `phub_tools::demo`).
fn main() -> std::process::ExitCode {
    phub_tools::demo::main()
}

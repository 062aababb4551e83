//! phubctl: the operator's CLI over phub-control (see `phub_control::cli`).

fn main() -> std::process::ExitCode {
    phub_control::cli::main()
}

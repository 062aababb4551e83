//! phub-control: the appliance's control daemon (see `phub_control::daemon`).

fn main() -> std::process::ExitCode {
    phub_control::daemon::main()
}

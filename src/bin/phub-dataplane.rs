//! `phub-dataplane`: the appliance's data path (see `phub_dataplane::app`).
fn main() -> std::process::ExitCode {
    phub_dataplane::app::main(&phub::build_info())
}

//! The `narsil` command: see `narsil --help`.

fn main() -> std::process::ExitCode {
    narsil::cli::main()
}

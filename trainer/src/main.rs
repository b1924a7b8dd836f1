//! `trainer`: parse the command line, then run as launcher, worker or tool. No logic here.

fn main() -> std::process::ExitCode {
    trainer::cli::main()
}

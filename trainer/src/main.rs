//! `trainer`: parse the command line, then run as launcher, worker or tool. No logic here.

/// An allocation failure is a one-line error, not an abort.
#[global_allocator]
static ALLOC: trainer::alloc::ReportingAllocator = trainer::alloc::ReportingAllocator;

fn main() -> std::process::ExitCode {
    trainer::cli::main()
}

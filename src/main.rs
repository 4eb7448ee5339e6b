//! The `narsil` command: see `narsil --help`.

// mimalloc keeps freed pages for reuse: fused batches allocate buffers of
// hundreds of KiB, which glibc malloc would map and unmap (page faults) each time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    narsil::cli::main()
}

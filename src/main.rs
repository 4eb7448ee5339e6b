//! The `narsil` command: see `narsil --help`.

// mimalloc keeps freed pages for reuse: fused batches allocate buffers of
// hundreds of KiB, which glibc malloc would map and unmap (page faults) each time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    huge_pages_for_libtorch();
    narsil::cli::main()
}

/// libtorch puts its allocations of 2 MiB and more on transparent huge pages
/// when `THP_MEM_ALLOC_ENABLE=1` (read once, at its first allocation). The
/// embedding tables are read at random rows, so 4 KiB pages cost a TLB miss
/// per lookup: on the default DLRM huge pages made bf16 forwards 1.2-1.5x
/// faster (REPORTS.md). Set here, before any thread exists, unless the
/// operator chose otherwise (`THP_MEM_ALLOC_ENABLE=0` turns it off). Needs
/// the kernel's transparent huge pages set to `madvise` or `always`.
fn huge_pages_for_libtorch() {
    if std::env::var_os("THP_MEM_ALLOC_ENABLE").is_none() {
        std::env::set_var("THP_MEM_ALLOC_ENABLE", "1");
    }
}

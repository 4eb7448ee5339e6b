//! The `narsil` command: see `narsil --help`.

// mimalloc keeps freed pages for reuse: fused batches allocate buffers of
// hundreds of KiB, which glibc malloc would map and unmap (page faults) each time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    huge_pages_for_libtorch();
    bounded_malloc_arenas();
    // mimalloc returns the pages it keeps for reuse lazily, when the thread
    // that freed them allocates again; after a batch of tens of MiB (a
    // request with millions of ids) that could leave them resident for a
    // long time. A forced collect hands them back at once (REPORTS.md).
    // SAFETY: mi_collect only walks mimalloc's own structures.
    narsil_engine::on_large_free(|| unsafe { libmimalloc_sys::mi_collect(true) });
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

/// libtorch allocates through glibc's malloc, which gives each new thread
/// its own arena (up to 8 per core) and keeps what an arena once held. Every
/// model version has its own lane threads, and a lane's forward may run on
/// an OpenMP team, so reloads would keep adding arenas: with two threads per
/// idle forward, ten version switches grew resident memory by 7 MiB each.
/// One arena per core bounds that (flat after a few switches). An operator's
/// `MALLOC_ARENA_MAX` wins.
fn bounded_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: mallopt only sets a glibc tuning value, before any thread exists.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, cores as libc::c_int) };
    }
}

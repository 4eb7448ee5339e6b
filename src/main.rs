//! The `narsil` command: see `narsil --help`.
//!
//! `main` sets the environment of libraries that read it once (libtorch,
//! MKL, glibc's malloc) first, before Narsil starts any thread: changing
//! the environment is sound only while no other thread can read it.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

// mimalloc keeps freed pages for reuse: fused batches allocate buffers of
// hundreds of KiB, which glibc malloc would map and unmap (page faults) each time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // These four run before anything starts a thread (see the crate docs).
    huge_pages_for_libtorch();
    no_mkl_buffers_per_thread();
    bounded_malloc_arenas();
    reused_large_blocks_for_libtorch();
    narsil_engine::on_freed_memory(release_freed_memory);
    narsil::cli::main()
}

/// Hands freed memory back to the OS, after a very large batch and after a
/// model version stopped. mimalloc (Rust's allocations) returns the pages it
/// keeps for reuse lazily, when the thread that freed them allocates again;
/// after a batch of tens of MiB (a request with millions of ids) that could
/// leave them resident for a long time, and a forced collect hands them back
/// at once (REPORTS.md#memory-bound-flood). glibc's malloc (libtorch's weights and activations)
/// keeps the free pages inside its heap until asked: `malloc_trim` returns
/// them, so a retired version's weights leave the resident set
/// (REPORTS.md#memory-on-reload).
fn release_freed_memory() {
    // SAFETY: mi_collect takes no pointer and only walks mimalloc's own
    // structures, under mimalloc's own synchronisation; any thread may call it.
    unsafe { libmimalloc_sys::mi_collect(true) };
    // SAFETY: malloc_trim takes no pointer, takes each arena's lock and only
    // releases pages that hold no allocation; any thread may call it.
    unsafe { libc::malloc_trim(0) };
}

/// libtorch puts its allocations of 2 MiB and more on transparent huge pages
/// when `THP_MEM_ALLOC_ENABLE=1` (read once, at its first allocation). The
/// embedding tables are read at random rows, so 4 KiB pages cost a TLB miss
/// per lookup: on the default DLRM huge pages made bf16 forwards 1.2-1.5x
/// faster (REPORTS.md#huge-pages). Set here, before any thread exists, unless the
/// operator chose otherwise (`THP_MEM_ALLOC_ENABLE=0` turns it off). Needs
/// the kernel's transparent huge pages set to `madvise` or `always`.
fn huge_pages_for_libtorch() {
    if std::env::var_os("THP_MEM_ALLOC_ENABLE").is_none() {
        // SAFETY: called first thing in `main`, before any thread exists
        // that could read the environment at the same time (`set_var` is
        // `unsafe` from edition 2024 for that reason).
        unsafe { std::env::set_var("THP_MEM_ALLOC_ENABLE", "1") };
    }
}

/// libtorch's FP32 GEMMs run in Intel MKL (linked into libtorch), whose
/// memory manager keeps the buffers a thread used in a pool of that thread's,
/// and frees them only when the thread itself asks (`mkl_thread_free_buffers`,
/// which libtorch does not export). Every model version has its own lane
/// threads and OpenMP teams, so each reload left its retired threads' buffers
/// behind: on an Intel Xeon (AVX512-BF16), 50 publishes of alternating FP32
/// versions grew resident memory by 60 MiB with the pool and 26 MiB without
/// it (REPORTS.md#memory-on-reload); the forward was as fast either way.
/// MKL reads `MKL_DISABLE_FAST_MM` once, at its first call, and any value
/// disables its pools: set here, before any thread exists, unless the
/// operator set it; `MKL_DISABLE_FAST_MM=0` keeps MKL's pools (the variable
/// is then removed before MKL can read it).
fn no_mkl_buffers_per_thread() {
    match std::env::var_os("MKL_DISABLE_FAST_MM") {
        // SAFETY: called from `main` before any thread exists (as above).
        None => unsafe { std::env::set_var("MKL_DISABLE_FAST_MM", "1") },
        // SAFETY: called from `main` before any thread exists (as above).
        Some(value) if value == "0" => unsafe { std::env::remove_var("MKL_DISABLE_FAST_MM") },
        Some(_) => {}
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
        // SAFETY: mallopt takes plain integers and only sets a glibc tuning
        // value; called from `main` before any thread exists, so no other
        // thread is inside malloc while it changes.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, cores as libc::c_int) };
    }
}

/// libtorch's activations of a large fused batch are blocks of several MiB
/// (an INT8 model's pooled embeddings at 1,600 rows: 10.6 MiB), allocated
/// and freed by every forward. glibc's malloc adapts its thresholds to the
/// blocks it sees: the first such free raises the mmap threshold to its
/// size and the trim threshold to twice that, and then every forward whose
/// freed top exceeds it hands the pages back, so the next one faults them
/// in (on huge pages, 2 MiB zeroed per fault). Fixed thresholds keep blocks
/// up to 32 MiB in the heap and up to 64 MiB of free heap top resident:
/// 1.09-1.19x the single-file bf16 forwards and 1.06-1.07x the split ones
/// at 1,600 rows on an AMD Zen 5 core (three alternating runs each,
/// REPORTS.md#malloc-thresholds), the same at 100 rows. What stays
/// resident is returned by `malloc_trim` after very large batches and
/// after a version stops, as before. An operator's `GLIBC_TUNABLES` or
/// `MALLOC_*_THRESHOLD_` wins.
fn reused_large_blocks_for_libtorch() {
    let set_by_operator = ["GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]
        .iter()
        .any(|name| std::env::var_os(name).is_some());
    if !set_by_operator {
        // SAFETY: mallopt takes plain integers and only sets glibc tuning
        // values; called from `main` before any thread exists, so no other
        // thread is inside malloc while they change.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        }
    }
}

//! The `narsil` command: see `narsil --help`.
//!
//! `main` sets the environment of libraries that read it once (libtorch,
//! MKL, glibc's malloc) first, before Narsil starts any thread: changing
//! the environment is sound only while no other thread can read it. What
//! it sets, and why, is the process's memory policy (`process_memory`) and
//! its scratch directory, where libtorch extracts packages (`scratch_dir`).

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

// The binary's own modules live in `src/main/`: they are not rooms of the
// library (`tests/layout.rs` reads `src/`'s other top-level files as rooms).
#[path = "main/process_memory.rs"]
mod process_memory;
#[path = "main/scratch_dir.rs"]
mod scratch_dir;

fn main() -> std::process::ExitCode {
    // These four run before anything starts a thread (see the crate docs).
    let scratch = scratch_dir::ScratchDir::create();
    process_memory::huge_pages_for_libtorch();
    process_memory::no_mkl_buffers_per_thread();
    let malloc = process_memory::tune_glibc_malloc();
    narsil_engine::on_freed_memory(process_memory::release_freed_memory);
    let code = narsil::cli::main(|| {
        process_memory::log_malloc(malloc);
        scratch.iter().for_each(scratch_dir::ScratchDir::log);
    });
    // Removes the scratch directory: every model has been dropped.
    drop(scratch);
    code
}

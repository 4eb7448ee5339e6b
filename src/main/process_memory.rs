//! The process's memory policy, set by `main` before Narsil starts any
//! thread: Rust's allocations on mimalloc (the global allocator, below),
//! libtorch's large allocations on transparent huge pages, Intel MKL
//! without its per-thread buffer pools, glibc malloc's arenas and mmap and
//! trim thresholds bounded, and freed memory handed back to the OS after a
//! very large batch or a retired model version.
//!
//! Libtorch, MKL and glibc's malloc read their environment once, so it is
//! set first, before any thread exists: changing the environment (and
//! calling `mallopt`) is sound only while no other thread can read it (or
//! be inside malloc). The operator's own settings win, one by one.

// mimalloc keeps freed pages for reuse: fused batches allocate buffers of
// hundreds of KiB, which glibc malloc would map and unmap (page faults) each time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Hands freed memory back to the OS, after a very large batch and after a
/// model version stopped. mimalloc (Rust's allocations) returns the pages it
/// keeps for reuse lazily, when the thread that freed them allocates again;
/// after a batch of tens of MiB (a request with millions of ids) that could
/// leave them resident for a long time, and a forced collect hands them back
/// at once (REPORTS.md#memory-bound-flood). glibc's malloc (libtorch's weights and activations)
/// keeps the free pages inside its heap until asked: `malloc_trim` returns
/// them, so a retired version's weights leave the resident set
/// (REPORTS.md#memory-on-reload).
pub(crate) fn release_freed_memory() {
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
pub(crate) fn huge_pages_for_libtorch() {
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
pub(crate) fn no_mkl_buffers_per_thread() {
    match std::env::var_os("MKL_DISABLE_FAST_MM") {
        // SAFETY: called from `main` before any thread exists (as above).
        None => unsafe { std::env::set_var("MKL_DISABLE_FAST_MM", "1") },
        // SAFETY: called from `main` before any thread exists (as above).
        Some(value) if value == "0" => unsafe { std::env::remove_var("MKL_DISABLE_FAST_MM") },
        Some(_) => {}
    }
}

/// glibc malloc's tunables that `narsil` sets (libtorch allocates through
/// glibc's malloc; Rust's allocations go to mimalloc).
///
/// * `arena_max`: glibc gives each new thread its own arena (up to 8 per
///   core) and keeps what an arena once held. Every model version has its
///   own lane threads, and a lane's forward may run on an OpenMP team, so
///   reloads would keep adding arenas: with two threads per idle forward,
///   ten version switches grew resident memory by 7 MiB each
///   (REPORTS.md#glibc-arenas). Capped (below), that stays flat.
/// * `mmap_threshold` and `trim_threshold`: libtorch's activations of a
///   large fused batch are blocks of several MiB (an INT8 model's pooled
///   embeddings at 1,600 rows: 10.6 MiB), allocated and freed by every
///   forward. glibc adapts its thresholds to the blocks it sees: the first
///   such free raises the mmap threshold to its size and the trim threshold
///   to twice that, and then every forward whose freed top exceeds it hands
///   the pages back, so the next one faults them in (on huge pages, 2 MiB
///   zeroed per fault). Fixed thresholds keep blocks up to 32 MiB in the
///   heap and up to 64 MiB of free heap top resident: 1.09-1.19x the
///   single-file bf16 forwards and 1.06-1.07x the split ones at 1,600 rows
///   on an AMD Zen 5 core (REPORTS.md#malloc-thresholds), the same at 100
///   rows. What stays resident is returned by `malloc_trim` after very
///   large batches and after a version stops.
///
/// The trim threshold holds per arena (glibc trims each arena's heap top
/// against it), so the free heap kept resident, outside `--memory`, is up
/// to arenas x threshold: at one arena per core, 64 cores x 64 MiB = 4 GiB.
/// Bounded at [`FREE_TOP_BOUND`] = 512 MiB: the arenas are capped at
/// 512 MiB / 64 MiB = 8 (one per core below 8 cores: 2 cores keep at most
/// 2 x 64 = 128 MiB, 64 cores 8 x 64 = 512 MiB, not 4 GiB), which keeps the
/// measured 64 MiB threshold everywhere (scaling the threshold down instead
/// would give 64 cores 8 MiB, under one large batch's blocks: the gain
/// gone where cores are many). The lanes and OpenMP teams beyond 8 threads
/// share arenas; tcache serves their small blocks without the arena lock.
/// Where the operator sets `arena_max` (above 8, or 0: glibc's 8 per core),
/// the thresholds Narsil sets scale down instead: trim = 512 MiB / arenas
/// (at least glibc's 128 KiB default), mmap = half of it, at most 32 MiB.
///
/// The operator's settings win, one by one: a tunable named in
/// `GLIBC_TUNABLES` (`glibc.malloc.arena_max`, `glibc.malloc.mmap_threshold`,
/// `glibc.malloc.trim_threshold`) or by its older variable
/// (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`)
/// is left to glibc, even with a value glibc ignores (the operator meant
/// to choose); other tunables in `GLIBC_TUNABLES` change nothing here.
/// Returns the line that says what was set (logged once logging is up) and
/// whether a `mallopt` failed.
pub(crate) fn tune_glibc_malloc() -> (String, bool) {
    let tunables = std::env::var_os("GLIBC_TUNABLES").map(|v| v.to_string_lossy().into_owned());
    let variable =
        |tunable: Tunable| std::env::var_os(tunable.variable()).map(|v| v.to_string_lossy().into_owned());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let plan = malloc_plan(cores, |tunable| {
        operator_setting(tunable, tunables.as_deref(), variable(tunable).as_deref())
    });
    let mut said = Vec::new();
    let mut failed = false;
    for (tunable, setting) in &plan.settings {
        match setting {
            Setting::Narsil(value) => {
                // SAFETY: mallopt takes plain integers and only sets glibc
                // tuning values; called from `main` before any thread
                // exists, so no other thread is inside malloc meanwhile.
                let done = unsafe { libc::mallopt(tunable.param(), *value as libc::c_int) } == 1;
                failed |= !done;
                said.push(match done {
                    true => format!("{} {}", tunable.short(), tunable.show(*value)),
                    false => format!("{} not set (mallopt refused {value})", tunable.short()),
                });
            }
            Setting::Operator(how) => said.push(format!("{} left to the operator's {how}", tunable.short())),
        }
    }
    let kept = match plan.kept {
        Some(kept) => {
            format!("at most {} MiB of free heap top kept resident over {} arenas", kept >> 20, plan.arenas)
        }
        None => format!(
            "{} arenas, each keeping the free heap top the operator's trim threshold allows",
            plan.arenas
        ),
    };
    let line = format!("glibc malloc: {}; {kept}", said.join(", "));
    (line, failed)
}

/// At most this much free heap top is kept resident, over every arena
/// (see [`tune_glibc_malloc`]).
const FREE_TOP_BOUND: u64 = 512 << 20;
/// The trim threshold measured (REPORTS.md#malloc-thresholds).
const TRIM_THRESHOLD: u64 = 64 << 20;
/// The mmap threshold measured.
const MMAP_THRESHOLD: u64 = 32 << 20;
/// glibc's default trim threshold: the least Narsil sets.
const GLIBC_TRIM_THRESHOLD: u64 = 128 << 10;

/// One of glibc malloc's tunables that `narsil` sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tunable {
    ArenaMax,
    MmapThreshold,
    TrimThreshold,
}

impl Tunable {
    /// Its name in `GLIBC_TUNABLES`.
    fn name(self) -> &'static str {
        match self {
            Self::ArenaMax => "glibc.malloc.arena_max",
            Self::MmapThreshold => "glibc.malloc.mmap_threshold",
            Self::TrimThreshold => "glibc.malloc.trim_threshold",
        }
    }

    fn short(self) -> &'static str {
        self.name().trim_start_matches("glibc.malloc.")
    }

    /// The older variable glibc reads for it.
    fn variable(self) -> &'static str {
        match self {
            Self::ArenaMax => "MALLOC_ARENA_MAX",
            Self::MmapThreshold => "MALLOC_MMAP_THRESHOLD_",
            Self::TrimThreshold => "MALLOC_TRIM_THRESHOLD_",
        }
    }

    /// Its `mallopt` parameter.
    fn param(self) -> libc::c_int {
        match self {
            Self::ArenaMax => libc::M_ARENA_MAX,
            Self::MmapThreshold => libc::M_MMAP_THRESHOLD,
            Self::TrimThreshold => libc::M_TRIM_THRESHOLD,
        }
    }

    fn show(self, value: u64) -> String {
        match self {
            Self::ArenaMax => value.to_string(),
            _ if value >= 1 << 20 => format!("{} MiB", value >> 20),
            _ => format!("{} KiB", value >> 10),
        }
    }
}

/// What the operator set for a tunable, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Operator {
    /// Nothing: Narsil may set it.
    Unset,
    /// A value glibc takes (decimal, `0x` hex or `0` octal, as glibc reads
    /// it), named in `from`.
    Value(u64, &'static str),
    /// A value glibc does not take (it ignores the entry); left alone too.
    Malformed(String, &'static str),
}

/// What the operator set for `tunable`: its entry in `glibc_tunables` (the
/// value of `GLIBC_TUNABLES`: `name=value` entries separated by colons, the
/// last of a name winning, as in glibc; entries of other names and ones
/// without `=` say nothing of it), else `variable` (the value of its
/// `MALLOC_*` variable).
fn operator_setting(tunable: Tunable, glibc_tunables: Option<&str>, variable: Option<&str>) -> Operator {
    let named = glibc_tunables.and_then(|list| {
        list.split(':').filter_map(|entry| entry.split_once('=')).rfind(|(name, _)| *name == tunable.name())
    });
    let (value, from) = match (named, variable) {
        (Some((_, value)), _) => (value, "GLIBC_TUNABLES"),
        (None, Some(value)) => (value, tunable.variable()),
        (None, None) => return Operator::Unset,
    };
    let parsed = match value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None if value.len() > 1 && value.starts_with('0') => u64::from_str_radix(&value[1..], 8).ok(),
        None => value.parse().ok(),
    };
    parsed.map_or_else(|| Operator::Malformed(value.to_owned(), from), |n| Operator::Value(n, from))
}

/// Who sets a tunable.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Setting {
    /// Narsil, to this value.
    Narsil(u64),
    /// The operator (how, for the log).
    Operator(String),
}

/// What Narsil sets on `cores` cores, given the operator's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MallocPlan {
    /// Arenas glibc may create.
    arenas: u64,
    /// Each tunable, arenas first (the thresholds' bound depends on it).
    settings: Vec<(Tunable, Setting)>,
    /// The free heap top kept at most (arenas x trim threshold), unless
    /// the operator set the trim threshold.
    kept: Option<u64>,
}

fn malloc_plan(cores: u64, operator: impl Fn(Tunable) -> Operator) -> MallocPlan {
    let said = |tunable: Tunable| match operator(tunable) {
        Operator::Unset => None,
        Operator::Value(value, from) => Some(format!("{from} ({}={value})", tunable.name())),
        Operator::Malformed(value, from) => {
            Some(format!("{from} ({}={value:?}, not a number: glibc ignores it)", tunable.name()))
        }
    };
    let cap = (FREE_TOP_BOUND / TRIM_THRESHOLD).min(cores).max(1);
    let (arenas, arena_setting) = match (operator(Tunable::ArenaMax), said(Tunable::ArenaMax)) {
        (Operator::Unset, _) => (cap, Setting::Narsil(cap)),
        // 0, or a value glibc ignores: glibc's own limit, 8 per core.
        (Operator::Value(n, _), Some(how)) if n > 0 => (n, Setting::Operator(how)),
        (_, how) => (8 * cores, Setting::Operator(how.unwrap_or_default())),
    };
    let trim = (FREE_TOP_BOUND / arenas).clamp(GLIBC_TRIM_THRESHOLD, TRIM_THRESHOLD);
    let mmap = (trim / 2).min(MMAP_THRESHOLD);
    let setting =
        |tunable: Tunable, value: u64| said(tunable).map_or(Setting::Narsil(value), Setting::Operator);
    let trim_setting = setting(Tunable::TrimThreshold, trim);
    let kept = matches!(trim_setting, Setting::Narsil(_)).then_some(arenas * trim);
    MallocPlan {
        arenas,
        settings: vec![
            (Tunable::ArenaMax, arena_setting),
            (Tunable::MmapThreshold, setting(Tunable::MmapThreshold, mmap)),
            (Tunable::TrimThreshold, trim_setting),
        ],
        kept,
    }
}

/// Logs what [`tune_glibc_malloc`] did, once logging is set up (it was
/// set before: a record then would be lost).
pub(crate) fn log_malloc((line, failed): (String, bool)) {
    match failed {
        true => tracing::warn!("{line}"),
        false => tracing::info!("{line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(cores: u64, tunables: Option<&str>, variables: &[(Tunable, &str)]) -> MallocPlan {
        malloc_plan(cores, |tunable| {
            let variable = variables.iter().find(|(t, _)| *t == tunable).map(|(_, v)| *v);
            operator_setting(tunable, tunables, variable)
        })
    }

    fn narsil_sets(plan: &MallocPlan) -> Vec<(Tunable, u64)> {
        let set = plan.settings.iter().filter_map(|(tunable, setting)| match setting {
            Setting::Narsil(value) => Some((*tunable, *value)),
            Setting::Operator(_) => None,
        });
        set.collect()
    }

    #[test]
    fn an_unrelated_tunable_leaves_every_setting_on() {
        let all = vec![
            (Tunable::ArenaMax, 2),
            (Tunable::MmapThreshold, 32 << 20),
            (Tunable::TrimThreshold, 64 << 20),
        ];
        assert_eq!(narsil_sets(&plan(2, None, &[])), all);
        for unrelated in
            ["glibc.cpu.hwcaps=-AVX512F", "glibc.malloc.tcache_count=0:glibc.pthread.rseq=0", "", ":::"]
        {
            assert_eq!(narsil_sets(&plan(2, Some(unrelated), &[])), all, "{unrelated:?}");
        }
        // A name that only starts like one, or one without a value.
        let near = "glibc.malloc.mmap_threshold_x=1:glibc.malloc.trim_threshold";
        assert_eq!(narsil_sets(&plan(2, Some(near), &[])), all);
    }

    #[test]
    fn a_named_tunable_turns_off_only_its_own_setting() {
        for (tunables, variables, left) in [
            (Some("glibc.malloc.mmap_threshold=1048576"), &[][..], Tunable::MmapThreshold),
            (Some("glibc.cpu.x=1:glibc.malloc.trim_threshold=0x100000"), &[], Tunable::TrimThreshold),
            (Some("glibc.malloc.arena_max=2"), &[], Tunable::ArenaMax),
            (None, &[(Tunable::TrimThreshold, "4096")], Tunable::TrimThreshold),
            (Some("glibc.cpu.x=1"), &[(Tunable::MmapThreshold, "4096")], Tunable::MmapThreshold),
        ] {
            let plan = plan(2, tunables, variables);
            for (tunable, setting) in &plan.settings {
                assert_eq!(
                    matches!(setting, Setting::Operator(_)),
                    *tunable == left,
                    "{tunables:?}: {tunable:?}"
                );
            }
        }
        let operator =
            operator_setting(Tunable::TrimThreshold, Some("glibc.malloc.trim_threshold=0x100000"), None);
        assert_eq!(operator, Operator::Value(1 << 20, "GLIBC_TUNABLES"));
        // The last entry of a name wins; GLIBC_TUNABLES over the variable.
        let both = operator_setting(
            Tunable::ArenaMax,
            Some("glibc.malloc.arena_max=4:glibc.malloc.arena_max=010"),
            Some("3"),
        );
        assert_eq!(both, Operator::Value(8, "GLIBC_TUNABLES"));
    }

    #[test]
    fn a_malformed_value_is_left_to_glibc_and_said() {
        let malformed =
            operator_setting(Tunable::MmapThreshold, Some("glibc.malloc.mmap_threshold=32M"), None);
        assert_eq!(malformed, Operator::Malformed("32M".into(), "GLIBC_TUNABLES"));
        let plan = plan(2, Some("glibc.malloc.mmap_threshold=32M"), &[(Tunable::ArenaMax, "many")]);
        let said: Vec<String> = plan
            .settings
            .iter()
            .filter_map(|(_, setting)| match setting {
                Setting::Operator(how) => Some(how.clone()),
                Setting::Narsil(_) => None,
            })
            .collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(said[0].contains("MALLOC_ARENA_MAX") && said[0].contains("not a number"), "{said:?}");
        assert!(said[1].contains("\"32M\"") && said[1].contains("glibc ignores it"), "{said:?}");
        // glibc's own arena limit (8 per core) bounds the trim threshold.
        assert_eq!(plan.arenas, 16);
        assert_eq!(narsil_sets(&plan), vec![(Tunable::TrimThreshold, 32 << 20)]);
    }

    #[test]
    fn the_free_heap_top_kept_is_bounded_whatever_the_cores_or_arenas() {
        for cores in [1u64, 2, 8, 32, 64, 256] {
            let plan = plan(cores, None, &[]);
            assert_eq!(plan.arenas, cores.min(8), "{cores} cores");
            assert!(narsil_sets(&plan).contains(&(Tunable::TrimThreshold, 64 << 20)), "{cores} cores");
            assert_eq!(plan.kept, Some(cores.min(8) * (64 << 20)));
        }
        for arenas in ["16", "64", "0"] {
            let plan = plan(64, None, &[(Tunable::ArenaMax, arenas)]);
            assert!(plan.kept.unwrap() <= FREE_TOP_BOUND, "{arenas} arenas: {plan:?}");
            let sets = narsil_sets(&plan);
            let trim = sets.iter().find(|(t, _)| *t == Tunable::TrimThreshold).unwrap().1;
            let mmap = sets.iter().find(|(t, _)| *t == Tunable::MmapThreshold).unwrap().1;
            assert!(trim >= GLIBC_TRIM_THRESHOLD && mmap <= trim / 2, "{arenas}: {sets:?}");
        }
    }
}

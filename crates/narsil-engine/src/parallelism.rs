//! How many threads one forward may use.
//!
//! Under load every lane runs its own forward on one core: separate
//! forwards on separate cores beat one forward split across them, since
//! the DLRM's small per-request matrices parallelise poorly. A lone
//! request is the opposite case: with the other lanes idle and nothing
//! queued behind it, its forward may take every idle core, which is what a
//! one-forward-per-request server (TorchRec's) does all the time. The rule
//! below gives each forward the cores no other lane is using at the moment
//! it starts, and only when nothing else waits; the lanes that start while
//! it runs get one thread each, so under load it returns to one per lane.

/// Threads for a forward that starts now: `cores` less the lanes already
/// running one, when `nothing_queued` is left behind it; otherwise 1.
pub fn forward_threads(cores: usize, busy_lanes: usize, nothing_queued: bool) -> usize {
    if nothing_queued {
        cores.saturating_sub(busy_lanes).max(1)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::forward_threads;

    #[test]
    fn a_lone_forward_takes_every_idle_core() {
        assert_eq!(forward_threads(2, 0, true), 2);
        assert_eq!(forward_threads(8, 3, true), 5);
    }

    #[test]
    fn under_load_each_forward_keeps_one_thread() {
        assert_eq!(forward_threads(2, 1, true), 1, "the other lane is busy");
        assert_eq!(forward_threads(2, 0, false), 1, "more work is queued for the other lane");
        assert_eq!(forward_threads(2, 5, true), 1, "more lanes than cores");
    }

    #[test]
    fn one_core_means_one_thread() {
        assert_eq!(forward_threads(1, 0, true), 1);
        assert_eq!(forward_threads(0, 0, true), 1);
    }
}

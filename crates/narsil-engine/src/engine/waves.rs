//! How a request's parts are sized to the memory bound and queued in
//! waves within it ([`super::predict`]): parts halved while one is charged
//! more than half the bound, and consecutive parts grouped into waves whose
//! charges, with what stays held meanwhile, fit the bound.

use narsil_core::RequestSamples;

/// `parts`, each cut into halves (by rows, in order) while it has more
/// than one row and is charged more than `most`.
pub(super) fn halve_while(
    parts: Vec<RequestSamples>,
    most: usize,
    charge: &impl Fn(&RequestSamples) -> usize,
    num_sparse: usize,
) -> Vec<RequestSamples> {
    let mut fitted = Vec::with_capacity(parts.len());
    let mut pending: Vec<RequestSamples> = parts.into_iter().rev().collect();
    while let Some(part) = pending.pop() {
        if part.num_samples > 1 && charge(&part) > most {
            let half = part.num_samples.div_ceil(2);
            let halves = part.split_rows(half, num_sparse);
            pending.extend(halves.into_iter().rev());
        } else {
            fitted.push(part);
        }
    }
    fitted
}

/// A part of a request that cannot fit the memory bound alone.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Unfit {
    /// Which.
    pub part: usize,
    /// What it needs, with what is held beside it.
    pub bytes: usize,
}

/// Where each wave of parts ends: consecutive parts whose `charges`, with
/// `shared` (held by every wave) and the `row_bytes` of the parts after
/// the wave (held until their turn), fit `max` together, as many as fit.
/// One wave when the whole request fits; the first part that cannot fit
/// alone otherwise.
pub(super) fn waves(
    charges: &[usize],
    row_bytes: &[usize],
    shared: usize,
    max: usize,
) -> Result<Vec<usize>, Unfit> {
    let later = |end: usize| row_bytes[end..].iter().fold(shared, |a, &b| a.saturating_add(b));
    let (mut ends, mut first) = (Vec::new(), 0);
    while first < charges.len() {
        let mut end = first;
        let mut sum = 0usize;
        while end < charges.len() && sum.saturating_add(charges[end]).saturating_add(later(end + 1)) <= max {
            sum = sum.saturating_add(charges[end]);
            end += 1;
        }
        if end == first {
            return Err(Unfit { part: first, bytes: charges[first].saturating_add(later(first + 1)) });
        }
        ends.push(end);
        first = end;
    }
    Ok(ends)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_queued_in_waves_within_the_bound_holding_the_rows_still_to_come() {
        // Parts charged 40 each, their rows 5 each, a block of 10.
        let (charges, rows) = ([40; 5], [5; 5]);
        // All of it fits 230: one wave.
        assert_eq!(waves(&charges, &rows, 10, 230), Ok(vec![5]));
        // 100: two parts (80) + the block + the 3 parts to come (15) = 105
        // is over, so one part first (40 + 10 + 20 = 70), then two (80 + 10
        // + the 2 to come, 10 = 100), then the last two (80 + 10).
        assert_eq!(waves(&charges, &rows, 10, 100), Ok(vec![1, 3, 5]));
        // A part that cannot fit alone is named with what it needs.
        assert_eq!(waves(&charges, &rows, 10, 60), Err(Unfit { part: 0, bytes: 40 + 10 + 20 }));
    }
}

//! How a request's parts are sized to the memory bound and queued in
//! waves within it ([`super::predict`]): parts halved while one is charged
//! more than half the bound (where halving lowers its charge), consecutive
//! parts grouped into waves whose charges, with what stays held meanwhile,
//! fit the bound, and a part that fits no wave halved until it does.

use narsil_core::RequestSamples;

/// `parts`, each cut into halves (by rows, in order) while it has more
/// than one row, is charged more than `most`, and halving helps: a half
/// charged more than three quarters of the whole (a ranking part whose
/// history's own work dominates) is not worth a forward more, each
/// encoding the history again.
pub(super) fn halve_while(
    parts: Vec<RequestSamples>,
    most: usize,
    charge: &impl Fn(&RequestSamples) -> usize,
    num_sparse: usize,
) -> Vec<RequestSamples> {
    let mut fitted = Vec::with_capacity(parts.len());
    let mut pending: Vec<RequestSamples> = parts.into_iter().rev().collect();
    while let Some(part) = pending.pop() {
        let whole = charge(&part);
        if part.num_samples > 1 && whole > most {
            let halves = part.clone().split_rows(part.num_samples.div_ceil(2), num_sparse);
            if charge(&halves[0]).saturating_mul(4) <= whole.saturating_mul(3) {
                pending.extend(halves.into_iter().rev());
                continue;
            }
        }
        fitted.push(part);
    }
    fitted
}

/// A request's parts grouped into waves within the memory bound
/// ([`plan`]).
pub(super) struct Plan {
    /// The parts, in order.
    pub parts: Vec<RequestSamples>,
    /// What each part is charged while it is queued and computed.
    pub charges: Vec<usize>,
    /// Each part's own rows' bytes, held until its wave is queued.
    pub row_bytes: Vec<usize>,
    /// Where each wave ends ([`waves`]).
    pub ends: Vec<usize>,
}

impl Plan {
    /// What stays held while the waves up to `end` run: `shared` and the
    /// rows of the parts after `end`.
    pub fn held_after(&self, end: usize, shared: usize) -> usize {
        self.row_bytes[end..].iter().fold(shared, |a, &b| a.saturating_add(b))
    }
}

/// `parts` grouped into waves that fit `max` beside `shared` ([`waves`]);
/// where `halve`, a part that cannot fit alone is halved by rows and the
/// waves planned again, until it fits or is one row. Else the parts as cut
/// and the part that cannot fit.
pub(super) fn plan(
    mut parts: Vec<RequestSamples>,
    charge: &impl Fn(&RequestSamples) -> usize,
    shared: usize,
    max: usize,
    (halve, num_sparse): (bool, usize),
) -> Result<Plan, (Vec<RequestSamples>, Unfit)> {
    let mut charges: Vec<usize> = parts.iter().map(charge).collect();
    let mut row_bytes: Vec<usize> = parts.iter().map(RequestSamples::row_bytes).collect();
    loop {
        match waves(&charges, &row_bytes, shared, max) {
            Ok(ends) => return Ok(Plan { parts, charges, row_bytes, ends }),
            Err(unfit) if halve && parts[unfit.part].num_samples > 1 => {
                // Only the halved part's charges are computed again.
                let at = unfit.part;
                let part = parts.remove(at);
                let half = part.num_samples.div_ceil(2);
                let halves = part.split_rows(half, num_sparse);
                charges.splice(at..=at, halves.iter().map(charge));
                row_bytes.splice(at..=at, halves.iter().map(RequestSamples::row_bytes));
                parts.splice(at..at, halves);
            }
            Err(unfit) => return Err((parts, unfit)),
        }
    }
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
    // What stays held after each part: `shared` and the rows after it
    // (summed once, from the end).
    let mut after = vec![shared; charges.len() + 1];
    for i in (0..charges.len()).rev() {
        after[i] = after[i + 1].saturating_add(row_bytes[i]);
    }
    let later = |end: usize| after[end];
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

    /// A request of `rows` rows, one dense and one sparse feature.
    fn request(rows: usize) -> RequestSamples {
        RequestSamples {
            num_samples: rows,
            dense: vec![0.5; rows],
            lengths: vec![1; rows],
            ids: (0..rows as i64).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_part_that_fits_no_wave_is_halved_until_it_fits_or_is_one_row() {
        let per_row = |part: &RequestSamples| part.num_samples * 1000;
        // 8 rows charged 8,000 against 4,500: halved to parts of 4 rows.
        let planned = plan(vec![request(8)], &per_row, 0, 4500, (true, 1)).ok().unwrap();
        let rows: Vec<usize> = planned.parts.iter().map(|p| p.num_samples).collect();
        assert_eq!(rows, [4, 4]);
        assert!(planned.charges.iter().all(|&c| c <= 4500));
        assert_eq!(planned.ends.len(), 2, "one part a wave, the other's rows held meanwhile");
        // A row charged more than the bound: refused, the part named one row.
        let Err((parts, unfit)) = plan_of(request(4), 500) else { panic!("a row over the bound fits") };
        assert_eq!((unfit.part, parts[unfit.part].num_samples), (0, 1));
        assert_eq!(parts.iter().map(|p| p.num_samples).sum::<usize>(), 4);
        // Not halved where the caller says not to (a model without
        // sequences): the part as cut is refused.
        let per_row = |part: &RequestSamples| part.num_samples * 1000;
        let Err((whole, _)) = plan(vec![request(8)], &per_row, 0, 4500, (false, 1)) else { panic!("fits") };
        assert_eq!(whole.len(), 1);
    }

    fn plan_of(request: RequestSamples, max: usize) -> Result<Plan, (Vec<RequestSamples>, Unfit)> {
        plan(vec![request], &|part: &RequestSamples| part.num_samples * 1000, 0, max, (true, 1))
    }

    #[test]
    fn a_part_is_halved_only_where_halving_lowers_its_charge() {
        // Charged by its rows: halved down to the limit.
        let per_row = |part: &RequestSamples| part.num_samples * 10;
        let halves = halve_while(vec![request(8)], 25, &per_row, 1);
        assert_eq!(halves.iter().map(|p| p.num_samples).collect::<Vec<_>>(), [2, 2, 2, 2]);
        // Charged mostly for a history every part holds (a ranking part):
        // kept whole, not cut into forwards that each encode it again.
        let history = |part: &RequestSamples| 1000 + part.num_samples;
        assert_eq!(halve_while(vec![request(8)], 25, &history, 1).len(), 1);
    }
}

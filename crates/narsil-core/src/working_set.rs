//! What a sequence model's dense network allocates for one request beyond
//! its inputs: its working set. A DIN-like network gathers each row's
//! history (`[rows, longest, width]`); an HSTU-like one attends in blocks,
//! `[pairs, heads, block, block]` scores over every pair of a unit's blocks
//! (the square of its history). The memory bound charges it before a
//! request is queued, so one request cannot make a forward allocate
//! gigabytes the bound never saw.
//!
//! A sequence declares its network's working set in `schema.json` (or
//! `model.json`, `narsil_schema()`), next to its channels:
//! `"working_set": {"kind": "gather", "width": 208}` or
//! `{"kind": "block_attention", "block": 32, "heads": 4, "head_dim": 32,
//! "contexts": 2, "model_dim": 128}` (`bytes_per_value` optional, 4), or
//! `unit_attention` with the same fields and `group_tokens` (a network
//! that attends unit after unit, one query block at a time, units in
//! groups: GR's TorchScript form, linear in a unit's history). Where a split model's AOTInductor packages attend
//! otherwise than its TorchScript network, the sequence also declares
//! `"package_working_set"`, which a server running a package charges
//! instead ([`crate::ModelSchema::charge_package_working_sets`]). A
//! sequence without one (exported before) is charged
//! [`WorkingSet::undeclared`]: a gather of 16 values per position's value
//! and a full attention of 64 bytes per pair of a unit's positions,
//! conservative for the networks Narsil's exporters write.
//!
//! [`WorkingSet::bytes`] is a pure function of the request's shape: its
//! units (one history each: a flat request's rows each hold their own, a
//! ranking request's block one for all its rows) and the rows attending
//! to each. It bounds the tensors alive at once during one forward of that
//! request alone (checked against measured peaks: `docs/guide/sequences.md`);
//! a fused batch holds the sum of its requests' (more where fusing pads).
//! [`WorkingSet::batch_bound`] bounds what any one forward of some of a
//! set of units can hold, however they are fused: the engine holds, for
//! its requests in flight, the lesser of their sum and its lanes times
//! the most one batch of them holds (that bound, and the largest working
//! sets of as many requests as one batch takes: a queued request
//! allocates nothing; `narsil-engine`'s `working_sets`).

use serde::Deserialize;

/// One unit of a request: a history of `positions` positions that `rows`
/// of its rows attend to (a flat row: 1; a ranking request's block: all
/// its rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// Its history's positions, as validated (cut to the maximum).
    pub positions: usize,
    /// The rows that attend to it.
    pub rows: usize,
}

fn four() -> usize {
    4
}

/// A declared working set (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkingSet {
    /// Each row gathers its unit's positions, padded to the request's
    /// longest: `[rows, longest, width]` values alive at once (DIN).
    Gather {
        /// Values per (row, position) alive at once: the gathered history
        /// and what the network computes from it per position.
        width: usize,
        /// Values per position computed once per position (not per row),
        /// alive with the gather.
        #[serde(default)]
        position_width: usize,
        /// Bytes per value (4: FP32).
        #[serde(default = "four")]
        bytes_per_value: usize,
    },
    /// Each unit's tokens (`contexts` plus its positions) attend in blocks
    /// of `block`, every block to those at or before it (HSTU's jagged
    /// form): `[pairs, heads, block, block]` scores, `[pairs, block,
    /// heads, head_dim]` gathers; each row then attends to its unit's
    /// blocks (`[blocks, heads, rows of its unit, block]`).
    BlockAttention {
        /// Tokens per block.
        block: usize,
        /// Attention heads.
        heads: usize,
        /// Values per head.
        head_dim: usize,
        /// Tokens a unit has before its positions (contextual features).
        #[serde(default)]
        contexts: usize,
        /// Values per token between layers.
        model_dim: usize,
        /// Bytes per value (4: FP32).
        #[serde(default = "four")]
        bytes_per_value: usize,
    },
    /// Each unit's tokens (`contexts` plus its positions) attend unit after
    /// unit, one query block of `block` tokens at a time against every key
    /// of its unit up to its own end, then the unit's rows against all of
    /// its keys (GR's TorchScript form, `models/gr_model.py`'s
    /// `attend_units`); units run in groups of whole units of at most
    /// `group_tokens` positions and rows (a larger unit alone), one group
    /// after another. A group's tokens and rows hold their states at once;
    /// scores are one unit's at a time: linear in a unit's history.
    UnitAttention {
        /// Query tokens per product.
        block: usize,
        /// Attention heads.
        heads: usize,
        /// Values per head.
        head_dim: usize,
        /// Tokens a unit has before its positions (contextual features).
        #[serde(default)]
        contexts: usize,
        /// Values per token between layers.
        model_dim: usize,
        /// Positions and rows a group of units holds at most (0: every
        /// unit in one group).
        #[serde(default)]
        group_tokens: usize,
        /// Bytes per value (4: FP32).
        #[serde(default = "four")]
        bytes_per_value: usize,
    },
    /// A sequence declared without one, of `width` values per position
    /// ([`WorkingSet::undeclared`]).
    #[serde(skip)]
    Undeclared {
        /// Values per position of the sequence (its channels' dims; 0 where
        /// the model looks its rows up itself).
        width: usize,
    },
}

/// Bytes of an int64 index, and of a mask value.
const INDEX: usize = 8;

/// What an undeclared sequence is charged per pair of one unit's
/// positions (a full attention: 4 heads of FP32 scores, 4 alive at once).
pub const UNDECLARED_PAIR_BYTES: usize = 64;

/// Values per (row, position) an undeclared sequence is charged for its
/// gather: this many per value of a position (at least 16 values).
pub const UNDECLARED_GATHER_FACTOR: usize = 16;

impl WorkingSet {
    /// The charge of a sequence of `width` values per position declared
    /// without a working set.
    pub fn undeclared(width: usize) -> Self {
        Self::Undeclared { width }
    }

    /// Checks a declaration's sizes (positive where they must be).
    pub fn check(&self) -> Result<(), String> {
        let zero = match *self {
            Self::Gather { width, bytes_per_value, .. } => {
                [("width", width), ("bytes_per_value", bytes_per_value)].into_iter().find(|(_, v)| *v == 0)
            }
            Self::BlockAttention { block, heads, head_dim, model_dim, bytes_per_value, .. }
            | Self::UnitAttention { block, heads, head_dim, model_dim, bytes_per_value, .. } => [
                ("block", block),
                ("heads", heads),
                ("head_dim", head_dim),
                ("model_dim", model_dim),
                ("bytes_per_value", bytes_per_value),
            ]
            .into_iter()
            .find(|(_, v)| *v == 0),
            Self::Undeclared { .. } => None,
        };
        match zero {
            Some((name, _)) => Err(format!("working_set: {name} must be at least 1")),
            None => Ok(()),
        }
    }

    /// Bytes the network holds at once for one forward of `units` (module
    /// docs); saturating. 0 for no units or no positions.
    pub fn bytes(&self, units: &[Unit]) -> usize {
        let rows = units.iter().map(|u| u.rows).fold(0, usize::saturating_add);
        let positions = units.iter().map(|u| u.positions).fold(0, usize::saturating_add);
        let longest = units.iter().map(|u| u.positions).max().unwrap_or(0);
        match *self {
            Self::Gather { width, position_width, bytes_per_value } => {
                gather(rows, longest, width, bytes_per_value)
                    .saturating_add(positions.saturating_mul(position_width).saturating_mul(bytes_per_value))
            }
            Self::Undeclared { width } => {
                let width = (width * UNDECLARED_GATHER_FACTOR).max(16);
                let pairs = units
                    .iter()
                    .map(|u| u.positions.saturating_mul(u.positions))
                    .fold(0, usize::saturating_add);
                gather(rows, longest, width, 4)
                    .saturating_add(positions.saturating_mul(width * 4))
                    .saturating_add(pairs.saturating_mul(UNDECLARED_PAIR_BYTES))
            }
            Self::BlockAttention { block, heads, head_dim, contexts, model_dim, bytes_per_value } => {
                let shape = Blocks::of(units, block, contexts);
                shape.bytes(block, heads, head_dim, model_dim, bytes_per_value)
            }
            Self::UnitAttention { contexts, group_tokens, .. } => {
                self.grouped(Groups::of(units, contexts, group_tokens))
            }
        }
    }

    /// What a unit-by-unit network holds for `groups` (0 for other kinds).
    fn grouped(&self, groups: Groups) -> usize {
        let Self::UnitAttention { block, heads, head_dim, model_dim, bytes_per_value, .. } = *self else {
            return 0;
        };
        groups.bytes(block, heads, head_dim, model_dim, bytes_per_value)
    }

    /// Whether a forward of several requests' units can hold less than
    /// their own working sets summed: a network that runs units in groups
    /// ([`Self::UnitAttention`]) holds one group's states at a time. Every
    /// other kind's forward of a batch holds at least its requests' sum
    /// (their sizes add up, and it pads each to the batch's longest or
    /// most rows).
    pub fn fuses_below_sum(&self) -> bool {
        matches!(self, Self::UnitAttention { .. })
    }

    /// The most one forward of any of `units` (any subset, fused in any
    /// order) can hold: at least [`Self::bytes`] of each such batch, and
    /// never less for more units. The kinds that add up or pad to their
    /// longest: [`Self::bytes`] of them all. A network that runs units in
    /// groups ([`Self::UnitAttention`]) holds one group's states at a
    /// time: the largest unit alone, or at most `group_tokens` positions
    /// and rows of several units with their contexts; scores of its
    /// longest unit and its unit with the most row-token pairs.
    pub fn batch_bound(&self, units: &[Unit]) -> usize {
        let Self::UnitAttention { contexts, group_tokens, .. } = *self else {
            return self.bytes(units);
        };
        let alone = Groups::of(units, contexts, 1);
        let counted: Vec<_> = units.iter().filter(|u| u.positions > 0 || u.rows > 0).collect();
        let all = counted.iter().fold(0usize, |a, u| {
            a.saturating_add(u.positions).saturating_add(u.rows).saturating_add(contexts)
        });
        let states = if group_tokens == 0 {
            all
        } else {
            // A group of several units counts at most `group_tokens`
            // positions and rows, at least one a unit.
            let several =
                group_tokens.saturating_add(contexts.saturating_mul(counted.len().min(group_tokens)));
            all.min(alone.states.max(several))
        };
        self.grouped(Groups { states, ..alone })
    }
}

/// A request's units as a unit-by-unit network runs them
/// ([`WorkingSet::UnitAttention`]): in groups of whole units, cut as the
/// network cuts them (`models/gr_model.py`'s `forward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Groups {
    /// Tokens (contexts and positions) and rows of the largest group.
    states: usize,
    /// The most tokens one unit has.
    longest: usize,
    /// The most row-token pairs one unit has (its rows against its tokens).
    pairs: usize,
}

impl Groups {
    fn of(units: &[Unit], contexts: usize, group_tokens: usize) -> Self {
        let mut shape = Self::default();
        let (mut group, mut held) = (0usize, 0usize);
        for unit in units.iter().filter(|u| u.positions > 0 || u.rows > 0) {
            let counted = unit.positions.saturating_add(unit.rows);
            if group_tokens > 0 && held > 0 && held.saturating_add(counted) > group_tokens {
                (shape.states, group, held) = (shape.states.max(group), 0, 0);
            }
            let tokens = unit.positions.saturating_add(contexts);
            held = held.saturating_add(counted);
            group = group.saturating_add(tokens).saturating_add(unit.rows);
            shape.longest = shape.longest.max(tokens);
            shape.pairs = shape.pairs.max(unit.rows.saturating_mul(tokens));
        }
        shape.states = shape.states.max(group);
        shape
    }

    /// A layer at its peak holds, per token and row of the group it runs,
    /// its state before and after, its sorted copy and its norm
    /// (`4 x model_dim`) and its `u, v, q, k` with their activation, the
    /// heads' copies of `q, k, v`, what is attended and its layout, its
    /// norm, the concatenation of three and the gate (18 x `heads x
    /// head_dim`), with what the group's preprocessing keeps alive beside
    /// them (4 more: measured, a group of many short units holds ~24 KB a
    /// token at dim 256); and the scores of one product at a time, four
    /// alive (the product, its scaling, its activation, its mask), for the
    /// unit with the most tokens (a query block against them) and the unit
    /// with the most row-token pairs. Measured against one forward's peak
    /// under the server's malloc settings (`benchmarks/working_set_peak.py
    /// --gr`: 1.1-6.8x) and against the server's own peak RSS
    /// (`docs/guide/gr-models.md#memory`: 1.5-2.6x).
    fn bytes(&self, block: usize, heads: usize, head_dim: usize, model_dim: usize, value: usize) -> usize {
        let per = (4 * model_dim + 22 * heads * head_dim) * value + 2 * INDEX;
        let scores = block.saturating_mul(self.longest).saturating_add(self.pairs);
        self.states.saturating_mul(per).saturating_add(scores.saturating_mul(4 * heads * value))
    }
}

/// What a forward holds for several sequences: each one's `working_sets`
/// over its `units` (in the same order), summed; saturating.
pub fn summed(working_sets: impl IntoIterator<Item = WorkingSet>, units: &[Vec<Unit>]) -> usize {
    working_sets.into_iter().zip(units).fold(0, |a, (w, u)| a.saturating_add(w.bytes(u)))
}

/// `[rows, longest, width]` values with an index and a mask each.
fn gather(rows: usize, longest: usize, width: usize, value: usize) -> usize {
    let per = width.saturating_mul(value).saturating_add(INDEX + 1);
    rows.saturating_mul(longest).saturating_mul(per)
}

/// A request's units cut into blocks (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Blocks {
    /// Units.
    units: usize,
    /// Tokens: contexts and positions, every unit's.
    tokens: usize,
    /// Blocks, every unit's.
    blocks: usize,
    /// Block pairs (a query block and a key block at or before it in its
    /// unit), every unit's.
    pairs: usize,
    /// Rows.
    rows: usize,
    /// The most rows one unit has (at least 2, as the network pads).
    most: usize,
}

impl Blocks {
    fn of(units: &[Unit], block: usize, contexts: usize) -> Self {
        let mut shape = Self { most: 2, ..Self::default() };
        for unit in units.iter().filter(|u| u.rows > 0) {
            let tokens = unit.positions.saturating_add(contexts);
            let blocks = tokens.div_ceil(block.max(1)).max(1);
            shape.units += 1;
            shape.tokens = shape.tokens.saturating_add(tokens);
            shape.blocks = shape.blocks.saturating_add(blocks);
            shape.pairs = shape.pairs.saturating_add(blocks.saturating_mul(blocks + 1) / 2);
            shape.rows = shape.rows.saturating_add(unit.rows);
            shape.most = shape.most.max(unit.rows);
        }
        shape
    }

    /// The tensors of one layer at its peak, plus those kept across layers:
    /// * per pair of blocks, `b x b` scores for each head, three alive at
    ///   once (the scores, the relative bias gathered for them, the sum),
    ///   the pair's distances and their clamped copy (int64) and its mask;
    ///   and three `[b, heads, head_dim]` gathers (a key block, its copy by
    ///   head, the shares);
    /// * per block, its query, key and value blocks, what is attended and
    ///   its token indices;
    /// * per token, its state, norm and output (`model_dim`) and its
    ///   `u, v, q, k` with their activation (`8 x heads x head_dim`);
    /// * per row, as a token and its attended and own shares, and against
    ///   each of its unit's blocks the padded candidates' gathers and
    ///   scores, four each (a unit's rows padded to the most rows a unit
    ///   has).
    fn bytes(&self, b: usize, heads: usize, head_dim: usize, model_dim: usize, value: usize) -> usize {
        if self.units == 0 {
            return 0;
        }
        let attention = heads.saturating_mul(head_dim);
        let per_pair = (3 * heads * b * value + 2 * INDEX + value) * b + 3 * b * attention * value;
        let per_block = b * (4 * attention * value + 3 * INDEX);
        let per_token = (4 * model_dim + 8 * attention) * value + 2 * INDEX;
        let per_row = (4 * model_dim + 12 * attention) * value + 2 * INDEX;
        let candidates =
            self.blocks.saturating_mul(self.most).saturating_mul(4 * heads * (b + head_dim) * value);
        [
            self.pairs.saturating_mul(per_pair),
            self.blocks.saturating_mul(per_block),
            self.tokens.saturating_mul(per_token),
            self.rows.saturating_mul(per_row),
            candidates,
            self.units.saturating_mul(self.most).saturating_mul(3 * attention * value),
        ]
        .into_iter()
        .fold(0, usize::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(rows: usize, positions: usize) -> Vec<Unit> {
        vec![Unit { positions, rows: 1 }; rows]
    }

    /// The HSTU benchmark's network (`bench-hstu`).
    const BENCH_HSTU: WorkingSet = WorkingSet::BlockAttention {
        block: 32,
        heads: 4,
        head_dim: 32,
        contexts: 2,
        model_dim: 128,
        bytes_per_value: 4,
    };

    #[test]
    fn a_declaration_parses_by_kind_and_refuses_unknown_fields_and_zero_sizes() {
        let gather: WorkingSet = serde_json::from_str(r#"{"kind": "gather", "width": 208}"#).unwrap();
        assert_eq!(gather, WorkingSet::Gather { width: 208, position_width: 0, bytes_per_value: 4 });
        let attention: WorkingSet = serde_json::from_str(
            r#"{"kind": "block_attention", "block": 32, "heads": 4, "head_dim": 32, "contexts": 2, "model_dim": 128}"#,
        )
        .unwrap();
        assert_eq!(attention, BENCH_HSTU);
        assert!(serde_json::from_str::<WorkingSet>(r#"{"kind": "gather", "width": 1, "wdth": 2}"#).is_err());
        assert!(serde_json::from_str::<WorkingSet>(r#"{"kind": "undeclared", "width": 1}"#).is_err());
        let zero: WorkingSet = serde_json::from_str(r#"{"kind": "gather", "width": 0}"#).unwrap();
        assert_eq!(zero.check().unwrap_err(), "working_set: width must be at least 1");
        attention.check().unwrap();
    }

    #[test]
    fn a_gather_is_rows_by_the_longest_unit_by_its_width() {
        let gather = WorkingSet::Gather { width: 10, position_width: 3, bytes_per_value: 4 };
        // 3 rows of 5, 2 and 0 positions: padded to 5.
        let units =
            [Unit { positions: 5, rows: 1 }, Unit { positions: 2, rows: 1 }, Unit { positions: 0, rows: 1 }];
        assert_eq!(gather.bytes(&units), 3 * 5 * (10 * 4 + 9) + 7 * 3 * 4);
        // A ranking request: one unit of 100 positions for 50 rows.
        assert_eq!(gather.bytes(&[Unit { positions: 100, rows: 50 }]), 50 * 100 * 49 + 100 * 12);
        assert_eq!(gather.bytes(&[]), 0);
    }

    #[test]
    fn block_attention_grows_with_the_square_of_a_units_history() {
        let one = |positions| BENCH_HSTU.bytes(&flat(1, positions));
        // Twice the history, about four times the memory once past the
        // linear terms.
        let (short, long) = (one(1000), one(2000));
        assert!(long > 3 * short && long < 5 * short, "{short} -> {long}");
        // Rows with their own histories add up; a ranking request's rows
        // share one history, so they cost far less than flat rows.
        assert_eq!(BENCH_HSTU.bytes(&flat(10, 512)), 10 * one(512) - 9 * BENCH_HSTU.bytes(&[]));
        let ranking = BENCH_HSTU.bytes(&[Unit { positions: 512, rows: 10 }]);
        assert!(ranking < 2 * one(512), "{ranking} vs {}", one(512));
    }

    #[test]
    fn the_bench_hstu_flat_request_is_charged_gigabytes_not_megabytes() {
        // 400 rows x 512 positions: 2 contexts + 512 = 514 tokens, 17
        // blocks, 153 block pairs a row; measured at 4.8 GB of peak RSS.
        let bytes = BENCH_HSTU.bytes(&flat(400, 512));
        let per_row_pairs = 153 * (3 * 4 * 32 * 4 + 2 * 8 + 4) * 32 + 153 * 3 * 32 * 128 * 4;
        assert!(bytes >= 400 * per_row_pairs, "{bytes}");
        assert!((4_000_000_000..8_000_000_000).contains(&bytes), "{bytes}");
    }

    /// The DLRMv3-scaled GR network (`models/gr/make_gr_golden.py --sets
    /// dlrmv3-cpu`) as its TorchScript form attends.
    const GR_UNITS: WorkingSet = WorkingSet::UnitAttention {
        block: 64,
        heads: 4,
        head_dim: 64,
        contexts: 1,
        model_dim: 256,
        group_tokens: 2048,
        bytes_per_value: 4,
    };

    #[test]
    fn unit_attention_grows_linearly_with_a_units_history_and_holds_one_groups_states() {
        let ranking = |positions, rows| GR_UNITS.bytes(&[Unit { positions, rows }]);
        // Twice the history, at most twice the memory (block attention:
        // about four times).
        let (short, long) = (ranking(1023, 128), ranking(2047, 128));
        assert!(long > short && long <= 2 * short, "{short} -> {long}");
        // 1,024 tokens and 128 rows: their states, a query block's scores
        // against the tokens and the rows' against them.
        let per = (4 * 256 + 22 * 256) * 4 + 16;
        assert_eq!(ranking(1023, 128), (1024 + 128) * per + (64 * 1024 + 128 * 1024) * 64);
        // Two units of 1,151 positions and rows: a group of 2,048 holds one
        // at a time. Units of 1,151 and 575 share a group: their states add
        // up, the scores are the larger unit's.
        let apart =
            GR_UNITS.bytes(&[Unit { positions: 1023, rows: 128 }, Unit { positions: 1023, rows: 128 }]);
        assert_eq!(apart, ranking(1023, 128));
        let together =
            GR_UNITS.bytes(&[Unit { positions: 1023, rows: 128 }, Unit { positions: 511, rows: 64 }]);
        assert_eq!(together, ranking(1023, 128) + (512 + 64) * per);
        // Flat rows of 63 positions: 32 a group (2,048 positions and rows).
        let rows = GR_UNITS.bytes(&flat(100, 63));
        assert_eq!(rows, 32 * (64 + 1) * per + (64 * 64 + 64) * 64);
        let everything = WorkingSet::UnitAttention {
            block: 64,
            heads: 4,
            head_dim: 64,
            contexts: 1,
            model_dim: 256,
            group_tokens: 0,
            bytes_per_value: 4,
        };
        assert_eq!(everything.bytes(&flat(100, 63)), 100 * (64 + 1) * per + (64 * 64 + 64) * 64);
        assert_eq!(GR_UNITS.bytes(&[]), 0);
        // The same network's block attention (its .pt2) charges over twice as much.
        let blocks = WorkingSet::BlockAttention {
            block: 64,
            heads: 4,
            head_dim: 64,
            contexts: 1,
            model_dim: 256,
            bytes_per_value: 4,
        };
        let units = [Unit { positions: 1023, rows: 128 }];
        assert!(blocks.bytes(&units) > 2 * GR_UNITS.bytes(&units));
        let declared: WorkingSet = serde_json::from_str(
            r#"{"kind": "unit_attention", "block": 64, "heads": 4, "head_dim": 64, "contexts": 1, "model_dim": 256,
                "group_tokens": 2048}"#,
        )
        .unwrap();
        assert_eq!(declared, GR_UNITS);
    }

    #[test]
    fn a_batch_bound_holds_every_batch_of_some_units_in_any_order_and_grows_with_them() {
        let gather = WorkingSet::Gather { width: 10, position_width: 3, bytes_per_value: 4 };
        let kinds = [GR_UNITS, BENCH_HSTU, gather, WorkingSet::undeclared(8)];
        // Units of varied histories and rows, from a fixed LCG.
        let mut seed = 7u64;
        let mut next = |below: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) % below) as usize
        };
        let units: Vec<Unit> = (0..24)
            .map(|_| Unit { positions: next(1500) + usize::from(next(4) == 0), rows: next(300) })
            .collect();
        for kind in kinds {
            let all = kind.batch_bound(&units);
            for trial in 0..200 {
                // Some of them, in some order.
                let mut batch: Vec<Unit> = units.iter().copied().filter(|_| next(3) > 0).collect();
                for i in (1..batch.len()).rev() {
                    batch.swap(i, next(i as u64 + 1));
                }
                assert!(kind.bytes(&batch) <= kind.batch_bound(&batch), "{kind:?} trial {trial}");
                assert!(kind.batch_bound(&batch) <= all, "{kind:?} trial {trial}");
                // Cut into requests, the kinds that do not fuse below
                // their sum hold at least it.
                let cut = next(batch.len() as u64 + 1);
                let apart = kind.bytes(&batch[..cut]) + kind.bytes(&batch[cut..]);
                assert!(kind.fuses_below_sum() || kind.bytes(&batch) >= apart, "{kind:?} trial {trial}");
            }
        }
        // 16 GR users of 1,023 positions and 128 candidates: one group of
        // 2,048 positions and rows (and 16 contexts) at most, against 16
        // units' sum; those that add up are their sum.
        let users = vec![Unit { positions: 1023, rows: 128 }; 16];
        let per = (4 * 256 + 22 * 256) * 4 + 16;
        assert_eq!(GR_UNITS.batch_bound(&users), 2064 * per + (64 * 1024 + 128 * 1024) * 64);
        assert!(16 * GR_UNITS.bytes(&users[..1]) > 8 * GR_UNITS.batch_bound(&users));
        assert_eq!(BENCH_HSTU.batch_bound(&users), BENCH_HSTU.bytes(&users));
        assert_eq!(GR_UNITS.batch_bound(&[]), 0);
    }

    #[test]
    fn an_undeclared_sequence_is_charged_its_gather_and_a_full_attention() {
        let undeclared = WorkingSet::undeclared(48);
        let units = flat(2, 100);
        let gather = 2 * 100 * (48 * 16 * 4 + 9) + 200 * 48 * 16 * 4;
        assert_eq!(undeclared.bytes(&units), gather + 2 * 100 * 100 * UNDECLARED_PAIR_BYTES);
        // Above what bench-hstu declares (its sequence: 3 channels of 64),
        // for flat rows and for a ranking request.
        let bench = WorkingSet::undeclared(3 * 64);
        for units in [flat(400, 512), vec![Unit { positions: 512, rows: 4096 }]] {
            assert!(bench.bytes(&units) > BENCH_HSTU.bytes(&units), "{units:?}");
        }
    }
}

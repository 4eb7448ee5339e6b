//! A lane's buffers for the embedding stage, reused from batch to batch
//! (one stage serves every lane; each lane brings its own scratch).

use narsil_core::KeyedBatch;

use super::map_ids::BatchPushed;
use super::sequences::SequenceValues;
use crate::dedup::DistinctIds;

/// A lane's buffers, reused from batch to batch.
#[derive(Default)]
pub struct StageScratch {
    /// Per table: the batch's distinct ids.
    pub(super) distinct: Vec<DistinctIds>,
    /// Per table whose store fetches: the rows of its distinct ids.
    pub(super) fetched: Vec<Vec<u8>>,
    /// A feature's ids as their rows in the file, for local rows laid out
    /// in popularity order or by an id map.
    pub(super) file_rows: Vec<i64>,
    /// Copies of a bag's rows, for a bag of a table laid out by its id map
    /// that holds ids the map lacks.
    pub(super) bag_rows: Vec<u8>,
    /// Per table laid out by its id map, the batch's snapshot of its pushed
    /// ids (what its pooling looks ids the layout lacks up in).
    pub(super) laid_out_pushed: BatchPushed,
    /// The request-level units' pooled bags, `[units, request-level
    /// features * dim]`.
    pub(super) unit_pooled: Vec<f32>,
    /// The batch with its raw ids mapped to rows, for models with tables
    /// whose ids are raw.
    pub(super) mapped: KeyedBatch,
    /// Per table, the snapshot of its pushed ids the batch found ids in
    /// (none where it found none): the table is pooled through copies of
    /// its distinct rows, those read from the snapshot.
    pub(super) pushed: BatchPushed,
    /// The last batch's sequences, in the schema's order.
    pub(super) sequences: Vec<SequenceValues>,
    /// The last batch's raw inputs outside sequences, `[rows, K]`
    /// row-major (empty for a model without).
    pub(super) row_raw: Vec<i64>,
    /// Bag lengths of 1, for looking positions up one id each.
    pub(super) ones: Vec<i32>,
    /// The rows of a batch with ranking requests that pool their own bags
    /// of request-level features (the flat requests' rows), as ranges.
    pub(super) own_rows: Vec<std::ops::Range<usize>>,
}

impl StageScratch {
    /// The last batch's sequence values (one per declared sequence, in the
    /// schema's order; none for a model without sequences).
    pub fn sequences(&self) -> &[SequenceValues] {
        &self.sequences
    }

    /// The last batch's raw inputs outside sequences, `[rows, K]`
    /// row-major, K = [`super::EmbeddingStage::row_raw_width`] (each row's
    /// own value, or its request block's where the feature arrived once
    /// per request); empty for a model without.
    pub fn row_raw(&self) -> &[i64] {
        &self.row_raw
    }
}

//! A request's sequences ([`crate::sequence`]): checked and cut at
//! validation, and what they weigh once fused (tokens, and the memory of
//! their values once looked up).

use crate::invalid::{InputField, InvalidInput};
use crate::request::RequestSamples;
use crate::schema::{ModelSchema, SequenceFeature};
use crate::sequence::{fit_sequences, BagLayout};

impl RequestSamples {
    /// Its rows plus the sequence positions it looks up (once per position,
    /// whatever its channels): those on its rows and those in its request
    /// block (once, whatever its rows; on every row where `flat`: lanes
    /// that take only flat batches get the block copied into each row,
    /// [`crate::KeyedBatch::into_flat`]). Equal to its rows for a model
    /// without sequence features; what a batch's token budget counts.
    /// Lengths as validated (explicit).
    pub fn tokens(&self, schema: &ModelSchema, flat: bool) -> usize {
        let (rows, block) = self.sum_over_positions(schema, |_| 1);
        let block = if flat { block.saturating_mul(self.num_samples) } else { block };
        self.num_samples.saturating_add(rows).saturating_add(block)
    }

    /// Memory the sequence values of its rows take once looked up (each
    /// position's FP32 values, [`crate::SequenceFeature::width`]), and
    /// those of its request block (looked up once per request).
    pub fn sequence_value_bytes(&self, schema: &ModelSchema) -> (usize, usize) {
        self.sum_over_positions(schema, |sequence| sequence.width * std::mem::size_of::<f32>())
    }

    /// `per_position(sequence)` summed over every sequence position of its
    /// rows, and of its request block (each position once: counted on its
    /// sequence's first channel); saturating.
    fn sum_over_positions(
        &self,
        schema: &ModelSchema,
        per_position: impl Fn(&SequenceFeature) -> usize,
    ) -> (usize, usize) {
        if schema.sequences.is_empty() {
            return (0, 0);
        }
        let weight = |f: usize| schema.first_channel_of(f).map_or(0, &per_position);
        let (b, num_sparse) = (self.num_samples, schema.num_sparse());
        let rows = self
            .lengths
            .iter()
            .enumerate()
            .map(|(bag, &len)| len as usize * weight(self.layout.bag_position(bag, b, num_sparse).1));
        let block = self.request.iter().flat_map(|block| {
            block.features.iter().zip(&block.lengths).map(|(&f, &len)| len as usize * weight(f))
        });
        (rows.fold(0, usize::saturating_add), block.fold(0, usize::saturating_add))
    }

    /// Checks the rows' sequences' alignment and cuts those longer than
    /// their maximum; returns the positions dropped.
    pub(crate) fn fit_sequences(&mut self, schema: &ModelSchema) -> Result<usize, InvalidInput> {
        if schema.sequences.is_empty() {
            return Ok(0);
        }
        let (b, num_sparse, layout) = (self.num_samples, schema.num_sparse(), self.layout);
        let sequences: Vec<&SequenceFeature> = schema.sequences.iter().collect();
        let bag = move |sample: usize, f: usize| layout.bag_index(sample, f, b, num_sparse);
        let feature = move |bag: usize| layout.bag_position(bag, b, num_sparse).1;
        let place = |sample: usize| format!("sample {sample}");
        let bags =
            BagLayout { samples: b, bag: &bag, feature: &feature, field: InputField::Lengths, place: &place };
        fit_sequences(&sequences, schema, &mut self.lengths, &mut self.ids, &bags)
    }
}

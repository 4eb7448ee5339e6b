//! The request path: [`EngineHandle::predict`] validates a request, cuts
//! it into parts when it has more rows or tokens than one forward may
//! carry, charges its memory (its values, what its rows grow by once
//! fused, and the working set its sequences make the dense network
//! allocate: [`narsil_core::working_set`], held for all the model's
//! requests in flight together by [`crate::working_sets`]), admits it,
//! queues the parts and waits for their answers, its deadline or its queue
//! timeout, whichever comes first. A request whose charge can never fit
//! the memory bound alone is refused naming it.
//!
//! Timers live with the caller: when the queue timeout or the deadline
//! fires, the caller abandons the request's [`Ticket`] and answers
//! DEADLINE_EXCEEDED at once; the lane that later meets the request drops
//! it uncomputed. A caller that goes away (client cancelled) drops its reply
//! channels, which lanes see the same way. When admission is full, queued
//! requests nobody waits for any more are swept out before refusing (only
//! when a caller has stopped waiting since the last sweep).

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{InputField, InvalidInput, RequestSamples};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::waves::{halve_while, plan, Unfit};
use super::EngineHandle;
use crate::admission::{QueueFull, QueueLimit};
use crate::collector::Collector;
use crate::error::EngineError;
use crate::flush::Fill;
use crate::job::{Entry, Prediction, Ticket};
use crate::memory::Lease;
use crate::stats::{Outcome, Stats};

impl EngineHandle {
    /// Validates, admits and queues a request, then waits for its scores.
    /// `lease` is what its decode holds on the memory budget (resized to
    /// the request's decoded bytes; taken from the budget when `None`).
    /// Past `deadline` (or the queue timeout, while it has not started) the
    /// caller gets DeadlineExceeded at once, and a request that had not
    /// started is never computed. Every call is counted by outcome; a call
    /// dropped before its answer counts as cancelled.
    ///
    /// The call runs in a `request` tracing span holding the engine's id for
    /// it; the lane that runs it names the same id when its forward fails.
    pub async fn predict(
        &self,
        request: RequestSamples,
        lease: Option<Lease>,
        deadline: Option<Instant>,
    ) -> Result<Prediction, EngineError> {
        let received = Instant::now();
        let id = self.shared.next_request_id.0.fetch_add(1, Ordering::Relaxed);
        let mut tally = Tally { stats: &self.shared.stats, recorded: false };
        let result =
            self.run(id, request, lease, deadline).instrument(tracing::info_span!("request", id)).await;
        let outcome = match &result {
            Ok(_) => {
                self.shared.stats.request_seconds.observe(received.elapsed().as_secs_f64());
                Outcome::Ok
            }
            Err(EngineError::Invalid(_) | EngineError::NeverFits(_)) => Outcome::Invalid,
            Err(EngineError::Overloaded(_)) => Outcome::Rejected,
            Err(EngineError::DeadlineExceeded) => Outcome::Deadline,
            Err(EngineError::NotReady | EngineError::NoServingVersion(_) | EngineError::ShuttingDown) => {
                Outcome::Unavailable
            }
            Err(EngineError::Backend(_)) => Outcome::BackendError,
        };
        tally.record(outcome);
        result
    }

    async fn run(
        &self,
        id: u64,
        mut request: RequestSamples,
        lease: Option<Lease>,
        deadline: Option<Instant>,
    ) -> Result<Prediction, EngineError> {
        let shared = &self.shared;
        if !self.is_ready() {
            return Err(EngineError::NotReady);
        }
        let validated = request.validate(&shared.schema, shared.limits)?;
        shared.stats.positions_truncated.inc_by(validated.positions_truncated as u64);
        // Parts of at most --max-batch-rows rows and, for a model with
        // sequences, --max-batch-tokens tokens (a row over it alone).
        let schema = &shared.schema;
        let (flat_only, block_bytes) =
            (shared.flat_only, request.request.as_ref().map_or(0, |b| b.decoded_bytes()));
        let block_values = request.stage_value_bytes(schema).1;
        // What each part's rows grow by once fused, the sequence values
        // they look up, and the working set its forward allocates for its
        // sequences (those of the request block, once, stay with the last
        // part, as the block does).
        let working_set = |part: &RequestSamples| part.working_set_bytes(schema, flat_only);
        let charge = |part: &RequestSamples| {
            part.row_bytes()
                .saturating_add(part.fused_growth_bytes(flat_only))
                .saturating_add(part.stage_value_bytes(schema).0)
                .saturating_add(working_set(part))
        };
        // Parts within both budgets, each cut in halves while it is
        // charged more than half the memory bound (a row stays whole).
        let mut parts =
            request.split_tokens(shared.max_batch_rows, shared.max_batch_tokens, schema, flat_only);
        if !schema.sequences.is_empty() {
            parts = halve_while(parts, shared.memory.max() / 2, &charge, schema.num_sparse());
        }
        let shared_bytes = block_bytes.saturating_add(block_values);
        let memory = &shared.memory;
        // Parts are charged and queued in waves within the bound, the next
        // once the last is answered; a part that cannot fit alone is
        // halved until it can, or refused (one row), naming what it needs.
        // Parts of a model with sequences are halved to fit; a grouped
        // request to flat-only lanes of a model without is refused whole
        // (cut, each part would copy its block again: a small message
        // making a forward per candidate).
        let halve = (!schema.sequences.is_empty(), schema.num_sparse());
        let mut plan = match plan(parts, &charge, shared_bytes, memory.max(), halve) {
            Ok(plan) => plan,
            Err((parts, Unfit { part, bytes })) => {
                let working = working_set(&parts[part]);
                let rows = parts[part].num_samples;
                if working > 0 {
                    let part = Footprint { rows, working, bytes };
                    return Err(EngineError::Invalid(never_fits_working_set(
                        part,
                        shared.max_batch_tokens,
                        memory.max(),
                    )));
                }
                if flat_only && parts[part].request.is_some() {
                    let ids = parts[part].request.as_deref().map_or(0, |b| b.ids.len());
                    return Err(EngineError::Invalid(never_fits_flat(ids, rows, bytes, memory.max())));
                }
                let full = QueueFull {
                    limit: QueueLimit::Bytes,
                    queued: memory.used(),
                    max: memory.max(),
                    needed: bytes,
                };
                return Err(EngineError::NeverFits(full));
            }
        };
        // Held until the last wave is answered (every part's forward needs
        // the block): the block with its values, and the rows of the parts
        // not yet queued, given back wave by wave.
        let held = plan.held_after(plan.ends[0], shared_bytes);
        let mut pending = match lease {
            Some(mut lease) => lease.resize(held).map(|()| lease),
            None => memory.try_reserve(held),
        }
        .map_err(EngineError::Overloaded)?;
        let (mut first, mut answered) = (0, Vec::with_capacity(plan.ends.len()));
        let mut parts = std::mem::take(&mut plan.parts).into_iter();
        for (wave, &end) in plan.ends.iter().enumerate() {
            if wave > 0 {
                // This wave's rows are charged with its parts from here on
                // (shrinking always succeeds).
                let _ = pending.resize(plan.held_after(end, shared_bytes));
            }
            let queued: Vec<_> = parts.by_ref().take(end - first).collect();
            answered.push(self.queue(id, queued, &plan.charges[first..end], deadline).await?);
            first = end;
        }
        drop(pending);
        Ok(Prediction::merge(answered))
    }

    /// Charges, admits and queues `parts` (each charged its `charges`:
    /// its working set on the model's working-set lease, the rest on a
    /// lease of its own), then waits for their answers.
    async fn queue(
        &self,
        id: u64,
        parts: Vec<RequestSamples>,
        charges: &[usize],
        deadline: Option<Instant>,
    ) -> Result<Prediction, EngineError> {
        let (shared, memory) = (&self.shared, &self.shared.memory);
        let admitted = Instant::now();
        if deadline.is_some_and(|d| d <= admitted) {
            return Err(EngineError::DeadlineExceeded);
        }
        let (schema, flat_only) = (&shared.schema, shared.flat_only);
        let units: Vec<_> = parts.iter().map(|part| part.units(schema, flat_only)).collect();
        let fills: Vec<Fill> = parts
            .iter()
            .map(|part| Fill { requests: 1, rows: part.num_samples, tokens: part.tokens(schema, flat_only) })
            .collect();
        let working: Vec<usize> = units
            .iter()
            .map(|units| {
                narsil_core::working_set::summed(
                    schema.sequences.iter().map(narsil_core::SequenceFeature::working_set),
                    units,
                )
            })
            .collect();
        let charges: Vec<usize> = charges.iter().zip(&working).map(|(c, w)| c.saturating_sub(*w)).collect();
        let bytes = charges.iter().fold(0usize, |a, &c| a.saturating_add(c));
        let mut lease = memory.try_reserve(bytes).map_err(EngineError::Overloaded)?;
        let shares = match &shared.working_sets {
            Some(sets) => units
                .iter()
                .zip(&fills)
                .zip(&working)
                .map(|((units, &fill), &bytes)| sets.hold(units, fill, bytes).map(Some))
                .collect::<Result<Vec<_>, _>>()
                .map_err(EngineError::Overloaded)?,
            None => units.iter().map(|_| None).collect(),
        };
        let rows = parts.iter().map(|p| p.num_samples).sum();
        let mut permit = match shared.admission.try_admit(rows, bytes) {
            Ok(permit) => permit,
            // Full: free the places of requests nobody waits for (if any
            // caller left since the last sweep), then retry once.
            Err(_) if shared.collector.sweep() > 0 => {
                shared.admission.try_admit(rows, bytes).map_err(EngineError::Overloaded)?
            }
            Err(full) => return Err(EngineError::Overloaded(full)),
        };
        let queue_deadline = shared.queue_timeout.map(|t| admitted + t);
        let expires = deadline.into_iter().chain(queue_deadline).min();
        let ticket = Ticket::new();
        // Each part frees its rows when it starts, and its bytes when its
        // forward ends; the last also frees the request's place.
        let last = parts.len() - 1;
        let mut permits: Vec<_> = parts[..last].iter().map(|p| permit.split_off(p.num_samples)).collect();
        permits.push(permit);
        // Each part holds its rows and what they grow by once fused, and
        // its share of the working set (the block, shared by every part, is
        // held by the caller until the last wave is answered).
        let mut leases: Vec<_> = charges[..last].iter().map(|&charge| lease.split_off(charge)).collect();
        leases.push(lease);
        let (entries, answers): (Vec<_>, Vec<_>) = parts
            .into_iter()
            .zip(permits.into_iter().zip(leases))
            .zip(units.into_iter().zip(shares).zip(fills))
            .map(|((part, (permit, lease)), ((units, working), fill))| {
                let (reply, answer) = oneshot::channel();
                let ticket = Arc::clone(&ticket);
                let entry = Entry {
                    id,
                    rows: fill.rows,
                    tokens: fill.tokens,
                    lease,
                    units,
                    working,
                    reply,
                    admitted,
                    expires,
                    deadline,
                    ticket,
                    permit,
                };
                ((entry, part), answer)
            })
            .unzip();
        shared.collector.submit(entries)?;
        // Until every answer is in, leaving (timer, cancelled call) leaves
        // the request queued for a sweep to free.
        let mut leaving = StaleOnLeave { collector: &shared.collector, armed: true };
        let answers = async move {
            let mut parts = Vec::with_capacity(answers.len());
            for answer in answers {
                parts.push(answer.await.unwrap_or(Err(EngineError::ShuttingDown))?);
            }
            Ok(Prediction::merge(parts))
        };
        let result = wait(answers, &ticket, queue_deadline, deadline).await;
        leaving.armed = matches!(result, Err(EngineError::DeadlineExceeded));
        result
    }
}

/// What a part of a request would hold once admitted, for a refusal.
struct Footprint {
    /// Its rows.
    rows: usize,
    /// The working set its forward allocates for its sequences.
    working: usize,
    /// Everything it would be charged, with what is held beside it.
    bytes: usize,
}

/// Why a request can never be admitted: a part of it (cut to at most
/// `max_tokens` tokens, or a row alone) needs more than the memory bound
/// `max`, with the working set its sequences make the dense network
/// allocate.
fn never_fits_working_set(part: Footprint, max_tokens: usize, max: usize) -> InvalidInput {
    let Footprint { rows, working, bytes } = part;
    InvalidInput::new(
        InputField::Message,
        format!(
            "a part of {rows} row(s) needs {bytes} bytes, more than the server's memory bound of {max} bytes \
             (--max-queue-bytes): the model's dense network allocates {working} bytes of working set for its \
             sequences; a request is cut into parts of at most {max_tokens} tokens (--max-batch-tokens) or one \
             row, queued in turn; send shorter histories"
        ),
    )
}

/// Why a grouped request of `rows` candidates and `ids` request-level ids
/// can never be admitted by lanes that take only flat batches: with its
/// block copied into every row it needs `bytes`, more than the memory
/// bound `max`.
fn never_fits_flat(ids: usize, rows: usize, bytes: usize, max: usize) -> InvalidInput {
    InvalidInput::new(
        InputField::Request,
        format!(
            "this model's lanes take only flat batches (a single-file model, Burn or the mock; a split model pools \
             the block once), so its {ids} request-level ids are copied into each of its {} candidate rows: {bytes} \
             bytes, more than the server's memory bound of {max} bytes (--max-queue-bytes); send fewer candidates \
             or request-level ids per request",
            rows
        ),
    )
}

/// Tells the collector a caller stopped waiting for its queued request,
/// unless disarmed because every answer came.
struct StaleOnLeave<'a> {
    collector: &'a Collector,
    armed: bool,
}

impl Drop for StaleOnLeave<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.collector.mark_stale();
        }
    }
}

/// Counts a call's outcome exactly once; a call dropped before recording one
/// (its client went away) counts as cancelled.
struct Tally<'a> {
    stats: &'a Stats,
    recorded: bool,
}

impl Tally<'_> {
    fn record(&mut self, outcome: Outcome) {
        self.stats.record(outcome);
        self.recorded = true;
    }
}

impl Drop for Tally<'_> {
    fn drop(&mut self) {
        if !self.recorded {
            self.stats.record(Outcome::Cancelled);
        }
    }
}

/// Waits for a request's answers. At the queue deadline it gives up if no
/// part has started; at the caller's deadline it gives up regardless, and
/// parts not yet started are never computed.
async fn wait(
    answers: impl Future<Output = Result<Prediction, EngineError>>,
    ticket: &Ticket,
    queue_deadline: Option<Instant>,
    deadline: Option<Instant>,
) -> Result<Prediction, EngineError> {
    tokio::pin!(answers);
    if let Some(queue_deadline) = queue_deadline.filter(|&q| deadline.is_none_or(|d| q < d)) {
        tokio::select! {
            biased;
            answer = &mut answers => return answer,
            () = tokio::time::sleep_until(queue_deadline.into()) => {
                if ticket.abandon() {
                    return Err(EngineError::DeadlineExceeded);
                }
            }
        }
    }
    match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline.into(), answers).await {
            Ok(answer) => answer,
            Err(_) => {
                ticket.abandon();
                Err(EngineError::DeadlineExceeded)
            }
        },
        None => answers.await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use narsil_core::working_set::{Unit, WorkingSet};
    use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};

    use super::*;
    use crate::lanes::fixtures::config;
    use crate::{Engine, EngineConfig, MemoryBudget};

    /// Answers every forward after its delay.
    struct Answers(Duration);

    impl ModelBackend for Answers {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            std::thread::sleep(self.0);
            Ok(vec![0.5; batch.rows])
        }
    }

    /// Lanes that pool request-level blocks once (a split model's), or
    /// that take only flat batches; each forward takes `delay`.
    struct GroupedFactory {
        schema: ModelSchema,
        takes_request_level: bool,
        delay: Duration,
    }

    impl BackendFactory for GroupedFactory {
        fn schema(&self) -> &ModelSchema {
            &self.schema
        }

        fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
            Ok(Box::new(Answers(self.delay)))
        }

        fn takes_request_level(&self) -> bool {
            self.takes_request_level
        }
    }

    /// `candidates` rows of the one candidate feature (cat_1) and a block
    /// of `ids` ids of cat_0, request-level.
    fn grouped(candidates: usize, ids: usize) -> RequestSamples {
        RequestSamples {
            num_samples: candidates,
            dense: vec![0.5; candidates],
            ids: vec![1; candidates],
            request: Some(Arc::new(narsil_core::RequestBlock {
                lengths: vec![ids as u32],
                ids: vec![2; ids],
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    async fn grouped_engine(takes_request_level: bool, budget: usize) -> (Engine, MemoryBudget) {
        let mut schema = ModelSchema::dlrm("test", "cpu", 1000);
        schema.num_dense = 1;
        schema.sparse.truncate(2);
        let memory = MemoryBudget::new(budget);
        let config = EngineConfig {
            request_level: Some(vec!["cat_0".into()]),
            memory: memory.clone(),
            ..config(false)
        };
        let factory = GroupedFactory { schema, takes_request_level, delay: Duration::ZERO };
        let engine = Engine::start(Arc::new(factory), config).unwrap();
        engine.handle().wait_ready().await.unwrap();
        (engine, memory)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grouped_request_is_charged_its_copy_per_row_where_lanes_take_only_flat_batches() {
        // 64 candidates x 10,000 ids x 12 bytes: 7.7 MB once made flat,
        // 80 kB as sent.
        let (flat_only, memory) = grouped_engine(false, 4 << 20).await;
        let error = flat_only.handle().predict(grouped(64, 10_000), None, None).await.unwrap_err();
        let EngineError::Invalid(invalid) = &error else { panic!("{error:?}") };
        assert_eq!(invalid.field, InputField::Request);
        for words in
            ["take only flat batches", "10000 request-level ids", "64 candidate rows", "--max-queue-bytes"]
        {
            assert!(invalid.message.contains(words), "{words:?} in {invalid}");
        }
        assert_eq!(memory.used(), 0, "refused before any lease");
        // A smaller one fits, and held its copy's bytes while it ran.
        let request = grouped(8, 10_000);
        let charged = request.decoded_bytes() + 8 * 10_000 * 12 + 8 * 4;
        flat_only.handle().predict(request, None, None).await.unwrap();
        assert!(memory.peak() >= charged, "peak {} of {charged} charged", memory.peak());
        // Lanes that pool the block once are charged the block once.
        let (pooled, memory) = grouped_engine(true, 4 << 20).await;
        pooled.handle().predict(grouped(64, 10_000), None, None).await.unwrap();
        assert!(memory.peak() < 200_000, "peak {}", memory.peak());
    }

    /// A model whose one sequence (cat_1, per row, at most 64 positions)
    /// makes its network gather 1,000 values per row and position.
    async fn sequence_engine(budget: usize, max_batch_tokens: usize) -> (Engine, MemoryBudget) {
        let gather = WorkingSet::Gather { width: 1000, position_width: 0, bytes_per_value: 4 };
        working_set_engine(gather, budget, max_batch_tokens, Duration::ZERO).await
    }

    /// A model whose one sequence (cat_1, per row, at most 64 positions)
    /// makes its network hold `working_set`, its forwards taking `delay`.
    async fn working_set_engine(
        working_set: WorkingSet,
        budget: usize,
        max_batch_tokens: usize,
        delay: Duration,
    ) -> (Engine, MemoryBudget) {
        let mut schema = ModelSchema::dlrm("test", "cpu", 1000);
        schema.num_dense = 1;
        schema.sparse.truncate(2);
        let mut history = narsil_core::SequenceFeature::new(
            "h",
            &["cat_1".into()],
            64,
            narsil_core::KeepEnd::Last,
            &schema,
            &[],
        )
        .unwrap();
        history.working_set = Some(working_set);
        schema.sequences = vec![history];
        let memory = MemoryBudget::new(budget);
        let config = EngineConfig { memory: memory.clone(), max_batch_tokens, ..config(false) };
        let factory = GroupedFactory { schema, takes_request_level: true, delay };
        let engine = Engine::start(Arc::new(factory), config).unwrap();
        engine.handle().wait_ready().await.unwrap();
        (engine, memory)
    }

    /// `rows` flat rows, each with a history of 64 positions.
    fn histories(rows: usize) -> RequestSamples {
        RequestSamples {
            num_samples: rows,
            dense: vec![0.5; rows],
            lengths: [1, 64].repeat(rows),
            ids: (0..rows).flat_map(|_| std::iter::repeat_n(3, 65)).collect(),
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sequence_requests_working_set_is_charged_in_waves_and_a_row_that_never_fits_is_refused() {
        // A row's working set: 64 positions x (1,000 x 4 + 9) bytes, 257 kB.
        let per_row = 64 * (1000 * 4 + 9);
        let (engine, memory) = sequence_engine(8 << 20, 130).await;
        // 16 rows: 4.1 MB of working set, cut into parts of 2 rows (130
        // tokens), every row scored. A part fills a forward's tokens, and
        // one lane runs one forward at a time: the parts in flight hold
        // one part's working set, not their sum.
        let prediction = engine.handle().predict(histories(16), None, None).await.unwrap();
        assert_eq!(prediction.outputs[0].len(), 16);
        assert!(prediction.forwards >= 8, "{} forwards for 8 parts", prediction.forwards);
        assert!(memory.peak() >= 2 * per_row, "peak {} of a part's {} charged", memory.peak(), 2 * per_row);
        assert!(memory.peak() < 4 * per_row, "peak {}: not each part's own", memory.peak());
        assert_eq!(memory.used(), 0, "every part's charge returned");
        // 60 rows: 15.4 MB, more than the 8 MiB bound: queued in waves,
        // never holding more than the bound.
        let prediction = engine.handle().predict(histories(60), None, None).await.unwrap();
        assert_eq!(prediction.outputs[0].len(), 60);
        assert!(memory.peak() <= 8 << 20, "peak {}", memory.peak());
        // A bound one row cannot fit: refused, naming what it needs.
        let (engine, memory) = sequence_engine(200_000, 130).await;
        let error = engine.handle().predict(histories(3), None, None).await.unwrap_err();
        let EngineError::Invalid(invalid) = &error else { panic!("{error:?}") };
        assert_eq!(invalid.field, InputField::Message);
        for words in [
            "a part of 1 row(s)",
            "200000 bytes (--max-queue-bytes)",
            &format!("{per_row} bytes of working set"),
            "130 tokens (--max-batch-tokens)",
        ] {
            assert!(invalid.message.contains(words), "{words:?} in {invalid}");
        }
        assert_eq!(memory.used(), 0, "refused before any lease");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_requests_of_a_unit_by_unit_network_hold_one_batchs_working_set_not_each_their_own() {
        // GR's TorchScript form at a small shape: units in groups of at
        // most 130 positions and rows, so a batch holds two rows' states
        // at a time however many requests it fuses.
        let units = WorkingSet::UnitAttention {
            block: 64,
            heads: 4,
            head_dim: 64,
            contexts: 0,
            model_dim: 256,
            group_tokens: 130,
            bytes_per_value: 4,
        };
        let own = units.bytes(&[Unit { positions: 64, rows: 1 }; 2]);
        let peak = eight_in_flight(units, own, 1 << 20).await;
        // Eight in flight at once held one batch's bound, with their rows.
        let bound = units.batch_bound(&[Unit { positions: 64, rows: 1 }; 16]);
        assert!(peak >= bound, "peak {peak} under one batch's {bound}");
        assert!(peak < 2 * own, "peak {peak} of {own} a request");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_requests_that_each_fill_a_forward_hold_one_forwards_working_set_not_each_their_own() {
        // A gather (DIN's kind: a batch holds its requests' sum) whose
        // requests of 2 rows x 64 positions fill a forward's 130 tokens.
        let gather = WorkingSet::Gather { width: 1000, position_width: 0, bytes_per_value: 4 };
        let own = gather.bytes(&[Unit { positions: 64, rows: 1 }; 2]);
        let peak = eight_in_flight(gather, own, 130).await;
        assert!(peak >= own, "peak {peak} under a request's {own}");
        assert!(peak < 2 * own, "peak {peak} of {own} a request");
    }

    /// Eight requests of 2 rows with 64-position histories in flight at
    /// once (forwards of 150 ms) under a bound of four and a half of their
    /// own working sets (`own`): every one served, the lease given back.
    /// Returns the budget's peak.
    async fn eight_in_flight(kind: WorkingSet, own: usize, max_batch_tokens: usize) -> usize {
        let (engine, memory) =
            working_set_engine(kind, 4 * own + own / 2, max_batch_tokens, Duration::from_millis(150)).await;
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let handle = engine.handle();
                tokio::spawn(async move { handle.predict(histories(2), None, None).await })
            })
            .collect();
        for call in calls {
            let prediction = call.await.unwrap().unwrap();
            assert_eq!(prediction.outputs[0].len(), 2);
        }
        assert_eq!(memory.used(), 0, "every share returned");
        memory.peak()
    }
}

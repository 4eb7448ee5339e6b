//! Request memory is reserved before a message is buffered and decoded.
//!
//! A layer in front of every service wraps each call's request body. When
//! the message's 5-byte gRPC frame header arrives, before its payload is
//! buffered, the body reserves on the process's [`MemoryBudget`] the most
//! the message can take while it is received and decoded
//! ([`decode_reservation`]: its encoded size plus its values decoded, at the
//! method's worst expansion, which each protocol declares:
//! [`ServedProtocol::decode_expansion`]). A reservation that does not fit ends the call
//! at once with RESOURCE_EXHAUSTED naming `--max-queue-bytes`: the payload is
//! never buffered. A reservation that fits is a [`Lease`] left for the
//! call's handler ([`take_lease`]), which hands it to the engine: it shrinks
//! to the request's decoded bytes and is held until its forward ends.
//!
//! The lease travels from the body to the handler in a task-local slot the
//! layer opens around each call: tonic reads a unary call's body inside the
//! call's own future. A lease nobody takes is returned when the call ends.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use narsil_engine::{decode_reservation, Lease, MemoryBudget};
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{Bytes, Service};
use tonic::Status;

use super::ServedProtocol;
use crate::lifecycle::ModelRegistry;

tokio::task_local! {
    static RECEIVED: RefCell<Option<Lease>>;
}

/// The lease reserved while this call's message arrived, if any (once).
pub fn take_lease() -> Option<Lease> {
    RECEIVED.try_with(|slot| slot.borrow_mut().take()).ok().flatten()
}

/// The layer, for `tonic::transport::Server::builder().layer(…)`.
#[derive(Clone)]
pub struct MemoryLayer {
    budget: MemoryBudget,
    models: Arc<ModelRegistry>,
    expansion: Arc<DecodeExpansion>,
}

/// Worst-case decoded bytes per encoded byte, by method path, as each
/// protocol declares them ([`ServedProtocol::decode_expansion`]).
struct DecodeExpansion(HashMap<String, usize>);

impl DecodeExpansion {
    fn of(protocols: &[ServedProtocol]) -> Self {
        let methods = protocols.iter().flat_map(|protocol| {
            protocol
                .decode_expansion
                .iter()
                .map(|(method, x)| (format!("/{}/{method}", protocol.service), *x))
        });
        Self(methods.collect())
    }

    /// Decoded bytes per encoded byte of a call to `path`: what its protocol
    /// declared, or 0 (held to its encoded size) for methods that take small
    /// messages.
    fn get(&self, path: &str) -> usize {
        self.0.get(path).copied().unwrap_or(0)
    }
}

impl MemoryLayer {
    /// Reserves on `budget` for the methods of `protocols`; refusals are
    /// counted in `models`' metrics.
    pub fn new(budget: MemoryBudget, models: Arc<ModelRegistry>, protocols: &[ServedProtocol]) -> Self {
        Self { budget, models, expansion: Arc::new(DecodeExpansion::of(protocols)) }
    }
}

impl<S> tower::Layer<S> for MemoryLayer {
    type Service = MemoryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MemoryService { inner, layer: self.clone() }
    }
}

/// [`MemoryLayer`]'s service.
#[derive(Clone)]
pub struct MemoryService<S> {
    inner: S,
    layer: MemoryLayer,
}

impl<S, B> Service<Request<Body>> for MemoryService<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let expansion = self.layer.expansion.get(request.uri().path());
        let layer = self.layer.clone();
        let request = request
            .map(|body| Body::new(Reserving { inner: body, header: [0; HEADER], seen: 0, expansion, layer }));
        Box::pin(RECEIVED.scope(RefCell::new(None), self.inner.call(request)))
    }
}

/// A request body that reserves its message's memory once the frame
/// header says how long the message is.
struct Reserving {
    inner: Body,
    /// The frame header's bytes, as they arrive.
    header: [u8; HEADER],
    /// How many of them arrived (the reservation is made at `HEADER`).
    seen: usize,
    expansion: usize,
    layer: MemoryLayer,
}

const HEADER: usize = 5;

impl Reserving {
    /// Notes the frame's first bytes; once the header is complete, reserves.
    fn observe(&mut self, data: &Bytes) -> Result<(), Status> {
        if self.seen >= HEADER {
            return Ok(());
        }
        let taken = (HEADER - self.seen).min(data.len());
        self.header[self.seen..self.seen + taken].copy_from_slice(&data[..taken]);
        self.seen += taken;
        if self.seen < HEADER {
            return Ok(());
        }
        let [_, length @ ..] = self.header;
        let encoded = u32::from_be_bytes(length) as usize;
        let bytes = decode_reservation(encoded, self.expansion, &self.layer.budget);
        match self.layer.budget.try_reserve(bytes) {
            Ok(lease) => {
                // Outside a call's scope (never in the server) the lease is
                // simply returned.
                let _ = RECEIVED.try_with(|slot| *slot.borrow_mut() = Some(lease));
                Ok(())
            }
            Err(full) => Err(super::status::to_status(
                self.layer.models.refuse_overloaded(full),
                narsil_core::InputField::name,
            )),
        }
    }
}

impl tonic::codegen::Body for Reserving {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                if let Err(status) = self.observe(data) {
                    return Poll::Ready(Some(Err(status)));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::DecodeExpansion;
    use crate::protocols::PROTOCOLS;

    #[test]
    fn prediction_methods_reserve_their_worst_expansion_and_others_their_size() {
        let expansion = DecodeExpansion::of(&PROTOCOLS);
        assert_eq!(expansion.get("/narsil.v1.Predictor/Predict"), 8);
        assert_eq!(expansion.get("/inference.GRPCInferenceService/ModelInfer"), 8);
        assert_eq!(expansion.get("/predictor.Predictor/Predict"), 2);
        assert_eq!(expansion.get("/grpc.health.v1.Health/Check"), 0);
    }

    #[test]
    fn every_protocol_declares_the_expansion_of_a_method_that_carries_requests() {
        for protocol in PROTOCOLS {
            assert!(
                protocol.decode_expansion.iter().any(|(_, x)| *x > 0),
                "{} declares no method whose messages the memory bound expands",
                protocol.service
            );
        }
    }
}

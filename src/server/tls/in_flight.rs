//! The handshakes in flight on one listener, and the shedding that keeps
//! them bounded without ever refusing a new connection: a new one that
//! finds [`MAX_HANDSHAKES_PER_PEER`] of its peer's in flight (its IPv4
//! address, or its IPv6 /64) drops one of that peer's, and one that finds
//! [`MAX_HANDSHAKES`] in flight drops one of the listener's: each time the
//! one that has gone longest without progress ([`super::shedding`]). A
//! client sends its ClientHello with its first packet and completes its
//! handshake in a few round trips, so it never goes long without progress;
//! a flood of connections that send nothing, half a ClientHello, or a
//! whole one and then nothing, loses its own first. The listener keeps
//! accepting whatever the flood.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

use super::shedding::{Caps, Handshakes, Shedding};

/// Handshakes in flight at once on one listener; a new connection past it
/// sheds the one longest without progress.
pub const MAX_HANDSHAKES: usize = 1024;

/// Handshakes in flight at once from one peer (an IPv4 address, an IPv6
/// /64) on one listener; a new connection from that peer past it sheds the
/// peer's longest without progress.
pub const MAX_HANDSHAKES_PER_PEER: usize = 256;

/// One listener's handshakes in flight.
pub(crate) struct InFlight {
    state: Mutex<State>,
    gauge: Gauge,
}

struct State {
    handshakes: Handshakes,
    /// Each handshake's; dropping it sheds the handshake.
    shed: HashMap<u64, oneshot::Sender<()>>,
}

/// A handshake's place among those in flight: [`Ticket::shed`] resolves
/// when it is shed.
pub(crate) struct Ticket {
    pub place: Place,
    pub shed: oneshot::Receiver<()>,
}

/// Dropping it (the handshake ended) gives the place up.
pub(crate) struct Place {
    id: u64,
    in_flight: Arc<InFlight>,
}

impl Place {
    /// Its whole ClientHello arrived at `now`: it goes behind every
    /// handshake that has not progressed since.
    pub fn hello_received(&self, now: Instant) {
        self.in_flight.lock().handshakes.progressed(self.id, now);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut state = self.in_flight.lock();
        state.handshakes.remove(self.id);
        state.shed.remove(&self.id);
        self.in_flight.gauge.set(state.handshakes.len() as i64);
    }
}

impl InFlight {
    /// At most [`MAX_HANDSHAKES`], [`MAX_HANDSHAKES_PER_PEER`] from one
    /// peer; their count in `gauge`.
    pub fn new(gauge: Gauge) -> Arc<Self> {
        Self::with_caps(Caps { total: MAX_HANDSHAKES, per_peer: MAX_HANDSHAKES_PER_PEER }, gauge)
    }

    fn with_caps(caps: Caps, gauge: Gauge) -> Arc<Self> {
        let state = State { handshakes: Handshakes::new(caps), shed: HashMap::new() };
        Arc::new(Self { state: Mutex::new(state), gauge })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a handshake from `peer` accepted at `now`, shedding what the
    /// caps say to make room; its ticket, and what was shed.
    pub fn admit(self: &Arc<Self>, peer: IpAddr, now: Instant) -> (Ticket, Vec<Shedding>) {
        let mut state = self.lock();
        let (id, shed) = state.handshakes.admit(peer, now);
        for victim in &shed {
            // Dropping its sender resolves its ticket's receiver.
            state.shed.remove(&victim.id);
        }
        let (sender, receiver) = oneshot::channel();
        state.shed.insert(id, sender);
        self.gauge.set(state.handshakes.len() as i64);
        drop(state);
        (Ticket { place: Place { id, in_flight: Arc::clone(self) }, shed: receiver }, shed)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot::error::TryRecvError;

    use super::*;
    use crate::server::tls::shedding::Cap;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn in_flight(total: usize, per_peer: usize) -> Arc<InFlight> {
        InFlight::with_caps(Caps { total, per_peer }, Gauge::default())
    }

    #[test]
    fn the_shed_handshake_s_ticket_resolves_and_the_others_stay_open() {
        let (t, in_flight) = (Instant::now(), in_flight(3, 3));
        let mut tickets: Vec<Ticket> = (1..=3).map(|n| in_flight.admit(ip(n), t).0).collect();
        tickets[0].place.hello_received(t + Duration::from_millis(5));
        let (newest, shed) = in_flight.admit(ip(4), t + Duration::from_millis(10));
        assert_eq!(shed.iter().map(|s| s.cap).collect::<Vec<_>>(), vec![Cap::Listener]);
        assert_eq!(tickets[1].shed.try_recv(), Err(TryRecvError::Closed));
        for n in [0, 2] {
            assert_eq!(tickets[n].shed.try_recv(), Err(TryRecvError::Empty), "ticket {n}");
        }
        assert_eq!(in_flight.gauge.get(), 3);
        drop(newest);
        assert_eq!(in_flight.gauge.get(), 2);
    }

    #[test]
    fn a_finished_handshake_gives_its_place_up_and_is_never_shed_later() {
        let (t, in_flight) = (Instant::now(), in_flight(2, 2));
        let first = in_flight.admit(ip(1), t).0;
        let mut second = in_flight.admit(ip(1), t).0;
        drop(first);
        let (_third, shed) = in_flight.admit(ip(2), t);
        assert!(shed.is_empty(), "{shed:?}");
        assert_eq!(second.shed.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(in_flight.lock().shed.len(), 2);
        assert_eq!(in_flight.gauge.get(), 2);
    }
}

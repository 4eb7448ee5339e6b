//! The handshakes in flight on one listener, oldest first, and the shedding
//! that keeps them bounded without ever refusing a new connection: a new
//! one that finds [`MAX_HANDSHAKES_PER_PEER`] of its peer's address in
//! flight drops one of that address's, and one that finds
//! [`MAX_HANDSHAKES`] in flight drops one of the listener's: the oldest of
//! those still waiting for their whole ClientHello, or the oldest of all
//! if every one has sent its own. A client sends its ClientHello with its
//! first packet and completes its handshake in a few round trips, so it is
//! never the oldest for long; a flood of connections that send nothing
//! (or too little) loses its own first. The listener keeps accepting
//! whatever the flood.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

/// Handshakes in flight at once on one listener; a new connection past it
/// sheds the oldest.
pub const MAX_HANDSHAKES: usize = 1024;

/// Handshakes in flight at once from one peer address on one listener; a
/// new connection from that address past it sheds the address's oldest.
pub const MAX_HANDSHAKES_PER_PEER: usize = 256;

/// Why a handshake in flight was dropped to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shed {
    /// The oldest of the listener ([`MAX_HANDSHAKES`]).
    Oldest,
    /// The oldest of its peer address ([`MAX_HANDSHAKES_PER_PEER`]).
    Peer,
}

/// One listener's handshakes in flight.
pub(crate) struct InFlight {
    limits: (usize, usize),
    state: Mutex<State>,
    gauge: Gauge,
}

#[derive(Default)]
struct State {
    next: u64,
    /// By admission order; dropping the sender sheds the handshake.
    by_age: BTreeMap<u64, (IpAddr, oneshot::Sender<()>)>,
    /// Those still waiting for their whole ClientHello.
    waiting: BTreeSet<u64>,
    by_peer: HashMap<IpAddr, BTreeSet<u64>>,
}

impl State {
    /// Forgets handshake `id`: its sender is dropped (it is shed) if it
    /// was still in flight.
    fn remove(&mut self, id: u64) {
        let Some((peer, _shed)) = self.by_age.remove(&id) else { return };
        self.waiting.remove(&id);
        if let Some(ids) = self.by_peer.get_mut(&peer) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_peer.remove(&peer);
            }
        }
    }

    /// Which of `ids` (oldest first) to shed: the oldest still waiting for
    /// its ClientHello, else the oldest.
    fn victim<'a>(waiting: &BTreeSet<u64>, mut ids: impl Iterator<Item = &'a u64> + Clone) -> Option<u64> {
        ids.clone().find(|id| waiting.contains(id)).or_else(|| ids.next()).copied()
    }
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
    /// Its whole ClientHello arrived: it is shed after every handshake still
    /// waiting for its own.
    pub fn hello_received(&self) {
        self.in_flight.lock().waiting.remove(&self.id);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut state = self.in_flight.lock();
        state.remove(self.id);
        self.in_flight.gauge.set(state.by_age.len() as i64);
    }
}

impl InFlight {
    /// At most [`MAX_HANDSHAKES`], [`MAX_HANDSHAKES_PER_PEER`] from one
    /// address; their count in `gauge`.
    pub fn new(gauge: Gauge) -> Arc<Self> {
        Self::with_limits(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER, gauge)
    }

    fn with_limits(total: usize, per_peer: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(Self { limits: (total.max(1), per_peer.max(1)), state: Mutex::default(), gauge })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a handshake from `peer`, shedding what the limits say to make
    /// room; its ticket, and what was shed.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> (Ticket, Vec<Shed>) {
        let peer = peer.to_canonical();
        let (total, per_peer) = self.limits;
        let mut shed = Vec::new();
        let mut state = self.lock();
        let full = |ids: &&BTreeSet<u64>| ids.len() >= per_peer;
        let peer_victim =
            state.by_peer.get(&peer).filter(full).and_then(|ids| State::victim(&state.waiting, ids.iter()));
        if let Some(victim) = peer_victim {
            state.remove(victim);
            shed.push(Shed::Peer);
        }
        if state.by_age.len() >= total {
            if let Some(victim) = State::victim(&state.waiting, state.by_age.keys()) {
                state.remove(victim);
                shed.push(Shed::Oldest);
            }
        }
        let id = state.next;
        state.next += 1;
        let (sender, receiver) = oneshot::channel();
        state.by_age.insert(id, (peer, sender));
        state.waiting.insert(id);
        state.by_peer.entry(peer).or_default().insert(id);
        self.gauge.set(state.by_age.len() as i64);
        drop(state);
        (Ticket { place: Place { id, in_flight: Arc::clone(self) }, shed: receiver }, shed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn past_the_cap_the_oldest_is_shed_and_the_newest_admitted() {
        let in_flight = InFlight::with_limits(3, 3, Gauge::default());
        let mut tickets: Vec<Ticket> = (1..=3).map(|n| in_flight.admit(ip(n)).0).collect();
        let (newest, shed) = in_flight.admit(ip(4));
        assert_eq!(shed, vec![Shed::Oldest]);
        assert_eq!(tickets[0].shed.try_recv(), Err(oneshot::error::TryRecvError::Closed));
        for ticket in &mut tickets[1..] {
            assert_eq!(ticket.shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        }
        assert_eq!(in_flight.gauge.get(), 3);
        drop(newest);
        assert_eq!(in_flight.gauge.get(), 2);
    }

    #[test]
    fn a_peer_past_its_own_cap_sheds_its_own_oldest_never_another_s() {
        let in_flight = InFlight::with_limits(10, 2, Gauge::default());
        let mut other = in_flight.admit(ip(9)).0;
        let mut flood: Vec<Ticket> = (0..2).map(|_| in_flight.admit(ip(1)).0).collect();
        let (_third, shed) = in_flight.admit(ip(1));
        assert_eq!(shed, vec![Shed::Peer]);
        assert_eq!(flood[0].shed.try_recv(), Err(oneshot::error::TryRecvError::Closed));
        assert_eq!(flood[1].shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        assert_eq!(other.shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        assert_eq!(in_flight.gauge.get(), 3);
    }

    #[test]
    fn a_finished_handshake_gives_its_place_up_and_is_never_shed_later() {
        let in_flight = InFlight::with_limits(2, 2, Gauge::default());
        let first = in_flight.admit(ip(1)).0;
        let mut second = in_flight.admit(ip(1)).0;
        drop(first);
        let (_third, shed) = in_flight.admit(ip(2));
        assert!(shed.is_empty(), "{shed:?}");
        assert_eq!(second.shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        assert!(in_flight.lock().by_peer.get(&ip(1)).is_some_and(|ids| ids.len() == 1));
    }

    #[test]
    fn those_still_waiting_for_their_client_hello_are_shed_before_older_ones_that_sent_it() {
        let in_flight = InFlight::with_limits(3, 3, Gauge::default());
        let mut client = in_flight.admit(ip(1)).0;
        client.place.hello_received();
        let mut silent: Vec<Ticket> = (0..2).map(|_| in_flight.admit(ip(2)).0).collect();
        let (_newest, shed) = in_flight.admit(ip(3));
        assert_eq!(shed, vec![Shed::Oldest]);
        assert_eq!(client.shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        assert_eq!(silent[0].shed.try_recv(), Err(oneshot::error::TryRecvError::Closed));
        assert_eq!(silent[1].shed.try_recv(), Err(oneshot::error::TryRecvError::Empty));
    }
}
